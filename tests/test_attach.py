"""attach / capture / watch against real JAX training loops on CPU, in subprocesses on loopback (127.0.0.1).
Every test bounds its time and stops the job."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import HOST_CHIP, ROOT

pytest.importorskip("jax", reason="JAX (dev extra) runs the training loops")

ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
LOOP = """
import sys, time, jax, jax.numpy as jnp
f = jax.jit(lambda a: jnp.tanh(a @ a) * 0.5)
a = jnp.ones((128, 128))
"""


HEAVY = """
import json, sys, time, jax, jax.numpy as jnp
@jax.jit
def g(a):  # milliseconds of device work per step, dispatched in a fraction of one: the host runs ahead
    for _ in range(6):
        a = jnp.tanh(a @ a) * 0.5
    return a
a = g(jnp.ones((384, 384)) / 384).block_until_ready()  # compiled outside any profile
cost = g.lower(a).compile().cost_analysis()
print(json.dumps({"flops": (cost[0] if isinstance(cost, list) else cost)["flops"]}), flush=True)
"""


def _executions(profile_dir, module: str) -> dict[int, int]:
    """Op events per execution (run id) of ``module`` in the one profile file under ``profile_dir``, counted
    from the raw events here rather than by traceroof's step logic."""
    from parsers.xspace import read_xspace

    (path,) = profile_dir.rglob("*.xplane.pb")
    ev = read_xspace(path).plane("/host:CPU").events(stats=("run_id", "hlo_module", "hlo_op"))
    ev = ev[(ev["hlo_module"].astype(str) == module) & ev["hlo_op"].notna() & ev["run_id"].notna()]
    return {int(r): int(n) for r, n in ev.groupby("run_id").size().items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "traceroof.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=ENV, timeout=timeout)


def test_attach_profiles_a_window_and_writes_reports(tmp_path):
    script = LOOP + f"""
import logging, traceroof, traceroof.analysis
logging.basicConfig(level=logging.INFO)
def in_the_job(*args, **kwargs):
    raise RuntimeError("the analysis ran inside the training process")
traceroof.analysis.analyze = in_the_job  # the analysis must run in its own process, which imports the real one
seen = []
with traceroof.attach(out_dir={str(tmp_path / 'out')!r}, wait_steps=2, warmup_steps=1, active_steps=3, repeat=2,
                      chip={HOST_CHIP!r}, on_report=seen.append) as hook:
    for i in range(10):
        with hook.step():
            a = f(a).block_until_ready()
print("done", i + 1, hook.errors)
print("seen", sorted((w.window, w.summary["steps_used"], len(w.reports)) for w in seen))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done 10 []" in r.stdout
    assert "seen [(0, [3, 4, 5], 3), (1, [7, 8, 9], 3)]" in r.stdout
    out = tmp_path / "out" / "window_0"
    assert {p.name for p in out.iterdir()} == {"traceroof_report.txt", "traceroof_report.md", "traceroof_report.json"}
    doc = json.loads((out / "traceroof_report.json").read_text())
    assert doc["summary"]["steps_used"] == [3, 4, 5]  # steps 2..5 traced, step 2 is the warm-up
    second = json.loads((tmp_path / "out" / "window_1" / "traceroof_report.json").read_text())
    assert second["summary"]["steps_used"] == [7, 8, 9]
    assert "traceroof: step" in r.stderr


def test_attach_never_breaks_the_job(tmp_path):
    script = LOOP + f"""
import traceroof
hook = traceroof.attach(out_dir={str(tmp_path / 'out')!r}, wait_steps=0, warmup_steps=0, active_steps=2, chip="no-such-chip")
for i in range(5):
    with hook.step():
        a = f(a).block_until_ready()
hook.close()
print("done", i + 1, len(hook.errors))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=180)
    assert r.returncode == 0 and "done 5 1" in r.stdout, r.stderr[-2000:]
    assert "analysis of window 0 failed" in r.stderr and "the job goes on" in r.stderr


