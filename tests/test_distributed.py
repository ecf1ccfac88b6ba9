"""A target sharded over two processes on this machine (``mlx.launch -n 2 --backend ring``, the
ring backend over localhost) against the committed mini models: mini-hybrid (Qwen3.5
GatedDeltaNet hybrid with an MTP head), mini-attn (Qwen3.5 attention only, with its DFlash
drafter), mini-draft (a draft model). Both shard with mlx-lm's own ``shard()`` at 2 ranks
(2 attention heads, 2 / 4 linear-attention heads; the one KV head is repeated by it).

- Temperature 0: every drafter's tokens are the single process's, on every rank.
  Also a random-weight Qwen3.5 checkpoint with an untied (vocabulary-split) lm_head, and a
  Qwen3-Next one, a family mlx-lm splits by layers (pipeline parallel), with prompt lookup
  and its MTP head.
- Seeded temperature > 0: every rank commits the same tokens; they are the single process's
  where no decision reads the target's size (plain decoding, prompt lookup). The other drafters
  weigh a draft against the target's bytes, and a rank holds half of them: their gates (and
  DFlash's trees) may decide other depths and so spend the random draws elsewhere.
- Ranks given different seeds stop with a RankError rather than mixing their generations.
- ``mlxspec run`` under mlx.launch: rank 0 alone prints.
- A rank that dies ends rank 0 with one error line, not a hang; one that hangs (stopped), with
  the watchdog's line after MLXSPEC_PEER_TIMEOUT.
- ``mlxspec serve`` under mlx.launch: rank 0 serves, rank 1 follows; a client that leaves stops
  both ranks at one step; SIGTERM ends both with code 0.

Only the CLI run goes through mlx.launch itself; the other pairs start their two ranks as
mlx.launch starts them (its environment: a hostfile of two, MLX_RANK) but without it: the
launcher polls in a loop (its node threads select on the ranks' always-writable stdin: 1.1-1.3
cores on this machine for as long as the ranks live), which here took that time from the tests.
The single-process reference runs while the main pair does; the other pairs (serve, the CLI
run, the dying and the hung rank) start one at a time, each when its test does.
"""

import http.client
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
import tiny_dflash
from mlxspec.cli.console import ErrorLines
from mlxspec.engine import ranks, watchdog
from mlxspec.models.sharding import launch_rank, launched, lost_peer
from mlxspec.server.sharded import job_bytes

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "benchmarks" / "models"
JOB = Path(__file__).resolve().parent / "distributed_job.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
PROMPT = "def fib(n):"
TOKENS = 10
# a launch's two processes import mlx-lm and load in parallel on this machine's cores; a run
# that takes longer than this is hung
LAUNCH_TIMEOUT_S = 90
HUNG_TIMEOUT_S = 3  # MLXSPEC_PEER_TIMEOUT of the hung-rank test's rank 0
SERVE_TIMEOUT_S = 10  # and of the served ranks (idle, rank 0 meets its follower every 50 ms)

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


def _launch_args(*command) -> list[str]:
    return [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(_free_port()), "--",
            sys.executable, *map(str, command)]


