"""Step breakdown (traceroof.breakdown): the components add up on every fixture, each rule on a hand-made
timeline, the NNX fixture's host overhead as host-bound time, and the report sections."""

from __future__ import annotations

import json
import re
from functools import lru_cache

import numpy as np
import pandas as pd
import pytest

from tests.conftest import FIXTURES, HOST_CHIP
from traceroof.breakdown import COMPONENTS, breakdown_delta, slowest_vs_median, step_breakdown, step_windows
from traceroof.aggregate import Timeline
from traceroof.hostactivity import (covered_both_ps, covered_ps, intersect_intervals, merge_intervals,
                                   subtract_intervals)

PROFILES = ["transformer", "scan_mlp", "sharded_mlp", "diff_base", "diff_rerun", "diff_wide"] + [
    f"{fw}/{v}" for fw in ("fw_flax_cnn", "fw_nnx_transformer", "fw_equinox_transformer", "fw_gpt2", "fw_keras_cnn",
                           "fw_scan_remat") for v in ("readme", "blocking")] + ["fw_flax_cnn/midstep"]


@lru_cache(maxsize=None)
def analyzed(name: str):
    from traceroof import analyze

    if name.startswith("fw_"):
        fw = name.split("/")[0]
        return analyze(str(FIXTURES / name / "logdir"), hlo=[str(FIXTURES / fw / "hlo")], chip=HOST_CHIP)
    return analyze(str(FIXTURES / name), chip=HOST_CHIP)


@pytest.mark.parametrize("name", PROFILES)
def test_components_add_up_on_every_fixture(name: str) -> None:
    a = analyzed(name)
    b = a.step_breakdown
    assert len(b), name
    assert set(b["step"]) <= set(a.summary.steps_used)
    assert (b[list(COMPONENTS)] >= 0).all().all()
    total = b[list(COMPONENTS)].sum(axis=1)
    assert np.allclose(total, b["step_time_s"], rtol=0.01, atol=0), name
    assert (b["step_time_s"] > 0).all()
    assert (b["compute_s"] > 0).all()  # every used step ran ops on every device


def test_sharded_fixture_shows_exposed_communication() -> None:
    b = analyzed("sharded_mlp").step_breakdown
    assert b["device"].nunique() == 8
    assert (b["exposed_comm_s"] > 0).all()


def test_nnx_host_overhead_is_host_bound() -> None:
    """The blocking NNX loop: between executions the device waits while the Python thread runs NNX's per-call
    graph work (annotations 8.9 ms per step against 3.9 ms on the device)."""
    a = analyzed("fw_nnx_transformer/blocking")
    b = a.step_breakdown
    share = (b["host_bound_s"] / b["step_time_s"]).mean()
    assert share > 0.4
    assert (b["host_bound_python_share"] > 0.9).all()
    assert b["step_time_s"].mean() == pytest.approx(a.summary.host_step_time_mean_s, rel=0.05)
    (hb,) = [f for f in a.findings if f.code == "host-bound"]
    assert "waits on the host" in hb.title and "python" in hb.title and hb.lost_per_step_s > 0
    # the equinox loop blocks too, but its launch waits on the Python thread: far less host-bound time
    eqx = analyzed("fw_equinox_transformer/blocking").step_breakdown
    assert (eqx["host_bound_s"] / eqx["step_time_s"]).mean() < share


def test_async_readme_loop_device_steps_match_summary() -> None:
    """With the README's asynchronous loop the device runs its steps back to back: the breakdown's steps are the
    device steps of the summary, and none of their time is host-bound (the host had launched them already)."""
    a = analyzed("fw_nnx_transformer/readme")
    b = a.step_breakdown
    assert b["step_time_s"].mean() == pytest.approx(a.summary.step_time_mean_s, rel=0.01)
    assert b["host_bound_s"].sum() == 0


def _ops(rows: list[tuple]) -> pd.DataFrame:
    """An op table: (device, hlo_op, category, step, program_id) per row."""
    d = pd.DataFrame(rows, columns=["device", "hlo_op", "category", "step", "program_id"])
    return d.assign(host="h", counted=True, step=pd.array(d["step"], "Int64"),
                    program_id=pd.array(d["program_id"], "Int64"))


