"""Self-contained HTML report: summary, roofline chart, per-layer stacked bars, sortable tables, findings.

Charts are Plotly figures with plotly.js embedded in the page (no network access needed to view it). Every
string that comes from a profile or HLO (op names, scope paths, shapes, source lines, notes) is HTML-escaped
before it reaches the page or a chart's hover text: a profile is untrusted input.
"""

from __future__ import annotations

import html
import math

import numpy as np
import pandas as pd

from traceroof.analysis import Analysis
from traceroof.report.findings import finding_ops_table, findings_html, op_anchors
from traceroof.report.safe import printable
from traceroof.report.timeline import axis_labels, timeline_figure, timeline_html
from traceroof.report.text import collectives_table, fmt_si, fmt_time, header_lines, layers_table, top_table
from traceroof.report.memory import memory_html

PAGE_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<script>window.__pageErrors = [];
window.addEventListener("error", function (e) {{ window.__pageErrors.push(String(e.message)); }});</script>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 7px; text-align: right; white-space: nowrap; }}
th {{ background: #f0f0f0; cursor: pointer; }}
td.text, th.text {{ text-align: left; }}
dl {{ display: grid; grid-template-columns: max-content auto; gap: 2px 12px; }}
dt {{ font-weight: 600; }}
.chart {{ width: 100%; max-width: 1100px; height: 560px; }}
</style></head><body>
<h1>{title}</h1>
{body}
<div id="page-errors"></div>
<script>{plotlyjs}</script>
<script>{charts}</script>
<script>
document.querySelectorAll("table.sortable").forEach(function (table) {{
  table.querySelectorAll("th").forEach(function (th, col) {{
    th.addEventListener("click", function () {{
      var rows = Array.from(table.tBodies[0].rows);
      var asc = th.dataset.asc !== "1"; th.dataset.asc = asc ? "1" : "0";
      rows.sort(function (a, b) {{
        var x = a.cells[col].dataset.v, y = b.cells[col].dataset.v;
        var nx = parseFloat(x), ny = parseFloat(y);
        var c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : String(x).localeCompare(String(y));
        return asc ? c : -c;
      }});
      rows.forEach(function (r) {{ table.tBodies[0].appendChild(r); }});
    }});
  }});
}});
document.getElementById("page-errors").textContent = window.__pageErrors.join("\\n");
</script>
</body></html>
"""

_TEXT_COLUMNS = {"layer", "phase", "worst op", "op", "opcode", "category", "bound", "shape", "operands", "kind",
                 "form", "mode", "axes", "link", "ops (new)", "matched by", "side", "ops"}


def esc(value: object) -> str:
    """HTML-escape any value (quotes included), control characters shown as escapes."""
    return html.escape(printable(value), quote=True)


def table_html(shown: pd.DataFrame, raw: pd.DataFrame | None = None, table_id: str = "",
               row_ids: dict[int, str] | None = None) -> str:
    """A sortable table: cells show ``shown``; sorting uses ``raw``'s values (numbers) where given; ``row_ids``
    gives rows (by position) an id that findings link to."""
    if shown.empty:
        return "<p><em>none</em></p>"
    head = "".join(f'<th class="{"text" if c in _TEXT_COLUMNS else ""}">{esc(c)}</th>' for c in shown.columns)
    rows = []
    raw_rows = list(raw.itertuples(index=False)) if raw is not None and len(raw) == len(shown) else None
    for i, row in enumerate(shown.itertuples(index=False)):
        cells = []
        for j, (c, v) in enumerate(zip(shown.columns, row)):
            sort = raw_rows[i][j] if raw_rows is not None and j < len(raw_rows[i]) else v
            if isinstance(sort, float) and math.isnan(sort):
                sort = ""
            cells.append(f'<td class="{"text" if c in _TEXT_COLUMNS else ""}" data-v="{esc(sort)}">{esc(v)}</td>')
        rid = (row_ids or {}).get(i)
        rows.append((f'<tr id="{esc(rid)}">' if rid else "<tr>") + "".join(cells) + "</tr>")
    ident = f' id="{esc(table_id)}"' if table_id else ""
    return (f'<table class="sortable"{ident}><thead><tr>{head}</tr></thead><tbody>' + "".join(rows)
            + "</tbody></table>")


def _op_points(a: Analysis) -> pd.DataFrame:
    """One point per distinct op with FLOPs and HBM traffic: intensity, achieved FLOP/s, time per step."""
    stats = a.op_stats
    d = stats[(stats["flops_per_step"] > 0) & (stats["hbm_bytes_per_step"] > 0) & (stats["time_per_step_s"] > 0)]
    d = d.assign(intensity=d["flops_per_step"] / d["hbm_bytes_per_step"],
                 achieved=d["flops_per_step"] / d["time_per_step_s"])
    return d


def roofline_figure(a: Analysis) -> dict:
    """Plotly figure (as a dict) of the roofline: log-log arithmetic intensity vs achieved FLOP/s, the chip's
    compute roofs per dtype, the HBM roof and the interconnect roof where the chip has one; one trace per
    layer, marker area proportional to time per step."""
    pts = _op_points(a)
    s = a.summary
    traces = []
    x_lo, x_hi = 0.01, 1e4
    if len(pts):
        x_lo = max(min(float(pts["intensity"].min()) / 3, 1.0), 1e-3)
        x_hi = max(float(pts["intensity"].max()) * 3, 10.0)
    xs = np.logspace(math.log10(x_lo), math.log10(x_hi), 60).tolist()
    bw = s.hbm_bandwidth_bytes_per_s
    for key, peak in sorted(s.peak_flops_per_s.items(), key=lambda kv: -kv[1]):
        roof = [min(peak, bw * x) if bw else peak for x in xs]
        traces.append({"type": "scatter", "mode": "lines", "x": xs, "y": roof, "name": esc(f"{key} roof"),
                       "line": {"width": 1, "dash": "dot"}, "hoverinfo": "name"})
    if bw:
        traces.append({"type": "scatter", "mode": "lines", "x": xs, "y": [bw * x for x in xs],
                       "name": esc(f"HBM {fmt_si(bw, 'B/s')}"), "line": {"width": 1, "color": "#888"},
                       "hoverinfo": "name"})
    link = a.collectives["link_peak_bytes_per_s"].dropna() if len(a.collectives) else pd.Series(dtype=float)
    if len(link):
        w = float(link.max())
        traces.append({"type": "scatter", "mode": "lines", "x": xs, "y": [w * x for x in xs],
                       "name": esc(f"interconnect {fmt_si(w, 'B/s')}"), "line": {"width": 1, "color": "#b55"},
                       "hoverinfo": "name"})
    if len(pts):
        t_max = float(pts["time_per_step_s"].max())
        for layer, g in pts.groupby("layer", sort=True):
            hover = [esc(f"{r.hlo_ops} ({r.opcode}, {r.category}) {r.phase}") + "<br>"
                     + esc(f"shape {r.shape} <- {r.operand_shapes}") + "<br>"
                     + esc(f"measured {fmt_time(r.time_per_step_s)}, expected {fmt_time(r.expected_per_step_s)} "
                           f"per step; {fmt_si(r.achieved, 'FLOP/s')} at {r.intensity:.3g} FLOP/B")
                     for r in g.itertuples(index=False)]
            traces.append({
                "type": "scatter", "mode": "markers", "name": esc(layer),
                "x": g["intensity"].tolist(), "y": g["achieved"].tolist(), "text": hover, "hoverinfo": "text",
                "marker": {"size": [6 + 34 * math.sqrt(t / t_max) for t in g["time_per_step_s"]], "opacity": 0.7,
                           "line": {"width": 0.5, "color": "#333"}},
            })
    return {"data": traces, "layout": {
        "title": {"text": esc(f"Roofline on {s.chip_name}")},
        "xaxis": {"type": "log", "title": {"text": "arithmetic intensity (FLOP/byte of HBM traffic)"}},
        "yaxis": {"type": "log", "title": {"text": "achieved FLOP/s"}},
        "legend": {"font": {"size": 10}}, "margin": {"t": 50}}}


def layer_bars_figure(a: Analysis) -> dict:
    """Stacked bars per layer and phase: expected time by bound (compute / memory / communication), exposed
    communication, and the rest of the measured time; the stack adds up to the measured time per step."""
    d = a.ops[a.ops["counted"] & a.ops["step"].notna()]
    per = a.per_step_divisor
    order = [f"{r.layer} ({r.phase})" for r in a.layers.itertuples(index=False)]
    if d.empty:
        return {"data": [], "layout": {"title": {"text": "Per layer: no counted ops"}}}
    label = d["layer"].astype(str) + " (" + d["phase"].astype(str) + ")"
    exp = d["expected_s"].fillna(0.0)
    exposed = d["comm_exposed_s"].fillna(0.0) if "comm_exposed_s" in d else 0.0 * exp
    parts = {
        "expected: compute-bound": exp.where(d["bound"].astype(str) == "compute", 0.0),
        "expected: memory-bound": exp.where(d["bound"].astype(str) == "memory", 0.0),
        "expected: communication-bound": exp.where(d["bound"].astype(str).isin(["communication", "latency"]), 0.0),
        "exposed communication (beyond expected)": (exposed - exp.where(exposed > 0, 0.0)).clip(lower=0.0),
    }
    total = d["measured_s"]
    accounted = sum(parts.values())
    parts["other lost time"] = (total - accounted).clip(lower=0.0)
    traces = []
    for name, values in parts.items():
        sums = values.groupby(label).sum() / per
        y = [float(sums.get(k, 0.0)) * 1e3 for k in order]
        traces.append({"type": "bar", "name": esc(name), "x": [esc(k) for k in order], "y": y})
    ticks = [esc(k) for k in order]
    return {"data": traces, "layout": {"barmode": "stack", "title": {"text": "Time per step by layer (ms)"},
                                       "yaxis": {"title": {"text": "ms per step"}}, "margin": {"b": 160},
                                       "xaxis": {"tickvals": ticks, "ticktext": axis_labels(ticks),
                                                 "automargin": True}}}


def chart_script(figures: dict[str, dict]) -> str:
    """JavaScript that draws each figure into the div of that id ("</" escaped so no string closes the tag)."""
    import json

    out = []
    for div, fig in figures.items():
        payload = json.dumps(fig).replace("</", "<\\/")
        out.append(f'Plotly.newPlot("{div}", {payload}.data, {payload}.layout, {{"responsive": true}});')
    return "\n".join(out)


def plotlyjs_source() -> str:
    """The plotly.js bundle that ships with the plotly package, safe to inline in a <script>."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().replace("</script", "<\\/script")


def render_html(a: Analysis) -> str:
    """The HTML report of an analysis (one self-contained file)."""
    from traceroof.report.breakdown import breakdown_html

    s = a.summary
    head = "<dl>" + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in header_lines(a)) + "</dl>"
    layers_raw = a.layers[["layer", "phase", "time_per_step_s", "share_of_step", "flops_per_step",
                           "hbm_bytes_per_step", "expected_per_step_s", "efficiency", "bound", "lost_per_step_s",
                           "exposed_comm_per_step_s", "worst_op"]]
    anchors = op_anchors(a)  # findings link to their ops' rows: top ops, collectives, else a table of their own
    placed: set[str] = set()

    def ids(names: pd.Series) -> dict[int, str]:
        out = {i: anchors[n] for i, n in enumerate(names.astype(str)) if n in anchors and n not in placed}
        placed.update(n for n in names.astype(str) if n in anchors)
        return out

    top_ids = ids(a.top_ops["hlo_op"]) if len(a.top_ops) else {}
    coll_ids = ids(a.collectives["hlo_op"]) if len(a.collectives) else {}
    rest = [n for n in anchors if n not in placed]
    body = ["<h2>Summary</h2>", head]
    if a.findings:
        body += [f"<h2>Findings ({len(a.findings)}, most time lost per step first)</h2>",
                 findings_html(a, anchors, esc)]
    body += [
        "<h2>Roofline</h2>", '<div id="roofline" class="chart"></div>',
        "<h2>Time per layer</h2>", '<div id="layer-bars" class="chart"></div>',
        timeline_html(a), breakdown_html(a.step_breakdown),
        f"<h2>Per layer (named-scope depth {a.depth}; per step, per device)</h2>",
        table_html(layers_table(a), layers_raw, "layers-table"),
        f"<h2>Top {len(a.top_ops)} ops by median lost time</h2>",
        table_html(top_table(a), None, "top-ops-table", top_ids),
    ]
    if len(a.collectives):
        body += ["<h2>Collectives</h2>", table_html(collectives_table(a), None, "collectives-table", coll_ids)]
    body += memory_html(a.memory)
    from traceroof.report.parallelism import parallelism_html
    body += parallelism_html(a)
    if rest:
        table = finding_ops_table(a, rest)
        body += ["<h2>Other ops named by findings (per step, per device)</h2>",
                 table_html(table, None, "finding-ops-table", {i: anchors[n] for i, n in enumerate(table["op"])})]
    if s.notes:
        body += ["<h2>Missing or partial input</h2>", "<ul>" + "".join(f"<li>{esc(n)}</li>" for n in s.notes)
                 + "</ul>"]
    charts = chart_script({"roofline": roofline_figure(a), "layer-bars": layer_bars_figure(a),
                           **({"step-timeline": timeline_figure(a)} if len(a.step_timeline) else {})})
    return PAGE_TEMPLATE.format(title=esc(f"traceroof: {s.input}"), body="\n".join(body), plotlyjs=plotlyjs_source(),
                        charts=charts)
