"""Renderers: text (terminal, Markdown), data (JSON, CSV) and the chip list."""

from __future__ import annotations

from traceroof.analysis import Analysis


def render(a: Analysis, fmt: str, table: str = "layers", wide: bool = False) -> str:
    """Render an analysis as ``terminal``, ``markdown``, ``json``, ``csv`` (``table`` picks the CSV table),
    ``html`` (self-contained page with charts) or ``summary`` (a Markdown digest of at most 60 lines). The
    terminal report fits 120 columns unless ``wide``."""
    from traceroof.report.data import render_csv, render_json
    from traceroof.report.text import render_markdown, render_terminal

    if fmt == "terminal":
        return render_terminal(a, None) if wide else render_terminal(a)
    if fmt == "markdown":
        return render_markdown(a)
    if fmt == "json":
        return render_json(a)
    if fmt == "csv":
        return render_csv(a, table)
    if fmt == "summary":
        from traceroof.report.summary import render_summary

        return render_summary(a)
    if fmt == "html":
        from traceroof.report.html import render_html

        return render_html(a)
    raise ValueError(f"unknown format {fmt!r}")
