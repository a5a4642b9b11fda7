"""Collectives over the op rows: the per-collective table (expected vs measured, bus bandwidth, exposed time,
arrival skew); the findings on them are rules of :mod:`traceroof.findings.rules_system`."""

from __future__ import annotations

import numpy as np
import pandas as pd

from parsers.hlo import HloModule
from parsers.hlo_text import async_pairs
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
    d = counted[counted["collective_id"] >= 0]
    if d.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    mean_skew = skew.groupby("hlo_op")["skew_s"].mean() if len(skew) else pd.Series(dtype=float)
    for (module, op), g in d.groupby(["module", "hlo_op"], observed=True, sort=False):
        c = collectives[int(g["collective_id"].iloc[0])]
        est = estimates.get(int(g["collective_id"].iloc[0]))
        execs = g["executions"].sum() / per
        t = g["measured_s"].sum() / per
        window = g["comm_window_s"].sum(min_count=1) / per
        exposed = g["comm_exposed_s"].sum(min_count=1) / per
        mean_t = (g["comm_window_s"].sum(min_count=1) if g["comm_window_s"].notna().any() else
                  g["measured_s"].sum()) / max(g["executions"].sum(), 1e-12)
        rows.append({
            "module": str(module), "hlo_op": str(op), "kind": c.kind, "form": c.form, "dtype": c.element_type,
            "bytes_in": c.bytes_in, "bytes_out": c.bytes_out, "group_size": c.group_size,
            "num_groups": c.num_groups, "mode": c.mode, "axes": est.axes if est else "",
            "link": est.link if est else "", "bound": est.bound if est else "", "executions_per_step": execs,
            "expected_per_step_s": est.time_s * execs if est else np.nan, "time_per_step_s": t,
            "bus_bandwidth_bytes_per_s": bus_bandwidth(c, mean_t) if c.form != "done" else np.nan,
            "link_peak_bytes_per_s": est.link_peak_bytes_per_s if est else np.nan,
            "exposed_per_step_s": exposed, "exposed_share": exposed / window if window and window > 0 else np.nan,
            "arrival_skew_s": float(mean_skew.get(str(op), np.nan)),
        })
    out = pd.DataFrame(rows, columns=cols)
    return out.sort_values(["exposed_per_step_s", "hlo_op"], ascending=[False, True], kind="stable") \
        .reset_index(drop=True)
