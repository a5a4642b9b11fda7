"""Renderers of a :class:`~traceroof.diff.DiffResult`: terminal text, Markdown and JSON."""

from __future__ import annotations

import json

import pandas as pd

from traceroof.diff import DiffResult, work_ratio
from traceroof.report.breakdown import breakdown_diff_text
from traceroof.report.memory import memory_delta_line
from traceroof.report.data import clean_value, records
from traceroof.report.safe import json_text, markdown as markdown_text, printable
from traceroof.report.text import md_table, text_table, fmt_pct, fmt_si, fmt_time


def _layers(r: DiffResult) -> pd.DataFrame:
    d = r.layers
    return pd.DataFrame({
        "layer": d["layer"], "phase": d["phase"], "base": d["time_per_step_s_base"].map(fmt_time),
        "new": d["time_per_step_s_new"].map(fmt_time), "delta": d["time_per_step_s_delta"].map(fmt_time),
        "FLOPs x": d["flops_ratio"].map(lambda x: "-" if pd.isna(x) else f"{x:.2f}"),
        "eff base": d["efficiency_base"].map(fmt_pct), "eff new": d["efficiency_new"].map(fmt_pct),
        "exposed comm delta": d["exposed_comm_per_step_s_delta"].map(lambda x: fmt_time(x) if x else "-"),
    })


def _ops(r: DiffResult, n: int = 10) -> pd.DataFrame:
    d = r.ops.head(n)
    return pd.DataFrame({
        "ops (new)": d["hlo_ops_new"], "layer": d["layer"], "phase": d["phase"], "opcode": d["opcode"],
        "shape": _shapes(d), "base": d["time_per_step_s_base"].map(fmt_time),
        "new": d["time_per_step_s_new"].map(fmt_time), "delta": d["time_per_step_s_delta"].map(fmt_time),
        "matched by": d["matched_by"],
    })


def _shapes(d: pd.DataFrame) -> pd.Series:
    """The result shape of each matched op: ``base -> new`` where a looser pass matched other shapes."""
    if "shape_new" not in d:
        return d["shape"]
    changed = d["shape_new"].notna() & (d["shape_new"] != d["shape"])
    return d["shape"].where(~changed, d["shape"] + " -> " + d["shape_new"].astype(str))


def _unmatched(r: DiffResult, n: int = 10) -> pd.DataFrame:
    d = r.unmatched.sort_values("time_per_step_s", ascending=False).head(n)
    return pd.DataFrame({"side": d["side"], "ops": d["hlo_ops"], "layer": d["layer"], "phase": d["phase"],
                         "opcode": d["opcode"], "shape": d["shape"], "time/step": d["time_per_step_s"].map(fmt_time)})


def _input_notes(r: DiffResult) -> list[tuple[str, str]]:
    """(side, note) for each side's notes on input left out (:attr:`traceroof.diff.Side.input_notes`)."""
    return [(side, n) for side, s in (("base", r.base), ("new", r.new)) for n in s.input_notes]


def render_diff_text(r: DiffResult, gate_line: str = "", markdown: bool = False, wide: bool = False) -> str:
    """Terminal (or, with ``markdown``, Markdown) text of a diff: contributors, gate, layers, ops, unmatched. The
    terminal tables fit 120 columns unless ``wide`` (every cell in full, as ``analyze --wide``)."""
    table, safe = (md_table, markdown_text) if markdown else (text_table, printable)
    if wide and not markdown:
        table = lambda df: text_table(df, None)  # noqa: E731
    h = "## " if markdown else ""
    out = [("# " if markdown else "") + "traceroof diff", "",
           f"base: {safe(r.base.label)} ({safe(r.base.chip)}); new: {safe(r.new.label)} ({safe(r.new.chip)})",
           f"FLOPs per step {fmt_si(r.base.flops_per_step, 'FLOP')} -> {fmt_si(r.new.flops_per_step, 'FLOP')}"]
    out += [safe(memory_delta_line(r.memory))] if r.memory else []
    out += [f"warning: {safe(w)}" for w in r.warnings]
    out += [f"note ({side}): {safe(n)}" for side, n in _input_notes(r)]
    out += [f"- {safe(c)}" for c in r.contributors]
    if gate_line:
        out.append(f"gate: {safe(gate_line)}")
    out += breakdown_diff_text(r.step_breakdown, markdown)
    out += ["", f"{h}Per layer (per step, per device)", table(_layers(r))]
    out += ["", f"{h}Matched ops with the largest changes", table(_ops(r))]
    if len(r.unmatched):
        out += ["", f"{h}Unmatched ops (added or removed)", table(_unmatched(r))]
    return "\n".join(out) + "\n"


