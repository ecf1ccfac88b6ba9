"""bench --real-shapes on the CPU's tiny shapes: the scripts, the scripted target, the steering,
and the JSON (every cell identical to its script)."""

import json
import math

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

from mlxspec import cli
from mlxspec.bench.real_shapes import BASELINE, STOCK_DRAFT, WITH_KERNELS, Cell, plan, run_real_shapes
from mlxspec.bench.real_summary import CELL_KEYS
from mlxspec.bench.script import ScriptedLogits, SteeredLookup, make_script, parse_workload
from mlxspec.bench.synthetic import random_model, random_mtp_head
from mlxspec.errors import UsageError


def test_scripts_have_the_promised_shape():
    echo = make_script("echo", 4096, 400, 300)
    prompt = set(echo.prompt)
    copied = sum(t in prompt for t in echo.continuation)
    assert 0.9 < copied / len(echo.continuation) < 0.99  # spans of the prompt, an edit every ~25
    novel = make_script("novel", 4096, 400, 300)
    assert not set(novel.continuation) & set(novel.prompt)
    assert novel.drafted == novel.target and novel.acceptance is None
    for a in (0.6, 0.8, 1.0):
        s = make_script(f"scripted-a{a}", 4096, 64, 2000)
        right = sum(d == t for d, t in zip(s.drafted[64:], s.target[64:])) / len(s.continuation)
        assert abs(right - a) < 0.04
    assert make_script("echo", 4096, 64, 64).target == echo.target[:0] + make_script("echo", 4096, 64, 64).target
    with pytest.raises(UsageError):
        parse_workload("scripted-a1.5")
    with pytest.raises(UsageError):
        parse_workload("chat")


@pytest.mark.parametrize("shape", ["smoke", "smoke-hybrid", "smoke-moe"])
def test_scripted_target_emits_the_script(shape):
    model = random_model(shape, bits=4)
    head = random_mtp_head(model, shape)
    plain = model(mx.array([[1, 2, 3]]))
    script = make_script("novel", 1024, 24, 16)
    ScriptedLogits(model, script.target)
    prompt = mx.array(script.prompt, mx.uint32)
    out = [t for (t, _), _ in zip(generate_step(prompt, model, max_tokens=16), range(16))]
    assert out == script.continuation[:16]
    # an MTP head's logits through the shared lm_head stay the real ones
    hidden = mx.zeros((1, model.args.hidden_size if hasattr(model.args, "hidden_size")
                       else head.module.fc.weight.shape[0]), mx.bfloat16)
    assert head.logits(hidden).shape[-1] == plain.shape[-1]
    real = head.logits(hidden)
    assert mx.sum(real == 30.0).item() == 0


def test_steered_lookup_follows_the_drafted_script():
    s = make_script("scripted-a0.6", 1024, 16, 40)
    d = SteeredLookup(s)
    tokens = s.target[:20]
    assert d.lookup(tokens, 5) == s.drafted[20:25]
    assert d.peek(tokens, [7, 7], 3) == s.drafted[22:25]


def test_steered_mtp_rows_drafted_together_follow_the_drafted_script(monkeypatch):
    """A batch's MTP rows draft in one call (MTPDrafter.propose_together); each row's draft is
    then its own script's (PLANTED, without SteeredMTP's override they keep the head's tokens)."""
    from mlxspec.bench.script import SteeredMTP
    from mlxspec.engine.drafters.base import Draft
    from mlxspec.engine.drafters.mtp import MTPDrafter

    scripts = [make_script("scripted-a0.6", 1024, 16, 40, seed=seed) for seed in (1, 2)]
    rows = []
    for s in scripts:
        row = SteeredMTP.__new__(SteeredMTP)  # no head: the chains below stand for its drafts
        row.script = s
        rows.append(row)
    head_drafts = lambda cls, drafters, tokens, ks, samplings: [  # noqa: E731
        Draft(mx.full((k,), 1023, mx.uint32)) for k in ks]
    monkeypatch.setattr(MTPDrafter, "propose_together", classmethod(head_drafts))
    tokens = [s.target[:20] for s in scripts]
    got = SteeredMTP.propose_together(rows, tokens, [3, 2], [None, None])
    assert [d.host_tokens() for d in got] == [scripts[0].drafted[20:23], scripts[1].drafted[20:22]]


