"""Layout findings: tile padding that inflates HBM traffic, and layout-changing copies (retiling).

TPU layouts store arrays in tiles (``T(8,128)(2,1)`` ...), so a tiled dimension is rounded up to the tile size
(``docs/reference/hlo-text.md`` §6.2; How to Scale Your Model §9.2.2): small or odd dims pay for padding, and
copies that only change the layout ("retiling") move bytes for no math (§9.2.2 fn 5).
"""

from __future__ import annotations

import pandas as pd

from parsers.hlo import Instruction, Shape

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
