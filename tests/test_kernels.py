"""The CUDA verify kernels, as far as a machine without a GPU can check them.

- Every kernel source compiles for an H100 (sm_90) with nvcc, in the wrapper MLX's
  ``mx.fast.cuda_kernel`` generates (skipped without nvcc): a typo fails here, not on the GPU.
- Off CUDA, or with MLXSPEC_KERNELS=0, nothing changes: mlx-lm's and MLX's paths run.
- The small-M layer swap keeps outputs and follows the timing decision.
The kernels' numbers are checked on the GPU machine: tests/test_kernels_gpu.py.
"""

import os
import shutil
import subprocess

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import gated_delta

from mlxspec import kernels
from mlxspec.kernels import gdn, gdn_grad, qmm

_CUDA_TYPES = {mx.float32: "float", mx.bfloat16: "__nv_bfloat16", mx.float16: "__half",
               mx.uint32: "uint32_t", mx.int32: "int32_t", mx.bool_: "bool"}


def _wrap(name, source, inputs, outputs, template) -> str:
    """The __global__ function MLX's CUDA custom_kernel builds around a source body."""
    args = [f"const {_CUDA_TYPES[t]}* {n}" for n, t in inputs] + [f"{_CUDA_TYPES[t]}* {n}" for n, t in outputs]
    consts = []
    for n, v in template:
        if isinstance(v, bool):
            consts.append(f"constexpr bool {n} = {str(v).lower()};")
        elif isinstance(v, int):
            consts.append(f"constexpr int {n} = {v};")
        else:
            consts.append(f"using {n} = {_CUDA_TYPES[v]};")
    return (f"__global__ void {name}({', '.join(args)}) {{\n" + "\n".join(consts) + source + "\n}\n")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_sources_compile_for_sm90(tmp_path):
    f32, bf16 = mx.float32, mx.bfloat16
    gdn_in = [("q", bf16), ("k", bf16), ("v", bf16), ("g", f32), ("beta", bf16), ("state_in", f32), ("dims", mx.int32)]
    units = []
    for mask in (False, True):
        for states in (False, True):
            src = gdn._SOURCE.replace("KEEP", "mask[b_idx * T + t]" if mask else "true")
            src = src.replace("STORE_STATE", gdn._STORE if states else "")
            units.append(_wrap(f"gdn_{mask}_{states}", src, gdn_in + ([("mask", mx.bool_)] if mask else []),
                               [("y", bf16), ("state_out", f32)] + ([("states", f32)] if states else []),
                               [("InT", bf16), ("StT", f32), ("Dk", 128), ("Vectorized", mask)]))
    units.append(_wrap("gdn_backward", gdn_grad._SOURCE,
                       gdn_in[:6] + [("states", f32), ("dy", bf16), ("dstate", f32), ("dims", mx.int32)],
                       [(n, f32) for n in ("dq", "dk", "dv", "dg", "dbeta", "dstate_in")],
                       [("InT", bf16), ("StT", f32), ("Dk", 64), ("Vectorized", False)]))
    for dtype in (f32, bf16, mx.float16):
        for bits in (4, 8):
            units.append(_wrap(f"qmm_{_CUDA_TYPES[dtype].strip('_')}_{bits}", qmm._SOURCE,
                               [("x", dtype), ("w", mx.uint32), ("scales", dtype), ("biases", dtype), ("dims", mx.int32)],
                               [("y", dtype)], [("Bits", bits), ("MaxM", 8), ("Cols", qmm.COLS), ("InT", dtype)]))
    cu = tmp_path / "kernels.cu"
    cu.write_text("#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cstdint>\n" + qmm._HEADER
                  + "namespace mlx::core::cu {\n" + "\n".join(units) + "}\n")
    done = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "--ptx", "-o", str(tmp_path / "k.ptx"), str(cu)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_kernels_are_off_without_cuda_or_when_switched_off(monkeypatch):
    if not kernels.cuda():
        assert not kernels.active()
        assert kernels.install(nn.Linear(4, 4)) == {"gdn": False, "qmm_layers": 0}
    monkeypatch.setattr(kernels, "cuda", lambda: True)
    assert kernels.active()
    monkeypatch.setenv(kernels.ENV, "0")
    assert not kernels.active()
    assert kernels.install(nn.Linear(4, 4)) == {"gdn": False, "qmm_layers": 0}


