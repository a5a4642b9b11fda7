"""The step-breakdown section of the terminal, Markdown and HTML reports, and of ``traceroof diff``
(:mod:`traceroof.breakdown`)."""

from __future__ import annotations

import pandas as pd

from traceroof.breakdown import COMPONENTS, LABELS, mean_row, other_programs_line, per_step, slowest_vs_median

MAX_STEPS_SHOWN = 12  # per-step rows in the text reports (the JSON report has every step and device)
TITLE = "Step breakdown (per device; from the previous step's end to this one's: marker or last op, the later)"


def breakdown_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The mean step, then one row per step (averaged over devices): time and each component with its share."""
    from traceroof.report.text import fmt_time

    if rows is None or not len(rows):
        return pd.DataFrame()
    n_dev = rows["device"].nunique()
    steps = per_step(rows)
    shown = steps.head(MAX_STEPS_SHOWN)
    mean = mean_row(rows)
    table = [{"step": "mean", **mean}] + [{"step": str(int(r["step"])), **{c: float(r[c]) for c in mean}}
                                          for _, r in shown.iterrows()]

    def cell(r: dict, c: str) -> str:
        t = r["step_time_s"]
        return f"{fmt_time(r[c])} ({r[c] / t:.0%})" if t > 0 else fmt_time(r[c])

    return pd.DataFrame([{"step": r["step"], "devices": str(n_dev), "step time": fmt_time(r["step_time_s"]),
                          **{LABELS[c]: cell(r, c) for c in COMPONENTS}} for r in table])


def _lines(rows: pd.DataFrame) -> list[str]:
    out = []
    steps = rows["step"].nunique()
    if steps > MAX_STEPS_SHOWN:
        out.append(f"first {MAX_STEPS_SHOWN} of {steps} steps shown; every step and device is in the JSON report "
                   "(step_breakdown)")
    out += [x for x in (other_programs_line(rows), slowest_vs_median(rows)) if x]
    return out


def breakdown_text(rows: pd.DataFrame, markdown: bool = False, width: int | None = None) -> list[str]:
    """Lines of the step-breakdown section (none when the analysis has no breakdown)."""
    from traceroof.report.safe import markdown as md_text
    from traceroof.report.text import md_table, text_table, wrap

    if rows is None or not len(rows):
        return []
    if markdown:
        return ["", f"## {TITLE}", "", md_table(breakdown_table(rows)), ""] + [f"- {md_text(x)}" for x in _lines(rows)]
    return ["", TITLE, text_table(breakdown_table(rows), width)] + [y for x in _lines(rows)
                                                                   for y in wrap(x, width, "- ", "  ")]


def breakdown_html(rows: pd.DataFrame) -> str:
    """The HTML section: the same table and line."""
    from traceroof.report.html import esc, table_html

    if rows is None or not len(rows):
        return ""
    return (f"<h2>{esc(TITLE)}</h2>" + table_html(breakdown_table(rows), None, "breakdown-table")
            + "".join(f"<p>{esc(x)}</p>" for x in _lines(rows)))


def breakdown_delta_table(d: pd.DataFrame) -> pd.DataFrame:
    """Mean step and components of both sides of a diff (``d``: :func:`traceroof.breakdown.breakdown_delta`'s
    rows), formatted."""
    from traceroof.report.text import fmt_time

    return pd.DataFrame({"component": [LABELS.get(c, "step time") for c in d["component"]],
                         "base": d["base_s"].map(fmt_time), "new": d["new_s"].map(fmt_time),
                         "delta": d["delta_s"].map(lambda x: ("+" if x > 0 else "") + fmt_time(x))}) if len(d) else d


def breakdown_diff_text(delta: pd.DataFrame, markdown: bool = False) -> list[str]:
    """The diff's step-breakdown section from :func:`traceroof.breakdown.breakdown_delta`'s rows (none when they
    are empty: a side without a breakdown)."""
    from traceroof.report.text import md_table, text_table

    t = breakdown_delta_table(delta)
    if not len(t):
        return []
    return ["", ("## " if markdown else "") + "Step breakdown (mean step, per device)",
            md_table(t) if markdown else text_table(t)]
