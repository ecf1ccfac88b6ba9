"""A target sharded over two processes on this machine (``mlx.launch -n 2 --backend ring``, the
ring backend over localhost) against the committed mini models: mini-hybrid (Qwen3.5
GatedDeltaNet hybrid with an MTP head), mini-attn (Qwen3.5 attention only, with its DFlash
drafter), mini-draft (a draft model). Both shard with mlx-lm's own ``shard()`` at 2 ranks
(2 attention heads, 2 / 4 linear-attention heads; the one KV head is repeated by it).

- Temperature 0: every drafter's tokens are the single process's, on every rank.
  Also a random-weight Qwen3.5 checkpoint with an untied (vocabulary-split) lm_head.
- Seeded temperature > 0: every rank commits the same tokens; they are the single process's
  where no decision reads the target's size (plain decoding, prompt lookup). The other drafters
  weigh a draft against the target's bytes, and a rank holds half of them: their gates (and
  DFlash's trees) may decide other depths and so spend the random draws elsewhere.
- Ranks given different seeds stop with a RankError rather than mixing their generations.
- ``mlxspec run`` under mlx.launch: rank 0 alone prints.
- A rank that dies ends rank 0 with one error line, not a hang.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import distributed_job
import tiny
from mlxspec.cli.console import ErrorLines
from mlxspec.models.sharding import launch_rank, launched, lost_peer

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "benchmarks" / "models"
JOB = Path(__file__).resolve().parent / "distributed_job.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
PROMPT = "def fib(n):"
TOKENS = 10
# a launch's two processes import mlx-lm and load in parallel on this machine's cores; a run
# that takes longer than this is hung
LAUNCH_TIMEOUT_S = 90

def _case(id, drafter, temperature=0.0, seed=None, **extra):
    return {"id": id, "prompt": PROMPT, "drafter": drafter, "temperature": temperature, "seed": seed,
            "max_tokens": TOKENS, **extra}


def _free_port() -> int:
    # mlx.launch's ring backend listens on this port and the next (one per rank)
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def _env(tmp_path) -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "MLXSPEC_TUNE_DIR": str(tmp_path / "tune"),
            "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}


def _launch(tmp_path, *command) -> subprocess.CompletedProcess:
    args = [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(_free_port()), "--",
            sys.executable, *map(str, command)]
    return subprocess.run(args, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=_env(tmp_path),
                          stdin=subprocess.DEVNULL, cwd=tmp_path)


HYBRID = [_case("none", "none"), _case("pld", "pld"), _case("mtp", "mtp"), _case("draft", "draft"),
          _case("seeded-none", "none", 0.8, 7), _case("seeded-pld", "pld", 0.8, 7),
          _case("own-seeds", "mtp", 0.8, "rank")]
ATTENTION = [_case("attn-dflash", "dflash"), _case("attn-dflash-chain", "dflash", tree=0),
             _case("attn-seeded-dflash", "dflash", 0.8, 3)]
# a random-weight Qwen3.5 checkpoint (tests/tiny.py) with what the mini models lack: an untied
# lm_head, which mlx-lm splits over the vocabulary (the MTP head reads it through the trunk)
UNTIED = [_case("untied-mtp", "mtp"), _case("untied-seeded-mtp", "mtp", 0.8, 2)]
JOBS = [{"target": str(MODELS / "mini-hybrid"), "draft": str(MODELS / "mini-draft"), "cases": HYBRID},
        {"target": str(MODELS / "mini-attn"), "draft": str(MODELS / "mini-attn-DFlash"), "cases": ATTENTION},
        {"target": "tiny_qwen3_5", "cases": UNTIED}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(rank 0's results, rank 1's, the single process's) for JOBS: one mlx.launch for both
    targets, the reference in this process. The single process runs temperature 0 seeded: the
    same tokens, and no verify-cost timing to wait for."""
    if not LAUNCH.exists():
        pytest.skip("mlx.launch is not installed beside python")
    tmp_path = tmp_path_factory.mktemp("sharded")
    out = tmp_path / "out"
    out.mkdir()
    # vocabulary 38 (a character tokenizer): even, as a vocabulary-split lm_head needs
    tiny_models = {"tiny_qwen3_5": str(tiny.write_checkpoint(tmp_path / "tiny_qwen3_5", "qwen3_5", vocab_size=38,
                                                             seed=4))}
    jobs = [{**job, "target": tiny_models.get(job["target"], job["target"])} for job in JOBS]
    done = _launch(tmp_path, JOB, out, json.dumps(jobs))
    files = [out / f"rank{r}.json" for r in (0, 1)]
    assert all(f.exists() for f in files), f"a rank wrote nothing:\n{done.stdout}\n{done.stderr}"
    alone = [{**job, "cases": [{**c, "seed": 0} if c["temperature"] == 0 else c
                               for c in job["cases"] if c["seed"] != "rank"]} for job in jobs]
    single = distributed_job.run(out, alone)
    return json.loads(files[0].read_text()), json.loads(files[1].read_text()), single


