"""Findings in the reports: the top ones first (terminal, Markdown, summary), the rest briefly at the end, all of
them in HTML with links to their ops. Every string is made safe for its medium (:mod:`traceroof.report.safe`)."""

from __future__ import annotations

import html
import math
from typing import Callable

import pandas as pd

from traceroof.analysis import Analysis
from traceroof.findings import Finding
from traceroof.findings.record import step_time_s
from traceroof.report.safe import markdown, printable

TOP = 5  # findings shown in full at the top of terminal and Markdown reports


def lost_text(f: Finding, step_s: float) -> str:
    """'lost ~1.2 ms per step (3.4% of the step)', or 'no time figure'."""
    from traceroof.report.text import fmt_time

    if not (math.isfinite(f.lost_per_step_s) and f.lost_per_step_s > 0):
        return "no time figure" if not math.isfinite(f.lost_per_step_s) else "lost ~0 per step"
    part = f" ({f.lost_per_step_s / step_s:.1%} of the step)" if step_s > 0 else ""
    return f"lost ~{fmt_time(f.lost_per_step_s)} per step{part}"


def _detail(f: Finding, step_s: float, safe: Callable[[object], str]) -> list[str]:
    out = [f"{safe(f.title)}; {lost_text(f, step_s)}"]
    if f.evidence:
        out.append("evidence: " + "; ".join(safe(e) for e in f.evidence))
    out.append(f"do: {safe(f.advice)}")
    if f.source_lines:
        out.append("your code: " + ", ".join(safe(s) for s in f.source_lines))
    out.append(f"source: {safe(f.source)}")
    return out


def terminal_top(a: Analysis) -> list[str]:
    """Lines of the top findings, for the head of the terminal report ([] when none)."""
    if not a.findings:
        return []
    step = step_time_s(a)
    out = ["", f"Top findings ({min(TOP, len(a.findings))} of {len(a.findings)}, most time lost per step first)"]
    for i, f in enumerate(a.findings[:TOP], start=1):
        first, *rest = _detail(f, step, printable)
        out.append(f"{i}. [{printable(f.severity)}] {printable(f.code)}: {first}")
        out += [f"   {line}" for line in rest]
    return out


def markdown_top(a: Analysis) -> list[str]:
    """Lines of the top findings in Markdown ([] when none)."""
    if not a.findings:
        return []
    step = step_time_s(a)
    out = ["", f"## Top findings ({min(TOP, len(a.findings))} of {len(a.findings)}, most time lost per step first)",
           ""]
    for i, f in enumerate(a.findings[:TOP], start=1):
        first, *rest = _detail(f, step, markdown)
        out.append(f"{i}. **{markdown(f.severity)}** {markdown(f.code)}: {first}")
        out += [f"   - {line}" for line in rest]
    return out


def rest_lines(a: Analysis, safe: Callable[[object], str]) -> list[str]:
    """One line per finding after the top ones."""
    step = step_time_s(a)
    return [f"- [{safe(f.severity)}] {safe(f.code)}: {safe(f.title)}; {lost_text(f, step)}" for f in a.findings[TOP:]]


def op_anchors(a: Analysis) -> dict[str, str]:
    """HTML id of every op a finding names (``op-0``, ``op-1``...)."""
    names = dict.fromkeys(op for f in a.findings for op in f.ops)
    return {op: f"op-{i}" for i, op in enumerate(names)}


def finding_ops_table(a: Analysis, names: list[str]) -> pd.DataFrame:
    """Per-step figures of the ops ``names`` (the ops findings name that no other table shows)."""
    from traceroof.report.text import fmt_time

    o = a.op_rows  # stored columns only: no need to work out the cost columns of every row
    d = o[o["counted"] & o["step"].notna() & o["hlo_op"].astype(str).isin(names)]
    if d.empty:
        return pd.DataFrame(columns=["op", "opcode", "category", "layer", "time/step", "bound", "shape", "operands"])
    g = d.assign(hlo_op=d["hlo_op"].astype(str)).groupby("hlo_op", sort=False)
    first = g.first()
    t = g["measured_s"].sum() / a.per_step_divisor
    order = [n for n in names if n in t.index]
    return pd.DataFrame({"op": order, "opcode": first.loc[order, "opcode"].astype(str).to_numpy(),
                         "category": first.loc[order, "category"].astype(str).to_numpy(),
                         "layer": first.loc[order, "layer"].astype(str).to_numpy(),
                         "time/step": t.loc[order].map(fmt_time).to_numpy(),
                         "bound": first.loc[order, "bound"].astype(str).to_numpy(),
                         "shape": first.loc[order, "shape"].astype(str).to_numpy(),
                         "operands": first.loc[order, "operand_shapes"].astype(str).to_numpy()})


def findings_html(a: Analysis, anchors: dict[str, str], esc: Callable[[object], str]) -> str:
    """The findings as an ordered list, each op a link to its row (``anchors``: op -> row id)."""
    step = step_time_s(a)
    items = []
    for f in a.findings:
        first, *rest = _detail(f, step, lambda v: str(v))
        ops = ", ".join(f'<a href="#{html.escape(anchors[o], quote=True)}">{esc(o)}</a>' for o in f.ops
                        if o in anchors)
        items.append(f'<li class="finding"><b>[{esc(f.severity)}] {esc(f.code)}</b>: {esc(first)}<ul>'
                     + "".join(f"<li>{esc(line)}</li>" for line in rest)
                     + (f"<li>ops: {ops}</li>" if ops else "") + "</ul></li>")
    return "<ol>" + "".join(items) + "</ol>"
