"""Renderer of the chip database (``traceroof chips``)."""

from __future__ import annotations

from traceroof.chips import Chip
from traceroof.report.safe import printable
from traceroof.report.text import fmt_si


def render_chips(chips: list[Chip], sources: bool = False) -> str:
    """One line per chip with its headline figures; with ``sources`` every figure and its source. Chip files
    are input: their strings go through :func:`~traceroof.report.safe.printable`."""
    lines = []
    for c in chips:
        peaks = c.peak_flops_per_s
        head = ", ".join(f"{k} {fmt_si(v, 'FLOP/s')}" for k, v in sorted(peaks.items()) if k != "vector_f32")
        hbm = c.value("memory.hbm_bytes")
        bw = c.hbm_bandwidth_bytes_per_s
        lines.append(printable(f"{c.id:10s} {c.name} ({c.vendor} {c.kind}): {head}; "
                               f"HBM {fmt_si(hbm, 'B') if hbm else '-'} at {fmt_si(bw, 'B/s') if bw else '-'}"))
        if sources:
            for key, fig in sorted(c.figures.items()):
                lines.append(printable(f"    {key} = {fig.value!r}  [{fig.source or 'no source'}]"))
            lines.append(f"    file: {printable(c.path)}")
    return "\n".join(lines) + "\n"
