"""The CUDA verify kernels, as far as a machine without a GPU can check them.

- Every kernel source compiles for an H100 (sm_90) with nvcc, in the wrapper MLX's
  ``mx.fast.cuda_kernel`` generates (skipped without nvcc): a typo fails here, not on the GPU.
- Off CUDA, or with MLXSPEC_KERNELS=0, nothing changes: mlx-lm's and MLX's paths run.
- The small-M layer swap keeps outputs and follows the timing decision.
- Verify attention: off CUDA it is mlx-lm's function bit for bit; install() rebinds the modules
  a model's attention comes from; the dispatch sends exactly 2..16-row float attention with a
  supported mask to the kernel.
The kernels' numbers are checked on the GPU machine: tests/test_kernels_gpu.py.
"""

import os
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import gated_delta

import gdn_grad  # tests/gdn_grad.py: the backward kernel, outside the package
from mlxspec import kernels
from mlxspec.kernels import attention, attention_mma, attention_source, gdn, qmm, qmm_tc

_CUDA_TYPES = {mx.float32: "float", mx.bfloat16: "__nv_bfloat16", mx.float16: "__half",
               mx.uint32: "uint32_t", mx.int32: "int32_t", mx.bool_: "bool"}


def _wrap(name, source, inputs, outputs, template) -> str:
    """The __global__ function MLX's CUDA custom_kernel builds around a source body: each input's
    pointer, then its shape, strides and ndim where the source names them (``x_shape``...)."""
    args = []
    for n, t in inputs:
        args.append(f"const {_CUDA_TYPES[t]}* {n}")
        args += [f"const __grid_constant__ {kind} {n}_{suffix}"
                 for kind, suffix in (("Shape", "shape"), ("Strides", "strides"), ("int", "ndim"))
                 if f"{n}_{suffix}" in source]
    args += [f"{_CUDA_TYPES[t]}* {n}" for n, t in outputs]
    consts = []
    for n, v in template:
        if isinstance(v, bool):
            consts.append(f"constexpr bool {n} = {str(v).lower()};")
        elif isinstance(v, int):
            consts.append(f"constexpr int {n} = {v};")
        else:
            consts.append(f"using {n} = {_CUDA_TYPES[v]};")
    return (f"__global__ void {name}({', '.join(args)}) {{\n" + "\n".join(consts) + source + "\n}\n")


