"""mlxspec bench on tiny checkpoints: the JSON (raw reps, medians of them), temperature-0 identity
of every engine with mlx-lm, skipped engines, workload errors, the verify-cost sweep, the chart."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlxspec import cli
from mlxspec.api import load
from mlxspec.bench.prompts import ENGINES, Bench, Options, WorkloadError, load_workloads, parse_engines

ROOT = Path(__file__).resolve().parents[1]
# repeats itself, so prompt lookup drafts from the first step
REPETITIVE = "def add(a, b):\n    return a + b\n\n" * 4 + "def add(a, b):\n"
NOVEL = "Hello! How are you today?"
METRICS = ("tps", "ttft_ms", "peak_mb", "acceptance", "mean_accepted_length", "draft_fraction")


def _jsonl(path: Path, items) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def workloads_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("workloads")
    _jsonl(folder / "echo.jsonl", [{"id": "code", "prompt": REPETITIVE, "max_tokens": 20},
                                   {"id": "fox", "prompt": "The quick brown fox. " * 3, "max_tokens": 12}])
    _jsonl(folder / "novel.jsonl", [{"id": "hello", "prompt": NOVEL, "max_tokens": 16}])
    return folder


@pytest.fixture(scope="module")
def dense_run(isolated, tiny_qwen3, tiny_qwen3_draft, workloads_dir, tmp_path_factory):
    """All engines on the dense target with a draft model, through the CLI, 2 repetitions."""
    out = tmp_path_factory.mktemp("bench") / "results.json"
    result = CliRunner().invoke(cli.app, [
        "bench", str(tiny_qwen3), "--draft-model", str(tiny_qwen3_draft), "--workloads-dir",
        str(workloads_dir), "--reps", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result, out


def test_json_schema_and_medians_of_the_raw_repetitions(dense_run):
    doc, result, _ = dense_run
    assert doc["schema"] == "mlxspec-bench/1" and doc["kind"] == "bench"
    env = doc["environment"]
    assert {"mlx", "mlx_lm", "mlxspec", "device", "command", "argv"} <= env.keys()
    # which forwards ran compiled: the defaults (the suite sets no MLXSPEC_COMPILED_* variable)
    assert env["compiled"] == {"verify": True, "hybrid_verify": True, "plain": True, "batch": True, "head": False}
    assert doc["model"]["model_type"] == "qwen3" and doc["draft_model"]["path"]
    assert doc["config"]["reps"] == 2 and list(doc["workloads"]) == ["echo", "novel"]
    first = doc["workloads"]["echo"]["prompts"][0]
    assert first["id"] == "code" and first["max_tokens"] == 20 and first["prompt_tokens"] > 10
    assert set(doc["engines"]) == set(ENGINES)
    # the tiny dense checkpoint has no MTP head: skipped with the reason, not an error
    assert doc["engines"]["mlxspec-mtp"] == {"status": "skipped", "reason": "the checkpoint has no MTP head",
                                             "what": doc["engines"]["mlxspec-mtp"]["what"]}
    assert [p["temperature"] for p in doc["passes"]] == [0.0, 0.7]
    for p in doc["passes"]:
        ran = p["engines"]
        assert ran[0] == "mlx-lm" and "mlxspec-mtp" not in ran
        # every (rep, prompt, engine) has one raw run
        assert len(p["runs"]) == 2 * 3 * len(ran)
        ok = [r for r in p["results"] if r["status"] == "ok"]
        assert {(r["workload"], r["engine"]) for r in ok} == {(w, e) for w in ("echo", "novel") for e in ran}
        for row in ok:
            for key in METRICS:
                values = [v for v in row["reps"][key] if v is not None]
                assert len(row["reps"][key]) == 2
                assert row["median"][key] == (statistics.median(values) if values else None)
            # each repetition's tok/s: the workload's tokens after the first over its decode time
            for rep, tps in enumerate(row["reps"]["tps"]):
                runs = [r for r in p["runs"] if r["rep"] == rep and r["workload"] == row["workload"]
                        and r["engine"] == row["engine"]]
                expect = sum(r["generated"] - 1 for r in runs) / sum(r["decode_s"] for r in runs)
                assert tps == pytest.approx(expect, rel=1e-3)
            base = next(r for r in ok if r["workload"] == row["workload"] and r["engine"] == "mlx-lm")
            assert row["speedup"] == pytest.approx(row["median"]["tps"] / base["median"]["tps"])
            assert row["median"]["tps"] > 0 and row["median"]["ttft_ms"] > 0 and row["median"]["peak_mb"] > 0
    table = result.stdout
    assert "mlxspec-pld" in table and "skipped mlxspec-mtp: the checkpoint has no MTP head" in table
    # like with like: every engine's time to first token is cold, and the table and JSON say so
    assert doc["config"]["ttft"] == "cold" and "cold TTFT ms" in table and "TTFT: cold for every engine" in table
    assert all(r["cached_tokens"] == 0 for p in doc["passes"] for r in p["runs"])
    # progress goes to stderr, never into the tables on stdout
    assert "bench: temperature 0, rep 1/2" in result.stderr and "rep 1/2" not in table


def test_every_engine_is_identical_to_mlx_lm_at_temperature_zero(dense_run):
    doc = dense_run[0]
    zero, sampled = doc["passes"]
    for row in zero["results"]:
        if row["status"] == "ok":
            assert row["identical"] is True, row["engine"]
    assert all(r["identical"] and r["first_diff"] is None for r in zero["runs"])
    assert all(r["identical"] is None for r in sampled["results"] if r["status"] == "ok")
    assert "mlxspec-none" not in sampled["engines"]  # the sampling pass: baseline + drafting engines
    rows = {(r["workload"], r["engine"]): r for r in zero["results"]}
    # prompt lookup drafted on the repetitive prompts and had drafts accepted
    pld = rows["echo", "mlxspec-pld"]["median"]
    assert pld["acceptance"] > 0 and pld["mean_accepted_length"] > 1 and pld["draft_fraction"] > 0
    # mlx-lm-draft: draft share and tokens per verify from its from_draft flags, acceptance blank
    mlx_draft = rows["echo", "mlx-lm-draft"]["median"]
    assert mlx_draft["acceptance"] is None and mlx_draft["draft_fraction"] is not None
    assert mlx_draft["mean_accepted_length"] >= 1
    plain = rows["echo", "mlx-lm"]["median"]
    assert plain["acceptance"] is None and plain["draft_fraction"] is None
    # mlxspec's draft engine drafted every step: tokens per verify = (accepted + verifies) / verifies
    runs = [r for r in zero["runs"] if r["engine"] == "mlxspec-draft" and r["workload"] == "echo" and r["rep"] == 0]
    drafted, accepted, verifies = (sum(r[k] for r in runs) for k in ("drafted", "accepted", "verify_steps"))
    assert drafted > 0
    assert rows["echo", "mlxspec-draft"]["reps"]["acceptance"][0] == pytest.approx(accepted / drafted)
    mean_accepted_length = rows["echo", "mlxspec-draft"]["reps"]["mean_accepted_length"][0]
    assert mean_accepted_length == pytest.approx((accepted + verifies) / verifies)


def test_hybrid_target_skips_mlx_lm_draft_and_runs_mtp_exactly(isolated, tiny_qwen3_5, tiny_qwen3_draft, workloads_dir):
    spec = load(str(tiny_qwen3_5), draft_model=str(tiny_qwen3_draft))
    sets = load_workloads(workloads_dir, ["echo"])
    bench = Bench(spec, sets, parse_engines("mlx-lm-draft,mlxspec-mtp,mlxspec-draft"),
                  Options(reps=1, temp_pass=False, gates=False))
    assert "mlx-lm-draft" in bench.skipped and "ArraysCache" in bench.skipped["mlx-lm-draft"]
    assert bench.engines == ["mlx-lm", "mlxspec-draft", "mlxspec-mtp"]
    (zero,) = bench.run()["passes"]
    rows = {r["engine"]: r for r in zero["results"]}
    assert rows["mlx-lm-draft"]["status"] == "skipped" and "cannot" in rows["mlx-lm-draft"]["reason"]
    for engine in ("mlxspec-draft", "mlxspec-mtp"):
        assert rows[engine]["status"] == "ok" and rows[engine]["identical"] is True
    # no gates: the head drafts at every step, so the identity above covers many partial accepts
    runs = [r for r in zero["runs"] if r["engine"] == "mlxspec-mtp"]
    assert all(r["drafted"] > 0 and r["verify_steps"] > 0 for r in runs)
    assert rows["mlxspec-mtp"]["median"]["acceptance"] is not None


def test_ttft_is_cold_for_every_engine_and_progress_counts_tokens(isolated, tiny_qwen3, workloads_dir):
    """mlx-lm prefills every prompt in full; mlxspec's engines must too (no prefix cache reused
    from the warm-up or the previous repetition of the same prompt), and on_step hears which
    engine, which repetition and how many tokens so far within each generation."""
    spec = load(str(tiny_qwen3))
    bench = Bench(spec, load_workloads(workloads_dir, ["echo"]), parse_engines("mlxspec-none,mlxspec-pld"),
                  Options(reps=2, temp_pass=False))
    steps = []
    (zero,) = bench.run(lambda message, done, total: steps.append((message, done, total)))["passes"]
    assert len(spec.prompt_cache) == 0  # nothing stored, so nothing could be reused
    ours = [r for r in zero["runs"] if r["engine"].startswith("mlxspec")]
    assert ours and all(r["cached_tokens"] == 0 for r in ours)
    messages = [m for m, _, _ in steps]
    for r in zero["runs"]:  # each generation reports its final count, named by rep, prompt and engine
        label = f"temperature 0, rep {r['rep'] + 1}/2: echo/{r['prompt']} {r['engine']}"
        counts = [m for m in messages if m.startswith(label + ": ")]
        assert counts and counts[-1] == f"{label}: {r['generated']}/{r['max_tokens']} tokens", (label, counts)
    assert any(m.startswith("warm-up mlxspec-pld (temperature 0): ") and m.endswith(" tokens") for m in messages)


def test_workload_selection_and_overrides(workloads_dir):
    sets = load_workloads(workloads_dir)  # default: all, the standard names first
    assert [w.name for w in sets] == ["echo", "novel"] and len(sets[0].prompts) == 2
    sets = load_workloads(workloads_dir, ["novel", "echo"], prompts=1, max_tokens=5)
    assert [w.name for w in sets] == ["novel", "echo"]
    assert [len(w.prompts) for w in sets] == [1, 1] and {p.max_tokens for w in sets for p in w.prompts} == {5}
    assert parse_engines("mlxspec-pld") == ["mlx-lm", "mlxspec-pld"]  # the baseline always runs
    with pytest.raises(WorkloadError, match="bad.jsonl:2: not valid JSON"):
        bad = _jsonl(workloads_dir / "bad.jsonl", [{"id": "a", "prompt": "x", "max_tokens": 3}])
        bad.write_text(bad.read_text() + "{oops\n")
        load_workloads(workloads_dir, ["bad"])
    (workloads_dir / "bad.jsonl").unlink()


@pytest.mark.parametrize("lines, args, fragment", [
    (['{"id": "a", "prompt": "x", "max_tokens": 4}', "not json"], [], "w.jsonl:2: not valid JSON"),
    (['{"id": "a", "prompt": "x", "max_tokens": 0}'], [], "w.jsonl:1: \"max_tokens\" must be a positive integer"),
    (['{"id": "a", "max_tokens": 4}'], [], "w.jsonl:1: \"prompt\" must be a non-empty string"),
    (['["a list"]'], [], "w.jsonl:1: expected an object"),
    ([], [], "has no prompts"),
    (['{"id": "a", "prompt": "x", "max_tokens": 4}'], ["--workloads", "w,missing"], "no workload 'missing'"),
    (['{"id": "a", "prompt": "x", "max_tokens": 4}'], ["--engines", "mlx-lm,turbo"], "unknown engine 'turbo'"),
    (['{"id": "a", "prompt": "x", "max_tokens": 4}'], ["--reps", "0"], "--reps"),
])
def test_bad_workloads_and_flags_are_one_line_errors(tmp_path, lines, args, fragment):
    folder = tmp_path / "wl"
    folder.mkdir()
    (folder / "w.jsonl").write_text("".join(line + "\n" for line in lines))
    # MODEL does not exist: workloads and flags are checked before any model is loaded
    result = CliRunner().invoke(cli.app, ["bench", str(tmp_path / "no-model"), "--workloads-dir", str(folder), *args])
    assert result.exit_code != 0
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert fragment in result.stderr


def test_missing_workloads_dir_in_a_real_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_COLOR="1")
    proc = subprocess.run([sys.executable, "-m", "mlxspec", "bench", "some-model", "--workloads-dir",
                           str(tmp_path / "nowhere")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: workloads folder '{tmp_path / 'nowhere'}' does not exist (set --workloads-dir)"]


def test_no_model_and_no_default_is_an_error(tmp_path, monkeypatch, workloads_dir):
    monkeypatch.chdir(tmp_path)  # no benchmarks/models/mini-hybrid here
    result = CliRunner().invoke(cli.app, ["bench", "--workloads-dir", str(workloads_dir)])
    assert result.exit_code == 2 and "give MODEL" in result.stderr


def test_sweep_on_the_smoke_shapes(tmp_path):
    out = tmp_path / "sweep.json"
    result = CliRunner().invoke(cli.app, ["bench", "--sweep", "smoke,smoke-hybrid", "--sweep-tokens", "4",
                                          "--sweep-context", "16", "--reps", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["kind"] == "sweep" and [s["shape"] for s in doc["sweep"]["shapes"]] == ["smoke", "smoke-hybrid"]
    for shape in doc["sweep"]["shapes"]:
        assert [r["tokens"] for r in shape["rows"]] == [1, 2, 3, 4]
        assert all(r["ms"] > 0 and len(r["samples_ms"]) == 1 for r in shape["rows"])
        assert shape["rows"][0]["ratio"] == 1.0 and shape["bits"] == 4 and shape["weights_mb"] > 0
    assert doc["sweep"]["shapes"][1]["model_type"] == "qwen3_5"
    assert "smoke-hybrid" in result.stdout
    bad = CliRunner().invoke(cli.app, ["bench", "--sweep", "qwen9"])
    assert bad.exit_code == 2 and "unknown sweep shape 'qwen9'" in bad.stderr


def test_png_chart_and_from_json(dense_run, tmp_path):
    pytest.importorskip("matplotlib")
    _, first, saved = dense_run
    png = tmp_path / "chart.png"
    result = CliRunner().invoke(cli.app, ["bench", "--from-json", str(saved), "--png", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.stdout == first.stdout  # the same tables, redrawn from the JSON alone


def test_png_without_matplotlib_is_a_one_line_error(dense_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = CliRunner().invoke(cli.app, ["bench", "--from-json", str(dense_run[2]), "--png", str(tmp_path / "c.png")])
    assert result.exit_code == 1
    assert result.stderr == 'error: the chart needs matplotlib: pip install "mlxspec[bench]"\n'


def test_from_json_rejects_other_files(tmp_path):
    other = tmp_path / "other.json"
    other.write_text('{"rows": []}')
    result = CliRunner().invoke(cli.app, ["bench", "--from-json", str(other)])
    assert result.exit_code == 1 and "was not written by `mlxspec bench --json`" in result.stderr


def test_help_explains_every_option():
    text = CliRunner().invoke(cli.app, ["bench", "--help"]).output
    for option in ("--draft-model", "--workloads-dir", "--workloads", "--prompts", "--max-tokens",
                   "--engines", "--reps", "--draft-depth", "--depth", "--temperature", "--temp-pass",
                   "--no-temp-pass", "--no-gates", "--seed", "--json", "--png", "--from-json", "--sweep", "--bits",
                   "--sweep-tokens", "--sweep-context"):
        assert option in text
    flat = " ".join(text.replace("│", " ").split())  # the help's boxes wrap lines
    assert 'pip install "mlxspec[bench]"' in flat and "mlx-lm-draft" in flat
