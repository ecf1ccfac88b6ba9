"""Verify kernels for MLX's CUDA backend (``mx.fast.cuda_kernel``).

Three things make a verify forward of a few tokens cost far more than one token there:
mlx-lm's GatedDeltaNet recurrence has a fused kernel only on Metal (elsewhere it is a loop of
ops per token), MLX's quantized matmul for a few rows reads the weights once per row (and
past 8 rows costs a 20-32-row verify about 2.7 one-row forwards of the 8B shape), and MLX's
attention for 2..16 query rows rebuilds a cuDNN graph whenever the key length changes (every
verify step). :mod:`.gdn`, :mod:`.qmm` (with :mod:`.qmm_tc`) and :mod:`.attention` replace the three on CUDA;
everywhere else, and with ``MLXSPEC_KERNELS=0``, mlx-lm's and MLX's own paths run unchanged.
A target sharded by tensor parallelism gets them too: each works on the rank's own heads and
rows, and a sharded layer's all-sum stays where mlx puts it (:mod:`.qmm`).
"""

from __future__ import annotations

import sys

import mlx.nn as nn

from .switch import ENV, active, cuda, int_array, switched_off

__all__ = ["ENV", "active", "cuda", "install", "int_array", "switched_off", "uninstall"]


def install(model: nn.Module) -> dict:
    """Route a loaded model's GatedDeltaNet recurrences, small-batch quantized matmuls and
    verify attention through the CUDA kernels where they are active; a no-op elsewhere.
    Returns what it did."""
    if not active():
        return {"gdn": False, "qmm_layers": 0, "attention_modules": 0}
    from . import attention, gdn, qmm

    return {"gdn": gdn.install(), "qmm_layers": qmm.install(model),
            "attention_modules": attention.install(model)}


def uninstall(model: nn.Module) -> int:
    """Undo :func:`install` in this process: mlx-lm's own functions back wherever ours were bound,
    MODEL's kernel layers mlx's classes again. For a stock baseline run beside a kernel run in
    one process (``bench --sharded``: a second process could not join the ranks). Returns how
    many bindings and layers it set back."""
    from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_sdpa
    from mlx_lm.models.gated_delta import gated_delta_update as mlx_lm_gdn

    from ..compat import rebind, unswap_class
    from . import attention, gdn, qmm

    ours = {"scaled_dot_product_attention": (attention.scaled_dot_product_attention, mlx_lm_sdpa),
            "gated_delta_update": (gdn.gated_delta_update, mlx_lm_gdn)}
    undone = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("mlx_lm.") or module is None:
            continue
        for attr, (kernel, original) in ours.items():
            if getattr(module, attr, None) is kernel:
                rebind(module, attr, original)
                undone += 1
    kernel_classes = tuple(qmm.SWAPS.values())
    return undone + sum(unswap_class(m) for m in model.modules() if isinstance(m, kernel_classes))
