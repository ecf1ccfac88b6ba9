"""The CUDA verify kernels (mlxspec/kernels/), on MLX's CUDA backend only.

Run on the GPU machine with:  pytest -m gpu tests/test_kernels_gpu.py
Everywhere else these are skipped (tests/test_kernels.py checks what a CPU can: that the
sources compile, and that the fallback is mlx-lm's path).

- The GatedDeltaNet kernel equals mlx-lm's ops path (scalar and per-key gates, masks, GQA,
  float32 and bfloat16, T from 1 to a prefill), its per-step states equal replaying m steps
  bit for bit, and its backward pass equals autodiff through mlx-lm's ops.
- The small-M quantized matmul equals ``mx.quantized_matmul`` for 4/8 bits, groups 32/64/128,
  1..8 rows, float32 and bfloat16.
- On the trained mini-hybrid model, kernels on and off give the same greedy text, and
  temperature-0 speculation with the kernels is plain decoding with them (float32).
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk

from mlxspec import kernels
from mlxspec.kernels import gdn, qmm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not kernels.cuda(), reason="needs MLX's CUDA backend")]

MODELS = Path(__file__).resolve().parents[1] / "benchmarks" / "models"


def _gdn_inputs(B, T, Hk, Hv, Dk, Dv, dtype, vectorized=False, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk))
    k = mx.random.normal((B, T, Hk, Dk))
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    a = mx.random.normal((B, T, Hv, Dk) if vectorized else (B, T, Hv))
    g = compute_g(mx.log(mx.random.uniform(1, 16, (Hv, 1) if vectorized else (Hv,))), a, mx.ones((1,)))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk))
    q, k, v, beta = (t.astype(dtype) for t in (q, k, v, beta))
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


def _close(got, want, tol):
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    scale = max(1.0, float(np.abs(want).max()))
    assert np.abs(got - want).max() <= tol * scale, np.abs(got - want).max()


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 2e-5), (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv", [
    (1, 1, 16, 48, 128, 128),  # Qwen3.6-27B's linear attention, decode
    (1, 4, 16, 48, 128, 128),  # a verify of 3 drafts
    (1, 9, 16, 32, 128, 128),  # Qwen3.5-9B-like, 8 drafts
    (2, 37, 2, 4, 64, 32),  # batch, odd T, Dv not a multiple of the block's rows
    (1, 300, 4, 8, 128, 128),  # a prefill
])
@pytest.mark.parametrize("vectorized", [False, True])
def test_gdn_kernel_matches_mlx_lm_ops(B, T, Hk, Hv, Dk, Dv, dtype, tol, vectorized):
    q, k, v, g, beta, state = _gdn_inputs(B, T, Hk, Hv, Dk, Dv, dtype, vectorized)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    y, s = gdn.gated_delta_kernel(q, k, v, g, beta, state)
    assert y.dtype == dtype and s.dtype == state.dtype and y.shape == y_ref.shape
    _close(y, y_ref, tol)
    _close(s, s_ref, 2e-5 if dtype == mx.float32 else 2e-2)


def test_gdn_kernel_masks_like_mlx_lm():
    q, k, v, g, beta, state = _gdn_inputs(3, 12, 2, 4, 64, 64, mx.float32)
    mask = mx.array([[True] * 12, [False] * 4 + [True] * 8, [True] * 7 + [False] * 5])
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state, mask)
    y, s = gdn.gated_delta_kernel(q, k, v, g, beta, state, mask)
    _close(s, s_ref, 2e-5)
    _close(y * mask[..., None, None], y_ref * mask[..., None, None], 2e-5)
    assert not np.array(y[1, :4]).any()  # padded steps output zeros, as the Metal kernel does


def test_gdn_per_step_states_are_the_replayed_states_bit_for_bit():
    q, k, v, g, beta, state = _gdn_inputs(1, 9, 16, 32, 128, 128, mx.bfloat16)
    y, final, states = gdn.gated_delta_states(q, k, v, g, beta, state)
    y_plain, final_plain = gdn.gated_delta_kernel(q, k, v, g, beta, state)
    assert mx.array_equal(y, y_plain) and mx.array_equal(final, final_plain)
    for m in (1, 3, 9):
        _, replayed = gdn.gated_delta_kernel(q[:, :m], k[:, :m], v[:, :m], g[:, :m], beta[:, :m], state)
        assert mx.array_equal(states[:, m - 1], replayed), m


@pytest.mark.parametrize("vectorized", [False, True])
def test_gdn_backward_matches_autodiff_through_mlx_lm_ops(vectorized):
    q, k, v, g, beta, state = _gdn_inputs(2, 24, 2, 4, 64, 32, mx.float32, vectorized, seed=3)
    wy = mx.random.normal((2, 24, 4, 32))
    ws = mx.random.normal(state.shape)

    def loss(fn):
        def f(q, k, v, g, beta, state):
            y, s = fn(q, k, v, g, beta, state)
            return (y * wy).sum() + (s * ws).sum()
        return f

    args = (q, k, v, g, beta, state)
    want = mx.grad(loss(gated_delta_ops), argnums=tuple(range(6)))(*args)
    got = mx.grad(loss(gdn.recurrence), argnums=tuple(range(6)))(*args)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want):
        assert a.shape == b.shape, name
        _close(a, b, 1e-4)


def test_gated_delta_update_falls_back_when_switched_off(monkeypatch):
    q, k, v, _, _, state = _gdn_inputs(1, 5, 2, 4, 64, 64, mx.float32)
    a, b = mx.random.normal((1, 5, 4)), mx.random.normal((1, 5, 4))
    A_log, dt_bias = mx.zeros((4,)), mx.ones((4,))
    on = gdn.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
    monkeypatch.setenv(kernels.ENV, "0")
    assert not kernels.active()
    off = gdn.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
    _close(on[0], off[0], 2e-5)
    _close(on[1], off[1], 2e-5)


TOL = {mx.float32: 1e-4, mx.bfloat16: 1e-2, mx.float16: 5e-3}


# every layout in bfloat16 (what checkpoints use), the other float types on one layout each
@pytest.mark.parametrize("bits,group_size,dtype", [
    (b, g, mx.bfloat16) for b in (4, 8) for g in (32, 64, 128)
] + [(4, 64, mx.float32), (8, 32, mx.float32), (4, 128, mx.float16)])
def test_small_m_qmm_matches_mlx(bits, group_size, dtype):
    tol = TOL[dtype]
    mx.random.seed(bits + group_size)
    N, K = 1000, 1536  # N not a multiple of the block's warps
    w, scales, biases = mx.quantize(mx.random.normal((N, K)).astype(dtype), group_size=group_size, bits=bits)
    for rows in range(1, 9):
        x = mx.random.normal((rows, K)).astype(dtype)
        want = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
        got = qmm.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)
        assert got.shape == want.shape and got.dtype == want.dtype
        _close(got, want, tol)
    x3 = mx.random.normal((1, 3, K)).astype(dtype)  # leading axes fold into rows
    _close(qmm.quantized_matmul(x3, w, scales, biases, group_size=group_size, bits=bits),
           mx.quantized_matmul(x3, w, scales, biases, transpose=True, group_size=group_size, bits=bits), tol)


def test_install_swaps_quantized_layers_and_keeps_their_outputs(monkeypatch):
    from mlxspec.models.synthetic import random_model

    model = random_model("smoke-hybrid", bits=4)  # installs the kernels
    swapped = [m for _, m in model.named_modules() if isinstance(m, qmm.SmallMQuantizedLinear)]
    assert swapped and qmm.decisions()
    tokens = mx.array([[5, 17, 300, 2, 9, 40]])
    on = model(tokens)
    monkeypatch.setenv(kernels.ENV, "0")
    off = model(tokens)
    _close(on, off, 2e-2)


def _fp32(module):
    module.update(tree_map(lambda p: p.astype(mx.float32), module.parameters()))


def test_mini_hybrid_speculates_exactly_with_the_kernels(monkeypatch):
    from mlx_lm.generate import generate_step

    from mlxspec.engine.speculate import SpeculativeDecoder
    from mlxspec.models.mtp.head import load_mtp_head

    from mlxspec.models.loader import load_model

    loaded = load_model(str(MODELS / "mini-hybrid"))
    _fp32(loaded.model)
    head = load_mtp_head(loaded.model, loaded.path, loaded.config)
    _fp32(head.module)
    prompt = loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n", add_special_tokens=False)

    def greedy():
        return [t for (t, _), _ in zip(generate_step(mx.array(prompt), loaded.model, max_tokens=64), range(64))]

    with_kernels = greedy()
    for kw in ({"drafter": "pld", "depth": 4}, {"drafter": "mtp", "depth": 2, "mtp_head": head}):
        out = []
        for toks, stats in SpeculativeDecoder(loaded.model, gates=False, **kw).generate(prompt, max_tokens=64):
            out.extend(toks)
        assert out == with_kernels, kw["drafter"]
        assert stats.drafted > 0
    monkeypatch.setenv(kernels.ENV, "0")
    assert greedy() == with_kernels
