"""Quantities as text (decimal SI prefixes, times with their unit), for the notes the analysis writes and the
reports alike (the analysis must not import the renderers)."""

from __future__ import annotations

import math
from collections.abc import Iterable


def fmt_si(x: float, unit: str) -> str:
    """A quantity with a decimal SI prefix (``1.45 GFLOP``, ``23.2 GB/s``)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def fmt_bytes(n: float | None) -> str:
    """Bytes with a decimal prefix (``4.33 MB``, ``512 B``); ``-`` when unknown."""
    return fmt_si(n, "B")


def fmt_time(s: float) -> str:
    """Seconds as a short string with a unit (ns, µs, ms, s); '-' when missing or not finite."""
    if s is None or not math.isfinite(s):
        return "-"
    a = abs(s)
    if a >= 1:
        return f"{s:.3f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    if a >= 1e-6:
        return f"{s * 1e6:.1f} µs"
    return f"{s * 1e9:.0f} ns"


def fmt_list(items: Iterable[object], shown: int = 3) -> str:
    """The first ``shown`` items as text, comma-separated, then ``and N more`` (``a, b, c and 4 more``)."""
    items = [str(i) for i in items]
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")