def test_interrupted_window_reports_complete_steps_without_calibrating(tmp_path):
    """Ctrl-C inside traced step 3: the job exits at once; the report (written by the analysis process on its
    own) holds steps 1-2 only, says why, and, with no chip and no cached host calibration, has no roofline
    rather than a calibration run inside the job."""
    cache = tmp_path / "cache"
    script = LOOP + f"""
import traceroof
try:
    with traceroof.attach(out_dir={str(tmp_path / 'out')!r}, wait_steps=0, warmup_steps=1, active_steps=6) as hook:
        for i in range(10):
            with hook.step():
                a = f(a)
                if i == 3:
                    raise KeyboardInterrupt  # what Ctrl-C raises
                a.block_until_ready()
except KeyboardInterrupt:
    print("interrupted", i, hook.errors)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                       env=dict(ENV, XDG_CACHE_HOME=str(cache)))
    assert r.returncode == 0 and "interrupted 3 []" in r.stdout, r.stderr[-2000:]
    report = tmp_path / "out" / "window_0" / "traceroof_report.json"
    deadline = time.monotonic() + 120
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    s = json.loads(report.read_text())["summary"]
    assert s["steps_used"] == [1, 2] and s["steps_total"] == 3  # step 0 warm-up; step 3 interrupted
    assert any("interrupted in step 3 (KeyboardInterrupt): that step is left out" in n for n in s["notes"])
    assert s["chip_id"] == "uncalibrated-host" and s["peak_flops_per_s"] == {}
    assert s["mfu"] is None and s["roofline_efficiency"] is None  # no figures: unknown, not 0 %
    assert any("attach never calibrates inside a job" in n for n in s["notes"])
    assert not (cache / "traceroof" / "host.toml").exists()  # nothing calibrated


def test_the_analysis_process_takes_the_cached_calibration_as_it_is(monkeypatch, tmp_path):
    """A cached calibration taken on a loaded machine is measured again by ``analyze`` on an idle machine; inside
    a job's analysis process it is used as it is (with its note), and a corrupt one gives no roofline: the job
    never calibrates."""
    import traceroof.chips as chips
    from traceroof.attach import _analysis_chip
    from traceroof.chips import Calibration, calibration_toml

    cache = tmp_path / "host.toml"
    cache.write_text(calibration_toml(Calibration({"f32": 1e11}, 2e10, 1e10, "Test CPU", 2, "2026-01-02T03:04:05Z",
                                                  "numpy", {}, 0.5, 0.5, chips.load_note(0.5, 0.5))))
    monkeypatch.setattr(chips, "host_cache_path", lambda: cache)
    monkeypatch.setattr(chips, "cpu_busy_share", lambda window_s=0.0: 0.0)  # idle: analyze would measure again
    monkeypatch.setattr(chips, "calibrate", lambda: pytest.fail("calibrated inside the job's analysis"))
    chip, note = _analysis_chip(None, "cpu")
    assert chip.load_note and chip.calibrated_at == "2026-01-02T03:04:05Z" and note == ""
    cache.write_text("corrupt = [")
    chip, note = _analysis_chip(None, "cpu")
    assert chip.id == "uncalibrated-host" and "attach never calibrates inside a job" in note
    assert _analysis_chip("h100", "cpu") == ("h100", "")


def test_attach_to_a_loop_that_never_blocks_puts_each_execution_in_its_own_step(tmp_path):
    """The README's loop without ``block_until_ready`` and a device slower than the host: when the window opens,
    steps launched before it are still queued and run inside the trace. They belong to no step; each step holds
    the one execution it launched (a user's attach report had them shifted by two steps: fractional FLOPs per
    step, 489-507 op events for 486, and an MFU off by 5 %)."""
    from traceroof.discovery import discover
    from traceroof.profile import load_profile

    out = tmp_path / "out"
    script = HEAVY + f"""
import traceroof
seen = []
with traceroof.attach(out_dir={str(out)!r}, wait_steps=4, warmup_steps=1, active_steps=4, chip={HOST_CHIP!r},
                      on_report=seen.append) as hook:
    for i in range(10):
        with hook.step():
            a = g(a)
a.block_until_ready()
print(json.dumps({{"steps_used": [w.summary["steps_used"] for w in seen], "errors": hook.errors}}))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    facts, done = map(json.loads, r.stdout.strip().splitlines()[-2:])
    assert done == {"steps_used": [[5, 6, 7, 8]], "errors": []}
    window = out / "profiles" / "window_0"
    runs = sorted(_executions(window, "jit_g"))
    # attach waits for the window's steps before it stops the trace and nothing is launched in between: the
    # window's five steps (4-8) are the last five executions; the ones before ran steps 0-3, launched earlier
    assert len(runs) > 5, f"the device kept up with the host ({len(runs)} executions): nothing was queued"
    assert runs == list(range(runs[0], runs[0] + len(runs)))
    truth = dict(zip(range(4, 9), runs[-5:]))
    ev = load_profile(discover([window], [])).events()
    ev = ev[(ev["module"].astype(str) == "jit_g") & ev["step"].notna()]
    held = {int(s): sorted(int(x) for x in set(g["run_id"])) for s, g in ev.groupby("step")}
    assert held == {s: [run] for s, run in truth.items()}
    s = json.loads((out / "window_0" / "traceroof_report.json").read_text())["summary"]
    assert s["flops_per_step"] == pytest.approx(facts["flops"], rel=1e-9)  # XLA's count, exactly
    assert any(n.startswith(f"{len(runs) - 5} execution(s)") and "began before the trace started" in n
               for n in s["notes"]), s["notes"]
    assert not any("could not be tied to its launch" in n for n in s["notes"]), s["notes"]


