"""mlxspec: exact speculative decoding for MLX."""

import os

__version__ = "0.1.0"

# MLX's CUDA backend replays captured CUDA graphs from a cache keyed by topology (400 by
# default, read when a stream first runs). Plain decoding of the MoE shape fits; with an MTP
# head's forwards and the verifies of several widths it thrashed: a plain step with the head
# attached took 36 ms instead of 23 (25 ms with a 4096-entry cache). Metal ignores it; a value
# the user set stays.
os.environ.setdefault("MLX_CUDA_GRAPH_CACHE_SIZE", "4096")


def load(model=None, draft_model=None, **kwargs):
    """Load MODEL (local path, cached repo id, or None for the default/demo model).

    Returns an :class:`mlxspec.api.SpecModel` whose ``generate`` / ``stream`` run the
    exact speculative engine.
    """
    from .api import load as _load

    return _load(model, draft_model=draft_model, **kwargs)


__all__ = ["__version__", "load"]
