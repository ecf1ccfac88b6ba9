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


# ``MLXSPEC_KERNELS``, read when this module is imported. In a running process the kernels go
# off and on with :func:`switched_off` (or by setting this flag): reading the environment on
# every layer call cost more host time than some of the calls it guards.
enabled = os.environ.get(ENV, "1") != "0"


def active() -> bool:
    """Use mlxspec's kernels now: on CUDA, unless switched off. Asked on every call, so the
    switch also works on a model already loaded (the fallback is always there)."""
    return enabled and cuda()


@contextlib.contextmanager
def switched_off():
    """Run a block with the kernels off (and ``MLXSPEC_KERNELS=0``, for any process it starts),
    then put both back as they were: for timing the same model both ways."""
    global enabled
    saved, saved_flag = os.environ.get(ENV), enabled
    os.environ[ENV] = "0"
    enabled = False
    try:
        yield
    finally:
        enabled = saved_flag
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


def compact(source: str) -> str:
    """CUDA source without its // comments, indentation and blank lines. MLX copies a custom
    kernel's whole source into every call's node, and a call's host time grew with its length
    (docs/benchmarks.md): the comments stay in this package's files, not in the calls."""
    lines = (_code_of(line).strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line) + "\n"


def _code_of(line: str) -> str:
    """LINE up to a // comment that is not inside a string literal."""
    quoted, i = False, 0
    while i < len(line):
        if quoted and line[i] == "\\":
            i += 2
            continue
        if line[i] == '"':
            quoted = not quoted
        elif not quoted and line.startswith("//", i):
            return line[:i]
        i += 1
    return line


def quantized_matmul_kernel(name: str, header: str, source: str):
    """A CUDA quantized matmul's kernel object: inputs x, w, scales, biases and dims (int32
    sizes), output y. Built once by each caller (``functools.cache``)."""
    return mx.fast.cuda_kernel(name=name, input_names=["x", "w", "scales", "biases", "dims"],
                               output_names=["y"], header=header, source=source)


def run_quantized_matmul(kernel, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *,
                         max_rows: int, name: str, plan) -> mx.array:
    """y = x @ dequantized(w).T by ``kernel()`` (a cached :func:`quantized_matmul_kernel`, built
    after the rows are checked) for x of 1..MAX_ROWS rows (all leading axes together).
    ``plan(rows, K, N)`` gives the call's launch keywords (template, grid, threadgroup) and its
    dims array. x goes in with its own shape: the kernel reads it as [rows, K] (row-contiguous,
    which MLX ensures), and y comes out in x's leading shape, so no reshape node is built."""
    shape = x.shape
    K = shape[-1]
    N = w.shape[0]
    rows = x.size // K
    if not 1 <= rows <= max_rows:
        raise ValueError(f"{name} takes 1..{max_rows} rows, got {rows}")
    launch, dims = plan(rows, K, N)
    (y,) = kernel()(inputs=[x, w, scales, biases, dims], output_shapes=[(*shape[:-1], N)],
                    output_dtypes=[x.dtype], **launch)
    return y


@functools.lru_cache(maxsize=1024)
def int_array(*values: int) -> mx.array:
    """A small int32 array of kernel arguments (sizes), made once and kept: a new array per
    call would cost a host-to-device copy each launch (measured: ~30 us a matmul)."""
    arr = mx.array(values, dtype=mx.int32)
    mx.eval(arr)
    return arr
