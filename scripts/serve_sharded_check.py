"""`mlxspec serve` under mlx.launch, checked from outside as a client sees it: rank 0 answers as
a single process does (temperature 0, the MTP head), a seeded sampled request passes every
step's rank check, a client that leaves mid-stream stops every rank, SIGTERM ends every rank
with code 0. Prints one JSON object; exit 1 when a check failed.

    python3 scripts/serve_sharded_check.py MODEL -- mlx.launch --backend nccl -n 2 [...] --

Everything after the first ``--`` starts the ranks (it must end with ``--``); this script adds
``python3 -c <rank wrapper> serve MODEL --port P --no-ui``. (The CPU tests do the same over the
ring backend: tests/test_distributed.py.)
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT, TOKENS = "def fib(n):", 10
# a served rank: its pid in rank<r>.pid (SIGTERM goes to rank 0 itself), then the CLI
RANK = """
import os, sys
from pathlib import Path
Path(f"rank{os.environ.get('MLX_RANK', os.environ.get('OMPI_COMM_WORLD_RANK', '0'))}.pid").write_text(str(os.getpid()))
from mlxspec.cli import main
sys.argv = ["mlxspec", *sys.argv[1:]]
main()
"""


def post(port: int, body: dict, timeout: float = 120) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def main(argv: list[str]) -> int:
    model, launch = argv[0], argv[argv.index("--") + 1:]
    single = subprocess.run([sys.executable, "-m", "mlxspec", "run", model, "-p", PROMPT, "--raw", "--temp", "0",
                             "--drafter", "mtp", "-n", str(TOKENS), "--json"], capture_output=True, text=True)
    want = json.loads(single.stdout.splitlines()[-1])["text"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = Path(tempfile.mkdtemp())
    err = open(work / "serve.err", "w")
    ranks = subprocess.Popen([*launch, sys.executable, "-c", RANK, "serve", model, "--port", str(port), "--no-ui",
                              "--log-level", "warning"], cwd=work, stdout=err, stderr=err, start_new_session=True)
    checks: dict = {}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and ranks.poll() is None:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        t0 = time.perf_counter()
        status, body = post(port, {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                                   "speculation": {"drafter": "mtp"}})
        checks["temp0_mtp_same_as_single_process"] = status == 200 and body["choices"][0]["text"] == want
        checks["temp0_mtp_s"] = round(time.perf_counter() - t0, 2)
        status, body = post(port, {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0.8, "seed": 7,
                                   "speculation": {"drafter": "pld"}})
        checks["seeded_pld_ok"] = status == 200 and body["usage"]["completion_tokens"] > 0
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 400, "stream": True,
                                                         "temperature": 0, "speculation": {"drafter": "pld"}}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        r.readline()
        c.sock.shutdown(socket.SHUT_RDWR)  # the client leaves
        c.close()
        deadline = time.monotonic() + 60
        while "finish=cancelled" not in (work / "serve.err").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        status, body = post(port, {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                                   "speculation": {"drafter": "mtp"}})
        checks["after_a_client_left_same"] = status == 200 and body["choices"][0]["text"] == want
        os.kill(int((work / "rank0.pid").read_text()), signal.SIGTERM)
        code = ranks.wait(120)
        log = (work / "serve.err").read_text()
        checks["sigterm_every_rank_code_0"] = code == 0 and "[WARN]" not in log
    except Exception as e:  # a report, not a traceback: what failed and the ranks' log
        checks["exception"] = f"{type(e).__name__}: {e}"
    finally:
        if ranks.poll() is None:
            os.killpg(ranks.pid, signal.SIGKILL)
    checks["log_tail"] = (work / "serve.err").read_text()[-3000:]
    print(json.dumps(checks, indent=1))
    ok = all(v for k, v in checks.items() if k not in ("log_tail", "temp0_mtp_s")) and "exception" not in checks
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
