"""Level 1 of the op table: one host's op events (one per execution, millions) aggregated at once into op rows
(one per host, device, program, HLO op, kernel and step), and the :class:`Timeline` of those events. Each host is
aggregated where it is read (:func:`traceroof.host.read_host`, in a worker process or on a Dask worker), so only
the rows and the slim timeline travel; :mod:`traceroof.optable` joins the rows of every host to their HLO."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from traceroof.codes import first_rows, group_codes, run_starts

# what makes an op row: events sharing these are executions of one op in one step on one device
ROW_KEY = ("host", "device", "program_id", "module", "hlo_op", "kernel", "attributed", "step", "framework_scope")
TPU_COST_COLUMNS = ("profile_flops", "profile_model_flops", "profile_bytes_accessed")


@dataclass(frozen=True, eq=False)
class Timeline:
    """Level 1: one entry per op event, in the profile's event order. ``row``: index of the event's op row
    (int64); ``start_ps``, ``duration_ps``: int64 picoseconds on the profile's clock; ``run_id`` and ``launch_ps``
    (float64, NaN where unknown; ``None`` when the profile has none): the execution an event belongs to and when
    the host launched it, for the step breakdown (:mod:`traceroof.breakdown`). float64 holds both exactly up to
    2^53: run ids count a process's executions, and 2^53 ps is 2.5 hours after the profile's start (later
    launches round to a few ps, far below any gap the breakdown measures)."""

    row: np.ndarray
    start_ps: np.ndarray
    duration_ps: np.ndarray
    run_id: np.ndarray | None = None
    launch_ps: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.row)

    @staticmethod
    def concat(parts: Sequence[Timeline], row_offsets: Sequence[int], time_offsets_ps: Sequence[int]) -> Timeline:
        """The events of ``parts`` one after another, each part's rows numbered from its ``row_offsets`` entry
        (its place in the merged op table) and its starts and launches moved by its ``time_offsets_ps`` entry (its
        host's clock offset). Each column is written once into one new array (no shifted copy per part)."""
        if not parts:
            empty = np.zeros(0, np.int64)
            return Timeline(empty, empty, empty)
        if len(parts) == 1 and not row_offsets[0] and not time_offsets_ps[0]:
            return parts[0]
        n = sum(len(t) for t in parts)
        bounds = np.cumsum([0] + [len(t) for t in parts])

        def join(name: str, offsets: Sequence[int] | None, dtype: type) -> np.ndarray | None:
            arrays = [getattr(t, name) for t in parts]
            if all(a is None for a in arrays):
                return None
            out = np.empty(n, dtype)
            for i, a in enumerate(arrays):
                at = out[bounds[i]:bounds[i + 1]]
                if a is None:
                    at.fill(np.nan)
                elif offsets is not None and offsets[i]:
                    np.add(a, offsets[i], out=at)
                else:
                    at[:] = a
            return out
        return Timeline(join("row", row_offsets, np.int64), join("start_ps", time_offsets_ps, np.int64),
                        join("duration_ps", None, np.int64), join("run_id", None, np.float64),
                        join("launch_ps", time_offsets_ps, np.float64))


def aggregate_events(events: pd.DataFrame) -> tuple[pd.DataFrame, Timeline]:
    """Op events -> op rows (:data:`ROW_KEY` columns present in ``events``, first-seen order) with ``events``
    (count), ``duration_ps`` (sum), ``start_ps`` (first start) and, for TPU profiles, the sums of libtpu's per-op
    costs (NaN for a row where some event lacks them); and the :class:`Timeline` of the events (with ``run_id``
    and ``launch_ps`` where ``events`` has them). A profile's hosts are aggregated one by one (the host is part of
    the row key), in the per-host workers (:func:`traceroof.host.read_host`)."""
    keys = [c for c in ROW_KEY if c in events]
    key_columns = [events[c] for c in keys]
    row = group_codes(key_columns) if keys else np.zeros(len(events), np.int64)
    n_rows = int(row.max()) + 1 if len(row) else 0
    every = n_rows == len(row)  # every event a row of its own (the ids count up in event order: row i is event i)
    first = None if every else first_rows(row)
    start = events["start_ps"].to_numpy(np.int64)
    duration = events["duration_ps"].to_numpy(np.int64)
    cols: dict[str, object] = {c: col.array.copy() if every else col.array.take(first)
                               for c, col in zip(keys, key_columns)}
    if every:
        cols["events"] = np.ones(n_rows, np.int64)
        cols["duration_ps"], cols["start_ps"] = duration.copy(), start.copy()
    else:  # integer sums and minima in any order: no sort of the events
        cols["events"] = np.bincount(row, minlength=n_rows).astype(np.int64)
        cols["duration_ps"], cols["start_ps"] = np.zeros(n_rows, np.int64), start[first]
        np.add.at(cols["duration_ps"], row, duration)
        np.minimum.at(cols["start_ps"], row, start)
    costs = [c for c in TPU_COST_COLUMNS if c in events]
    if costs:  # float sums as reduceat adds each row's events, in event order
        order = np.argsort(row, kind="stable")
        bounds = run_starts(row[order])
        for c in costs:
            v = events[c].to_numpy(np.float64)
            cols[c] = np.add.reduceat(v[order], bounds) if n_rows else np.zeros(0)  # NaN if any event lacks it
    rows = pd.DataFrame(cols, copy=False)
    extra = [events[c].to_numpy(dtype="float64", na_value=np.nan) if c in events else None
             for c in ("run_id", "launch_ps")]
    return rows, Timeline(row, start, duration, *extra)