class Started:
    """A process started in the background, its output in files (nothing blocks on a full pipe)."""

    def __init__(self, tmp_path: Path, name: str, args: list, env: dict):
        self.out, self.err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(list(map(str, args)), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                            env=env, cwd=tmp_path, start_new_session=True)

    def wait(self, timeout: float = LAUNCH_TIMEOUT_S) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) once it ends; at most TIMEOUT seconds."""
        code = self.process.wait(timeout=timeout)
        return code, self.out.read_text(), self.err.read_text()

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its group: mlx.launch's ranks too
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)


def _ranks_env(tmp_path, name: str) -> dict:
    """The environment mlx.launch gives its ranks (a hostfile of two on this machine), less MLX_RANK."""
    port = _free_port()
    hosts = tmp_path / f"{name}-hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    return {**_env(tmp_path), "MLX_HOSTFILE": str(hosts)}


class Ranks:
    """Two ranks started as mlx.launch starts them, without it (:func:`_ranks_env`): rank 0's
    ``process``, ``out`` and ``err`` as :class:`Started` has them."""

    def __init__(self, tmp_path: Path, name: str, args: list, **extra_env):
        env = {**_ranks_env(tmp_path, name), **extra_env}
        self.ranks = [Started(tmp_path, f"{name}{r}" if r else name, args, {**env, "MLX_RANK": str(r)})
                      for r in (0, 1)]
        self.process, self.out, self.err = self.ranks[0].process, self.ranks[0].out, self.ranks[0].err

    def wait(self, timeout: float = LAUNCH_TIMEOUT_S) -> tuple[list[int], str, str]:
        """([rank 0's exit code, rank 1's], rank 0's stdout, both ranks' stderr) once both end."""
        ends = [rank.wait(timeout) for rank in self.ranks]
        return [end[0] for end in ends], ends[0][1], ends[0][2] + ends[1][2]

    def kill(self) -> None:
        for rank in self.ranks:
            rank.kill()


HYBRID = [_case("none", "none"), _case("pld", "pld"), _case("mtp", "mtp"), _case("draft", "draft"),
          _case("seeded-none", "none", 0.8, 7), _case("seeded-pld", "pld", 0.8, 7),
          _case("own-seeds", "mtp", 0.8, "rank")]
# attn-dflash: a fixed tree budget and depth, so trees are verified on the sharded target
# whatever this machine's timing (unseeded, its auto budget reads rank 0's measured costs: a
# loaded CI machine once measured trees as not paying, and only chains ran)
ATTENTION = [_case("attn-dflash", "dflash", tree=8, depth=3), _case("attn-dflash-chain", "dflash", tree=0),
             _case("attn-seeded-dflash", "dflash", 0.8, 3)]
# a random-weight Qwen3.5 checkpoint (tests/tiny.py) with what the mini models lack: an untied
# lm_head, which mlx-lm splits over the vocabulary (the MTP head reads it through the trunk);
# its MTP head whole on every rank (MLXSPEC_MTP_HEAD=whole; mini-hybrid's is split, the default)
UNTIED = [_case("untied-mtp", "mtp"), _case("untied-seeded-mtp", "mtp", 0.8, 2)]
# a random-weight Qwen3-Next: mlx-lm gives its family no shard(), so sharded_load splits it by
# layers (pipeline parallel: rank 0 the last two layers, rank 1 the first two, hidden states
# sent between them); a repeating prompt, so prompt lookup drafts and is rejected
REPEATS = "abcabcabcabcabcabc"
PIPELINE = [_case("pipeline-pld", "pld", prompt=REPEATS, max_tokens=40),
            _case("pipeline-seeded-pld", "pld", 0.8, 5, prompt=REPEATS, max_tokens=40),
            # the MTP head reads the last hidden state, which the pipeline gathers to every rank
            _case("pipeline-mtp", "mtp", prompt=REPEATS, max_tokens=20),
            # DFlash reads layers 1 and 2, one on each rank: each captures its own, one all-sum;
            # a fixed depth, so its (random, never right) drafts are verified, not only tried
            _case("pipeline-dflash", "dflash", prompt=REPEATS, max_tokens=20, depth=3),
            _case("pipeline-seeded-dflash", "dflash", 0.8, 6, prompt=REPEATS, max_tokens=20, depth=3)]
JOBS = [{"target": str(MODELS / "mini-hybrid"), "draft": str(MODELS / "mini-draft"), "cases": HYBRID},
        {"target": str(MODELS / "mini-attn"), "draft": str(MODELS / "mini-attn-DFlash"), "cases": ATTENTION},
        {"target": "tiny_qwen3_5", "cases": UNTIED, "env": {"MLXSPEC_MTP_HEAD": "whole"}},
        {"target": "tiny_qwen3_next", "draft": "tiny_qwen3_next_dflash", "cases": PIPELINE}]


def _qwen3_next_checkpoint(out: Path) -> Path:
    """A tiny Qwen3-Next checkpoint as mlx-lm saves one (with the model.safetensors.index.json
    sharded_load reads to split it by layers), a character tokenizer of 38 tokens, and a random
    MTP head beside it (``mtp.safetensors``: its ``mtp.*`` tensors, an MoE block like the trunk's)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_next
    from mlx_lm.utils import save_config, save_model

    from mlxspec.models.mtp.head import QwenMTPHead

    out.mkdir(parents=True)
    tiny.write_minimal_tokenizer(out, 38)
    _, special = tiny.tokenizer_info(out)
    config = dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                  linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                  shared_expert_intermediate_size=64, mlp_only_layers=[], moe_intermediate_size=32,
                  rms_norm_eps=1e-6, vocab_size=38, rope_theta=10000.0, partial_rotary_factor=0.25,
                  max_position_embeddings=4096, full_attention_interval=2, tie_word_embeddings=False,
                  eos_token_id=[special[tiny.EOS_TOKEN]], num_nextn_predict_layers=1)
    assert not hasattr(qwen3_next.Model, "shard")  # what makes this the pipeline-parallel case
    mx.random.seed(0)
    model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")
    head = QwenMTPHead(model.args, 1)
    mx.eval(head.parameters())
    mx.save_safetensors(str(out / "mtp.safetensors"), {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, background):
    """(rank 0's results, rank 1's, the single process's) for JOBS: one mlx.launch for both
    targets, the reference in this process meanwhile. The single process runs temperature 0
    seeded: the same tokens, and no verify-cost timing to wait for."""
    tmp_path = tmp_path_factory.mktemp("sharded")
    out = tmp_path / "out"
    out.mkdir()
    # vocabulary 38 (a character tokenizer): even, as a vocabulary-split lm_head needs
    tiny_models = {"tiny_qwen3_5": str(tiny.write_checkpoint(tmp_path / "tiny_qwen3_5", "qwen3_5", vocab_size=38,
                                                             seed=4)),
                   "tiny_qwen3_next": str(_qwen3_next_checkpoint(tmp_path / "tiny_qwen3_next"))}
    tiny_models["tiny_qwen3_next_dflash"] = str(tiny_dflash.write_dflash_checkpoint(
        tmp_path / "tiny_qwen3_next_dflash", tiny_models["tiny_qwen3_next"], seed=2, target_layer_ids=[1, 2]))
    jobs = [{**job, **{k: tiny_models.get(job[k], job[k]) for k in ("target", "draft") if k in job}} for job in JOBS]
    launch = Ranks(tmp_path, "launch", [sys.executable, JOB, out, json.dumps(jobs)])
    try:
        alone = [{**job, "cases": [{**c, "seed": 0} if c["temperature"] == 0 else c
                                   for c in job["cases"] if c["seed"] != "rank"]} for job in jobs]
        single = distributed_job.run(out, alone)
        _, stdout, stderr = launch.wait()
    finally:
        launch.kill()
    files = [out / f"rank{r}.json" for r in (0, 1)]
    assert all(f.exists() for f in files), f"a rank wrote nothing:\n{stdout}\n{stderr}"
    return json.loads(files[0].read_text()), json.loads(files[1].read_text()), single


def test_every_rank_commits_the_same_tokens(runs):
    rank0, rank1, _ = runs
    for case in HYBRID[:-1] + ATTENTION + UNTIED + PIPELINE:
        name = case["id"]
        assert "tokens" in rank0[name] and rank0[name]["sharded"], rank0[name]
        assert rank0[name] == rank1[name], name
        assert rank0[name]["drafter"] == case["drafter"]


def test_temperature_zero_is_the_single_process_output(runs):
    rank0, _, single = runs
    for case in HYBRID + ATTENTION + UNTIED + PIPELINE:
        if case["temperature"] == 0:
            assert rank0[case["id"]]["tokens"] == single[case["id"]]["tokens"], case["id"]
    assert rank0["attn-dflash"]["tree_steps"] > 0  # trees verified on the sharded target, not only chains
    # drafts were rejected: each rank rolled its shard of the GatedDeltaNet state back (tape replay)
    assert rank0["mtp"]["drafted"] > rank0["mtp"]["accepted"] > 0
    assert rank0["pipeline-mtp"]["drafted"] > rank0["pipeline-mtp"]["accepted"]  # the head on a pipeline, rejected
    assert rank0["pipeline-dflash"]["drafted"] > 0  # DFlash drafted from layers that two ranks captured


def test_seeded_sampling_is_the_single_process_output_where_no_decision_reads_sizes(runs):
    rank0, _, single = runs
    for name in ("seeded-none", "seeded-pld", "pipeline-seeded-pld", "pipeline-seeded-dflash"):
        assert rank0[name]["tokens"] == single[name]["tokens"], name
    # DFlash on the pipeline kept some drafts at temperature 0.8: its draft distributions, made
    # from layers captured on two ranks, are the single process's (planted: each rank's own
    # captures with zeros for the other's layer, no all-sum: the tokens differ)
    assert rank0["pipeline-seeded-dflash"]["accepted"] > 0
    assert rank0["pipeline-pld"]["drafted"] > rank0["pipeline-pld"]["accepted"]  # a pipeline stage rolled back
    # for the untied tiny model the MTP head's gates happen to decide alike too
    assert rank0["untied-seeded-mtp"]["tokens"] == single["untied-seeded-mtp"]["tokens"]


def test_mtp_head_is_split_like_the_target_unless_asked_whole(runs):
    """By default (mini-hybrid) each rank holds part of the head (its layer's heads and MLP
    columns; fc and the norms whole) and the output stays the single process's;
    MLXSPEC_MTP_HEAD=whole (the untied job) keeps the whole head on every rank, and so does a
    pipeline-parallel target (its head split, the two ranks deadlocked)."""
    rank0, rank1, single = runs
    whole = single["mtp"]["head_nbytes"]
    assert rank0["mtp"]["head_nbytes"] == rank1["mtp"]["head_nbytes"] < 0.8 * whole
    for case in ("untied-mtp", "pipeline-mtp"):
        assert rank0[case]["head_nbytes"] == rank1[case]["head_nbytes"] == single[case]["head_nbytes"], case


def test_unseeded_sharded_runs_decide_on_rank_zeros_measured_costs(runs, tmp_path_factory):
    """An unseeded request over the ranks measures the costs once a process, every rank running
    the same forwards, and every rank decides on rank 0's figures (tuning/shared.py); a seeded
    one keeps the default curve (its decisions must repeat); no tune record is written."""
    rank0, rank1, _ = runs
    assert rank0["mtp"]["cost_model"] == "measured" and rank0["seeded-pld"]["cost_model"] == "default"
    for case in ("mtp", "pipeline-pld", "attn-dflash"):
        assert rank0[case]["curve"] == rank1[case]["curve"], case  # the same numbers, not each rank's own
    assert rank0["mtp"]["curve"]["verify"]["1"] == 1.0 and 0.25 <= rank0["mtp"]["curve"]["plain"] <= 1.0
    assert {"mtp", "draft"} <= set(rank0["draft"]["curve"]["draft"])  # each drafter's step timed when first used
    assert not list((tmp_path_factory.getbasetemp() / "sharded0" / "tune").rglob("*.json"))


def test_ranks_that_diverge_stop_with_an_error(runs):
    """A planted divergence (each rank its own seed) is caught on every rank, not mixed."""
    for rank in runs[:2]:
        assert rank["own-seeds"]["error"].startswith(
            "RankError: the processes of the sharded run committed different tokens (ranks [1] differ from rank 0")


CLI_RUN = ["-m", "mlxspec", "run", MODELS / "mini-hybrid", "-p", PROMPT, "--raw", "--temp", "0", "--seed", "1",
           "--drafter", "mtp", "-n", TOKENS, "--json"]


def test_cli_run_prints_on_rank_zero_only(background, runs):
    code, stdout, stderr = background["cli"].wait()
    lines = stdout.splitlines()
    assert code == 0 and len(lines) == 1, stdout + stderr  # one JSON object: rank 1 printed nothing
    # rank 0's note, once: rank 1 prints no notes
    assert stderr.count("note: --seed has no effect at temperature 0") == 1, stderr
    sharded = json.loads(lines[0])
    assert sharded["tokens"] == runs[2]["mtp"]["tokens"]
    # no per-machine timing decides a sharded run (the ranks' timings differ), and none is stored
    assert sharded["stats"]["cost_model"] == "default"
    assert not [p for p in (background["cli"].out.parent / "tune").rglob("*") if p.is_file()]


# rank 1 of the dead- and hung-rank tests: the CLI, which after two steps writes $FAIL_MARKER
# and sends itself $FAIL_SIGNAL (SIGKILL: gone as by a crash; SIGSTOP: hung, its sockets open)
FAILING_RANK = """
import os, sys
from pathlib import Path
import mlxspec.api as api
checked = api.checked
def failing(steps, group):
    for i, step in enumerate(checked(steps, group)):
        if i == 2:
            Path(os.environ["FAIL_MARKER"]).write_text("")
            os.kill(os.getpid(), int(os.environ["FAIL_SIGNAL"]))
        yield step
api.checked = failing
from mlxspec.cli import main
sys.argv = ["mlxspec", *sys.argv[1:]]
main()
"""
FAILING_RUN = ["run", MODELS / "mini-hybrid", "-p", PROMPT, "--raw", "--temp", "0", "-n", 200, "--no-stats"]


def _failing_pair(tmp_path: Path, name: str, sig: int, drafter: str, **rank0_env) -> tuple[Started, Started]:
    """Rank 0 (the CLI) and a failing rank 1, started as mlx.launch starts them (its environment)
    but without it: mlx.launch would end the others itself once one exits non-zero; here rank 0
    must notice alone."""
    env, run = _ranks_env(tmp_path, name), [*FAILING_RUN, "--drafter", drafter]
    rank1 = Started(tmp_path, f"{name}1", [sys.executable, "-c", FAILING_RANK, *run],
                    {**env, "MLX_RANK": "1", "FAIL_SIGNAL": str(int(sig)), "FAIL_MARKER": str(tmp_path / name)})
    rank0 = Started(tmp_path, f"{name}0", [sys.executable, "-m", "mlxspec", *run],
                    {**env, "MLX_RANK": "0", **rank0_env})
    return rank0, rank1


# a served rank: its pid in rank<r>.pid (SIGTERM goes to rank 0 itself), then the CLI
SERVE_RANK = """
import os, sys
from pathlib import Path
Path(f"rank{os.environ['MLX_RANK']}.pid").write_text(str(os.getpid()))
from mlxspec.cli import main
sys.argv = ["mlxspec", *sys.argv[1:]]
main()
"""


class Background(dict):
    """The slow process pairs, each started when a test first asks for it: `mlxspec serve` and
    `mlxspec run --json` under mlx.launch, a rank that dies and one that hangs. (Started all at
    once they were slower: ranks waiting in a collective keep a core busy.)"""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, name: str):
        tmp = self.tmp_path_factory.mktemp(name)
        if name == "serve":
            port = _free_port()
            self[name] = Ranks(tmp, "serve", [sys.executable, "-c", SERVE_RANK, "serve", MODELS / "mini-hybrid",
                                              "--port", port, "--no-ui", "--log-level", "warning"],
                               MLXSPEC_PEER_TIMEOUT=str(SERVE_TIMEOUT_S))
            self[name].port = port
        elif name == "cli":
            self[name] = Started(tmp, "cli", _launch_args(*CLI_RUN), _env(tmp))
        elif name == "dead":
            self[name] = _failing_pair(tmp, "dead", signal.SIGKILL, "mtp")
        else:
            self[name] = _failing_pair(tmp, "hung", signal.SIGSTOP, "pld", MLXSPEC_PEER_TIMEOUT=str(HUNG_TIMEOUT_S))
        return self[name]


