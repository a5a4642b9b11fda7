"""Collectives over the op rows: the per-collective table (expected vs measured, bus bandwidth, exposed time,
arrival skew); the findings on them are rules of :mod:`traceroof.findings.rules_system`."""

from __future__ import annotations

import numpy as np
import pandas as pd

from parsers.hlo import HloModule
from parsers.hlo_text import async_pairs
from traceroof.codes import as_text, first_rows, group_codes, group_mean, group_sum
from traceroof.collectives import bus_bandwidth



def _latency_bound(estimates: dict, n: int) -> np.ndarray:
    """Per collective id (and one trailing False for non-collectives): the estimate is latency-bound."""
    return np.array([bool(estimates.get(i) and estimates[i].latency_bound) for i in range(n)] + [False])


def _async_pairs(modules: list[HloModule]) -> dict[tuple[int | None, str], str]:
    """(program id, ``-done`` op) -> its ``-start`` op, over every computation of every module."""
    out: dict[tuple[int | None, str], str] = {}
    for m in modules:
        for comp in m.computations.values():
            for done, start in async_pairs(comp).items():
                out[(m.program_id, done)] = start
    return out


def collectives_table(counted: pd.DataFrame, collectives: list, estimates: dict, per: float, skew: pd.DataFrame,
                      steps: int) -> pd.DataFrame:
    """One row per collective op (per step, per device): ``kind``, ``form``, ``dtype``, ``bytes_in``,
    ``bytes_out``, ``group_size``, ``num_groups``, ``mode``, ``axes``, ``link``, ``bound`` (``latency`` when
    the per-hop latency floor sets the expected time, else ``communication``), ``executions_per_step``,
    ``expected_per_step_s``, ``time_per_step_s``, ``bus_bandwidth_bytes_per_s`` (achieved, nccl-tests
    convention), ``link_peak_bytes_per_s``, ``exposed_per_step_s``, ``exposed_share`` (of its window) and
    ``arrival_skew_s`` (mean over executions, across devices)."""
    cols = ["module", "hlo_op", "kind", "form", "dtype", "bytes_in", "bytes_out", "group_size", "num_groups",
            "mode", "axes", "link", "bound", "executions_per_step", "expected_per_step_s", "time_per_step_s",
            "bus_bandwidth_bytes_per_s", "link_peak_bytes_per_s", "exposed_per_step_s", "exposed_share",
            "arrival_skew_s"]
    cid = counted["collective_id"].to_numpy(np.int64)
    at = np.flatnonzero((cid >= 0) & counted["module"].notna().to_numpy() & counted["hlo_op"].notna().to_numpy())
    if not len(at):
        return pd.DataFrame(columns=cols)
    group = group_codes([counted["module"].array[at], counted["hlo_op"].array[at]])  # one per collective op
    first = first_rows(group)
    n = len(first)

    def total(c: str) -> np.ndarray:
        return group_sum(group, counted[c].to_numpy(np.float64)[at], n)

    def given(c: str) -> np.ndarray:  # rows with a value, per collective
        return np.bincount(group, weights=counted[c].notna().to_numpy()[at], minlength=n)

    executions, measured = total("executions"), total("measured_s")
    window = np.where(given("comm_window_s") > 0, total("comm_window_s"), np.nan)
    exposed = np.where(given("comm_exposed_s") > 0, total("comm_exposed_s"), np.nan) / per
    mean_t = np.where(np.isnan(window), measured, window) / np.maximum(executions, 1e-12)
    skew_at = {}  # HLO op -> mean arrival skew over its executions
    if len(skew):
        skew_op = as_text(skew["hlo_op"])
        by_op = group_codes([skew_op])
        ops = first_rows(by_op)
        skew_at = dict(zip(skew_op[ops], group_mean(by_op, skew["skew_s"].to_numpy(np.float64), len(ops))))
    module, hlo_op = as_text(counted["module"])[at[first]], as_text(counted["hlo_op"])[at[first]]
    rows = []
    for u in range(n):
        ci = int(cid[at[first[u]]])
        c, est = collectives[ci], estimates.get(ci)
        execs, w = executions[u] / per, window[u] / per
        rows.append({
            "module": module[u], "hlo_op": hlo_op[u], "kind": c.kind, "form": c.form, "dtype": c.element_type,
            "bytes_in": c.bytes_in, "bytes_out": c.bytes_out, "group_size": c.group_size,
            "num_groups": c.num_groups, "mode": c.mode, "axes": est.axes if est else "",
            "link": est.link if est else "", "bound": est.bound if est else "", "executions_per_step": execs,
            "expected_per_step_s": est.time_s * execs if est else np.nan, "time_per_step_s": measured[u] / per,
            "bus_bandwidth_bytes_per_s": bus_bandwidth(c, mean_t[u]) if c.form != "done" else np.nan,
            "link_peak_bytes_per_s": est.link_peak_bytes_per_s if est else np.nan,
            "exposed_per_step_s": exposed[u], "exposed_share": exposed[u] / w if w and w > 0 else np.nan,
            "arrival_skew_s": float(skew_at.get(hlo_op[u], np.nan)),
        })
    out = pd.DataFrame(rows, columns=cols)
    return out.sort_values(["exposed_per_step_s", "hlo_op"], ascending=[False, True], kind="stable") \
        .reset_index(drop=True)
