"""HTML report: self-contained, escaped, and rendered for real in headless Chromium (Debian's chromium,
installed by .ci/run when absent; the browser tests skip without it)."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from traceroof import analyze
from traceroof.diff import diff, side_from_analysis
from traceroof.findings import Finding
from traceroof.report import render
from traceroof.report.diff import render_diff_html
from tests.conftest import FIXTURES, HOST_CHIP

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PAYLOADS = ('<script>document.body.setAttribute("data-pwned","script")</script>',
            '"><img src=x onerror="document.body.setAttribute(\'data-pwned\',\'img\')">')


@pytest.fixture(scope="module")
def sharded():
    return analyze(FIXTURES / "sharded_mlp", chip=HOST_CHIP)


def _chromium(page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.skip("chromium not installed (.ci/run installs Debian's chromium)")
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run",
                           f"--user-data-dir={tmp / 'profile'}", "--window-size=1280,2200",
                           "--virtual-time-budget=5000", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=120)


def test_page_is_self_contained(sharded, tmp_path):
    page = render(sharded, "html")
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=[\"']?(https?:)?//", page)
    assert "Plotly.newPlot" in page and 'id="layers-table"' in page and 'id="collectives-table"' in page


def _poisoned(a):
    """The analysis with markup and script in every profile-derived name."""
    ops = a.ops.copy()
    for col in ("layer", "scope", "hlo_op"):
        cats = list(ops[col].cat.categories)
        ops[col] = ops[col].cat.rename_categories({c: f"{c}{PAYLOADS[i % 2]}" for i, c in enumerate(cats)})
    layers = a.layers.assign(layer=a.layers["layer"].astype(str) + PAYLOADS[0],
                             worst_op=a.layers["worst_op"].astype(str) + PAYLOADS[1])
    top = a.top_ops.assign(hlo_op=a.top_ops["hlo_op"].astype(str) + PAYLOADS[1],
                           shape=a.top_ops["shape"].astype(str) + PAYLOADS[0])
    coll = a.collectives.assign(hlo_op=a.collectives["hlo_op"].astype(str) + PAYLOADS[0])
    summary = dataclasses.replace(a.summary, input=a.summary.input + PAYLOADS[1], notes=(PAYLOADS[0],))
    return dataclasses.replace(a, op_rows=ops, row_costs=None, layers=layers, top_ops=top, collectives=coll,
                               summary=summary,
                               findings=(Finding(code=PAYLOADS[0], severity="high", title=PAYLOADS[1],
                                                 lost_per_step_s=1e-3, advice=PAYLOADS[0], source=PAYLOADS[1],
                                                 evidence=(PAYLOADS[0],), ops=(str(top["hlo_op"].iloc[0]),
                                                                               PAYLOADS[1]),
                                                 source_lines=(PAYLOADS[1],)),))


def test_profile_strings_are_escaped(sharded, tmp_path):
    page = render(_poisoned(sharded), "html")
    for p in PAYLOADS:
        assert p not in page
    assert "<img src=x" not in page and '<script>document.body.setAttribute("data-pwned"' not in page
    f = tmp_path / "poisoned.html"
    f.write_text(page)
    dom = _chromium(f, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-1000:]
    assert "data-pwned" not in dom.stdout.split("<body", 1)[1].split(">", 1)[0]  # no payload ran
    assert "&lt;script&gt;" in dom.stdout  # shown as text


def test_report_renders_in_chromium(sharded, tmp_path):
    f = tmp_path / "report.html"
    f.write_text(render(sharded, "html"))
    dom = _chromium(f, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-1000:]
    html = dom.stdout
    for chart in ("roofline", "layer-bars"):
        block = html.split(f'id="{chart}"', 1)[1][:20000]
        assert "main-svg" in block, f"{chart} chart was not drawn"
    for table in ("layers-table", "top-ops-table", "collectives-table"):
        assert f'id="{table}"' in html
    errors = re.search(r'<div id="page-errors">(.*?)</div>', html, re.S)
    assert errors is not None and errors.group(1).strip() == "", errors.group(1)
    shot = tmp_path / "report.png"
    r = _chromium(f, tmp_path, f"--screenshot={shot}")
    assert r.returncode == 0 and shot.stat().st_size > 20_000
    keep = os.environ.get("TRACEROOF_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / "report.png")


def test_diff_page_renders_side_by_side(tmp_path):
    base = side_from_analysis(analyze(FIXTURES / "diff_base", chip=HOST_CHIP), "base")
    new = side_from_analysis(analyze(FIXTURES / "diff_wide", chip=HOST_CHIP), "new")
    f = tmp_path / "diff.html"
    f.write_text(render_diff_html(diff(base, new), "step time +111.6% (limit 5%)"))
    dom = _chromium(f, tmp_path, "--dump-dom")
    assert dom.returncode == 0
    assert "main-svg" in dom.stdout.split('id="layer-bars"', 1)[1][:20000]
    assert 'id="layers-table"' in dom.stdout and "base: base" in dom.stdout
    assert re.search(r'<div id="page-errors">\s*</div>', dom.stdout)