# What MLX's JIT prelude (mlx/backend/cuda/device/utils.cuh and custom_kernel.cpp's default
# header) gives a kernel that the sources use: Shape / Strides (MAX_NDIM 10) and the `inf` macro.
_PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cuda/std/array>
#include <cuda/std/limits>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
#define inf cuda::std::numeric_limits<float>::infinity()
"""


def _attention_units(splits=("queries", "keys")) -> list[str]:
    """Every attention kernel variant of SPLITS: their query tiles, head sizes, float types
    (tensor cores: bf16 and fp16), mask kinds (additive masks in the queries' type and in
    float32); pass 2 with the CUDA-core splits."""
    units = []
    for D in attention.HEAD_DIMS:
        tiles = {"queries": [attention.QUERIES_PER_WARP], "keys": attention.KEY_SPLIT_TILES[D],
                 "mma": attention_mma.TILES}
        for dtype in attention.DTYPES:
            tname = _CUDA_TYPES[dtype].strip("_")
            for kind in attention_source.MASK_KINDS:
                mask_types = {"bool": [mx.bool_], "add": [dtype, mx.float32]}.get(kind, [None])
                for mtype in dict.fromkeys(mask_types):
                    inputs = [("queries", dtype), ("keys", dtype), ("values", dtype), ("scale", mx.float32)]
                    if mtype is not None:
                        inputs.append(("mask", mtype))
                    assert [n for n, _ in inputs] == attention.partial_inputs(kind)
                    for split in splits:
                        if split == "mma" and dtype not in attention.TENSOR_CORE_DTYPES:
                            continue
                        for qpw in tiles[split]:
                            template = [("T", dtype), ("D", D), ("NW", attention.WARPS),
                                        ("MT" if split == "mma" else "QPW", qpw)]
                            if kind == "add":
                                template.append(("MaskT", mtype))
                            name = f"attn_{split}_{kind}_{tname}_{D}_{_CUDA_TYPES[mtype or dtype].strip('_')}_{qpw}"
                            units.append(_wrap(name, attention_source.partial_source(kind, split), inputs,
                                               [("part_o", mx.float32), ("part_m", mx.float32),
                                                ("part_l", mx.float32)], template))
            if "mma" not in splits:
                units.append(_wrap(f"attn_combine_{tname}_{D}", attention_source.COMBINE,
                                   [("part_o", mx.float32), ("part_m", mx.float32), ("part_l", mx.float32)],
                                   [("out", dtype)], [("T", dtype), ("D", D)]))
    return units


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
                               [("x", dtype), ("w", mx.uint32), ("scales", dtype), ("biases", dtype),
                                ("dims", mx.int32)],
                               [("y", dtype)], [("Bits", bits), ("MaxM", 8), ("Cols", qmm.COLS), ("InT", dtype)]))
    for dtype in qmm_tc.DTYPES:
        for col_tiles, row_tiles in ((1, 1), (2, 4)):
            units.append(_wrap(f"qmm_tc_{_CUDA_TYPES[dtype].strip('_')}_{col_tiles}_{row_tiles}", qmm_tc._SOURCE,
                               [("x", dtype), ("w", mx.uint32), ("scales", dtype), ("biases", dtype),
                                ("dims", mx.int32)],
                               [("y", dtype)], [("InT", dtype), ("MT", col_tiles), ("NT", row_tiles), ("KW", 4)]))
    cu = tmp_path / "kernels.cu"
    units += _attention_units()
    cu.write_text(_PRELUDE + qmm._HEADER + qmm_tc._HEADER + attention_source.HEADER
                  + "namespace mlx::core::cu {\n" + "\n".join(units) + "}\n")
    # -O0: the front end's checks are the point, and optimizing ~50 variants takes seconds
    done = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "--ptx", "-Xcicc", "-O0",
                           "-o", str(tmp_path / "k.ptx"), str(cu)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    # the tensor-core attention has its own header (its mma helper is also qmm_tc's)
    cu_mma = tmp_path / "attention_mma.cu"
    cu_mma.write_text(_PRELUDE + attention_mma.HEADER_MMA + "namespace mlx::core::cu {\n"
                      + "\n".join(_attention_units(("mma",))) + "}\n")
    done = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "--ptx", "-Xcicc", "-O0",
                           "-o", str(tmp_path / "mma.ptx"), str(cu_mma)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_kernels_are_off_without_cuda_or_when_switched_off(monkeypatch):
    if not kernels.cuda():
        assert not kernels.active()
        assert kernels.install(nn.Linear(4, 4)) == {"gdn": False, "qmm_layers": 0, "attention_modules": 0}
    monkeypatch.setattr(kernels.switch, "cuda", lambda: True)
    monkeypatch.setattr(kernels.switch, "enabled", True)
    assert kernels.active()
    with kernels.switched_off():
        assert not kernels.active() and os.environ[kernels.ENV] == "0"
        assert kernels.install(nn.Linear(4, 4)) == {"gdn": False, "qmm_layers": 0, "attention_modules": 0}
    assert kernels.active()
    monkeypatch.setattr(kernels.switch, "enabled", False)  # MLXSPEC_KERNELS=0 when the process started
    assert not kernels.active()


def test_the_switch_reads_the_environment_once(monkeypatch):
    """MLXSPEC_KERNELS is read when the kernels' module is imported (a fresh interpreter here),
    not on every layer call: decoding on CUDA is host-bound and the read cost more than a call."""
    code = "from mlxspec.kernels import switch; print(switch.enabled)"
    for env, want in (("0", "False"), ("1", "True"), (None, "True")):
        run_env = {k: v for k, v in os.environ.items() if k != kernels.ENV}
        if env is not None:
            run_env[kernels.ENV] = env
        done = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        assert done.stdout.strip() == want, env


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


def test_tensor_core_eligibility_and_route(monkeypatch):
    """2..32 rows of bf16/fp16 activations on 4-bit weights, K a multiple of 128, go to the
    tensor-core kernel, 33..72 rows to it too (in even pieces of at most 32, one call); float32
    activations take the small-M kernel up to 8 rows; 8-bit, an odd K, 1 row and 73 rows are
    not the tensor-core kernel's."""
    w, s, b = mx.quantize(mx.random.normal((64, 256)).astype(mx.bfloat16), group_size=64, bits=4)
    assert qmm_tc.eligible(mx.bfloat16, w, s, b, 64, 4, "affine")
    assert not qmm_tc.eligible(mx.float32, w, s, b, 64, 4, "affine")
    w8, s8, b8 = mx.quantize(mx.random.normal((64, 256)).astype(mx.bfloat16), group_size=64, bits=8)
    assert not qmm_tc.eligible(mx.bfloat16, w8, s8, b8, 64, 8, "affine")
    w3, s3, b3 = mx.quantize(mx.random.normal((64, 192)).astype(mx.bfloat16), group_size=64, bits=4)
    assert not qmm_tc.eligible(mx.bfloat16, w3, s3, b3, 64, 4, "affine")  # K = 192
    assert qmm_tc.split_k(4096, 4096, 2) == 8 and qmm_tc.split_k(151936, 4096, 2) == 1
    assert qmm_tc.split_k(4096, 256, 2) == 1  # 2 passes of 128 k: one warp
    mlp = _bf16_quantized_layer()
    monkeypatch.setattr(qmm, "active", lambda: True)
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", 0)
    assert qmm.install(mlp) == 1
    wide, small = _record_routes(monkeypatch)
    for rows in (1, 2, 8, 9, 32):
        mlp.layers[0](mx.zeros((1, rows, 256), mx.bfloat16))
    for rows in (2, 20):
        mlp.layers[0](mx.zeros((1, rows, 256)))  # float32 activations
    assert wide == [2, 8, 9, 32] and small == [2]
    # 40 rows (8 rows of 5 tokens): one call, in X's own shape
    x = mx.arange(8 * 5 * 256).reshape(8, 5, 256).astype(mx.bfloat16)
    y = mlp.layers[0](x)
    assert wide[4:] == [40] and y.shape == (8, 5, 64) and mx.array_equal(y, x[..., :64])
    for rows in (33, 72, 73):
        mlp.layers[0](mx.zeros((1, rows, 256), mx.bfloat16))
    assert wide[5:] == [33, 72]  # 73 rows: MLX's
    monkeypatch.setattr(qmm, "TC_ROWS", range(0))
    for rows in (8, 20, 40):
        mlp.layers[0](mx.zeros((1, rows, 256), mx.bfloat16))
    assert len(wide) == 7 and small == [2, 8]
    # the kernel's pieces (a grid row each): as few as fit 32 rows, as even as can be
    assert [qmm_tc.pieces(r) for r in (1, 32, 33, 40, 64, 72, 256)] == [
        (1, 1), (1, 32), (2, 17), (2, 20), (2, 32), (3, 24), (8, 32)]
    plan, dims = qmm_tc._launch(40, 4096, 1024, 64, mx.bfloat16, 2, None)
    assert plan["grid"][1] == 2 and dict(plan["template"])["NT"] == 3 and dims.tolist() == [40, 4096, 1024, 64, 20]


