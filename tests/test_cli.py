"""The command line: formats, files, and every bad-input path (one line, exit status 2, no traceback)."""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from traceroof.cli import main
from tests.conftest import FIXTURES, HOST_CHIP, ROOT, fixture_trace_json, fixture_xplane


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_terminal_report_on_fixture():
    r = run("analyze", "fixtures/transformer", "--chip", HOST_CHIP)
    assert r.exit_code == 0, r.output
    assert "layer_*/attention" in r.output and "Top 10 ops by median lost time" in r.output
    assert "MFU" in r.output and "1,070 of 1,070 op events" in r.output


def test_json_csv_markdown_and_output_file(tmp_path):
    r = run("analyze", "fixtures/scan_mlp", "--chip", HOST_CHIP, "--format", "json")
    doc = json.loads(r.output)
    assert doc["summary"]["steps_used"] == [1, 2, 3, 4]
    assert {row["layer"] for row in doc["layers"]} >= {"layers/block", "optimizer"}
    r = run("analyze", "fixtures/scan_mlp", "--chip", HOST_CHIP, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(r.output)))
    assert rows and "time_per_step_s" in rows[0] and "hbm_bytes_per_step" in rows[0]
    out = tmp_path / "ops.csv"
    r = run("analyze", "fixtures/scan_mlp", "--chip", HOST_CHIP, "--format", "csv", "--table", "ops", "-o", str(out))
    assert r.exit_code == 0 and r.output == ""
    ops = list(csv.DictReader(out.open()))
    assert sum(int(r["events"]) for r in ops) == 650 and len(ops) < 650 and "expected_s" in ops[0]  # op rows
    r = run("analyze", "fixtures/scan_mlp", "--chip", HOST_CHIP, "--format", "markdown")
    assert r.output.startswith("# traceroof") and "| layer | phase |" in r.output


def test_chips_lists_every_chip_with_sources():
    r = run("chips", "--sources")
    assert r.exit_code == 0
    for name in ("tpu_v7", "gb200", "mi355x", "v100"):
        assert name in r.output
    assert "no source" not in r.output


