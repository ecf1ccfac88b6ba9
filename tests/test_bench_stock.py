"""The honest baseline of bench --real-shapes (issue 29, item 5): stock mlx-lm in a process of its
own, proven stock (and caught when it is not: kernels planted there), ABAB repetitions, paired
ratios with their median and interquartile range, and the cell schema."""

import functools
import os
import sys
from pathlib import Path

import mlx.nn as nn
import pytest

from mlxspec.bench import stock_evidence
from mlxspec.bench.paired import abab, paired_ratios, paired_speedup, quartiles
from mlxspec.bench.real_plan import BASELINE, Cell
from mlxspec.bench.real_shapes import Run
from mlxspec.bench.real_summary import CELL_KEYS, baseline_of, cell_summary, measure
from mlxspec.bench.script import make_script
from mlxspec.bench.stock import NotStock, StockBaseline, started_without
from mlxspec.bench.stock_worker import GRAPH_CACHE_ENV


def test_the_baseline_process_is_stock_and_says_so():
    import mlxspec.kernels  # noqa: F401 - here, in the bench's process, the kernels are loaded

    assert "mlxspec.kernels" in sys.modules
    script = make_script("scripted-a0.6", 1024, 24, 10)
    with StockBaseline("smoke", bits=4, vocab=1024, draft_shape="smoke") as stock:
        ev = stock.evidence
        assert ev["stock"] and stock_evidence.failures(ev) == []
        assert ev["kernels_imported"] == [] and not any(m.startswith("mlxspec.kernels") for m in ev["mlxspec_modules"])
        names = {c["name"] for c in ev["originals"]}
        assert {"mlx_lm.models.qwen3_5.gated_delta_update", "mlx_lm.models.qwen3_next.gated_delta_update",
                "mlx_lm.models.qwen3.scaled_dot_product_attention"} <= names
        assert all(c["original"] and c["module"].startswith("mlx_lm.") for c in ev["originals"])
        assert ev["foreign_bindings"] == [] and ev["foreign_layers"] == []
        assert ev["scripted_layers"]  # the script is forced on the baseline too (and said so)
        assert ev["pid"] == stock.proc.pid != os.getpid()  # another process
        if GRAPH_CACHE_ENV in started_without():  # the variable mlxspec's import sets is gone there
            assert ev["env"][GRAPH_CACHE_ENV] is None
        plain = stock.run(script.prompt, script.target, script.drafted, 8)
        assert plain["tokens"] == script.continuation[:8] and plain["decode_s"] > 0 and plain["from_draft"] == 0
        drafted = stock.run(script.prompt, script.target, script.drafted, 8, draft_depth=3)
        assert drafted["tokens"] == script.continuation[:8] and drafted["from_draft"] > 0
        assert stock.recheck()["stock"]  # nothing the runs did changed it


def test_kernels_planted_in_the_baseline_process_fail_the_check():
    with pytest.raises(NotStock) as err:
        StockBaseline("smoke", bits=4, vocab=1024,
                      worker=(sys.executable, str(Path(__file__).parent / "planted_stock_worker.py")))
    text = str(err.value)
    assert "imported mlxspec.kernels" in text
    assert "mlx_lm.models.qwen3_5.gated_delta_update is mlxspec.kernels.gdn.gated_delta_update" in text
    assert "scaled_dot_product_attention is mlxspec.kernels.attention" in text
    assert "layer model.layers.0.self_attn.q_proj: mlxspec.kernels.qmm.SmallMQuantizedLinear" in text


def test_evidence_sees_a_disguised_rebinding_and_a_swapped_layer(monkeypatch):
    from mlx_lm.models import base, qwen3

    from mlxspec.compat import swap_class
    from mlxspec.kernels.qmm import SmallMQuantizedLinear

    assert stock_evidence.check_original("mlx_lm.models.qwen3", "scaled_dot_product_attention")["original"]

    @functools.wraps(base.scaled_dot_product_attention)  # same __module__ and __qualname__ as mlx-lm's
    def disguised(*args, **kwargs):
        return base.scaled_dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(qwen3, "scaled_dot_product_attention", disguised)
    seen = stock_evidence.check_original("mlx_lm.models.qwen3", "scaled_dot_product_attention")
    assert seen["module"] == "mlx_lm.models.base" and not seen["original"]  # not mlx-lm's object, nor its code
    layer = nn.QuantizedLinear(64, 64, bits=4)
    model = nn.Sequential(layer, nn.QuantizedLinear(64, 64, bits=4))
    assert stock_evidence.layer_classes([model]) == ([], [])
    swap_class(layer, SmallMQuantizedLinear)
    foreign, scripting = stock_evidence.layer_classes([model])
    assert foreign == ["layers.0: mlxspec.kernels.qmm.SmallMQuantizedLinear"] and scripting == []


# -- ABAB order, paired ratios ---------------------------------------------------------------


def test_abab_puts_each_cell_right_after_its_own_baseline():
    cells = [Cell("echo", BASELINE), Cell("echo", "mlxspec-pld"), Cell("echo", "mlxspec-mtp"),
             Cell("novel", BASELINE), Cell("echo", BASELINE, None, 0.7), Cell("echo", "mlxspec-pld", None, 0.7),
             Cell("dflash", BASELINE)]
    order = abab(cells, baseline_of)
    assert order == [(cells[0], cells[1]), (cells[0], cells[2]), (cells[3], None), (cells[4], cells[5]),
                     (cells[6], None)]


