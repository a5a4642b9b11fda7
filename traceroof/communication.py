"""Collectives over the op rows: the per-collective table (expected vs measured, bus bandwidth, exposed time, arrival skew) and the findings on exposed communication and stragglers."""

from __future__ import annotations

import numpy as np
import pandas as pd

from parsers.hlo import HloModule
from parsers.hlo_text import async_pairs
from traceroof.collectives import bus_bandwidth
from traceroof.results import Summary


EXPOSED_SHARE_MIN = 0.02  # collectives exposed for more than this share of the step are named
STRAGGLER_LAST_SHARE_MIN = 0.5  # a device last at more than this share of collective executions ...
STRAGGLER_WAIT_SHARE_MIN = 0.01  # ... while the others wait more than this share of the step


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


def communication_findings(table: pd.DataFrame, skew: pd.DataFrame, s: Summary, steps: int,
                           virtual_devices: bool = False) -> list[str]:
    """The largest exposed collectives with what would hide them, and the device that makes others wait.

    ``virtual_devices``: the devices are threads of one host (XLA:CPU's ``--xla_force_host_platform_device_count``):
    a collective's time is mostly device threads waiting for each other on a few cores, so no interconnect
    advice is given, only that reading."""
    out = []
    if len(table) and s.step_time_mean_s > 0:
        top = table[table["exposed_per_step_s"] > EXPOSED_SHARE_MIN * s.step_time_mean_s].head(3)
        for r in top.itertuples(index=False):
            if virtual_devices:
                skew_s = r.arrival_skew_s if np.isfinite(r.arrival_skew_s) else 0.0
                out.append(f"{r.hlo_op} ({r.kind}, {r.bytes_out / 1e6:.3g} MB, group {r.group_size}) takes "
                           f"{r.exposed_per_step_s * 1e3:.3f} ms per step on virtual CPU devices (threads of one "
                           f"host; arrival skew {skew_s * 1e3:.3f} ms): mostly devices waiting for each other on "
                           "shared cores, not data movement; profile on the real accelerators to judge it")
                continue
            advice = {"all-gather": "prefetch it a layer ahead (FSDP overlap) or let XLA schedule it async",
                      "reduce-scatter": "overlap it with the next layer's backward (async collective)",
                      "all-reduce": "split it into reduce-scatter + all-gather that overlap compute, or shard "
                                    "the operand so it shrinks",
                      "all-to-all": "overlap dispatch with expert compute (chunk the all-to-all)"}.get(
                r.kind, "make it asynchronous so compute can overlap it")
            out.append(f"{r.hlo_op} ({r.kind}, {r.bytes_out / 1e6:.3g} MB, group {r.group_size}) is exposed "
                       f"{r.exposed_per_step_s * 1e3:.3f} ms per step ({r.exposed_share:.0%} of its window): "
                       f"{advice}")
    if len(skew) and steps:
        last = skew["last_device"].value_counts()
        dev, n = last.index[0], int(last.iloc[0])
        wait = skew["wait_s"].sum() / steps
        if n / len(skew) > STRAGGLER_LAST_SHARE_MIN and wait > STRAGGLER_WAIT_SHARE_MIN * s.step_time_mean_s:
            out.append(f"{dev} arrives last at {n / len(skew):.0%} of collective executions; the other devices "
                       f"wait {wait * 1e3:.3f} ms per step in total for it (straggler)")
    return out
