"""Backward pass of the fused GatedDeltaNet recurrence (``mlxspec.kernels.gdn``), for training
on CUDA: a development tool, kept out of the installed package (like tiny.py, scripts and
benchmarks put tests/ on ``sys.path`` to import it). The package's own
``gdn.recurrence`` differentiates mlx-lm's ops for its backward; :func:`install` makes training
runs use this kernel instead.

Rows of the recurrent state evolve independently given q, k, v, g and beta, so the backward
pass keeps the forward's layout: one warp per (batch, value head, value row) walks the steps in
reverse, holding that row's state gradient in registers. Step t is redone from the state after
step t-1 (written by the forward kernel's ``states`` output, recomputed here once), with the
forward's own arithmetic, so it needs no inverse of the decay. Gradients of q, k (shared by the
value heads of a key head and by all value rows), of the gates and of beta are summed with
float32 atomics; v's and the initial state's belong to one row and are written directly.

Per step, with s the row's state, the forward is:
    a = g * s_prev;  kv = a . k;  delta = (v - kv) * beta;  s = a + delta * k;  y = s . q
"""

from __future__ import annotations

import functools

import mlx.core as mx

from mlxspec.compat import rebind
from mlxspec.kernels import gdn
from mlxspec.kernels.gdn import PRELUDE, ROWS, dims, gated_delta_kernel, gated_delta_states, kernel_template

_SOURCE = PRELUDE + """
    float ds[n_per_t];
    const float* ds_in = dstate + ((size_t)n * Dv + dv_idx) * Dk;
    #pragma unroll
    for (int i = 0; i < n_per_t; ++i) {
        ds[i] = static_cast<float>(ds_in[n_per_t * lane + i]);
    }
    for (int t = T - 1; t >= 0; --t) {
        const size_t qk_off = (((size_t)b_idx * T + t) * Hk + hk_idx) * Dk;
        const size_t v_off = (((size_t)b_idx * T + t) * Hv + hv_idx) * Dv + dv_idx;
        const size_t h_off = ((size_t)b_idx * T + t) * Hv + hv_idx;
        float sp[n_per_t], a[n_per_t], kk[n_per_t], qq[n_per_t], gg[n_per_t];
        #pragma unroll
        for (int i = 0; i < n_per_t; ++i) {
            const int s = n_per_t * lane + i;
            sp[i] = t > 0
                ? states[((((size_t)b_idx * T + t - 1) * Hv + hv_idx) * Dv + dv_idx) * Dk + s]
                : static_cast<float>(state_in[((size_t)n * Dv + dv_idx) * Dk + s]);
            kk[i] = static_cast<float>(k[qk_off + s]);
            qq[i] = static_cast<float>(q[qk_off + s]);
            gg[i] = Vectorized ? static_cast<float>(g[h_off * Dk + s]) : static_cast<float>(g[h_off]);
        }
        float kv = 0.0f;
        #pragma unroll
        for (int i = 0; i < n_per_t; ++i) {
            a[i] = sp[i] * gg[i];
            kv += a[i] * kk[i];
        }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            kv += __shfl_xor_sync(0xffffffff, kv, off);
        }
        const float vi = static_cast<float>(v[v_off]);
        const float bt = static_cast<float>(beta[h_off]);
        const float delta = (vi - kv) * bt;
        const float dyi = static_cast<float>(dy[v_off]);

        // y = s . q  and  s = a + delta * k
        float ddelta = 0.0f;
        #pragma unroll
        for (int i = 0; i < n_per_t; ++i) {
            const float s_t = a[i] + kk[i] * delta;
            atomicAdd(dq + qk_off + n_per_t * lane + i, dyi * s_t);
            ds[i] += dyi * qq[i];
            ddelta += ds[i] * kk[i];
        }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            ddelta += __shfl_xor_sync(0xffffffff, ddelta, off);
        }
        // delta = (v - kv) * beta  and  kv = a . k
        const float dkv = -ddelta * bt;
        float dgate = 0.0f;
        #pragma unroll
        for (int i = 0; i < n_per_t; ++i) {
            const int s = n_per_t * lane + i;
            atomicAdd(dk + qk_off + s, delta * ds[i] + dkv * a[i]);
            const float da = ds[i] + dkv * kk[i];
            // a = g * s_prev
            if (Vectorized) {
                atomicAdd(dg + h_off * Dk + s, da * sp[i]);
            } else {
                dgate += da * sp[i];
            }
            ds[i] = da * gg[i];
        }
        if (!Vectorized) {
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                dgate += __shfl_xor_sync(0xffffffff, dgate, off);
            }
        }
        if (lane == 0) {
            dv[v_off] = ddelta * bt;
            atomicAdd(dbeta + h_off, ddelta * (vi - kv));
            if (!Vectorized) {
                atomicAdd(dg + h_off, dgate);
            }
        }
    }
    float* ds_out = dstate_in + ((size_t)n * Dv + dv_idx) * Dk;
    #pragma unroll
    for (int i = 0; i < n_per_t; ++i) {
        ds_out[n_per_t * lane + i] = ds[i];
    }
"""


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="mlxspec_gated_delta_backward",
        input_names=["q", "k", "v", "g", "beta", "state_in", "states", "dy", "dstate", "dims"],
        output_names=["dq", "dk", "dv", "dg", "dbeta", "dstate_in"],
        source=_SOURCE,
    )


def backward(q, k, v, g, beta, state, dy, dstate):
    """Gradients of (q, k, v, g, beta, state) from those of (y, final state)."""
    B = k.shape[0]
    Hv, Dv = v.shape[2:]
    _, _, states = gated_delta_states(q, k, v, g, beta, state)
    if dy is None:
        dy = mx.zeros(v.shape, v.dtype)
    dstate = mx.zeros(state.shape, mx.float32) if dstate is None else dstate.astype(mx.float32)
    f32 = mx.float32
    grads = _kernel()(
        inputs=[q, k, v, g, beta, state, states, dy, dstate, dims(k, v)],
        template=kernel_template(q, k, g, state),
        grid=(32, Dv, B * Hv),
        threadgroup=(32, ROWS, 1),
        output_shapes=[q.shape, k.shape, v.shape, g.shape, beta.shape, state.shape],
        output_dtypes=[f32] * 6,
        init_value=0.0,
    )
    return tuple(d.astype(p.dtype) for d, p in zip(grads, (q, k, v, g, beta, state)))


@mx.custom_function
def recurrence(q, k, v, g, beta, state):
    """``gdn.recurrence`` with this module's backward kernel instead of autodiff through
    mlx-lm's per-token ops."""
    return gated_delta_kernel(q, k, v, g, beta, state)


@recurrence.vjp
def _recurrence_vjp(primals, cotangents, outputs):
    return backward(*primals, *cotangents)


def install() -> None:
    """Train with the backward kernel: mlx-lm's GatedDeltaNet layers go through
    ``gdn.gated_delta_update``, whose unmasked recurrence (what a training step differentiates)
    becomes :func:`recurrence`. Same forward: inference is unchanged."""
    gdn.install()
    rebind(gdn, "recurrence", recurrence)
