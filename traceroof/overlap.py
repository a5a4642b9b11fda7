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

from traceroof.codes import as_text, category_text, first_rows, group_codes
from traceroof.hostactivity import covered_ps, merge_intervals
from traceroof.aggregate import Timeline


def _collective_rows(ops: pd.DataFrame) -> np.ndarray:
    """Whether each op row's ``category`` is ``collective`` (tested once per category of a categorical column)."""
    col = ops["category"]
    if isinstance(col.dtype, pd.CategoricalDtype):
        return np.append(category_text(col.array) == "collective",
                         False)[col.array.codes]  # code -1 (missing): the False appended
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
    is_coll_row = _collective_rows(out)
    window_row = np.zeros(len(out))
    hidden_row = np.zeros(len(out))
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
        row_op, op_names = _text_codes(out["hlo_op"], rows)
        op = op_names[row_op[r]]
        pid = out["program_id"].to_numpy(dtype="float64", na_value=-1)[r]
        counted = out["counted"].to_numpy(bool)[r]
        starts_of_pairs = {(p, s) for (p, _), s in pairs.items()}
        dev = row_dev[r]
        by_dev = np.argsort(dev, kind="stable")
        bounds = np.flatnonzero(np.diff(dev[by_dev], prepend=-1)).tolist() + [len(ev)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            idx = by_dev[a:b]
            coll = idx[is_coll[idx]]
            if len(coll) == 0:
                continue
            other = idx[~is_coll[idx] & counted[idx]]
            lo, hi = start[coll].copy(), end[coll].copy()
            keep = np.ones(len(coll), bool)
            last_start: dict[tuple[int | None, str], int] = {}
            for j in np.argsort(start[coll], kind="stable"):
                e = coll[j]
                key = (int(pid[e]) if pid[e] >= 0 else None, op[e])
                if key in starts_of_pairs:
                    last_start[key] = e
                    keep[j] = False  # a start event: its window is accounted on its done event
                elif key in pairs:
                    s = last_start.get((key[0], pairs[key]))
                    if s is not None:
                        lo[j] = start[s]
            covered = covered_ps(merge_intervals(start[other], end[other]), lo, hi)
            window[coll[keep]] = (hi - lo)[keep] * 1e-12
            hidden[coll[keep]] = np.minimum(covered, hi - lo)[keep] * 1e-12
        window_row = np.bincount(r, weights=window, minlength=len(out))
        hidden_row = np.bincount(r, weights=hidden, minlength=len(out))
    out["comm_window_s"] = window_row
    out["comm_hidden_s"] = hidden_row
    out["comm_exposed_s"] = window_row - hidden_row
    return out


def arrival_skew(ops: pd.DataFrame, timeline: Timeline) -> pd.DataFrame:
    """One row per execution of a collective seen on several devices: ``program_id``, ``hlo_op``, ``step``,
    ``occurrence``, ``devices``, ``skew_s`` (latest − earliest start), ``last_device`` (arrived last),
    ``wait_s`` (Σ over devices of latest start − own start). Reads the events of collective rows in steps.
    Rows sorted by program id (missing: -1), op name, step and occurrence (the n-th execution of the op in the
    step on a device, in order of start)."""
    cols = ["program_id", "hlo_op", "step", "occurrence", "devices", "skew_s", "last_device", "wait_s"]
    pick = _collective_rows(ops)
    if pick.any():
        pick = pick & ops["step"].notna().to_numpy(bool)
    if not pick.any():
        return pd.DataFrame(columns=cols)
    rows = np.flatnonzero(pick)
    row_dev, dev_names = _text_codes(ops["device"], rows)
    if len(np.unique(row_dev[ops["device"].notna().to_numpy(bool)[rows]])) < 2:  # devices (NA not one)
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