@pytest.fixture(scope="module")
def background(tmp_path_factory):
    """The Background of this module: its processes killed (their process groups) at the end,
    whatever state they are in."""
    if not LAUNCH.exists():
        pytest.skip("mlx.launch is not installed beside python")
    started = Background(tmp_path_factory)
    try:
        yield started
    finally:
        for one in started.values():
            for process in one if isinstance(one, tuple) else (one,):
                process.kill()


def test_dead_rank_ends_rank_zero_with_one_error_line(background):
    rank0, rank1 = background["dead"]
    code, _, stderr = rank0.wait()
    code1, _, stderr1 = rank1.wait(10)
    assert code1 == -signal.SIGKILL, (code1, stderr1, stderr)  # seen once under load: rank 1 exited 1
    assert code == 1
    # mlxspec's one line, last; before it only the ring backend's own lines (its C++ writes them)
    *backend, last = stderr.strip().splitlines()
    assert last.startswith("error: another process of the sharded run is gone ([ring]"), stderr
    assert all(line.startswith("[ring]") for line in backend), stderr


def test_hung_rank_ends_rank_zero_with_the_watchdog_line(background):
    """A rank stopped (SIGSTOP: its sockets stay open, as a machine that lost power) two steps
    in: rank 0 waits in a collective until the watchdog ends it, MLXSPEC_PEER_TIMEOUT later."""
    rank0, rank1 = background["hung"]
    code, _, stderr = rank0.wait()
    assert code == 1, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"error: no step of the sharded run finished in {HUNG_TIMEOUT_S} s: another process is not answering "
        "(hung or unreachable); stopping"), stderr
    stopped = (rank1.out.parent / "hung").stat().st_mtime
    assert rank0.err.stat().st_mtime - stopped < HUNG_TIMEOUT_S + 7  # its last line: the watchdog's
    assert rank1.process.poll() is None  # still there, stopped: the watchdog spoke, not the backend