@pytest.fixture()
def job(tmp_path):
    """A training loop with a profiler server on a free loopback port; stopped after the test."""
    port = _free_port()
    script = LOOP + f"""
jax.profiler.start_server({port})
print("ready", flush=True)
t0, i = time.time(), 0
while time.time() - t0 < 90:
    with jax.profiler.StepTraceAnnotation("train", step_num=i):
        a = f(a).block_until_ready()
    i += 1
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=ENV)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        yield port
    finally:
        p.kill()
        p.wait(timeout=30)


def test_capture_analyzes_a_running_job(job, tmp_path):
    r = _cli("capture", f"127.0.0.1:{job}", "--duration", "1s", "--logdir", str(tmp_path / "ld"), "--chip", HOST_CHIP)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("traceroof: per-layer roofline report") and "op events to HLO" in r.stdout
    assert len(list((tmp_path / "ld" / "plugins" / "profile").glob("*/*.xplane.pb"))) == 1
    # with the Python tracer on, as jax.profiler.trace has it (its events are the Python calls, named "$file:line
    # function"): a slow loader is seen as host work, not as an idle device
    from parsers.xspace import read_xspace

    (pb,) = (tmp_path / "ld" / "plugins" / "profile").glob("*/*.xplane.pb")
    names = read_xspace(pb).plane("/host:CPU").events()["name"].astype(str)
    assert names.str.startswith("$").sum() > 10
    # two captures of the same job; the gate is set out of reach: timing on a shared machine is not under test
    r = _cli("capture", f"127.0.0.1:{job}", "--duration", "500ms", "--every", "500ms", "--count", "2",
             "--logdir", str(tmp_path / "ld2"), "--chip", HOST_CHIP, "--fail-above", "1000")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and "(baseline)" in lines[0] and "vs baseline: step time" in lines[1]
    runs = sorted((tmp_path / "ld2" / "plugins" / "profile").glob("*"))  # each capture's reports beside it
    assert len(runs) == 2 and all(f"capture {i + 1}: {run}: " in lines[i] for i, run in enumerate(runs))
    for run in runs:
        assert json.loads((run / "traceroof_report.json").read_text())["summary"]["steps_used"]
        assert (run / "traceroof_report.md").read_text().startswith("# traceroof")
    r = _cli("capture", f"127.0.0.1:{job}", "--every", "1s", "--format", "markdown")
    assert r.returncode == 2 and "--format with --every" in r.stderr and len(r.stderr.splitlines()) == 1


def test_capture_leaves_out_the_steps_its_start_and_stop_cut(tmp_path):
    """A remote capture starts and stops whenever it does: with a device busy most of the time, the execution
    running at the stop (and the one at the start) is partly in the profile. That step is left out, with a note,
    and the steps are XLA's count exactly (a user's capture counted 186 of a step's 486 op events as a step)."""
    from traceroof.discovery import discover
    from traceroof.profile import load_profile

    port = _free_port()
    script = HEAVY + f"""
jax.profiler.start_server({port})
t0, i = time.time(), 0
while time.time() - t0 < 90:
    with jax.profiler.StepTraceAnnotation("train", step_num=i):
        a = g(a)
    a.block_until_ready()
    i += 1
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=ENV)
    try:
        facts = json.loads(p.stdout.readline())
        time.sleep(1.0)
        r = _cli("capture", f"127.0.0.1:{port}", "--duration", "1s", "--logdir", str(tmp_path), "--chip", HOST_CHIP,
                 "--format", "json")
    finally:
        p.kill()
        p.wait(timeout=30)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["summary"]
    assert s["flops_per_step"] == pytest.approx(facts["flops"], rel=1e-9)
    counts = _executions(tmp_path, "jit_g")
    runs = sorted(counts)
    whole = max(counts.values())
    cut = [run for run in (runs[0], runs[-1]) if counts[run] < whole]
    # one run at either end cut short, the note says so; between them every execution is whole
    assert all(counts[run] == whole for run in runs[1:-1])
    assert any(n.startswith("1 execution(s)") and "still running when the trace stopped" in n
               for n in s["notes"]) == (runs[-1] in cut), s["notes"]
    ev = load_profile(discover([tmp_path], [])).events()
    ev = ev[(ev["module"].astype(str) == "jit_g") & ev["step"].isin(s["steps_used"])]
    held = {int(step): set(g["run_id"]) for step, g in ev.groupby("step")}
    assert sorted(held) == s["steps_used"] and all(len(r) == 1 and counts[r.pop()] == whole for r in held.values())


def test_capture_errors_are_one_line(tmp_path):
    r = _cli("capture", f"127.0.0.1:{_free_port()}", "--duration", "200ms", "--logdir", str(tmp_path),
             "--retry-for", "1200ms")
    assert r.returncode == 2 and r.stdout == ""
    *retries, error = r.stderr.strip().splitlines()  # it tried while --retry-for lasted, then ended in one line
    assert retries and all("yet (the job may still be starting): trying again" in line for line in retries)
    assert error.startswith("traceroof: error: nothing listens at") and "--retry-for" in error
    with socket.socket() as server:  # something listens, but it is no profiler server
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        r = _cli("capture", f"127.0.0.1:{server.getsockname()[1]}", "--duration", "200ms", "--logdir", str(tmp_path),
                 "--retry-for", "0s", timeout=90)
    assert r.returncode == 2 and "answered but sent no profile" in r.stderr, r.stderr
    assert "no jax.profiler.start_server port" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert _cli("capture", "nonsense", "--logdir", str(tmp_path)).returncode == 2


def test_capture_waits_for_a_job_that_is_still_starting(tmp_path):
    """capture is started first, as users do right after launching a job: it tries again until the job's profiler
    server listens, then captures it."""
    port = _free_port()
    capture = subprocess.Popen([sys.executable, "-m", "traceroof.cli", "capture", f"127.0.0.1:{port}", "--duration",
                                "1s", "--logdir", str(tmp_path), "--chip", HOST_CHIP, "--retry-for", "90s"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    script = LOOP + f"""