def test_calibrate_writes_a_chip_file(tmp_path):
    out = tmp_path / "me.toml"
    r = CliRunner().invoke(main, ["calibrate", "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = run("analyze", "fixtures/scan_mlp", "--chip", str(out))
    assert r.exit_code == 0 and "calibrated host" in r.output


def _corrupt_inputs(tmp: Path) -> dict[str, list[str]]:
    data = fixture_xplane("scan_mlp").read_bytes()
    (tmp / "cut.xplane.pb").write_bytes(data[: len(data) // 3])
    (tmp / "noise.xplane.pb").write_bytes(bytes(range(256)) * 64)
    (tmp / "bad.trace.json.gz").write_bytes(gzip.compress(b"{}")[:-6])
    (tmp / "bad.trace.json").write_text('{"traceEvents": [')
    (tmp / "notes.csv").write_text("a,b\n")
    (tmp / "empty").mkdir()
    bad_hlo = tmp / "bad_hlo"
    bad_hlo.mkdir()
    (bad_hlo / "module_0020.jit_train_step.cpu_after_optimizations.txt").write_text(
        "HloModule jit_train_step\nENTRY e {\n a = f32[2 p(\n")  # the only HLO of the program the trace ran
    return {
        "missing path": ["analyze", str(tmp / "nope")],
        "unknown format": ["analyze", str(tmp / "notes.csv")],
        "empty directory": ["analyze", str(tmp / "empty")],
        "truncated protobuf": ["analyze", str(tmp / "cut.xplane.pb"), "--chip", "h100"],
        "corrupt protobuf": ["analyze", str(tmp / "noise.xplane.pb"), "--chip", "h100"],
        "corrupt gzip": ["analyze", str(tmp / "bad.trace.json.gz"), "--chip", "h100"],
        "truncated json": ["analyze", str(tmp / "bad.trace.json"), "--chip", "h100"],
        "hlo not matching": ["analyze", str(fixture_trace_json("transformer")), "--hlo",
                             str(FIXTURES / "scan_mlp" / "hlo" / "module_0020.jit_train_step.cpu_after_optimizations.txt"),
                             "--chip", "h100"],
        "bad hlo text": ["analyze", str(fixture_trace_json("scan_mlp")), "--hlo", str(bad_hlo), "--chip", "h100"],
        "missing hlo": ["analyze", str(fixture_xplane("scan_mlp")), "--hlo", str(tmp / "nohlo"), "--chip", "h100"],
        "unknown chip": ["analyze", "fixtures/scan_mlp", "--chip", "tpu_v9"],
        "bad chip file": ["analyze", "fixtures/scan_mlp", "--chip", str(tmp / "notes.csv.toml")],
    }


@pytest.mark.parametrize("case", ["missing path", "unknown format", "empty directory", "truncated protobuf",
                                  "corrupt protobuf", "corrupt gzip", "truncated json", "hlo not matching",
                                  "bad hlo text", "missing hlo", "unknown chip", "bad chip file"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
    args = _corrupt_inputs(tmp_path)[case]
    r = subprocess.run([sys.executable, "-m", "traceroof.cli", *args], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2, (case, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("traceroof: error: "), r.stderr
    assert r.stdout == ""


def test_inputs_are_not_modified(tmp_path):
    run_dir = tmp_path / "fx"
    shutil.copytree(FIXTURES / "scan_mlp", run_dir)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert run("analyze", str(run_dir), "--chip", HOST_CHIP).exit_code == 0
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert before == after


def test_trace_json_input_with_hlo():
    r = run("analyze", str(fixture_trace_json("scan_mlp")), "--hlo", "fixtures/scan_mlp/hlo", "--chip", HOST_CHIP)
    assert r.exit_code == 0 and "650 of 650 op events" in r.output


def test_expand_shows_each_block_instance():
    r = run("analyze", "fixtures/transformer", "--chip", HOST_CHIP, "--expand")
    assert r.exit_code == 0, r.output
    assert "layer_0/attention" in r.output and "layer_1/attention" in r.output and "layer_*" not in r.output


def test_hlo_of_another_program_is_ignored_when_the_profile_carries_its_own():
    r = subprocess.run([sys.executable, "-m", "traceroof.cli", "analyze", str(fixture_xplane("transformer")), "--hlo",
                        str(FIXTURES / "scan_mlp" / "hlo" / "module_0020.jit_train_step.cpu_after_optimizations.txt"),
                        "--chip", str(FIXTURES / "fixture_host.toml"), "--format", "json"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)["summary"]
    assert any("describes none of the profiled programs" in n for n in summary["notes"])
    assert summary["join"]["events_joined"] == summary["join"]["events_total"]
    assert summary["hlo_sources"] == {"HloProtos embedded in the profile": 1}  # the ignored file is not a source


def test_a_bug_is_one_line_and_exit_3_never_1(monkeypatch):
    import traceroof.analysis

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(traceroof.analysis, "analyze", broken)
    monkeypatch.delenv("TRACEROOF_DEBUG", raising=False)
    r = run("analyze", "fixtures/scan_mlp", "--chip", HOST_CHIP)
    assert r.exit_code == 3, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("traceroof: internal error: ZeroDivisionError at test_cli.py:")
    assert "please report it" in lines[0]


def test_error_lines_carry_no_control_characters(tmp_path):
    bad = tmp_path / "x\x1b]0;pwned\x07.trace.json"
    bad.write_text('{"traceEvents": [')
    r = subprocess.run([sys.executable, "-m", "traceroof.cli", "analyze", str(bad), "--chip", "h100"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "\x1b" not in r.stderr and "\x07" not in r.stderr, r.stderr
    assert "\\x1b]0;pwned\\x07" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_chips_lists_the_database_and_names_a_bad_user_chip_file(tmp_path, monkeypatch):
    (tmp_path / "broken.toml").write_bytes(b"id = \xff\xfe\n")
    monkeypatch.setenv("TRACEROOF_CHIPS_DIR", str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "traceroof.cli", "chips"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "h100" in r.stdout.lower(), r.stderr
    assert "broken.toml" in r.stderr and r.stderr.startswith("traceroof: note: ")


@pytest.mark.parametrize("args, says", [
    (("analyze", "fixtures/transformer", "--jobs", "0"), "0 is not in the range x>=1; see 'traceroof analyze --help'"),
    (("analyze", "fixtures/transformer", "--format", "xyz"), "'xyz' is not one of"),
    (("analyze", "fixtures/transformer", "--bogus"), "No such option '--bogus'"),
    (("nosuch",), "No such command 'nosuch'; see 'traceroof --help'"),
    (("analyze", "fixtures/transformer", "--jobs", "2", "--dask", "tcp://127.0.0.1:1"), "--jobs 2 with --dask"),
    (("analyze", "fixtures/transformer", "--chip", ""), "an empty chip name"),  # not silently the detected chip
    (("analyze", "fixtures/transformer", "--chip", " "), "an empty chip name"),
    (("diff", "fixtures/transformer", "fixtures/transformer", "--fail-above", "-5"), "-5.0 is not in the range x>=0"),
    (("capture", "127.0.0.1:1", "--every", "1s", "--fail-above", "-1"), "-1.0 is not in the range x>=0"),
])
def test_usage_errors_are_one_line_and_exit_2(args, says):
    r = subprocess.run([sys.executable, "-m", "traceroof.cli", *args], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("traceroof: error: ") and says in r.stderr, r.stderr


def test_bare_command_shows_help_and_version_works():
    r = subprocess.run([sys.executable, "-m", "traceroof.cli"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Commands:" in r.stdout and "analyze" in r.stdout
    r = subprocess.run([sys.executable, "-m", "traceroof.cli", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "traceroof, version" in r.stdout


def test_output_to_an_object_store_url_is_refused_in_one_line(tmp_path):
    for args in (("analyze", "fixtures/transformer", "-o", "gs://bucket/report.json"),
                 ("calibrate", "-o", "s3://bucket/chip.toml")):
        r = subprocess.run([sys.executable, "-m", "traceroof.cli", *args], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "reports are written to a local file" in r.stderr


def test_a_before_optimizations_dump_is_named_as_such(tmp_path):
    """A user passed XLA's before_optimizations.txt (it sits beside the after-optimizations dump): the report said
    the HLO was ignored without saying why. The dump is made by XLA itself (--xla_dump_to) here."""
    dump = tmp_path / "dump"
    code = "import jax, jax.numpy as jnp; jax.jit(lambda x: jnp.tanh(x) * 2).lower(jnp.ones(8)).compile()"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump}", "JAX_PLATFORMS": "cpu"})
    (before,) = dump.glob("*jit__lambda*before_optimizations.txt")
    r = CliRunner().invoke(main, ["analyze", str(fixture_xplane("transformer")), "--hlo", str(before), "--chip",
                                  str(HOST_CHIP), "--format", "json"])
    assert r.exit_code == 0, r.output
    (note,) = [n for n in json.loads(r.output)["summary"]["notes"] if "describes none of the profiled programs" in n]
    assert f"({before.name}: HLO before XLA's optimizations, which is not the program that ran; pass the " \
           "*after_optimizations* dump)" in note


_HUGEPAGE_PROBE = """
import os, numpy as np
from traceroof.cli import main
try:
    main(["chips"])
except SystemExit:
    pass
core = getattr(np, "_core", None) or np.core
print(core.multiarray._set_madvise_hugepage(True), os.environ.get("NUMPY_MADVISE_HUGEPAGE"))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="numpy advises huge pages on Linux only")
@pytest.mark.parametrize("env, expect", [(None, "False 0"), ("1", "True 1")])
def test_the_cli_turns_numpys_huge_page_advice_off_unless_the_user_set_it(env, expect):
    """Transparent huge pages in madvise mode made each first touch of a large array compact memory (20 M events:
    +1.1 system CPU s); the CLI turns numpy's advice off for itself and its workers, a user's setting wins."""
    assert _probe(_HUGEPAGE_PROBE, "NUMPY_MADVISE_HUGEPAGE", env) == expect


def _probe(code: str, variable: str, value: str | None) -> str:
    """The last line ``code`` prints in a child Python, with ``variable`` set to ``value`` (None: unset)."""
    child_env = {k: v for k, v in os.environ.items() if k != variable}
    if value is not None:
        child_env[variable] = value
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env, capture_output=True, text=True,
                          check=True).stdout.split("\n")[-2]


_BLAS_PROBE = """
import os, sys
from traceroof.cli import main
loaded = "numpy" in sys.modules
try:
    main(["chips"])
except SystemExit:
    pass
print(loaded, os.environ.get("OPENBLAS_NUM_THREADS"))
"""


@pytest.mark.parametrize("env, expect", [(None, "False 1"), ("2", "False 2")])
def test_the_cli_sets_one_blas_thread_before_numpy_loads_unless_the_user_set_it(env, expect):
    """numpy's OpenBLAS starts a spinning thread per core when it loads (0.1 CPU s of every run); the setting
    works only if ``import traceroof.cli`` has not loaded numpy yet, which the lazy package ``__init__`` ensures."""
    assert _probe(_BLAS_PROBE, "OPENBLAS_NUM_THREADS", env) == expect
