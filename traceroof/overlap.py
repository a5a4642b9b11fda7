"""Exposed communication and stragglers, from the op timeline of each device.

A collective's window is its own event (synchronous collectives) or the span from its ``-start`` event to the
matching ``-done`` event (async pairs) on one device. The part of the window that other, non-collective ops on
the same device cover is hidden; the rest is exposed: time the device spent only communicating or waiting.
Across devices, one execution of a collective (same program, op, step and occurrence) arrives at different
times: the arrival skew is latest − earliest start, and each early device waits latest − own start.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from traceroof.codes import as_text, category_text, first_rows, group_codes, group_order
from traceroof.hostactivity import covered_ps, merge_intervals
from traceroof.aggregate import Timeline


def collective_rows(ops: pd.DataFrame) -> np.ndarray:
    """Whether each op row's ``category`` is ``collective`` (tested once per category of a categorical column;
    no row read where no category is)."""
    col = ops["category"]
    if isinstance(col.dtype, pd.CategoricalDtype):
        is_coll = category_text(col.array) == "collective"
        if not is_coll.any():
            return np.zeros(len(col), bool)
        return np.append(is_coll, False)[col.array.codes]  # code -1 (missing): the False appended
    return (col.astype(str) == "collective").to_numpy(bool)


def _text_codes(col: pd.Series, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``col.astype(str)`` at positions ``rows`` (a missing value reads ``nan``, as ``astype(str)`` writes it), as
    (codes into the distinct texts, the sorted distinct texts)."""
    if not isinstance(col.dtype, pd.CategoricalDtype):
        names, codes = np.unique(as_text(col, "nan")[rows], return_inverse=True)
        return codes.reshape(-1).astype(np.int64), names
    # a categorical: its categories' texts sorted, not one text per row
    names, at = np.unique(np.append(category_text(col.array), "nan"), return_inverse=True)  # code -1: "nan"
    codes = at.reshape(-1)[col.array.codes[rows]]
    used = np.zeros(len(names), bool)
    used[codes] = True  # the texts of these rows only, as np.unique of them gives
    return (np.cumsum(used) - 1)[codes].astype(np.int64), names[used]


def pair_windows(dev: np.ndarray, pid: np.ndarray, op: np.ndarray, op_names: np.ndarray, start: np.ndarray,
                 pairs: dict[tuple[object, str], str]) -> tuple[np.ndarray, np.ndarray]:
    """For collective events (device codes ``dev``, program ids ``pid`` with -1 where missing, op codes ``op``
    into ``op_names``, starts ``start``, ps): whether each is the ``-start`` event of an async pair (its window is
    accounted on its done event), and each one's window start: from the latest start event of its pair before it
    on its device (by start; ties in event order), else its own start. ``pairs``: (program id, ``-done`` op) ->
    ``-start`` op. Vectorized: one sort of the events, a binary search per done event among its pair's starts.
    The one rule for both timelines: exposed communication here, the step breakdown (:mod:`traceroof.breakdown`)."""
    lo = start.copy()
    if not pairs or not len(start):
        return np.zeros(len(start), bool), lo
    code_of = {name: i for i, name in enumerate(op_names.tolist())}
    program = np.where(pid >= 0, pid, -1).astype(np.int64)  # a missing or negative id: None in pairs
    key = group_codes([program, op])  # (program, op) of each event, few distinct
    first = first_rows(key)
    slot_of: dict[tuple[int, int], int] = {}  # (program, -start op) -> its slot
    for (p, _), st in pairs.items():
        if (p is None or p >= 0) and st in code_of:
            slot_of.setdefault((-1 if p is None else int(p), code_of[st]), len(slot_of))
    start_slot = np.full(len(first), -1, np.int64)  # per key: the slot it starts, or the slot its done ends
    done_slot = np.full(len(first), -1, np.int64)
    for k, (p, o) in enumerate(zip(program[first].tolist(), op[first].tolist())):
        if (p, o) in slot_of:
            start_slot[k] = slot_of[(p, o)]
        elif (None if p < 0 else p, op_names[o]) in pairs:
            done_slot[k] = slot_of.get((p, code_of.get(pairs[(None if p < 0 else p, op_names[o])], -1)), -1)
    is_start = start_slot[key] >= 0
    order = np.lexsort((start, dev))  # by device, then start; ties in event order
    n = len(start)
    span = np.int64(n + 1)
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)
    slots = len(slot_of)
    starts = np.flatnonzero(is_start)
    marks = np.sort((dev[starts] * slots + start_slot[key[starts]]) * span + pos[starts])  # by pair, then order
    done = np.flatnonzero(done_slot[key] >= 0)
    want = dev[done] * slots + done_slot[key[done]]
    at = np.searchsorted(marks, want * span + pos[done]) - 1  # the latest start of the pair before each done
    hit = at >= 0
    hit[hit] = marks[at[hit]] // span == want[hit]
    lo[done[hit]] = start[order[marks[at[hit]] % span]]
    return is_start, lo


