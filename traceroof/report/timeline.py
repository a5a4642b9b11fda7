"""The HTML report's step timeline: one step per device as a Gantt strip (ops coloured by layer; exposed
communication and idle gaps marked by kind), a lane per layer in execution order (the order the model runs, not
time spent), and a selector for the step (:func:`timeline_figure`). Drawn from
:attr:`~traceroof.results.Analysis.step_timeline` (:func:`traceroof.breakdown.timeline_items`), which caps the
ops drawn; the page says how many it shows."""

from __future__ import annotations

import pandas as pd

from traceroof.analysis import Analysis

GAP_COLOURS = {"exposed communication": "#d62728", "launch gap": "#bbbbbb", "host-bound": "#ff7f0e",
               "outside any program": "#555555", "other programs": "#c7c7c7"}
PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#aec7e8",
           "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2", "#9edae5", "#dbdb8d", "#393b79", "#637939", "#8c6d31"]


def layer_order(items: pd.DataFrame) -> list[str]:
    """Layers (``layer (phase)``) in execution order: by the first start of one of their ops over the steps
    drawn (each step's start is 0), so the order follows the model, not the time spent."""
    ops = items[items["kind"] == "op"]
    first = ops.groupby("layer", sort=False)["start_s"].min().sort_values(kind="stable")
    return [str(x) for x in first.index]


def timeline_figure(a: Analysis) -> dict:
    """The Plotly figure (a dict) of the step timeline; empty ``data`` when the analysis has none."""
    from traceroof.report.html import esc
    from traceroof.report.text import fmt_time

    items = a.step_timeline
    if items is None or not len(items):
        return {"data": [], "layout": {"title": {"text": "Step timeline: no steps"}}}
    layers = layer_order(items)
    colour = {la: PALETTE[i % len(PALETTE)] for i, la in enumerate(layers)}
    steps = sorted(int(s) for s in items["step"].unique())
    devices = sorted(str(d) for d in items["device"].unique())
    first_dev = devices[0]
    lanes = [f"{d}: ops" for d in devices] + [f"{d}: idle / comm" for d in devices] + \
        [f"{first_dev}: {la}" for la in layers]
    traces: list[dict] = []
    owner: list[int] = []
    for step in steps:
        d = items[items["step"] == step]
        ops = d[d["kind"] == "op"]
        for la in layers:
            g = ops[ops["layer"] == la]
            if g.empty:
                continue
            lane = g["device"].astype(str) + ": ops"
            by_layer = g[g["device"] == first_dev]
            y = list(lane) + [f"{first_dev}: {la}"] * len(by_layer)
            both = pd.concat([g, by_layer])
            traces.append(_bars(esc(la), both, y, colour[la], [esc(f"{o} ({la}) {fmt_time(t)}") for o, t in
                                                               zip(both["hlo_op"], both["duration_s"])], la))
            owner.append(step)
        for kind, c in GAP_COLOURS.items():
            g = d[d["kind"] == kind]
            if g.empty:
                continue
            traces.append(_bars(esc(kind), g, list(g["device"].astype(str) + ": idle / comm"), c,
                                [esc(f"{kind} {fmt_time(t)}") for t in g["duration_s"]], kind))
            owner.append(step)
    first = steps[0] if steps else None
    for t, s in zip(traces, owner):
        t["visible"] = s == first
    buttons = [{"label": esc(f"step {s}"), "method": "update",
                "args": [{"visible": [o == s for o in owner]},
                         {"title": {"text": esc(_title(a, s)), "x": 0.1, "xanchor": "left"}}]}
               for s in steps]
    return {"data": traces, "layout": {
        "title": {"text": esc(_title(a, first)), "x": 0.1, "xanchor": "left"}, "barmode": "overlay", "bargap": 0.2,
        "xaxis": {"title": {"text": "ms from the step's start"}},
        "yaxis": {"categoryorder": "array", "categoryarray": list(reversed(lanes)), "automargin": True,
                  "type": "category"},
        "height": chart_height(a), "legend": {"font": {"size": 10}, "traceorder": "normal"},
        "updatemenus": [{"buttons": buttons, "direction": "down", "x": 0, "xanchor": "left", "y": 1.0,
                         "yanchor": "bottom", "showactive": True}],
        "margin": {"t": 90}}}


