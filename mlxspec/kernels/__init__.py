"""Verify kernels for MLX's CUDA backend (``mx.fast.cuda_kernel``).

Three things make a verify forward of a few tokens cost far more than one token there:
mlx-lm's GatedDeltaNet recurrence has a fused kernel only on Metal (elsewhere it is a loop of
ops per token), MLX's quantized matmul for 2..7 rows reads the weights once per row, and MLX's
attention for 2..16 query rows rebuilds a cuDNN graph whenever the key length changes (every
verify step). :mod:`.gdn`, :mod:`.qmm` and :mod:`.attention` replace the three on CUDA;
everywhere else, and with ``MLXSPEC_KERNELS=0``, mlx-lm's and MLX's own paths run unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import os

import mlx.core as mx
import mlx.nn as nn

ENV = "MLXSPEC_KERNELS"


@functools.cache
def _cuda_backend() -> bool:
    return mx.cuda.is_available()  # fixed for the process; asked on every layer call otherwise


def cuda() -> bool:
    """MLX runs on its CUDA backend here."""
    return _cuda_backend() and mx.default_device() == mx.gpu


def active() -> bool:
    """Use mlxspec's kernels now: on CUDA, unless ``MLXSPEC_KERNELS=0``. Read on every call,
    so the switch also works on a model already loaded (the fallback is always there)."""
    return os.environ.get(ENV, "1") != "0" and cuda()


@contextlib.contextmanager
def switched_off():
    """Run a block with the kernels off (``MLXSPEC_KERNELS=0``), then put the variable back
    as it was: for timing the same model both ways."""
    saved = os.environ.get(ENV)
    os.environ[ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


@functools.lru_cache(maxsize=1024)
def int_array(*values: int) -> mx.array:
    """A small int32 array of kernel arguments (sizes), made once and kept: a new array per
    call would cost a host-to-device copy each launch (measured: ~30 us a matmul)."""
    arr = mx.array(values, dtype=mx.int32)
    mx.eval(arr)
    return arr


def install(model: nn.Module) -> dict:
    """Route a loaded model's GatedDeltaNet recurrences, small-batch quantized matmuls and
    verify attention through the CUDA kernels where they are active; a no-op elsewhere.
    Returns what it did."""
    if not active():
        return {"gdn": False, "qmm_layers": 0, "attention_modules": 0}
    from . import attention, gdn, qmm

    return {"gdn": gdn.install(), "qmm_layers": qmm.install(model),
            "attention_modules": attention.install(model)}
