"""traceroof.parallel.map_hosts (in process, local pool, Dask) and traceroof.progress.

The mapped functions are stdlib callables (``operator.call`` over partials) and real traceroof functions that
raise on bad input, so that worker processes can import them.
"""

from __future__ import annotations

import io
import json
import operator
import os
import pickle
import shutil
import socket
import sys
import threading
import time
import types
from functools import partial
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

import traceroof.parallel as parallel
import traceroof.progress as progress_module
from parsers.errors import InputError, TraceroofError
from parsers.hlo_text import parse_hlo_text
from tests.conftest import HOST_CHIP, ROOT
from traceroof.analysis import analyze as analyze_profile
from traceroof.chips import get_chip
from traceroof.cli import main
from traceroof.discovery import discover
from traceroof.parallel import map_hosts
from traceroof.progress import progress

BAD_CALLS = [partial(parse_hlo_text, "garbage"), partial(get_chip, "no-such-chip"),
             partial(discover, ["/nonexistent/x"])]


def _in_process_error(call: partial) -> TraceroofError:
    with pytest.raises(TraceroofError) as caught:
        call()
    return caught.value


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def test_pool_keeps_the_order_and_runs_in_other_processes() -> None:
    results = map_hosts(operator.call, [partial(operator.neg, i) for i in range(5)] + [os.getpid], jobs=2)
    assert results[:5] == [0, -1, -2, -3, -4] and results[5] != os.getpid()


def test_one_job_or_one_item_runs_in_this_process() -> None:
    assert map_hosts(operator.call, [os.getpid] * 3, jobs=1) == [os.getpid()] * 3
    assert map_hosts(operator.call, [os.getpid]) == [os.getpid()]
    assert map_hosts(operator.neg, []) == []


