"""The Memory section of the terminal, Markdown and HTML reports (:class:`~traceroof.memory.MemoryView`): the
peak per device with its source and headroom, what the buffers hold at the peak instant by category, XLA's
allocations by kind and XLA's and traceroof's figures side by side, the book's model and why it differs, the
largest buffers live at the peak, and allocator figures."""

from __future__ import annotations

from typing import Mapping

import pandas as pd

from traceroof.memory import CATEGORIES, MemoryView, ProgramMemory
from traceroof.units import fmt_bytes

_KINDS = {"parameter": "arguments", "output": "outputs", "temp": "temporaries", "constant": "constants",
          "thread-local": "thread-local scratch"}  # XLA's allocation kinds, in the order shown
_ORDER = {k: i for i, k in enumerate(_KINDS)}
SOURCES = {"xla_buffer_assignment": "XLA's buffer assignment", "traceroof_live_ranges": "traceroof's live ranges"}


def _lines(view: MemoryView) -> list[tuple[str, str]]:
    p = view.peak
    if p is None:
        return []
    hbm = (f"of {fmt_bytes(view.hbm_bytes)} HBM: headroom {fmt_bytes(view.headroom_bytes)} "
           f"({view.headroom_bytes / view.hbm_bytes:.1%})" if view.headroom_bytes is not None
           else "(the chip's HBM capacity is unknown: no headroom)")
    out = [("peak", f"{fmt_bytes(p.peak_bytes)} per device {hbm}; program {p.program}, from {SOURCES[p.source]}"),
           ("at peak", "the buffers hold, at the peak instant: " + ", ".join(
               f"{c.replace('_', ' ')} {fmt_bytes(p.categories[c])}" for c in CATEGORIES if p.categories.get(c))
            + (" (a buffer XLA allocated as an output or a parameter may hold a temporary then: the allocations' "
               "own sizes are under checks)" if p.allocation_bytes_by_kind else ""))]
    checks = []
    if p.allocation_bytes_by_kind:
        kinds = p.allocation_bytes_by_kind
        checks.append("XLA's allocations " + ", ".join(f"{_KINDS.get(k, k)} {fmt_bytes(kinds[k])}" for k in
                                                         sorted(kinds, key=lambda k: (_ORDER.get(k, 9), k))
                                                         if kinds[k]))
    if p.xla_report_total_bytes is not None:
        checks.append(f"XLA memory-usage report {fmt_bytes(p.xla_report_total_bytes)}")
    if p.xla_live_range_peak_bytes is not None:
        checks.append(f"XLA live-range peak {fmt_bytes(p.xla_live_range_peak_bytes)} (values, no packing)")
    if checks:
        out.append(("checks", "; ".join(checks)))
    if p.source == "xla_buffer_assignment" and p.live_range_peak_bytes:  # not a check: it leaves out the packing
        out.append(("estimate", f"traceroof's own estimate (live values only, no XLA heap packing; the fallback "
                                f"without XLA's reports): {fmt_bytes(p.live_range_peak_bytes)}, "
                                f"{p.live_range_peak_bytes / p.peak_bytes:.2f}x XLA's allocations"))
    b = p.book
    out.append(("book", f"parameters {fmt_bytes(b.parameters_bytes)} + optimizer state "
                        f"{fmt_bytes(b.optimizer_state_bytes)} + gradients {fmt_bytes(b.gradients_bytes)} + saved "
                        f"activations {fmt_bytes(b.activations_bytes)} = {fmt_bytes(b.total_bytes)} per device "
                        "(How to Scale Your Model §5.1.1)"))
    out += [("", line) for line in b.explanation]
    for q in view.programs:
        if q is not p:
            out.append(("program", f"{q.program}: {fmt_bytes(q.peak_bytes)} from {SOURCES[q.source]}"))
    out += [("note", n) for n in view.notes]
    for a in view.allocators:
        out.append(("allocator", f"{a.allocator}: at most {fmt_bytes(a.max_in_use_bytes)} in use during the trace, "
                                 f"peak {fmt_bytes(a.peak_in_use_bytes)} since start, limit "
                                 f"{fmt_bytes(a.limit_bytes)} ({a.events:,} events)"))
    return out


def buffers_table(p: ProgramMemory) -> pd.DataFrame:
    """The largest buffers live at the peak, for display."""
    return pd.DataFrame([{"buffer": b.name, "op": b.opcode, "layer": b.layer, "phase": b.phase, "shape": b.shape,
                          "size": fmt_bytes(b.size_bytes), "category": b.category.replace("_", " ")}
                         for b in p.largest])


def memory_terminal(view: MemoryView | None, width: int | None = None) -> list[str]:
    """Lines of the terminal report's Memory section (none without a view or program), folded to ``width``
    columns (None: unfolded)."""
    from traceroof.report.text import printable, text_table, wrap

    if view is None or view.peak is None:
        return []
    lines = _lines(view)
    pad = max(len(k) for k, _ in lines)
    out = ["", "Memory (per device)"] + [x for k, v in lines
                                        for x in wrap(printable(v), width, f"{k.ljust(pad)}  ", " " * (pad + 2))]
    return out + ["", "Largest buffers live at the peak", text_table(buffers_table(view.peak), width)]


def memory_markdown(view: MemoryView | None) -> list[str]:
    """Lines of the Markdown report's Memory section."""
    from traceroof.report.safe import markdown, md_item
    from traceroof.report.text import md_table

    if view is None or view.peak is None:
        return []
    out = ["", "## Memory (per device)", ""] + [md_item(k, markdown(v)) for k, v in _lines(view)]
    return out + ["", "Largest buffers live at the peak:", "", md_table(buffers_table(view.peak))]


def memory_html(view: MemoryView | None) -> list[str]:
    """HTML fragments of the report's Memory section."""
    from traceroof.report.html import esc, table_html

    if view is None or view.peak is None:
        return []
    dl = "<dl>" + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in _lines(view)) + "</dl>"
    return ["<h2>Memory (per device)</h2>", dl, "<h3>Largest buffers live at the peak</h3>",
            table_html(buffers_table(view.peak), None, "memory-buffers-table")]


def memory_delta_line(delta: Mapping | None) -> str:
    """One line for a diff's summary: the peak's change and the categories that moved it most."""
    if not delta:
        return ""
    p = delta["peak_bytes_per_device"]
    pct = f" ({p['delta_pct']:+.1f}%)" if p["delta_pct"] is not None else ""
    movers = sorted(delta["categories"].items(), key=lambda kv: -abs(kv[1]["delta_bytes"]))
    parts = [f"{c.replace('_', ' ')} {'+' if d['delta_bytes'] >= 0 else '-'}{fmt_bytes(abs(d['delta_bytes']))}"
             for c, d in movers[:3] if d["delta_bytes"]]
    src = delta.get("source") or {}
    base_src, new_src = src.get("base"), src.get("new")
    differ = (f"; not one measure: base from {SOURCES.get(base_src, base_src)}, new from "
              f"{SOURCES.get(new_src, new_src)} (pass --hlo-base / --hlo-new dumps for XLA's figure on both)"
              if base_src and new_src and base_src != new_src else "")
    if base_src == new_src == "traceroof_live_ranges":
        differ = ("; an estimate from traceroof's live ranges on both (pass --hlo-base / --hlo-new dumps for XLA's "
                  "buffer assignment)")
    return (f"peak memory per device {fmt_bytes(p['base_bytes'])} -> {fmt_bytes(p['new_bytes'])}{pct}"
            + (f": {', '.join(parts)}" if parts else "") + differ)
