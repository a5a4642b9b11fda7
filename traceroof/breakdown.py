"""Where each step's time goes on each device (:func:`step_breakdown`): compute, exposed communication, launch
gaps, host-bound idle time and time outside any program, adding up to the step time.

**The step on a device** runs from the end of the previous step to its own end, so that the steps of a device
tile its timeline: a step ends when both its marker (the host's step annotation, or the device's own ``Steps``
event) and its last op have ended. With the README's asynchronous loop this is the device's step (first op of
the step's execution to its last); with a loop that blocks on every step it is the host's step period, Python
included. The first step starts at its marker or its launch, whichever is first.

**Other programs** (``other_programs_s``, named in ``other_programs``): the executions launched outside the
steps (an eval program between marked training steps) run on the device inside a step's period. Their spans on the
host (first op on any device to last), where the step's own work does not run, are not the step's time:
``step_time_s`` is the period less them, and MFU, the slowest step and the components leave them out (s40 trial:
an eval every 4 steps made the mean training step 441.5 ms for 410.3 ms of training).

**Components** (intervals on the device's timeline, measured inside the step, so they add up exactly):

- ``compute_s``: covered by at least one non-collective op (union over threads and streams, not the sum);
- ``exposed_comm_s``: covered by collectives (an async pair from its ``-start`` to its ``-done``) and no
  compute op;
- the rest is idle, split by what held the device:
  - ``launch_gap_s``: inside one execution of a program (between its first op's start and its last op's end):
    the short gaps between consecutive ops (the runtime launching the next op or kernel);
  - ``host_bound_s``: between executions, while the next execution was not launched yet (its PjRt launch or
    kernel launch, where the profile has it) and a host thread was busy (:mod:`traceroof.hostactivity`: the
    Python thread, dispatch, compilation, input pipeline): the device waited for the host;
  - ``outside_program_s``: between executions otherwise (work already queued, or host threads idle).

Executions are told apart by ``run_id`` (XLA:CPU) and otherwise by program and step.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd

from traceroof.codes import RunGroups, group_order, run_starts
from traceroof.hostactivity import (HOST_KINDS, covered_both_ps, covered_ps, intersect_intervals,
                                   merge_intervals, subtract_intervals)
from traceroof.aggregate import Timeline
from traceroof.units import fmt_list
from traceroof.overlap import collective_rows, pair_windows

COMPONENTS = ("compute_s", "exposed_comm_s", "launch_gap_s", "host_bound_s", "outside_program_s")
OTHER = "other_programs_s"  # time of programs launched outside the steps, inside a step's period: not in its time
BREAKDOWN_COLUMNS = ("step_time_s", *COMPONENTS)  # the numeric columns a saved report's rows must carry
LABELS = {"compute_s": "compute", "exposed_comm_s": "exposed communication", "launch_gap_s": "launch gaps",
          "host_bound_s": "host-bound", "outside_program_s": "outside any program",
          OTHER: "other programs (not in step time)"}
MAX_DRAWN_STEPS = 6  # steps drawn in the HTML timeline: the median, the slowest, then the first ones
MAX_DRAWN_DEVICES = 4  # devices drawn per step
MAX_DRAWN_OPS = 4000  # op bars drawn over all steps and devices (the longest of each strip); the page says so
Intervals = tuple[np.ndarray, np.ndarray]  # sorted, disjoint (start_ps, end_ps), from merge_intervals


def _union(*sets: Intervals) -> Intervals:
    return merge_intervals(np.concatenate([s[0] for s in sets]), np.concatenate([s[1] for s in sets]))


def _codes(col: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """A column as codes (-1 where missing) into its distinct values written as ``str`` (``astype(str)``'s
    text), read from a categorical column's categories without touching its rows."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        names = col.array.categories
        names = names if isinstance(names.dtype, pd.StringDtype) else names.astype(str)
        if names.is_unique:
            return col.array.codes, np.asarray(names, dtype=object)
    codes, names = pd.factorize(col.astype(str).to_numpy(dtype=object))
    return codes, np.asarray(names, dtype=object)


def _positions(key: np.ndarray, n: int) -> Callable[[int], np.ndarray]:
    """For codes ``key`` in 0..n-1: a function giving the positions holding code ``k``, in increasing order
    (``np.flatnonzero(key == k)``; none for a code outside 0..n-1): from the runs of equal codes where they are
    long (a device's events one after another), else from :func:`~traceroof.codes.group_order`."""
    change = run_starts(key)[1:]
    if len(change) > len(key) // 64:  # runs shorter than 64 events on average: one sort beats a walk per run
        order, bounds = group_order(key, n)
        return lambda k: order[bounds[k]:bounds[k + 1]] if 0 <= k < n else order[:0]
    run_start, run_end = np.append(0, change), np.append(change, len(key))
    run_code = key[run_start] if len(key) else key[:0]
    return lambda k: np.concatenate([np.zeros(0, np.int64)] + [np.arange(run_start[i], run_end[i])
                                                              for i in np.flatnonzero(run_code == k).tolist()])


