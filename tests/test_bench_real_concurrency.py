"""`mlxspec bench --real-shapes SHAPE --concurrency`: scripted requests at once on a random
model of a real shape against stock mlx-lm's BatchGenerator in its own process; every
request's tokens checked against its script; successor-table scripts are consistent."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from mlxspec import cli
from mlxspec.bench import real_concurrency as rc
from mlxspec.bench.script import make_follow_scripts
from mlxspec.bench.scripted import ScriptedLogits
from mlxspec.errors import UsageError


@pytest.mark.parametrize("workload", ["echo", "novel", "mtp-like", "scripted-a0.8"])
def test_one_successor_table_drives_every_script(workload):
    table, scripts = make_follow_scripts(workload, 4096, 5, 120, 40, seed=3)
    used = set()
    for s in scripts:
        p = len(s.prompt)
        assert all(int(table[s.target[i]]) == s.target[i + 1] for i in range(p - 1, len(s.target) - 1))
        assert not used & set(s.prompt)  # requests never share a token
        used |= set(s.prompt)
    if workload == "echo":  # the continuation echoes its prompt, with edits from outside it
        s = scripts[0]
        inside = sum(t in set(s.prompt) for t in s.continuation)
        assert 0.8 * len(s.continuation) < inside < len(s.continuation)
    else:
        assert not set(scripts[0].continuation) & set(scripts[0].prompt)


def test_scripts_that_do_not_fit_the_vocabulary_are_refused():
    with pytest.raises(UsageError, match="do not fit"):
        make_follow_scripts("echo", 1024, 8, 100, 40)


def test_follow_logits_follow_the_input_token_in_every_row():
    import mlx.core as mx

    from mlxspec.bench.synthetic import random_model

    model = random_model("smoke", bits=0)
    script = ScriptedLogits(model, [0])
    script.follow = mx.array((np.arange(1024) * 7 + 5) % 1024, mx.int32)
    inputs = mx.array([[3, 9, 100], [1, 2, 1000]], mx.uint32)
    picks = mx.argmax(model(inputs), axis=-1).tolist()
    assert picks == [[(x * 7 + 5) % 1024 for x in row] for row in inputs.tolist()]


def test_cli_runs_every_engine_against_stock_batching(tmp_path):
    out = tmp_path / "rc.json"
    result = CliRunner().invoke(cli.app, ["bench", "--real-shapes", "smoke", "--bits", "0", "--concurrency", "2",
                                          "--workloads", "echo,mtp-like", "--reps", "1", "--max-tokens", "10",
                                          "--prompt-tokens", "40", "--join-tokens", "300", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["kind"] == "real_concurrency" and doc["baseline"] == "mlx-lm (stock)"
    assert doc["real_concurrency"]["stock_evidence"]["stock"] is True
    cells = {(c["workload"], c["concurrency"], c["engine"]): c for c in doc["cells"]}
    assert set(cells) == {(w, 2, e) for w in ("echo", "mtp-like") for e in rc.ENGINES}
    for c in cells.values():  # every engine's every request is its script
        assert c["identical"] is True and c["reps"] == 1 and c["aggregate_tps"] > 0, c
    for w in ("echo", "mtp-like"):
        batched = cells[(w, 2, rc.BATCHED)]
        assert batched["vs_stock_batched"] > 0 and len(batched["vs_stock_batched_iqr"]) == 2
        assert batched["vs_serial"] > 0 and "acceptance" in batched and batched["mean_rows"] > 1
        # the batch's compiled graphs: traced in the warm-up, so none inside the timed repetition
        assert batched["compiled_traces"] == 0, batched
        assert cells[(w, 2, rc.SERIAL)]["batching_bound"] > 1  # two requests: more than one's worth
    graphs = doc["real_concurrency"]["compiled_graphs"]
    assert graphs["traced"] >= 1 and graphs["tracing_calls_s"] > 0, graphs
    join = doc["real_concurrency"]["join"]
    assert join["join_tokens"] == 300 and join["steps"] >= 1 and join["worst_gap_ms"] > 0
    assert "requests at once" in result.output and "a batch can be at most" in result.output


def test_a_wrong_script_shows_as_not_identical(monkeypatch):
    """PLANTED: the mlxspec engines' target follows another table than the scripts'."""
    real = rc.ConcurrencyBench.follow

    def planted(self, workload):
        real(self, workload)
        import mlx.core as mx

        self.logits.follow = mx.array(np.roll(self.tables[workload], 1), mx.int32)

    monkeypatch.setattr(rc.ConcurrencyBench, "follow", planted)
    result = rc.run_real_concurrency("smoke", levels=[2], workloads=["novel"], bits=0, prompt_tokens=24,
                                     max_tokens=6, reps=1, stock=False)
    assert not any(c["identical"] for c in result["cells"])


@pytest.mark.parametrize("flags, message", [
    (["--real-shapes", "smoke,qwen3-8b", "--concurrency", "2"], "one shape at a time"),
    (["--real-shapes", "gemma-4-31b", "--concurrency", "2"], "Gemma targets are served alone"),
    (["--real-shapes", "smoke", "--concurrency", "2", "--workloads", "chat"], "unknown workload"),
    (["--real-shapes", "smoke", "--concurrency", "2", "--bits", "7"], "--bits must be"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    result = CliRunner().invoke(cli.app, ["bench", *flags])
    assert result.exit_code == 2 and message in result.output, result.output


def test_the_batching_bound_is_the_prefills_plus_the_slowest_decode():
    # requests: prefill 1 s then decode 2 s; prefill 1 s then decode 6 s (seconds from the start)
    run = rc.Run([[1, 2], [3, 4]], first=[1.0, 4.0], last=[3.0, 10.0], serial=True)
    assert run.batching_bound == pytest.approx(10.0 / (1.0 + 1.0 + 6.0))
    assert rc.Run([[1]], first=[1.0], last=[2.0]).batching_bound is None  # a batch's run has none
