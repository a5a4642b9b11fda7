"""The fuzzer in the suite: 1,000 mutated inputs per input class (``tests/fuzzing.py``) end in a report whose
figures are in range (or say why not) or in a one-line TraceroofError; bad input through the CLI exits 2 with
one ``traceroof: error:`` line. ``TRACEROOF_FUZZ_N`` changes the number per class; the long campaign is
``benchmarks/fuzz_campaign.py``.

Cost (measured on the 2-core development machine, idle): the 7,000 inputs take about 2.5 CPU-minutes, 76 s of
wall time on 2 cores (127 s before the fixed per-analysis costs were cut); the workers use every core the suite may
use (up to 8). A full analysis of the tiny .xplane.pb seed costs about 30 ms, most of it pandas' fixed cost per
operation (op table, step breakdown, layer rollup, op statistics), and about half the mutated inputs reach it; the
rest end in a one-line error within a few milliseconds."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fuzzing

N = int(os.environ.get("TRACEROOF_FUZZ_N", "1000"))

# Crash sites still open: a class listed here is expected to fail (not strict), its reason naming the sites
# (file:line ExceptionType, or the figure). Empty: every site the baseline campaign found is fixed and has a
# regression test (tests/test_input_contract*.py, tests/test_fuzz_regressions.py).
KNOWN_OPEN: dict[str, str] = {}


def _marks(cls: str) -> list:
    return [pytest.mark.xfail(strict=False, reason=KNOWN_OPEN[cls])] if cls in KNOWN_OPEN else []


@pytest.fixture(scope="module")
def results() -> dict[str, list[fuzzing.Result]]:
    out: dict[str, list[fuzzing.Result]] = {c: [] for c in fuzzing.CLASSES}
    workers = max(2, min(len(os.sched_getaffinity(0)), 8))  # every core the suite may use (2 here, more in CI)
    for r in fuzzing.run_many(fuzzing.interleaved(fuzzing.CLASSES, N), workers=workers, timeout_s=15.0):
        out[r.cls].append(r)
    return out


@pytest.mark.parametrize("cls", [pytest.param(c, marks=_marks(c)) for c in fuzzing.CLASSES])
def test_fuzzed_inputs_end_in_a_report_or_a_traceroof_error(cls: str, results: dict) -> None:
    rs = results[cls]
    assert len(rs) == N
    summary = fuzzing.summarize(rs)
    counts = summary["per_class"][cls]
    assert counts.get("report", 0) and counts.get("error", 0), f"mutations reach neither side: {counts}"
    lines = [f"{f['count']} x {f['outcome']} {f['place']}: python -m tests.fuzzing {cls} {f['example_seed']} "
             f"({f['example_mutation']}) {f['detail'][:120]}" for f in summary["findings"]]
    assert not lines, f"{len(lines)} finding place(s) in {N} {cls} inputs ({counts}):\n" + "\n".join(lines)


def test_inputs_are_deterministic_and_mutated() -> None:
    for cls in fuzzing.CLASSES:
        a, b = fuzzing.make_input(cls, 7), fuzzing.make_input(cls, 7)
        assert a == b
        seeds = {fuzzing.make_input(cls, s).files[fuzzing.make_input(cls, s).main] for s in range(20)}
        assert len(seeds) > 10, cls  # different seeds, different inputs


def test_structure_aware_mutations_make_the_named_cases() -> None:
    import random

    hlo = fuzzing.seed_bytes("hlo_text")
    texts = [fuzzing.mutate_hlo(random.Random(s), hlo) for s in range(400)]
    self_calls = [t.decode() for t, how in texts if how == "hlo:selfcall"]
    assert any("%fused_computation" in t and "calls=%fused_computation" in t.split("%fused_computation", 1)[1]
               .split("ENTRY", 1)[0] or "calls=%main" in t for t in self_calls)
    assert any(b"{1<0}" in t for t, _ in texts) and any(b"(((" in t for t, _ in texts)
    proto = fuzzing.seed_bytes("xplane")
    hows = {fuzzing.mutate_protobuf(random.Random(s), proto)[1].split("@")[0] for s in range(400)}
    assert {"protobuf:varint", "protobuf:length", "protobuf:field0", "protobuf:nest"} <= hows
    js = [fuzzing.mutate_json(random.Random(s), fuzzing.seed_bytes("trace_json")) for s in range(300)]
    assert any(t.count(b"[") > 100_000 for t, _ in js) and any(b"NaN" in t for t, _ in js)
    toml = [fuzzing.mutate_toml(random.Random(s), fuzzing.seed_bytes("chip")) for s in range(200)]
    assert any(b"gpus_per_node" in t and b"= 0" in t for t, _ in toml) and any(b"\xff" in t for t, _ in toml)


def test_range_checks_catch_garbage_figures() -> None:
    import traceroof

    a = traceroof.analyze(fuzzing.seed_files()["xplane"], chip=str(fuzzing.seed_files()["chip"]))
    assert fuzzing.check_analysis(a) == []
    for change, what in (({"step_time_mean_s": -3.07e6}, "step_time_mean_s"), ({"mfu": 1.3e13}, "mfu"),
                         ({"flops_per_step": float("nan")}, "flops_per_step"),
                         ({"peak_flops_per_s": {"f32": 0.0}}, "peak used")):
        bad = dataclasses.replace(a, summary=dataclasses.replace(a.summary, **change))
        assert [p for p in fuzzing.check_analysis(bad) if p.startswith(what)], change
    noted = dataclasses.replace(a, summary=dataclasses.replace(a.summary, mfu=3.0, notes=("MFU 300 %: ...",)))
    assert fuzzing.check_analysis(noted) == []


def test_runner_records_hangs_crashes_and_memory_blowups(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    real = fuzzing.run_entry

    def entry(inp: fuzzing.FuzzInput, folder: Path):
        if inp.seed == 1:
            time.sleep(60)
        if inp.seed == 2:
            os.kill(os.getpid(), 9)
        if inp.seed == 3:
            return bytearray(8 << 30)
        if inp.seed == 4:
            raise KeyError("boom")
        return real(inp, folder)

    monkeypatch.setattr(fuzzing, "run_entry", entry)
    rs = {r.seed: r for r in fuzzing.run_many([("chip_toml", s) for s in range(5)], timeout_s=3,
                                              memory_bytes=1 << 30)}
    assert [rs[s].outcome for s in range(1, 5)] == ["timeout", "crash", "memory", "bug"]
    assert rs[4].place.endswith("(outside the project) KeyError")


def _first_error(cls: str) -> fuzzing.FuzzInput:
    import tempfile

    for seed in range(200):
        inp = fuzzing.make_input(cls, seed)
        with tempfile.TemporaryDirectory() as d:
            if fuzzing.run_one(inp, Path(d)).outcome == "error":
                return inp
    raise AssertionError(f"no {cls} input in 200 gave a TraceroofError")


def test_bad_inputs_through_the_cli_exit_2_with_one_line(tmp_path: Path) -> None:
    procs = []
    for cls in fuzzing.CLASSES:
        inp = _first_error(cls)
        folder = tmp_path / cls
        folder.mkdir()
        fuzzing.write_input(inp, folder)
        cmd = [sys.executable, "-m", "traceroof.cli", *fuzzing.cli_args(inp, folder)]
        procs.append((cls, inp, subprocess.Popen(cmd, cwd=fuzzing.ROOT, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, text=True)))
    for cls, inp, p in procs:
        out, err = p.communicate(timeout=120)
        lines = err.splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("traceroof: error: "), \
            (cls, inp.seed, inp.mutation, p.returncode, err[-500:])


def test_the_readme_fuzzing_commands_run_as_written(tmp_path: Path) -> None:
    """README: ``python benchmarks/fuzz_campaign.py -n 10000 -o fuzz.json`` (here -n 3) and
    ``python -m tests.fuzzing CLASS SEED -o DIR``."""
    import json

    r = subprocess.run([sys.executable, "benchmarks/fuzz_campaign.py", "-n", "3", "-o", str(tmp_path / "fuzz.json")],
                       cwd=fuzzing.ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "fuzz.json").read_text())
    assert sum(sum(c.values()) for c in doc["per_class"].values()) == 3 * len(fuzzing.CLASSES)
    r = subprocess.run([sys.executable, "-m", "tests.fuzzing", "chip_toml", "5", "-o", str(tmp_path / "one")],
                       cwd=fuzzing.ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "->" in r.stdout and any((tmp_path / "one").iterdir()), r.stderr[-2000:]