def _request(port: int, body: dict, timeout: float = 60) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.fixture(scope="module")
def served(background) -> Ranks:
    """The two ranks of `mlxspec serve` on mini-hybrid, once rank 0 answers /health."""
    serve = background["serve"]
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline:
        assert serve.process.poll() is None, serve.out.read_text() + serve.err.read_text()
        try:
            connection = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return serve
        except OSError:
            time.sleep(0.2)
    pytest.fail("the served ranks did not come up:\n" + serve.err.read_text())


def test_serve_answers_as_the_single_process(served, runs):
    status, body = _request(served.port, {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                                          "speculation": {"drafter": "mtp"}})
    assert status == 200, body
    assert body["choices"][0]["text"] == runs[2]["mtp"]["text"]
    assert body["usage"]["speculation"]["drafter"] == "mtp"
    # sampled: the ranks' per-step check fails the request unless both drew the same tokens
    status, body = _request(served.port, {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0.8, "seed": 7,
                                          "speculation": {"drafter": "pld"}})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] > 0


def test_serve_client_that_leaves_stops_every_rank_at_one_step(served, runs):
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 400, "stream": True,
                                                              "temperature": 0, "speculation": {"drafter": "pld"}}),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.sock.shutdown(socket.SHUT_RDWR)  # the client leaves long before the end
    connection.close()
    deadline = time.monotonic() + 30
    while "finish=cancelled" not in served.err.read_text():
        assert time.monotonic() < deadline, served.err.read_text()
        time.sleep(0.1)
    # had rank 1 gone on generating, this request's collectives would not meet its
    status, body = _request(served.port, {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                                          "speculation": {"drafter": "mtp"}})
    assert status == 200, body
    assert body["choices"][0]["text"] == runs[2]["mtp"]["text"]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_an_idle_follower_sleeps_between_requests(served):
    """Waiting inside a collective for the next request, the follower polled: 0.75 cores idle
    here (both ranks, measured over 5 s; 0.08 with the idle meetings). In the quietest of three
    idle seconds it now uses under a quarter of a core-second, where polling even at the fair
    share of a loaded 2-core machine (4 busy processes: half a core) uses half a core-second
    every second. (The quietest, not the first: one run saw 0.53 core-seconds over the 2 s right
    after the previous request, while the follower finished its share of that request.)"""
    follower = served.ranks[1].process.pid
    used = []
    for _ in range(3):
        before = _cpu_seconds(follower)
        time.sleep(1.0)
        used.append(_cpu_seconds(follower) - before)
    assert served.ranks[1].process.poll() is None
    assert min(used) < 0.25, used


