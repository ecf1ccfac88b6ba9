"""The masks the verify attention kernel (:mod:`.attention`) takes, and the view it reads one
through."""

from __future__ import annotations

import mlx.core as mx

DTYPES = (mx.float32, mx.float16, mx.bfloat16)  # queries, keys, values and additive masks


def _broadcastable(shape: tuple, target: tuple) -> bool:
    return len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def mask_kind(mask, target: tuple) -> str | None:
    """The kernel's name for a mask mlx-lm may pass (None, "causal", a bool or additive array
    broadcastable to ``target`` = (B, Hq, L, S)); None for anything else."""
    if mask is None:
        return "none"
    if isinstance(mask, str):
        return "causal" if mask == "causal" else None
    if not isinstance(mask, mx.array) or not _broadcastable(mask.shape, target):
        return None
    if mask.dtype == mx.bool_:
        return "bool"
    return "add" if mask.dtype in DTYPES else None


# A model passes every layer the same mask array (a batch's rows of different lengths): it is
# viewed at the queries' shape once a forward, not once a layer (on CUDA each node of a
# forward's graph costs the host time a verify pays for).
_last: tuple = (None, None, None)


def kernel_mask(mask: mx.array, shape: tuple) -> mx.array:
    """MASK as the kernel reads it: a stride-0 view at SHAPE (B, Hq, L, S) over the broadcast
    axes, read through its strides; made once for each mask array and shape."""
    global _last
    if _last[0] is not mask or _last[1] != shape:
        _last = (mask, shape, mx.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape), shape))
    return _last[2]