def test_plan_has_forced_depths_and_the_draft_baseline_only_for_dense():
    dense = plan(["scripted-a1.0", "novel"], True, (1, 2), 0.7)
    hybrid = plan(["scripted-a1.0", "novel"], False, (1, 2), None)
    assert Cell("scripted-a1.0", STOCK_DRAFT) in dense and Cell("scripted-a1.0", STOCK_DRAFT) not in hybrid
    assert [c for c in dense if c.engine == WITH_KERNELS] == [Cell("scripted-a1.0", WITH_KERNELS)]  # once a shape
    assert Cell("scripted-a1.0", "mlxspec-pld", 2) in dense
    assert not any(c.temperature for c in hybrid)


def test_run_real_shapes_cells_are_identical_and_complete():
    result = run_real_shapes(["smoke"], bits=0, prompt_tokens=48, max_tokens=12, reps=2,
                             depths=(1, 3), workloads=("echo", "scripted-a1.0"), temperature=0.7)
    cells = result["cells"]
    assert all(c["identical"] for c in cells)
    assert {c["engine"] for c in cells} == {BASELINE, STOCK_DRAFT, WITH_KERNELS, "mlxspec-none", "mlxspec-pld",
                                           "mlxspec-mtp", "mlxspec-draft"}
    assert result["baseline"] == "mlx-lm (stock)" and result["shapes"][0]["baseline_evidence"]["stock"]

    forced = [c for c in cells if c["workload"] == "scripted-a1.0" and c["depth"] == 3]
    assert {c["engine"] for c in forced} == {"mlxspec-pld", "mlxspec-mtp"}
    for c in forced:  # every draft accepted: k + 1 tokens per verify (the last one may be cut)
        assert c["acceptance"] == 1.0 and c["tokens_per_step"] > 2.5 and c["ideal"] > 0
    assert all(len(c["reps_tps"]) == 2 for c in cells if c["engine"] != BASELINE)
    # the warm-up traced every compiled verify a timed repetition meets, each script's own
    assert all(c["compiled_traces"] == 0 for c in cells if c["engine"].startswith("mlxspec-")), \
        [(c["workload"], c["engine"], c["compiled_traces"]) for c in cells if c["engine"].startswith("mlxspec-")]
    assert all(c["reps"] >= 2 and c["context_tokens"] == 48 for c in cells)
    assert any(c["temperature"] == 0.7 for c in cells)
    shape = result["shapes"][0]
    assert set(shape["forward_ms"]) >= {"1", "2", "9"} and shape["draft_step_ms"]["mlxspec-mtp"] > 0
    assert shape["compiled_graphs"]["traced"] > 0 and shape["compiled_graphs"]["tracing_calls_s"] > 0


