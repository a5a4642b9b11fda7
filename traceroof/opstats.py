"""Per-op figures over op rows: the spread of single executions (:func:`execution_stats`, from the events), the
ops losing most time (:func:`top_ops`), and per-identity figures for ``traceroof diff`` (:func:`op_stats`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from traceroof.codes import (as_text, category_text, first_rows, group_codes, group_codes_at, group_order, group_sum,
                             positions)
from traceroof.aggregate import Timeline

OUTLIER_RATIO = 10.0  # an execution slower than this x its op's median is an outlier (noise, contention, first run)
OUTLIER_MIN_EXECUTIONS = 3  # ops with fewer executions than this have no median to judge outliers by
OP_ID = ["module", "program_id", "hlo_op"]
STATS_COLUMNS = ["median_s", "p90_s", "spread", "max_s", "samples", "outlier_executions"]


def _grouped_quantiles(op: np.ndarray, t: np.ndarray, w: np.ndarray, n_ops: int, qs: Sequence[float]
                       ) -> tuple[dict[float, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Per op code (0..n_ops-1): the weighted quantiles ``qs`` of samples ``t`` (weights ``w``), the smallest
    sample whose cumulative weight reaches ``q`` of the op's total (numpy's ``inverted_cdf``; for unit weights
    an actual execution time, the lower middle one for an even count); the max; the total weight; and the
    unweighted median of the samples (the mean of the two middle ones for an even count, as pandas'
    ``median``). No samples: NaN everywhere, totals 0."""
    if not len(op):
        return {q: np.full(n_ops, np.nan) for q in qs}, np.full(n_ops, np.nan), np.zeros(n_ops), np.full(n_ops, np.nan)
    # by op, then time; equal times may come in any order: they give the same quantiles, max and median
    order = np.argsort(t)
    order = order[np.argsort(op[order].astype(np.min_scalar_type(n_ops)), kind="stable")]  # radix: small ints
    op, t, w = op[order], t[order], w[order]
    total = np.bincount(op, weights=w, minlength=n_ops)
    cum = np.cumsum(w)
    first = np.flatnonzero(np.diff(op, prepend=-1))  # group starts
    base = np.repeat(cum[first] - w[first], np.diff(np.append(first, len(op))))
    within = cum - base
    out = {}
    for q in qs:
        reached = within >= q * total[op] - 1e-9 * total[op]
        idx = np.flatnonzero(reached)
        at = idx[np.flatnonzero(np.diff(op[idx], prepend=-1))]  # each op's first sample reaching q
        v = np.full(n_ops, np.nan)
        v[op[at]] = t[at]
        out[q] = v
    last = np.append(first[1:], len(op)) - 1
    mx = np.full(n_ops, np.nan)
    mx[op[last]] = t[last]
    size = last - first + 1
    mid = np.full(n_ops, np.nan)
    mid[op[first]] = (t[first + (size - 1) // 2] + t[first + size // 2]) / 2
    return out, mx, total, mid


def _event_quantiles(op: np.ndarray, duration_ps: np.ndarray, n_ops: int, qs: Sequence[float]
                     ) -> tuple[dict[float, np.ndarray], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_grouped_quantiles` of one unit-weight sample per event (op codes ``op``, times ``duration_ps`` x
    1e-12 s; an event of code ``n_ops`` is no sample), plus each op's executions slower than ``OUTLIER_RATIO`` x
    its median (``qs`` holds 0.5). The samples grouped by op (a radix sort of the small op codes), then each op's
    few order statistics that the figures read placed by ``np.partition``: no sort of all events. A time is
    monotone in its duration, so positions among durations are positions among times."""
    order, bounds = group_order(op, n_ops + 1)
    if len(duration_ps) and 0 <= duration_ps.min() and duration_ps.max() < 1 << 32:  # gathered in half the bytes
        duration_ps = duration_ps.astype(np.uint32)
    dur = duration_ps[order[:bounds[n_ops]]]  # the samples, by op
    first, size = bounds[:-2], np.diff(bounds[:-1])
    g = np.flatnonzero(size)  # ops with samples; the others get NaN, and no outliers
    total = size.astype(np.float64)
    # the first sample whose count reaches q of the op's (the tolerance as _grouped_quantiles')
    at_q = {q: np.maximum(np.ceil(q * total - 1e-9 * total), 1).astype(np.int64) - 1 for q in qs}
    ranks = [*at_q.values(), (size - 1) // 2, size // 2, size - 1]  # and the middle ones, the last
    for o in g.tolist():
        dur[first[o]:first[o] + size[o]].partition(sorted({int(k[o]) for k in ranks}))

    def time_at(rank: np.ndarray) -> np.ndarray:  # the time of each op's sample of this rank
        v = np.full(n_ops, np.nan)
        v[g] = dur[first[g] + rank[g]].astype(np.float64) * 1e-12
        return v

    out = {q: time_at(k) for q, k in at_q.items()}
    mx = time_at(size - 1)
    mid = (time_at((size - 1) // 2) + time_at(size // 2)) / 2
    # outliers: the durations from each op's least d with d * 1e-12 > the limit (float rounding: nudged to it)
    limit = OUTLIER_RATIO * out[0.5][g]
    d = np.clip(np.floor(limit * 1e12), -(1 << 62), 1 << 62).astype(np.int64)
    while (down := (d - 1) * 1e-12 > limit).any():
        d -= down
    while (up := ~(d * 1e-12 > limit)).any():
        d += up
    far = np.zeros(n_ops)
    for o, least in zip(g.tolist(), d.tolist()):  # (numpy compares with a Python int out of the dtype's range)
        far[o] = np.count_nonzero(dur[first[o]:first[o] + size[o]] >= least)
    return out, mx, total, mid, far


def _op_codes(counted: pd.DataFrame, at: np.ndarray | None
              ) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]:
    """The op (``OP_ID``) of every row of ``counted``: per row its op code (0..n-1 in order of first appearance
    among the rows at the positions ``at``, default all rows, as :func:`~traceroof.codes.group_codes` numbers
    them; n for a row not at ``at``; in the smallest unsigned type that holds n), n, and per op its module, program
    id (missing: -1) and HLO op as ``astype(str)`` writes them (a missing name: ``nan``), by
    :func:`~traceroof.codes.group_codes_at`."""
    module, hlo_op = _categorical(counted["module"]), _categorical(counted["hlo_op"])
    pid = counted["program_id"].to_numpy(dtype="int64", na_value=-1)
    row_op, first = group_codes_at([module, pid, hlo_op], at, small=True)
    n_ops = len(first)
    mod_names = np.append(category_text(module), "nan")  # code -1: NA
    hlo_names = np.append(category_text(hlo_op), "nan")
    return row_op, n_ops, mod_names[module.codes[first]], pid[first], hlo_names[hlo_op.codes[first]]


def execution_stats(counted: pd.DataFrame, timeline: Timeline | None = None, at: np.ndarray | None = None
                    ) -> pd.DataFrame:
    """Robust per-execution statistics of every op (index ``OP_ID``, sorted): ``median_s`` and ``p90_s``
    (measured time of one execution), ``spread`` = p90 ÷ median (1 = every execution alike; how far the slow
    tail reaches), ``max_s``, ``samples``, ``midpoint_median_s`` (the mean of the two middle samples, as pandas'
    ``median``) and ``outlier_executions``: executions slower than ``OUTLIER_RATIO`` x the op's median (counted
    only for ops with at least ``OUTLIER_MIN_EXECUTIONS`` executions, so the median is a fair typical value), e.g.
    one 16 ms run among 90 µs runs: noise, contention or first-run effects.

    One sample per execution where an event is one execution (CPU, TPU: read from the ``timeline`` of the rows'
    events; without a timeline, as for an XProf export, one sample per row, its mean, weighted by its
    executions). Ops whose executions launch several kernels (GPU, ``kernels_per_execution`` > 1) are sampled
    per device and step: the step's time of the op ÷ its executions, weighted by those executions (kernels of
    one execution cannot be told apart in the trace).

    ``at``: positions of the rows of ``counted`` to read, increasing (``execution_stats(counted.take(at))``
    without selecting the wide table); default all.
    """
    if counted.empty or (at is not None and not len(at)):
        return pd.DataFrame(columns=STATS_COLUMNS, index=pd.MultiIndex.from_tuples([], names=OP_ID))
    row_op, n_ops, mod_t, pid_t, op_t = _op_codes(counted, at)  # ops in order of first appearance
    rows = np.arange(len(counted)) if at is None else at
    multi = ~(counted["kernels_per_execution"].to_numpy(np.float64) <= 1.0)  # NaN too
    many = rows[multi[rows] & counted["device"].notna().to_numpy()[rows]] if multi.any() else rows[:0]
    single_op = np.where(multi, n_ops, row_op).astype(row_op.dtype, copy=False) if multi.any() else row_op
    any_single = bool((single_op < n_ops).any())  # rows whose events are one execution each (others: n_ops)
    stats = None
    parts_op, parts_t, parts_w = [], [], []
    if any_single and timeline is not None:
        # each event of a single-kernel row is one execution: its own duration
        # counted's index labels are op-table row numbers, which the timeline's events point to
        index, last = counted.index, int(timeline.row.max(initial=0))
        if isinstance(index, pd.RangeIndex) and index.start == 0 and index.step == 1 and last < len(index):
            op_of = single_op  # labels are positions
        else:
            labels = index.to_numpy()
            op_of = np.full(max(int(labels.max()), last) + 1, n_ops, single_op.dtype)
            op_of[labels] = single_op
        ev_op, duration = op_of[timeline.row], timeline.duration_ps.astype(np.int64, copy=False)
        if not len(many):  # every sample one event: order statistics per op, no sort of all events
            stats = _event_quantiles(ev_op, duration, n_ops, (0.5, 0.9))
        else:
            ev = np.flatnonzero(ev_op < n_ops)
            parts_op.append(ev_op[ev])
            parts_t.append(duration[ev].astype(np.float64) * 1e-12)
            parts_w.append(np.ones(len(ev)))
    if len(many) or any_single and timeline is None:  # samples from rows' times and executions
        measured = counted["measured_s"].to_numpy(np.float64)
        executions = counted["executions"].to_numpy(np.float64)
    if any_single and timeline is None:
        single = rows[single_op[rows] < n_ops]
        parts_op.append(row_op[single])
        with np.errstate(divide="ignore", invalid="ignore"):
            parts_t.append(measured[single] / executions[single])
        parts_w.append(executions[single])
    if len(many):  # per (op, device, step) sums; rows without a step are one step of their own
        step = counted["step"].to_numpy(dtype="float64", na_value=-1)[many]
        per_step = group_codes([row_op[many], counted["device"].array[many], step])
        m, x = np.bincount(per_step, weights=measured[many]), np.bincount(per_step, weights=executions[many])
        parts_op.append(row_op[many][first_rows(per_step)])
        with np.errstate(divide="ignore", invalid="ignore"):
            parts_t.append(m / x)
        parts_w.append(x)
    if stats is None:  # (ops in order of first appearance: the float sums run in that order)
        op = np.concatenate([np.zeros(0, np.int64), *parts_op])
        t = np.concatenate([np.zeros(0), *parts_t])
        w = np.concatenate([np.zeros(0), *parts_w])
        q, mx, total, mid = _grouped_quantiles(op, t, w, n_ops, (0.5, 0.9))
        far = np.bincount(op, weights=np.where(t > OUTLIER_RATIO * q[0.5][op], w, 0.0), minlength=n_ops)
    else:
        q, mx, total, mid, far = stats
    median = q[0.5]
    keys = [np.unique(op_t, return_inverse=True)[1].reshape(-1), pid_t, np.unique(mod_t, return_inverse=True)[1]]
    # lexsort is stable: ops alike in text (a missing name and one written "nan") stay in order of first appearance
    order = np.lexsort(keys)
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = q[0.9] / np.where(median > 0, median, np.nan)
    out = {"median_s": median, "p90_s": q[0.9], "spread": spread, "max_s": mx, "samples": total,
           "outlier_executions": np.where(total >= OUTLIER_MIN_EXECUTIONS, np.rint(far), 0).astype(np.int64),
           "midpoint_median_s": mid}
    return pd.DataFrame({c: v[order] for c, v in out.items()},  # sorted by module, program id, op
                        index=_multi_index([mod_t[order], pid_t[order], op_t[order]], OP_ID))


def _multi_index(arrays: Sequence[np.ndarray], names: Sequence[str]) -> pd.MultiIndex:
    """``pd.MultiIndex.from_arrays(arrays, names=names)`` for arrays without missing values: levels the sorted
    distinct values, found with ``np.unique`` (from_arrays builds a Categorical per level: 0.3 ms on tens of
    rows)."""
    levels, codes = [], []
    for a in arrays:
        u, c = np.unique(a, return_inverse=True)
        levels.append(pd.Index(u))
        codes.append(c.reshape(-1))
    return pd.MultiIndex(levels=levels, codes=codes, names=list(names), verify_integrity=False)


def _categorical(col: pd.Series) -> pd.Categorical:
    """The column as a Categorical (its own when it is one)."""
    return col.array if isinstance(col.dtype, pd.CategoricalDtype) else pd.Categorical(col)


def top_ops(counted: pd.DataFrame, per: float, n: int, stats: pd.DataFrame | None = None) -> pd.DataFrame:
    """The ``n`` ops (module, HLO op) losing most time per step, ranked by their *median* lost time per step:
    ``median_lost_per_step_s`` = (median measured per execution − expected per execution) x executions per step,
    so a few slow executions (noise, contention, a first run) do not make an op the worst; ``lost_per_step_s``
    keeps the total (mean) figure that the layer table sums. Per execution: ``median_s``, ``p90_s``, ``spread``
    (p90 ÷ median) and ``outlier_executions`` (see :func:`execution_stats`, passed as ``stats`` when already
    computed). With opcode, category, layer, phase, bound and shapes (an op's first row's where given). Ops
    without an expectation (nothing joined to HLO) are ranked by median time per step."""
    cols = ["module", "program_id", "hlo_op", "opcode", "category", "layer", "phase", "executions_per_step",
            "time_per_step_s", "expected_per_step_s", "lost_per_step_s", "median_s", "p90_s", "spread",
            "outlier_executions", "median_lost_per_step_s", "efficiency", "bound", "shape", "operand_shapes"]
    joined = counted["joined"].to_numpy(bool)
    d = counted[joined] if joined.any() and not joined.all() else counted  # nothing joined: rank by time
    rows = np.flatnonzero(d["module"].notna().to_numpy() & d["hlo_op"].notna().to_numpy())
    if not len(rows):
        return pd.DataFrame(columns=cols)
    pid = d["program_id"].to_numpy(dtype="int64", na_value=-1)[rows]
    module, hlo_op = as_text(d["module"])[rows], as_text(d["hlo_op"])[rows]
    group = group_codes([d["module"].array[rows], pid, d["hlo_op"].array[rows]])
    first = first_rows(group)
    n_ops = len(first)

    def total(c: str, min_count: int = 0) -> np.ndarray:
        v = d[c].to_numpy(np.float64)[rows]
        s = group_sum(group, v, n_ops) / per
        return np.where(np.bincount(group, weights=~np.isnan(v), minlength=n_ops) >= min_count, s, np.nan)

    def first_given(c: str) -> np.ndarray:  # the first row's value that is not NA, as text
        col = d[c]
        text = as_text(col)[rows]
        given = np.flatnonzero(col.array.codes[rows] >= 0 if isinstance(col.dtype, pd.CategoricalDtype)
                               else pd.notna(col.array[rows]))
        at = np.full(n_ops, -1, np.int64)
        at[group[given][::-1]] = given[::-1]
        return np.where(at >= 0, text[at], np.nan)

    executions, time = total("executions"), total("measured_s")
    expected = total("expected_s", 1)
    if stats is None:
        stats = execution_stats(d)
    at = positions(stats.index, zip(module[first], pid[first], hlo_op[first]))

    def stat(c: str) -> np.ndarray:
        return np.where(at >= 0, stats[c].to_numpy(np.float64)[at], np.nan)

    median = stat("median_s")
    with np.errstate(divide="ignore", invalid="ignore"):  # inf and NaN as pandas' arithmetic gives, silently
        median_lost = (median - expected / executions) * executions
        median_time = median * executions
        efficiency = expected / time
    agg = {
        "module": module[first], "program_id": pd.arrays.IntegerArray(pid[first], pid[first] < 0),
        "hlo_op": hlo_op[first], **{c: first_given(c) for c in ("opcode", "category", "layer", "phase")},
        "executions_per_step": executions, "time_per_step_s": time, "expected_per_step_s": expected,
        "lost_per_step_s": total("lost_s", 1), "median_s": median, "p90_s": stat("p90_s"),
        "spread": stat("spread"), "outlier_executions": np.nan_to_num(stat("outlier_executions")).astype(np.int64),
        "median_lost_per_step_s": median_lost, "efficiency": efficiency,
        **{c: first_given(c) for c in ("bound", "shape", "operand_shapes")}}
    names = np.unique(hlo_op[first], return_inverse=True)[1]
    # most median lost time first, then most median time (NaN last), then by name
    top = np.lexsort((names, -median_time, -median_lost))[:n]
    return pd.DataFrame({c: agg[c][top] for c in cols})

OP_KEY = ["layer", "phase", "scope", "opcode", "category", "dtype", "shape", "operand_shapes", "collective_group"]


def op_stats(counted: pd.DataFrame, per: float) -> pd.DataFrame:
    """Counted op rows aggregated per op identity (``OP_KEY``: scope, phase, opcode, category, dtype, shapes, and
    for collectives kind and group (``all-gather/4x2``); not the HLO name, which changes between compilations),
    per step and device: ``executions_per_step``,
    ``time_per_step_s``, ``expected_per_step_s``, ``flops_per_step``, ``hbm_bytes_per_step``,
    ``exposed_comm_per_step_s``, and ``hlo_ops`` (the names, for reading)."""
    cols = OP_KEY + ["executions_per_step", "time_per_step_s", "expected_per_step_s", "flops_per_step",
                     "hbm_bytes_per_step", "exposed_comm_per_step_s", "hlo_ops"]
    if counted.empty:
        return pd.DataFrame(columns=cols)
    exposed = counted["comm_exposed_s"].fillna(0.0) if "comm_exposed_s" in counted else 0.0
    d = pd.DataFrame({**{c: counted[c].astype(str) if c in counted else "" for c in OP_KEY},  # only what is read
                      **{c: counted[c] for c in ("executions", "measured_s", "expected_s", "flops", "hbm_bytes")},
                      "_exposed": exposed}, index=counted.index)
    g = d.groupby(OP_KEY, sort=True)
    names: list[set[str]] = [set() for _ in range(g.ngroups)]  # each group's HLO op names (groups in key order)
    for i, name in zip(g.ngroup().tolist(), as_text(counted["hlo_op"], "nan").tolist()):
        names[i].add(name)
    executions = g["executions"].sum()
    out = pd.DataFrame({
        "executions_per_step": executions / per,
        "time_per_step_s": g["measured_s"].sum() / per,
        "expected_per_step_s": g["expected_s"].sum(min_count=1) / per,
        "flops_per_step": g["flops"].sum() / per,
        "hbm_bytes_per_step": g["hbm_bytes"].sum() / per,
        "exposed_comm_per_step_s": g["_exposed"].sum() / per,
        "hlo_ops": pd.Series([",".join(sorted(x)[:4]) for x in names], index=executions.index),
    }).reset_index()
    return out[cols]