def test_rules_on_a_hand_made_timeline() -> None:
    """One device, step window [0, 100): execution A (run 1) ops at [10, 20) and [25, 40) (a 5-ps launch gap),
    a collective [40, 50) partly under a compute op [45, 48); execution B (run 2, launched at 70) ops at [80, 90).
    Host busy [0, 60) and [65, 75). Idle [0, 10): before A's launch (unknown -> all of it) and host busy:
    host-bound 10. [50, 80): host-bound until B's launch at 70 where the host is busy ([50, 60) and [65, 70)) =
    15, the rest 15 outside any program; [90, 100) after the last execution, host idle: outside."""
    ops = _ops([("d0", "a", "fusion", 0, 1), ("d0", "ar", "collective", 0, 1), ("d0", "b", "fusion", 0, 1)])
    tl = Timeline(row=np.array([0, 0, 1, 0, 2]), start_ps=np.array([10, 25, 40, 45, 80]),
                  duration_ps=np.array([10, 15, 10, 3, 10]))
    run = np.array([1, 1, 1, 1, 2], float)
    launch = np.array([np.nan] * 4 + [70.0])
    act = pd.DataFrame({"host": "h", "kind": ["python", "python"], "start_ps": [0, 65], "end_ps": [60, 75]})
    win = pd.DataFrame({"step": [0], "device": ["d0"], "start_ps": [0], "end_ps": [100]})
    r = step_breakdown(ops, tl, win, run, launch, act).iloc[0]
    ps = {c: round(r[c] * 1e12) for c in ("step_time_s", *COMPONENTS)}
    assert ps == {"step_time_s": 100, "compute_s": 10 + 15 + 10 + 3, "exposed_comm_s": 7, "launch_gap_s": 5,
                  "host_bound_s": 10 + 15, "outside_program_s": 15 + 10}
    assert r["host_bound_python_share"] == 1.0


def test_another_program_between_steps_is_left_out_of_both_devices_steps() -> None:
    """Two devices, step 1's window [100, 300) on each. The step's own execution (run 2) runs [250, 290) on both.
    Between steps the host ran another program (an eval; run 9, outside every step): on d0 [120, 150), on d1
    [120, 200): d0 finished its part first and waited for d1's, with the host busy (its Python thread blocked in
    the call) [100, 240). The other program's time is its span on the host, [120, 200) on both devices, not
    host-bound on d0 (s41 trial: 27-32 ms per sampling call on 4 virtual devices). An event of another program
    with no run id, [205, 210) on d0, is its own span, on the host as well."""
    ops = _ops([("d0", "t", "fusion", 1, 1), ("d1", "t", "fusion", 1, 1), ("d0", "e", "fusion", None, 2),
                ("d1", "e", "fusion", None, 2), ("d0", "x", "fusion", None, 3)]).assign(
        module=["jit_train", "jit_train", "jit_eval", "jit_eval", "jit_other"])
    tl = Timeline(row=np.array([0, 1, 2, 3, 4]), start_ps=np.array([250, 250, 120, 120, 205]),
                  duration_ps=np.array([40, 40, 30, 80, 5]))
    run = np.array([2, 2, 9, 9, np.nan])
    launch = np.array([240.0, 240.0, np.nan, np.nan, np.nan])
    act = pd.DataFrame({"host": "h", "kind": ["python"], "start_ps": [100], "end_ps": [240]})
    win = pd.DataFrame({"step": [1, 1], "device": ["d0", "d1"], "start_ps": [100, 100], "end_ps": [300, 300]})
    rows = step_breakdown(ops, tl, win, run, launch, act).set_index("device")
    for d in ("d0", "d1"):
        r = rows.loc[d]
        other = 80 + 5
        assert round(r["other_programs_s"] * 1e12) == other, d
        assert r["other_programs"] == "jit_eval, jit_other"
        ps = {c: round(r[c] * 1e12) for c in ("step_time_s", *COMPONENTS)}
        # the rest of [100, 240) waits for the launch with the host busy; [240, 250) launched, not started, and
        # [290, 300) after the execution: outside any program
        assert ps == {"step_time_s": 200 - other, "compute_s": 40, "exposed_comm_s": 0, "launch_gap_s": 0,
                      "host_bound_s": 140 - other, "outside_program_s": 20}, (d, ps)


def test_async_pair_window_is_communication() -> None:
    """An async collective: its window runs from the -start event to the -done event; idle inside it is exposed
    communication, not a launch gap."""
    ops = _ops([("d0", "ag-start", "collective", 0, 1), ("d0", "ag-done", "collective", 0, 1),
                ("d0", "f", "fusion", 0, 1)])
    tl = Timeline(row=np.array([0, 2, 1]), start_ps=np.array([0, 5, 30]), duration_ps=np.array([2, 10, 5]))
    win = pd.DataFrame({"step": [0], "device": ["d0"], "start_ps": [0], "end_ps": [35]})
    r = step_breakdown(ops, tl, win, np.ones(3), None, None, {(1, "ag-done"): "ag-start"}).iloc[0]
    assert round(r["exposed_comm_s"] * 1e12) == 35 - 10
    assert round(r["launch_gap_s"] * 1e12) == 0