def _bf16_quantized_layer() -> nn.Sequential:
    """One 4-bit 64 x 256 layer with bf16 scales (the tensor-core kernel's layout), not installed."""
    layer = nn.Linear(256, 64, bias=False)
    layer.set_dtype(mx.bfloat16)
    return nn.Sequential(nn.QuantizedLinear.from_linear(layer, group_size=64, bits=4))


def _record_routes(monkeypatch) -> tuple[list[int], list[int]]:
    """The tensor-core and small-M kernels replaced by recorders of the rows each is given (their
    output: the input's first 64 columns): (tensor-core rows, small-M rows)."""
    wide, small = [], []
    monkeypatch.setattr(qmm_tc, "quantized_matmul",
                        lambda x, w, *a, **k: wide.append(x.size // x.shape[-1]) or x[..., :64])
    monkeypatch.setattr(qmm, "quantized_matmul", lambda x, w, *a, **k: small.append(x.shape[-2]) or x[..., :64])
    return wide, small


def _quantized_mlp():
    mlp = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 64, bias=False), nn.Embedding(64, 128))
    nn.quantize(mlp, group_size=64, bits=4)
    mx.eval(mlp.parameters())
    return mlp


def test_swap_sends_2_to_8_rows_to_the_kernel_and_falls_back_when_off(monkeypatch):
    mlp = _quantized_mlp()
    x = mx.random.normal((1, 9, 256))
    before = mlp.layers[1](mlp.layers[0](x))
    monkeypatch.setattr(qmm, "active", lambda: True)
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", 0)  # these toy matrices are small
    assert qmm.install(mlp) == 3
    assert isinstance(mlp.layers[0], qmm.SmallMQuantizedLinear)
    assert isinstance(mlp.layers[2], qmm.SmallMQuantizedEmbedding)
    called = []
    monkeypatch.setattr(qmm, "_matmul", lambda module, x, kernel: called.append(x.shape)
                        or mx.zeros(x.shape[:-1] + (module.weight.shape[0],)))
    for rows in (1, 2, 8, 9):
        mlp.layers[0](x[:, :rows])
    assert called == [(1, 2, 256), (1, 8, 256)]  # 1 row (decode) and 9 rows: MLX's
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", mlp.layers[0].weight.nbytes + 1)
    mlp.layers[0](x[:, :4])
    assert len(called) == 2  # a matrix below the size limit: MLX's
    monkeypatch.setattr(qmm, "active", lambda: False)
    after = mlp.layers[1](mlp.layers[0](x))
    assert mx.array_equal(before, after)


