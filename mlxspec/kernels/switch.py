"""The one switch of the CUDA kernels: where they may run, and the small helpers they share.

``MLXSPEC_KERNELS=0`` turns them off; they are only ever on with MLX's CUDA backend.
"""

from __future__ import annotations

import contextlib
import functools
import os

import mlx.core as mx

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


def quantized_matmul_kernel(name: str, header: str, source: str):
    """A CUDA quantized matmul's kernel object: inputs x, w, scales, biases and dims (int32
    sizes), output y. Built once by each caller (``functools.cache``)."""
    return mx.fast.cuda_kernel(name=name, input_names=["x", "w", "scales", "biases", "dims"],
                               output_names=["y"], header=header, source=source)


@functools.lru_cache(maxsize=1024)
def int_array(*values: int) -> mx.array:
    """A small int32 array of kernel arguments (sizes), made once and kept: a new array per
    call would cost a host-to-device copy each launch (measured: ~30 us a matmul)."""
    arr = mx.array(values, dtype=mx.int32)
    mx.eval(arr)
    return arr