def test_serve_ends_every_rank_with_code_zero_on_sigterm(served):
    os.kill(int((served.out.parent / "rank0.pid").read_text()), signal.SIGTERM)
    codes, stdout, stderr = served.wait(30)
    assert codes == [0, 0], stdout + stderr  # (an abort in the interpreter's teardown was -6)
    assert not [line for line in stderr.splitlines() if line.startswith("error")], stderr
    assert "requests run one at a time: the model is sharded over 2 processes (mlx.launch)" in stderr


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


def test_a_bad_mtp_head_layout_is_refused_before_the_load(monkeypatch):
    from mlxspec.errors import UsageError
    from mlxspec.models import loader

    monkeypatch.setattr(loader, "resolve_model", lambda *a: pytest.fail("looked for the model before the check"))
    monkeypatch.setenv("MLXSPEC_MTP_HEAD", "halves")
    with pytest.raises(UsageError, match=r"MLXSPEC_MTP_HEAD must be one of split, whole \(got 'halves'\)"):
        loader.load_model(str(MODELS / "mini-hybrid"), group=object())  # a group: as under mlx.launch


@pytest.mark.parametrize("command", ["bench", "tune", "profile"])
def test_commands_that_cannot_shard_refuse_under_launch(monkeypatch, capsys, command):
    from mlxspec import cli

    monkeypatch.setenv("MLX_HOSTFILE", "/nonexistent/hosts.json")
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setattr(sys, "argv", ["mlxspec", command, "some-model"])
    with pytest.raises(SystemExit) as exit:
        cli.main()
    assert exit.value.code == 2
    assert capsys.readouterr().err == (f"error: `mlxspec {command}` does not run under mlx.launch: only `mlxspec run` "
                                       "and `mlxspec serve` shard a model (docs/distributed.md)\n")


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