def render_diff_json(r: DiffResult, failed: bool, gate_line: str) -> str:
    """JSON of a diff for CI: step change with noise, contributors, gate verdict, and the three tables."""
    doc = {
        "base": r.base.label, "new": r.new.label,
        "step": clean_value({k: getattr(r.step, k) for k in ("base_s", "new_s", "delta_s", "delta_pct",
                                                          "standard_error_s", "noise", "paired", "left_out")}),
        "work_ratio": clean_value(work_ratio(r.base, r.new)),  # FLOPs per step, all devices, new / base
        "warnings": list(r.warnings), "contributors": list(r.contributors),
        "input_notes": {"base": list(r.base.input_notes), "new": list(r.new.input_notes)},
        "gate": {"failed": failed, "reason": gate_line},
        "layers": records(r.layers), "ops": records(r.ops), "unmatched": records(r.unmatched),
        "step_breakdown": records(r.step_breakdown),
    }
    if r.memory:
        doc["memory"] = clean_value(r.memory)
    return json_text(json.dumps(doc, indent=2, ensure_ascii=False)) + "\n"


def render_diff_html(r: DiffResult, gate_line: str = "") -> str:
    """Self-contained HTML of a diff: both profiles side by side per layer (bars), deltas, ops, unmatched."""
    from traceroof.report.html import PAGE_TEMPLATE, chart_script, plotlyjs_source, esc, table_html

    order = [f"{x.layer} ({x.phase})" for x in r.layers.itertuples(index=False)]
    bars = {"data": [
        {"type": "bar", "name": esc(f"base: {r.base.label}"), "x": [esc(k) for k in order],
         "y": (r.layers["time_per_step_s_base"].fillna(0) * 1e3).tolist()},
        {"type": "bar", "name": esc(f"new: {r.new.label}"), "x": [esc(k) for k in order],
         "y": (r.layers["time_per_step_s_new"].fillna(0) * 1e3).tolist()},
    ], "layout": {"barmode": "group", "title": {"text": "Time per step by layer (ms): base vs new"},
                  "margin": {"b": 160}}}
    body = [
        "<h2>Summary</h2>",
        f"<p>base: {esc(r.base.label)} ({esc(r.base.chip)})<br>new: {esc(r.new.label)} ({esc(r.new.chip)})</p>",
        "".join(f"<p><b>warning:</b> {esc(w)}</p>" for w in r.warnings),
        "".join(f"<p><b>note ({side}):</b> {esc(n)}</p>" for side, n in _input_notes(r)),
        "<ul>" + "".join(f"<li>{esc(c)}</li>" for c in r.contributors + (memory_delta_line(r.memory),) if c) + "</ul>",
        f"<p>gate: {esc(gate_line)}</p>" if gate_line else "",
        '<div id="layer-bars" class="chart"></div>',
        "<h2>Per layer</h2>", table_html(_layers(r), None, "layers-table"),
        "<h2>Matched ops with the largest changes</h2>", table_html(_ops(r, 20), None, "ops-table"),
    ]
    if len(r.unmatched):
        body += ["<h2>Unmatched ops</h2>", table_html(_unmatched(r, 20), None, "unmatched-table")]
    return PAGE_TEMPLATE.format(title=esc(f"traceroof diff: {r.base.label} vs {r.new.label}"), body="\n".join(body),
                        plotlyjs=plotlyjs_source(), charts=chart_script({"layer-bars": bars}))
