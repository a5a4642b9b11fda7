"""Where each step's time goes on each device (:func:`step_breakdown`): compute, exposed communication, launch
gaps, host-bound idle time and time outside any program, adding up to the step time.

**The step on a device** runs from the end of the previous step to its own end, so that the steps of a device
tile its timeline: a step ends when both its marker (the host's step annotation, or the device's own ``Steps``
event) and its last op have ended. With the README's asynchronous loop this is the device's step (first op of
the step's execution to its last); with a loop that blocks on every step it is the host's step period, Python
included. The first step starts at its marker or its launch, whichever is first.

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

import numpy as np
import pandas as pd

from traceroof.hostactivity import HOST_KINDS, breakpoints, inside, merge_intervals, subtract_intervals
from traceroof.optable import Timeline

COMPONENTS = ("compute_s", "exposed_comm_s", "launch_gap_s", "host_bound_s", "outside_program_s")
BREAKDOWN_COLUMNS = ("step_time_s", *COMPONENTS)  # the numeric columns a saved report's rows must carry
LABELS = {"compute_s": "compute", "exposed_comm_s": "exposed communication", "launch_gap_s": "launch gaps",
          "host_bound_s": "host-bound", "outside_program_s": "outside any program"}
ITEM_COLUMNS = ["step", "device", "kind", "start_s", "duration_s", "row"]
MAX_DRAWN_STEPS = 6  # steps drawn in the HTML timeline: the median, the slowest, then the first ones
MAX_DRAWN_DEVICES = 4  # devices drawn per step
MAX_DRAWN_OPS = 4000  # op bars drawn over all steps and devices (the longest of each strip); the page says so
Intervals = tuple[np.ndarray, np.ndarray]  # sorted, disjoint (start_ps, end_ps), from merge_intervals


def _union(*sets: Intervals) -> Intervals:
    return merge_intervals(np.concatenate([s[0] for s in sets]), np.concatenate([s[1] for s in sets]))


def _intersect(a: Intervals, b: Intervals) -> Intervals:
    """Intersection of two merged interval sets."""
    pts = breakpoints(a, b)
    if len(pts) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    lo, hi = pts[:-1], pts[1:]
    keep = inside(a, lo) & inside(b, lo)
    return merge_intervals(lo[keep], hi[keep])


def covered_ps(s: Intervals, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Length (ps, int64) of [lo, hi) covered by the merged intervals ``s``, per window."""
    ms, me = s
    if not len(ms):
        return np.zeros(len(lo), np.int64)
    cum = np.concatenate([[0], np.cumsum(me - ms)])

    def before(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(ms, t, side="right")  # intervals starting at or before t
        j = np.maximum(i - 1, 0)
        part = np.clip(t - ms[j], 0, me[j] - ms[j])
        return np.where(i > 0, cum[j] + part, 0)

    return np.maximum(before(np.asarray(hi, np.int64)) - before(np.asarray(lo, np.int64)), 0)


def step_windows(steps: pd.DataFrame, device_host: dict[str, str]) -> pd.DataFrame:
    """One row per step and device: ``step``, ``device``, ``start_ps``, ``end_ps`` (see the module docstring).

    ``steps``: ``host``, ``step``, ``start_ps``, ``end_ps``, optionally ``device_start_ps`` / ``device_end_ps``
    (host steps) or ``device`` (devices' own ``Steps`` lines). ``device_host``: every device with op events ->
    its host. Steps of a host ``""`` (a whole profile as one step) apply to every device."""
    cols = ["step", "device", "start_ps", "end_ps"]
    st = steps.dropna(subset=["step"])
    if st.empty or not device_host:
        return pd.DataFrame(columns=cols)
    per_device = "device" in st and st["device"].notna().all()
    end = st["end_ps"].to_numpy(np.int64)
    start = st["start_ps"].to_numpy(np.int64)
    if "device_end_ps" in st:
        dev_end = st["device_end_ps"].to_numpy(dtype="float64", na_value=np.nan)
        dev_start = st["device_start_ps"].to_numpy(dtype="float64", na_value=np.nan)
        end = np.where(np.isnan(dev_end), end, np.maximum(end, np.nan_to_num(dev_end))).astype(np.int64)
        start = np.where(np.isnan(dev_start), start, np.minimum(start, np.nan_to_num(dev_start))).astype(np.int64)
    key = st["device" if per_device else "host"].astype(str).to_numpy()
    t = pd.DataFrame({"key": key, "step": st["step"].to_numpy(np.int64), "start_ps": start, "end_ps": end})
    t = t.groupby(["key", "step"], as_index=False).agg(start_ps=("start_ps", "min"), end_ps=("end_ps", "max"))
    t = t.sort_values(["key", "start_ps", "step"], kind="stable")
    run_end = t.groupby("key")["end_ps"].cummax()
    prev = run_end.groupby(t["key"]).shift(1)
    t["end_ps"] = run_end.to_numpy()
    t["start_ps"] = np.where(prev.notna(), prev.fillna(0), t["start_ps"]).astype(np.int64)
    if per_device:
        t = t[t["key"].isin(list(device_host))]
        return t.rename(columns={"key": "device"})[cols].reset_index(drop=True)
    hosts = set(device_host.values())
    out = []
    for dev, host in device_host.items():
        mine = t[t["key"] == host] if host in set(t["key"]) else t[t["key"] == ""] if "" in set(t["key"]) \
            and not (hosts & set(t["key"])) else t.iloc[:0]
        out.append(mine.assign(device=dev))
    return pd.concat(out, ignore_index=True)[cols] if out else pd.DataFrame(columns=cols)


def _async_windows(op: np.ndarray, pid: np.ndarray, start: np.ndarray, end: np.ndarray,
                   pairs: dict[tuple[object, str], str]) -> np.ndarray:
    """Per collective event of one device (any order): the start of its window, from the latest preceding
    ``-start`` event of its async pair (``pairs``: (program id, ``-done`` op) -> ``-start`` op), else its own."""
    lo = start.copy()
    if not pairs:
        return lo
    last: dict[tuple[object, str], int] = {}
    starts_of_pairs = {(p, s) for (p, _), s in pairs.items()}
    for j in np.argsort(start, kind="stable"):
        key = (int(pid[j]) if pid[j] >= 0 else None, str(op[j]))
        if key in starts_of_pairs:
            last[key] = int(start[j])
        elif key in pairs and (key[0], pairs[key]) in last:
            lo[j] = last[(key[0], pairs[key])]
    return lo


def step_breakdown(ops: pd.DataFrame, timeline: Timeline, windows: pd.DataFrame,
                   run_id: np.ndarray | None = None, launch_ps: np.ndarray | None = None,
                   host_activity: pd.DataFrame | None = None,
                   pairs: dict[tuple[object, str], str] | None = None) -> pd.DataFrame:
    """One row per step and device of ``windows`` (:func:`step_windows`): ``step``, ``device``,
    ``step_time_s`` and the :data:`COMPONENTS` (seconds; they add up to ``step_time_s``), plus
    ``host_bound_<kind>_share`` columns: the share of the host-bound time during which each kind of host work
    (``python``, ``dispatch``, ``compile``, ``input``) was running (they may overlap, so need not sum to 1).

    ``ops``: the op table (``device``, ``host``, ``program_id``, ``hlo_op``, ``category``, ``counted``,
    ``step``); ``timeline``: its events; ``run_id`` / ``launch_ps``: per event of the timeline (float, NaN when
    unknown); ``host_activity``: :func:`traceroof.hostactivity.host_activity` rows on the same clock; ``pairs``:
    async collective pairs."""
    return _breakdown(ops, timeline, windows, run_id, launch_ps, host_activity, pairs)[0]


def _breakdown(ops: pd.DataFrame, timeline: Timeline, windows: pd.DataFrame, run_id: np.ndarray | None,
               launch_ps: np.ndarray | None, host_activity: pd.DataFrame | None,
               pairs: dict[tuple[object, str], str] | None, draw: frozenset[int] = frozenset()
               ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`step_breakdown`'s rows, and the :func:`timeline_items` of the steps in ``draw``."""
    items: list[pd.DataFrame] = []
    share_cols = [f"host_bound_{k}_share" for k in HOST_KINDS]
    cols = ["step", "device", "step_time_s", *COMPONENTS, *share_cols]
    if windows.empty or not len(timeline):
        return pd.DataFrame(columns=cols), pd.DataFrame(columns=ITEM_COLUMNS)
    r = timeline.row
    counted = ops["counted"].to_numpy(bool)[r]
    dev_codes = pd.Categorical(ops["device"].astype(str)).codes
    dev_names = list(pd.Categorical(ops["device"].astype(str)).categories)
    dev = dev_codes[r]
    coll = (ops["category"].astype(str) == "collective").to_numpy()[r]
    pid = ops["program_id"].to_numpy(dtype="float64", na_value=-1)[r]
    step = ops["step"].to_numpy(dtype="float64", na_value=-1)[r]
    op = ops["hlo_op"].astype(str).to_numpy()[r] if coll.any() else None
    start = timeline.start_ps
    end = start + timeline.duration_ps
    rid = run_id if run_id is not None else np.full(len(r), np.nan)
    launch = launch_ps if launch_ps is not None else np.full(len(r), np.nan)
    pairs_dh = ops[["device", "host"]].drop_duplicates()
    host_of = dict(zip(pairs_dh["device"].astype(str), pairs_dh["host"].astype(str)))
    act = host_activity if host_activity is not None else pd.DataFrame(columns=["host", "kind", "start_ps",
                                                                                "end_ps"])
    rows = []
    for d, w in windows.groupby("device", sort=False):
        code = dev_names.index(d) if d in dev_names else -1
        m = np.flatnonzero((dev == code) & counted)
        lo = w["start_ps"].to_numpy(np.int64)
        hi = np.maximum(w["end_ps"].to_numpy(np.int64), lo)
        s, e = start[m], end[m]
        is_c = coll[m]
        compute = merge_intervals(s[~is_c], e[~is_c])
        comm_lo = _async_windows(op[m][is_c], pid[m][is_c], s[is_c], e[is_c], pairs or {}) if is_c.any() \
            else s[is_c]
        busy = _union(compute, merge_intervals(comm_lo, e[is_c]))
        # executions: run id where known, else program and step
        key = pd.DataFrame({"p": pid[m], "k": np.where(np.isnan(rid[m]), step[m], rid[m]),
                            "by_run": ~np.isnan(rid[m]), "s": s, "e": e, "l": launch[m]})
        ex = key.groupby(["p", "by_run", "k"], sort=False).agg(s=("s", "min"), e=("e", "max"), l=("l", "min"))
        programs = merge_intervals(ex["s"].to_numpy(np.int64), ex["e"].to_numpy(np.int64))
        waiting = _waiting_for_launch(ex, programs)
        a = act[act["host"] == host_of.get(d, "")]
        host = merge_intervals(a["start_ps"].to_numpy(np.int64), a["end_ps"].to_numpy(np.int64))
        idle_host = subtract_intervals(_intersect(waiting, host), busy)  # waiting lies outside every program
        c_ps = covered_ps(compute, lo, hi)
        busy_ps = covered_ps(busy, lo, hi)
        prog_ps = covered_ps(programs, lo, hi)
        prog_busy_ps = covered_ps(_intersect(programs, busy), lo, hi)
        hb_ps = covered_ps(idle_host, lo, hi)
        total = hi - lo
        launch_gap = prog_ps - prog_busy_ps
        outside = total - busy_ps - launch_gap - hb_ps
        shares = {}
        for k in HOST_KINDS:
            ak = a[a["kind"] == k]
            kset = merge_intervals(ak["start_ps"].to_numpy(np.int64), ak["end_ps"].to_numpy(np.int64))
            shares[f"host_bound_{k}_share"] = np.where(hb_ps > 0, covered_ps(_intersect(idle_host, kset), lo, hi)
                                                       / np.maximum(hb_ps, 1), np.nan)
        rows.append(pd.DataFrame({
            "step": w["step"].to_numpy(np.int64), "device": d, "step_time_s": total * 1e-12,
            "compute_s": c_ps * 1e-12, "exposed_comm_s": (busy_ps - c_ps) * 1e-12,
            "launch_gap_s": launch_gap * 1e-12, "host_bound_s": hb_ps * 1e-12,
            "outside_program_s": np.maximum(outside, 0) * 1e-12, **shares}))
        drawn = [(st, w0, w1) for st, w0, w1 in zip(w["step"].to_numpy(np.int64), lo, hi) if int(st) in draw]
        if drawn:  # the device's idle and exposed sets, once for all its drawn steps
            device_sets = {"exposed communication": subtract_intervals(busy, compute),
                           "launch gap": subtract_intervals(programs, busy), "host-bound": idle_host}
            occupied = _union(busy, programs, idle_host)
        for st, w0, w1 in drawn:
            win = (np.array([w0]), np.array([w1]))
            sets = {**device_sets, "outside any program": subtract_intervals(win, occupied)}
            sel = np.flatnonzero((e > w0) & (s < w1))
            parts = [pd.DataFrame({"kind": "op", "start_ps": np.maximum(s[sel], w0), "end_ps": np.minimum(e[sel], w1),
                                   "row": r[m][sel]})]
            for kind, iv in sets.items():
                a0, a1 = _intersect(iv, win)
                parts.append(pd.DataFrame({"kind": kind, "start_ps": a0, "end_ps": a1, "row": -1}))
            it = pd.concat(parts, ignore_index=True)
            items.append(it.assign(step=int(st), device=d, start_s=(it["start_ps"] - w0) * 1e-12,
                                   duration_s=(it["end_ps"] - it["start_ps"]) * 1e-12)[ITEM_COLUMNS])
    out = pd.concat(rows, ignore_index=True)[cols]
    tl = pd.concat(items, ignore_index=True) if items else pd.DataFrame(columns=ITEM_COLUMNS)
    return out.sort_values(["step", "device"], kind="stable").reset_index(drop=True), tl


def _waiting_for_launch(ex: pd.DataFrame, programs: Intervals) -> Intervals:
    """Where a device without a running program was waiting for its next execution to be launched: each gap
    between program spans (and the time before the first, after the last) up to the launch of the next
    execution (the whole gap when that launch is unknown)."""
    big = np.iinfo(np.int64).max // 4
    ps, pe = programs
    gap_lo = np.concatenate([[-big], pe])
    gap_hi = np.concatenate([ps, [big]])
    first_s = ex["s"].to_numpy(np.int64)
    launch = ex["l"].to_numpy(np.float64)
    order = np.argsort(first_s, kind="stable")
    first_s, launch = first_s[order], launch[order]
    # the next execution after each gap: the first whose first op starts at or after the gap's end
    nxt = np.searchsorted(first_s, gap_hi, side="left")
    has = nxt < len(first_s)
    lau = np.where(has, launch[np.minimum(nxt, max(len(first_s) - 1, 0))] if len(first_s) else np.nan, np.nan)
    until = np.where(np.isnan(lau), gap_hi, np.minimum(np.nan_to_num(lau, nan=0).astype(np.int64), gap_hi))
    return merge_intervals(gap_lo, np.maximum(until, gap_lo))


def mean_row(rows: pd.DataFrame) -> dict[str, float]:
    """The mean step over steps and devices: ``step_time_s`` and each component (seconds)."""
    return {c: float(rows[c].mean()) for c in ("step_time_s", *COMPONENTS)} if len(rows) else {}


def per_step(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per step: ``step_time_s`` and components averaged over devices."""
    return rows.groupby("step", sort=True)[["step_time_s", *COMPONENTS]].mean().reset_index()


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
    names = ["step_time_s", *COMPONENTS]
    return pd.DataFrame({"component": names, "base_s": [b[c] for c in names], "new_s": [n[c] for c in names],
                         "delta_s": [n[c] - b[c] for c in names]})


def analysis_breakdown(profile, ops: pd.DataFrame, timeline: Timeline, steps: pd.DataFrame,
                       used: tuple[int, ...]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`step_breakdown` of the ``used`` steps of an analysis (``profile``: the
    :class:`~traceroof.profile.Profile` the op table and timeline were built from; ``steps``: its steps, or the
    one step the analysis made of a profile without markers), and the items of the HTML timeline
    (:func:`timeline_items`)."""
    from traceroof.communication import _async_pairs

    pairs_dh = ops[["device", "host"]].drop_duplicates()
    device_host = dict(zip(pairs_dh["device"].astype(str), pairs_dh["host"].astype(str)))
    windows = step_windows(steps, device_host)
    windows = windows[windows["step"].isin(used)]
    ev = profile.events
    same = len(ev) == len(timeline)
    run_id = ev["run_id"].to_numpy(dtype="float64", na_value=np.nan) if same and "run_id" in ev else None
    launch = ev["launch_ps"].to_numpy(dtype="float64", na_value=np.nan) if same and "launch_ps" in ev else None
    devices = sorted(set(windows["device"]))[:MAX_DRAWN_DEVICES]
    pairs = _async_pairs(profile.modules)
    draw = _drawn_steps(windows)
    rows, items = _breakdown(ops, timeline, windows[windows["device"].isin(devices) | ~windows["step"].isin(draw)],
                             run_id, launch, profile.host_activity, pairs, draw)
    if len(set(windows["device"])) > len(devices):  # the devices not drawn: their rows only
        more, _ = _breakdown(ops, timeline, windows[~windows["device"].isin(devices) & windows["step"].isin(draw)],
                             run_id, launch, profile.host_activity, pairs)
        rows = pd.concat([rows, more], ignore_index=True).sort_values(["step", "device"], kind="stable") \
            .reset_index(drop=True)
    return rows, timeline_items(items, ops)


def _drawn_steps(windows: pd.DataFrame) -> frozenset[int]:
    """The steps the HTML timeline draws: the median and the slowest step, then the first ones."""
    t = windows.assign(t=windows["end_ps"] - windows["start_ps"]).groupby("step")["t"].mean().sort_values(
        kind="stable")
    if t.empty:
        return frozenset()
    chosen = [int(t.index[(len(t) - 1) // 2]), int(t.index[-1])]
    chosen += [int(x) for x in sorted(t.index) if int(x) not in chosen]
    return frozenset(chosen[:MAX_DRAWN_STEPS])


def timeline_items(items: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    """What the HTML timeline draws: ``step``, ``device``, ``kind`` (``op`` or an idle / exposed-communication
    kind), ``start_s`` (from the step's start), ``duration_s``, ``layer``, ``hlo_op`` (ops only). Op bars are
    capped at :data:`MAX_DRAWN_OPS` over all strips (the longest of each strip kept); ``attrs["ops_total"]``
    holds how many there were."""
    cols = ["step", "device", "kind", "start_s", "duration_s", "layer", "hlo_op"]
    if items.empty:
        return pd.DataFrame(columns=cols)
    is_op = items["kind"] == "op"
    strips = max(items.loc[is_op, ["step", "device"]].drop_duplicates().shape[0], 1)
    per_strip = max(MAX_DRAWN_OPS // strips, 1)
    op_items = items[is_op].sort_values("duration_s", ascending=False, kind="stable") \
        .groupby(["step", "device"], sort=False).head(per_strip)
    kept = pd.concat([op_items, items[~is_op & (items["duration_s"] > 0)]]).sort_values(
        ["step", "device", "start_s"], kind="stable")
    row = kept["row"].to_numpy(np.int64)
    layer = np.where(row >= 0, ops["layer"].astype(str).to_numpy()[np.maximum(row, 0)], "")
    phase = np.where(row >= 0, ops["phase"].astype(str).to_numpy()[np.maximum(row, 0)], "")
    op = np.where(row >= 0, ops["hlo_op"].astype(str).to_numpy()[np.maximum(row, 0)], "")
    out = kept.assign(layer=[f"{x} ({p})" if x else "" for x, p in zip(layer, phase)], hlo_op=op)[cols] \
        .reset_index(drop=True)
    out.attrs["ops_total"] = int(is_op.sum())
    return out
