"""Safe output in every format: hostile strings from the input (op, layer and file names, chip names and notes)
cannot drive the terminal, become Markdown/HTML markup, break a Markdown table or run as a spreadsheet formula;
JSON keeps them exact; ``-o`` never writes over an input and never leaves half a file."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys

import pandas as pd
import pytest
from click.testing import CliRunner

from traceroof import analyze
from traceroof.cli import main
from traceroof.diff import diff, side_from_analysis
from traceroof.report import render
from traceroof.report.data import TABLES
from traceroof.report.diff import render_diff_html, render_diff_json, render_diff_text
from traceroof.report.output import write_atomic
from traceroof.report.safe import csv_cell, markdown, markdown_cell, printable
from tests.conftest import FIXTURES, HOST_CHIP, ROOT

FORMULA = "=cmd|' /C calc'!A0"
HOSTILE = "\x1b]0;pwned\x07\x1b[2J<img src=x onerror=alert(1)><script>x</script>a|b\\\x9b31m\u202e\x7f\nrow"
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e]")  # newline ends report lines


@pytest.fixture(scope="module")
def sharded():
    return analyze(FIXTURES / "sharded_mlp", chip=HOST_CHIP)


def _poison_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Every text cell as FORMULA + itself + HOSTILE; numbers untouched."""
    text = [c for c in df.columns if not (pd.api.types.is_numeric_dtype(df[c]) or pd.api.types.is_bool_dtype(df[c]))]
    return df.assign(**{c: df[c].astype(object).map(lambda v: v if pd.isna(v) else f"{FORMULA}{v}{HOSTILE}")
                        for c in text})


def _poisoned(a):
    layers = _poison_frame(a.layers)
    layers["lost_per_step_s"] = -layers["lost_per_step_s"].abs() - 1.5  # negative numbers stay numbers
    s = dataclasses.replace(a.summary, input=a.summary.input + HOSTILE, chip_name=HOSTILE, chip_note=HOSTILE,
                            notes=(HOSTILE,))
    return dataclasses.replace(a, op_rows=_poison_frame(a.ops), row_costs=None, layers=layers,
                               top_ops=_poison_frame(a.top_ops),
                               collectives=_poison_frame(a.collectives), summary=s, findings=(_hostile_finding(),))


def _hostile_finding():
    from traceroof.findings import Finding

    return Finding(code=HOSTILE, severity="high", title=HOSTILE, lost_per_step_s=1e-3, advice=HOSTILE,
                   source=HOSTILE, evidence=(HOSTILE,), ops=(HOSTILE,), source_lines=(HOSTILE,))


def _assert_inert_text(text: str, shown: str = "\\x1b]0;pwned\\x07") -> None:
    assert not CONTROL.search(text), repr(CONTROL.search(text).group())
    assert shown in text  # the sequence is shown as text, escaped


def _assert_markdown(text: str) -> None:
    _assert_inert_text(text, "\\\\x1b]0;pwned\\\\x07")  # Markdown's \\ shows one backslash
    assert "<img" not in text and "<script" not in text and "&lt;img src=x" in text
    columns = None
    for line in text.splitlines():  # every row of a table has as many cells as its header: no pipe got out
        if line.startswith("|"):
            n = len(re.split(r"(?<!\\)\|", line.replace("\\\\", "")))
            columns = columns or n
            assert n == columns, line
        else:
            columns = None


def test_safe_functions():
    assert printable("a\x1b[31mb\x07\x9b\x7f\u202e\tc\nd") == "a\\x1b[31mb\\x07\\x9b\\x7f\\u202e\\tc\\nd"
    assert printable("µs ± 3 ÷ 4 → 注意") == "µs ± 3 ÷ 4 → 注意"
    assert markdown("<b>&x</b>") == "&lt;b>&amp;x&lt;/b>" and markdown("a\\b") == "a\\\\b"
    assert markdown("a -> b") == "a -> b" and markdown("> quote") == "\\> quote" and markdown(" >x") == " \\>x"
    assert markdown_cell("a|b\\|c") == "a\\|b\\\\\\|c"
    assert [csv_cell(v) for v in ("=1+2", "+1", "-x", "@SUM(A1)", "\tx", "\rx", "x=1", -3.5, -2, "")] == \
        ["'=1+2", "'+1", "'-x", "'@SUM(A1)", "'\tx", "'\rx", "x=1", -3.5, -2, ""]


