"""traceroof against XProf's own ``hlo_stats`` conversion, side by side, and multi-host run directories with
``--jobs 1`` against ``--jobs 2`` (issue 12).

Usage::

    python benchmarks/bench_vs_xprof.py [--events 0.5,2,5,20] [--repeat 3] [--hosts 4,8] [--host-events 500000]
                                        [--json results.json] [--data benchmarks/data] [--quick]
                                        [--one-line-per-thread]

Inputs are built with ``benchmarks/replicate.py`` (the transformer fixture's op events replicated; with
``--one-line-per-thread`` the copies are appended to the original lines, ``events_<n>_threads``) into
``--data`` (default ``benchmarks/data/``, git-ignored), and reused when present:
``vs_xprof/events_<n>/host.xplane.pb`` per size (``--events`` in millions), and
``run_<N>hosts/plugins/profile/run/host<i>.xplane.pb``: N hard links to (or copies of) the ``--host-events``
profile.

What is measured, each run in a fresh child process, ``--repeat`` times, the two tools alternating:

* traceroof: the whole ``python -m traceroof.cli analyze FILE --hlo fixtures/transformer/hlo --chip
  fixtures/fixture_host.toml --format json -o <tmp>.json`` process (``--chip`` given so no run calibrates the
  host);
* XProf: ``xprof.convert.raw_to_tool_data.xspace_to_tool_data([FILE], "hlo_stats", {"use_saved_result":
  False})`` in a fresh ``python`` process. XProf caches its op stats beside the xplane
  (``ALL_HOSTS.op_stats_v2.pb``): every file of the profile's folder but the ``.xplane.pb`` is removed before and
  after each run, so each run converts. On a CPU profile XProf's table has no rows (its op stats come from device
  planes): the row count is reported; it still reads and processes the whole XSpace.
* run directories: ``traceroof analyze <logdir> ... --format json --jobs 1`` and ``--jobs 2``, wall seconds and
  CPU seconds of the process tree. When the CLI rejects ``--jobs`` (exit 2, "No such option") that part reports
  ``--jobs not available``.

CPU seconds are user + sys of the child and of every descendant it waited for (``RUSAGE_CHILDREN`` of this process
before and after, Linux). Peak RSS is ``ru_maxrss`` of the child from ``os.wait4`` (KiB on Linux; the largest of
the child and its waited-for descendants; it includes the interpreter), shown as a multiple of the file size.
Per size: median CPU seconds of each tool, the ratio traceroof / XProf, traceroof's events per CPU second (every
event in the file), the largest peak RSS of each. Per run directory: median wall and CPU seconds, wall(jobs 1) /
wall(jobs 2), and cores busy = CPU / wall.

Targets: traceroof / XProf CPU <= 0.10 at 2 M and 20 M events; >= 8 M events per CPU second at 20 M; traceroof peak
RSS <= 1.5x the file (checked at 2 M and 20 M: below, the interpreter dominates); wall(jobs 1) / wall(jobs 2) >= 1.7
on 4 hosts. The script prints each measured target as met or MISSED.

Bytecode: traceroof's own modules are compiled first (``python -m compileall traceroof parsers``, into the
git-ignored ``__pycache__`` folders), as ``pip install`` does for an installed package and for XProf's. Without it
an editable checkout run under ``PYTHONDONTWRITEBYTECODE=1`` (as on this project's machines) recompiles about 70
modules in every timed process: 0.15-0.2 CPU s that no installed user pays.

Absolute times on a small shared machine (2 cores here) are noisy: quote medians and ratios. XProf needs about 16x
the file in memory (the 20 M file is ~800 MB). ``--quick`` (for tests): 20,000 events, one repeat, run directories
of 20,000-event hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HLO = ROOT / "fixtures" / "transformer" / "hlo"
CHIP = ROOT / "fixtures" / "fixture_host.toml"
QUICK_EVENTS = 20_000
TARGETS = {"ratio_max": 0.10, "ratio_at_events": (2_000_000, 20_000_000), "events_per_cpu_s_min": 8e6,
           "events_per_cpu_s_at": 20_000_000, "rss_multiple_max": 1.5, "jobs_speedup_min": 1.7,
           "jobs_speedup_hosts": 4}
JOBS_UNAVAILABLE = "--jobs not available"

XPROF_CHILD = """\
import json, sys
from xprof.convert.raw_to_tool_data import xspace_to_tool_data
data, _ = xspace_to_tool_data([sys.argv[1]], "hlo_stats", {"use_saved_result": False})
if data is None:
    sys.exit("XProf's hlo_stats conversion failed")
