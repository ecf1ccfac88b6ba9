"""bench --real-shapes on the CPU's tiny shapes: the scripts, the scripted target, the steering,
and the JSON (every cell identical to its script)."""

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

from mlxspec import cli
from mlxspec.bench.real_shapes import Cell, plan, run_real_shapes
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


def test_plan_has_forced_depths_and_the_draft_baseline_only_for_dense():
    dense = plan(["scripted-a1.0", "novel"], True, (1, 2), 0.7)
    hybrid = plan(["scripted-a1.0", "novel"], False, (1, 2), None)
    assert Cell("scripted-a1.0", "mlx-lm-draft") in dense and Cell("scripted-a1.0", "mlx-lm-draft") not in hybrid
    assert Cell("scripted-a1.0", "mlxspec-pld", 2) in dense
    assert not any(c.temperature for c in hybrid)


def test_run_real_shapes_cells_are_identical_and_complete():
    result = run_real_shapes(["smoke"], bits=0, prompt_tokens=48, max_tokens=12, reps=2,
                             depths=(1, 3), workloads=("echo", "scripted-a1.0"), temperature=0.7)
    cells = result["cells"]
    assert all(c["identical"] for c in cells)
    assert {c["engine"] for c in cells} == {"mlx-lm", "mlx-lm-draft", "mlxspec-none", "mlxspec-pld",
                                           "mlxspec-mtp", "mlxspec-draft"}

    forced = [c for c in cells if c["workload"] == "scripted-a1.0" and c["depth"] == 3]
    assert {c["engine"] for c in forced} == {"mlxspec-pld", "mlxspec-mtp"}
    for c in forced:  # every draft accepted: k + 1 tokens per verify (the last one may be cut)
        assert c["acceptance"] == 1.0 and c["tokens_per_step"] > 2.5 and c["ideal"] > 0
    assert all(len(c["reps_tps"]) == 2 for c in cells)
    assert any(c["temperature"] == 0.7 for c in cells)
    shape = result["shapes"][0]
    assert set(shape["forward_ms"]) >= {"1", "2", "9"} and shape["draft_step_ms"]["mlxspec-mtp"] > 0


def test_cli_real_shapes_json_and_errors(tmp_path):
    runner = CliRunner()
    out = tmp_path / "rs.json"
    res = runner.invoke(cli.app, ["bench", "--real-shapes", "smoke", "--bits", "0", "--reps", "1", "--max-tokens", "8",
                                  "--prompt-tokens", "32", "--workloads", "novel", "--no-temp-pass",
                                  "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert {"device", "mlx", "cells"} <= set(doc)
    assert {c["engine"] for c in doc["cells"]} == {"mlx-lm", "mlxspec-none", "mlxspec-pld", "mlxspec-mtp"}
    for c in doc["cells"]:
        assert {"shape", "workload", "engine", "depth", "speedup", "ideal", "acceptance",
                "tokens_per_step", "identical"} <= set(c) and c["identical"]
    again = runner.invoke(cli.app, ["bench", "--from-json", str(out)])
    assert again.exit_code == 0 and "novel" in again.output
    for args, msg in [(["--real-shapes", "qwen9"], "unknown shape"),
                      (["--real-shapes", "smoke", "--workloads", "chat"], "unknown workload"),
                      (["some-model", "--real-shapes", "smoke"], "give no MODEL")]:
        bad = runner.invoke(cli.app, ["bench", *args])
        assert bad.exit_code != 0 and msg in bad.output, bad.output
