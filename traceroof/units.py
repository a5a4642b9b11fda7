"""Quantities as text with decimal SI prefixes, for the notes the analysis writes and the reports alike (the
analysis must not import the renderers)."""

from __future__ import annotations

import math


def fmt_si(x: float, unit: str) -> str:
    """A quantity with a decimal SI prefix (``1.45 GFLOP``, ``23.2 GB/s``)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"