def test_async_pair_across_executions_is_not_host_bound() -> None:
    """An async collective started in execution A (run 1, [10, 22)) and done in execution B (run 2, launched at
    50, [60, 80)): its window [20, 65) covers the wait between them, so the busy host there is not host-bound
    time (the device was communicating); host-bound only before A and after B."""
    ops = _ops([("d0", "f", "fusion", 0, 1), ("d0", "ag-start", "collective", 0, 1),
                ("d0", "ag-done", "collective", 0, 1), ("d0", "g", "fusion", 0, 1)])
    tl = Timeline(row=np.array([0, 1, 2, 3]), start_ps=np.array([10, 20, 60, 65]),
                  duration_ps=np.array([10, 2, 5, 15]))
    run = np.array([1, 1, 2, 2], float)
    launch = np.array([np.nan, np.nan, 50.0, 50.0])
    act = pd.DataFrame({"host": "h", "kind": ["python"], "start_ps": [0], "end_ps": [100]})
    win = pd.DataFrame({"step": [0], "device": ["d0"], "start_ps": [0], "end_ps": [100]})
    r = step_breakdown(ops, tl, win, run, launch, act, {(1, "ag-done"): "ag-start"}).iloc[0]
    ps = {c: round(r[c] * 1e12) for c in ("step_time_s", *COMPONENTS)}
    assert ps == {"step_time_s": 100, "compute_s": 10 + 15, "exposed_comm_s": 70 - 25, "launch_gap_s": 0,
                  "host_bound_s": 10 + 20, "outside_program_s": 0}
    assert r["host_bound_python_share"] == 1.0


def test_positions_of_codes_in_runs_or_not() -> None:
    """breakdown._positions (from runs of equal codes, or one sort) gives np.flatnonzero(key == k) for every code
    and none outside 0..n-1."""
    from traceroof.breakdown import _positions

    rng = np.random.default_rng(5)
    for case in range(300):
        n = int(rng.integers(1, 6))
        runs = rng.integers(0, n, int(rng.integers(0, 20)))
        key = np.repeat(runs, rng.integers(1, 200 if case % 2 else 3, len(runs))).astype(np.uint8)
        at = _positions(key, n)
        for k in range(-1, n + 1):
            want = np.flatnonzero(key == k) if 0 <= k < n else np.zeros(0, np.int64)
            assert at(k).tolist() == want.tolist()


def test_windows_tile_each_device() -> None:
    """Steps end at the later of their marker and last op; the next starts there (no time counted twice)."""
    steps = pd.DataFrame({"host": "h", "step": pd.array([0, 1, 2], "Int64"), "start_ps": [0, 100, 200],
                          "end_ps": [100, 200, 300], "device_start_ps": pd.array([50, 160, pd.NA], "Int64"),
                          "device_end_ps": pd.array([150, 190, pd.NA], "Int64")})
    w = step_windows(steps, {"h/cpu:0": "h", "h/cpu:1": "h"})
    w0 = w[w["device"] == "h/cpu:0"]
    assert w0[["start_ps", "end_ps"]].values.tolist() == [[0, 150], [150, 200], [200, 300]]
    assert len(w) == 6


def test_slowest_vs_median_and_delta() -> None:
    rows = pd.DataFrame({"step": [1, 2, 3], "device": "d", "step_time_s": [1.0, 1.2, 2.0],
                         "compute_s": [0.8, 0.9, 0.8], "exposed_comm_s": 0.0, "launch_gap_s": [0.2, 0.3, 0.2],
                         "host_bound_s": [0.0, 0.0, 1.0], "outside_program_s": 0.0})
    line = slowest_vs_median(rows)
    assert line.startswith("slowest step 3 took 2000.000 ms, 800.000 ms more than the median step 2")
    assert "host-bound +1000.000 ms" in line
    d = breakdown_delta(rows, rows.assign(host_bound_s=0.0, step_time_s=rows["step_time_s"] - rows["host_bound_s"]))
    assert d.set_index("component").loc["host_bound_s", "delta_s"] == pytest.approx(-1 / 3)
    assert d.set_index("component").loc["step_time_s", "delta_s"] == pytest.approx(-1 / 3)


