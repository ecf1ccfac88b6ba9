"""Verify kernels for MLX's CUDA backend (``mx.fast.cuda_kernel``).

Three things make a verify forward of a few tokens cost far more than one token there:
mlx-lm's GatedDeltaNet recurrence has a fused kernel only on Metal (elsewhere it is a loop of
ops per token), MLX's quantized matmul for 2..7 rows reads the weights once per row, and MLX's
attention for 2..16 query rows rebuilds a cuDNN graph whenever the key length changes (every
verify step). :mod:`.gdn`, :mod:`.qmm` and :mod:`.attention` replace the three on CUDA;
everywhere else, and with ``MLXSPEC_KERNELS=0``, mlx-lm's and MLX's own paths run unchanged.
"""

from __future__ import annotations

import mlx.nn as nn

from .switch import ENV, active, cuda, int_array, switched_off

__all__ = ["ENV", "active", "cuda", "install", "int_array", "switched_off"]


def install(model: nn.Module) -> dict:
    """Route a loaded model's GatedDeltaNet recurrences, small-batch quantized matmuls and
    verify attention through the CUDA kernels where they are active; a no-op elsewhere.
    Returns what it did."""
    if not active():
        return {"gdn": False, "qmm_layers": 0, "attention_modules": 0}
    from . import attention, gdn, qmm

    return {"gdn": gdn.install(), "qmm_layers": qmm.install(model),
            "attention_modules": attention.install(model)}
