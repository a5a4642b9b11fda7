"""Per-op figures over op rows: the spread of single executions (:func:`execution_stats`, from the events), the
ops losing most time (:func:`top_ops`), and per-identity figures for ``traceroof diff`` (:func:`op_stats`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from traceroof.codes import first_rows, group_codes
from traceroof.optable import Timeline

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
    ``median``)."""
    order = np.lexsort((t, op))
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
        ops_hit, at = np.unique(op[idx], return_index=True)
        v = np.full(n_ops, np.nan)
        v[ops_hit] = t[idx[at]]
        out[q] = v
    last = np.append(first[1:], len(op)) - 1
    mx = np.full(n_ops, np.nan)
    mx[op[last]] = t[last]
    size = last - first + 1
    mid = np.full(n_ops, np.nan)
    mid[op[first]] = (t[first + (size - 1) // 2] + t[first + size // 2]) / 2
    return out, mx, total, mid


def execution_stats(counted: pd.DataFrame, timeline: Timeline | None = None) -> pd.DataFrame:
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
    """
    if counted.empty:
        return pd.DataFrame(columns=STATS_COLUMNS, index=pd.MultiIndex.from_tuples([], names=OP_ID))
    module, hlo_op = pd.Categorical(counted["module"]), pd.Categorical(counted["hlo_op"])
    pid = counted["program_id"].to_numpy(dtype="int64", na_value=-1)
    op_row = group_codes([module, pid, hlo_op])
    first_row = first_rows(op_row)

    def text(cat: pd.Categorical) -> np.ndarray:
        names = np.append(np.asarray(cat.categories.astype(str), dtype=object), "nan")  # code -1: NA
        return names[cat.codes[first_row]]

    uniques = pd.MultiIndex.from_arrays([text(module), pid[first_row], text(hlo_op)])
    n_ops = len(uniques)
    single = counted["kernels_per_execution"].to_numpy(np.float64) <= 1.0
    parts_op, parts_t, parts_w = [], [], []
    if single.any() and timeline is not None:
        # each event of a single-kernel row is one execution: its own duration
        # counted's index labels are op-table row numbers, which the timeline's events point to
        pos = np.full(max(int(counted.index.max()), int(timeline.row.max(initial=0))) + 1, -1, np.int64)
        pos[counted.index.to_numpy()[single]] = np.flatnonzero(single)
        ev = np.flatnonzero(pos[timeline.row] >= 0)
        r = pos[timeline.row[ev]]
        parts_op.append(op_row[r])
        parts_t.append(timeline.duration_ps[ev].astype(np.float64) * 1e-12)
        parts_w.append(np.ones(len(ev)))
    elif single.any():
        one = counted[single]
        parts_op.append(op_row[single])
        parts_t.append((one["measured_s"] / one["executions"]).to_numpy(np.float64))
        parts_w.append(one["executions"].to_numpy(np.float64))
    if not single.all():
        many = counted[~single].assign(_op=op_row[~single],
                                       step=counted.loc[~single, "step"].astype("float64").fillna(-1))
        per_step = many.groupby(["_op", "device", "step"], observed=True, sort=False)[
            ["measured_s", "executions"]].sum().reset_index()
        parts_op.append(per_step["_op"].to_numpy(np.int64))
        parts_t.append((per_step["measured_s"] / per_step["executions"]).to_numpy(np.float64))
        parts_w.append(per_step["executions"].to_numpy(np.float64))
    op = np.concatenate(parts_op).astype(np.int64)
    t = np.concatenate(parts_t)
    w = np.concatenate(parts_w)
    q, mx, total, mid = _grouped_quantiles(op, t, w, n_ops, (0.5, 0.9))
    median = q[0.5]
    far = np.bincount(op, weights=np.where(t > OUTLIER_RATIO * median[op], w, 0.0), minlength=n_ops)
    out = pd.DataFrame({"median_s": median, "p90_s": q[0.9]}, index=uniques.set_names(OP_ID))
    out["spread"] = out["p90_s"] / out["median_s"].where(out["median_s"] > 0)
    out["max_s"] = mx
    out["samples"] = total
    out["outlier_executions"] = np.where(total >= OUTLIER_MIN_EXECUTIONS, np.rint(far), 0).astype(np.int64)
    out["midpoint_median_s"] = mid
    return out[STATS_COLUMNS + ["midpoint_median_s"]].sort_index()


def top_ops(counted: pd.DataFrame, per: float, n: int, stats: pd.DataFrame | None = None) -> pd.DataFrame:
    """The ``n`` ops (module, HLO op) losing most time per step, ranked by their *median* lost time per step:
    ``median_lost_per_step_s`` = (median measured per execution − expected per execution) x executions per step,
    so a few slow executions (noise, contention, a first run) do not make an op the worst; ``lost_per_step_s``
    keeps the total (mean) figure that the layer table sums. Per execution: ``median_s``, ``p90_s``, ``spread``
    (p90 ÷ median) and ``outlier_executions`` (see :func:`execution_stats`, passed as ``stats`` when already
    computed). With opcode, category, layer, phase, bound and shapes. Ops without an expectation (nothing joined
    to HLO) are ranked by median time per step."""
    cols = ["module", "program_id", "hlo_op", "opcode", "category", "layer", "phase", "executions_per_step",
            "time_per_step_s", "expected_per_step_s", "lost_per_step_s", "median_s", "p90_s", "spread",
            "outlier_executions", "median_lost_per_step_s", "efficiency", "bound", "shape", "operand_shapes"]
    d = counted[counted["joined"]]
    if d.empty:  # nothing joined to HLO: rank by measured time instead
        d = counted
    if d.empty:
        return pd.DataFrame(columns=cols)
    d = d.assign(program_id=d["program_id"].fillna(-1))
    g = d.groupby(OP_ID, observed=True, sort=False)
    first = g.first()
    agg = pd.DataFrame({
        "executions_per_step": g["executions"].sum() / per,
        "time_per_step_s": g["measured_s"].sum() / per,
        "expected_per_step_s": g["expected_s"].sum(min_count=1) / per,
        "lost_per_step_s": g["lost_s"].sum(min_count=1) / per,
    })
    agg["efficiency"] = agg["expected_per_step_s"] / agg["time_per_step_s"]
    for c in ("opcode", "category", "layer", "phase", "bound", "shape", "operand_shapes"):
        agg[c] = first[c].astype(str)
    agg = agg.reset_index()
    agg["module"] = agg["module"].astype(str)
    agg["hlo_op"] = agg["hlo_op"].astype(str)
    if stats is None:
        stats = execution_stats(d)
    st = stats.reindex(pd.MultiIndex.from_frame(agg[OP_ID]))
    for c in ("median_s", "p90_s", "spread", "outlier_executions"):
        agg[c] = st[c].to_numpy()
    agg["outlier_executions"] = agg["outlier_executions"].fillna(0).astype(np.int64)
    expected_per_exec = agg["expected_per_step_s"] / agg["executions_per_step"]
    agg["median_lost_per_step_s"] = (agg["median_s"] - expected_per_exec) * agg["executions_per_step"]
    agg["_median_time"] = agg["median_s"] * agg["executions_per_step"]
    agg["program_id"] = agg["program_id"].astype("Int64").where(agg["program_id"] >= 0)
    agg = agg.sort_values(["median_lost_per_step_s", "_median_time", "hlo_op"], ascending=[False, False, True],
                          kind="stable", na_position="last")
    return agg[cols].head(n).reset_index(drop=True)


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
    d = counted.assign(**{c: counted[c].astype(str) if c in counted else "" for c in OP_KEY})
    exposed = d["comm_exposed_s"] if "comm_exposed_s" in d else pd.Series(0.0, index=d.index)
    d = d.assign(_exposed=exposed.fillna(0.0))
    g = d.groupby(OP_KEY, sort=True)
    out = pd.DataFrame({
        "executions_per_step": g["executions"].sum() / per,
        "time_per_step_s": g["measured_s"].sum() / per,
        "expected_per_step_s": g["expected_s"].sum(min_count=1) / per,
        "flops_per_step": g["flops"].sum() / per,
        "hbm_bytes_per_step": g["hbm_bytes"].sum() / per,
        "exposed_comm_per_step_s": g["_exposed"].sum() / per,
        "hlo_ops": g["hlo_op"].agg(lambda x: ",".join(sorted(set(map(str, x)))[:4])),
    }).reset_index()
    return out[cols]