print(json.dumps({"rows": len(json.loads(data).get("rows", []))}))
"""


@dataclass(frozen=True)
class Run:
    """One measured child process: CPU (user + sys, descendants included) and wall seconds, peak RSS in bytes,
    exit code, the last line of its stderr (failures) and its stdout."""

    cpu_s: float
    wall_s: float
    peak_rss_bytes: int
    rc: int
    error: str = ""
    stdout: str = ""


def measure(cmd: list[str], cwd: Path) -> Run:
    """Run ``cmd`` in ``cwd`` and measure it (this process must have no other child running)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        wall_s = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [line for line in stderr.splitlines() if line.strip()]
    error = "" if proc.returncode == 0 else (lines[-1].strip() if lines else f"exit {proc.returncode}")
    return Run(cpu_s, wall_s, usage.ru_maxrss * 1024, proc.returncode, error, stdout)


def traceroof_cmd(path: Path, out: Path, jobs: int | None = None) -> list[str]:
    """The measured ``traceroof analyze`` command line."""
    cmd = [sys.executable, "-m", "traceroof.cli", "analyze", str(path), "--hlo", str(HLO), "--chip", str(CHIP),
           "--format", "json", "-o", str(out)]
    return cmd + (["--jobs", str(jobs)] if jobs is not None else [])


def clear_xprof_cache(xplane: Path) -> None:
    """Remove every file beside ``xplane`` but ``*.xplane.pb`` (XProf's saved op stats)."""
    for p in xplane.parent.iterdir():
        if p.is_file() and not p.name.endswith(".xplane.pb"):
            p.unlink()


def build_profile(data: Path, events: int, one_line_per_thread: bool = False) -> Path:
    """The replicated profile of ``events`` op events under ``data`` (built when missing); with
    ``one_line_per_thread`` its copies are appended to the original lines (``replicate.py --one-line-per-thread``)."""
    suffix = "_threads" if one_line_per_thread else ""
    path = data / "vs_xprof" / f"events_{events}{suffix}" / "host.xplane.pb"
    if not path.exists():
        print(f"building {path} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "replicate.py"), "--events", str(events),
                        "-o", str(path)] + ["--one-line-per-thread"] * one_line_per_thread,
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return path


def build_run_dir(data: Path, hosts: int, host_file: Path) -> Path:
    """``data/run_<hosts>hosts`` whose run folder holds ``hosts`` hard links to (or copies of) ``host_file``."""
    logdir = data / f"run_{hosts}hosts"
    run = logdir / "plugins" / "profile" / "run"
    run.mkdir(parents=True, exist_ok=True)
    names = [f"host{i}.xplane.pb" for i in range(hosts)]
    for p in run.iterdir():
        if p.name not in names:
            p.unlink()  # not one of this run's hosts
    for name in names:
        dst = run / name
        if dst.exists() and dst.stat().st_size == host_file.stat().st_size and os.path.samefile(dst, host_file):
            continue
        dst.unlink(missing_ok=True)
        try:
            os.link(host_file, dst)
        except OSError:
            shutil.copyfile(host_file, dst)
    return logdir


def count_events(path: Path) -> int:
    """Every event of every line of every plane of the file."""
    sys.path.insert(0, str(ROOT))
    from parsers.xspace import read_xspace

    return sum(line.event_count for plane in read_xspace(path).planes for line in plane.lines)


