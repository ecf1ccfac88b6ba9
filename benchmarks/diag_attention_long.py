"""Attention over long caches on the GPU: mlxspec's kernel against MLX's 1-row kernel, and
against an earlier version of the kernel (``--compare FILE``: a copy of an older
``mlxspec/kernels/attention.py``), for 1..8 query rows.

Parts:
  op     the attention op alone, bf16, Qwen3-8B's heads (32 q / 8 kv of 128) and Qwen3.6-27B's
         (24 q / 4 kv of 256), over caches of --lengths keys: the device time of a call,
         taken as the wall time of --batch independent calls evaluated together (host sync
         and launch gaps spread over them), median of --calls such batches; and the largest
         difference from MLX's op (1 row: its decode kernel; more rows: its op in float32).
         ``--target-blocks 264,528`` also times other pass-1 block targets.
  model  a random 4-bit Qwen3-8B-shaped model, its cache prefilled in 2K-token chunks to each
         of --contexts in turn, then waited forwards of --widths tokens (kept: the cache grows)
         with the kernel as shipped, with one-row attention on the kernel too ("one_row"),
         and with the compared kernel ("compare"), in interleaved rounds; median ms.

    python3 benchmarks/diag_attention_long.py --json out.json [--compare old_attention.py]
    (``--tensor-core-vectors N``: pass 1 on tensor cores from N query vectors a KV head)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_attention import HEADS  # noqa: E402
from benchmarks.bench_attention import _theirs as _mlx  # noqa: E402
from mlxspec.kernels import attention  # noqa: E402


def load_compare(path: str | None):
    """An older attention module from a file (its package-relative imports made absolute)."""
    if not path:
        return None
    text = Path(path).read_text().replace("from ..compat", "from mlxspec.compat").replace(
        "from .attention_", "from mlxspec.kernels.attention_").replace(
        "from .switch", "from mlxspec.kernels.switch").replace("from . import", "from mlxspec.kernels import")
    spec = importlib.util.spec_from_loader("mlxspec_attention_compare", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(text, path, "exec"), module.__dict__)
    return module


def _inputs(Hq, Hkv, D, L, S, seed=0):
    """Queries as mlx-lm lays them out, K/V as views of a KVCache's larger buffer."""
    from mlx_lm.models.cache import KVCache

    mx.random.seed(seed)
    cache = KVCache()
    k, v = cache.update_and_fetch(mx.random.normal((1, Hkv, S, D)).astype(mx.bfloat16),
                                  mx.random.normal((1, Hkv, S, D)).astype(mx.bfloat16))
    qs = [mx.random.normal((1, L, Hq, D)).astype(mx.bfloat16).transpose(0, 2, 1, 3) for _ in range(4)]
    mx.eval(k, v, qs)
    return qs, k, v


def time_calls(fn, qs, k, v, scale, mask, batch: int, calls: int) -> float:
    """Median ms a call of BATCH calls evaluated together."""
    times = []
    for n in range(calls + 2):
        outs = [fn(qs[i % len(qs)], k, v, scale, mask) for i in range(batch)]
        t0 = time.perf_counter()
        mx.eval(outs)
        if n >= 2:
            times.append((time.perf_counter() - t0) / batch)
    return statistics.median(times) * 1e3


def part_op(lengths, rows, batch, calls, compare, targets) -> list[dict]:
    out = []
    for name, (Hq, Hkv, D) in HEADS.items():
        for S in lengths:
            for L in rows:
                qs, k, v = _inputs(Hq, Hkv, D, L, S)
                scale, mask = D**-0.5, ("causal" if L > 1 else None)
                line = {"heads": name, "keys": S, "rows": L}
                ours = attention.verify_attention(qs[0], k, v, scale, mask).astype(mx.float32)
                if L == 1:
                    want = _mlx(qs[0], k, v, scale, None).astype(mx.float32)
                    line["mlx_ms"] = round(time_calls(_mlx, qs, k, v, scale, None, batch, calls), 4)
                else:
                    f32 = [x.astype(mx.float32) for x in (qs[0], k, v)]
                    want = _mlx(*f32, scale, mask)
                line["max_abs_err"] = float(mx.abs(ours - want).max().item())
                for blocks in targets:
                    attention.TARGET_BLOCKS = blocks
                    key = "kernel_ms" if blocks == targets[0] else f"kernel_ms_blocks{blocks}"
                    line[key] = round(time_calls(attention.verify_attention, qs, k, v, scale, mask, batch, calls), 4)
                attention.TARGET_BLOCKS = targets[0]
                if compare is not None:
                    line["compare_ms"] = round(time_calls(compare.verify_attention, qs, k, v, scale, mask,
                                                          batch, calls), 4)
                    line["compare_max_abs_err"] = float(mx.abs(
                        compare.verify_attention(qs[0], k, v, scale, mask).astype(mx.float32) - want).max().item())
                gb = 2 * k.size * k.itemsize / 1e9
                line["kernel_gb_s"] = round(gb / (line["kernel_ms"] / 1e3), 1)
                print(json.dumps(line), flush=True)
                out.append(line)
    return out