def test_a_shards_quantized_layers_swap_keep_their_collective_and_come_back(monkeypatch):
    """A tensor-parallel target's layers (mlx's sharded quantized classes) get the kernel for
    their local matmul; the row-split layer's all-sum still runs, after it; uninstall gives
    mlx's classes back. Over one rank the all-sum is the identity, so outputs are checkable."""
    from mlx.nn.layers.distributed import QuantizedAllToShardedLinear, QuantizedShardedToAllLinear

    group = mx.distributed.init()
    mlp = _quantized_mlp()
    col = QuantizedAllToShardedLinear.from_quantized_linear(mlp.layers[0], group=group)
    row = QuantizedShardedToAllLinear.from_quantized_linear(mlp.layers[1], group=group)
    model = nn.Sequential(col, row)
    x = mx.random.normal((1, 4, 256))
    before = model(x)
    monkeypatch.setattr(qmm, "active", lambda: True)
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", 0)
    assert qmm.install(model) == 2
    assert isinstance(col, qmm.SmallMQuantizedAllToShardedLinear)
    assert isinstance(row, qmm.SmallMQuantizedShardedToAllLinear)
    called, summed = [], []
    all_sum = mx.distributed.all_sum
    monkeypatch.setattr(mx.distributed, "all_sum",
                        lambda y, group=None: summed.append(y.shape) or all_sum(y, group=group))

    def matmul(module, y, kernel):  # the kernel's place, filled by MLX's matmul (no CUDA here)
        called.append(type(module))
        return mx.quantized_matmul(y, module["weight"], module["scales"], module["biases"], transpose=True,
                                   group_size=module.group_size, bits=module.bits)

    monkeypatch.setattr(qmm, "_matmul", matmul)
    assert mx.allclose(model(x), before, atol=1e-5)
    assert called == [qmm.SmallMQuantizedAllToShardedLinear, qmm.SmallMQuantizedShardedToAllLinear]
    assert summed == [(1, 4, 64)]  # the row-split layer's partial sums, once
    model(x[:, :1])
    assert len(called) == 2  # decode: mlx's layers
    assert kernels.uninstall(model) == 2
    assert type(col) is QuantizedAllToShardedLinear and type(row) is QuantizedShardedToAllLinear


def test_uninstall_leaves_a_process_stock(monkeypatch, mlx_lm_bindings_kept):
    """What bench --sharded does before each baseline run in its own process: after install,
    uninstall leaves the stock evidence clean (mlx-lm's functions, mlx's layer classes)."""
    from mlxspec.bench.stock_evidence import evidence, failures

    model = _tiny_qwen3()
    nn.quantize(model, group_size=64, bits=4)
    monkeypatch.setattr(kernels, "active", lambda: True)
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", 0)
    done = kernels.install(model)
    assert done["qmm_layers"] > 0 and done["attention_modules"] == 1
    dirty = [f for f in failures(evidence([model])) if not f.startswith("imported ")]
    assert dirty  # the check sees what install did
    assert kernels.uninstall(model) == done["qmm_layers"] + 1 + 2  # layers, attention, both GDN users
    assert [f for f in failures(evidence([model])) if not f.startswith("imported ")] == []
    assert kernels.uninstall(model) == 0


def test_sweep_times_each_shape_with_the_kernels_off_too(monkeypatch):
    from mlxspec.bench.sweep import run_sweep

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

    monkeypatch.setattr(kernels.switch, "cuda", lambda: False)
    done = CliRunner().invoke(app, ["bench", "--sweep", "smoke", "--kernels-off"])
    assert done.exit_code == 2 and "not running MLX's CUDA backend" in done.output


# --- verify attention -------------------------------------------------------------------------

def _qkv(B=1, Hq=8, Hkv=2, L=4, S=40, D=64, dtype=mx.float32, seed=0):
    """Queries in mlx-lm's layout (a transposed view) and K/V as a KVCache hands them out
    (views of its 256-step buffer) after a prefill and one more step."""
    from mlx_lm.models.cache import KVCache

    mx.random.seed(seed)
    q = mx.random.normal((B, L, Hq, D)).astype(dtype).transpose(0, 2, 1, 3)
    cache = KVCache()
    for n in (S - L, L):
        if n:
            k, v = cache.update_and_fetch(mx.random.normal((B, Hkv, n, D)).astype(dtype),
                                          mx.random.normal((B, Hkv, n, D)).astype(dtype))
    return q, k, v, cache