def exposed_communication(ops: pd.DataFrame, timeline: Timeline, pairs: dict[tuple[object, str], str]
                          ) -> pd.DataFrame:
    """Add ``comm_window_s``, ``comm_hidden_s`` and ``comm_exposed_s`` (sums over each row's events) to the
    collective rows of an op table (0 elsewhere), from the events of the devices that run collectives.
    ``pairs`` maps (program id, ``-done`` op) to its ``-start`` op; a done event gets the window from the latest
    preceding start of its pair on the same device, and the start event gets nothing.

    Needs ``device``, ``program_id``, ``hlo_op``, ``category``, ``counted`` and the events' ``timeline``. The
    columns are added to ``ops`` in place (no copy of the large op table), which is returned.
    """
    out = ops
    is_coll_row = collective_rows(out)
    window_row, hidden_row, exposed_row = np.zeros(len(out)), np.zeros(len(out)), np.zeros(len(out))
    if is_coll_row.any():
        rows = np.arange(len(out))
        row_dev, _ = _text_codes(out["device"], rows)
        row_dev[out["device"].isna().to_numpy(bool)] = -1  # events of a missing device belong to none
        on = np.zeros(len(row_dev) + 1, bool)  # devices that run collectives (index -1: missing, never)
        on[row_dev[is_coll_row]] = True
        on[-1] = False
        ev = np.flatnonzero(on[row_dev][timeline.row]) if len(timeline) else np.zeros(0, np.int64)
        r = timeline.row[ev]
        window = np.zeros(len(ev))
        hidden = np.zeros(len(ev))
        is_coll = is_coll_row[r]
        start = timeline.start_ps[ev].astype(np.int64)
        end = start + timeline.duration_ps[ev].astype(np.int64)
        counted = out["counted"].to_numpy(bool)[r]
        dev = row_dev[r]
        coll_ev = np.flatnonzero(is_coll)
        coll_rows = np.flatnonzero(is_coll_row)
        op_codes, op_names = _text_codes(out["hlo_op"], coll_rows)  # the collectives' names
        row_op = np.zeros(len(out), np.int64)
        row_op[coll_rows] = op_codes
        pid = out["program_id"].to_numpy(dtype="float64", na_value=-1)
        rc = r[coll_ev]
        is_start, coll_lo = pair_windows(dev[coll_ev], pid[rc], row_op[rc], op_names, start[coll_ev], pairs)
        lo_of = np.zeros(len(ev), np.int64)
        lo_of[coll_ev] = coll_lo
        kept = np.zeros(len(ev), bool)
        kept[coll_ev] = ~is_start  # a start event's window is accounted on its done event
        by_dev, bounds = group_order(dev, int(dev.max(initial=-1)) + 1)  # each device's events, in their order
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            idx = by_dev[a:b]
            coll = idx[kept[idx]]
            if len(coll) == 0:
                continue
            other = idx[~is_coll[idx] & counted[idx]]
            lo, hi = lo_of[coll], end[coll]
            covered = covered_ps(merge_intervals(start[other], end[other]), lo, hi)
            window[coll] = (hi - lo) * 1e-12
            hidden[coll] = np.minimum(covered, hi - lo) * 1e-12
        window_row = np.bincount(r, weights=window, minlength=len(out))
        hidden_row = np.bincount(r, weights=hidden, minlength=len(out))
        exposed_row = window_row - hidden_row
    for c, v in (("comm_window_s", window_row), ("comm_hidden_s", hidden_row), ("comm_exposed_s", exposed_row)):
        out[c] = pd.Series(v, index=out.index, copy=False)  # new arrays: no copy (setting an array copies it)
    return out