def _median(runs: list[Run], key: str) -> float | None:
    ok = [getattr(r, key) for r in runs if r.rc == 0]
    return statistics.median(ok) if ok else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_size(size_events: int, events: int, file_bytes: int, tr: list[Run], xp: list[Run]) -> dict:
    """The per-size figures of the profile built for ``size_events`` op events (``events``: every event in the
    file): medians of CPU seconds, ratio, rate and the largest peak RSS over the file size (``None`` where every
    run of a tool failed)."""
    tr_cpu, xp_cpu = _median(tr, "cpu_s"), _median(xp, "cpu_s")
    tr_rss = max((r.peak_rss_bytes for r in tr if r.rc == 0), default=None)
    xp_rss = max((r.peak_rss_bytes for r in xp if r.rc == 0), default=None)
    rows = [json.loads(r.stdout.strip().splitlines()[-1])["rows"] for r in xp if r.rc == 0 and r.stdout.strip()]
    return {"size_events": size_events, "events": events, "file_bytes": file_bytes,
            "traceroof_cpu_s": tr_cpu, "xprof_cpu_s": xp_cpu,
            "ratio": _div(tr_cpu, xp_cpu), "traceroof_events_per_cpu_s": _div(events, tr_cpu),
            "traceroof_rss_x": _div(tr_rss, file_bytes), "xprof_rss_x": _div(xp_rss, file_bytes),
            "traceroof_wall_s": _median(tr, "wall_s"), "xprof_wall_s": _median(xp, "wall_s"),
            "xprof_rows": rows[0] if rows else None,
            "errors": sorted({f"{name}: {r.error}" for name, runs in (("traceroof", tr), ("xprof", xp))
                              for r in runs if r.rc != 0}),
            "runs": {"traceroof": [asdict(r) for r in tr], "xprof": [asdict(r) for r in xp]}}


def summarize_hosts(hosts: int, host_events: int, by_jobs: dict[int, list[Run]]) -> dict:
    """The per-run-directory figures; ``error`` is ``--jobs not available`` when the CLI rejected the option."""
    runs = [r for rs in by_jobs.values() for r in rs]
    if any(r.rc == 2 and "No such option" in r.error for r in runs):
        error = JOBS_UNAVAILABLE
    else:
        error = "; ".join(sorted({r.error for r in runs if r.rc != 0}))
    out = {"hosts": hosts, "host_events": host_events, "error": error,
           "runs": {str(j): [asdict(r) for r in rs] for j, rs in by_jobs.items()}}
    for j, rs in by_jobs.items():
        wall, cpu = _median(rs, "wall_s"), _median(rs, "cpu_s")
        out[f"jobs{j}_wall_s"], out[f"jobs{j}_cpu_s"], out[f"jobs{j}_cores_busy"] = wall, cpu, _div(cpu, wall)
    out["speedup"] = None if error else _div(out.get("jobs1_wall_s"), out.get("jobs2_wall_s"))
    return out


def _f(x: float | None, fmt: str) -> str:
    return "failed" if x is None else format(x, fmt)


def size_table(sizes: list[dict]) -> str:
    """The markdown table of the per-size figures."""
    head = ("| size | events | file MB | traceroof CPU s | XProf CPU s | traceroof / XProf | traceroof events / CPU s "
            "| traceroof RSS / file | XProf RSS / file |")
    lines = [head, "|" + "---:|" * head.count(" | ") + "---:|"]
    for s in sizes:
        lines.append(f"| {s['size_events'] / 1e6:g} M | {s['events']:,} | {s['file_bytes'] / 1e6:,.1f} | "
                     f"{_f(s['traceroof_cpu_s'], '.2f')} | "
                     f"{_f(s['xprof_cpu_s'], '.2f')} | {_f(s['ratio'], '.3f')} | "
                     f"{_f(s['traceroof_events_per_cpu_s'], ',.0f')} | {_f(s['traceroof_rss_x'], '.2f')}x | "
                     f"{_f(s['xprof_rss_x'], '.2f')}x |")
    return "\n".join(lines)


