"""Shell completion (Typer's, with MODEL, --drafter and --reasoning values) and NO_COLOR, in
real processes and on a pseudo-terminal."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def cli_env(tmp_path, **extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1",
               HF_HUB_CACHE=str(tmp_path / "hub"), XDG_CONFIG_HOME=str(tmp_path / "config"),
               _TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION="1")
    env.pop("NO_COLOR", None)
    env.update(extra)
    (tmp_path / "home").mkdir(exist_ok=True)
    return env


def mlxspec_cmd(env, *args):
    return subprocess.run([sys.executable, "-m", "mlxspec", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def complete(env, words, cword):
    env = dict(env, COMP_WORDS=words, COMP_CWORD=str(cword), _MLXSPEC_COMPLETE="complete_bash")
    proc = mlxspec_cmd(env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout.split()


def complete_here(monkeypatch, capsys, env, words, cword):
    """complete() in this process, through the console script's entry point (cli.main) with
    ENV's variables: what Typer's completion prints, without a process start (mlx and mlxspec
    imported again) for each. test_completion_of_commands_models_and_choices keeps one real
    process (the MODEL values, read from the Hugging Face cache), the script tests the rest."""
    from mlxspec.cli import main

    env = dict(env, COMP_WORDS=words, COMP_CWORD=str(cword), _MLXSPEC_COMPLETE="complete_bash")
    for key, value in env.items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setattr(sys, "argv", ["mlxspec"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main()
    out, err = capsys.readouterr()
    assert exit_.value.code in (0, None) and "Traceback" not in err, err
    return out.split()


def fake_cached_model(cache: Path, repo_id: str):
    """A Hugging Face cache entry laid out as huggingface_hub writes it (blob + snapshot link)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0" * 40
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text('{"model_type": "qwen3"}')
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "snapshots" / revision / "config.json").symlink_to("../../blobs/abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def test_completion_scripts_and_install(tmp_path):
    env = cli_env(tmp_path)
    for shell, marker in (("bash", "complete -o default -F _mlxspec_completion mlxspec"),
                          ("zsh", "#compdef mlxspec"), ("fish", "complete --command mlxspec")):
        proc = mlxspec_cmd(env, "--show-completion", shell)
        assert proc.returncode == 0 and marker in proc.stdout, proc.stderr
    proc = mlxspec_cmd(env, "--install-completion", "bash")
    assert proc.returncode == 0, proc.stderr
    home = tmp_path / "home"
    assert "_MLXSPEC_COMPLETE" in (home / ".bash_completions" / "mlxspec.sh").read_text()
    assert ".bash_completions/mlxspec.sh" in (home / ".bashrc").read_text()


def test_completion_of_commands_models_and_choices(tmp_path, monkeypatch, capsys):
    env = cli_env(tmp_path)
    here = lambda words, cword: complete_here(monkeypatch, capsys, env, words, cword)  # noqa: E731
    assert here("mlxspec ru", 1) == ["run"]
    assert {"serve", "pull", "profile"} <= set(here("mlxspec ", 1))
    fake_cached_model(tmp_path / "hub", "tiny-org/Tiny-Qwen3")
    models = complete(env, "mlxspec run ", 2)  # a real process
    assert models[0] == "tiny-org/Tiny-Qwen3" and "qwen3-0.6b" in models  # cached first, then aliases
    assert here("mlxspec run ", 2) == models
    assert here("mlxspec rm tiny", 2) == ["tiny-org/Tiny-Qwen3"]
    assert here("mlxspec run ./", 2) == []  # paths: the shell's own file completion
    assert here("mlxspec serve --drafter m", 3) == ["mtp"]
    assert here("mlxspec run --reasoning o", 3) == ["on", "off"]


def _pty_output(args, env) -> str:
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: mlxspec on a terminal
        os.execvpe(sys.executable, [sys.executable, "-m", "mlxspec", *args], env)
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.waitpid(pid, 0)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


COLOR_SGR = re.compile(r"\x1b\[([0-9;]*)m")


def _colors(text) -> set[str]:
    """SGR parameters that set a colour (30-38, 40-48, 90-107), not bold/dim/reset."""
    found = set()
    for params in COLOR_SGR.findall(text):
        for p in params.split(";"):
            if p.isdigit() and (30 <= int(p) <= 48 or 90 <= int(p) <= 107):
                found.add(p)
    return found


@pytest.mark.parametrize("args", [["--help"], ["rm", "no-such/model", "--yes"]])
def test_no_color_on_a_terminal(tmp_path, args):
    env = cli_env(tmp_path, COLUMNS="100")
    assert _colors(_pty_output(args, env)), "expected colours on a terminal without NO_COLOR"
    assert not _colors(_pty_output(args, dict(env, NO_COLOR="1")))
