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


def _covered(starts: np.ndarray, ends: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Length of [lo, hi) covered by the union of intervals [starts, ends) (any order, may overlap)."""
    if len(starts) == 0:
        return np.zeros(len(lo))
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    # merge overlapping intervals
    run_end = np.maximum.accumulate(e)
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > run_end[:-1]
    grp = np.cumsum(new) - 1
    ms = s[new]
    me = np.zeros(len(ms), dtype=run_end.dtype)
    np.maximum.at(me, grp, e)
    cum = np.concatenate([[0], np.cumsum(me - ms)])

    def covered_before(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(ms, t, side="right")  # merged intervals starting at or before t
        full = cum[np.maximum(i - 1, 0)]
        last = np.where(i > 0, np.clip(t - ms[np.maximum(i - 1, 0)], 0, me[np.maximum(i - 1, 0)] -
                                       ms[np.maximum(i - 1, 0)]), 0)
        return np.where(i > 0, full + last, 0)

    return np.maximum(covered_before(hi) - covered_before(lo), 0)


def exposed_communication(ops: pd.DataFrame, pairs: dict[tuple[object, str], str]) -> pd.DataFrame:
    """Add ``comm_window_s``, ``comm_hidden_s`` and ``comm_exposed_s`` to the collective rows of an op table
    (0 elsewhere). ``pairs`` maps (program id, ``-done`` op) to its ``-start`` op; a done row gets the window
    from the latest preceding start of its pair on the same device, and the start row gets nothing.

    Needs ``device``, ``program_id``, ``hlo_op``, ``start_ps``, ``duration_ps``, ``category``, ``counted``.
    """
    out = ops.copy()
    window = np.zeros(len(out))
    hidden = np.zeros(len(out))
    is_coll = (out["category"].astype(str) == "collective").to_numpy()
    start = out["start_ps"].to_numpy(np.int64)
    end = start + out["duration_ps"].to_numpy(np.int64)
    op = out["hlo_op"].astype(str).to_numpy()
    pid = out["program_id"].to_numpy(dtype="float64", na_value=-1)
    counted = out["counted"].to_numpy(bool)
    starts_of_pairs = {(p, s) for (p, _), s in pairs.items()}
    for _, idx in out.groupby("device", observed=True, sort=False).indices.items():
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
                keep[j] = False  # a start row: its window is accounted on its done row
            elif key in pairs:
                s = last_start.get((key[0], pairs[key]))
                if s is not None:
                    lo[j] = start[s]
        covered = _covered(start[other], end[other], lo, hi)
        window[coll[keep]] = (hi - lo)[keep] * 1e-12
        hidden[coll[keep]] = np.minimum(covered, hi - lo)[keep] * 1e-12
    out["comm_window_s"] = window
    out["comm_hidden_s"] = hidden
    out["comm_exposed_s"] = window - hidden
    return out


def arrival_skew(ops: pd.DataFrame) -> pd.DataFrame:
    """One row per execution of a collective seen on several devices: ``program_id``, ``hlo_op``, ``step``,
    ``occurrence``, ``devices``, ``skew_s`` (latest − earliest start), ``last_device`` (arrived last),
    ``wait_s`` (Σ over devices of latest start − own start)."""
    c = ops[(ops["category"].astype(str) == "collective") & ops["step"].notna()]
    cols = ["program_id", "hlo_op", "step", "occurrence", "devices", "skew_s", "last_device", "wait_s"]
    if c.empty or c["device"].nunique() < 2:
        return pd.DataFrame(columns=cols)
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
