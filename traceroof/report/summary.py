"""``--format summary``: a compact Markdown digest (at most :data:`MAX_LINES` lines) for a person skimming or an
LLM reading: the headline figures, the top findings with their advice and source lines, the ops losing most
time, and how many notes the full report has."""

from __future__ import annotations

import math

from traceroof.analysis import Analysis
from traceroof.findings.record import step_time_s
from traceroof.report.findings import TOP, lost_text
from traceroof.report.safe import markdown
from traceroof.report.text import fmt_pct, fmt_si, fmt_time, virtual_comm
from traceroof.utilization import MFU_CAVEATS

MAX_LINES = 60
TOP_FINDINGS = TOP
TOP_OPS = 3


def render_summary(a: Analysis) -> str:
    """The digest of ``a`` (Markdown, ≤ ``MAX_LINES`` lines)."""
    s = a.summary
    step = s.step_time_mean_s
    busy = s.op_time_per_step_s / step if step > 0 else float("nan")
    comm = s.exposed_comm_per_step_s / step if step > 0 else float("nan")
    out = [f"# traceroof summary: {markdown(s.input)}", "",
           f"- chip: {markdown(s.chip_name)} [{markdown(s.chip_id)}]; {s.devices} device(s)"
           f"{f' on {s.hosts} hosts' * (s.hosts > 1)}; {markdown(s.device)}",
           f"- step: {fmt_time(step)} ± {fmt_time(s.step_time_std_s)} over {len(s.steps_used)} step(s); op time "
           f"{fmt_pct(busy)} of it{' (op events overlap in time)' if busy > 1 else ''}; exposed communication "
           f"{fmt_pct(comm)}{virtual_comm(s)}",
           f"- work per step and device: {fmt_si(s.flops_per_step, 'FLOP')}, {fmt_si(s.hbm_bytes_per_step, 'B')} HBM",
           f"- MFU {fmt_pct(s.mfu)}, HFU {fmt_pct(s.hfu)} ({markdown(s.mfu_peak_key or '-')} peak); roofline "
           f"efficiency {fmt_pct(s.roofline_efficiency)} (expected {fmt_time(s.expected_per_step_s)})"]
    out += [f"  - {markdown(n)}" for n in s.notes if any(c in n for c in MFU_CAVEATS)]
    if len(a.layers):
        worst = a.layers.sort_values("lost_per_step_s", ascending=False, na_position="last").iloc[0]
        out.append(f"- layer losing most: {markdown(worst['layer'])} ({markdown(worst['phase'])}), "
                   f"{fmt_time(worst['lost_per_step_s'])} per step over its roofline")
    out += ["", f"## Top findings ({min(TOP_FINDINGS, len(a.findings))} of {len(a.findings)})", ""]
    if not a.findings:
        out.append("none")
    for i, f in enumerate(a.findings[:TOP_FINDINGS], start=1):
        out.append(f"{i}. **{markdown(f.severity)}** {markdown(f.code)}: {markdown(f.title)}; {lost_text(f, step_time_s(a))}")
        out.append(f"   - do: {markdown(f.advice)}")
        if f.source_lines:
            out.append("   - code: " + ", ".join(markdown(x) for x in f.source_lines[:3]))
    if len(a.top_ops):
        out += ["", "## Ops losing most time (median, per step)", ""]
        for r in a.top_ops.head(TOP_OPS).itertuples(index=False):
            # the median execution's time per step, as its lost time is (the mean one can be smaller than that)
            median_s = r.median_s * r.executions_per_step
            time_s = median_s if math.isfinite(median_s) else r.time_per_step_s
            out.append(f"- {markdown(r.hlo_op)} ({markdown(r.opcode)}, {markdown(r.layer)}): "
                       f"{fmt_time(time_s)}, {fmt_time(r.median_lost_per_step_s)} lost, "
                       f"{markdown(r.bound)}-bound")
    if s.notes:
        out += ["", f"{len(s.notes)} note(s) on missing or partial input: see the full report."]
    if len(out) > MAX_LINES:
        out = out[:MAX_LINES - 1] + ["(cut: see the full report)"]
    return "\n".join(out) + "\n"