def test_terminal_and_markdown_are_inert(sharded):
    a = _poisoned(sharded)
    _assert_inert_text(render(a, "terminal"))
    _assert_markdown(render(a, "markdown"))
    _assert_markdown(render(a, "summary"))


def test_json_keeps_strings_exact(sharded):
    a = _poisoned(sharded)
    text = render(a, "json")
    assert not re.search("[\x7f-\x9f\u202e]", text)  # raw C1/DEL/bidi never reach a terminal that cats it
    doc = json.loads(text)
    assert doc["summary"]["chip_name"] == HOSTILE
    (f,) = doc["findings"]
    assert f["title"] == f["advice"] == f["code"] == HOSTILE and f["source_lines"] == f["ops"] == [HOSTILE]
    assert doc["layers"][0]["layer"] == f"{FORMULA}{sharded.layers['layer'].iloc[0]}{HOSTILE}"


@pytest.mark.parametrize("name", TABLES)
def test_csv_neutralises_formulas_and_keeps_numbers(sharded, name):
    text = render(_poisoned(sharded), "csv", name)
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rows
    for row in rows:
        for v in row.values():
            assert not v.startswith(("=", "+", "@", "\t", "\r")), v
            assert not v.startswith("-") or re.fullmatch(r"-[\d.e+-]+|-inf", v), v  # only numbers start with -
    if name == "layers":
        assert all(r["layer"].startswith("'" + FORMULA) for r in rows)
        assert float(rows[0]["lost_per_step_s"]) < -1.5  # a negative number is written as a number


def test_html_is_escaped(sharded):
    page = render(_poisoned(sharded), "html")
    assert "<img src=x" not in page and "<script>x</script>" not in page and "&lt;script&gt;x" in page
    assert not CONTROL.search(page.split("<script>", 1)[0] + page.rsplit("</script>", 1)[1])


def test_diff_renderers_are_safe():
    base = analyze(FIXTURES / "diff_base", chip=HOST_CHIP)
    new = analyze(FIXTURES / "diff_wide", chip=HOST_CHIP)
    r = diff(side_from_analysis(base, "base" + HOSTILE), side_from_analysis(new, "new" + HOSTILE))
    r = dataclasses.replace(r, layers=_poison_frame(r.layers), ops=_poison_frame(r.ops),
                            unmatched=_poison_frame(r.unmatched), contributors=(HOSTILE,))
    _assert_inert_text(render_diff_text(r, HOSTILE))
    _assert_markdown(render_diff_text(r, HOSTILE, markdown=True))
    page = render_diff_html(r, HOSTILE)
    assert "<img src=x" not in page and "<script>x</script>" not in page
    doc = json.loads(render_diff_json(r, False, HOSTILE))
    assert doc["base"] == "base" + HOSTILE and doc["contributors"] == [HOSTILE]