def test_json_and_text_sections() -> None:
    from traceroof.report import render

    a = analyzed("fw_nnx_transformer/blocking")
    doc = json.loads(render(a, "json"))
    rows = doc["step_breakdown"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert sum(r[c] for c in COMPONENTS) == pytest.approx(r["step_time_s"], rel=0.01)
    text = render(a, "terminal")
    assert "Step breakdown" in text and "host-bound" in text and "slowest step 2" in text
    md = render(a, "markdown")
    assert "## Step breakdown" in md and "| mean |" in md


def test_diff_shows_breakdown_deltas(tmp_path) -> None:
    """From a saved JSON report to a profile: the mean step's components on both sides, signed deltas."""
    from traceroof.diff import diff, side_from_analysis, side_from_json
    from parsers.errors import FormatError
    from traceroof.report import render
    from traceroof.report.diff import render_diff_json, render_diff_text

    base = tmp_path / "base.json"
    base.write_text(render(analyzed("diff_base"), "json"))
    r = diff(side_from_json(base), side_from_analysis(analyzed("diff_wide"), "wide"))
    text = render_diff_text(r)
    assert "Step breakdown (mean step, per device)" in text
    rows = {x["component"]: x for x in json.loads(render_diff_json(r, False, ""))["step_breakdown"]}
    new = analyzed("diff_wide").step_breakdown
    assert rows["compute_s"]["new_s"] == pytest.approx(new["compute_s"].mean())
    assert rows["step_time_s"]["delta_s"] > 0 and re.search(r"compute\s+\S+ ms\s+\S+ ms\s+\+", text)
    doc = json.loads(base.read_text())
    doc["step_breakdown"][0]["host_bound_s"] = -1.0
    base.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"step_breakdown\[0\]\.host_bound_s"):
        side_from_json(base)


def test_interval_sets_match_their_points() -> None:
    """merge_intervals / intersect_intervals / subtract_intervals / covered_both_ps against the sets of integer
    points the intervals cover; results merged (sorted, apart)."""
    rng = np.random.default_rng(11)

    def points(s: tuple[np.ndarray, np.ndarray]) -> set[int]:
        return {t for a, b in zip(*s) for t in range(a, b)}

    def random_set() -> tuple[np.ndarray, np.ndarray]:
        k = int(rng.integers(0, 12))
        start = rng.integers(0, 80, k)
        end = start + rng.integers(-4, 15, k)  # some empty or reversed: they cover nothing
        merged = merge_intervals(start, end)
        assert points(merged) == points((start, end)) and (merged[0][1:] > merged[1][:-1]).all()
        assert (merged[1] > merged[0]).all()
        return merged

    for _ in range(2000):
        a, b = random_set(), random_set()
        for got, want in ((intersect_intervals(a, b), points(a) & points(b)),
                          (subtract_intervals(a, b), points(a) - points(b))):
            assert points(got) == want
            assert got[0].dtype == np.int64 and (got[1] > got[0]).all() and (got[0][1:] > got[1][:-1]).all()
        lo = rng.integers(-5, 100, 4)
        hi = lo + rng.integers(-3, 40, 4)  # some windows empty or reversed
        both = points(a) & points(b)
        assert covered_both_ps(a, b, lo, hi).tolist() == [len(both & set(range(x, y))) for x, y in zip(lo, hi)]
        assert (covered_both_ps(a, b, lo, hi) == covered_ps(intersect_intervals(a, b), lo, hi)).all()


def test_a_trace_json_without_hlo_measures_communication_by_op_names():
    """A trace JSON carries no HLO: its collectives (all-reduce.14, all-to-all.5...) were 'unknown' ops, and the
    breakdown read 0 % exposed communication where the xplane with its HLO reads most of the step. XLA names an
    instruction after its opcode, so the names identify them: the same events give the xplane's figure."""
    import glob

    from traceroof.analysis import analyze

    (tj,) = glob.glob(str(FIXTURES / "sharded_mlp" / "logdir" / "**" / "*.trace.json.gz"), recursive=True)
    (xp,) = glob.glob(str(FIXTURES / "sharded_mlp" / "logdir" / "**" / "*.xplane.pb"), recursive=True)
    names = analyze(tj, chip=str(HOST_CHIP))
    hlo = analyze(xp, chip=str(HOST_CHIP))
    assert names.summary.join.events_joined == 0
    assert hlo.summary.exposed_comm_per_step_s > 0.5 * hlo.summary.step_time_mean_s
    assert names.summary.exposed_comm_per_step_s == pytest.approx(hlo.summary.exposed_comm_per_step_s, rel=0.01)
    assert names.step_breakdown["exposed_comm_s"].sum() == pytest.approx(hlo.step_breakdown["exposed_comm_s"].sum(),
                                                                         rel=0.01)
    (note,) = [n for n in names.summary.notes if "taken for collectives by their names" in n]
    collectives = hlo.ops.loc[hlo.ops["category"].astype(str) == "collective", "hlo_op"].astype(str).nunique()
    assert note.startswith(f"{collectives} op(s) without HLO")
