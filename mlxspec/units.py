"""Human-readable quantities for messages: one byte-size format everywhere (no mlx import)."""

from __future__ import annotations

_BYTE_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3))


def human_bytes(n: int | float | None) -> str:
    """'15.0 GB', '2.5 MB', '512 B' (decimal units, as disks and Apple's memory and bandwidth
    figures are quoted); '?' for an unknown size."""
    if n is None:
        return "?"
    for unit, scale in _BYTE_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
