"""The benchmark's replicating tool makes a valid, bigger profile that analyzes like the original."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from parsers.xspace import read_xspace
from traceroof import analyze
from tests.conftest import FIXTURES, HOST_CHIP, ROOT, fixture_xplane


@pytest.mark.parametrize("one_line_per_thread", [False, True])
def test_replicated_profile_is_valid_and_joins(tmp_path, one_line_per_thread):
    """Copies on lines of their own, or appended to the original lines (as a long capture records them): either
    way a profile of 3x the steps that analyzes like the original."""
    spec = importlib.util.spec_from_file_location("replicate", ROOT / "benchmarks" / "replicate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "plugins" / "profile" / "run" / "host.xplane.pb"
    src = fixture_xplane("scan_mlp")
    lines = read_xspace(src).plane("/host:CPU").lines
    per_copy = sum(l.event_count for l in lines if l.name != "python")
    written, copies = mod.replicate(src, out, 3 * per_copy, one_line_per_thread)
    assert copies == 3 and written == 3 * per_copy
    got = read_xspace(out).plane("/host:CPU").lines
    assert len(got) == (len(lines) if one_line_per_thread else 3 * len(lines))
    a = analyze(tmp_path, hlo=[FIXTURES / "scan_mlp" / "hlo"], chip=HOST_CHIP, warmup_steps=0)
    base = analyze(FIXTURES / "scan_mlp", chip=HOST_CHIP, warmup_steps=0)
    assert a.summary.steps_total == 3 * base.summary.steps_total
    assert a.summary.join.events_total == 3 * base.summary.join.events_total
    assert a.summary.flops_per_step == pytest.approx(base.summary.flops_per_step)


def _bench_vs_xprof():
    spec = importlib.util.spec_from_file_location("bench_vs_xprof", ROOT / "benchmarks" / "bench_vs_xprof.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def test_bench_vs_xprof_figures_and_targets_from_canned_runs(tmp_path):
    b = _bench_vs_xprof()
    def run(cpu_s, rss_bytes=10**6, rc=0, error=""):
        return b.Run(cpu_s, cpu_s, rss_bytes, rc, error, '{"rows": 0}')

    tr = [run(1.0), run(3.0, 25 * 10**6), run(2.0)]
    xp = [run(20.0), run(30.0, rc=1, error="boom"), run(25.0, 300 * 10**6)]
    s = b.summarize_size(20_000_000, 20_000_000, 20 * 10**6, tr, xp)
    assert s["traceroof_cpu_s"] == 2.0 and s["xprof_cpu_s"] == 22.5  # medians of the runs that succeeded
    assert s["ratio"] == pytest.approx(2.0 / 22.5) and s["traceroof_events_per_cpu_s"] == 10_000_000
    assert s["traceroof_rss_x"] == 1.25 and s["xprof_rss_x"] == 15.0 and s["xprof_rows"] == 0
    assert s["errors"] == ["xprof: boom"]
    assert "| 20 M | 20,000,000 | 20.0 | 2.00 | 22.50 | 0.089 | 10,000,000 | 1.25x | 15.00x |" in b.size_table([s])
    ok = b.summarize_hosts(4, 500_000, {1: [run(4.0)], 2: [b.Run(3.8, 2.0, 1, 0)]})
    assert ok["speedup"] == 2.0 and ok["jobs2_cores_busy"] == 1.9 and not ok["error"]
    rejected = b.summarize_hosts(8, 500_000, {1: [run(0.5, rc=2, error="Error: No such option '--jobs'.")], 2: []})
    assert rejected["error"] == b.JOBS_UNAVAILABLE and rejected["speedup"] is None
    assert b.JOBS_UNAVAILABLE in b.hosts_table([ok, rejected])
    assert "| 4 | 500,000 | 4.00 | 2.00 | 2.00 | 1.00 | 1.90 |" in b.hosts_table([ok])
    lines = b.target_lines([s, b.summarize_size(2_000_000, 2_100_000, 10**5, [run(2.0)], [run(1.0)])],
                           [{**ok, "speedup": 1.5}])
    assert [line.rsplit(": ", 1)[1] for line in lines] == ["met", "met", "met", "MISSED", "MISSED", "MISSED"]

    host = tmp_path / "h.xplane.pb"
    host.write_bytes(b"x")
    run_dir = b.build_run_dir(tmp_path, 4, host) / "plugins" / "profile" / "run"
    (run_dir / "stale.op_stats_v2.pb").write_bytes(b"")
    other = tmp_path / "other.xplane.pb"
    other.write_bytes(b"yy")
    b.build_run_dir(tmp_path, 4, other)  # another host profile: every link replaced, the stray file removed
    assert sorted(p.name for p in run_dir.iterdir()) == [f"host{i}.xplane.pb" for i in range(4)]
    assert all(p.read_bytes() == b"yy" for p in run_dir.iterdir()) and host.read_bytes() == b"x"


def test_bench_vs_xprof_measures_the_child_and_its_children():
    b = _bench_vs_xprof()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    code = f"import subprocess, sys\nx = bytearray(150_000_000)\nsubprocess.run([sys.executable, '-c', {burn!r}])"
    r = b.measure([sys.executable, "-c", code], ROOT)
    assert r.rc == 0 and r.cpu_s >= 0.3 and r.peak_rss_bytes >= 150_000_000 and r.wall_s >= 0.3


def test_bench_vs_xprof_quick_run(tmp_path, capsys):
    b = _bench_vs_xprof()
    res = b.main(["--quick", "--hosts", "4", "--data", str(tmp_path), "--json", str(tmp_path / "r.json")])
    (s,) = res["sizes"]
    assert s["size_events"] == 20_000 and s["events"] > 20_000 and s["traceroof_cpu_s"] > 0
    assert s["traceroof_events_per_cpu_s"] == pytest.approx(s["events"] / s["traceroof_cpu_s"])
    xplane = tmp_path / "vs_xprof" / "events_20000" / "host.xplane.pb"
    assert [p.name for p in xplane.parent.iterdir()] == [xplane.name]  # XProf's saved op stats removed
    if importlib.util.find_spec("xprof"):
        assert s["xprof_cpu_s"] > 0 and s["ratio"] == pytest.approx(s["traceroof_cpu_s"] / s["xprof_cpu_s"])
    (h,) = res["run_dirs"]
    assert h["error"] == b.JOBS_UNAVAILABLE or h["speedup"] > 0
    assert len(list((tmp_path / "run_4hosts" / "plugins" / "profile" / "run").iterdir())) == 4
    assert json.loads((tmp_path / "r.json").read_text())["sizes"][0]["events"] == s["events"]
    assert "| 0.02 M |" in capsys.readouterr().out