class FakeBench:
    """Runs cells in order, each at a made-up rate, recording the sequence."""

    shape, max_tokens = "smoke", 4

    def __init__(self):
        self.log = []
        self.scripts = {"echo": make_script("echo", 1024, 16, 4), "novel": make_script("novel", 1024, 16, 4)}

    def run(self, cell):
        self.log.append(cell.engine)
        n = len(self.log)
        rate = 100.0 if cell.engine == BASELINE else 150.0 + n
        want = self.scripts[cell.workload].continuation[:4]
        return Run(list(want), (len(want) - 1) / rate)

    def ideal(self, cell, run, plain_ms):
        return 1.0 if cell.engine == BASELINE else 2.0


def test_measure_runs_abab_and_pairs_adjacent_runs():
    cells = [Cell("echo", BASELINE), Cell("echo", "a"), Cell("echo", "b"), Cell("novel", BASELINE)]
    bench = FakeBench()
    reps = []
    runs, pairs = measure(bench, cells, 3, on_rep=lambda rep, r, p: reps.append(rep))
    assert bench.log == [BASELINE, "a", BASELINE, "b", BASELINE] * 3 and reps == [0, 1, 2]
    assert [len(runs[c.key]) for c in cells] == [6, 3, 3, 3]
    for cell in cells[1:3]:  # each run's pair is the baseline run right before it
        assert len(pairs[cell.key]) == 3 and all(b.tps == pytest.approx(100.0) for b in pairs[cell.key])
    assert pairs[cells[0].key] == runs[cells[0].key]


def test_paired_ratio_median_and_iqr():
    assert paired_ratios([2.0, 3.0, 4.0, 5.0], [1.0, 1.0, 2.0, 1.0]) == [2.0, 3.0, 2.0, 5.0]
    got = paired_speedup([2.0, 3.0, 4.0, 5.0], [1.0, 1.0, 2.0, 1.0])
    # sorted 2, 2, 3, 5: median 2.5; inclusive quartiles at positions 0.75 and 2.25: 2 and 3 + 0.25 * 2
    assert got == {"speedup": 2.5, "speedup_iqr": [2.0, 3.5], "ratios": [2.0, 3.0, 2.0, 5.0]}
    # the pairing matters: a ratio of medians would say 3.5 / 1 here
    assert quartiles([1.0, 2.0, 3.0, 4.0, 100.0]) == (2.0, 3.0, 4.0)
    assert quartiles([1.5]) == (1.5, 1.5, 1.5)
    assert paired_speedup([2.0, None], [1.0, 1.0]) == {"speedup": None, "speedup_iqr": None, "ratios": None}
    with pytest.raises(ValueError):
        paired_ratios([1.0], [1.0, 2.0])


def test_cell_schema():
    bench = FakeBench()
    cells = [Cell("echo", BASELINE), Cell("echo", "mlxspec-pld")]
    runs, pairs = measure(bench, cells, 8)
    base = cell_summary(bench, cells[0], runs[cells[0].key], pairs[cells[0].key])
    mine = cell_summary(bench, cells[1], runs[cells[1].key], pairs[cells[1].key])
    for c in (base, mine):
        assert list(c)[: len(CELL_KEYS)] == list(CELL_KEYS)
        assert c["baseline"] == "mlx-lm (stock)" and c["context_tokens"] == 16 and c["identical"]
    assert base["speedup"] == 1.0 and base["speedup_iqr"] == [1.0, 1.0] and base["reps"] == 8
    ratios = [(150.0 + 2 * i + 2) / 100.0 for i in range(8)]  # the 2nd, 4th, ... run of the log
    assert mine["reps"] == 8 and mine["speedup_reps"] == [round(r, 3) for r in ratios]
    assert mine["speedup"] == round(sorted(ratios)[3] / 2 + sorted(ratios)[4] / 2, 3)
    q1, _, q3 = quartiles(ratios)
    assert mine["speedup_iqr"] == [round(q1, 3), round(q3, 3)]
    assert mine["ideal"] == 2.0 and mine["achieved_over_ideal"] == pytest.approx(mine["speedup"] / 2, abs=1e-3)
    assert mine["plain_ms"] == 10.0 and mine["baseline_tps"] == 100.0
    assert mine["acceptance"] is None and mine["tokens_per_step"] == 1.0  # plain runs: one token a step


def test_a_checkpoint_in_the_baseline_process_is_stock_and_streams_as_mlx_lm(tiny_qwen3, tiny_qwen3_draft):
    """The same process for a real checkpoint (``mlx_lm.load``, ``mlx_lm.stream_generate``): for
    ``mlxspec bench MODEL``'s mlx-lm engine."""
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(tiny_qwen3))
    prompt = tokenizer.encode("the stock baseline")
    want = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=6, sampler=make_sampler(temp=0.0))]
    with StockBaseline(path=tiny_qwen3, draft_path=tiny_qwen3_draft) as stock:
        assert stock.evidence["stock"] and stock.evidence["scripted_layers"] == []
        plain = stock.stream(prompt, 6)
        assert plain["tokens"] == want and plain["ttft_s"] > 0 and plain["finish"] in ("length", "stop")
        assert stock.stream(prompt, 6, draft_depth=2)["tokens"] == want
        with pytest.raises(Exception, match="scripted model"):
            stock.run(prompt, prompt, prompt, 4)
