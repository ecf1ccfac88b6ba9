"""Verify attention over long caches: how many keys a pass-1 block of mlxspec's kernel should
read, timed on the GPU. A cap gives long caches more chunks (more blocks in flight) than
``kernels.attention.chunks`` gives them (its count fills the GPU once, whatever the length);
the kernel takes any chunk count, so the cap is applied here by swapping ``chunks``.

Parts:
  op     the attention op alone (bf16, Qwen3-8B's and Qwen3.6-27B's heads): MLX's 1-row kernel
         (plain decoding's) and ours at 2 / 4 / 8 rows for each cap, over caches of 1K, 8K and
         32K keys growing by the rows each call; median ms.
  model  a random 4-bit Qwen3-8B-shaped model, its cache prefilled in 2K-token chunks to
         --context tokens, then forwards of 1, 2 and 4 tokens (kept, so the cache grows) for
         each cap, in interleaved rounds; median ms and the n-token / 1-token ratios.

    python3 benchmarks/diag_attention_chunks.py --json out.json [--caps none,512,256,128] [--context 32768]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_attention import HEADS, _ours, _theirs, time_op  # noqa: E402
from mlxspec.kernels import attention  # noqa: E402


def _cap(text: str) -> int | None:
    return None if text == "none" else int(text)


_chunks = attention.chunks


def set_cap(cap: int | None) -> None:
    """Let a pass-1 block read at most CAP keys (whole tiles; None: the shipped count)."""
    def capped(S: int, blocks_per_chunk: int, tiles: int = 1) -> int:
        n = _chunks(S, blocks_per_chunk, tiles)
        if cap:
            tile = attention.TILE
            n = max(n, min(-(-S // tile), -(-S // max(tile, cap // tile * tile))))
            length = -(-(-(-S // n)) // attention.TILE) * attention.TILE  # as the kernel computes it
            n = -(-S // length)
        return n

    attention.chunks = capped


def part_op(caps, lengths, rows, calls: int, warmup: int) -> list[dict]:
    out = []
    for name, (Hq, Hkv, D) in HEADS.items():
        for S in lengths:
            one, _ = time_op(_theirs, Hq, Hkv, D, 1, S, calls, warmup)
            line = {"heads": name, "keys": S, "mlx_1_row_ms": round(one, 4)}
            for L in rows:
                for cap in caps:
                    set_cap(cap)
                    ms, _ = time_op(_ours, Hq, Hkv, D, L, S, calls, warmup)
                    line[f"rows{L}_cap{cap}"] = round(ms, 4)
            print(json.dumps(line), flush=True)
            out.append(line)
    return out


def part_model(caps, context: int, rounds: int, shape: str = "qwen3-8b", widths=(1, 2, 4)) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    from mlxspec.bench.synthetic import random_model, vocab_size

    model = random_model(shape, bits=4)  # installs the kernels
    vocab = vocab_size(shape)
    cache = make_prompt_cache(model)
    mx.random.seed(0)
    for start in range(0, context, 2048):
        n = min(2048, context - start)
        mx.eval(model(mx.random.randint(0, vocab, (1, n)), cache=cache))
        mx.eval([c.state for c in cache])
    times = {(cap, n): [] for cap in caps for n in widths}
    for r in range(rounds):
        order = [(cap, n) for cap in caps for n in widths]
        for cap, n in (order if r % 2 == 0 else order[::-1]):
            set_cap(cap)
            tokens = mx.random.randint(0, vocab, (1, n))
            mx.eval(tokens)
            t0 = time.perf_counter()
            mx.eval(model(tokens, cache=cache))
            if r:  # round 0 warms up
                times[(cap, n)].append(time.perf_counter() - t0)
    result = {"shape": shape, "context": context, "rounds": rounds - 1}
    for cap in caps:
        ms = {n: statistics.median(times[(cap, n)]) * 1e3 for n in widths}
        result[f"cap{cap}"] = {f"ms_{n}": round(ms[n], 3) for n in widths} | {
            f"ratio_{n}_1": round(ms[n] / ms[1], 3) for n in widths if n > 1}
        print(f"model {shape} ctx {context} cap {cap}: {result[f'cap{cap}']}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--parts", default="op,model")
    ap.add_argument("--caps", default="none,1024,512,256,128")
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--rows", default="2,4,8")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shape", default="qwen3-8b", help="the model part's shape (smoke: a CPU check)")
    args = ap.parse_args()
    caps = [_cap(c) for c in args.caps.split(",")]
    result = {"device": mx.device_info().get("device_name", str(mx.default_device())), "mlx": mx.__version__,
              "command": " ".join(sys.argv)}
    if "op" in args.parts:
        result["op"] = part_op(caps, [int(x) for x in args.lengths.split(",")],
                               [int(x) for x in args.rows.split(",")], args.calls, args.warmup)
    if "model" in args.parts:
        result["model"] = part_model(caps, args.context, args.rounds, args.shape)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