time.sleep(1.5)  # imports and setup before the server starts
jax.profiler.start_server({port})
t0, i = time.time(), 0
while time.time() - t0 < 90:
    with jax.profiler.StepTraceAnnotation("train", step_num=i):
        a = f(a).block_until_ready()
    i += 1
"""
    job = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=ENV)
    try:
        out, err = capture.communicate(timeout=120)
    finally:
        capture.kill()
        job.kill()
        job.wait(timeout=30)
    assert capture.returncode == 0, err
    assert "yet (the job may still be starting): trying again" in err.splitlines()[0]
    assert out.startswith("traceroof: per-layer roofline report") and "op events to HLO" in out


def test_idle_job_gives_a_clear_error(tmp_path):
    port = _free_port()
    script = f"""
import time, jax
jax.profiler.start_server({port})
print("ready", flush=True)
time.sleep(60)
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=ENV)
    try:
        assert p.stdout.readline().strip() == "ready"
        r = _cli("capture", f"127.0.0.1:{port}", "--duration", "300ms", "--logdir", str(tmp_path), "--chip", HOST_CHIP,
                 "--retry-for", "1s")
    finally:
        p.kill()
        p.wait(timeout=30)
    # it tried again while the bound lasted (one line per retry), then ended with one line
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == "", r.stderr
    retries, error = lines[:-1], lines[-1]
    assert retries and all("held no op events" in line and "capturing again" in line for line in retries), r.stderr
    assert error.startswith("traceroof: error: no op events in ") and "still compiling" in error
    assert f"no op events in {len(retries) + 1} capture(s)" in error
    assert not list((tmp_path / "plugins" / "profile").glob("*"))  # the empty captures were removed


