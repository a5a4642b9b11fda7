"""Which HLO module each op event (or op row) ran: by program id and name, or by a unique name without ids; and
how much of the profile joined (:class:`JoinReport`). Never by op name alone across modules
(``docs/reference/xplane-format.md`` §7)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from parsers.hlo import HloModule
from traceroof.codes import run_starts


@dataclass(frozen=True)
class JoinReport:
    """How much of the profile joined to HLO: events and time, and why the rest did not."""

    events_total: int
    events_joined: int
    time_total_ps: int
    time_joined_ps: int
    unmatched_modules: tuple[str, ...]
    unmatched_ops: int
    ambiguous_modules: tuple[str, ...]
    matched_sources: tuple[str, ...] = ()  # files (HloModule.source) of the modules events joined to


def match_modules(events: pd.DataFrame, modules: Sequence[HloModule], weights: np.ndarray | None = None
                  ) -> tuple[np.ndarray, JoinReport]:
    """Index into ``modules`` for every event or op row (-1 when no module matches) and a partial
    :class:`JoinReport` (``weights``: events per row, for op rows; 1 each by default).

    An event's module is the one with its program id and name; without a program id, the only module of that
    name (several modules sharing a name and no id to tell them apart: ambiguous, not joined).
    """
    by_id: dict[tuple[int, str], int] = {}  # (program id, name): an unrelated dump may reuse a profiled id
    for i, m in enumerate(modules):
        if m.program_id is not None:
            by_id.setdefault((m.program_id, m.name), i)
    ids = {m.program_id for m in modules if m.program_id is not None}
    by_name: dict[str, list[int]] = {}
    for i, m in enumerate(modules):
        by_name.setdefault(m.name, []).append(i)
    names = events["module"].astype("category")
    mcodes = names.cat.codes.to_numpy()
    pid = events["program_id"].to_numpy(dtype="int64", na_value=-1)  # ids are checked: NA or in [0, 2^63)
    # rows come in runs of one (module, program id): each pair is first seen at the start of a run, so the pairs
    # of the runs' first rows, in order, are those of every row (a few runs, not millions of rows, hashed)
    n = len(events)
    starts = run_starts(mcodes, pid)
    pcodes, pids = pd.factorize(pid[starts])
    width = max(len(pids), 1)
    codes, uniques = pd.factorize(mcodes[starts].astype(np.int64) * width + pcodes)  # (module, program id) pairs
    cats = list(names.cat.categories)
    chosen = np.full(len(uniques), -1, np.int64)
    unmatched, ambiguous = set(), set()
    for u, key in enumerate(uniques):
        mi, pi = divmod(int(key), width)
        name = cats[mi] if 0 <= mi < len(cats) else ""
        p = int(pids[pi])
        idx = -1
        if p >= 0 and p in ids:
            idx = by_id.get((p, name), -1)
        elif len(by_name.get(name, [])) == 1 and (p < 0 or modules[by_name[name][0]].program_id is None):
            idx = by_name[name][0]
        elif len(by_name.get(name, [])) > 1:
            ambiguous.add(name)
        if idx < 0 and name and name not in ambiguous:
            unmatched.add(f"{name}({p})" if p >= 0 else name)
        chosen[u] = idx
    n_events = int(weights.sum()) if weights is not None else len(events)
    report = JoinReport(n_events, 0, int(events["duration_ps"].sum()), 0, tuple(sorted(unmatched)), 0,
                        tuple(sorted(ambiguous)), tuple(sorted({modules[i].source for i in chosen if i >= 0})))
    return np.repeat(chosen[codes], np.diff(np.append(starts, n))), report