def _bars(name: str, g: pd.DataFrame, y: list[str], colour: str, hover: list[str], group: str) -> dict:
    return {"type": "bar", "orientation": "h", "name": name, "legendgroup": name,
            "base": [round(x * 1e3, 6) for x in g["start_s"]], "x": [round(x * 1e3, 6) for x in g["duration_s"]],
            "y": y, "marker": {"color": colour, "line": {"width": 0}}, "text": hover, "hoverinfo": "text",
            "textposition": "none"}


def _title(a: Analysis, step: int | None) -> str:
    from traceroof.report.text import fmt_time

    b = a.step_breakdown
    if step is None or b is None or not len(b):
        return "Step timeline"
    t = float(b.loc[b["step"] == step, "step_time_s"].mean())
    return f"Step {step} ({fmt_time(t)}, mean over devices): ops by layer, exposed communication and idle gaps"


def timeline_html(a: Analysis) -> str:
    """The section: a note on what is drawn, and the chart's div (drawn by :func:`timeline_figure`)."""
    from traceroof.report.html import esc

    items = a.step_timeline
    if items is None or not len(items):
        return ""
    total = int(items.attrs.get("ops_total", 0))
    drawn = int((items["kind"] == "op").sum())
    steps = sorted(int(s) for s in items["step"].unique())
    devices = items["device"].nunique()
    all_devices = a.step_breakdown["device"].nunique() if len(a.step_breakdown) else devices
    note = (f"Steps {', '.join(map(str, steps))} (the median and the slowest step first), {devices} of "
            f"{all_devices} device(s); {drawn:,} of {total:,} op events drawn"
            + (" (the longest of each strip)" if drawn < total else "")
            + ". Lanes: each device's ops (coloured by layer), its exposed communication and idle gaps (launch "
              "gaps, host-bound, outside any program; other programs: those launched outside the steps, not "
              "in the step time), then the first device's ops one lane per layer, in "
              "execution order.")
    return (f'<h2>Step timeline</h2><p>{esc(note)}</p><div id="step-timeline" class="chart" '
            f'style="height: {chart_height(a)}px"></div>')


def chart_height(a: Analysis) -> int:
    """Height (px) of the timeline chart: one lane per device twice, and one per layer."""
    items = a.step_timeline
    n = 2 * items["device"].nunique() + len(layer_order(items)) if items is not None and len(items) else 0
    return max(300, 22 * n + 160)


AXIS_LABEL_MAX = 32  # characters of an x-axis category label before it is shortened in the middle


def axis_labels(names: list[str], limit: int = AXIS_LABEL_MAX) -> list[str]:
    """Tick labels for category names: a name longer than ``limit`` is cut in the middle with "…" (its start
    and its end kept), and labels that would then collide are lengthened until every label is distinct (the full
    name at worst), so no two categories read alike and none is cut at the chart's edge."""
    def cut(s: str, n: int) -> str:
        if len(s) <= n:
            return s
        head = (n - 1) // 2
        return s[:head] + "…" + s[len(s) - (n - 1 - head):]

    lengths = {s: limit for s in names}
    while True:
        labels = {s: cut(s, lengths[s]) for s in names}
        seen: dict[str, list[str]] = {}
        for s, lab in labels.items():
            seen.setdefault(lab, []).append(s)
        clash = [s for group in seen.values() if len(set(group)) > 1 for s in group]
        if not clash:
            return [labels[s] for s in names]
        for s in clash:
            lengths[s] = min(len(s), lengths[s] + 4)
