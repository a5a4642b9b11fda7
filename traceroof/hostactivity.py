"""When the host threads were busy, from the host plane of an ``.xplane.pb`` (:func:`host_activity`): the Python
thread that launches programs (``python``, and ``dispatch`` for its PjRt/PjitFunction launch events), the PjRt
client threads (``dispatch``), the compiler threads (``compile``) and input-pipeline threads (``input``).

Read by :mod:`traceroof.breakdown` to tell device idle time spent waiting for the host (host-bound) from idle
time the host did not cause. Intervals are merged per kind, so the table stays small (hundreds of rows per host
even with the Python tracer on). XLA:CPU op events (``hlo_op``) and the thunk executor's scaffolding are device
work, not host work, and are left out; so are events where the host waits for the device (``Await``,
``BlockHostUntilReady``): a host that waits is not what holds the device back.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np
import pandas as pd

from traceroof.codes import run_codes

HOST_KINDS = ("python", "dispatch", "compile", "input")
PYTHON = HOST_KINDS.index("python")
OP_WORKER_LINE = re.compile(r"^tf_XLAEigen|^XLA Ops$|^Stream")  # device work on XLA:CPU pools / device lines
COMPILE_LINE = re.compile(r"compil|codegen", re.IGNORECASE)
INPUT_LINE = re.compile(r"tf_data|tf\.data|grain|dataloader|input|prefetch", re.IGNORECASE)
PJRT_LINE = re.compile(r"pjrt.*client", re.IGNORECASE)
PYTHON_LINE = re.compile(r"^python|^MainThread$", re.IGNORECASE)
# launch-side events on the launching thread (jax 0.4.3x-0.10 names)
DISPATCH_EVENT = re.compile(r"PjitFunction\(|(?:\w+::)*\w*PjRt\w*(?:Executable|Client|Buffer)::|ExecutePrepare|"
                            r"Handle inputs|Handle input event|AllocateOutputBuffers|ParseArguments|shard_args|"
                            r"batched_copy_array|ExecuteReplicated")
SCAFFOLD_EVENT = re.compile(r"end: |ThunkExecutor|ThreadpoolListener")
WAIT_EVENT = re.compile(r".*(?:Await|BlockHostUntilReady|block_until_ready|WaitUntilReady)", re.IGNORECASE)
COLUMNS = ("host", "kind", "start_ps", "end_ps")


def empty_activity() -> pd.DataFrame:
    """A host-activity table with no rows."""
    return pd.DataFrame({"host": pd.Series([], dtype=object), "kind": pd.Series([], dtype=object),
                         "start_ps": np.zeros(0, np.int64), "end_ps": np.zeros(0, np.int64)})


def merge_intervals(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [start, end) as sorted, disjoint (start, end) int64 arrays (intervals that touch
    merged; empty and reversed ones cover nothing)."""
    start, end = np.asarray(start, np.int64), np.asarray(end, np.int64)
    if not len(start):
        return start, end
    if not (start[1:] >= start[:-1]).all():  # (in order already: one stream's events, merged sets)
        order = np.argsort(start, kind="stable")  # op events come in a few sorted runs (threads): timsort merges
        start, end = start[order], end[order]
    run_end = np.maximum.accumulate(end)
    new = start[1:] > run_end[:-1]  # where a run of overlapping intervals starts (after the first)
    # a run ends at the running max at its last interval (the runs before it end earlier); an empty interval only
    # shapes a run of its own, which covers nothing, or one starting where it does: runs kept where not empty
    k = int(np.count_nonzero(new))
    lo, hi = np.empty(k + 1, np.int64), np.empty(k + 1, np.int64)
    lo[0], hi[k] = start[0], run_end[-1]
    np.compress(new, start[1:], out=lo[1:])
    np.compress(new, run_end[:-1], out=hi[:k])
    kept = hi > lo
    return (lo, hi) if kept.all() else (lo[kept], hi[kept])


