"""`mlxspec bench --real-shapes SHAPE --sharded`: the benchmark of a target sharded over the
ranks of an mlx.launch run (measured on two GPUs, docs/distributed.md), here on one CPU
process: its baseline is stock mlx-lm in the bench's own process once mlxspec's kernels are
taken out and its tape classes set back (a planted kernel left in is caught), mlxspec's cells
run with the kernels in, a head split over the vocabulary scripts its own slice, every cell
follows its script. (`mlx.launch` runs of the engine itself: tests/test_distributed.py.)"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mlxspec import cli
from mlxspec.bench import real_sharded as rs
from mlxspec.bench.scripted import HOT, ScriptedLogits


class _Rank:  # the group a head split by mlx-lm's shard() keeps: only its rank is read
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("rank", [0, 1])
def test_a_head_split_over_the_vocabulary_scripts_its_own_slice(rank):
    import mlx.core as mx

    from mlxspec.bench.synthetic import random_model

    model = random_model("smoke-hybrid", bits=0, kernels=False)  # vocabulary 1024, untied head
    model.language_model.sharding_group = _Rank(rank, 2)  # as qwen3_5's shard() marks its split head
    script = ScriptedLogits(model, [5, 7, 700, 9])  # position p's row scripts table[p + 1]
    script.pending = (0, 3, None, mx.zeros((1, 3), mx.uint32))  # rows at positions 0, 1, 2
    slice_logits = mx.zeros((1, 3, 512))  # this rank's half of the vocabulary
    hot = script.replace(slice_logits)
    want = [t - 512 * rank for t in (7, 700, 9)]  # the ids of this slice
    got = [[i for i, v in enumerate(row) if v == HOT] for row in hot[0].tolist()]
    assert got == [[w] if 0 <= w < 512 else [] for w in want]


def test_the_baseline_gets_mlx_lms_layers_back_after_the_engine_taped_them():
    import mlx.core as mx

    from mlxspec.bench.stock_evidence import evidence
    from mlxspec.bench.synthetic import random_model
    from mlxspec.engine.speculate import SpeculativeDecoder

    model = random_model("smoke-hybrid", bits=0, kernels=False)
    ScriptedLogits(model, list(range(1, 40)))
    for _ in SpeculativeDecoder(model, drafter="pld", cost=None).generate(list(range(1, 12)), max_tokens=4):
        pass
    mx.eval(mx.zeros(1))
    # PLANTED: the baseline run on the engine's taped GatedDeltaNet layers is caught
    assert not rs.stock_ok(evidence([model]))
    assert rs.stock_layers(model) > 0
    ev = evidence([model])
    assert rs.stock_ok(ev) and ev["scripted_layers"], ev  # the scripting stays: both engines run it
    assert rs.stock_layers(model) == 0


def test_cli_on_one_device_runs_every_engine_and_follows_every_script(tmp_path, monkeypatch):
    """The bench measures the costs its gates weigh, as an unseeded run does; its engines here
    decide on cheap costs instead (each token past the first 0.05 of a forward, a plain token a
    whole one, a head step 0.05): on a loaded 2-core machine the measured costs once made no
    draft pay, and a cell drafted nothing (acceptance None)."""
    from mlxspec.engine.gates import CostModel

    real = rs.ShardedShapeBench._costs

    def measured_then_cheap(self, vocab):
        cost, heads = real(self, vocab)
        measured.update(cost=cost, heads=heads)
        return CostModel(slope=0.05, curve={1: 1.0}, measured=True), {engine: 0.05 for engine in heads}

    measured = {}
    monkeypatch.setattr(rs.ShardedShapeBench, "_costs", measured_then_cheap)
    out = tmp_path / "sharded.json"
    result = CliRunner().invoke(cli.app, ["bench", "--real-shapes", "smoke", "--sharded", "--bits", "0", "--reps",
                                          "1", "--max-tokens", "32", "--prompt-tokens", "40", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    run = doc["real_shapes"]
    assert run["config"]["ranks"] == 1 and run["baseline_stock"] is True
    assert {(c["workload"], c["engine"]) for c in doc["cells"]} == {
        ("echo", rs.BASELINE), ("echo", "mlxspec-none"), ("echo", "mlxspec-pld"),
        ("mtp-like", rs.BASELINE), ("mtp-like", "mlxspec-mtp")}
    assert all(c["identical"] and c["reps"] >= 1 for c in doc["cells"])
    drafted = [c for c in doc["cells"] if c["engine"] in ("mlxspec-pld", "mlxspec-mtp")]
    assert all(c["acceptance"] > 0.2 and c["tokens_per_step"] > 1 for c in drafted), drafted  # drafts were kept
    assert "stock (" in result.output and "one device" in result.output
    # the costs were measured, as an unseeded `run` under mlx.launch measures them (rank 0's)
    cost = measured["cost"]
    assert cost.measured and cost.curve[1] == 1.0 and len(cost.curve) > 2 and 0.25 <= cost.plain <= 1.0
    assert set(measured["heads"]) == {"mlxspec-mtp"} and measured["heads"]["mlxspec-mtp"] > 0
    info = next(iter(run["shapes"].values())) if isinstance(run["shapes"], dict) else run["shapes"][0]
    assert info["cost_curve"] == {"1": 1.0}  # the shape's info reports the costs the gates weighed


@pytest.mark.parametrize("flags, message", [
    (["--sharded"], "--sharded runs with --real-shapes"),
    (["--sharded", "--real-shapes", "smoke", "--sweep", "smoke"], "--sharded runs with --real-shapes"),
    (["--sharded", "--real-shapes", "smoke", "--workloads", "novel"], "--sharded runs the workloads"),
    (["--sharded", "--real-shapes", "smoke", "--bits", "7"], "--bits must be"),
    (["--sharded", "--real-shapes", "smoke", "--png", "x.png"], "writes no chart"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    result = CliRunner().invoke(cli.app, ["bench", *flags])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.fixture
def kernels_bound(monkeypatch, mlx_lm_bindings_kept):
    """mlxspec's kernels installed as on CUDA (their dispatchers fall back off CUDA, so the runs
    still compute): every binding install may change is put back after the test."""
    from mlxspec import kernels

    monkeypatch.setattr(kernels, "active", lambda: True)
    return kernels


def _bench_echo(tmp_path) -> dict:
    out = tmp_path / "sharded.json"
    result = CliRunner().invoke(cli.app, ["bench", "--real-shapes", "smoke", "--sharded", "--bits", "0", "--reps",
                                          "1", "--max-tokens", "16", "--prompt-tokens", "40", "--workloads", "echo",
                                          "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_kernels_run_in_mlxspecs_cells_and_are_out_for_every_baseline_run(kernels_bound, tmp_path, monkeypatch):
    from mlx_lm.models import qwen3

    from mlxspec.engine.speculate import SpeculativeDecoder
    from mlxspec.kernels import attention

    seen = []
    real = SpeculativeDecoder.generate

    def generate(self, *args, **kw):  # what the engine's attention is bound to in mlxspec's runs
        seen.append(qwen3.scaled_dot_product_attention is attention.scaled_dot_product_attention)
        return real(self, *args, **kw)

    monkeypatch.setattr(SpeculativeDecoder, "generate", generate)
    doc = _bench_echo(tmp_path)
    run = doc["real_shapes"]
    assert run["shapes"][0]["kernels"]["attention_modules"] == 1 and seen and all(seen)
    assert run["baseline_stock"] is True and all(c["identical"] for c in doc["cells"])
    # PLANTED: kernels left in for the baseline runs are caught by the stock evidence
    monkeypatch.setattr(kernels_bound, "uninstall", lambda model: 0)
    assert _bench_echo(tmp_path)["real_shapes"]["baseline_stock"] is False
