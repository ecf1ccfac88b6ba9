"""The command line: real processes for stdin, pipes, exit codes and the pty chat; CliRunner
with a fake model for argument handling."""

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mlxspec
from mlxspec import cli
from mlxspec.engine.stats import Stats
from mlxspec.errors import DrafterError

ROOT = Path(__file__).resolve().parents[1]
STATS_KEYS = {"drafter", "depth", "drafted", "accepted", "acceptance", "verify_steps",
              "prompt_tps", "decode_tps", "ttft_s"}


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An environment with no user config, an empty offline HF cache and no colours."""
    values = {
        "PYTHONPATH": str(ROOT),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
        "NO_COLOR": "1",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    for name in ("MLXSPEC_DEFAULT_MODEL", "MLXSPEC_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    return dict(os.environ)


def mlxspec_cmd(env, *args, stdin=""):
    return subprocess.run([sys.executable, "-m", "mlxspec", *map(str, args)], input=stdin,
                          capture_output=True, text=True, env=env, timeout=60)


def assert_one_line_error(proc, code, *fragments):
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


# -- real processes ----------------------------------------------------------


def test_version(env):
    proc = mlxspec_cmd(env, "--version")
    assert proc.returncode == 0
    assert proc.stdout.startswith(f"mlxspec {mlxspec.__version__}") and "mlx-lm" in proc.stdout


def test_run_with_prompt_argument(env, tiny_qwen3):
    proc = mlxspec_cmd(env, "run", tiny_qwen3, "Hello there", "--max-tokens", 8)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert proc.stderr.count("\n") == 1 and "tok/s" in proc.stderr  # one summary line


def test_stdin_prompt_and_json(env, tiny_qwen3):
    proc = mlxspec_cmd(env, "run", tiny_qwen3, "--json", "--max-tokens", 8, stdin="Hello there\n")
    assert proc.returncode == 0, proc.stderr
    piped = json.loads(proc.stdout)
    assert {"text", "tokens", "stats"} <= piped.keys() and STATS_KEYS <= piped["stats"].keys()
    assert piped["tokens"] and isinstance(piped["text"], str)
    # the trailing newline of stdin is not part of the prompt: same answer as the argument
    args = ["run", str(tiny_qwen3), "Hello there", "--json", "--max-tokens", "8"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == piped["tokens"]


def test_no_stats_keeps_stderr_empty(env, tiny_qwen3):
    proc = mlxspec_cmd(env, "run", tiny_qwen3, "--no-stats", "--max-tokens", 4, stdin="Hi")
    assert proc.returncode == 0 and proc.stdout and proc.stderr == ""


def test_missing_model_error(env):
    proc = mlxspec_cmd(env, "run", "someorg/not-downloaded", "Hello")
    assert_one_line_error(proc, 1, "someorg/not-downloaded", "Hugging Face cache")


def test_bad_flag_error(env, tiny_qwen3):
    assert_one_line_error(mlxspec_cmd(env, "run", tiny_qwen3, "Hi", "--temp", "-1"), 2, "--temp")


def test_mismatched_draft_model_error(env, tiny_qwen3, tiny_mismatched_vocab):
    proc = mlxspec_cmd(env, "run", tiny_qwen3, "Hi", "--drafter", "draft",
                       "--draft-model", tiny_mismatched_vocab)
    assert_one_line_error(proc, 1, "vocab")


class Pty:
    """A child process on a pseudo-terminal, with an expect-style reader."""

    def __init__(self, argv, env):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            # as a terminal starts a command: Ctrl-C delivered. An ignored or blocked SIGINT
            # survives exec, and an earlier test in this worker process may have left either
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
            os.execve(argv[0], argv, env)
        self.output = ""
        self.seen = 0  # output before this was matched by an earlier expect

    def expect(self, text, timeout=30):
        deadline = time.monotonic() + timeout
        while (found := self.output.find(text, self.seen)) < 0:
            assert time.monotonic() < deadline, f"no {text!r} in {self.output[self.seen:][-500:]!r}"
            if select.select([self.fd], [], [], 0.1)[0]:
                self.output += os.read(self.fd, 65536).decode(errors="replace")
        self.seen = found + len(text)
        return self

    def send(self, data: str):
        os.write(self.fd, data.encode())
        return self

    def wait(self, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            with_data = select.select([self.fd], [], [], 0.1)[0]
            if with_data:
                try:
                    self.output += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:
                    pass
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"mlxspec did not exit: {self.output[-500:]!r}")


def test_interactive_chat(env, tiny_qwen3):
    argv = [sys.executable, "-m", "mlxspec", "run", str(tiny_qwen3), "--drafter", "none",
            "--max-tokens", "100000"]
    chat = Pty(argv, env)
    chat.expect(">>> ").send("Hello there\n")
    chat.expect("tok/s")  # the live status line: the answer is streaming
    chat.send("\x03")  # Ctrl-C stops the answer, not the chat
    chat.expect("[stopped]").expect(">>> ").send("/stats\n")
    chat.expect("mlxspec stats").expect(">>> ").send("/reset\n")
    chat.expect("conversation cleared").expect(">>> ").send("/exit\n")
    assert chat.wait() == 0
    assert "Traceback" not in chat.output


# -- in process, with a fake model -------------------------------------------


class FakeSpecModel:
    """Records how the CLI calls the API; answers with two chunks."""

    def __init__(self, model_ref, is_demo=False):
        self.model_ref, self.is_demo, self.name = model_ref, is_demo, "fake-demo" if is_demo else "fake"
        self.calls = []

    class tokenizer:  # what starts_in_reasoning reads of the prompt
        all_special_ids = []

        @staticmethod
        def decode(ids):
            return ""

    def encode(self, prompt, **options):
        return [1, 2, 3]

    def stream(self, prompt, request, **options):
        from mlxspec.api import Chunk, GenerationRequest

        # the request's fields the CLI set (those not at their defaults), as keyword arguments;
        # callbacks (on_note...) are left out
        default = GenerationRequest()
        self.calls.append((prompt, {k: v for k, v in vars(request).items()
                                    if v != getattr(default, k) and not callable(v)} | options))
        stats = Stats(drafter="pld", depth=4, prompt_tokens=3, generated_tokens=2)

        yield Chunk(text="fake ", tokens=[1], stats=stats)
        yield Chunk(text="answer", tokens=[2], stats=stats)


@pytest.fixture
def fake_load(monkeypatch, env):
    loaded = []

    def load(model_ref, draft_model=None):
        loaded.append(FakeSpecModel(model_ref, is_demo=model_ref is None))
        return loaded[-1]

    monkeypatch.setattr("mlxspec.api.load", load)
    return loaded


def test_help_lists_run_and_its_options():
    runner = CliRunner()
    assert "run" in runner.invoke(cli.app, ["--help"]).output
    text = runner.invoke(cli.app, ["run", "--help"]).output
    for option in ("--drafter", "--draft-model", "--depth", "--temp", "--top-p", "--top-k", "--min-p",
                   "--seed", "--max-tokens", "--system", "--raw", "--json", "--no-stats"):
        assert option in text


def test_help_explains_every_drafter_and_preset():
    """run, serve and bench say what each drafter (dflash included) and preset is."""
    import typer

    from mlxspec.presets import PRESETS

    commands = typer.main.get_command(cli.app).commands

    def help_of(command, option):
        return next(p.help for p in commands[command].params if p.name == option)

    for command in ("run", "serve"):
        drafters = help_of(command, "drafter")
        for name in cli.DRAFTERS:
            assert f"{name} (" in drafters, (command, name)
        assert "DFlash block drafter made for MODEL" in drafters and "-DFlash*" in drafters
        presets = help_of(command, "preset")
        assert all(name in presets for name in PRESETS) and "dflash (a DFlash drafter" in presets
        assert "DFlash" in help_of(command, "draft_model")
    assert "15 for dflash" in help_of("run", "depth")
    assert "dflash" in help_of("bench", "drafter")


def test_one_argument_is_a_prompt_unless_it_names_a_model(fake_load, tiny_llama):
    result = CliRunner().invoke(cli.app, ["run", "Write a haiku"])
    assert result.exit_code == 0, result.output
    assert fake_load[-1].model_ref is None and fake_load[-1].calls[0][0] == "Write a haiku"
    assert result.stdout == "fake answer\n"
    assert "demo model" in result.stderr  # the default here is the demo: said on stderr

    result = CliRunner().invoke(cli.app, ["run", str(tiny_llama)], input="from stdin\n")
    assert result.exit_code == 0, result.output
    assert fake_load[-1].model_ref == str(tiny_llama) and fake_load[-1].calls[0][0] == "from stdin"
    assert "demo" not in result.stderr


def test_options_reach_the_api(fake_load):
    args = ["run", "m", "p", "--drafter", "pld", "--depth", "3", "--temp", "0.7", "--top-p", "0.9",
            "--top-k", "5", "--min-p", "0.1", "--seed", "7", "--max-tokens", "9", "--system", "be brief",
            "--raw", "--repetition-penalty", "1.2", "--presence-penalty", "0.5", "--frequency-penalty", "-0.5",
            "--penalty-window", "64"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert fake_load[-1].calls[0] == ("p", dict(
        max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=7, drafter="pld",
        depth=3, system="be brief", raw=True, template_kwargs={}, reuse=False, repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=-0.5, penalty_window=64))


@pytest.mark.parametrize("flags, fragment", [
    (["--temp", "-0.5"], "--temp"),
    (["--top-p", "-0.1"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-1"], "--top-k"),
    (["--min-p", "2"], "--min-p"),
    (["--depth", "0"], "--depth"),
    (["--depth", "17"], "--depth"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--presence-penalty", "2.5"], "--presence-penalty"),
    (["--frequency-penalty", "-3"], "--frequency-penalty"),
    (["--penalty-window", "0"], "--penalty-window"),
    (["--penalty-window", str(10**30)], "--penalty-window"),
    (["--temp", "inf"], "--temp"),
    (["--repetition-penalty", "inf"], "--repetition-penalty"),
    (["--drafter", "magic"], "unknown drafter"),
    (["--drafter", "draft"], "--draft-model"),
    (["--seed", "-5", "--temp", "0.7"], "--seed must be between 0 and"),  # was mx.random.key's TypeError
    (["--seed", str(2**64), "--temp", "0.7"], "--seed must be between 0 and"),
])
def test_bad_flag_values(fake_load, flags, fragment):
    result = CliRunner().invoke(cli.app, ["run", "m", "p", *flags])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert fragment in result.stderr and not fake_load  # rejected before loading anything


def test_api_errors_are_one_line(monkeypatch, env):
    def load(model_ref, draft_model=None):
        raise DrafterError("draft model 'd' has a different vocabulary from 't'")

    monkeypatch.setattr("mlxspec.api.load", load)
    result = CliRunner().invoke(cli.app, ["run", "m", "p", "--draft-model", "d"])
    assert result.exit_code == 1
    assert result.stderr == "error: draft model 'd' has a different vocabulary from 't'\n"


def test_unexpected_errors_are_one_line_in_main(monkeypatch, env, capsys):
    def load(model_ref, draft_model=None):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr("mlxspec.api.load", load)
    monkeypatch.setattr(sys, "argv", ["mlxspec", "run", "m", "p"])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: internal error: RuntimeError: boom second line")
    assert "MLXSPEC_DEBUG=1" in err and err.count("\n") == 1


def test_one_argument_that_looks_like_a_path_is_a_model(env):
    result = CliRunner().invoke(cli.app, ["run", "./no-such-model-folder"], input="hi")
    assert result.exit_code == 1
    assert result.stderr == "error: model folder './no-such-model-folder' does not exist\n"


def test_drafter_names_match_the_api():
    from mlxspec import api

    assert cli.DRAFTERS == api.DRAFTERS


def test_run_resolves_aliases(env, tiny_qwen3, tmp_path):
    """A user alias from config.toml names a local model; a catalog alias that is not
    downloaded is refused in one line when nothing can ask (no terminal, no --yes)."""
    config_dir = tmp_path / "xdg-config" / "mlxspec"
    config_dir.mkdir(parents=True)
    (config_dir / "config.toml").write_text(f'[aliases]\nmine = "{tiny_qwen3}"\n')
    env = dict(env, XDG_CONFIG_HOME=str(tmp_path / "xdg-config"), HF_HUB_OFFLINE="1",
               HF_HUB_CACHE=str(tmp_path / "empty-cache"))
    proc = mlxspec_cmd(env, "run", "mine", "hi", "--json", "--max-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["tokens"]) == 3
    proc = mlxspec_cmd(env, "run", "qwen3-0.6b", "hi", "--max-tokens", "3")
    assert_one_line_error(proc, 2, "not downloaded yet", "mlxspec pull qwen3-0.6b")
