"""The CUDA verify kernels (mlxspec/kernels/) against MLX's and mlx-lm's own paths, on the GPU.

Parts (each prints a table and goes into --out as JSON):
  qmm    4-bit, group 64, bf16: ms of mx.quantized_matmul and of the small-M kernel for 1..8
         rows, on the weight shapes of Qwen3-8B and of the issue's 16384x8192 example.
  gdn    the GatedDeltaNet recurrence at Qwen3.6-27B's linear-attention shape (16 key / 48
         value heads of 128), T = 1..16 and a 512-token prefill: kernel vs mlx-lm's ops loop.
  sweep  verify cost (forward of 1..16 tokens over a 256-token cache) of random 4-bit models
         in the shapes of Qwen3-8B, a Qwen3.5-9B-like hybrid and Qwen3.6-27B, with the kernels
         off (MLXSPEC_KERNELS=0: MLX's and mlx-lm's paths) and on, same process, same weights.
  train  one training step (forward, backward, AdamW) of a hybrid (3 of 4 layers GatedDeltaNet)
         and of the same model with every layer full attention, kernels off and on.

    python benchmarks/bench_kernels.py --parts qmm,gdn,sweep,train --out kernels.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import gdn_grad  # noqa: E402  (tests/gdn_grad.py: the GatedDeltaNet backward kernel, for training)
from mlxspec import kernels  # noqa: E402
from mlxspec.kernels import gdn, qmm  # noqa: E402


def _best(fn, reps=5, inner=10) -> float:
    """ms per call: the fastest of ``reps`` timings of ``inner`` back-to-back calls."""
    mx.eval(fn())  # compiles and warms up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(inner)])
        best = min(best, (time.perf_counter() - t0) / inner)
    return best * 1e3


def part_qmm() -> list[dict]:
    shapes = {"8b q/o_proj": (4096, 4096), "8b k/v_proj": (1024, 4096), "8b gate/up": (12288, 4096),
              "8b down": (4096, 12288), "8b lm_head": (151936, 4096), "16384x8192": (16384, 8192)}
    rows_out = []
    for name, (N, K) in shapes.items():
        w, s, b = mx.quantize(mx.random.normal((N, K)).astype(mx.bfloat16) * 0.02, group_size=64, bits=4)
        mx.eval(w, s, b)
        line = {"shape": name, "N": N, "K": K, "mlx_ms": {}, "kernel_ms": {}}
        for m in range(1, 9):
            x = mx.random.normal((m, K)).astype(mx.bfloat16)
            mx.eval(x)
            line["mlx_ms"][m] = round(_best(lambda: mx.quantized_matmul(
                x, w, s, b, transpose=True, group_size=64, bits=4)), 4)
            line["kernel_ms"][m] = round(_best(lambda: qmm.quantized_matmul(
                x, w, s, b, group_size=64, bits=4)), 4)
        print(f"qmm {name:12s} mlx  " + " ".join(f"{line['mlx_ms'][m]:7.3f}" for m in range(1, 9)))
        print(f"qmm {name:12s} ours " + " ".join(f"{line['kernel_ms'][m]:7.3f}" for m in range(1, 9)))
        rows_out.append(line)
    return rows_out


def part_gdn() -> list[dict]:
    from mlx_lm.models.gated_delta import gated_delta_ops

    out = []
    Hk, Hv, D = 16, 48, 128
    for T in (1, 2, 4, 8, 16, 512):
        q = mx.random.normal((1, T, Hk, D)).astype(mx.bfloat16) * 0.1
        k = mx.random.normal((1, T, Hk, D)).astype(mx.bfloat16) * 0.1
        v = mx.random.normal((1, T, Hv, D)).astype(mx.bfloat16)
        g = mx.random.uniform(0.8, 1.0, (1, T, Hv))
        beta = mx.random.uniform(0, 1, (1, T, Hv)).astype(mx.bfloat16)
        state = mx.zeros((1, Hv, D, D))
        mx.eval(q, k, v, g, beta, state)
        ops = _best(lambda: gated_delta_ops(q, k, v, g, beta, state), reps=3, inner=3 if T > 64 else 10)
        ours = _best(lambda: gdn.gated_delta_kernel(q, k, v, g, beta, state))
        print(f"gdn T={T:4d}  mlx-lm ops {ops:8.3f} ms   kernel {ours:7.3f} ms   {ops / ours:6.1f}x")
        out.append({"T": T, "ops_ms": round(ops, 4), "kernel_ms": round(ours, 4)})
    return out


def part_sweep(shapes, reps: int) -> list[dict]:
    from mlxspec.bench.synthetic import random_model, vocab_size
    from mlxspec.engine.costs import verify_times

    out = []
    widths = range(1, 17)
    for shape in shapes:
        model = random_model(shape, bits=4)  # installs the kernels
        entry = {"shape": shape}
        for label in ("off", "on"):
            with kernels.switched_off() if label == "off" else contextlib.nullcontext():
                times = verify_times(model, widths=widths, context=256, reps=reps,
                                     vocab=vocab_size(shape), warmup_each=True)
            ms = {n: statistics.median(times[n]) * 1e3 for n in widths}
            entry[label] = {"ms": {n: round(v, 4) for n, v in ms.items()},
                            "ratio": {n: round(v / ms[1], 4) for n, v in ms.items()}}
            print(f"sweep {shape:16s} kernels {label:3s} " + " ".join(f"{ms[n]:7.2f}" for n in widths))
        out.append(entry)
        del model
        mx.clear_cache()
    return out


def _train_model(attention_only: bool, hidden=1024, layers=12):
    from mlx_lm.models import qwen3_5

    text = dict(model_type="qwen3_5_text", hidden_size=hidden, num_hidden_layers=layers,
                intermediate_size=3 * hidden, num_attention_heads=8, num_key_value_heads=2,
                head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                full_attention_interval=1 if attention_only else 4, rms_norm_eps=1e-6,
                vocab_size=32000, tie_word_embeddings=False,
                rope_parameters={"type": "default", "mrope_section": [11, 11, 10],
                                 "rope_theta": 10000000, "partial_rotary_factor": 0.25})
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))
    mx.eval(model.parameters())
    return model


def part_train(batch: int, seq: int, reps: int) -> list[dict]:
    import mlx.optimizers as optim

    out = []
    gdn_grad.install()  # kernels on: the kernel forward and backward (off: mlx-lm's ops)
    mx.random.seed(0)
    tokens = mx.random.randint(0, 32000, (batch, seq + 1))
    for kind in ("hybrid", "attention-only"):
        model = _train_model(kind == "attention-only")
        model.train()
        params = sum(v.size for _, v in tree_flatten(model.parameters()))

        def loss_fn(m, x, y):
            return nn.losses.cross_entropy(m(x), y, reduction="mean")

        initial = tree_flatten(model.parameters())
        step_grad = nn.value_and_grad(model, loss_fn)
        for label in ("off", "on"):
            if kind == "attention-only" and label == "off":
                continue  # no GatedDeltaNet layer: the switch changes nothing
            model.update(tree_unflatten(initial))  # both modes train from the same weights
            opt = optim.AdamW(1e-4)
            times, losses = [], []
            with kernels.switched_off() if label == "off" else contextlib.nullcontext():
                for i in range(reps + 2):
                    t0 = time.perf_counter()
                    loss, grads = step_grad(model, tokens[:, :-1], tokens[:, 1:])
                    opt.update(model, grads)
                    mx.eval(loss, model.parameters(), opt.state)
                    losses.append(round(loss.item(), 5))
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            print(f"train {kind:15s} kernels {label:3s} {ms:9.1f} ms/step  losses {losses}  "
                  f"({params / 1e6:.0f}M params, batch {batch}x{seq})")
            out.append({"model": kind, "kernels": label, "ms_per_step": round(ms, 2),
                        "samples_ms": [round(t * 1e3, 2) for t in times], "params": params,
                        "batch": batch, "seq": seq, "losses": losses})
        del model
        mx.clear_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="qmm,gdn,sweep,train")
    ap.add_argument("--shapes", default="qwen3-8b,qwen3.5-9b-like,qwen3.6-27b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--train-seq", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not kernels.cuda():
        sys.exit("bench_kernels: needs MLX's CUDA backend (the GPU machine)")
    parts = args.parts.split(",")
    result = {"device": mx.device_info().get("device_name", str(mx.default_device())),
              "mlx": mx.__version__, "command": " ".join(sys.argv)}
    if "qmm" in parts:
        result["qmm"] = part_qmm()
    if "gdn" in parts:
        result["gdn"] = part_gdn()
    if "sweep" in parts:
        result["sweep"] = part_sweep(args.shapes.split(","), args.reps)
    if "train" in parts:
        result["train"] = part_train(args.train_batch, args.train_seq, args.reps)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