def test_cli_real_shapes_json_and_errors(tmp_path):
    runner = CliRunner()
    out = tmp_path / "rs.json"
    res = runner.invoke(cli.app, ["bench", "--real-shapes", "smoke", "--bits", "0", "--reps", "1", "--max-tokens", "8",
                                  "--prompt-tokens", "32", "--workloads", "novel", "--no-temp-pass",
                                  "--engines", "mlxspec-pld,mlx-lm-kernels,mlxspec-draft", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "no cell of these workloads runs mlxspec-draft" in res.output  # novel has no draft-model cell
    doc = json.loads(out.read_text())
    assert {"device", "mlx", "cells"} <= set(doc)
    # --engines: only those engines' cells (of novel's: stock, kernels, none, pld, mtp), stock always
    assert {c["engine"] for c in doc["cells"]} == {BASELINE, WITH_KERNELS, "mlxspec-pld"}
    assert doc["real_shapes"]["config"]["engines"] == sorted({BASELINE, WITH_KERNELS, "mlxspec-pld", "mlxspec-draft"})
    assert doc["baseline"] == "mlx-lm (stock)"
    for c in doc["cells"]:
        assert set(CELL_KEYS) <= set(c) and c["identical"]
    assert doc["real_shapes"]["shapes"][0]["baseline_evidence"]["stock"]
    again = runner.invoke(cli.app, ["bench", "--from-json", str(out)])
    assert again.exit_code == 0 and "novel" in again.output and "mlx-lm (stock)" in again.output
    for args, msg in [(["--real-shapes", "qwen9"], "unknown shape"),
                      (["--real-shapes", "smoke", "--workloads", "chat"], "unknown workload"),
                      (["--real-shapes", "smoke", "--engines", "mlxspec-pdl"], "unknown engine 'mlxspec-pdl'"),
                      (["--real-shapes", "smoke", "--engines", ","], "at least one engine"),
                      (["--real-shapes", "smoke", "--concurrency", "2", "--engines", "mlxspec-pld"], "--engines picks"),
                      (["--sweep", "smoke", "--engines", "mlxspec-pld"], "--engines picks"),
                      (["some-model", "--real-shapes", "smoke"], "give no MODEL")]:
        bad = runner.invoke(cli.app, ["bench", *args])
        assert bad.exit_code != 0 and msg in bad.output, bad.output


# -- DFlash rows: the profile workloads, the steered block drafter, draft trees ----------------


def test_profile_scripts_rank_the_script_token_as_promised():
    from mlxspec.bench.script import PROFILES

    s = make_script("dflash", 4096, 32, 3000)
    assert s.steered and s.profile is PROFILES["dflash"] and not set(s.continuation) & set(s.prompt)
    starts = range(len(s.prompt), len(s.target) - 16)
    for i in (1, 4, 12):
        ranks = [s.ranked(start, i) for start in starts]
        top1 = sum(a == s.target[start + i - 1] for start, (a, _, _) in zip(starts, ranks)) / len(ranks)
        top2 = sum(b == s.target[start + i - 1] for start, (_, b, _) in zip(starts, ranks)) / len(ranks)
        r = 0.97 * 0.95 ** (i - 1)
        assert abs(top1 - r) < 0.04 and abs(top2 - 0.5 * (1 - r)) < 0.04
        assert all(a != b for a, b, _ in ranks)
        assert all(neither == (s.target[st + i - 1] not in (a, b)) for st, (a, b, neither) in zip(starts, ranks))
    # a steered chain drafter proposes the top-1s; the same (start, position) always decides the same
    assert s.drafts(40, 5) == [s.ranked(40, i)[0] for i in range(1, 6)] == s.drafts(40, 5)
    m = make_script("mtp-like", 4096, 32, 3000)
    right = [sum(m.drafts(st, 3)[i - 1] == m.target[st + i - 1] for st in starts) / len(starts) for i in (1, 2, 3)]
    assert all(abs(x - want) < 0.04 for x, want in zip(right, (0.73, 0.66, 0.67)))
    assert parse_workload("dflash") is None and parse_workload("mtp-like") is None


def test_steered_rows_put_top1_top2_and_demote_the_script_token():
    from mlxspec.bench.script import steered_rows, tree_depth

    s = make_script("dflash", 1024, 16, 200)
    rows = steered_rows(s, 40, mx.zeros((15, 1024), mx.bfloat16))
    probs = mx.softmax(rows, axis=-1)
    order = mx.argsort(-rows, axis=-1)
    for i in range(1, 16):
        a, b, neither = s.ranked(40, i)
        assert order[i - 1, 0].item() == a and order[i - 1, 1].item() == b
        r = 0.97 * 0.95 ** (i - 1)
        assert abs(probs[i - 1, a].item() - r) < 1e-3 and abs(probs[i - 1, b].item() - 0.5 * (1 - r)) < 1e-3
        if neither:
            assert order[i - 1, -1].item() == s.target[40 + i - 1]
    depths = {n: tree_depth("dflash", n, 16) for n in (4, 8, 16, 32)}
    assert [depths[n][0] for n in (4, 8, 16, 32)] == [3, 7, 10, 11]
    chain15 = sum(math.prod(0.97 * 0.95 ** j for j in range(i)) for i in range(1, 16))
    assert depths[32][1] > chain15 + 0.8  # 32 nodes keep more than the whole block's chain


def test_scripted_target_follows_node_depths_in_a_tree_verify():
    from mlxspec.engine.cache import ModelState
    from mlxspec.engine.tree_forward import keep_path, tree_forward

    model = random_model("smoke", bits=0)
    script = make_script("novel", 1024, 24, 16)
    ScriptedLogits(model, script.target)
    state = ModelState(model)
    state.prefill(script.prompt[:-1])
    start = state.length  # the root (the prompt's last token) goes here
    parents = [-1, 0, 1, 0, 3, 2]  # depths 0 1 2 1 2 3
    tokens = mx.array([script.prompt[-1], 5, 6, 7, 8, 9], mx.uint32)
    rows = mx.argmax(tree_forward(state, tokens, parents), axis=-1).tolist()
    assert rows == [script.target[start + 1 + d] for d in (0, 1, 2, 1, 2, 3)]
    keep_path(state, start, [0])


def test_plan_has_the_dflash_chains_and_trees():
    cells = plan(["dflash", "mtp-like"], True, (1, 2), None, dflash_block=16)
    dflash = [(c.depth, c.tree) for c in cells if c.engine == "mlxspec-dflash"]
    assert dflash == [(None, 0), (None, None), (3, 0), (7, 0), (15, 0), (3, 4), (7, 8), (10, 16), (11, 32)]
    assert [c.engine for c in cells if c.workload == "mtp-like"] == [BASELINE, "mlxspec-mtp"]
    assert not [c for c in plan(["dflash"], True, (1,), None) if c.engine == "mlxspec-dflash"]  # no drafter


@pytest.mark.parametrize("shape, reps", [("smoke", 1), ("smoke-hybrid", 1)])  # two reps: above
def test_dflash_rows_run_and_every_cell_is_identical(shape, reps):
    from rich.console import Console

    from mlxspec.bench.report import real_shapes_table

    result = run_real_shapes([shape], bits=0, prompt_tokens=16, max_tokens=20, reps=reps,
                             workloads=("dflash", "mtp-like"), temperature=None)
    cells = result["cells"]
    assert all(c["identical"] for c in cells), [c for c in cells if not c["identical"]]
    dflash = {(c["depth"], c["tree"]): c for c in cells if c["engine"] == "mlxspec-dflash"}
    assert set(dflash) == {("auto", 0), ("auto", "auto"), (3, 0), (7, 0), (15, 0), (3, 4), (7, 8), (10, 16),
                           (11, 32)}
    for (depth, tree), c in dflash.items():
        assert c["speedup"] > 0 and c["ideal"] > 0 and c["acceptance"] > 0 and c["tokens_per_step"] > 1
        lo, hi = c["speedup_iqr"]
        assert lo <= c["speedup"] <= hi
        if isinstance(tree, int) and tree:  # every verify a tree of at most N nodes
            assert c["tree_steps"] > 0 and 1 < c["mean_tree_nodes"] <= tree
        elif tree == 0:
            assert c["tree_steps"] == 0
    assert dflash[(3, 0)]["tokens_per_step"] <= 4.0 and dflash[(15, 0)]["mean_depth"] > 7
    assert {c["engine"] for c in cells if c["workload"] == "mtp-like"} == {BASELINE, "mlxspec-mtp"}
    info = result["shapes"][0]
    assert set(info["tree_ms"]) == {"4", "8", "16", "32"} and info["draft_step_ms"]["mlxspec-dflash"] > 0
    assert info["dflash"]["block_size"] == 16 and "16" in info["forward_ms"]
    console = Console(width=200, record=True)
    console.print(real_shapes_table({"cells": cells}, shape))
    assert "mlxspec-dflash" in console.export_text()
