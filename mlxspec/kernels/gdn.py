"""Fused GatedDeltaNet recurrence for MLX's CUDA backend.

The same math as mlx-lm's Metal kernel (``mlx_lm.models.gated_delta``), scalar or per-key
gates, with or without a padding mask: one warp per (batch, value head, value row) keeps that
row of the recurrent state in registers (Dk/32 floats a lane) and walks the T steps, two warp
reductions a step. Prefill, decode, verify and the tape replay of a rollback
(:mod:`mlxspec.models.gdn_tape`) all call :func:`gated_delta_update`, so one launch per layer
replaces mlx-lm's T steps of ops; replaying m steps gives the state the verify had after m,
since each step is the same per-lane arithmetic.
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx
from mlx_lm.models import gated_delta as _mlx_lm

from ..compat import rebind
from .switch import active, compact, int_array

# Grid: x = the 32 lanes of a warp over Dk, y = value rows (ROWS warps a block), z = B * Hv.
ROWS = 4

# Where a warp is, shared by the forward and backward kernels (dims: T, Hk, Hv, Dv).
PRELUDE = """
    constexpr int n_per_t = Dk / 32;
    const int lane = threadIdx.x;
    const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;
    const int T = dims[0];
    const int Hk = dims[1];
    const int Hv = dims[2];
    const int Dv = dims[3];
    if (dv_idx >= Dv) {
        return;  // a whole warp leaves together: dv_idx is the same on all its lanes
    }
    const int b_idx = n / Hv;
    const int hv_idx = n % Hv;
    const int hk_idx = hv_idx / (Hv / Hk);
"""

_SOURCE = PRELUDE + """

    // q, k: [B, T, Hk, Dk]; v, y: [B, T, Hv, Dv]; state: [B, Hv, Dv, Dk]
    auto q_ = q + ((size_t)b_idx * T * Hk + hk_idx) * Dk;
    auto k_ = k + ((size_t)b_idx * T * Hk + hk_idx) * Dk;
    auto v_ = v + ((size_t)b_idx * T * Hv + hv_idx) * Dv;
    auto y_ = y + ((size_t)b_idx * T * Hv + hv_idx) * Dv;
    auto i_state = state_in + ((size_t)n * Dv + dv_idx) * Dk;
    auto o_state = state_out + ((size_t)n * Dv + dv_idx) * Dk;

    float state[n_per_t];
    #pragma unroll
    for (int i = 0; i < n_per_t; ++i) {
        state[i] = static_cast<float>(i_state[n_per_t * lane + i]);
    }
    // g: [B, T, Hv] (scalar gate) or [B, T, Hv, Dk] (per-key gate); beta: [B, T, Hv]
    auto g_ = Vectorized ? g + ((size_t)b_idx * T * Hv + hv_idx) * Dk : g + (size_t)b_idx * T * Hv;
    auto beta_ = beta + (size_t)b_idx * T * Hv;

    for (int t = 0; t < T; ++t) {
        if (KEEP) {
            float kv_mem = 0.0f;
            #pragma unroll
            for (int i = 0; i < n_per_t; ++i) {
                const int s = n_per_t * lane + i;
                const float decay = Vectorized ? static_cast<float>(g_[s]) : static_cast<float>(g_[hv_idx]);
                state[i] = state[i] * decay;
                kv_mem += state[i] * static_cast<float>(k_[s]);
            }
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                kv_mem += __shfl_xor_sync(0xffffffff, kv_mem, off);
            }
            const float delta = (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta_[hv_idx]);
            float out = 0.0f;
            #pragma unroll
            for (int i = 0; i < n_per_t; ++i) {
                const int s = n_per_t * lane + i;
                state[i] = state[i] + static_cast<float>(k_[s]) * delta;
                out += state[i] * static_cast<float>(q_[s]);
            }
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                out += __shfl_xor_sync(0xffffffff, out, off);
            }
            if (lane == 0) {
                y_[dv_idx] = static_cast<InT>(out);
            }
        } else if (lane == 0) {
            y_[dv_idx] = static_cast<InT>(0.0f);
        }
        STORE_STATE
        q_ += Hk * Dk;
        k_ += Hk * Dk;
        v_ += Hv * Dv;
        y_ += Hv * Dv;
        g_ += Vectorized ? Hv * Dk : Hv;
        beta_ += Hv;
    }
    #pragma unroll
    for (int i = 0; i < n_per_t; ++i) {
        o_state[n_per_t * lane + i] = static_cast<StT>(state[i]);
    }
"""


# Where the optional per-step states go: states [B, T, Hv, Dv, Dk] float32, the state after
# each step (the backward pass reads step t-1's to redo step t).
_STORE = """
        {
            float* s_out = states + ((((size_t)b_idx * T + t) * Hv + hv_idx) * Dv + dv_idx) * Dk;
            #pragma unroll
            for (int i = 0; i < n_per_t; ++i) {
                s_out[n_per_t * lane + i] = state[i];
            }
        }
