"""The committed example reports are what reports/generate.py writes now (regenerate them when this fails)."""

from __future__ import annotations

import importlib.util

from tests.conftest import ROOT


def test_reports_are_up_to_date():
    spec = importlib.util.spec_from_file_location("reports_generate", ROOT / "reports" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stale = [name for name, text in mod.reports().items()
             if not (ROOT / "reports" / name).exists() or (ROOT / "reports" / name).read_text(encoding="utf-8") != text]
    assert stale == [], f"stale reports {stale}: run `python reports/generate.py`"


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest" in readme and "python -m pytest" in ci


def test_header_gives_the_median_step_when_slow_steps_raise_the_mean():
    """Keras' fit without step markers (a new user's trial): one step holding a recompilation made the step time
    32.9 ms ± 67.2 ms against 4-14 ms batches; the header now says the median and how many steps raise the mean."""
    from traceroof.report.text import _skewed_median

    assert _skewed_median((0.009, 0.008, 0.185, 0.009, 0.010), 0.0442) == (
        "; median 9.000 ms: 1 step(s) over twice the median raise the mean (the step breakdown shows why)")
    assert _skewed_median((0.009, 0.008, 0.010, 0.009), 0.009) == ""  # no skew: nothing added
    assert _skewed_median((0.009, 0.185), 0.097) == ""  # too few steps to call one slow
    text = " ".join((ROOT / "reports" / "fw_keras_cnn.txt").read_text(encoding="utf-8").split())
    assert "step time 152.233 ms" in text and "median 2.338 ms: 2 step(s)" in text


def test_markdown_continuation_lines_are_sub_items_not_empty_bold():
    """``- ** **: text`` is no bold text in Markdown (it showed literally: a new user's trial); continuation
    lines of the header and the memory section are indented sub-items."""
    for md in (ROOT / "reports").glob("*.md"):
        text = md.read_text(encoding="utf-8")
        assert "** **" not in text, md.name
    assert "\n  - MFU counts" in (ROOT / "reports" / "diff_base.md").read_text(encoding="utf-8")