def test_every_rank_commits_the_same_tokens(runs):
    rank0, rank1, _ = runs
    for case in HYBRID[:-1] + ATTENTION + UNTIED:
        name = case["id"]
        assert "tokens" in rank0[name] and rank0[name]["sharded"], rank0[name]
        assert rank0[name] == rank1[name], name
        assert rank0[name]["drafter"] == case["drafter"]


def test_temperature_zero_is_the_single_process_output(runs):
    rank0, _, single = runs
    for case in HYBRID + ATTENTION + UNTIED:
        if case["temperature"] == 0:
            assert rank0[case["id"]]["tokens"] == single[case["id"]]["tokens"], case["id"]
    assert rank0["attn-dflash"]["tree_steps"] > 0  # trees verified on the sharded target, not only chains
    # drafts were rejected: each rank rolled its shard of the GatedDeltaNet state back (tape replay)
    assert rank0["mtp"]["drafted"] > rank0["mtp"]["accepted"] > 0


def test_seeded_sampling_is_the_single_process_output_where_no_decision_reads_sizes(runs):
    rank0, _, single = runs
    for name in ("seeded-none", "seeded-pld"):
        assert rank0[name]["tokens"] == single[name]["tokens"], name
    # for the untied tiny model the MTP head's gates happen to decide alike too
    assert rank0["untied-seeded-mtp"]["tokens"] == single["untied-seeded-mtp"]["tokens"]


def test_ranks_that_diverge_stop_with_an_error(runs):
    """A planted divergence (each rank its own seed) is caught on every rank, not mixed."""
    for rank in runs[:2]:
        assert rank["own-seeds"]["error"].startswith(
            "RankError: the processes of the sharded run committed different tokens (ranks [1] differ from rank 0")


def test_cli_run_prints_on_rank_zero_only(tmp_path, runs):
    args = ["-m", "mlxspec", "run", MODELS / "mini-hybrid", "-p", PROMPT, "--raw", "--temp", "0", "--seed", "1",
            "--drafter", "mtp", "-n", TOKENS, "--json"]
    done = _launch(tmp_path, *args)
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout + done.stderr  # one JSON object: rank 1 printed nothing
    # rank 0's note, once: rank 1 prints no notes
    assert done.stderr.count("note: --seed has no effect at temperature 0") == 1, done.stderr
    sharded = json.loads(lines[0])
    assert sharded["tokens"] == runs[2]["mtp"]["tokens"]
    # no per-machine timing decides a sharded run (the ranks' timings differ), and none is stored
    assert sharded["stats"]["cost_model"] == "default"
    assert not [p for p in (tmp_path / "tune").rglob("*") if p.is_file()]


# rank 1 of the dead-rank test: the CLI, killed (as by a crash or kill -9) after two steps
DYING_RANK = """
import os, sys
import mlxspec.api as api
checked = api.checked
def dying(steps, group):
    for i, step in enumerate(checked(steps, group)):
        if i == 2:
            os.kill(os.getpid(), 9)
        yield step
api.checked = dying
from mlxspec.cli import main
sys.argv = ["mlxspec", *sys.argv[1:]]
main()
"""


