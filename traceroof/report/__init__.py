"""Renderers: text (terminal, Markdown), data (JSON, CSV) and the chip list."""

from __future__ import annotations

from traceroof.analysis import Analysis


def render(a: Analysis, fmt: str, table: str = "layers") -> str:
    """Render an analysis as ``terminal``, ``markdown``, ``json`` or ``csv`` (``table`` picks the CSV table)."""
    from traceroof.report.data import render_csv, render_json
    from traceroof.report.text import render_markdown, render_terminal

    if fmt == "terminal":
        return render_terminal(a)
    if fmt == "markdown":
        return render_markdown(a)
    if fmt == "json":
        return render_json(a)
    if fmt == "csv":
        return render_csv(a, table)
    raise ValueError(f"unknown format {fmt!r}")
