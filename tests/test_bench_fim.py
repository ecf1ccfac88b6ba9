"""``mlxspec bench --workloads fim``: spans of whole lines cut from mlxspec's own installed source,
deterministic for a seed; prefix and suffix trimmed at their far ends to the token budget; the
prompt /infill would build (the model's FIM layout); end to end on a tiny checkpoint with Qwen's
FIM tokens (acceptance, speedup, per-prompt rows, identical at temperature 0); a model without
FIM tokens is a one-line error."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mlxspec
import tiny
from mlxspec import cli
from mlxspec.api import load
from mlxspec.bench.fim import (
    BUDGET_TOKENS,
    FIM,
    MAX_LINES,
    MIN_LINES,
    build_prompts,
    function_bodies,
    load_sets,
    package_sources,
    pick_spans,
    trim,
)
from mlxspec.models import fim
from mlxspec.models.tokens import plain_ids
from test_fim import QWEN


@pytest.fixture(scope="module")
def fim_checkpoint(shared_tokenizer, tmp_path_factory):
    """tiny_qwen3's shape with the shared tokenizer plus Qwen's FIM tokens (test_fim's checkpoint)."""
    folder = tiny.with_special_tokens(shared_tokenizer, tmp_path_factory.mktemp("fim_tokenizer"), QWEN)
    return tiny.write_checkpoint(tmp_path_factory.mktemp("tiny_fim"), "qwen3", tokenizer=folder, seed=1)


@pytest.fixture(scope="module")
def fim_spec(fim_checkpoint):
    return load(str(fim_checkpoint))


# -- spans --------------------------------------------------------------------------------------

def test_spans_are_seeded_whole_lines_inside_functions_of_the_installed_package():
    sources = package_sources()
    assert Path(str(resources.files("mlxspec"))) == Path(mlxspec.__file__).parent
    names = [path for path, _ in sources]
    assert names == sorted(names) and "bench/fim.py" in names and "engine/speculate.py" in names
    assert not any("__pycache__" in n or n.startswith("tests/") for n in names)
    texts = dict(sources)
    spans = pick_spans(sources, 6)
    assert spans == pick_spans(package_sources(), 6)  # the same package, the same spans
    assert pick_spans(sources, 3) == spans[:3]  # --prompts N: the first N of any longer run
    assert pick_spans(sources, 6, seed=1) != spans
    assert len({s.id for s in spans}) == 6
    for s in spans:
        text = texts[s.file]
        lines = text.splitlines(keepends=True)
        assert s.prefix + s.middle + s.suffix == text
        assert s.middle == "".join(lines[s.start - 1:s.end]) and MIN_LINES <= s.end - s.start + 1 <= MAX_LINES
        assert s.middle.endswith("\n") and (not s.prefix or s.prefix.endswith("\n"))
        bodies = [b for b in function_bodies(text) if b.name == s.function and b.first <= s.start
                  and s.end < b.last]  # inside the function, a line of it at least after the span
        assert bodies and s.start in bodies[0].starts and s.end in bodies[0].ends, s.id


def test_trimming_keeps_the_lines_next_to_the_span_within_the_budget(shared_tokenizer):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(shared_tokenizer / "tokenizer.json")))
    prefix = "".join(f"before_{i} = {i}\n" for i in range(200))
    suffix = "".join(f"after_{i} = {i}\n" for i in range(200))
    head, tail = trim(tok, prefix, suffix, budget=120)
    n_head, n_tail = len(plain_ids(tok, head)), len(plain_ids(tok, tail))
    assert n_head + n_tail <= 120 and n_head > n_tail > 10  # more before than after
    assert prefix.endswith(head) and prefix[-len(head) - 1] == "\n"  # whole lines, the nearest ones
    assert suffix.startswith(tail) and tail.endswith("\n")
    assert trim(tok, "a = 1\n", "b = 2\n", budget=BUDGET_TOKENS) == ("a = 1\n", "b = 2\n")
    head, tail = trim(tok, prefix, "b = 2\n", budget=120)  # a short suffix leaves its share to the prefix
    assert tail == "b = 2\n" and len(plain_ids(tok, head)) > 100


