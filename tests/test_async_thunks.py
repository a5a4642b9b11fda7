"""XLA:CPU async thunk ends (``traceroof.asyncends._bound_async_ends``): an ``end: <op>`` event is when the thunk's
completion was processed, which can lag the op by milliseconds. A lagging end is built here from the scan_mlp
fixture by moving one ``end:`` event into the next step, as a loaded machine recorded it (trial run
b_nnx_cnn_bn/a: a 25 µs convolution ended at an ``end:`` event 2.2 ms later, and one step came out negative)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from parsers.xspace import parse_full
from traceroof.discovery import discover
from traceroof.profile import load_profile
from tests.conftest import fixture_xplane

SRC = fixture_xplane("scan_mlp")
OP = "broadcast_multiply_fusion"  # once per execution; read by while.3 later in the same execution
STEP = 2


@pytest.fixture(scope="module")
def baseline():
    return load_profile(discover([SRC]))


def _stat(plane, ev, name):
    sid = next((k for k, v in plane.stat_metadata.items() if v.name == name), None)
    for st in ev.stats:
        if st.metadata_id == sid:
            return getattr(st, st.WhichOneof("value"))
    return None


def _lagging_end(tmp_path, baseline, lag_to_ps: int, keep_hlo: bool = True):
    """The fixture with the ``end:`` event of step ``STEP``'s ``OP`` moved to ``lag_to_ps`` (profile time);
    without the profile's embedded HLO when not ``keep_hlo``. Returns the file and the op's start (ps)."""
    e = baseline.events()
    op_start = int(e.loc[(e["step"] == STEP) & (e["hlo_op"] == OP), "start_ps"].iloc[0])
    m = parse_full(SRC)
    cpu = next(p for p in m.planes if p.name == "/host:CPU")
    names = {k: v.name for k, v in cpu.event_metadata.items()}
    base_ps = min(line.timestamp_ns * 1000 + ev.offset_ps for line in cpu.lines for ev in line.events
                  if _stat(cpu, ev, "hlo_op") is not None)
    t0 = int(e["start_ps"].min())  # the loader's times start at the first op event here (one host)
    flows = [_stat(cpu, ev, "_p") for line in cpu.lines for ev in line.events
             if names.get(ev.metadata_id) == OP and line.timestamp_ns * 1000 + ev.offset_ps - base_ps + t0 == op_start]
    assert len(flows) == 1 and flows[0] is not None
    moved = 0
    for line in cpu.lines:
        for ev in line.events:
            if names.get(ev.metadata_id) == f"end: {OP}" and _stat(cpu, ev, "_c") == flows[0]:
                ev.offset_ps = lag_to_ps - t0 + base_ps - line.timestamp_ns * 1000 - ev.duration_ps
                moved += 1
    assert moved == 1
    if not keep_hlo:
        meta = next(p for p in m.planes if p.name == "/host:metadata")
        for em in meta.event_metadata.values():
            del em.stats[:]
    f = tmp_path / "vm.xplane.pb"
    f.write_bytes(m.SerializeToString())
    return f, op_start


def _cuts(notes) -> int:
    (n,) = [int(m.group(1)) for m in map(re.compile(r".*; ([0-9,]+) ends cut at later work").match, notes) if m]
    return n


def _step_times_ps(profile) -> np.ndarray:
    s = profile.steps
    return (s["device_end_ps"] - s["device_start_ps"]).to_numpy(np.int64)


def test_a_late_end_is_cut_at_the_first_op_reading_the_result(tmp_path, baseline):
    nxt = baseline.steps.set_index("step").loc[STEP + 1]
    late = int(nxt["device_start_ps"] + (nxt["device_end_ps"] - nxt["device_start_ps"]) // 2)
    f, op_start = _lagging_end(tmp_path, baseline, late)
    p = load_profile(discover([f]))
    e = p.events()
    run = e.loc[(e["step"] == STEP) & (e["hlo_op"] == OP), "run_id"].iloc[0]
    user_start = int(e.loc[(e["run_id"] == run) & (e["hlo_op"] == "while.3"), "start_ps"].iloc[0])
    op = e[(e["step"] == STEP) & (e["hlo_op"] == OP)].iloc[0]
    assert op["start_ps"] == op_start
    # before: the op ran to its end: event, past the start of the next step; now to while.3, which reads it
    assert op_start + op["duration_ps"] == user_start
    # the fixture's own ends already lag the ops reading their results a little (stated in the stretch note);
    # this one, tens of ms late, is material: stated in a note of its own, one cut more
    was = _cuts(baseline.notes)
    assert any(n.startswith(f"{was + 1} async thunk ends came after later work had started") and
               f"using the result ({was + 1})" in n for n in p.notes), p.notes
    # nothing else moved: the steps are the fixture's (the op is not its step's last)
    assert (_step_times_ps(p) == _step_times_ps(baseline)).all()
    other = (e["step"] != STEP) | (e["hlo_op"] != OP)
    assert (e.loc[other, "duration_ps"].to_numpy() == baseline.events().loc[other, "duration_ps"].to_numpy()).all()


def test_without_hlo_a_late_end_is_cut_at_the_programs_next_execution(tmp_path, baseline):
    nxt = baseline.steps.set_index("step").loc[STEP + 1]
    late = int(nxt["device_end_ps"]) - 1_000_000  # 1 µs before the next step's last op ends
    f, op_start = _lagging_end(tmp_path, baseline, late, keep_hlo=False)
    p = load_profile(discover([f]))
    assert not p.modules
    e = p.events()
    op = e[(e["step"] == STEP) & (e["hlo_op"] == OP)].iloc[0]
    next_run_start = int(e.loc[e["step"] == STEP + 1, "start_ps"].min())
    assert op_start + op["duration_ps"] <= next_run_start
    assert any("or of the program's next execution (1)" in n for n in p.notes), p.notes
    times = _step_times_ps(p)
    assert (times > 0).all(), times


def test_first_start_after_matches_a_scan_of_each_group():
    # one candidate per group (the table) and several (the sort), with starts equal to a query's (not after it)
    from traceroof.asyncends import NO_BOUND_PS, _first_start_after
    rng = np.random.default_rng(2)
    for n_groups, n_cand in ((50, 40), (50, 200), (3, 30)):
        g_cand = rng.permutation(n_groups)[:n_cand] if n_cand <= n_groups else rng.integers(0, n_groups, n_cand)
        c_start = rng.integers(0, 100, len(g_cand)) * 10**9
        g_query, q_start = rng.integers(0, n_groups, 300), rng.integers(0, 100, 300) * 10**9
        got = _first_start_after(g_cand, c_start, g_query, q_start, n_groups)
        want = [min((int(t) for g2, t in zip(g_cand, c_start) if g2 == g and t > q), default=NO_BOUND_PS)
                for g, q in zip(g_query, q_start)]
        assert got.tolist() == want


def test_busy_matches_a_sum_over_each_threads_events():
    # threads' events in one run each or interleaved (then sorted by key), times near 0 and spanning 2^61 (fewer
    # threads per key than there are: chunks) or 2^63 (times by rank); queries on threads without events
    from traceroof.events import _busy
    rng = np.random.default_rng(8)
    for scale, lo in ((1, 0), (2**55, 0), (2**56, -2**62)):
        n = 60
        lines = rng.choice([7, -3, 2**40, 5, 11], n)
        if scale == 1:
            lines = np.sort(lines)
        start, end = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for line in np.unique(lines):  # one thread's events do not overlap
            at = np.flatnonzero(lines == line)
            bounds = np.sort(rng.choice(100, 2 * len(at), replace=False)).reshape(-1, 2)
            start[at], end[at] = lo + bounds[:, 0] * scale, lo + bounds[:, 1] * scale
        q_line = rng.choice([7, -3, 2**40, 5, 11, 99], 40)
        q_t = lo + rng.integers(0, 101, 40) * scale
        want = [sum(max(0, min(int(e), int(t)) - int(s)) for s, e, line in zip(start, end, lines) if line == q)
                for q, t in zip(q_line, q_t)]
        assert _busy(lines, start, end, q_line, q_t).tolist() == want
