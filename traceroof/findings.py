"""Findings on the whole step (busy share, opaque calls, ops faster than their roofline) and on layouts: tile padding that inflates HBM traffic, and layout-changing copies (retiling).

TPU layouts store arrays in tiles (``T(8,128)(2,1)`` ...), so a tiled dimension is rounded up to the tile size
(``docs/reference/hlo-text.md`` §6.2; How to Scale Your Model §9.2.2): small or odd dims pay for padding, and
copies that only change the layout ("retiling") move bytes for no math (§9.2.2 fn 5).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from parsers.hlo import Instruction, Shape
from traceroof.utilization import FASTER_THAN_ROOF_RATIO

if TYPE_CHECKING:
    from traceroof.results import Summary

PADDING_THRESHOLD = 0.25  # flag ops whose padded bytes exceed logical bytes by more than this fraction


def is_retiling(inst: Instruction, operand: Shape | None) -> bool:
    """A copy whose result has the operand's dims but another layout (minor-to-major order or tiling)."""
    if inst.opcode != "copy" or operand is None or operand.is_tuple or inst.shape.is_tuple:
        return False
    a, b = operand.layout, inst.shape.layout
    if a is None or b is None or operand.dims != inst.shape.dims:
        return False
    return (a.minor_to_major, a.tiles) != (b.minor_to_major, b.tiles)


def layout_findings(counted: pd.DataFrame, per: float) -> list[str]:
    """Findings on padding (> 25 % extra bytes) and retiling copies, with their time per step."""
    out = []
    if "padded_bytes" in counted and len(counted):
        d = counted[(counted["logical_bytes"] > 0)]
        g = d.groupby(["module", "hlo_op"], observed=True)[["padded_bytes", "logical_bytes", "measured_s"]].sum()
        inflated = g[g["padded_bytes"] > (1 + PADDING_THRESHOLD) * g["logical_bytes"]]
        if len(inflated):
            extra = (inflated["padded_bytes"] - inflated["logical_bytes"]).sort_values(ascending=False)
            worst = ", ".join(f"{op} (+{(inflated.loc[(m, op), 'padded_bytes'] / inflated.loc[(m, op), 'logical_bytes'] - 1):.0%})"
                              for m, op in extra.index[:3])
            out.append(f"{len(inflated)} op(s) move over {PADDING_THRESHOLD:.0%} more bytes because of tile padding "
                       f"({extra.sum() / per / 1e6:.3g} MB extra per step; worst: {worst}): pad or reshape those "
                       "dims to tile multiples (8 x 128; 256 on v6e)")
    if "retiling" in counted and counted["retiling"].any():
        r = counted[counted["retiling"]]
        t = r["measured_s"].sum() / per
        names = ", ".join(sorted(r["hlo_op"].astype(str).unique())[:4])
        out.append(f"{r['hlo_op'].nunique()} layout-changing copies (retiling) take {t * 1e3:.3f} ms per step "
                   f"({names}): let jit choose the layouts (AUTO) or change the producer's layout")
    return out


# Finding thresholds: traceroof's own heuristics (no external source); each finding states the figure it used.
BUSY_SHARE_MIN = 0.5  # ops covering less of the step than this: host overhead / idle finding


def step_findings(s: Summary, counted: pd.DataFrame, per: float, chip_kind: str = "") -> list[str]:
    """Findings on the whole step from per-op sums (``counted``; totals / ``per`` = per step, per device): ops
    covering under ``BUSY_SHARE_MIN`` of the step (host overhead, idle), time in opaque custom-calls, and ops
    running more than ``FASTER_THAN_ROOF_RATIO`` x faster than their roofline (async windows excepted)."""
    out = []
    if s.step_time_mean_s > 0 and s.op_time_per_step_s > 0:
        busy = s.op_time_per_step_s / s.step_time_mean_s
        if busy < BUSY_SHARE_MIN:
            out.append(f"ops cover {busy:.0%} of the step time: the rest is host overhead, input or idle gaps")
    opaque = counted[counted["opaque"]]
    if len(opaque) and s.step_time_mean_s > 0:
        t = opaque["measured_s"].sum() / per
        out.append(f"{t * 1e3:.3f} ms per step ({t / s.step_time_mean_s:.1%} of the step) in opaque custom-calls "
                   f"({', '.join(sorted(opaque['hlo_op'].astype(str).unique())[:4])}): measured, no expectation")
    is_async = counted["opcode"].astype(str).str.contains(r"-start$|-done$|^async", regex=True) | \
        counted["hlo_op"].astype(str).str.startswith("async")
    # async windows (-start/-done) wait for transfers: compute/memory efficiency does not apply (cost-model §7)
    joined = counted[counted["joined"] & counted["expected_s"].notna() & ~is_async]
    if len(joined):
        g = joined.groupby(["module", "hlo_op"], observed=True)[["expected_s", "measured_s"]].sum()
        fast = g[g["expected_s"] > FASTER_THAN_ROOF_RATIO * g["measured_s"]]
        if len(fast):
            names = ", ".join(sorted(fast.index.get_level_values("hlo_op").astype(str))[:5])
            why = ("the calibrated host's DRAM roof is below what cache-resident ops reach" if chip_kind == "cpu"
                   else "the cost model or the chip figures overstate these ops' work")
            out.append(f"{len(fast)} op(s) ran more than {FASTER_THAN_ROOF_RATIO:g}x faster than their roofline "
                       f"({names}): {why}")
    return out