def _covered_before(s: tuple[np.ndarray, np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """For merged intervals ``s``: a function of times ``t`` (int64 ps) giving the length of (-inf, t) that ``s``
    covers (ps, int64), by binary search over the intervals and their cumulative lengths."""
    ms, me = s
    cum = np.concatenate([[0], np.cumsum(me - ms)])

    def before(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(ms, t, side="right")  # intervals starting at or before t
        j = np.maximum(i - 1, 0)
        part = np.clip(t - ms[j], 0, me[j] - ms[j])
        return np.where(i > 0, cum[j] + part, 0)

    return before


def covered_ps(s: tuple[np.ndarray, np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Length (ps, int64) of [lo, hi) covered by the merged intervals ``s``, per window."""
    if not len(s[0]):
        return np.zeros(len(lo), np.int64)
    before = _covered_before(s)
    return np.maximum(before(np.asarray(hi, np.int64)) - before(np.asarray(lo, np.int64)), 0)


def covered_both_ps(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], lo: np.ndarray,
                    hi: np.ndarray) -> np.ndarray:
    """``covered_ps(intersect_intervals(a, b), lo, hi)`` without building the intersection: per window, the
    length (ps, int64) of [lo, hi) covered by both merged ``a`` and merged ``b``, from ``b``'s covered length
    before each end of ``a``'s intervals and of the windows (binary searches; for ``a`` the smaller set, far less
    than the intersection's intervals when ``b`` is large)."""
    (a0, a1), lo, hi = a, np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    if not len(a0) or not len(b[0]):
        return np.zeros(len(lo), np.int64)
    b_before = _covered_before(b)
    start_b = b_before(a0)  # b's length before each interval of a starts
    cum = np.concatenate([[0], np.cumsum(b_before(a1) - start_b)])  # of a n b, before each interval of a

    def before(t: np.ndarray) -> np.ndarray:  # length of a n b before t: the intervals of a before, then a part
        i = np.searchsorted(a0, t, side="right")
        j = np.maximum(i - 1, 0)
        return np.where(i > 0, cum[j] + b_before(np.minimum(t, a1[j])) - start_b[j], 0)

    return np.maximum(before(hi) - before(lo), 0)


def _overlapping(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per interval of merged ``a``, the first interval of merged ``b`` that overlaps it and how many do (a run):
    two binary searches per interval of ``a``, no sort."""
    first = np.searchsorted(b[1], a[0], side="right")  # the first interval of b ending after it starts
    stop = np.searchsorted(b[0], a[1], side="left")  # past the last one starting before it ends
    return first, np.maximum(stop - first, 0)


def _spread(n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For counts ``n`` per item: each of their ``sum(n)`` slots' item and its rank (0..n-1) within the item."""
    item = np.repeat(np.arange(len(n)), n)
    return item, np.arange(len(item)) - np.repeat(np.cumsum(n) - n, n)


def intersect_intervals(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
                        ) -> tuple[np.ndarray, np.ndarray]:
    """The intersection of merged intervals ``a`` and ``b`` (sorted, disjoint and apart, as :func:`merge_intervals`
    makes them), merged the same way: each interval of the smaller set clipped to the run of intervals of the
    other that it overlaps (binary searches: O(small x log(large) + output), no sort of an interval per op
    event)."""
    if len(a[0]) > len(b[0]):
        a, b = b, a
    first, n = _overlapping(a, b)
    i, k = _spread(n)
    j = first[i] + k
    return np.maximum(a[0][i], b[0][j]), np.minimum(a[1][i], b[1][j])


def subtract_intervals(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Merged intervals ``a`` less merged intervals ``b`` (as :func:`merge_intervals` makes them), merged the same
    way: each interval of ``a`` cut at the run of intervals of ``b`` it overlaps (binary searches, no sort)."""
    (s, e), (bs, be) = a, b
    if not len(bs) or not len(s):
        return s, e
    first, n = _overlapping(a, b)
    i, k = _spread(n + 1)  # n overlapping intervals leave n + 1 pieces (some empty)
    j = first[i] + k
    lo = np.where(k == 0, s[i], be[np.maximum(j - 1, 0)])  # from the start or the end of the interval before
    hi = np.where(k == n[i], e[i], bs[np.minimum(j, len(bs) - 1)])  # to the end or the start of the next one
    keep = hi > lo
    return lo[keep], hi[keep]


def _line_kind(name: str) -> str | None:
    if OP_WORKER_LINE.search(name):
        return None
    if COMPILE_LINE.search(name):
        return "compile"
    if INPUT_LINE.search(name):
        return "input"
    if PJRT_LINE.search(name):
        return "dispatch"
    return "python"  # decided below: only lines that launch programs, mark steps or are named python


def host_activity(xs, host: str) -> pd.DataFrame:
    """Busy intervals of ``host``'s host threads in an :class:`~parsers.xspace.XSpace`: ``host``, ``kind`` (one
    of :data:`HOST_KINDS`), ``start_ps``, ``end_ps`` (the profile's clock, as op events), merged per kind. Empty
    when the file has no ``/host:CPU`` plane. A line counts as the Python thread when it is named ``python*`` /
    ``MainThread``, or holds launch events or step annotations (``step_num``)."""
    cpu = xs.plane("/host:CPU")
    if cpu is None:
        return empty_activity()
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {k: [] for k in HOST_KINDS}
    waits: list[tuple[np.ndarray, np.ndarray]] = []
    kind_of = {name: _line_kind(name) for name in {line.name for line in cpu.lines}}  # (threads share names)
    chosen = [(line, kind) for line in cpu.lines if line.event_count and (kind := kind_of[line.name])]
    if chosen:  # every host-thread line decoded in one pass (one call per line cost seconds on many threads)
        ev = cpu.columns(stats=("hlo_op", "step_num"), lines=[line for line, _ in chosen])
        names = ev["name"]
        cats = [str(c) for c in names.categories]
        codes = np.where(names.codes >= 0, names.codes, len(cats))

        def by_name(pattern: re.Pattern) -> np.ndarray:
            return np.array([pattern.match(c) is not None for c in cats] + [False])[codes]

        line_of, line_ids = run_codes(ev["line_id"])
        kind_of_id = {line.id: HOST_KINDS.index(kind) for line, kind in chosen}
        python_line = {line.id: bool(PYTHON_LINE.search(line.name)) for line, kind in chosen if kind == "python"}
        line_kind = np.array([kind_of_id[int(i)] for i in line_ids], np.int8)
        kinds = line_kind[line_of]  # per event, its line's kind (HOST_KINDS index)
        dispatch = by_name(DISPATCH_EVENT)
        # a "python" line counts only when named so, or holding launches or step annotations; else some other
        # thread (GC, a profiler's own): not evidence of host work on the step
        marks = ~np.asarray(pd.isna(ev["step_num"]), bool)
        evidence = np.bincount(line_of[dispatch | marks], minlength=len(line_ids)) > 0
        drop_line = np.array([k == PYTHON and not python_line[int(i)] and not evidence[j]
                              for j, (i, k) in enumerate(zip(line_ids.tolist(), line_kind.tolist()))], bool)
        keep = ~drop_line[line_of] if drop_line.any() else True
        work = keep & np.asarray(pd.isna(ev["hlo_op"]), bool) & ~by_name(SCAFFOLD_EVENT)
        wait = keep & by_name(WAIT_EVENT)
        start = ev["start_ps"]
        end = start + ev["duration_ps"]
        waits.append(merge_intervals(start[wait], end[wait]))
        work &= ~wait
        on_python = kinds == PYTHON
        parts["dispatch"].append((start[work & dispatch & on_python], end[work & dispatch & on_python]))
        work &= ~(dispatch & on_python)
        for k, kind in enumerate(HOST_KINDS):
            sel = work & (kinds == k)
            if sel.any():
                parts[kind].append((start[sel], end[sel]))
    wait_all = merge_intervals(*(np.concatenate(x) for x in zip(*waits))) if waits else None
    kinds, starts, ends = [], [], []
    for kind, chunks in parts.items():
        if not chunks:
            continue
        merged = merge_intervals(np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks]))
        if wait_all is not None and len(wait_all[0]):
            merged = subtract_intervals(merged, wait_all)
        kinds += [kind] * len(merged[0])
        starts.append(merged[0])
        ends.append(merged[1])
    if not kinds:
        return empty_activity()
    return pd.DataFrame({"host": host, "kind": kinds, "start_ps": np.concatenate(starts),
                         "end_ps": np.concatenate(ends)})


def shifted_activity(parts: list[tuple[pd.DataFrame | None, int]]) -> pd.DataFrame:
    """The hosts' activity tables, each shifted by its offset (ps) onto the profile's one clock, as one table."""
    frames = [a.assign(start_ps=a["start_ps"] + off, end_ps=a["end_ps"] + off) if off else a for a, off in parts
              if a is not None and len(a)]
    if len(frames) == 1:
        return frames[0].reset_index(drop=True)
    return pd.concat(frames, ignore_index=True) if frames else empty_activity()