class Steps:
    """A decoder's steps: one token each, and whether it was closed."""

    def __init__(self, n: int):
        self.n, self.closed = n, False

    def __iter__(self):
        try:
            for i in range(self.n):
                yield [i], None
        finally:
            self.closed = True


def _ranks_say(monkeypatch, rank0_goes=lambda call: True, rank1_digest=lambda digest: digest):
    """ranks.gathered as two ranks answer it: this one (the values given), and the other whose
    go-on flag is RANK0_GOES(n-th call) (a follower's view: rank 0 decides) and digest
    RANK1_DIGEST(this one's); the values this rank gave, call by call."""
    calls = []

    def gathered(values, group):
        calls.append(list(values))
        return [[values[0], int(rank0_goes(len(calls)))], [rank1_digest(values[0]), values[1]]]

    monkeypatch.setattr(ranks, "gathered", gathered)
    return calls


def test_every_step_is_checked_once_before_the_next_one(monkeypatch):
    calls = _ranks_say(monkeypatch)
    steps = Steps(4)
    assert [t for t, _ in ranks.checked(iter(steps), None)] == [[0], [1], [2], [3]]
    assert [go for _, go in calls] == [1, 1, 1, 1] and steps.closed  # one exchange a step, each "go on"


def test_a_consumer_that_stops_stops_every_rank_at_that_step(monkeypatch):
    """Rank 0's consumer closes the stream at a step: it says "stop" in that step's exchange
    (the only collective it runs after), and a follower told so ends there too."""
    calls = _ranks_say(monkeypatch)
    steps = Steps(10)
    stream = ranks.checked(iter(steps), None)
    assert next(stream)[0] == [0] and next(stream)[0] == [1]
    stream.close()
    assert [go for _, go in calls] == [1, 0] and steps.closed
    # the follower: rank 0 says stop in the second exchange; its stream ends after two steps
    calls = _ranks_say(monkeypatch, rank0_goes=lambda call: call < 2)
    steps = Steps(10)
    assert [t for t, _ in ranks.checked(iter(steps), None)] == [[0], [1]]
    assert len(calls) == 2 and steps.closed