def test_the_prompt_is_infills_in_the_models_fim_layout(fim_spec):
    tok = fim_spec.tokenizer
    layout = fim.require(tok)
    prompts = build_prompts(fim_spec, 3)
    spans = pick_spans(package_sources(), 3)
    assert [p.id for p in prompts] == [s.id for s in spans]
    for p, s in zip(prompts, spans):
        pre, suf = p.ids.index(layout.prefix), p.ids.index(layout.suffix)
        assert p.ids[-1] == layout.middle and pre < suf
        prefix, suffix = tok.decode(p.ids[pre + 1:suf]), tok.decode(p.ids[suf + 1:-1])
        assert s.prefix.endswith(prefix) and s.suffix.startswith(suffix) and prefix and suffix
        assert p.ids == fim.prompt_ids(tok, layout, prefix, suffix, extra=[])  # what /infill sends
        assert p.meta["prefix_tokens"] + p.meta["suffix_tokens"] <= BUDGET_TOKENS
        assert p.max_tokens == p.meta["span_tokens"] == len(plain_ids(tok, s.middle))
        assert p.meta["file"] == s.file and p.meta["lines"] == [s.start, s.end] and p.meta["middle"] == s.middle
    assert [p.max_tokens for p in build_prompts(fim_spec, 2, max_tokens=5)] == [5, 5]


def test_fim_is_built_only_where_named(tmp_path):
    (tmp_path / "echo.jsonl").write_text('{"id": "a", "prompt": "x", "max_tokens": 4}\n')
    assert [w.name for w in load_sets(tmp_path, None)] == ["echo"]  # never a default
    sets = load_sets(tmp_path, [FIM, "echo"], prompts=2, max_tokens=7)
    assert [w.name for w in sets] == [FIM, "echo"] and sets[0].build is not None and sets[0].prompts == []


# -- the command --------------------------------------------------------------------------------

def test_bench_fim_end_to_end(isolated, fim_checkpoint, tmp_path):
    out = tmp_path / "fim.json"
    result = CliRunner().invoke(cli.app, [
        "bench", str(fim_checkpoint), "--workloads", FIM, "--prompts", "2", "--max-tokens", "10", "--reps", "1",
        "--engines", "mlxspec-pld", "--no-temp-pass", "--no-gates", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    w = doc["workloads"][FIM]
    assert w["kind"] == FIM and w["layout"] == "qwen" and w["budget_tokens"] == BUDGET_TOKENS
    assert [p["id"] for p in w["prompts"]] == [s.id for s in pick_spans(package_sources(), 2)]
    assert all(p["max_tokens"] == 10 and p["prompt_tokens"] > 100 and p["file"] for p in w["prompts"])
    (zero,) = doc["passes"]
    rows = {r["engine"]: r for r in zero["results"] if r["workload"] == FIM}
    assert set(rows) == {"mlx-lm", "mlxspec-pld"}
    assert rows["mlxspec-pld"]["identical"] is True and rows["mlx-lm"]["identical"] is True
    assert rows["mlxspec-pld"]["speedup"] > 0 and rows["mlx-lm"]["speedup"] == pytest.approx(1.0)
    assert {"acceptance", "mean_accepted_length", "draft_fraction"} <= rows["mlxspec-pld"]["median"].keys()
    assert all(r["drafted"] is not None for r in zero["runs"] if r["engine"] == "mlxspec-pld")
    per = zero["per_prompt"][FIM]
    assert [(r["prompt"], r["engine"]) for r in per] == [(p["id"], e) for p in w["prompts"]
                                                         for e in ("mlx-lm", "mlxspec-pld")]
    assert all(r["identical"] is True and r["speedup"] > 0 and "acceptance" in r for r in per)
    assert "fim per prompt" in result.stdout and w["prompts"][0]["id"] in result.stdout
    redrawn = CliRunner().invoke(cli.app, ["bench", "--from-json", str(out)])
    assert redrawn.exit_code == 0 and redrawn.stdout == result.stdout  # the tables from the JSON alone


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_a_model_without_fim_tokens_is_a_one_line_error(isolated, tiny_qwen3, which):
    model = str(tiny_qwen3) if which == "tiny" else "mlxspec-demo"  # the built-in demo model has none either
    result = CliRunner().invoke(cli.app, ["bench", model, "--workloads", f"echo,{FIM}", "--reps", "1"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "no fill-in-the-middle tokens" in result.stderr and "Traceback" not in result.output
    assert result.stdout == ""  # nothing measured


def test_help_names_the_fim_workload():
    text = CliRunner().invoke(cli.app, ["bench", "--help"]).output
    flat = " ".join(text.replace("│", " ").split())
    assert "--workloads fim" in flat and "fill-in-the-middle" in flat