def test_hostile_file_and_chip_names_through_the_cli(tmp_path):
    """Real input: a profile folder and a chip file whose names carry escape sequences and markup."""
    folder = tmp_path / "run\x1b]0;pwned\x07<img src=x>|"
    shutil.copytree(FIXTURES / "scan_mlp", folder)
    chip = tmp_path / "chip.toml"
    chip.write_text((FIXTURES / "fixture_host.toml").read_text().replace(
        'name = "', 'name = "\\u001b[2J<b>evil</b>|', 1).replace('note = "', 'note = "\\u0007\\u009b31m', 1))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for fmt, check in (("terminal", _assert_inert_text), ("markdown", _assert_markdown)):
        r = subprocess.run([sys.executable, "-m", "traceroof.cli", "analyze", str(folder), "--chip", str(chip),
                            "--format", fmt], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr
        check(r.stdout)
        assert "\\x1b[2J" in r.stdout and ("<b>" not in r.stdout) == (fmt == "markdown")
    r = subprocess.run([sys.executable, "-m", "traceroof.cli", "chips"], capture_output=True, text=True, env=dict(
        env, TRACEROOF_CHIPS_DIR=str(tmp_path)), cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "\\x1b[2J<b>evil" in r.stdout and not CONTROL.search(r.stdout)


# -- -o: never over an input, never half a file --------------------------------------------------------------------

def _refused(args: list[str], victim) -> None:
    before = victim.read_bytes()
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert len(line.splitlines()) == 1 and "would overwrite" in line and "an input of this command" in line, line
    assert victim.read_bytes() == before


def test_output_never_overwrites_an_input(tmp_path):
    fx = tmp_path / "fx"
    shutil.copytree(FIXTURES / "scan_mlp", fx)
    chip = tmp_path / "chip.toml"
    shutil.copy(HOST_CHIP, chip)
    xplane = next(fx.rglob("*.xplane.pb"))
    sibling = next(fx.rglob("*.trace.json.gz"))  # in the run directory, not read (the .xplane.pb is preferred)
    hlo = next((fx / "hlo").glob("*train_step*"))
    (tmp_path / "soft.pb").symlink_to(xplane)
    os.link(xplane, tmp_path / "hard.pb")
    cases = [([str(xplane)], xplane), ([str(fx)], xplane), ([str(fx)], sibling), ([str(fx)], hlo),
             ([str(fx), "--hlo", str(fx / "hlo")], hlo), ([str(xplane)], tmp_path / "soft.pb"),
             ([str(fx)], tmp_path / "hard.pb"), ([str(fx), "--chip", str(chip)], chip)]
    for args, target in cases:
        extra = [] if "--chip" in args else ["--chip", HOST_CHIP]
        _refused(["analyze", *args, *extra, "-o", str(target)], target)
    baseline = tmp_path / "base.json"
    assert CliRunner().invoke(main, ["analyze", str(fx), "--chip", HOST_CHIP, "--format", "json", "-o",
                                     str(baseline)]).exit_code == 0
    _refused(["diff", str(baseline), str(fx), "--chip", HOST_CHIP, "-o", str(baseline)], baseline)
    _refused(["diff", str(baseline), str(fx), "--chip", HOST_CHIP, "-o", str(xplane)], xplane)
    # a new file beside the inputs is fine, and holds what stdout would show
    out = fx / "report.md"
    r = CliRunner().invoke(main, ["analyze", str(fx), "--chip", HOST_CHIP, "--format", "markdown", "-o", str(out)])
    assert r.exit_code == 0 and out.read_text() == CliRunner().invoke(
        main, ["analyze", str(fx), "--chip", HOST_CHIP, "--format", "markdown"]).output


def test_interrupted_write_leaves_no_partial_file(tmp_path, monkeypatch):
    old = tmp_path / "report.md"
    old.write_text("previous report\n")
    os.chmod(old, 0o640)
    link = tmp_path / "link.md"
    link.symlink_to(old)
    write_atomic(link, "new report\n")  # through the link: the link stays, its target is replaced
    assert link.is_symlink() and old.read_text() == "new report\n" and (old.stat().st_mode & 0o777) == 0o640

    import traceroof.report.output as output

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    for victim in ("replace", "fsync"):
        with monkeypatch.context() as m:
            m.setattr(output.os, victim, interrupted)
            with pytest.raises(KeyboardInterrupt):
                write_atomic(old, "x" * 1_000_000)
            with pytest.raises(KeyboardInterrupt):
                write_atomic(tmp_path / "fresh.md", "x" * 1_000_000)
        assert old.read_text() == "new report\n" and not (tmp_path / "fresh.md").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["link.md", "report.md"]  # no temporary left
    r = CliRunner().invoke(main, ["analyze", str(FIXTURES / "scan_mlp"), "--chip", HOST_CHIP, "-o",
                                  str(tmp_path / "no-such-dir" / "r.txt")])
    assert r.exit_code == 2 and r.output.startswith("traceroof: error: cannot write")
    assert len(r.output.splitlines()) == 1


def test_calibrate_output_is_atomic(tmp_path, monkeypatch):
    import traceroof.chips
    import traceroof.report.output as output

    cal = traceroof.chips.Calibration({"f32": 1e11, "bf16": 1e11}, 2e10, 2e10, "test cpu", 2, "2026-01-01T00:00:00Z")
    monkeypatch.setattr(traceroof.chips, "calibrate", lambda: cal)  # measuring is not under test
    chip = tmp_path / "host.toml"
    chip.write_text("previous chip file\n")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(output.os, "replace", full_disk)
        r = CliRunner().invoke(main, ["calibrate", "-o", str(chip)])
    assert r.exit_code == 2 and "cannot write" in r.output and "No space left" in r.output
    assert chip.read_text() == "previous chip file\n" and [p.name for p in tmp_path.iterdir()] == ["host.toml"]
    r = CliRunner().invoke(main, ["calibrate", "-o", str(chip)])
    assert r.exit_code == 0 and traceroof.chips.load_chip_file(chip).peak_flops_per_s["f32"] == 1e11
