"""The stock mlx-lm baseline of ``mlxspec bench --real-shapes`` (and of a checkpoint): a process of its own.

``mlxspec.kernels.install`` rebinds functions inside mlx-lm's modules for the whole process, so
mlx-lm run next to mlxspec's engines is not stock mlx-lm. This process builds the same
random-weight model (``synthetic.random_model(..., kernels=False)``) and scripts its logits
(:mod:`.scripted`), never importing :mod:`mlxspec.kernels`, mlxspec's engine or models, then
generates with mlx-lm's own ``generate_step`` / ``speculative_generate_step`` on command, model
loaded once, so baseline and mlxspec runs can alternate cheaply. Every answer to ``build`` and
``evidence`` carries :func:`.stock_evidence.evidence`: the proof that nothing of mlxspec's is in
mlx-lm here.

    python -m mlxspec.bench.stock_worker [--unset-env NAME ...]

Protocol: one JSON object a line on stdin, one answer a line on stdout (anything else written to
stdout goes to stderr). Requests: ``{"op": "build", "shape", "bits", "vocab", "draft_shape"}``,
``{"op": "run", "engine", "prompt", "target", "drafted", "max_tokens", "temperature", "seed",
"draft_depth"}`` (a scripted random model), ``{"op": "load", "path", "draft_path"}`` and
``{"op": "follow", "table"}`` then ``{"op": "batch", "prompts", "max_tokens", "temperature", "seed"}``
(the scripted model's rows follow a successor table: mlx-lm's ``BatchGenerator`` over several
prompts at once), ``{"op": "stream", "prompt", "max_tokens", "temperature", "seed", "draft_depth"}``
(a checkpoint, through ``mlx_lm.load`` / ``mlx_lm.stream_generate``), ``{"op": "evidence"}``, ``{"op": "quit"}``;
answers ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. ``--unset-env``: variables
mlxspec's import sets that the user had not (``MLX_CUDA_GRAPH_CACHE_SIZE``), removed before MLX
runs anything. :func:`main` takes another :class:`Worker` class: the tests start one that
installs mlxspec's kernels, and its evidence must say the process is not stock.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .stock_evidence import evidence

GRAPH_CACHE_ENV = "MLX_CUDA_GRAPH_CACHE_SIZE"  # set by mlxspec's import (see mlxspec/__init__.py)
WATCHED_ENV = (GRAPH_CACHE_ENV, "MLXSPEC_KERNELS")


def generate(model, draft, prompt: list[int], max_tokens: int, temperature: float, seed: int | None,
             draft_depth: int | None) -> dict:
    """mlx-lm's own decoding of ``prompt``: ``generate_step`` (``draft`` None) or
    ``speculative_generate_step`` with ``draft_depth`` drafts a step. Returns the tokens, the
    decode time (first token to last) and how many tokens came from the draft model."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp=temperature)
    ids = mx.array(prompt, mx.uint32)
    if draft is not None:
        steps = speculative_generate_step(ids, model, draft, sampler=sampler, max_tokens=max_tokens,
                                          num_draft_tokens=draft_depth)
    else:
        steps = generate_step(ids, model, sampler=sampler, max_tokens=max_tokens)
    tokens, stamps, from_draft = [], [], 0
    for item in steps:
        tokens.append(int(item[0]))
        stamps.append(time.perf_counter())
        from_draft += bool(item[2]) if len(item) > 2 else 0
    return {"tokens": tokens, "decode_s": stamps[-1] - stamps[0] if stamps else 0.0, "from_draft": from_draft}


