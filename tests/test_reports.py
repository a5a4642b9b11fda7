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