def test_dead_rank_ends_rank_zero_with_one_error_line(tmp_path):
    """The ranks started as mlx.launch starts them (its environment), without it: mlx.launch
    would end the others itself when one exits non-zero; here rank 0 must notice alone."""
    port = _free_port()
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    args = ["run", MODELS / "mini-hybrid", "-p", PROMPT, "--raw", "--temp", "0", "--drafter", "mtp", "-n", 200,
            "--no-stats"]
    env = {**_env(tmp_path), "MLX_HOSTFILE": str(hosts)}
    dying = subprocess.Popen([sys.executable, "-c", DYING_RANK, *map(str, args)], env={**env, "MLX_RANK": "1"},
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    started = time.monotonic()
    try:
        rank0 = subprocess.run([sys.executable, "-m", "mlxspec", *map(str, args)], env={**env, "MLX_RANK": "0"},
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    finally:
        dying.kill()
        dying.wait()
    assert dying.returncode == -signal.SIGKILL
    assert rank0.returncode == 1
    # mlxspec's one line, last; before it only the ring backend's own lines (its C++ writes them)
    *backend, last = rank0.stderr.strip().splitlines()
    assert last.startswith("error: another process of the sharded run is gone ([ring]"), rank0.stderr
    assert all(line.startswith("[ring]") for line in backend), rank0.stderr
    assert time.monotonic() - started < 60


# -- the pieces, in this process --------------------------------------------------------


def test_single_process_is_not_launched(monkeypatch):
    for name in ("MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "MLX_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not launched() and launch_rank() is None
    monkeypatch.setenv("MLX_HOSTFILE", "")  # mlx.launch -n 1: no hostfile content, one process
    assert not launched()
    monkeypatch.setenv("MLX_HOSTFILE", "/tmp/hosts.json")
    monkeypatch.setenv("MLX_RANK", "1")
    assert launched() and launch_rank() == 1


def test_follower_stderr_keeps_error_lines_only(capsys):
    lines = ErrorLines(sys.stderr, 3)
    lines.write("note: --seed has no effect\n")
    lines.write("loading model…")
    lines.write("error: model 'x' not found\n")
    assert capsys.readouterr().err == "error: rank 3: model 'x' not found\n"
    assert not lines.isatty()


def test_lost_peer_is_one_line():
    err = lost_peer(RuntimeError("[ring] connection to a peer was lost"))
    assert str(err) == ("another process of the sharded run is gone ([ring] connection to a peer was lost); "
                        "stopping")
    other = ValueError("[ring] not a backend's")
    assert lost_peer(other) is other


def test_run_under_launch_wants_the_prompt_as_an_argument(monkeypatch):
    """mlx.launch forwards stdin to every rank and never closes it: reading it would hang."""
    from typer.testing import CliRunner

    from mlxspec import cli

    monkeypatch.setenv("MLX_HOSTFILE", "/nonexistent/hosts.json")
    monkeypatch.setenv("MLX_RANK", "0")
    result = CliRunner().invoke(cli.app, ["run", str(MODELS / "mini-hybrid"), "-"], input="hi\n")
    assert result.exit_code == 2
    assert "under mlx.launch give the prompt as PROMPT or -p/--prompt" in result.output


@pytest.mark.parametrize("command", ["serve", "bench", "tune", "profile"])
def test_commands_that_cannot_shard_refuse_under_launch(monkeypatch, capsys, command):
    from mlxspec import cli

    monkeypatch.setenv("MLX_HOSTFILE", "/nonexistent/hosts.json")
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setattr(sys, "argv", ["mlxspec", command, "some-model"])
    with pytest.raises(SystemExit) as exit:
        cli.main()
    assert exit.value.code == 2
    assert capsys.readouterr().err == (f"error: `mlxspec {command}` does not run under mlx.launch: only `mlxspec run` "
                                       "shards a model (docs/distributed.md)\n")


def test_memory_counts_this_machines_shard_of_the_target(monkeypatch):
    """Under mlx.launch a machine holds 1/N of the target (and the whole draft model): the
    memory warning and the wired limit count that, not the whole target."""
    from mlxspec import presets
    from mlxspec.models import sharding

    target, draft = str(MODELS / "mini-hybrid"), str(MODELS / "mini-draft")
    whole = presets.plan_run(None, target, "draft", draft, drafter_given=True).load_bytes
    draft_bytes = presets.model_caps(draft).model_bytes
    monkeypatch.setattr(sharding, "world", lambda: type("Group", (), {"size": lambda self: 2})())
    assert presets.plan_run(None, target, "draft", draft, drafter_given=True).load_bytes == \
        (whole - draft_bytes) // 2 + draft_bytes
