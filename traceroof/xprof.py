"""XProf HLO Op Stats exports as an op table (one row per exported op, aggregated over its occurrences).

XProf computed these rows from a profile we do not have (TPU ``XLA Ops`` with libtpu's own per-op FLOPs and
bytes), so the rows carry XProf's numbers: FLOPs = ``model_flop_rate`` (GFLOP/s) x total time, HBM bytes =
``hbm_bw`` (GiB/s, ``docs/reference/cost-model.md`` §7) x total time. Our own parser reads each row's HLO
instruction text for opcode, shapes, dtype and tile padding; scopes come from the framework-op column.
XProf's devices are JAX's: one TensorCore of a TPU v2/v3 chip, a whole v4/v5p megacore chip (the rule of
:func:`traceroof.chips.per_device_chip`), unless the roofline export says megacore is off.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pandas as pd

from parsers.errors import FormatError, HloParseError, InputError
from parsers.hlo_text import parse_hlo_text
from parsers.xprof_export import ExportContext, read_export_context, read_hlo_stats
from parsers.xspace import DURATION_LIMIT_PS
from traceroof.chips import Chip, Figure, per_device_chip
from traceroof.collectives import classify
from traceroof.cost import CostModel, _sizes
from parsers.hlo import is_retiling
from traceroof.layers import layer_of, parse_scope
from traceroof.events import as_id
from traceroof.optable import SharedList

MAX_OP_TIME_S = DURATION_LIMIT_PS * 1e-12  # 13.3 days: the profile parsers' limit on one event's duration

# XProf "HLO op category" -> traceroof category
CATEGORY = {
    "convolution fusion": "matmul", "convolution": "matmul", "dot": "matmul", "output fusion": "matmul",
    "loop fusion": "elementwise", "non-fusion elementwise": "elementwise", "rng-bit-generator": "elementwise",
    "input fusion": "reduction", "reduce": "reduction", "sort": "reduction",
    "all-reduce": "collective", "all-gather": "collective", "all-to-all": "collective",
    "all-reduce-scatter fusion": "collective", "reduce-scatter": "collective", "collective-permute": "collective",
    "custom fusion": "custom-call", "custom-call": "custom-call", "megacore fusion": "custom-call",
    "while": "control", "conditional": "control", "call": "control",
}


def _category(xprof: str, opcode: str) -> str:
    if xprof in CATEGORY:
        return CATEGORY[xprof]
    if "fusion" in xprof and ("all-" in xprof or "collective" in xprof):
        return "collective"
    return "data movement"


def per_core_chip(chip: Chip, ctx: ExportContext) -> tuple[Chip, str]:
    """The chip's figures per XProf device. The rule of :func:`traceroof.chips.per_device_chip`: TPU v2/v3
    devices are single TensorCores (figures / ``devices_per_chip``), v4/v5p megacore devices whole chips; except
    that a roofline export saying ``megacore: 0`` on a chip of several TensorCores makes each device one core."""
    per, note = per_device_chip(chip)
    cores = int(chip.value("compute.tensorcores_per_chip", 1) or 1)
    if per is chip and cores > 1 and ctx.megacore is False:
        figures = {k: (Figure(float(f.value) / cores, f.source + f"; / {cores} TensorCores per chip (megacore off)")
                       if k.startswith("peak_flops_per_s.") or k == "memory.hbm_bandwidth_bytes_per_s" else f)
                   for k, f in chip.figures.items()}
        per = dataclasses.replace(chip, figures=figures, name=f"{chip.name} (per TensorCore)")
        note = (f"the roofline export says megacore is off: each XProf device is one of {chip.name}'s {cores} "
                "TensorCores")
    if per is not chip and ctx.peak_flops_per_s and ctx.peak_hbm_bytes_per_s:
        note += (f" (the export claims {ctx.peak_flops_per_s / 1e12:.4g} TFLOP/s and "
                 f"{ctx.peak_hbm_bytes_per_s / 1e9:.4g} GB/s per device)")
    return per, note


def export_op_table(path: str | Path, depth: int = 2) -> tuple[pd.DataFrame, ExportContext, list[str]]:
    """Op table of an HLO Op Stats export, the export context, and notes (rows whose HLO text did not parse).

    Rows hold totals over all occurrences on all cores (container rows, whose total time includes other rows,
    are marked not ``counted``): ``measured_s`` (total self time), ``executions``
    (occurrences), ``flops``, ``hbm_bytes`` (XProf's), ``logical_bytes`` and ``padded_bytes`` (from the
    instruction's printed operand and result shapes, x occurrences).
    """
    p = Path(path)
    df = read_hlo_stats(p)
    ctx = read_export_context(p.parent)
    notes: list[str] = []
    rows = []
    unparsed = 0
    for r in df.to_dict("records"):
        expr = str(r.get("hlo_op_expression") or "")
        inst = None
        coll = None
        if expr:
            try:
                (m,) = parse_hlo_text("HloModule export\nENTRY e {\n" + expr + "\n}\n", source=f"{p.name} row")
                inst = m.entry.instructions[0]
                coll = classify(CostModel(m), inst)
            except (HloParseError, ValueError, IndexError):
                unparsed += 1
        total_s = float(r.get("total_time") or 0.0) * 1e-6
        self_s = float(r.get("total_self_time") or 0.0) * 1e-6
        if max(total_s, self_s) > MAX_OP_TIME_S:
            raise FormatError(f"{p}: row {len(rows) + unparsed}: op {str(r.get('hlo_op_name'))[:60]!r} totals "
                              f"{max(total_s, self_s):.3g} s, beyond {MAX_OP_TIME_S / 86400:.0f} days; the export "
                              "is corrupt")
        occ = float(r.get("occurrences") or 0.0)
        xcat = str(r.get("category") or "")
        opcode = inst.opcode if inst is not None else xcat
        logical = padded = 0.0
        dtype, shape, operands = "", "", ""
        if inst is not None:
            sizes = [_sizes(inst.shape)] + [_sizes(s) for s in inst.operand_shapes if s is not None]
            logical = sum(s[0] for s in sizes) * occ
            padded = sum(s[1] for s in sizes) * occ
            leaves = inst.shape.leaves()
            dtype = (inst.operand_shapes[0].element_type if xcat == "convolution fusion" and inst.operand_shapes
                     and inst.operand_shapes[0] is not None else (leaves[0].element_type if leaves else ""))
            shape = str(inst.shape)
            operands = ", ".join(str(s) if s is not None else "?" for s in inst.operand_shapes)
        tf_op = re.sub(r":[^/]*$", "", str(r.get("tf_op_name") or ""))
        scope, phase = parse_scope(tf_op)
        flops = float(r.get("model_flop_rate") or 0.0) * 1e9 * total_s
        hbm = float(r.get("hbm_bw") or 0.0) * 2**30 * total_s
        if not (np.isfinite(flops) and np.isfinite(hbm)):
            raise FormatError(f"{p}: row {len(rows) + unparsed}: op {str(r.get('hlo_op_name'))[:60]!r}: FLOP or "
                              "HBM rate times its time overflows; the export is corrupt")
        category = "collective" if coll is not None else _category(xcat, opcode)
        rows.append({
            "host": "", "device": "xprof export", "program_id": r.get("program_id"), "module": "",
            "hlo_op": str(r.get("hlo_op_name")), "start_ps": 0, "duration_ps": int(round(self_s * 1e12)),
            "step": 0, "measured_s": self_s, "joined": True, "kernels_per_execution": 1.0, "executions": occ,
            "opcode": opcode, "category": category, "fusion_kind": inst.fusion_kind if inst is not None else "",
            "dtype": dtype, "shape": shape, "operand_shapes": operands, "scope": scope, "phase": phase,
            "layer": layer_of(scope, depth), "source": str(r.get("source_info") or ""), "flops": flops,
            "transcendentals": 0.0, "logical_bytes": logical, "padded_bytes": padded, "hbm_bytes": hbm,
            "opaque": category == "custom-call" and flops == 0 and hbm == 0,
            "cost_note": "XProf hlo_stats: FLOPs and HBM bytes measured by the profiler",
            # a row whose total time exceeds its self time contains other rows (while, megacore fusion):
            # not counted, or its children's time and FLOPs would count twice
            "counted": not total_s > self_s * 1.001 + 1e-9,
            "xprof_bound_by": str(r.get("bound_by") or ""),
            "remat": str(r.get("hlo_rematerialization") or "") == "Yes",
            "retiling": inst is not None and is_retiling(inst, inst.operand_shapes[0] if inst.operand_shapes else None),
            "collective": coll,
        })
    if unparsed:
        notes.append(f"{unparsed} exported ops have HLO text this parser could not read: no shapes for them")
    if not rows:
        raise InputError(f"{p}: the HLO Op Stats export holds no op rows; export it from a profile with XLA ops")
    collectives = [r.pop("collective") for r in rows]
    ops = pd.DataFrame(rows)
    ops["collective_id"] = np.array([i if c is not None else -1 for i, c in enumerate(collectives)], np.int64)
    ops["collective_group"] = [f"{c.kind}/{c.group_size}x{c.num_groups}" if c is not None else ""
                               for c in collectives]
    ops.attrs["collectives"] = SharedList(collectives)  # a plain list is deep-copied at every frame operation
    for col in ("opcode", "category", "dtype", "scope", "phase", "layer", "module", "hlo_op", "device", "host"):
        ops[col] = ops[col].astype("category")
    ops["step"] = pd.array(ops["step"], "Int64")
    ids = [as_id(x, 0) for x in ops["program_id"]]  # XProf's ids: fingerprints below 2^63
    ops["program_id"] = pd.array([pd.NA if x is None else x for x in ids], "Int64")
    ops["duration_ps"] = ops["duration_ps"].astype(np.int64)
    return ops, ctx, notes
