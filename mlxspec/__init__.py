"""mlxspec: exact speculative decoding for MLX."""

__version__ = "0.1.0"


def load(model=None, draft_model=None, **kwargs):
    """Load MODEL (local path, cached repo id, or None for the default/demo model).

    Returns an :class:`mlxspec.api.SpecModel` whose ``generate`` / ``stream`` run the
    exact speculative engine.
    """
    from .api import load as _load

    return _load(model, draft_model=draft_model, **kwargs)


__all__ = ["__version__", "load"]