def arrival_skew(ops: pd.DataFrame, timeline: Timeline) -> pd.DataFrame:
    """One row per execution of a collective seen on several devices: ``program_id``, ``hlo_op``, ``step``,
    ``occurrence``, ``devices``, ``skew_s`` (latest − earliest start), ``last_device`` (arrived last),
    ``wait_s`` (Σ over devices of latest start − own start). Reads the events of collective rows in steps.
    Rows sorted by program id (missing: -1), op name, step and occurrence (the n-th execution of the op in the
    step on a device, in order of start)."""
    cols = ["program_id", "hlo_op", "step", "occurrence", "devices", "skew_s", "last_device", "wait_s"]
    pick = collective_rows(ops)
    if pick.any():
        pick = pick & ops["step"].notna().to_numpy(bool)
    if not pick.any():
        return pd.DataFrame(columns=cols)
    rows = np.flatnonzero(pick)
    row_dev, dev_names = _text_codes(ops["device"], rows)
    named = row_dev[ops["device"].notna().to_numpy(bool)[rows]]  # devices (NA not one)
    if not len(named) or (named == named[0]).all():  # fewer than two
        return pd.DataFrame(columns=cols)
    ev = np.flatnonzero(pick[timeline.row]) if len(timeline) else np.zeros(0, np.int64)
    ev = ev[np.argsort(timeline.start_ps[ev], kind="stable")]  # by start; ties in event order
    at = np.full(len(ops), -1, np.int64)
    at[rows] = np.arange(len(rows))
    r = at[timeline.row[ev]]  # position of each event's row among ``rows``
    start = timeline.start_ps[ev].astype(np.int64)
    dev = row_dev[r]
    pid = ops["program_id"].to_numpy(dtype="float64", na_value=-1)[rows][r]
    row_op, op_names = _text_codes(ops["hlo_op"], rows)
    op = row_op[r]
    step = ops["step"].to_numpy(dtype="int64", na_value=0)[rows][r]
    # occurrence: the events before this one of its (device, program, op, step)
    same = group_codes([dev, pid, op, step])
    by_same = np.argsort(same, kind="stable")
    bounds = np.flatnonzero(np.diff(same[by_same], prepend=-1))
    occurrence = np.empty(len(same), np.int64)
    occurrence[by_same] = np.arange(len(same)) - np.repeat(bounds, np.diff(np.append(bounds, len(same))))
    # executions: (program, op, step, occurrence), sorted; events of one keep their order (by start)
    order = np.lexsort((occurrence, step, op, pid))
    pid, op, step, occurrence, dev, start = (x[order] for x in (pid, op, step, occurrence, dev, start))
    new = np.append(True, (pid[1:] != pid[:-1]) | (op[1:] != op[:-1]) | (step[1:] != step[:-1])
                    | (occurrence[1:] != occurrence[:-1])) if len(order) else np.zeros(0, bool)
    first = np.flatnonzero(new)
    execution = np.cumsum(new) - 1
    latest = np.maximum.reduceat(start, first) if len(first) else np.zeros(0, np.int64)
    earliest = np.minimum.reduceat(start, first) if len(first) else np.zeros(0, np.int64)
    wait = np.add.reduceat(latest[execution] - start, first) if len(first) else np.zeros(0, np.int64)
    is_latest = np.flatnonzero(start == latest[execution])
    last = is_latest[np.flatnonzero(np.diff(execution[is_latest], prepend=-1))]  # each execution's first latest
    devices = np.bincount(execution[first_rows(group_codes([execution, dev]))], minlength=len(first))
    keep = np.flatnonzero(devices > 1)
    f = first[keep]
    return pd.DataFrame({
        "program_id": pd.array(pid[f].astype(np.int64), "Int64"), "hlo_op": op_names[op[f]],
        "step": pd.array(step[f], "Int64"), "occurrence": occurrence[f], "devices": devices[keep].astype(np.int64),
        "skew_s": (latest - earliest)[keep] * 1e-12, "last_device": dev_names[dev[last[keep]]],
        "wait_s": wait[keep] * 1e-12})
