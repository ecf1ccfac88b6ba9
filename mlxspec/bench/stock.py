"""The bench's side of the stock mlx-lm process (:mod:`.stock_worker`): start it, have it build a
shape, run generations on command, and refuse it unless its evidence says stock.

Started with ``python -m mlxspec.bench.stock_worker`` (a fresh interpreter, not a fork: nothing
this process installed is inherited). ``MLX_CUDA_GRAPH_CACHE_SIZE``, which mlxspec's import
sets where the user did not, is removed there again (the user's own value, read from the
environment this process started with, stays): stock mlx-lm runs with MLX's default.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Sequence

from ..errors import MlxspecError
from .stock_evidence import failures
from .stock_worker import GRAPH_CACHE_ENV

LABEL = "mlx-lm (stock)"


class NotStock(MlxspecError):
    """The baseline process's evidence shows something of mlxspec's in mlx-lm."""


def started_without(names=(GRAPH_CACHE_ENV,)) -> list[str]:
    """Those of ``names`` absent from the environment this process started with (Linux:
    /proc/self/environ; elsewhere the current one, where only Metal runs and ignores them)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            initial = {item.split(b"=", 1)[0].decode(errors="replace") for item in f.read().split(b"\0") if item}
    except OSError:
        initial = set(os.environ)
    return [n for n in names if n not in initial]


def build_beside(stock: StockBaseline | None, build, say, shape: str) -> None:
    """BUILD (this process's models) while STOCK builds its own copy, then wait for STOCK's;
    STOCK stops if either fails."""
    try:
        build()
        if stock is not None:
            say(f"{shape}: waiting for the stock mlx-lm process (its own model, no mlxspec kernels)")
            stock.ready()
    except BaseException:
        if stock is not None:
            stock.close()
        raise


class StockBaseline:
    """One stock mlx-lm process for one model: a random one of ``shape`` (``bits``, ``vocab``,
    ``draft_shape``: :meth:`run` generates with its logits scripted), or the checkpoint at
    ``path`` (with ``draft_path``: :meth:`stream`). ``wait``: False returns at once, the model
    still building there (:meth:`ready` waits). ``worker``: the command that starts the process
    (default: ``python -m mlxspec.bench.stock_worker``)."""

    def __init__(self, shape: str | None = None, *, bits: int = 4, vocab: int | None = None,
                 draft_shape: str | None = None, path: str | None = None, draft_path: str | None = None,
                 worker: Sequence[str] = (sys.executable, "-m", "mlxspec.bench.stock_worker"), wait: bool = True):
        command = [*worker] + [arg for name in started_without() for arg in ("--unset-env", name)]
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, bufsize=1)
        self.evidence: dict | None = None
        self.op = "load" if path else "build"
        if path:
            self._send(op="load", path=str(path), draft_path=str(draft_path) if draft_path else None)
        else:
            self._send(op="build", shape=shape, bits=bits, vocab=vocab, draft_shape=draft_shape)
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait for the model the process builds at start; its evidence, checked (else it stops)."""
        if self.evidence is not None:
            return
        try:
            self.evidence = self._answer(self.op)["evidence"]
            self.require_stock()
        except BaseException:
            self.close()
            raise

    def _send(self, **request) -> None:
        if self.proc.poll() is not None:
            raise MlxspecError(f"the stock mlx-lm process ended (exit {self.proc.returncode})")
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def _answer(self, op: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise MlxspecError(f"the stock mlx-lm process ended (exit {self.proc.wait()}) during {op}")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise MlxspecError(f"stock mlx-lm {op}: {answer['error']}")
        return answer

    def ask(self, **request) -> dict:
        self.ready()
        self._send(**request)
        return self._answer(request["op"])

    def require_stock(self) -> None:
        why = failures(self.evidence)
        if why or not self.evidence["stock"]:
            raise NotStock("the mlx-lm baseline process is not stock mlx-lm: " + "; ".join(why or ["not stock"]))

    def finish(self) -> dict:
        """The evidence checked once more (after the runs: nothing may have changed it), then
        the process stops, whatever the check said."""
        try:
            return self.recheck()
        finally:
            self.close()

    def recheck(self) -> dict:
        """The evidence again (after the runs: nothing may have changed it), checked."""
        self.evidence = self.ask(op="evidence")["evidence"]
        self.require_stock()
        return self.evidence

    def run(self, prompt, target, drafted, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
            draft_depth: int | None = None, engine: str = LABEL) -> dict:
        return self.ask(op="run", engine=engine, prompt=list(prompt), target=list(target), drafted=list(drafted),
                        max_tokens=max_tokens, temperature=temperature, seed=seed, draft_depth=draft_depth)

    def follow(self, table) -> None:
        """The scripted model's rows follow TABLE (a successor per token id) for :meth:`batch`."""
        self.ask(op="follow", table=[int(t) for t in table])

    def batch(self, prompts, max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> dict:
        """mlx-lm's ``BatchGenerator`` over PROMPTS at once: tokens, first_s, last_s per request."""
        return self.ask(op="batch", prompts=[list(p) for p in prompts], max_tokens=max_tokens,
                        temperature=temperature, seed=seed)

    def stream(self, prompt, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
               draft_depth: int | None = None) -> dict:
        """``mlx_lm.stream_generate`` there, on the checkpoint: tokens, ttft_s, decode_s,
        from_draft, finish."""
        return self.ask(op="stream", prompt=list(prompt), max_tokens=max_tokens, temperature=temperature,
                        seed=seed, draft_depth=draft_depth)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream and not stream.closed:
                stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