def hosts_table(runs: list[dict]) -> str:
    """The markdown table of the run-directory figures."""
    head = ("| hosts | events / host | wall s jobs 1 | wall s jobs 2 | jobs 1 / jobs 2 | cores busy jobs 1 "
            "| cores busy jobs 2 |")
    lines = [head, "|" + "---:|" * head.count(" | ") + "---:|"]
    for h in runs:
        if h["error"]:
            lines.append(f"| {h['hosts']} | {h['host_events']:,} | {h['error']} | | | | |")
            continue
        lines.append(f"| {h['hosts']} | {h['host_events']:,} | {_f(h['jobs1_wall_s'], '.2f')} | "
                     f"{_f(h['jobs2_wall_s'], '.2f')} | {_f(h['speedup'], '.2f')} | "
                     f"{_f(h['jobs1_cores_busy'], '.2f')} | {_f(h['jobs2_cores_busy'], '.2f')} |")
    return "\n".join(lines)


def target_lines(sizes: list[dict], runs: list[dict]) -> list[str]:
    """One line per target that this run measured: the figure, the target, met or missed."""
    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    out = []
    for s in sizes:
        ev = s["size_events"]
        if ev in TARGETS["ratio_at_events"] and s["ratio"] is not None:
            out.append(f"traceroof / XProf CPU at {ev / 1e6:g} M: {s['ratio']:.3f} (target <= "
                       f"{TARGETS['ratio_max']}): {verdict(s['ratio'] <= TARGETS['ratio_max'])}")
        if ev == TARGETS["events_per_cpu_s_at"] and s["traceroof_events_per_cpu_s"] is not None:
            rate = s["traceroof_events_per_cpu_s"]
            out.append(f"traceroof events / CPU s at {ev / 1e6:g} M: {rate / 1e6:.2f} M (target >= "
                       f"{TARGETS['events_per_cpu_s_min'] / 1e6:g} M): "
                       f"{verdict(rate >= TARGETS['events_per_cpu_s_min'])}")
        if ev in TARGETS["ratio_at_events"] and s["traceroof_rss_x"] is not None:
            rss_x = s["traceroof_rss_x"]
            out.append(f"traceroof peak RSS at {ev / 1e6:g} M: {rss_x:.2f}x the file (target <= "
                       f"{TARGETS['rss_multiple_max']}x): {verdict(rss_x <= TARGETS['rss_multiple_max'])}")
    for h in runs:
        if h["hosts"] == TARGETS["jobs_speedup_hosts"]:
            if h["speedup"] is None:
                out.append(f"jobs 1 / jobs 2 wall on {h['hosts']} hosts: {h['error'] or 'failed'}")
            else:
                out.append(f"jobs 1 / jobs 2 wall on {h['hosts']} hosts: {h['speedup']:.2f} (target >= "
                           f"{TARGETS['jobs_speedup_min']}): {verdict(h['speedup'] >= TARGETS['jobs_speedup_min'])}")
    return out


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_size(data: Path, events: int, repeat: int, tmp: Path, one_line_per_thread: bool = False) -> dict:
    """Build (or reuse) the profile of ``events`` op events and time both tools on it, alternating."""
    path = build_profile(data, events, one_line_per_thread)
    total, size = count_events(path), path.stat().st_size
    tr, xp = [], []
    for i in range(repeat):
        tr.append(measure(traceroof_cmd(path, tmp / "out.json"), ROOT))
        _log(f"{total:,} events, traceroof run {i + 1}: {tr[-1].cpu_s:.2f} CPU s, "
             f"{tr[-1].peak_rss_bytes / 1e6:,.0f} MB {tr[-1].error}")
        clear_xprof_cache(path)
        xp.append(measure([sys.executable, "-c", XPROF_CHILD, str(path)], tmp))
        clear_xprof_cache(path)
        _log(f"{total:,} events, XProf run {i + 1}: {xp[-1].cpu_s:.2f} CPU s, "
             f"{xp[-1].peak_rss_bytes / 1e6:,.0f} MB {xp[-1].error}")
    return summarize_size(events, total, size, tr, xp)