@contextlib.contextmanager
def variant(name: str, compare):
    """The dispatch as shipped, with one-row attention on the kernel, or with the compared kernel."""
    saved_from, saved_attend = attention.ONE_ROW_FROM_KEYS, attention.attend
    if name == "one_row":
        attention.ONE_ROW_FROM_KEYS = dict.fromkeys(attention.HEAD_DIMS, 1)
    elif name == "compare":
        attention.ONE_ROW_FROM_KEYS = {}
        attention.attend = compare.attend
    try:
        yield
    finally:
        attention.ONE_ROW_FROM_KEYS, attention.attend = saved_from, saved_attend


def part_model(contexts, rounds: int, shape: str, compare, widths=(1, 2, 4)) -> list[dict]:
    assert widths[0] == 1, "ratios are to the first width: 1"
    """At each context (ascending: the cache is prefilled on to the next), interleaved rounds
    of waited forwards per variant and width; the forwards' tokens stay in the cache."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxspec.bench.synthetic import random_model, vocab_size

    model = random_model(shape, bits=4)  # installs the kernels
    vocab = vocab_size(shape)
    cache = make_prompt_cache(model)
    mx.random.seed(0)
    names = ["shipped", "one_row"] + (["compare"] if compare is not None else [])
    out, fed = [], 0
    for context in contexts:
        while fed < context:
            n = min(2048, context - fed)
            mx.eval(model(mx.random.randint(0, vocab, (1, n)), cache=cache))
            mx.eval([c.state for c in cache])
            fed += n
        times = {(v, n): [] for v in names for n in widths}
        for r in range(rounds):
            order = [(v, n) for v in names for n in widths]
            for name, n in (order if r % 2 == 0 else order[::-1]):
                with variant(name, compare):
                    tokens = mx.random.randint(0, vocab, (1, n))
                    mx.eval(tokens)
                    t0 = time.perf_counter()
                    mx.eval(model(tokens, cache=cache))
                    fed += n
                    if r:  # round 0 warms up
                        times[(name, n)].append(time.perf_counter() - t0)
        result = {"shape": shape, "context": context, "rounds": rounds - 1,
                  "one_row_from_keys": dict(attention.ONE_ROW_FROM_KEYS)}
        for name in names:
            ms = {n: statistics.median(times[(name, n)]) * 1e3 for n in widths}
            result[name] = {f"ms_{n}": round(ms[n], 3) for n in widths} | {
                f"ratio_{n}_1": round(ms[n] / ms[1], 3) for n in widths if n > 1}
            print(f"model {shape} ctx {context} {name}: {result[name]}", flush=True)
        out.append(result)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--parts", default="op,model")
    ap.add_argument("--compare", default=None, help="an older attention.py to time beside this one")
    ap.add_argument("--lengths", default="1024,4096,8192,16384,32768")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--target-blocks", default=str(attention.TARGET_BLOCKS),
                    help="pass-1 block targets to time (the first is the one kept)")
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--contexts", default="1024,4096,8192,16384,32768")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shape", default="qwen3-8b", help="the model part's shape")
    ap.add_argument("--widths", default="1,2,4", help="the model part's forward widths (tokens), 1 first")
    ap.add_argument("--tensor-core-vectors", type=int, default=None,
                    help="query vectors a KV head from which pass 1 runs on tensor cores (default: as shipped)")
    args = ap.parse_args()
    compare = load_compare(args.compare)
    if args.tensor_core_vectors is not None:
        attention.TENSOR_CORE_VECTORS = args.tensor_core_vectors
        attention._plan.cache_clear()
    result = {"device": mx.device_info().get("device_name", str(mx.default_device())), "mlx": mx.__version__,
              "command": " ".join(sys.argv)}
    if "op" in args.parts:
        result["op"] = part_op([int(x) for x in args.lengths.split(",")], [int(x) for x in args.rows.split(",")],
                               args.batch, args.calls, compare, [int(x) for x in args.target_blocks.split(",")])
    if "model" in args.parts:
        result["model"] = part_model([int(x) for x in args.contexts.split(",")], args.rounds, args.shape, compare,
                                     tuple(int(x) for x in args.widths.split(",")))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