def test_the_pool_has_no_more_processes_than_items(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = []

    class Recording(parallel.ProcessPoolExecutor):
        def __init__(self, max_workers: int, **kwargs: object) -> None:
            sizes.append(max_workers)
            super().__init__(max_workers, **kwargs)

    monkeypatch.setattr(parallel, "ProcessPoolExecutor", Recording)
    assert map_hosts(operator.neg, [1, 2], jobs=8) == [-1, -2]
    assert sizes == [2]


def test_jobs_below_one_is_an_input_error() -> None:
    with pytest.raises(InputError, match=r"^--jobs 0: must be 1 or more") as caught:
        map_hosts(operator.neg, [1, 2], jobs=0)
    assert "\n" not in str(caught.value)


def test_every_traceroof_error_class_pickles_with_its_message() -> None:
    classes = _subclasses(TraceroofError)
    assert len(classes) >= 5
    for cls in classes:
        copy = pickle.loads(pickle.dumps(cls("f.pb: bad at byte 3: do X")))
        assert type(copy) is cls and str(copy) == "f.pb: bad at byte 3: do X"


@pytest.mark.parametrize("call", BAD_CALLS[:2], ids=["HloParseError", "ChipError"])  # pickling: test above
def test_a_worker_error_keeps_its_class_and_message(call: partial) -> None:
    expected = _in_process_error(call)
    with pytest.raises(TraceroofError) as caught:
        map_hosts(operator.call, [partial(int, "3"), call], jobs=2)
    assert type(caught.value) is type(expected) and str(caught.value) == str(expected)


def test_a_worker_that_dies_is_an_input_error_naming_the_item() -> None:
    dying = partial(os._exit, 1)
    with pytest.raises(InputError, match="fewer --jobs") as caught:
        map_hosts(operator.call, [os.getpid, dying], jobs=2)
    assert str(dying) in str(caught.value) and "\n" not in str(caught.value)


def _arrays(n: int) -> dict[str, object]:
    import numpy as np

    return {"ids": np.arange(n, dtype=np.int64), "names": [f"op{i}" for i in range(3)], "n": n}


def test_pool_results_come_back_through_shared_memory_files_and_leave_none(tmp_path, monkeypatch) -> None:
    import numpy as np

    monkeypatch.setattr(parallel, "_SHARED_MEMORY_DIR", str(tmp_path))
    spilled = []
    unspill = parallel._unspill
    monkeypatch.setattr(parallel, "_unspill", lambda r: (spilled.append(isinstance(r, parallel._Spilled)),
                                                          unspill(r))[1])
    results = map_hosts(_arrays, [10, 200_000, 0], jobs=2)
    assert spilled == [True, True, True] and list(tmp_path.iterdir()) == []  # the folder and its files removed
    for n, r in zip([10, 200_000, 0], results):
        assert r["n"] == n and r["names"] == ["op0", "op1", "op2"]
        assert np.array_equal(r["ids"], np.arange(n)) and r["ids"].flags.writeable
    r["ids"][:] = 1  # the parent may write the arrays it received


def test_without_shared_memory_results_come_through_the_pipe(monkeypatch, tmp_path) -> None:
    import numpy as np

    monkeypatch.setattr(parallel, "_SHARED_MEMORY_DIR", str(tmp_path / "missing"))
    (r,) = map_hosts(_arrays, [5], jobs=2)[:1]
    assert np.array_equal(r["ids"], np.arange(5))
    gone = tmp_path / "gone"  # a folder that fills up or vanishes: the worker returns the result itself
    assert parallel._spill(7, str(gone)) == 7


def test_fork_unless_threads_may_run(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in parallel._FORK_UNSAFE_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    if threading.active_count() == 1:
        assert parallel.start_method() == ("fork" if sys.platform == "linux" else "spawn")
    monkeypatch.setitem(sys.modules, "jax", types.ModuleType("jax"))
    assert parallel.start_method() == "spawn"


def test_spawn_when_a_thread_runs() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert parallel.start_method() == "spawn"
        assert map_hosts(operator.neg, [1, 2], jobs=2) == [-1, -2]
    finally:
        stop.set()
        thread.join()


def test_progress_writes_nothing_when_stderr_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(progress_module, "PROGRESS_DELAY_S", 0.0)
    assert map_hosts(operator.neg, range(3), jobs=2) == [0, -1, -2]
    assert map_hosts(operator.neg, range(3), jobs=1) == [0, -1, -2]
    assert capfd.readouterr() == ("", "")


def _fake_terminal(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    screen = io.StringIO()
    monkeypatch.setattr(progress_module, "_console", lambda: Console(file=screen, force_terminal=True, width=80))
    return screen


def test_progress_draws_on_a_terminal_only_after_the_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = _fake_terminal(monkeypatch)
    with progress(3, "hosts") as bar:
        bar.advance()
    assert screen.getvalue() == ""  # faster than PROGRESS_DELAY_S: nothing drawn
    monkeypatch.setattr(progress_module, "PROGRESS_DELAY_S", 0.0)
    with progress(2, "stages") as outer, progress(3, "hosts") as inner:  # nested blocks share one display
        inner.advance()
        outer.advance()
    drawn = screen.getvalue()
    assert "hosts" in drawn and "1/3" in drawn and "stages" in drawn and "1/2" in drawn


def test_pool_workers_never_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    screen = _fake_terminal(monkeypatch)
    monkeypatch.setattr(progress_module, "PROGRESS_DELAY_S", 0.0)
    monkeypatch.setattr(parallel, "_state", None)
    monkeypatch.setattr(parallel, "_spill_dir", None)
    monkeypatch.setitem(progress_module._shared, "off", False)
    parallel._init_worker(None, None)  # what each pool worker runs first
    with progress(3, "stages") as bar:
        bar.advance()
    assert screen.getvalue() == ""


# --- Dask -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dask_address() -> str:
    distributed = pytest.importorskip("distributed")
    import dask
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):  # a killed worker fails its task at once
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                           dashboard_address=None)
    with cluster:
        yield cluster.scheduler_address


def test_dask_map_equals_the_local_map(dask_address: str) -> None:
    items = list(range(6))
    assert map_hosts(operator.neg, items, dask_address=dask_address) == map_hosts(operator.neg, items, jobs=1)


@pytest.mark.parametrize("call", BAD_CALLS, ids=["HloParseError", "ChipError", "InputError"])
def test_dask_errors_keep_their_class_and_message(dask_address: str, call: partial) -> None:
    expected = _in_process_error(call)
    with pytest.raises(TraceroofError) as caught:
        map_hosts(operator.call, [partial(int, "3"), call], dask_address=dask_address)
    assert type(caught.value) is type(expected) and str(caught.value) == str(expected)


def test_dask_workers_that_cannot_import_the_function(dask_address: str, tmp_path, monkeypatch) -> None:
    (tmp_path / "only_on_this_host.py").write_text("def double(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_on_this_host
    with pytest.raises(InputError, match="the Dask workers cannot import only_on_this_host .*install the same traceroof"):
        map_hosts(only_on_this_host.double, [1, 2], dask_address=dask_address)


def test_an_unreachable_scheduler_is_an_input_error_in_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("distributed")
    monkeypatch.setattr(parallel, "DASK_CONNECT_TIMEOUT_S", 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    start_s = time.monotonic()
    with pytest.raises(InputError, match=f"--dask {address}: cannot connect to a Dask scheduler there .*`dask scheduler`"):
        map_hosts(operator.neg, [1, 2], dask_address=address)
    assert time.monotonic() - start_s < 5


def test_a_malformed_dask_address_is_an_input_error_at_once() -> None:
    pytest.importorskip("distributed")
    start_s = time.monotonic()
    for address in ("no-port", "foo://127.0.0.1:1"):
        with pytest.raises(InputError, match=f"--dask {address}: cannot connect to a Dask scheduler there"):
            map_hosts(operator.neg, [1, 2], dask_address=address)
    assert time.monotonic() - start_s < 1


def test_missing_dask_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "distributed", None)
    with pytest.raises(InputError, match=r"--dask needs the dask extra: pip install 'traceroof\[dask\]'"):
        map_hosts(operator.neg, [1, 2], dask_address="tcp://127.0.0.1:8786")


def test_a_killed_dask_worker_is_an_input_error(dask_address: str) -> None:
    dying = partial(os._exit, 1)
    with pytest.raises(InputError, match="a Dask worker died while analyzing .*_exit.*more memory"):
        map_hosts(operator.call, [dying, os.getpid], dask_address=dask_address)


# --- whole analyses: a run directory of several hosts, read one by one, by a pool and by Dask --------------------

def _pod(tmp_path) -> Path:
    """A run directory of three hosts (copies of the sharded_mlp fixture's host file, 8 devices each)."""
    src = next((ROOT / "fixtures" / "sharded_mlp").rglob("*.xplane.pb"))
    run = tmp_path / "logdir" / "plugins" / "profile" / "2026_01_01_00_00_00"
    run.mkdir(parents=True)
    for host in ("host_a", "host_b", "host_c"):
        shutil.copyfile(src, run / f"{host}.xplane.pb")
    return tmp_path / "logdir"


def _report(logdir: Path, *extra: str) -> str:
    r = CliRunner().invoke(main, ["analyze", str(logdir), "--hlo", str(ROOT / "fixtures" / "sharded_mlp" / "hlo"),
                                  "--chip", str(HOST_CHIP), "--format", "json", *extra])
    assert r.exit_code == 0, r.output
    return r.output


def test_jobs_read_hosts_in_parallel_with_the_same_result(tmp_path) -> None:
    logdir = _pod(tmp_path)
    one = _report(logdir, "--jobs", "1")
    assert _report(logdir, "--jobs", "2") == one and _report(logdir) == one
    doc = json.loads(one)
    assert doc["summary"]["devices"] == 24 and doc["summary"]["join"]["events_joined"] > 0


def test_dask_run_equals_the_local_run(tmp_path, dask_address: str) -> None:
    logdir = _pod(tmp_path)
    assert _report(logdir, "--dask", dask_address) == _report(logdir, "--jobs", "1")


def test_readme_dask_command_as_written(tmp_path, dask_address: str) -> None:
    """The README's --dask command, with a local run directory for its bucket and the local cluster's address."""
    import re
    import shlex

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (cmd,) = re.findall(r"&& (traceroof analyze \S+ --dask \S+)", readme)
    logdir = _pod(tmp_path)
    cmd = cmd.replace("gs://my-bucket/logdir", str(logdir))
    cmd = re.sub(r"tcp://\S+", dask_address, cmd)
    extra = ["--hlo", str(ROOT / "fixtures" / "sharded_mlp" / "hlo"), "--chip", str(HOST_CHIP), "--format", "json"]
    r = CliRunner().invoke(main, [*shlex.split(cmd)[1:], *extra])
    assert r.exit_code == 0, r.output
    assert r.output == _report(logdir, "--jobs", "1")


def test_hosts_notes_are_summed_once_and_their_program_counted_once(tmp_path) -> None:
    """Three copies of one host: the async-thunk note counts 3x the events in one note, the HLO the hosts carry
    is one program, and every per-step figure equals the single host's."""
    import re

    src = next((ROOT / "fixtures" / "transformer").rglob("*.xplane.pb"))
    run = tmp_path / "logdir" / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    for host in ("a", "b", "c"):
        shutil.copyfile(src, run / f"host_{host}.xplane.pb")
    hlo = ROOT / "fixtures" / "transformer" / "hlo"
    one = analyze_profile(src, hlo=hlo, chip=str(HOST_CHIP))
    three = analyze_profile(tmp_path / "logdir", hlo=hlo, chip=str(HOST_CHIP), jobs=2)
    pattern = r"^(\d[\d,]*) op events are launches of asynchronous thunks"
    (n1,) = [int(m.group(1).replace(",", "")) for n in one.summary.notes if (m := re.match(pattern, n))]
    (n3,) = [int(m.group(1).replace(",", "")) for n in three.summary.notes if (m := re.match(pattern, n))]
    assert n3 == 3 * n1
    assert three.summary.hlo_sources == one.summary.hlo_sources
    assert three.summary.flops_per_step == one.summary.flops_per_step and three.summary.devices == 3


def test_a_host_without_op_events_is_left_out_and_steps_are_one_per_step(tmp_path) -> None:
    """Four hosts, one of which ran no XLA program (its file keeps only the python thread's step annotations):
    the other hosts' device step times are kept, the idle host is named in a note, and a step seen by three
    hosts counts once (mean and spread as for one host)."""
    from parsers.xspace import SCHEMA

    src = next((ROOT / "fixtures" / "transformer").rglob("*.xplane.pb"))
    run = tmp_path / "logdir" / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    for host in ("a", "b", "c"):
        shutil.copyfile(src, run / f"host_{host}.xplane.pb")
    space = SCHEMA["XSpace"]()
    space.ParseFromString(src.read_bytes())
    for plane in space.planes:
        if plane.name == "/host:CPU":
            keep = [line for line in plane.lines if line.name == "python"]
            del plane.lines[:]
            plane.lines.extend(keep)
    (run / "host_idle.xplane.pb").write_bytes(space.SerializeToString())
    hlo = ROOT / "fixtures" / "transformer" / "hlo"
    one = analyze_profile(src, hlo=hlo, chip=str(HOST_CHIP))
    pod = analyze_profile(tmp_path / "logdir", hlo=hlo, chip=str(HOST_CHIP), jobs=2)
    assert pod.summary.step_times_s == pytest.approx(one.summary.step_times_s, rel=1e-12)
    assert pod.summary.step_time_std_s == pytest.approx(one.summary.step_time_std_s, rel=1e-12)
    assert any(n.startswith("1 host(s) hold no op events (host_idle)") for n in pod.summary.notes)
    assert pod.summary.flops_per_step == pytest.approx(one.summary.flops_per_step, rel=1e-12)


def test_dask_with_relative_paths(tmp_path, dask_address: str, monkeypatch) -> None:
    """Workers run in their own folder: a relative run directory is made absolute before it is sent."""
    _pod(tmp_path)
    shutil.copytree(ROOT / "fixtures" / "sharded_mlp" / "hlo", tmp_path / "hlo")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["analyze", "logdir", "--hlo", "hlo", "--chip", str(HOST_CHIP), "--format", "json",
                                  "--dask", dask_address])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["summary"]["devices"] == 24


def test_hosts_with_different_hlo_under_one_program_are_refused(tmp_path) -> None:
    """Two hosts whose program has the same id and name but other HLO (different runs put in one folder): one
    error naming the program and both hosts, instead of one host's events costed by another's HLO."""
    import copy
    import dataclasses

    from traceroof.discovery import discover
    from traceroof.host import HostTask, read_host
    from traceroof.profile import merge_hosts

    logdir = _pod(tmp_path)
    inputs = discover([logdir], [ROOT / "fixtures" / "sharded_mlp" / "hlo"])
    hosts = [read_host(HostTask(p, inputs.kind, inputs.hlo_files, inputs.hlo_proto_files)) for p in inputs.profiles]
    assert "hold different HLO" not in " ".join(merge_hosts(inputs, hosts).notes)
    other = []
    for m, how in hosts[2].modules:
        m = copy.deepcopy(m)
        comp = m.entry
        inst = comp.instructions[-1]
        comp.instructions[-1] = dataclasses.replace(inst, name=inst.name + ".other")
        other.append((m, how))
    hosts[2] = dataclasses.replace(hosts[2], modules=other)
    with pytest.raises(InputError) as e:
        merge_hosts(inputs, hosts)
    assert "hosts hold different HLO under the same program id and name" in str(e.value)
    assert "host_a vs host_c" in str(e.value) and "analyze them one at a time" in str(e.value)


def test_a_later_hosts_op_starts_and_launches_move_onto_the_first_hosts_clock(tmp_path) -> None:
    """Two copies of one host whose profile_start_time differ by 1 ms: after the merge the second host's op events
    start 1 ms (10^9 ps) later than the first's, and so do their launch times, which the step breakdown compares
    with op starts (launches were left on the host's own clock before the per-host aggregation). Moved by 1 s,
    past the end of the first host's events, the two are not one capture: refused."""
    from parsers.xspace import parse_full
    from traceroof.discovery import discover
    from traceroof.profile import load_profile

    logdir = _pod(tmp_path)
    run = next(logdir.rglob("host_a.xplane.pb")).parent
    (run / "host_c.xplane.pb").unlink()
    m = parse_full(run / "host_b.xplane.pb")
    env = next(p for p in m.planes if p.name == "Task Environment")
    sid = next(k for k, v in env.stat_metadata.items() if v.name == "profile_start_time")
    stat = next(s for s in env.stats if s.metadata_id == sid)
    ns = getattr(stat, stat.WhichOneof("value"))
    setattr(stat, stat.WhichOneof("value"), ns + 10**6)
    (run / "host_b.xplane.pb").write_bytes(m.SerializeToString())
    inputs = discover([logdir], [ROOT / "fixtures" / "sharded_mlp" / "hlo"])
    events = load_profile(inputs).events()
    a, b = (events[events["host"] == h].reset_index(drop=True) for h in ("host_a", "host_b"))
    assert len(a) == len(b) > 0 and a["launch_ps"].notna().any()
    assert ((b["start_ps"] - a["start_ps"]) == 10**9).all()
    known = a["launch_ps"].notna()
    assert ((b["launch_ps"] - a["launch_ps"])[known] == 10**9).all()
    span_ps = int((a["start_ps"] + a["duration_ps"]).max() - a["start_ps"].min())
    assert span_ps < 10**12  # the fixture's ops span less than 1 s: moved by 1 s, host_b's begin after host_a's end
    setattr(stat, stat.WhichOneof("value"), ns + 10**9)
    (run / "host_b.xplane.pb").write_bytes(m.SerializeToString())
    with pytest.raises(InputError, match=r"captured at different times \(host_a's op events end 0\.\d+ s before "
                                         r"host_b's begin\)"):
        load_profile(inputs)


def test_a_process_returns_each_programs_hlo_once_per_analysis(tmp_path) -> None:
    """The hosts of a pod run one program: within one analysis a process returns its HLO with the first host it
    reads and a ModuleRef with the others, and the merge puts the module back, as read from each host (its
    source), so the profile is the one the full copies give; a new analysis sends it again."""
    import dataclasses

    from traceroof.hlo_source import fingerprint
    from traceroof.host import HostTask, ModuleRef, read_host
    from traceroof.profile import merge_hosts

    inputs = discover([_pod(tmp_path)], [ROOT / "fixtures" / "sharded_mlp" / "hlo"])
    tasks = [HostTask(p, inputs.kind, inputs.hlo_files, inputs.hlo_proto_files, "analysis-1") for p in inputs.profiles]
    hosts = [read_host(t) for t in tasks]
    assert hosts[0].modules and not any(isinstance(m, ModuleRef) for m, _ in hosts[0].modules)
    assert all(isinstance(m, ModuleRef) for h in hosts[1:] for m, _ in h.modules)
    assert len(pickle.dumps(hosts[1].modules)) * 20 < len(pickle.dumps(hosts[0].modules))
    full = [read_host(dataclasses.replace(t, analysis_id="")) for t in tasks]
    assert not any(isinstance(m, ModuleRef) for h in full for m, _ in h.modules)

    def modules(p):
        return [(m.program_id, m.name, m.source, fingerprint(m)) for m in p.modules]
    merged, plain = merge_hosts(inputs, hosts), merge_hosts(inputs, full)
    assert modules(merged) == modules(plain) and merged.notes == plain.notes
    # a reference first (a Dask worker may read the hosts in any order): the module as that host read it
    merged = merge_hosts(inputs, [hosts[1], hosts[0], hosts[2]])
    assert modules(merged) == modules(merge_hosts(inputs, [full[1], full[0], full[2]]))
    again = read_host(dataclasses.replace(tasks[1], analysis_id="analysis-2"))
    assert not any(isinstance(m, ModuleRef) for m, _ in again.modules)


def test_a_step_that_one_host_lacks_is_left_out(tmp_path) -> None:
    """Three hosts of one run; host_c's trace stopped a step sooner (its step 4 is missing): step 4 would give
    per-step, per-device figures over two hosts' work divided by three hosts' devices. It is left out, with a
    note; FLOPs per step stay those of the hosts that ran every used step."""
    import dataclasses

    from traceroof.analysis import DEFAULT_OPTIMIZER_PATTERN, _analyze_profile
    from traceroof.discovery import discover
    from traceroof.host import HostTask, read_host
    from traceroof.profile import merge_hosts

    inputs = discover([_pod(tmp_path)], [ROOT / "fixtures" / "sharded_mlp" / "hlo"])
    hosts = [read_host(HostTask(p, inputs.kind, inputs.hlo_files, inputs.hlo_proto_files)) for p in inputs.profiles]

    def analyzed(hosts):
        return _analyze_profile(merge_hosts(inputs, hosts), str(HOST_CHIP), 2, 1, 10, DEFAULT_OPTIMIZER_PATTERN,
                                None, None, False).summary

    whole = analyzed(hosts)
    assert whole.steps_used == (1, 2, 3, 4) and not any("only some of the" in n for n in whole.notes)
    c = hosts[2]
    rows = c.rows.assign(step=c.rows["step"].where(c.rows["step"] != 4))  # its step-4 ops in no step
    hosts[2] = dataclasses.replace(c, steps=c.steps[c.steps["step"] != 4], rows=rows)
    part = analyzed(hosts)
    assert part.steps_used == (1, 2, 3)
    assert any(n.startswith("1 step(s) are on only some of the 3 hosts (steps 4): left out") for n in part.notes)
    assert part.flops_per_step == pytest.approx(whole.flops_per_step)


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_pod_with_one_truncated_host_gives_a_partial_report(tmp_path: Path, jobs: int) -> None:
    """One host file of a run directory cut short (an interrupted copy) no longer refuses the whole pod: the
    report covers the readable hosts, says PARTIAL in its input line and first note (naming the file and what is
    wrong with it), and its figures are those of the readable host analyzed alone. Every host cut short: exit 2."""
    run = tmp_path / "run"
    shutil.copytree(next((ROOT / "fixtures" / "multihost_dp8" / "logdir" / "plugins" / "profile").iterdir()), run)
    bad = run / "host1.xplane.pb"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    r = CliRunner().invoke(main, ["analyze", str(run), "--chip", HOST_CHIP, "--format", "json", "--jobs", str(jobs)])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)["summary"]
    assert s["input"].endswith("(PARTIAL: 1 of 2 hosts; unreadable: host1.xplane.pb)") and s["hosts"] == 1
    assert s["notes"][0].startswith("PARTIAL: 1 of 2 hosts' profiles cannot be read and are left out "
                                    "(host1.xplane.pb)") and "cut short" in s["notes"][0]
    alone = analyze_profile(run / "host0.xplane.pb", chip=HOST_CHIP).summary
    assert (s["flops_per_step"], s["steps_used"], s["devices"]) == (alone.flops_per_step, list(alone.steps_used),
                                                                    alone.devices)
    assert s["step_time_mean_s"] == pytest.approx(alone.step_time_mean_s, rel=1e-12)
    good = run / "host0.xplane.pb"
    good.write_bytes(good.read_bytes()[:1000])
    r = CliRunner().invoke(main, ["analyze", str(run), "--chip", HOST_CHIP, "--jobs", str(jobs)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "truncated" in r.output