def _masks(B, Hq, L, S, dtype=mx.float32):
    from mlx_lm.models.base import create_causal_mask

    window = create_causal_mask(L, S - L, window_size=max(2, S // 3))  # a sliding window, [L, S]
    return {"none": None, "causal": "causal", "bool": window,
            "add": mx.where(window, 0.0, -float("inf")).astype(dtype),
            "batch": mx.broadcast_to(window, (B, 1, L, S))}


@pytest.mark.parametrize("L,Hkv,D", [(1, 2, 64), (4, 2, 64), (4, 8, 128), (16, 1, 256), (17, 2, 64)])
def test_attention_is_mlx_lms_off_cuda_or_switched_off(monkeypatch, L, Hkv, D):
    from mlx_lm.models import base

    q, k, v, cache = _qkv(Hkv=Hkv, L=L, D=D)
    for name, mask in _masks(1, 8, L, k.shape[2]).items():
        want = base.scaled_dot_product_attention(q, k, v, cache, scale=D**-0.5, mask=mask)
        for env in (None, "0"):
            if env is None and kernels.cuda():
                continue  # on CUDA the kernel runs: tests/test_kernels_gpu.py
            if env is not None:
                monkeypatch.setattr(kernels.switch, "enabled", False)
                monkeypatch.setattr(kernels.switch, "cuda", lambda: True)
            got = attention.scaled_dot_product_attention(q, k, v, cache, scale=D**-0.5, mask=mask)
            assert mx.array_equal(got, want), (name, env)


def test_attention_dispatch(monkeypatch):
    from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_sdpa
    from mlx_lm.models.cache import QuantizedKVCache

    calls = []

    def recorder(q, k, v, scale, mask):
        calls.append((q.shape[2], q.shape[3], mask if isinstance(mask, (str, type(None))) else mask.dtype))
        return mx.zeros(q.shape, q.dtype)

    monkeypatch.setattr(attention, "active", lambda: True)
    monkeypatch.setattr(attention, "attend", recorder)
    sdpa = attention.scaled_dot_product_attention

    def falls_back(q, k, v, cache, mask=None, sinks=None):
        before = len(calls)
        # each its own queries: mlx-lm's quantized path scales them in place (queries *= scale)
        got = sdpa(mx.array(q), k, v, cache, scale=0.125, mask=mask, sinks=sinks)
        want = mlx_lm_sdpa(mx.array(q), k, v, cache, scale=0.125, mask=mask, sinks=sinks)
        return len(calls) == before and mx.array_equal(got, want)

    for L in (1, 17):
        q, k, v, cache = _qkv(L=L)
        assert falls_back(q, k, v, cache, mask=None if L == 1 else "causal"), L
    q, k, v, cache = _qkv(L=4)
    assert falls_back(q, k, v, cache, mask="causal", sinks=mx.zeros((8,)))
    assert falls_back(q[..., :48], k[..., :48], v[..., :48], cache, mask="causal")  # D = 48
    q96, k96, v96, cache96 = _qkv(L=4, D=96)
    assert falls_back(q96, k96, v96, cache96, mask="causal")
    assert falls_back(q, k.astype(mx.float16), v.astype(mx.float16), cache, mask="causal")  # mixed types
    assert falls_back(q, k, v, cache, mask=mx.zeros((4, k.shape[2]), mx.int32))  # not bool nor float
    with pytest.raises(ValueError):  # not broadcastable: MLX's error, not the kernel's
        sdpa(q, k, v, cache, scale=0.125, mask=mx.ones((3, k.shape[2]), mx.bool_))
    qcache = QuantizedKVCache(group_size=32, bits=8)
    qk, qv = qcache.update_and_fetch(k, v)
    assert falls_back(q, qk, qv, qcache, mask="causal")
    assert calls == []

    for L in range(2, 17):
        q, k, v, cache = _qkv(L=L, S=L + 20)
        for name, mask in _masks(1, 8, L, k.shape[2]).items():
            assert sdpa(q, k, v, cache, scale=0.125, mask=mask).shape == q.shape
    assert len(calls) == 15 * 5
    assert {c[0] for c in calls} == set(range(2, 17))
    assert {c[2] for c in calls} == {None, "causal", mx.bool_, mx.float32}
    monkeypatch.setattr(attention, "active", lambda: False)
    q, k, v, cache = _qkv(L=4)
    assert falls_back(q, k, v, cache, mask="causal")


def test_a_forwards_mask_is_viewed_once_for_all_its_layers():
    """Every layer of a forward gets the same mask array: the kernel's view of it (a broadcast
    node in the graph, host time on CUDA) is made once, and again only for a new mask or shape."""
    from mlxspec.kernels.attention_mask import kernel_mask

    mask = mx.array([[True, True, False], [True, True, True]]).reshape(2, 1, 1, 3)
    view = kernel_mask(mask, (2, 4, 1, 3))
    assert view.shape == (2, 4, 1, 3) and mx.array_equal(view[:, 3], mask[:, 0]).item()
    assert kernel_mask(mask, (2, 4, 1, 3)) is view  # the next layer
    assert kernel_mask(mask, (2, 8, 1, 3)) is not view  # another shape
    other = mx.array(mask)
    assert kernel_mask(other, (2, 8, 1, 3)) is not kernel_mask(mask, (2, 8, 1, 3))  # the next forward's


def test_one_row_attention_goes_to_the_kernel_only_over_long_caches(monkeypatch):
    """Plain decoding's one-row attention keeps MLX's kernel unless ONE_ROW_FROM_KEYS says the
    cache is long enough for ours at that head dim; more rows always take ours."""
    monkeypatch.setattr(attention, "active", lambda: True)
    q1, k, v, cache = _qkv(L=1, S=40)  # head_dim 64
    q4 = _qkv(L=4, S=40)[0]
    for threshold, one_row in (({}, False), ({128: 1}, False), ({64: 41}, False), ({64: 40}, True), ({64: 1}, True)):
        monkeypatch.setattr(attention, "ONE_ROW_FROM_KEYS", threshold)
        assert attention.eligible(q1, k, v, cache, None, None) is one_row, threshold
        assert attention.eligible(q4, k, v, cache, "causal", None)
    assert not attention.eligible(q1, k, v, cache, None, mx.zeros((8,)))  # sinks: MLX's still


def test_attention_chunks_cover_the_keys_once():
    for S in (1, 2, 31, 32, 33, 300, 512, 1000, 2049, 8191, 40000):
        for per_chunk in (1, 8, 24, 96, 264, 1000):
            for tiles in (1, 2, attention.WARPS):
                n = attention.chunks(S, per_chunk, tiles)
                length = -(-(-(-S // n)) // attention.TILE) * attention.TILE  # as the kernel computes it
                assert n * length >= S and (n - 1) * length < S, (S, per_chunk)
                assert n == 1 or n * per_chunk <= attention.TARGET_BLOCKS + per_chunk
                assert n == 1 or length >= tiles * attention.TILE  # every warp of a block has keys


def test_attention_splits_by_keys_for_few_query_vectors():
    assert attention.split_for(128, 4) == ("keys", 8, 8)  # the 8B's heads, one row
    assert attention.split_for(128, 12) == ("keys", 16, 16)
    assert attention.split_for(256, 12) == ("keys", 8, 8)  # two tiles of 8: 16 would spill
    assert attention.split_for(128, attention.KEY_SPLIT_VECTORS + 1) == ("queries", 8, 4 * 8)
    for split, qpw in (("keys", 16), ("queries", 8)):
        assert attention.shared_bytes(split, 256, qpw) <= 100 * 1024


def test_attention_runs_on_tensor_cores_for_many_query_vectors_in_16_bit(monkeypatch):
    first = attention.TENSOR_CORE_VECTORS
    assert attention.split_for(128, first - 1, True)[0] != "mma"
    assert attention.split_for(128, max(first, 17), True) == ("mma", 2, 32)  # 17..32: two m-tiles
    assert attention.split_for(128, 36, True) == ("mma", 4, 64)  # the 8B's heads, a 9-row verify
    assert attention.split_for(256, 96, True) == ("mma", 4, 64)  # the 27B's, 16 rows: two blocks
    assert attention.split_for(128, 36, False) == ("queries", 8, 32)  # float32: no tensor cores
    for D in attention.HEAD_DIMS:  # within an H100's 227 KB a block
        assert attention.shared_bytes("mma", D, max(attention_mma.TILES)) <= 227 * 1024
    # a block's chunk holds at least one 64-key tile (the mma plan asks for 2 tiles of 32)
    monkeypatch.setattr(attention, "_partial_kernel", lambda *key: key)  # no CUDA here: the plan's choice
    plan = attention._plan.__wrapped__  # uncached
    kernel, template, _, tiles, grid_yz, _, _ = plan((1, 32, 9, 128), 8, mx.bfloat16, "causal", None)
    assert kernel == ("causal", "mma", 128, 4) and ("MT", 4) in template and grid_yz == (1, 8)
    assert tiles == attention_mma.TILE_KEYS // attention.TILE
    assert plan((1, 32, 9, 128), 8, mx.float32, "causal", None)[0] == ("causal", "queries", 128, 8)


def _tiny_qwen3():
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                           vocab_size=128, max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=True)
    mx.random.seed(0)
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return model


def _verify_logits(model):
    """Logits of a 4-token step after a 20-token prefill: the verify path."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.arange(20)[None] % 128, cache=cache)
    return model(mx.array([[3, 1, 4, 1]]), cache=cache)


def test_install_rebinds_the_attention_modules_and_keeps_logits(monkeypatch, mlx_lm_bindings_kept):
    from mlx_lm.models import llama, qwen3, qwen3_5, qwen3_next

    model = _tiny_qwen3()
    before = _verify_logits(model)
    assert attention.install(model) == 1
    assert qwen3.scaled_dot_product_attention is attention.scaled_dot_product_attention
    assert qwen3_next.scaled_dot_product_attention is not attention.scaled_dot_product_attention
    assert attention.install(model) == 1  # again: still the one module
    assert mx.array_equal(_verify_logits(model), before)

    # through kernels.install, as a loaded model gets it where the kernels are active
    monkeypatch.setattr(qwen3, "scaled_dot_product_attention", attention._mlx_lm_sdpa)
    monkeypatch.setattr(kernels, "active", lambda: True)
    assert kernels.install(model) == {"gdn": True, "qmm_layers": 0, "attention_modules": 1}
    assert qwen3.scaled_dot_product_attention is attention.scaled_dot_product_attention

    # a Qwen3.5 hybrid's full-attention layers come from qwen3_next; llama's from llama
    hybrid = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=dict(
        model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, full_attention_interval=2, rms_norm_eps=1e-6, vocab_size=128,
        tie_word_embeddings=False, rope_parameters={"type": "default", "rope_theta": 1e6,
                                                    "partial_rotary_factor": 0.25})))
    assert attention.install(hybrid) == 1
    assert qwen3_next.scaled_dot_product_attention is attention.scaled_dot_product_attention
    tiny_llama = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1,
                                             intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-6,
                                             vocab_size=128, num_key_value_heads=2))
    assert attention.install(tiny_llama) == 1
    assert llama.scaled_dot_product_attention is attention.scaled_dot_product_attention
    assert attention.install(nn.Linear(4, 4)) == 0


def test_import_raises_the_cuda_graph_cache_unless_set():
    """MLX's CUDA graph cache (400 by default) thrashed on the MoE shape with an MTP head: a
    plain step took 36 ms against 23. `import mlxspec` sets a larger default; a user's value stays."""
    import os
    import subprocess
    import sys

    code = "import os, mlxspec; print(os.environ['MLX_CUDA_GRAPH_CACHE_SIZE'])"
    env = {k: v for k, v in os.environ.items() if k != "MLX_CUDA_GRAPH_CACHE_SIZE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "4096"
    env["MLX_CUDA_GRAPH_CACHE_SIZE"] = "123"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "123"


def test_decode_asks_nothing_of_the_switch(monkeypatch):
    """Decoding on CUDA is host-bound: a 1-row call through a swapped layer or the attention
    dispatcher must not even ask whether the kernels are on (a planted `active()` first, as
    before, fails here); 2 rows ask once each."""
    asked = []
    monkeypatch.setattr(qmm, "active", lambda: asked.append("qmm") or False)
    monkeypatch.setattr(attention, "active", lambda: asked.append("attention") or False)
    monkeypatch.setattr(qmm, "MIN_WEIGHT_BYTES", 0)
    mlp = _bf16_quantized_layer()
    assert qmm.install(mlp) == 1
    q, k, v, cache = _qkv(L=1, dtype=mx.bfloat16)
    mlp.layers[0](mx.zeros((1, 1, 256), mx.bfloat16))
    attention.scaled_dot_product_attention(q, k, v, cache, scale=0.125, mask=None)
    assert asked == []
    mlp.layers[0](mx.zeros((1, 2, 256), mx.bfloat16))
    q, k, v, cache = _qkv(L=2, dtype=mx.bfloat16)
    attention.scaled_dot_product_attention(q, k, v, cache, scale=0.125, mask="causal")
    assert asked == ["qmm", "attention"]


def test_kernel_sources_reach_mlx_without_comments():
    """What MLX copies into every call's node is code only; a // inside a string stays."""
    from mlxspec.kernels.switch import compact

    assert compact('  // gone\n\n   int a = 1;  // gone too\n asm("x // kept" : "+f"(c));\n') == \
        'int a = 1;\nasm("x // kept" : "+f"(c));\n'
    for src in (qmm._SOURCE, qmm_tc._HEADER, qmm_tc._SOURCE, attention_source.partial_source("causal", "queries"),
                attention_source.partial_source("causal", "keys"), gdn._SOURCE):
        assert compact(src) == src  # already compact: no comment, indentation or blank line left


def test_one_query_row_under_an_array_mask_goes_to_the_kernel(monkeypatch):
    """A batch's plain step (rows of different lengths: an array mask) takes the kernel at one
    query a row, which MLX's decode kernel does not take (MLX runs it op by op); one row with no
    mask or a named one keeps MLX's decode kernel."""
    monkeypatch.setattr(attention, "active", lambda: True)
    monkeypatch.setattr(attention, "ONE_ROW_FROM_KEYS", {})
    q1, k, v, cache = _qkv(L=1, S=40)
    ragged = mx.arange(40).reshape(1, 1, 1, 40) >= 3  # a row whose first 3 positions are padding
    assert attention.eligible(q1, k, v, cache, ragged, None)
    assert attention.eligible(q1, k, v, cache, mx.where(ragged, 0.0, -1e9).astype(mx.float32), None)
    assert not attention.eligible(q1, k, v, cache, None, None)
    assert not attention.eligible(q1, k, v, cache, "causal", None)
    assert not attention.eligible(q1, k, v, cache, ragged, mx.zeros((8,)))  # sinks: MLX's still
    monkeypatch.setattr(attention, "active", lambda: False)
    assert not attention.eligible(q1, k, v, cache, ragged, None)


def test_a_small_matrix_takes_the_tensor_core_kernel_from_mlxs_gemm_rows(monkeypatch):
    """A matrix below MIN_WEIGHT_BYTES (a k/v projection) keeps MLX's matmul below
    MLX_GEMM_ROWS rows (its qmv) and takes the tensor-core kernel from there to TC_SPLIT_MAX,
    where MLX's GEMM tiles left it most of the GPU idle; float32 activations keep MLX's."""
    mlp = _bf16_quantized_layer()
    monkeypatch.setattr(qmm, "active", lambda: True)
    assert qmm.install(mlp) == 1 and mlp.layers[0].weight_bytes < qmm.MIN_WEIGHT_BYTES
    wide, small = _record_routes(monkeypatch)
    for rows in (1, 2, 7, 8, 16, 28, 40, 72, 73):
        mlp.layers[0](mx.zeros((1, rows, 256), mx.bfloat16))
    mlp.layers[0](mx.zeros((1, 16, 256)))  # float32 activations
    assert wide == [8, 16, 28, 40, 72] and small == []
    monkeypatch.setattr(qmm, "MLX_GEMM_ROWS", 9)  # planted: the threshold one row off
    mlp.layers[0](mx.zeros((1, 8, 256), mx.bfloat16))
    assert wide == [8, 16, 28, 40, 72]


def test_prefill_rows_take_the_dequantized_matmul_from_dequant_rows(monkeypatch):
    """With qmm.DEQUANT_ROWS set, rows from there (a prompt's prefill chunk) dequantize the
    weights and multiply densely, in the layer's own dtype only; below it the routing is as
    before; unset (the default), they stay on MLX's matmul."""
    mlp = _bf16_quantized_layer()
    monkeypatch.setattr(qmm, "active", lambda: True)
    assert qmm.install(mlp) == 1
    dense = []
    monkeypatch.setattr(qmm, "dequantized_matmul", lambda x, *a, **k: dense.append(x.shape[-2]) or x[..., :64])
    wide, _ = _record_routes(monkeypatch)

    def run(*rows):
        for r in rows:
            mlp.layers[0](mx.zeros((1, r, 256), mx.bfloat16))

    run(72, 73, 512)
    assert dense == [] and wide == [72]  # unset: 73 and more rows keep MLX's
    monkeypatch.setattr(qmm, "DEQUANT_ROWS", 73)
    run(72, 73, 512)
    mlp.layers[0](mx.zeros((1, 512, 256)))  # float32 activations keep MLX's
    assert dense == [73, 512] and wide == [72, 72]
    monkeypatch.undo()  # the real dense path: MLX's outputs (float32, on the CPU)
    q, x = mlp.layers[0], mx.random.normal((3, 80, 256))
    want = mx.quantized_matmul(x, q["weight"], q["scales"].astype(mx.float32), q["biases"].astype(mx.float32),
                               transpose=True, group_size=64, bits=4)
    got = qmm.dequantized_matmul(x, q["weight"], q["scales"].astype(mx.float32), q["biases"].astype(mx.float32),
                                 group_size=64, bits=4)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
