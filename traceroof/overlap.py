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

from traceroof.hostactivity import covered_ps, merge_intervals
from traceroof.optable import Timeline


def _collective_rows(ops: pd.DataFrame) -> np.ndarray:
    """Whether each op row's ``category`` is ``collective`` (tested once per category of a categorical column)."""
    col = ops["category"]
    if isinstance(col.dtype, pd.CategoricalDtype):
        return np.append(np.asarray(col.array.categories.astype(str), dtype=object) == "collective",
                         False)[col.array.codes]  # code -1 (missing): the False appended
    return (col.astype(str) == "collective").to_numpy(bool)


def _event_frame(ops: pd.DataFrame, timeline: Timeline, rows: np.ndarray) -> pd.DataFrame:
    """The events of op rows ``rows`` (a boolean mask over ``ops``), with their rows' ``device``,
    ``program_id``, ``hlo_op``, ``step``, ``counted``, ``category`` and the event's ``start_ps`` /
    ``duration_ps``; ``row`` is the op row."""
    pick = np.flatnonzero(rows[timeline.row]) if len(timeline) else np.zeros(0, np.int64)
    r = timeline.row[pick]
    cols = {c: ops[c].to_numpy()[r] if not isinstance(ops[c].dtype, pd.CategoricalDtype)
            else pd.Categorical.from_codes(ops[c].cat.codes.to_numpy()[r], categories=ops[c].cat.categories)
            for c in ("device", "hlo_op", "category", "counted")}
    return pd.DataFrame({"row": r, **cols, "program_id": ops["program_id"].array[r], "step": ops["step"].array[r],
                         "start_ps": timeline.start_ps[pick], "duration_ps": timeline.duration_ps[pick]})


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
        devices = out["device"].astype(str).to_numpy()
        ev = _event_frame(out, timeline, np.isin(devices, np.unique(devices[is_coll_row])))
        window = np.zeros(len(ev))
        hidden = np.zeros(len(ev))
        is_coll = is_coll_row[ev["row"].to_numpy()]
        start = ev["start_ps"].to_numpy(np.int64)
        end = start + ev["duration_ps"].to_numpy(np.int64)
        op = ev["hlo_op"].astype(str).to_numpy()
        pid = ev["program_id"].to_numpy(dtype="float64", na_value=-1)
        counted = ev["counted"].to_numpy(bool)
        starts_of_pairs = {(p, s) for (p, _), s in pairs.items()}
        for _, idx in ev.groupby("device", observed=True, sort=False).indices.items():
            idx = np.asarray(idx)
            coll = idx[is_coll[idx]]
            if len(coll) == 0:
                continue
            other = idx[~is_coll[idx] & counted[idx]]
            lo, hi = start[coll].copy(), end[coll].copy()
            keep = np.ones(len(coll), bool)
            last_start: dict[tuple[int | None, str], int] = {}
            for j in np.argsort(start[coll], kind="stable"):
                r = coll[j]
                key = (int(pid[r]) if pid[r] >= 0 else None, op[r])
                if key in starts_of_pairs:
                    last_start[key] = r
                    keep[j] = False  # a start event: its window is accounted on its done event
                elif key in pairs:
                    s = last_start.get((key[0], pairs[key]))
                    if s is not None:
                        lo[j] = start[s]
            covered = covered_ps(merge_intervals(start[other], end[other]), lo, hi)
            window[coll[keep]] = (hi - lo)[keep] * 1e-12
            hidden[coll[keep]] = np.minimum(covered, hi - lo)[keep] * 1e-12
        window_row = np.bincount(ev["row"].to_numpy(), weights=window, minlength=len(out))
        hidden_row = np.bincount(ev["row"].to_numpy(), weights=hidden, minlength=len(out))
    out["comm_window_s"] = window_row
    out["comm_hidden_s"] = hidden_row
    out["comm_exposed_s"] = window_row - hidden_row
    return out


def arrival_skew(ops: pd.DataFrame, timeline: Timeline) -> pd.DataFrame:
    """One row per execution of a collective seen on several devices: ``program_id``, ``hlo_op``, ``step``,
    ``occurrence``, ``devices``, ``skew_s`` (latest − earliest start), ``last_device`` (arrived last),
    ``wait_s`` (Σ over devices of latest start − own start). Reads the events of collective rows in steps."""
    cols = ["program_id", "hlo_op", "step", "occurrence", "devices", "skew_s", "last_device", "wait_s"]
    pick = _collective_rows(ops)
    if pick.any():
        pick = pick & ops["step"].notna().to_numpy(bool)
    if not pick.any() or ops.loc[pick, "device"].nunique() < 2:
        return pd.DataFrame(columns=cols)
    c = _event_frame(ops, timeline, pick)
    c = c.sort_values("start_ps", kind="stable").assign(
        program_id=c["program_id"].fillna(-1), hlo_op=c["hlo_op"].astype(str), device=c["device"].astype(str))
    c["occurrence"] = c.groupby(["device", "program_id", "hlo_op", "step"], observed=True).cumcount()
    g = c.groupby(["program_id", "hlo_op", "step", "occurrence"], observed=True)
    latest = g["start_ps"].transform("max")
    c["wait_ps"] = latest - c["start_ps"]
    idx_last = g["start_ps"].idxmax()
    res = pd.DataFrame({
        "devices": g["device"].nunique(),
        "skew_s": (g["start_ps"].max() - g["start_ps"].min()) * 1e-12,
        "last_device": c.loc[idx_last.values, "device"].to_numpy(),
        "wait_s": g["wait_ps"].sum() * 1e-12,
    }).reset_index()
    res = res[res["devices"] > 1]
    return res[cols].reset_index(drop=True)
