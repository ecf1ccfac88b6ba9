"""Where a forward's device time goes, kernel by kernel: the batch's forward (rows x width over a
ragged cache of rows 500 + 8 i tokens long, compiled as ``serve`` runs it) and stock mlx-lm's
plain step (``0x1``: the model called over its ``KVCache``), on a real shape's random weights.

Run alone, it times each config's waited forward (build, launch, whole: medians of 15, ms; the
cache grows a token a row each time). Under Nsight Compute it runs one forward of each config
between ``cuProfilerStart``/``Stop``, a marker kernel before each, so ncu times every kernel on
the device alone (no launch gaps); ``--summarize`` then sums ncu's CSV by config and kernel:

    python3 benchmarks/diag_kernel_census.py [--shape qwen3-8b] [--configs 0x1,1x1,1x4,4x1,4x4,4x7] [--json OUT]
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        --log-file ncu.csv python3 benchmarks/diag_kernel_census.py --under-ncu
    python3 benchmarks/diag_kernel_census.py --summarize ncu.csv --json census.json

The sum of a config's kernel times is the device's share of its forward: where it is close to
the waited forward, the forward is the device's, and a kernel's time is what it costs.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MARKER = "census_marker_"
UNITS_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--configs", default="0x1,1x1,1x4,4x1,4x4,4x7", help="ROWSxWIDTH, 0x1: stock mlx-lm's plain step")
    ap.add_argument("--under-ncu", action="store_true", help="one profiled forward a config (run inside ncu)")
    ap.add_argument("--summarize", type=Path, metavar="CSV", help="sum an ncu CSV (--log-file) by config and kernel")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.summarize:
        out = summarize(args.summarize.read_text().splitlines(), args.top)
        for cfg, cell in out.items():
            print(f"== {cfg}: {cell['device_ms']:.3f} ms on the device over {cell['kernels']} kernels")
            for name, count, ms in cell["top"]:
                print(f"   {ms:8.3f} ms {count:5d}x  {name}")
    else:
        configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
        out = run(args.shape, configs, args.under_ncu)
        print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


def run(shape: str, configs: list[tuple[int, int]], under_ncu: bool) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from benchmarks.diag_batch_forward import ragged
    from benchmarks.diag_ragged_nodes import timed_forward
    from mlxspec.bench.synthetic import random_model, vocab_size

    vocab = vocab_size(shape)
    model = random_model(shape)
    caches = {B: ragged(model, B, 500, vocab, 8) for B in {b for b, _ in configs if b}}
    stock = make_prompt_cache(model)
    mx.eval(model(mx.array([[(7 * t) % vocab for t in range(500)]], mx.uint32), cache=stock))

    class Stock:
        """Stock mlx-lm's plain step over its KVCache, as ``timed_forward`` calls a cache."""

        def forward(self, x):
            return (model(x, cache=stock),)

    def forward(B: int, W: int, r: int) -> tuple[float, float, float]:
        """(build, launch, whole) seconds of one waited forward; the cache keeps a token a row."""
        x = mx.array([[(5 * i + j + 3 * r) % vocab for j in range(W)] for i in range(max(B, 1))], mx.uint32)
        mx.eval(x)
        took = timed_forward(caches[B] if B else Stock(), x)
        if B:
            caches[B].rollback([W - 1] * B)
            mx.eval([layer.state for layer in caches[B].layers])
        return took

    for B, W in configs:  # traces the compiled graphs and warms up
        for r in range(3):
            forward(B, W, r)
    mx.synchronize()
    if not under_ncu:
        out = {}
        for B, W in configs:
            times = [forward(B, W, r) for r in range(15)]
            out[f"{B}x{W}"] = {k: round(statistics.median(t[i] for t in times) * 1e3, 2)
                               for i, k in enumerate(("build_ms", "launch_ms", "forward_ms"))}
        return out
    cuda = ctypes.CDLL("libcuda.so.1")
    for B, W in configs:  # the markers' kernels are compiled before the profiled ranges
        marker(f"{B}x{W}")
    mx.synchronize()
    for B, W in configs:
        cuda.cuProfilerStart()
        marker(f"{B}x{W}")
        forward(B, W, 99)
        mx.synchronize()
        cuda.cuProfilerStop()
    return {"profiled": [f"{B}x{W}" for B, W in configs]}


def marker(tag: str) -> None:
    """A one-thread kernel named after TAG: where a config's kernels start in ncu's list."""
    import mlx.core as mx

    kernel = mx.fast.cuda_kernel(name=MARKER + tag, input_names=["a"], output_names=["o"], source="o[0] = a[0];")
    mx.eval(kernel(inputs=[mx.zeros((1,), mx.float32)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                   output_shapes=[(1,)], output_dtypes=[mx.float32])[0])


def summarize(lines: list[str], top: int) -> dict:
    """Per config (from one marker kernel to the next): device ms, kernels, and the TOP kernel
    names by time (count, ms), from ncu's CSV of ``gpu__time_duration.sum``."""
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    head = rows[0]
    name_i, metric_i, value_i, unit_i = (head.index(k) for k in ("Kernel Name", "Metric Name", "Metric Value",
                                                                 "Metric Unit"))
    by_config: dict[str, dict[str, list]] = {}
    current = None
    for r in rows[1:]:
        if len(r) <= value_i or r[metric_i] != "gpu__time_duration.sum":
            continue
        found = re.search(MARKER + r"(\w+)", r[name_i])
        if found:
            current = by_config.setdefault(found.group(1), collections.defaultdict(lambda: [0, 0.0]))
            continue
        if current is None:
            continue
        entry = current[re.sub(r"<.*", "", r[name_i])[:70]]
        entry[0] += 1
        entry[1] += float(r[value_i].replace(",", "")) * UNITS_MS[r[unit_i]]
    out = {}
    for cfg, kernels in by_config.items():
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
        out[cfg] = {"device_ms": round(sum(v[1] for v in kernels.values()), 3),
                    "kernels": sum(v[0] for v in kernels.values()),
                    "top": [[name, v[0], round(v[1], 3)] for name, v in ranked[:top]]}
    return out


if __name__ == "__main__":
    main()
