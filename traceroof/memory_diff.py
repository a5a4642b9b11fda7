"""Memory figures across two reports (``traceroof diff``): a saved report's ``memory`` object checked, and the
change of the peak and of each category from base to new (:mod:`traceroof.memory`)."""

from __future__ import annotations

import math
from typing import Mapping

from parsers.errors import FormatError
from traceroof.memory import CATEGORIES


def memory_from_json(path: object, memory: object) -> dict | None:
    """The ``memory`` object of a saved JSON report, checked: ``peak_bytes_per_device`` and each category a
    finite number >= 0 (or null). ``None`` when the report has none.

    :raises FormatError: naming the file and the key."""
    if memory is None:
        return None
    if not isinstance(memory, dict) or not isinstance(memory.get("categories", {}), dict):
        raise FormatError(f"{path}: memory is not an object with categories; write the report with "
                          "`traceroof analyze ... --format json -o base.json`")
    figures = [("peak_bytes_per_device", memory.get("peak_bytes_per_device"))]
    figures += [(f"categories.{k}", v) for k, v in memory.get("categories", {}).items()]
    for key, v in figures:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or v < 0):
            raise FormatError(f"{path}: memory.{key} is {v!r}; expected a finite number of bytes >= 0")
    return memory


def memory_delta(base: Mapping | None, new: Mapping | None) -> dict | None:
    """Peak memory per device and each category, base -> new, with the change in bytes and percent (``None``
    unless both sides have a peak)."""
    if not base or not new or base.get("peak_bytes_per_device") is None or new.get("peak_bytes_per_device") is None:
        return None

    def row(b: float, n: float) -> dict:
        return {"base_bytes": b, "new_bytes": n, "delta_bytes": n - b,
                "delta_pct": (n - b) / b * 100 if b else None}

    cats = {c: row(float((base.get("categories") or {}).get(c) or 0), float((new.get("categories") or {}).get(c) or 0))
            for c in CATEGORIES if (base.get("categories") or {}).get(c) or (new.get("categories") or {}).get(c)}
    return {"peak_bytes_per_device": row(float(base["peak_bytes_per_device"]), float(new["peak_bytes_per_device"])),
            "source": {"base": base.get("source"), "new": new.get("source")}, "categories": cats,
            "headroom_bytes": {"base": base.get("headroom_bytes"), "new": new.get("headroom_bytes")}}