def test_gated_delta_update_is_mlx_lms_off_cuda():
    mx.random.seed(0)
    q, k = gated_delta.normalize_qk(mx.random.normal((1, 6, 2, 32)), mx.random.normal((1, 6, 2, 32)),
                                    inv_scale=32**-0.5, eps=1e-6)
    v, a, b = mx.random.normal((1, 6, 4, 32)), mx.random.normal((1, 6, 4)), mx.random.normal((1, 6, 4))
    A_log, dt_bias = mx.zeros((4,)), mx.ones((4,))
    ours = gdn.gated_delta_update(q, k, v, a, b, A_log, dt_bias)
    theirs = gated_delta.gated_delta_update(q, k, v, a, b, A_log, dt_bias)
    assert all(mx.array_equal(x, y) for x, y in zip(ours, theirs))


def test_install_points_mlx_lms_hybrids_at_the_dispatcher():
    from mlx_lm.models import qwen3_5, qwen3_next

    saved = (qwen3_5.gated_delta_update, qwen3_next.gated_delta_update)
    try:
        assert gdn.install()
        assert qwen3_5.gated_delta_update is gdn.gated_delta_update
        assert qwen3_next.gated_delta_update is gdn.gated_delta_update
    finally:
        qwen3_5.gated_delta_update, qwen3_next.gated_delta_update = saved


def test_bucket_and_eligibility():
    assert [qmm._bucket(r) for r in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    w, s, b = mx.quantize(mx.random.normal((64, 256)), group_size=64, bits=4)
    assert qmm.eligible(mx.float32, w, s, b, 64, 4, "affine")
    assert not qmm.eligible(mx.bfloat16, w, s, b, 64, 4, "affine")  # activations != scales' type
    assert not qmm.eligible(mx.float32, w, s, None, 64, 4, "affine")
    assert not qmm.eligible(mx.float32, w, s, b, 64, 3, "affine")
    assert not qmm.eligible(mx.float32, w, s, b, 64, 4, "mxfp4")


def _quantized_mlp():
    mlp = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 64, bias=False), nn.Embedding(64, 128))
    nn.quantize(mlp, group_size=64, bits=4)
    mx.eval(mlp.parameters())
    return mlp


def test_swap_follows_the_timing_and_falls_back_when_off(monkeypatch):
    mlp = _quantized_mlp()
    x = mx.random.normal((1, 3, 256))
    before = mlp.layers[1](mlp.layers[0](x))
    monkeypatch.setattr(qmm, "_TIMES", {})
    monkeypatch.setattr(qmm, "active", lambda: True)
    # the kernel "wins" only for 3 rows of the first layer's shape
    monkeypatch.setattr(qmm, "time_both", lambda m, rows, dtype: (1.0, 0.5 if rows == 3 and m.weight.shape[0] == 128 else 2.0))
    assert qmm.install(mlp) == 3
    assert isinstance(mlp.layers[0], qmm.SmallMQuantizedLinear)
    assert isinstance(mlp.layers[2], qmm.SmallMQuantizedEmbedding)
    assert [d["rows"] for d in qmm.decisions() if d["kernel"]] == [3]
    called = []
    monkeypatch.setattr(qmm, "_matmul", lambda module, x: called.append(x.shape) or mx.zeros(x.shape[:-1] + (module.weight.shape[0],)))
    mlp.layers[0](x)
    mlp.layers[0](x[:, :2])
    assert called == [(1, 3, 256)]  # 3 rows: the kernel; 2 rows: MLX's
    monkeypatch.setattr(qmm, "active", lambda: False)
    after = mlp.layers[1](mlp.layers[0](x))
    assert mx.array_equal(before, after)


def test_sweep_times_each_shape_with_the_kernels_off_too(monkeypatch):
    from mlxspec.bench_sweep import run_sweep

    monkeypatch.delenv(kernels.ENV, raising=False)
    seen = []
    monkeypatch.setattr("mlxspec.engine.costs.verify_times",
                        lambda *a, **k: seen.append(os.environ.get(kernels.ENV))
                        or {1: [0.01], 2: [0.015]})
    result = run_sweep(["smoke"], bits=0, max_tokens=2, reps=1, kernels_off=True)
    assert [s["shape"] for s in result["shapes"]] == ["smoke (kernels off)", "smoke"]
    assert seen == ["0", None]  # off first, then as the user had it
    assert result["shapes"][0]["rows"][1]["ratio"] == 1.5


def test_sweep_kernels_off_needs_cuda(monkeypatch):
    from typer.testing import CliRunner

    from mlxspec.cli import app

    monkeypatch.setattr(kernels, "cuda", lambda: False)
    done = CliRunner().invoke(app, ["bench", "--sweep", "smoke", "--kernels-off"])
    assert done.exit_code == 2 and "not running MLX's CUDA backend" in done.output