def batch_generate(model, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int | None) -> dict:
    """mlx-lm's continuous batching (``BatchGenerator``, no speculation) of PROMPTS at once, each
    to MAX_TOKENS (no stop tokens). Per request: its tokens and the seconds from the start to
    its first and its last token."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    if seed is not None:
        mx.random.seed(seed)
    gen = BatchGenerator(model, sampler=make_sampler(temp=temperature), completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts))
    try:
        t0 = time.perf_counter()
        uids = gen.insert([list(p) for p in prompts], [max_tokens] * len(prompts))
        tokens = {u: [] for u in uids}
        first, last = {}, {}
        while responses := gen.next_generated():
            now = time.perf_counter() - t0
            for r in responses:
                tokens[r.uid].append(int(r.token))
                first.setdefault(r.uid, now)
                last[r.uid] = now
    finally:
        gen.close()
    return {"tokens": [tokens[u] for u in uids], "first_s": [first[u] for u in uids], "last_s": [last[u] for u in uids]}


class Worker:
    def __init__(self):
        self.model = self.draft = self.tokenizer = None
        self.scripts: list = []

    def build(self, shape: str, bits: int, vocab: int | None = None, draft_shape: str | None = None) -> dict:
        from .scripted import ScriptedLogits
        from .synthetic import random_model

        self.model = random_model(shape, bits=bits, kernels=False)
        self.draft = (random_model(draft_shape, vocab=vocab, bits=bits, seed=2, kernels=False)
                      if draft_shape else None)
        self.scripts = [ScriptedLogits(m, [0]) for m in (self.model, self.draft) if m is not None]
        return self.evidence()

    def load(self, path: str, draft_path: str | None = None) -> dict:
        """A checkpoint (and a draft model) as mlx-lm loads it (``mlx_lm.load``): for a bench on
        a real model; no script, the model's own outputs."""
        from mlx_lm import load

        self.model, self.tokenizer = load(path)
        self.draft = load(draft_path)[0] if draft_path else None
        self.scripts = []
        return self.evidence()

    def stream(self, prompt, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
               draft_depth: int | None = None) -> dict:
        """``mlx_lm.stream_generate`` on the loaded checkpoint (stops at its EOS, as mlx-lm does):
        the tokens, time to the first token, decode time (first token to last), tokens from the
        draft model and the finish reason."""
        import mlx.core as mx
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        if self.tokenizer is None:
            raise RuntimeError("stream needs a loaded checkpoint (load)")
        if seed is not None:
            mx.random.seed(seed)
        kwargs = dict(max_tokens=max_tokens, sampler=make_sampler(temp=temperature))
        if draft_depth:
            kwargs.update(draft_model=self.draft, num_draft_tokens=draft_depth)
        mx.synchronize()
        mx.clear_cache()
        tokens, stamps, from_draft, finish = [], [], 0, None
        t0 = time.perf_counter()
        for r in stream_generate(self.model, self.tokenizer, list(prompt), **kwargs):
            stamps.append(time.perf_counter())
            tokens.append(int(r.token))
            from_draft += bool(r.from_draft)
            finish = r.finish_reason
        return {"tokens": tokens, "ttft_s": stamps[0] - t0 if stamps else None,
                "decode_s": stamps[-1] - stamps[0] if stamps else 0.0, "from_draft": from_draft, "finish": finish}

    def evidence(self) -> dict:
        import mlx.core as mx
        import mlx_lm

        ev = evidence([m for m in (self.model, self.draft) if m is not None])
        ev.update(pid=os.getpid(), mlx=mx.__version__, mlx_lm=getattr(mlx_lm, "__version__", None),
                  env={k: os.environ.get(k) for k in WATCHED_ENV})
        return ev

    def run(self, engine: str, prompt, target, drafted, max_tokens: int, temperature: float = 0.0,
            seed: int | None = None, draft_depth: int | None = None) -> dict:
        import mlx.core as mx

        if not self.scripts:
            raise RuntimeError("run needs a scripted model (build)")
        draft = None
        if draft_depth:
            if self.draft is None:
                raise RuntimeError(f"{engine} needs a draft model: build gave none")
            draft = self.draft
        self.scripts[0].table = mx.array(target, mx.int32)
        self.scripts[0].follow = None
        if draft is not None:
            self.scripts[1].table = mx.array(drafted, mx.int32)
        mx.synchronize()
        mx.clear_cache()
        return generate(self.model, draft, prompt, max_tokens, temperature, seed, draft_depth)

    def set_follow(self, table) -> dict:
        """The scripted target's rows follow TABLE (``ScriptedLogits.follow``) until the next ``run``."""
        import mlx.core as mx

        if not self.scripts:
            raise RuntimeError("follow needs a scripted model (build)")
        self.scripts[0].follow = mx.array(table, mx.int32)
        return {}

    def batch(self, prompts, max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> dict:
        import mlx.core as mx

        if not self.scripts or self.scripts[0].follow is None:
            raise RuntimeError("batch needs a scripted model following a table (build, follow)")
        mx.synchronize()
        mx.clear_cache()
        return batch_generate(self.model, prompts, max_tokens, temperature, seed)

    def handle(self, request: dict) -> dict:
        op = request.pop("op", None)
        if op == "build":
            return {"evidence": self.build(**request)}
        if op == "load":
            return {"evidence": self.load(**request)}
        if op == "run":
            return self.run(**request)
        if op == "stream":
            return self.stream(**request)
        if op == "follow":
            return self.set_follow(**request)
        if op == "batch":
            return self.batch(**request)
        if op == "evidence":
            return {"evidence": self.evidence()}
        raise ValueError(f"unknown op {op!r}")


def serve(worker: Worker, requests, answers) -> None:
    """Answer ``requests`` (lines of JSON) on ``answers`` until ``quit`` or the end."""
    for line in requests:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if request.get("op") == "quit":
                break
            answer = {"ok": True, **worker.handle(request)}
        except Exception as err:  # noqa: BLE001 - every failure goes back to the bench as a message
            answer = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def main(argv=None, worker: type[Worker] = Worker) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlxspec.bench.stock_worker")
    parser.add_argument("--unset-env", action="append", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    for name in args.unset_env:  # before MLX runs anything: MLX reads them when a stream first runs
        os.environ.pop(name, None)
    answers = os.fdopen(os.dup(1), "w")  # the protocol's own copy of stdout
    os.dup2(2, 1)  # whatever else writes to stdout (Python or native) lands on stderr
    sys.stdout = sys.stderr
    serve(worker(), sys.stdin, answers)


if __name__ == "__main__":
    main()
