"""`mlxspec run`'s input and flags (issue 18, section 2): a lone repo id is a model, `-` and piped
stdin, bytes that are not UTF-8, one-line usage errors, mlx-lm's flag names, defaults in --help,
notes for flags that do nothing, draft-model errors, --json's fields. In process (CliRunner),
with a fake model where nothing needs to run."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mlxspec import cli
from test_cli import ROOT, FakeSpecModel
from test_cli_shell import fake_cached_model


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    for name in ("MLXSPEC_DEFAULT_MODEL", "MLXSPEC_DEBUG", "MLXSPEC_DRAFTER", "MLXSPEC_TEMP", "MLXSPEC_PRESET"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.fixture
def fake_load(monkeypatch, env):
    loaded = []

    def load(model_ref, draft_model=None):
        loaded.append(FakeSpecModel(model_ref, is_demo=model_ref is None))
        loaded[-1].draft_ref = draft_model
        return loaded[-1]

    monkeypatch.setattr("mlxspec.api.load", load)
    return loaded


def invoke(*args, input=None):
    return CliRunner().invoke(cli.app, [str(a) for a in args], input=input)


def one_error_line(result, code, *fragments):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# -- a lone argument that looks like a repo id ---------------------------------------------


def test_a_lone_repo_id_that_is_not_cached_is_a_model_not_a_prompt(env):
    fake_cached_model(env / "hub", "local/mini-attn")
    line = one_error_line(invoke("run", "local/mini-atn", input="hello"), 1, "'local/mini-atn'", "not found",
                          "mlxspec pull local/mini-atn")
    assert "local/mini-attn" in line  # the close match that is cached


def test_a_missing_repo_id_without_a_close_match_names_the_pull_command(env):
    line = one_error_line(invoke("run", "someorg/not-downloaded", "hi"), 1, "not found", "Hugging Face cache",
                          "mlxspec pull someorg/not-downloaded")
    assert "did you mean" not in line


def test_text_with_a_slash_and_spaces_is_still_a_prompt(fake_load):
    result = invoke("run", "what is 1/2 of 10?")
    assert result.exit_code == 0, result.output
    assert fake_load[-1].model_ref is None and fake_load[-1].calls[0][0] == "what is 1/2 of 10?"


# -- stdin ----------------------------------------------------------------------------------


def test_dash_reads_the_prompt_from_stdin(fake_load, tiny_llama):
    result = invoke("run", "-", input="from stdin\n")
    assert result.exit_code == 0, result.output
    assert fake_load[-1].model_ref is None and fake_load[-1].calls[0][0] == "from stdin"
    result = invoke("run", tiny_llama, "-", input="also from stdin\n")
    assert result.exit_code == 0, result.output
    assert fake_load[-1].model_ref == str(tiny_llama) and fake_load[-1].calls[0][0] == "also from stdin"


def test_a_prompt_argument_and_piped_stdin_are_joined(fake_load):
    result = invoke("run", "Summarize this.", input="def add(a, b):\n    return a + b\n")
    assert result.exit_code == 0, result.output
    assert fake_load[-1].calls[0][0] == "def add(a, b):\n    return a + b\n\nSummarize this."


def test_bytes_that_are_not_utf8_are_replaced_with_one_note(fake_load):
    result = CliRunner().invoke(cli.app, ["run"], input=b"caf\xe9 au lait\n")
    assert result.exit_code == 0, result.output
    assert fake_load[-1].calls[0][0] == "caf\ufffd au lait"
    notes = [line for line in result.stderr.splitlines() if "UTF-8" in line]
    assert len(notes) == 1 and "stdin" in notes[0]
    # argv: Python hands undecodable bytes over as lone surrogates
    result = CliRunner().invoke(cli.app, ["run", "caf\udce9", "--system", "be \udce9brief"])
    assert result.exit_code == 0, result.output
    prompt, options = fake_load[-1].calls[0]
    assert prompt == "caf\ufffd" and options["system"] == "be \ufffdbrief"
    assert len([line for line in result.stderr.splitlines() if "UTF-8" in line]) == 1


def test_latin1_argv_runs_on_the_real_demo_model(env):
    result = CliRunner().invoke(cli.app, ["run", "caf\udce9", "--max-tokens", "2", "--no-stats"])
    assert result.exit_code == 0, result.output
    assert "internal error" not in result.stderr and "UTF-8" in result.stderr


# -- flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize("args, fragment", [
    (["run", "hi", "--depth", "abc"], "--depth"),
    (["run", "hi", "--no-such-flag"], "--no-such-flag"),
    (["bench", "--reps", "x"], "--reps"),
    (["no-such-command"], "no-such-command"),
])
def test_usage_errors_are_one_error_line(env, args, fragment):
    result = invoke(*args)
    one_error_line(result, 2, fragment)
    assert "╭" not in result.output


def test_dash_capital_v_prints_the_version():
    import mlxspec

    result = invoke("-V")
    assert result.exit_code == 0 and result.stdout.startswith(f"mlxspec {mlxspec.__version__}")


def test_mlx_lm_flag_names_are_aliases(fake_load, tiny_llama):
    result = invoke("run", "-m", tiny_llama, "the prompt", "--temperature", "0.7", "--system-prompt", "be brief",
                    "--ignore-chat-template", "-n", "9", "--seed", "1")
    assert result.exit_code == 0, result.output
    assert fake_load[-1].model_ref == str(tiny_llama)
    prompt, options = fake_load[-1].calls[0]
    assert prompt == "the prompt"
    assert (options["temperature"], options["system"], options["raw"], options["max_tokens"]) == (
        0.7, "be brief", True, 9)
    result = invoke("run", "--model", tiny_llama, "--temperature", "-1", "x")
    one_error_line(result, 2, "--temp")
    one_error_line(invoke("run", "-m", tiny_llama, "m2", "p"), 2, "--model")


def test_help_shows_defaults_and_no_bool_metavars():
    run_help = invoke("run", "--help").stdout
    for fragment in ("default: 512", "default: 0.0", "default: auto"):
        assert fragment in run_help, fragment
    for command in (["run"], ["serve"], ["tune"], ["bench"], []):
        assert "<bool>" not in invoke(*command, "--help").stdout


def test_bench_takes_temp_like_run(env):
    one_error_line(invoke("bench", "no-model", "--temp", "-1"), 2, "--temp must be between 0 and")
    one_error_line(invoke("bench", "no-model", "--seed", "-1"), 2, "--seed must be between 0 and")


@pytest.mark.parametrize("flags, fragment", [
    (["--seed", "3"], "--seed"),
    (["--drafter", "none", "--depth", "3"], "--depth"),
    (["--drafter", "pld", "--draft-model", "some/draft"], "--draft-model"),
])
def test_flags_without_effect_get_a_note(fake_load, flags, fragment):
    result = invoke("run", "hi", *flags)
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:") and fragment in line]
    assert len(notes) == 1, result.stderr
    if "--draft-model" in flags:
        assert fake_load[-1].draft_ref is None  # not loaded for nothing


def test_no_note_when_the_flags_do_something(fake_load):
    result = invoke("run", "hi", "--seed", "3", "--temp", "0.7", "--drafter", "pld", "--depth", "3")
    assert result.exit_code == 0, result.output
    assert "has no effect" not in result.stderr


@pytest.mark.parametrize("ref, fragment", [
    ("./no-such-draft", "draft model folder './no-such-draft' does not exist"),
    ("nobody/no-draft", "draft model 'nobody/no-draft' not found"),
])
def test_draft_model_errors_say_draft_model(env, ref, fragment):
    one_error_line(invoke("run", "hi", "--drafter", "draft", "--draft-model", ref, "--max-tokens", "2"), 1, fragment)


# -- --json ------------------------------------------------------------------------------------


def test_json_has_model_and_finish_reason_at_the_top(env):
    result = invoke("run", "hi", "--json", "--max-tokens", "3")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["model"] == "mlxspec-demo" and out["finish_reason"] == "length"
    assert {"text", "reasoning", "tokens", "stats"} <= out.keys()


def test_third_party_warnings_stay_quiet(tiny_qwen3, tmp_path):
    """transformers' 'Token indices sequence length' warning (a tokenizer whose
    model_max_length is shorter than the prompt) does not reach stderr."""
    short = tmp_path / "short"
    shutil.copytree(tiny_qwen3, short)
    config = json.loads((short / "tokenizer_config.json").read_text())
    (short / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 8}))
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CONFIG_HOME=str(tmp_path / "config"))
    env.pop("MLXSPEC_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "mlxspec", "run", str(short), "one two three four five six seven",
                           "--max-tokens", "2", "--raw"], capture_output=True, text=True, env=env, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "Token indices" not in proc.stderr and "transformers" not in proc.stderr


# -- bench outside a checkout ------------------------------------------------------------------


def test_bench_finds_its_prompt_sets_outside_a_checkout(env, monkeypatch, tmp_path):
    from mlxspec.bench.prompts import WORKLOAD_ORDER, load_workloads
    from mlxspec.cli.bench import builtin_workloads

    assert [w.name for w in load_workloads(builtin_workloads())] == list(WORKLOAD_ORDER)
    monkeypatch.chdir(tmp_path)  # no benchmarks/ folder here
    result = invoke("bench", "--prompts", "1")
    one_error_line(result, 2, "give MODEL")
    assert "workloads" not in result.stderr