def test_watch_reports_new_runs(tmp_path):
    logdir = tmp_path / "tb"  # started before the job creates its logdir
    watcher = subprocess.Popen([sys.executable, "-m", "traceroof.cli", "watch", str(logdir), "--interval", "300ms",
                                "--timeout", "150s", "--max-reports", "1", "--chip", HOST_CHIP],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    try:
        # the job starts once the watcher has listed what is there: a run written before that counts as old
        started = watcher.stderr.readline()
        assert started == (f"traceroof: watching {logdir / 'plugins' / 'profile'} for new runs (the logdir does not "
                           "exist yet: the job creates it)\n"), started
        script = LOOP + f"""
with jax.profiler.trace({str(logdir)!r}):
    for i in range(4):
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
            a = f(a).block_until_ready()
"""
        subprocess.run([sys.executable, "-c", script], check=True, env=ENV, timeout=120, capture_output=True)
        out, err = watcher.communicate(timeout=150)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, err
    (run,) = list((logdir / "plugins" / "profile").iterdir())
    assert (run / "traceroof_report.md").exists() and (run / "traceroof_report.json").exists(), err
    assert str(run) in out and "step " in out


def test_watch_analyzes_again_a_run_whose_file_was_incomplete(tmp_path):
    """A profile caught half-written (its size stable over one poll) fails to analyze; once the writer finishes,
    the watcher analyzes the run again instead of skipping it for good."""
    from traceroof.attach import watch

    whole = (ROOT / "fixtures" / "fuzz" / "tiny.xplane.pb").read_bytes()
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    (run / "host.xplane.pb").write_bytes(whole[: len(whole) // 3])
    seen: list[str] = []

    def on_report(path, analysis, error, hosts, hosts_before):
        assert (hosts, hosts_before) == (1, 0)
        seen.append(error)
        if error:  # the writer finishes
            (path / "host.xplane.pb").write_bytes(whole)

    done = watch(tmp_path, interval_s=0.05, timeout_s=60, max_reports=1, chip=HOST_CHIP, on_report=on_report,
                 existing=True)
    assert done == [run]
    assert len(seen) == 2 and seen[0] and seen[1] == ""
    assert (run / "traceroof_report.json").exists()


def test_watch_analyzes_a_run_again_when_another_host_file_lands(tmp_path):
    """The hosts of a multi-host job write their files into one run directory, seconds apart: the run is reported
    from the first host's file, then analyzed again once the second host's file is there, its reports replaced
    and the user's files in the run directory left alone."""
    host_file = ROOT / "fixtures" / "fuzz" / "tiny_sharded.xplane.pb"  # 2 devices: host0/cpu:0 and cpu:1
    run = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
    watcher = subprocess.Popen([sys.executable, "-m", "traceroof.cli", "watch", str(tmp_path), "--interval", "50ms",
                                "--timeout", "60s", "--chip", HOST_CHIP],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    try:
        assert watcher.stderr.readline().startswith("traceroof: watching ")
        run.mkdir(parents=True)
        (run / "notes.txt").write_text("the user's own file")
        shutil.copy(host_file, run / "host0.xplane.pb")
        first = watcher.stdout.readline()
        assert first.startswith(f"{run}: step "), first
        assert json.loads((run / "traceroof_report.json").read_text())["summary"]["devices"] == 2
        first_reports = {ext: (run / f"traceroof_report.{ext}").read_text() for ext in ("txt", "md")}
        shutil.copy(host_file, run / "host1.xplane.pb")  # the second host finishes later
        again = watcher.stdout.readline()
        watcher.send_signal(signal.SIGINT)
        out, err = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    assert again.startswith(f"{run}: analyzed again with 2 host(s) now (1 before), reports replaced: step "), again
    assert watcher.returncode == 0 and out == "" and "not analyzed" not in err, err
    report = json.loads((run / "traceroof_report.json").read_text())
    assert report["summary"]["devices"] == 4
    assert {row["device"].split("/")[0] for row in report["step_breakdown"]} == {"host0", "host1"}
    assert all((run / f"traceroof_report.{ext}").read_text() != text for ext, text in first_reports.items())
    assert sorted(p.name for p in run.iterdir()) == ["host0.xplane.pb", "host1.xplane.pb", "notes.txt",
                                                     "traceroof_report.json", "traceroof_report.md",
                                                     "traceroof_report.txt"]
    assert (run / "notes.txt").read_text() == "the user's own file"


def test_watch_skips_the_runs_already_there_unless_existing(tmp_path):
    run = tmp_path / "plugins" / "profile" / "old"
    run.mkdir(parents=True)
    shutil.copy(ROOT / "fixtures" / "fuzz" / "tiny.xplane.pb", run / "host.xplane.pb")
    r = _cli("watch", str(tmp_path), "--interval", "50ms", "--timeout", "500ms", "--chip", HOST_CHIP)
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert r.stderr == (f"traceroof: watching {run.parent} for new runs (1 run(s) already there are skipped; "
                        "--existing analyzes them)\n")
    assert not (run / "traceroof_report.json").exists()
    r = _cli("watch", str(tmp_path), "--interval", "50ms", "--timeout", "60s", "--max-reports", "1", "--existing",
             "--chip", HOST_CHIP)
    assert r.returncode == 0 and r.stderr == f"traceroof: watching {run.parent} for new runs\n", r.stderr
    assert r.stdout.startswith(f"{run}: ") and (run / "traceroof_report.json").exists()
    r = _cli("watch", str(run / "host.xplane.pb"), "--timeout", "1s")  # a file: no logdir
    assert r.returncode == 2 and r.stderr.startswith("traceroof: error: ") and "is not a directory" in r.stderr
    assert len(r.stderr.splitlines()) == 1