def _factorize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``pd.factorize`` of an object array, hashing only the first value of each run of equal values (the host
    activity table holds each host's rows, and each kind's, one after another)."""
    heads = run_starts(values)
    codes, names = pd.factorize(values[heads])
    return np.repeat(codes, np.diff(np.append(heads, len(values)))), names


def _as_str(col: pd.Series, rows: np.ndarray) -> np.ndarray:
    """``col.astype(str)`` at positions ``rows``, as an object array (missing values stay NaN)."""
    codes, names = _codes(col)
    return np.append(names, np.nan)[codes[rows]]  # code -1: the NaN appended


def device_hosts(ops: pd.DataFrame) -> dict[str, str]:
    """Each device of the op table -> its host (both as ``str``), devices in order of first appearance. The rows
    of a (device, host) pair mostly follow one another: its distinct pairs are found among the rows where the
    pair changes."""
    dev, dev_names = _codes(ops["device"])
    host, host_names = _codes(ops["host"])
    n_host = len(host_names) + 1
    heads = run_starts(dev, host)
    dev, host = dev[heads], host[heads]
    pair = pd.unique((dev.astype(np.int64) + 1) * n_host + (host + 1))  # codes shifted: 0 is a missing value
    dev_names, host_names = np.append(np.nan, dev_names), np.append(np.nan, host_names)
    return dict(zip(dev_names[pair // n_host].tolist(), host_names[pair % n_host].tolist()))


def step_windows(steps: pd.DataFrame, device_host: dict[str, str]) -> pd.DataFrame:
    """One row per step and device: ``step``, ``device``, ``start_ps``, ``end_ps`` (see the module docstring).

    ``steps``: ``host``, ``step``, ``start_ps``, ``end_ps``, optionally ``device_start_ps`` / ``device_end_ps``
    (host steps) or ``device`` (devices' own ``Steps`` lines). ``device_host``: every device with op events ->
    its host. Steps of a host ``""`` (a whole profile as one step) apply to every device."""
    cols = ["step", "device", "start_ps", "end_ps"]
    has_step = steps["step"].notna().to_numpy(bool) if "step" in steps else np.zeros(len(steps), bool)
    if not has_step.any() or not device_host:
        return pd.DataFrame(columns=cols)
    per_device = "device" in steps and bool(steps["device"].notna().to_numpy(bool)[has_step].all())
    end = steps["end_ps"].to_numpy(np.int64)
    start = steps["start_ps"].to_numpy(np.int64)
    if "device_end_ps" in steps:
        dev_end = steps["device_end_ps"].to_numpy(dtype="float64", na_value=np.nan)
        dev_start = steps["device_start_ps"].to_numpy(dtype="float64", na_value=np.nan)
        end = np.where(np.isnan(dev_end), end, np.maximum(end, np.nan_to_num(dev_end))).astype(np.int64)
        start = np.where(np.isnan(dev_start), start, np.minimum(start, np.nan_to_num(dev_start))).astype(np.int64)
    code, names = _codes(steps["device" if per_device else "host"])
    step = steps["step"].to_numpy(np.int64, na_value=0)
    keep = has_step & (code >= 0)  # a step of a missing host or device belongs to none
    if not keep.any():
        return pd.DataFrame(columns=cols)
    by_name = np.argsort(names, kind="stable")
    rank = np.empty(len(names), np.int64)
    rank[by_name] = np.arange(len(names))  # keys ordered by their text
    rank, step, start, end = rank[code[keep]], step[keep], start[keep], end[keep]
    # one row per key and step (its earliest start, latest end), ordered by key, start and step
    order = np.lexsort((step, rank))
    rank, step, start, end = rank[order], step[order], start[order], end[order]
    first = run_starts(rank, step)
    rank, step = rank[first], step[first]
    start, end = np.minimum.reduceat(start, first), np.maximum.reduceat(end, first)
    order = np.lexsort((step, start, rank))
    rank, step, start, end = rank[order], step[order], start[order], end[order]
    # a step ends no earlier than any before it on its key, and starts where the one before it ended
    bounds = run_starts(rank).tolist() + [len(rank)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        end[a:b] = np.maximum.accumulate(end[a:b])
        start[a + 1:b] = end[a:b - 1]
    key = names[by_name][rank]
    if per_device:
        pick = np.flatnonzero([k in device_host for k in key.tolist()])
        devices = key[pick]
    else:
        present = set(key.tolist())
        everywhere = "" in present and not (set(device_host.values()) & present)  # one step for the whole profile
        picks = [np.flatnonzero(key == host) if host in present else np.flatnonzero(key == "") if everywhere
                 else np.zeros(0, np.int64) for host in device_host.values()]
        devices = np.repeat(np.asarray(list(device_host), dtype=object), [len(p) for p in picks])
        pick = np.concatenate(picks)
    return pd.DataFrame({"step": step[pick], "device": pd.array(devices, dtype=str), "start_ps": start[pick],
                         "end_ps": end[pick]})
def step_breakdown(ops: pd.DataFrame, timeline: Timeline, windows: pd.DataFrame,
                   run_id: np.ndarray | None = None, launch_ps: np.ndarray | None = None,
                   host_activity: pd.DataFrame | None = None,
                   pairs: dict[tuple[object, str], str] | None = None) -> pd.DataFrame:
    """One row per step and device of ``windows`` (:func:`step_windows`): ``step``, ``device``,
    ``step_time_s`` and the :data:`COMPONENTS` (seconds; they add up to ``step_time_s``), :data:`OTHER` (s) and
    ``other_programs`` (the programs' names, ``", "``-joined; ``""`` for none: see the module docstring), plus
    ``host_bound_<kind>_share`` columns: the share of the host-bound time during which each kind of host work
    (``python``, ``dispatch``, ``compile``, ``input``) was running (they may overlap, so need not sum to 1).

    ``ops``: the op table (``device``, ``host``, ``program_id``, ``hlo_op``, ``category``, ``counted``,
    ``step``); ``timeline``: its events; ``run_id`` / ``launch_ps``: per event of the timeline (float, NaN when
    unknown); ``host_activity``: :func:`traceroof.hostactivity.host_activity` rows on the same clock; ``pairs``:
    async collective pairs."""
    return _breakdown(ops, timeline, windows, run_id, launch_ps, host_activity, pairs)[0]


def _breakdown(ops: pd.DataFrame, timeline: Timeline, windows: pd.DataFrame, run_id: np.ndarray | None,
               launch_ps: np.ndarray | None, host_activity: pd.DataFrame | None,
               pairs: dict[tuple[object, str], str] | None, draw: frozenset[tuple[int, str]] = frozenset(),
               host_of: dict[str, str] | None = None) -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
    """:func:`step_breakdown`'s rows, and the items of the (step, device) strips in ``draw`` as
    :func:`timeline_items` reads them: ``step``, ``device``, ``kind``, ``start_ps``, ``end_ps``, ``w0`` (the
    step's start, ps) and ``row`` (the op row of an op bar, else -1). ``host_of``: :func:`device_hosts` of
    ``ops`` when already made.

    Op rows' columns are read per row and gathered per device (no copy of them per event). Every op event lies
    inside its execution, so the compute set lies inside the program spans; where the communication windows do
    too (always, but for an async pair spanning two executions), the device is never busy while it waits for a
    launch: then host-bound time is the waiting time the host is busy, with no set subtracted."""
    share_cols = [f"host_bound_{k}_share" for k in HOST_KINDS]
    cols = ["step", "device", "step_time_s", *COMPONENTS, *share_cols, OTHER, "other_programs"]
    items: dict[str, list] = {c: [] for c in ("step", "device", "kind", "start_ps", "end_ps", "w0", "row", "n")}
    if windows.empty or not len(timeline):
        return pd.DataFrame(columns=cols), {}
    r = timeline.row
    dev_codes, dev_names = _codes(ops["device"])
    code_of = {name: i for i, name in enumerate(dev_names.tolist())}
    coll_row = collective_rows(ops)
    any_coll = bool(coll_row.any())
    if not any_coll:
        coll_row = None
    pid_row = ops["program_id"].to_numpy(dtype="float64", na_value=-1)
    step_row = None  # read where run ids are missing
    op_codes, op_names = _codes(ops["hlo_op"]) if any_coll else (None, None)
    start, duration = timeline.start_ps, timeline.duration_ps
    rid = run_id if run_id is not None else np.full(len(r), np.nan)
    launch = launch_ps if launch_ps is not None else np.full(len(r), np.nan)
    host_of = device_hosts(ops) if host_of is None else host_of
    act = host_activity if host_activity is not None and len(host_activity) else None
    act_host = act["host"].to_numpy(object) if act is not None else np.zeros(0, object)
    act_kind, kind_names = _factorize(act["kind"].to_numpy(object) if act is not None else np.zeros(0, object))
    act_start = act["start_ps"].to_numpy(np.int64) if act is not None else np.zeros(0, np.int64)
    act_end = act["end_ps"].to_numpy(np.int64) if act is not None else np.zeros(0, np.int64)
    w_dev, w_names = pd.factorize(windows["device"])  # devices in order of first appearance
    w_step = windows["step"].to_numpy(np.int64)
    w_start = windows["start_ps"].to_numpy(np.int64)
    w_end = windows["end_ps"].to_numpy(np.int64)
    rows: dict[str, list] = {c: [] for c in cols}
    # positions grouped once (each device's in their order), not a pass over every event per device
    n_dev = len(dev_names)
    counted = ops["counted"].to_numpy(bool)
    # a counted row outside every step: an execution launched outside the steps (an eval between training steps)
    other = counted & ops["step"].isna().to_numpy(bool) if "step" in ops else np.zeros(len(ops), bool)
    small = np.min_scalar_type(-n_dev - 2)  # a signed type holding -1 .. n_dev + 1
    key = np.where(counted & ~other, np.add(dev_codes, 1, dtype=small), small.type(n_dev + 1))
    ev_of = _positions(key[r], n_dev + 2)
    mod_names, others = _other_programs(ops, timeline, other, rid) if other.any() else (None, {})
    w_of = _positions(w_dev + 1, len(w_names) + 1)
    act_codes, act_names = _factorize(act_host)
    act_of = _positions(act_codes + 1, len(act_names) + 1)
    act_code = {h: i for i, h in enumerate(act_names.tolist())}
    host_sets: dict[int, tuple[Intervals, np.ndarray, dict[int, Intervals]]] = {}  # per host: activity, its rows
    kind_at = {k: i for i, k in enumerate(kind_names.tolist())}

    def kind_set(h: int, kind: str) -> Intervals:  # host h's activity of this kind, merged once
        _, on_host, kinds = host_sets[h]
        k = kind_at.get(kind, -2)  # -2: a kind without activity (-1 is a missing one)
        if k not in kinds:
            of_kind = on_host[act_kind[on_host] == k]
            kinds[k] = merge_intervals(act_start[of_kind], act_end[of_kind])
        return kinds[k]

    dev_rank = np.unique(np.asarray(w_names, dtype=object), return_inverse=True)[1].reshape(-1)  # by text
    for g, d in enumerate(w_names):
        w = w_of(g + 1)
        lo = w_start[w]
        hi = np.maximum(w_end[w], lo)
        m = ev_of(code_of.get(d, -1) + 1)
        if len(m) and m[-1] - m[0] + 1 == len(m):  # the device's events one after another: views of them
            m = slice(int(m[0]), int(m[-1]) + 1)
        row_m = r[m]
        s = start[m]
        e = s + duration[m]
        is_c = coll_row[row_m] if any_coll else None
        any_c = is_c is not None and bool(is_c.any())
        drawn = [(st, w0, w1) for st, w0, w1 in zip(w_step[w].tolist(), lo.tolist(), hi.tolist())
                 if (st, d) in draw]
        by_start = np.argsort(s, kind="stable") if drawn else None  # (the order merge_intervals would sort in)
        s_sorted = s[by_start] if drawn else None
        if any_c:
            compute = merge_intervals(s[~is_c], e[~is_c])
        else:
            compute = merge_intervals(s_sorted, e[by_start]) if drawn else merge_intervals(s, e)
        pid = pid_row[row_m]
        # executions: run id where known, else program and step
        rid_m = rid[m]
        by_run = ~np.isnan(rid_m)
        if not by_run.all() and step_row is None:
            step_row = ops["step"].to_numpy(dtype="float64", na_value=-1)
        first_s, last_e, first_launch = _executions(pid, by_run, rid_m if by_run.all() else
                                                    np.where(by_run, rid_m, step_row[row_m]), s, e, launch[m])
        programs = merge_intervals(first_s, last_e)
        if any_c:  # busy: compute and communication
            op_c = op_codes[row_m[is_c]]
            op_c = np.where(op_c >= 0, op_c, len(op_names))  # a missing name: the NaN appended
            comm_lo = pair_windows(np.zeros(len(op_c), np.int64), pid[is_c], op_c, np.append(op_names, np.nan),
                                   s[is_c], pairs or {})[1]
            comm = merge_intervals(comm_lo, e[is_c])
            busy = _union(compute, comm)
            inside = _inside(comm, programs)
        else:
            busy, inside = compute, True
        waiting = _waiting_for_launch(first_s, first_launch, programs)
        spans = others.get(host_of.get(d, ""))
        if spans is not None:  # other programs' executions on this host: where this step's own work does not run
            foreign = subtract_intervals(spans[0], _union(programs, busy))
            waiting = subtract_intervals(waiting, spans[0])
            other_ps = covered_ps(foreign, lo, hi)
            other_names = _names_in_windows(*spans[1:], mod_names, lo, hi)
        else:
            foreign, other_ps, other_names = None, np.zeros(len(lo), np.int64), np.full(len(lo), "", object)
        h = act_code.get(host_of.get(d, ""), -2)  # a host without activity: none
        if h not in host_sets:
            on_host = act_of(h + 1)
            host_sets[h] = (merge_intervals(act_start[on_host], act_end[on_host]), on_host, {})
        host = host_sets[h][0]
        c_ps = covered_ps(compute, lo, hi)
        busy_ps = covered_ps(busy, lo, hi) if any_c else c_ps
        prog_ps = covered_ps(programs, lo, hi)
        prog_busy_ps = busy_ps if inside else covered_ps(intersect_intervals(programs, busy), lo, hi)
        # host-bound: waiting for a launch while the host is busy, and the device is not (it can be only when an
        # async pair spans two executions); every use below takes its part within the host's busy set
        idle = waiting if inside else subtract_intervals(intersect_intervals(waiting, host), busy)
        hb_ps = covered_both_ps(idle, host, lo, hi)
        total = hi - lo - other_ps
        launch_gap = prog_ps - prog_busy_ps
        outside = total - busy_ps - launch_gap - hb_ps
        for k in HOST_KINDS:
            share = np.full(len(lo), np.nan)
            if (hb_ps > 0).any():
                kind_ps = covered_both_ps(idle, kind_set(h, k), lo, hi)
                share = np.where(hb_ps > 0, kind_ps / np.maximum(hb_ps, 1), np.nan)
            rows[f"host_bound_{k}_share"].append(share)
        for c, v in (("step", w_step[w]), ("device", np.full(len(w), d, dtype=object)),
                     ("step_time_s", total * 1e-12), ("compute_s", c_ps * 1e-12),
                     ("exposed_comm_s", (busy_ps - c_ps) * 1e-12), ("launch_gap_s", launch_gap * 1e-12),
                     ("host_bound_s", hb_ps * 1e-12), ("outside_program_s", np.maximum(outside, 0) * 1e-12),
                     (OTHER, other_ps * 1e-12), ("other_programs", other_names),
                     ("_rank", np.full(len(w), dev_rank[g]))):
            rows.setdefault(c, []).append(v)
        if drawn:  # the device's idle and exposed sets inside its drawn steps (a few of many), once for all
            clip = merge_intervals(np.array([w0 for _, w0, _ in drawn]), np.array([w1 for _, _, w1 in drawn]))
            busy_d, compute_d, programs_d = (intersect_intervals(x, clip) for x in (busy, compute, programs))
            host_d = intersect_intervals(intersect_intervals(idle, clip), host)
            device_sets = {"exposed communication": subtract_intervals(busy_d, compute_d),
                           "launch gap": subtract_intervals(programs_d, busy_d), "host-bound": host_d}
            occupied = _union(busy_d, programs_d, host_d)
            if foreign is not None:
                device_sets["other programs"] = subtract_intervals(intersect_intervals(foreign, clip), occupied)
                occupied = _union(occupied, device_sets["other programs"])
            # the events overlapping a step: those starting before its end, after its start less the longest
            reach = int(duration[m].max(initial=0))
        for st, w0, w1 in drawn:
            win = (np.array([w0], np.int64), np.array([w1], np.int64))
            sets = {**device_sets, "outside any program": subtract_intervals(win, occupied)}
            sel = np.sort(by_start[np.searchsorted(s_sorted, w0 - reach, side="right"):
                                   np.searchsorted(s_sorted, w1, side="left")])
            sel = sel[e[sel] > w0]
            parts = [("op", np.maximum(s[sel], w0), np.minimum(e[sel], w1), row_m[sel])]
            for kind, iv in sets.items():
                a0, a1 = intersect_intervals(iv, win)
                parts.append((kind, a0, a1, np.full(len(a0), -1, np.int64)))
            for kind, a0, a1, row in parts:  # each part's step, device, kind and w0 repeated at the end
                for c, v in (("step", st), ("device", d), ("kind", kind), ("w0", w0), ("start_ps", a0),
                             ("end_ps", a1), ("row", row), ("n", len(a0))):
                    items[c].append(v)
    rows = {c: np.concatenate(v) for c, v in rows.items()}
    order = np.lexsort((rows.pop("_rank"), rows["step"]))  # by step, device
    out = pd.DataFrame({c: v[order] for c, v in rows.items()})
    if not items["row"]:
        return out, {}
    n = items.pop("n")
    return out, {c: np.concatenate(v) if c in ("start_ps", "end_ps", "row") else
                 np.repeat(np.array(v, dtype=np.int64 if c in ("step", "w0") else object), n)
                 for c, v in items.items()}


def _inside(a: Intervals, b: Intervals) -> bool:
    """Whether merged intervals ``a`` lie inside merged intervals ``b``: each within the one of ``b`` starting at
    or before it."""
    if not len(a[0]) or not len(b[0]):
        return not len(a[0])
    j = np.searchsorted(b[0], a[0], side="right") - 1
    return bool(((j >= 0) & (a[1] <= b[1][np.maximum(j, 0)])).all())


def _executions(program: np.ndarray, by_run: np.ndarray, key: np.ndarray, start: np.ndarray, end: np.ndarray,
                launch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per execution (the events sharing ``program``, ``by_run`` and ``key``; in order of first appearance): its
    first op start, last op end (ps, int64) and earliest known launch (ps, float; NaN when none is known; fmin: a
    NaN launch is no launch), reduced over the runs of each execution's events (:class:`~traceroof.codes.RunGroups`:
    an execution's events mostly follow one another)."""
    groups = RunGroups.of([key, program, by_run])
    return groups.reduce(np.minimum, start), groups.reduce(np.maximum, end), groups.reduce(np.fmin, launch)


def _other_programs(ops: pd.DataFrame, timeline: Timeline, other: np.ndarray, run_id: np.ndarray,
                    ) -> tuple[np.ndarray, dict[str, tuple[Intervals, np.ndarray, np.ndarray, np.ndarray]]]:
    """The executions of the op rows ``other`` (counted, outside every step), per host: ``(merged spans,
    first op start, last op end, module code)``, and the module names the codes index. An execution (its
    program and run id) spans its host's devices, from its first op on any of them to its last: a device that
    finished its part waits for the others' before the host goes on (s41 trial: 4 virtual devices, 27-32 ms of
    each sampling call spent so, read as host-bound). Events without a run id are their own spans."""
    mod_codes, mod_names = _codes(ops["module"])
    host_codes, host_names = _codes(ops["host"])
    at = np.flatnonzero(other[timeline.row])
    row = timeline.row[at]
    s = timeline.start_ps[at]
    e = s + timeline.duration_ps[at]
    rid = run_id[at]
    known = ~np.isnan(rid)
    pid = ops["program_id"].to_numpy(dtype="float64", na_value=-1)[row]
    # one group per (host, program, run id) where the run id is known, else per event
    key = pd.factorize(pd.MultiIndex.from_arrays([host_codes[row], pid, np.where(known, rid, -1.0),
                                                  np.where(known, -1, np.arange(len(at)))]))[0]
    n = int(key.max()) + 1 if len(key) else 0
    first = np.full(n, np.iinfo(np.int64).max)
    last = np.full(n, np.iinfo(np.int64).min)
    np.minimum.at(first, key, s)
    np.maximum.at(last, key, e)
    head = np.unique(key, return_index=True)[1]
    host, module = host_codes[row][head], mod_codes[row][head]
    out = {}
    for h in np.unique(host).tolist():
        mine = host == h
        out[str(host_names[h]) if h >= 0 else ""] = (merge_intervals(first[mine], last[mine]), first[mine],
                                                     last[mine], module[mine])
    return mod_names, out


def _names_in_windows(first_s: np.ndarray, last_e: np.ndarray, module: np.ndarray, names: np.ndarray,
                      lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per window [lo, hi) (sorted, disjoint): the programs (``names[module]``, sorted, joined by ``", "``) of the
    executions (first op start ``first_s``, last op end ``last_e``) that overlap it; ``""`` for none."""
    out = np.full(len(lo), "", object)
    found: dict[int, set[str]] = {}
    first_w, end_w = np.searchsorted(hi, first_s, side="right"), np.searchsorted(lo, last_e, side="left")
    for i in np.flatnonzero(end_w > first_w).tolist():
        name = str(names[module[i]]) if module[i] >= 0 else "(unnamed program)"
        for w in range(int(first_w[i]), int(end_w[i])):
            found.setdefault(w, set()).add(name)
    for w, got in found.items():
        out[w] = ", ".join(sorted(got))
    return out


def _waiting_for_launch(first_s: np.ndarray, launch: np.ndarray, programs: Intervals) -> Intervals:
    """Where a device without a running program was waiting for its next execution to be launched: each gap
    between program spans (and the time before the first, after the last) up to the launch of the next
    execution (the whole gap when that launch is unknown). ``first_s`` / ``launch``: each execution's first op
    start and launch (:func:`_executions`)."""
    big = np.iinfo(np.int64).max // 4
    ps, pe = programs
    gap_lo = np.concatenate([[-big], pe])
    gap_hi = np.concatenate([ps, [big]])
    order = np.argsort(first_s, kind="stable")
    first_s, launch = first_s[order], launch[order]
    # the next execution after each gap: the first whose first op starts at or after the gap's end
    nxt = np.searchsorted(first_s, gap_hi, side="left")
    has = nxt < len(first_s)
    lau = np.where(has, launch[np.minimum(nxt, max(len(first_s) - 1, 0))] if len(first_s) else np.nan, np.nan)
    until = np.where(np.isnan(lau), gap_hi, np.minimum(np.nan_to_num(lau, nan=0).astype(np.int64), gap_hi))
    return merge_intervals(gap_lo, np.maximum(until, gap_lo))


def _summed(rows: pd.DataFrame) -> list[str]:
    """The columns averaged by :func:`mean_row` and :func:`per_step`: the step time, the components, and
    :data:`OTHER` where the rows carry it (a saved report of an older version may not)."""
    return ["step_time_s", *COMPONENTS] + ([OTHER] if OTHER in rows else [])


def mean_row(rows: pd.DataFrame) -> dict[str, float]:
    """The mean step over steps and devices: ``step_time_s``, each component and :data:`OTHER` (seconds)."""
    return {c: float(rows[c].mean()) for c in _summed(rows)} if len(rows) else {}


def per_step(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per step: ``step_time_s``, components and :data:`OTHER` averaged over devices."""
    return rows.groupby("step", sort=True)[_summed(rows)].mean().reset_index()


def other_programs_line(rows: pd.DataFrame) -> str:
    """One line naming the programs launched outside the steps that ran inside step periods, and how much of
    them (``""`` when none did)."""
    if OTHER not in rows or not (rows[OTHER] > 0).any():
        return ""
    steps = per_step(rows)
    hit = steps[steps[OTHER] > 0]
    names = sorted({n for x in rows.loc[rows[OTHER] > 0, "other_programs"].astype(str) for n in x.split(", ") if n})
    return (f"programs launched outside the steps ({fmt_list(names, 4)}) ran in the periods of steps "
            f"{fmt_list((str(int(x)) for x in hit['step']), 6)}: {_ms(float(hit[OTHER].mean()))} in each on average "
            f"({_ms(float(steps[OTHER].mean()))} per step over all steps), left out of the step time and MFU")


def slowest_vs_median(rows: pd.DataFrame) -> str:
    """One line: the slowest step against the median step, with the components that differ most."""
    steps = per_step(rows)
    if len(steps) < 2:
        return ""
    by_time = steps.sort_values(["step_time_s", "step"], kind="stable").reset_index(drop=True)
    med = by_time.iloc[(len(by_time) - 1) // 2]
    slow = by_time.iloc[-1]
    extra = float(slow["step_time_s"] - med["step_time_s"])
    if extra <= 0:
        return ""
    deltas = sorted(((float(slow[c] - med[c]), c) for c in COMPONENTS), reverse=True)
    parts = ", ".join(f"{LABELS[c]} {'+' if d >= 0 else '-'}{_ms(abs(d))}" for d, c in deltas if abs(d) >= 0.05 * extra)
    return (f"slowest step {int(slow['step'])} took {_ms(float(slow['step_time_s']))}, {_ms(extra)} more than the "
            f"median step {int(med['step'])} ({_ms(float(med['step_time_s']))}): {parts or 'spread over components'}")


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def breakdown_delta(base: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """Mean step time and components of two breakdowns: ``component``, ``base_s``, ``new_s``, ``delta_s``
    (empty when either side has none)."""
    cols = ["component", "base_s", "new_s", "delta_s"]
    if base is None or new is None or not len(base) or not len(new):
        return pd.DataFrame(columns=cols)
    b, n = mean_row(base), mean_row(new)
    names = [c for c in _summed(base) if c in n and (c != OTHER or b[c] > 0 or n[c] > 0)]
    return pd.DataFrame({"component": names, "base_s": [b[c] for c in names], "new_s": [n[c] for c in names],
                         "delta_s": [n[c] - b[c] for c in names]})


def analysis_breakdown(profile, ops: pd.DataFrame, timeline: Timeline, steps: pd.DataFrame,
                       used: tuple[int, ...], pairs: dict[tuple[object, str], str]
                       ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`step_breakdown` of the ``used`` steps of an analysis (``profile``: the
    :class:`~traceroof.profile.Profile` the op table and timeline were built from; ``steps``: its steps, or the
    one step the analysis made of a profile without markers; ``pairs``: its async collective pairs, as
    :func:`~traceroof.communication._async_pairs` gives them), and the items of the HTML timeline
    (:func:`timeline_items`) of its drawn steps (:func:`_drawn_steps`) on the first :data:`MAX_DRAWN_DEVICES`
    devices."""
    host_of = device_hosts(ops)
    windows = step_windows(steps, host_of)
    in_used = np.isin(windows["step"].to_numpy(np.int64), np.asarray(used, np.int64))
    windows = windows if in_used.all() else windows.take(np.flatnonzero(in_used))
    devices = sorted(set(windows["device"].tolist()))[:MAX_DRAWN_DEVICES]
    draw = frozenset((st, d) for st in _drawn_steps(windows) for d in devices)
    rows, items = _breakdown(ops, timeline, windows, timeline.run_id, timeline.launch_ps, profile.host_activity,
                             pairs, draw, host_of)
    return rows, timeline_items(items, ops)


def _drawn_steps(windows: pd.DataFrame) -> list[int]:
    """The steps the HTML timeline draws: the median and the slowest step (mean over devices), then the first
    ones."""
    if windows.empty:
        return []
    steps, at = np.unique(windows["step"].to_numpy(np.int64), return_inverse=True)
    total_ps = np.zeros(len(steps), np.int64)
    np.add.at(total_ps, at, windows["end_ps"].to_numpy(np.int64) - windows["start_ps"].to_numpy(np.int64))
    by_time = steps[np.argsort(total_ps / np.bincount(at, minlength=len(steps)), kind="stable")].tolist()
    chosen = [by_time[(len(by_time) - 1) // 2], by_time[-1]]
    chosen += [x for x in steps.tolist() if x not in chosen]
    return chosen[:MAX_DRAWN_STEPS]


def timeline_items(items: dict[str, np.ndarray], ops: pd.DataFrame) -> pd.DataFrame:
    """What the HTML timeline draws: ``step``, ``device``, ``kind`` (``op`` or an idle / exposed-communication
    kind), ``start_s`` (from the step's start), ``duration_s``, ``layer``, ``hlo_op`` (ops only). Op bars are
    capped at :data:`MAX_DRAWN_OPS` over all strips (the longest of each strip kept); ``attrs["ops_total"]``
    holds how many there were. ``items``: :func:`_breakdown`'s, ``{}`` when none."""
    cols = ["step", "device", "kind", "start_s", "duration_s", "layer", "hlo_op"]
    if not items or not len(items["row"]):
        return pd.DataFrame(columns=cols)
    step, device, kind = items["step"], items["device"], items["kind"]
    start_s = (items["start_ps"] - items["w0"]) * 1e-12
    duration_s = (items["end_ps"] - items["start_ps"]) * 1e-12
    dev_code, devices = pd.factorize(device)
    dev_rank = np.empty(len(devices), np.int64)
    dev_rank[np.argsort(devices, kind="stable")] = np.arange(len(devices))  # as np.unique's: by text
    dev_rank = dev_rank[dev_code]
    strip = pd.factorize(step * len(devices) + dev_rank)[0]
    is_op = kind == "op"
    strips = max(len(np.unique(strip[is_op])), 1)
    per_strip = max(MAX_DRAWN_OPS // strips, 1)
    # each strip's longest op bars (ties in order), then the other items that last
    ops_longest = np.flatnonzero(is_op)[np.argsort(-duration_s[is_op], kind="stable")]
    by_strip = np.argsort(strip[ops_longest], kind="stable")
    first_of_strip = np.searchsorted(strip[ops_longest][by_strip], strip[ops_longest][by_strip])
    nth = np.empty(len(ops_longest), np.int64)
    nth[by_strip] = np.arange(len(ops_longest)) - first_of_strip
    kept = np.concatenate([ops_longest[nth < per_strip], np.flatnonzero(~is_op & (duration_s > 0))])
    kept = kept[np.lexsort((start_s[kept], dev_rank[kept], step[kept]))]
    row = items["row"][kept]
    layer = np.where(row >= 0, _as_str(ops["layer"], np.maximum(row, 0)), "")
    phase = np.where(row >= 0, _as_str(ops["phase"], np.maximum(row, 0)), "")
    op = np.where(row >= 0, _as_str(ops["hlo_op"], np.maximum(row, 0)), "")
    out = pd.DataFrame({"step": step[kept], "device": device[kept], "kind": kind[kept], "start_s": start_s[kept],
                        "duration_s": duration_s[kept],
                        "layer": [f"{x} ({p})" if x else "" for x, p in zip(layer, phase)], "hlo_op": op})
    out.attrs["ops_total"] = int(is_op.sum())
    return out