"""
# what MLX gets: the code without its comments (every call's node carries a copy)
_SOURCE, _STORE = compact(_SOURCE), compact(_STORE)


@functools.cache
def _kernel(has_mask: bool, with_states: bool):
    inputs = ["q", "k", "v", "g", "beta", "state_in", "dims"] + (["mask"] if has_mask else [])
    source = _SOURCE.replace("KEEP", "mask[b_idx * T + t]" if has_mask else "true")
    return mx.fast.cuda_kernel(
        name="mlxspec_gated_delta" + ("_mask" if has_mask else "") + ("_states" if with_states else ""),
        input_names=inputs,
        output_names=["y", "state_out"] + (["states"] if with_states else []),
        source=source.replace("STORE_STATE", _STORE if with_states else ""),
    )


def supported(k: mx.array) -> bool:
    """Key head sizes the kernel's lane layout takes: a multiple of the 32 lanes."""
    return k.shape[-1] >= 32 and k.shape[-1] % 32 == 0


def kernel_template(q, k, g, state):
    # Only what sizes registers or types is compiled in; T, heads and Dv come in `dims`, so
    # one compile serves every model with the same key head size.
    return [("InT", q.dtype), ("StT", state.dtype), ("Dk", k.shape[-1]), ("Vectorized", g.ndim == 4)]


def dims(k: mx.array, v: mx.array) -> mx.array:
    return int_array(k.shape[1], k.shape[2], v.shape[2], v.shape[3])


def _forward(q, k, v, g, beta, state, mask=None, with_states=False):
    B, T = k.shape[:2]
    Hv, Dv = v.shape[2:]
    inputs = [q, k, v, g, beta, state, dims(k, v)]
    if mask is not None:
        inputs.append(mask.astype(mx.bool_))
    shapes = [(B, T, Hv, Dv), state.shape] + ([(B, T) + state.shape[1:]] if with_states else [])
    dtypes = [q.dtype, state.dtype] + ([mx.float32] if with_states else [])
    return _kernel(mask is not None, with_states)(
        inputs=inputs, template=kernel_template(q, k, g, state), grid=(32, Dv, B * Hv),
        threadgroup=(32, ROWS, 1), output_shapes=shapes, output_dtypes=dtypes,
    )


def gated_delta_kernel(q, k, v, g, beta, state, mask=None):
    """(y [B, T, Hv, Dv], new state) of the recurrence over T steps, as
    ``mlx_lm.models.gated_delta.gated_delta_ops`` computes them (all arithmetic in float32)."""
    return tuple(_forward(q, k, v, g, beta, state, mask))


def gated_delta_states(q, k, v, g, beta, state, mask=None):
    """(y, new state, the state after every step [B, T, Hv, Dv, Dk] float32)."""
    return tuple(_forward(q, k, v, g, beta, state, mask, with_states=True))


@mx.custom_function
def recurrence(q, k, v, g, beta, state):
    """The unmasked recurrence as a differentiable function: the kernel forward, and mlx's own
    differentiation of mlx-lm's ops for the backward (``tests/gdn_grad.py``, outside the
    package, swaps in a backward kernel for training runs)."""
    return gated_delta_kernel(q, k, v, g, beta, state)


@recurrence.vjp
def _recurrence_vjp(primals, cotangents, outputs):
    cotangents = [mx.zeros_like(o) if c is None else c for c, o in zip(cotangents, outputs)]
    return tuple(mx.vjp(_mlx_lm.gated_delta_ops, list(primals), cotangents)[1])


def gated_delta_update(
    q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, A_log: mx.array,
    dt_bias: mx.array, state: Optional[mx.array] = None, mask: Optional[mx.array] = None, *,
    use_kernel: bool = True, lower_bound: float | None = None, allow_neg_eigval: bool = False,
):
    """mlx-lm's ``gated_delta_update`` (same signature, same gate and beta arithmetic) with
    the fused CUDA kernel where it is active; anywhere else, mlx-lm's own function."""
    # mlx-lm turns its Metal kernel off to train (it has no gradient); this one has one.
    if not (active() and supported(k)) or (not use_kernel and mask is not None):
        return _mlx_lm.gated_delta_update(
            q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
            lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval,
        )
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if lower_bound is None:
        g = _mlx_lm.compute_g(A_log, a, dt_bias)
    else:
        g = _mlx_lm.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    if state is None:
        B, _, Hk, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if mask is None:
        return recurrence(q, k, v, g, beta, state)
    return gated_delta_kernel(q, k, v, g, beta, state, mask)


# mlx-lm model modules that bind ``gated_delta_update`` by name at import.
_USERS = ("mlx_lm.models.qwen3_5", "mlx_lm.models.qwen3_next")


def install() -> bool:
    """Point mlx-lm's GatedDeltaNet layers at :func:`gated_delta_update` (it falls back to
    mlx-lm's own function whenever the kernel is not active, so this is safe to leave in)."""
    import importlib

    for name in _USERS:
        module = importlib.import_module(name)
        if getattr(module, "gated_delta_update", None) is not None:
            rebind(module, "gated_delta_update", gated_delta_update)
    return True
