"""HTML step timeline (traceroof.report.timeline), unambiguous x-axis labels, and the terminal report's 120
columns (--wide for all)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from click.testing import CliRunner

from tests.conftest import FIXTURES, HOST_CHIP
from tests.test_breakdown import PROFILES, analyzed
from traceroof.breakdown import MAX_DRAWN_OPS
from traceroof.report import render
from traceroof.report.html import layer_bars_figure
from traceroof.report.timeline import axis_labels, layer_order, timeline_figure


def test_timeline_strips_selector_and_execution_order() -> None:
    a = analyzed("sharded_mlp")
    fig = timeline_figure(a)
    items = a.step_timeline
    steps = sorted(set(items["step"]))
    buttons = fig["layout"]["updatemenus"][0]["buttons"]
    assert [b["label"] for b in buttons] == [f"step {s}" for s in steps]
    for b in buttons:  # each button shows exactly one step's traces
        assert len(b["args"][0]["visible"]) == len(fig["data"]) and any(b["args"][0]["visible"])
    names = {t["name"] for t in fig["data"]}
    assert {"exposed communication", "outside any program"} <= names
    # layer lanes follow execution order: the first op of each layer starts no earlier than the previous one's
    order = layer_order(items)
    ops = items[items["kind"] == "op"]
    firsts = [ops.loc[ops["layer"] == la, "start_s"].min() for la in order]
    assert firsts == sorted(firsts) and len(order) == ops["layer"].nunique()
    lanes = fig["layout"]["yaxis"]["categoryarray"][::-1]
    assert [x.split(": ", 1)[1] for x in lanes if not x.endswith((": ops", ": idle / comm"))] == order
    # a drawn step's strips cover its window: ops and marked gaps together reach the step's end
    b = a.step_breakdown
    s0 = steps[0]
    d0 = items[(items["step"] == s0) & (items["device"] == items["device"].iloc[0])]
    assert (d0["start_s"] + d0["duration_s"]).max() == pytest.approx(
        b.loc[(b["step"] == s0) & (b["device"] == d0["device"].iloc[0]), "step_time_s"].iloc[0], rel=1e-6)


def test_timeline_caps_ops_and_page_size() -> None:
    a = analyzed("fw_gpt2/readme")
    drawn = int((a.step_timeline["kind"] == "op").sum())
    assert drawn <= MAX_DRAWN_OPS
    page = render(a, "html")
    m = re.search(r"(\d[\d,]*) of (\d[\d,]*) op events drawn", page)
    assert m and int(m.group(1).replace(",", "")) == drawn
    from traceroof.report.html import plotlyjs_source

    assert len(page) - len(plotlyjs_source()) < 1_500_000  # the page beyond plotly.js stays small


def test_timeline_strings_are_escaped() -> None:
    a = analyzed("transformer")
    bad = '<script>alert("x")</script>'
    t = a.step_timeline.assign(layer=a.step_timeline["layer"] + bad, hlo_op=a.step_timeline["hlo_op"] + bad)
    page = render(dataclasses.replace(a, step_timeline=t), "html")
    assert bad not in page and "alert(" in page


def test_axis_labels_never_ambiguous() -> None:
    names = ["transformer/h/*/attention/query_projection (forward)",
             "transformer/h/*/attention/value_projection (forward)",
             "transformer/h/*/attention/query_projection (backward)", "mlp (forward)"]
    labels = axis_labels(names, limit=20)
    assert len(set(labels)) == len(names)
    assert labels[3] == "mlp (forward)"
    for n, lab in zip(names, labels):
        head, _, tail = lab.partition("…")
        assert lab == n or (n.startswith(head) and n.endswith(tail) and len(lab) < len(n))
    fig = layer_bars_figure(analyzed("fw_gpt2/readme"))
    ticks = fig["layout"]["xaxis"]["ticktext"]
    assert len(set(ticks)) == len(ticks) and fig["layout"]["xaxis"]["automargin"] is True


@pytest.mark.parametrize("name", PROFILES)
def test_terminal_report_fits_120_columns(name: str) -> None:
    text = render(analyzed(name), "terminal")
    assert max(len(line) for line in text.splitlines()) <= 120


def test_wide_shows_everything() -> None:
    from traceroof.cli import main

    r = CliRunner().invoke(main, ["analyze", str(FIXTURES / "sharded_mlp"), "--chip", HOST_CHIP, "--wide"])
    assert r.exit_code == 0, r.output
    assert max(len(line) for line in r.output.splitlines()) > 120
    assert "continued" not in r.output and "…" not in r.output
    narrow = render(analyzed("sharded_mlp"), "terminal")
    assert "… continued: " in narrow  # the wide tables fold; their first columns repeat so rows stay apart
    assert "(f32[256,256], f32[256,256], f32[])" in r.output  # a shape in full


def test_timeline_draws_in_chromium(tmp_path) -> None:
    from tests.test_html import _chromium

    f = tmp_path / "report.html"
    f.write_text(render(analyzed("sharded_mlp"), "html"))
    dom = _chromium(f, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-1000:]
    block = dom.stdout.split('id="step-timeline"', 1)[1][:300000]
    assert "main-svg" in block and "step 1" in block  # drawn, with its step selector
    assert re.search(r'<div id="page-errors">\s*</div>', dom.stdout)
