"""A target sharded over several processes with MLX's own distributed engine.

Started by ``mlx.launch`` (every backend it knows: ring, JACCL, MPI, NCCL), each process
loads the target through mlx-lm's ``sharded_load`` (over NCCL, its same steps with the
closing barrier on a GPU stream): tensor parallel through the model's ``shard(group)`` where
its family has one, pipeline parallel (``model.model.pipeline``) otherwise. mlxspec adds no
transport: the model's own collectives are the only traffic, plus the engine's
rank-consistency check (engine/ranks.py).

A process not started by ``mlx.launch`` never calls ``mx.distributed.init()``: ``launched()``
reads the environment only, so a single-process run pays nothing and behaves as before.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from ..errors import InvalidCheckpointError, RankError

# what mlx.launch exports to every process it starts: the ring backend's hostfile, JACCL's
# coordinator, NCCL's world size; mpirun its own rank count
LAUNCH_VARS = ("MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
RANK_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK")
# how the distributed backends begin the RuntimeError of a peer whose connection closed
BACKEND_TAGS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]", "[distributed]")


def launched() -> bool:
    """Whether this process was started as one of several by mlx.launch (its environment says so)."""
    return any(os.environ.get(name) for name in LAUNCH_VARS)


def launch_rank() -> int | None:
    """This process's rank as mlx.launch numbered it; None when not launched by it."""
    if not launched():
        return None
    for name in RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


@functools.cache
def world() -> Any:
    """The ``mx.distributed`` group of every launched process, or None for a single process
    (not launched, or a group of one). Joining waits for the other ranks to connect."""
    if not launched():
        return None
    import mlx.core as mx

    # mlx.launch's NCCL runs name no hostfile: ask for NCCL itself rather than trying the others first
    group = mx.distributed.init(backend="nccl") if nccl_run() else mx.distributed.init()
    return group if group.size() > 1 else None


def load_sharded(path: Path, name: str, group) -> tuple[Any, Any, dict]:
    """(model, tokenizer, config) of the checkpoint at PATH, this rank's shard of it: mlx-lm's
    ``sharded_load`` (tensor parallel if the family has ``shard``, else pipeline; over NCCL
    :func:`_load_for_nccl`), which ends with a barrier so no rank starts generating before
    every rank holds its shard. It shards over ``mx.distributed.init()``'s group: GROUP, the one
    ``world()`` joined."""
    from mlx_lm.utils import sharded_load

    try:
        if nccl_run():
            model, tokenizer, config = _load_for_nccl(path, group)
        else:
            model, tokenizer, config = sharded_load(str(path), return_config=True)
    except Exception as err:  # mlx-lm raises ValueError / AssertionError / OSError for what cannot shard
        gone = lost_peer(err)
        if gone is not err:  # its closing barrier found a rank gone
            raise gone from err
        detail = " ".join(str(err).split())[:200] or type(err).__name__
        raise InvalidCheckpointError(
            f"cannot shard model '{name}' over {group.size()} processes: {detail}") from err
    return model, tokenizer, config


def nccl_run() -> bool:
    """Whether mlx.launch started this run over NCCL (it names no hostfile then)."""
    return bool(os.environ.get("NCCL_HOST_IP")) and not os.environ.get("MLX_HOSTFILE")


def _load_for_nccl(path: Path, group) -> tuple[Any, Any, dict]:
    """``sharded_load``'s steps on a local checkpoint with its closing barrier on a GPU stream:
    mlx-lm's sums on the CPU stream, which MLX's NCCL backend cannot run ("There is no
    Stream(gpu, 1) in current thread", MLX 0.32.4 CUDA, seen on two H200s)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model, load_tokenizer

    model, config = load_model(path, lazy=True, strict=False)
    if hasattr(model, "shard"):  # sharded_load's order: tensor parallel first
        model.shard(group)
    elif hasattr(getattr(model, "model", None), "pipeline"):
        model.model.pipeline(group)
    else:
        raise ValueError("The model does not support any sharding")
    tokenizer = load_tokenizer(path, {"trust_remote_code": True}, eos_token_ids=config.get("eos_token_id", None))
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # the barrier, on the default (GPU) stream
    return model, tokenizer, config


class PeerLost(RankError):
    """A process of the sharded run is gone: the run cannot go on (a served model neither)."""


def lost_peer(err: BaseException) -> BaseException:
    """A backend's RuntimeError (a peer's connection closed: its process died) as a one-line
    PeerLost; anything else unchanged."""
    text = " ".join(str(err).split())
    if isinstance(err, RuntimeError) and text.startswith(BACKEND_TAGS):
        return PeerLost(f"another process of the sharded run is gone ({text[:160]}); stopping")
    return err