def bench_hosts(data: Path, hosts: int, host_events: int, repeat: int, tmp: Path,
                one_line_per_thread: bool = False) -> dict:
    """Time ``--jobs 1`` and ``--jobs 2`` on a run directory of ``hosts`` copies of one host profile."""
    logdir = build_run_dir(data, hosts, build_profile(data, host_events, one_line_per_thread))
    by_jobs: dict[int, list[Run]] = {1: [], 2: []}
    for i in range(repeat):
        for jobs in (1, 2):
            r = measure(traceroof_cmd(logdir, tmp / "out.json", jobs), ROOT)
            by_jobs[jobs].append(r)
            _log(f"{hosts} hosts, --jobs {jobs} run {i + 1}: {r.wall_s:.2f} wall s, {r.cpu_s:.2f} CPU s {r.error}")
            if r.rc == 2 and "No such option" in r.error:
                return summarize_hosts(hosts, host_events, by_jobs)
    return summarize_hosts(hosts, host_events, by_jobs)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def compile_bytecode() -> None:
    """Compile traceroof's modules to bytecode, as an install does (see the module docstring).

    :raises subprocess.CalledProcessError: a module does not compile.
    """
    subprocess.run([sys.executable, "-m", "compileall", "-q", "traceroof", "parsers"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> dict:
    """Parse arguments, run the benchmark, print the tables and targets; returns the raw results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", default="0.5,2,5,20", help="profile sizes in millions of op events")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hosts", default="4,8", help="run directories of this many hosts ('' for none)")
    ap.add_argument("--host-events", type=int, default=500_000, help="op events of each host's profile")
    ap.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data")
    ap.add_argument("--json", type=Path, help="write the raw results here")
    ap.add_argument("--quick", action="store_true", help="20,000 events, one repeat (tests)")
    ap.add_argument("--one-line-per-thread", action="store_true",
                    help="profiles whose copies are appended to the original lines (a few lines of millions of "
                         "events, as a long capture has) instead of lines of their own")
    args = ap.parse_args(argv)
    sizes = [int(round(float(x) * 1e6)) for x in args.events.split(",") if x.strip()]
    hosts = [int(x) for x in args.hosts.split(",") if x.strip()]
    repeat, host_events = args.repeat, args.host_events
    if args.quick:
        sizes, repeat, host_events = [QUICK_EVENTS], 1, QUICK_EVENTS
    results = {"commit": _commit(), "python": sys.version.split()[0], "machine": platform.machine(),
               "cpus": os.cpu_count(), "repeat": repeat, "one_line_per_thread": args.one_line_per_thread,
               "sizes": [], "run_dirs": []}
    compile_bytecode()
    with tempfile.TemporaryDirectory() as tmp:
        for events in sizes:
            results["sizes"].append(bench_size(args.data, events, repeat, Path(tmp), args.one_line_per_thread))
        for n in hosts:
            results["run_dirs"].append(bench_hosts(args.data, n, host_events, repeat, Path(tmp),
                                                   args.one_line_per_thread))
    layout = "copies appended to each thread's line" if args.one_line_per_thread else "each copy on lines of its own"
    print(f"traceroof {results['commit']} vs XProf hlo_stats; medians of {repeat} run(s); {os.cpu_count()} CPUs; "
          f"profiles replicated with {layout}\n")
    print(size_table(results["sizes"]))
    for s in results["sizes"]:
        for e in s["errors"]:
            print(f"\n{s['events']:,} events: {e}")
    if any(s["xprof_rows"] == 0 for s in results["sizes"]):
        print("\nXProf's hlo_stats table has no rows on these CPU profiles (its op stats come from device planes).")
    if results["run_dirs"]:
        print()
        print(hosts_table(results["run_dirs"]))
    lines = target_lines(results["sizes"], results["run_dirs"])
    if lines:
        print("\nTargets:\n" + "\n".join(f"- {line}" for line in lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