def test_ranks_that_commit_other_tokens_stop_at_that_step(monkeypatch):
    calls = _ranks_say(monkeypatch, rank1_digest=lambda digest: digest + 1)
    stream = ranks.checked(iter(Steps(10)), None)
    next(stream)
    with pytest.raises(Exception, match=r"committed different tokens \(ranks \[1\] differ from rank 0"):
        next(stream)
    assert len(calls) == 1


def test_watchdog_fires_only_while_a_step_is_in_flight(monkeypatch):
    now, fired = [100.0], []
    dog = watchdog.Watchdog(fire=fired.append, clock=lambda: now[0])
    monkeypatch.setenv(watchdog.TIMEOUT_ENV, "3")
    now[0] = 1e6
    assert not dog.overdue()  # idle (a follower waiting for a job): never
    with dog.watching():
        now[0] += 2.5
        assert not dog.overdue()
        dog.progress()  # a step finished: three more seconds from now
        now[0] += 2.9
        assert not dog.overdue()
        now[0] += 0.2
        assert dog.overdue() and fired[0] == 3.0
    count = len(fired)
    now[0] += 100
    assert not dog.overdue() and len(fired) == count
    with dog.watching(limit=1.5):  # the per-step exchange's shorter bound (ranks.EXCHANGE_LIMIT_S)
        now[0] += 1.6
        assert dog.overdue() and fired[-1] == 1.5
    monkeypatch.setenv(watchdog.TIMEOUT_ENV, "1")
    with dog.watching(limit=1.5):  # MLXSPEC_PEER_TIMEOUT below the limit still rules
        now[0] += 1.1
        assert dog.overdue() and fired[-1] == 1.0
    monkeypatch.setenv(watchdog.TIMEOUT_ENV, "soon")
    with pytest.raises(Exception, match="MLXSPEC_PEER_TIMEOUT must be a number of seconds above 0"):
        watchdog.timeout_s()
    monkeypatch.delenv(watchdog.TIMEOUT_ENV)
    assert watchdog.timeout_s() == 300


def test_a_serve_job_carries_the_request_without_its_callbacks():
    import pickle

    from mlxspec.api import GenerationRequest
    from mlxspec.options import ConstraintSpec

    request = GenerationRequest(max_tokens=7, temperature=0.7, top_p=0.9, seed=3, drafter="pld", depth=2, tree=0,
                                logprobs=2, constraint=ConstraintSpec("regex", "[a-z]+"), repetition_penalty=1.1,
                                logit_bias={3: -1.0}, reuse=False, checkpoints=[2], prefill_step=16,
                                on_prefill=lambda done, total: None, on_status=print, on_note=print)
    prompt, sent = pickle.loads(job_bytes([5, 6, 7], request))
    assert prompt == [5, 6, 7]
    assert sent == GenerationRequest(**{**request.__dict__, "on_prefill": None, "on_status": None, "on_note": None})


def test_worker_close_ends_the_followers_after_the_last_job():
    from mlxspec.server.worker import Worker

    class Model:
        finished = 0

        def stream(self, prompt, request):
            yield from ()

        def finish(self):
            self.finished += 1

    model = Model()
    worker = Worker(model, max_queue=1)
    assert worker.close(timeout=10) and model.finished == 1
