"""The analysis of an XProf HLO Op Stats export (``hlo_stats`` JSON/CSV): rows already aggregated by XProf over
occurrences, cores and steps, with libtpu's measured FLOPs and bytes; roofline, layers and findings as for a
profile, without a timeline."""

from __future__ import annotations

import numpy as np
import pandas as pd

from traceroof.chips import Chip, detect_chip, get_chip
from traceroof.collectives import expected_time, topology_for
from traceroof.communication import _latency_bound, collectives_table
from traceroof.discovery import Inputs
from traceroof.findings import FindingInputs, with_findings
from traceroof.join import JoinReport
from traceroof.layers import rollup
from traceroof.opstats import execution_stats, top_ops
from traceroof.results import Analysis, Summary
from traceroof.roofline import apply_roofline, main_matmul_peak
from traceroof.utilization import flop_utilization, utilization_notes
from traceroof.xprof import export_op_table, per_core_chip


def analyze_export(inputs: Inputs, chip: str | Chip | None, depth: int, top: int,
                    topology: str | None = None, model_flops_per_step: float | None = None) -> Analysis:
    """Analysis of an XProf HLO Op Stats export (rows aggregated over occurrences, cores and steps)."""
    path = inputs.profiles[0]
    ops, ctx, notes = export_op_table(path, depth)
    if isinstance(chip, Chip):
        target, note = chip, ""
    elif chip is not None:
        target, note = get_chip(chip), ""
    else:
        target, note = detect_chip({"device_type_string": ctx.device_type})
    chip_ici = target
    if target.kind == "tpu":
        target, core_note = per_core_chip(target, ctx)
        note = "; ".join(x for x in (note, core_note) if x)
    # collectives: expected time on the chip's links; replica-group ids are the program's devices
    collectives = ops.attrs.get("collectives", [])
    ids = [d for c in collectives if c is not None for g in c.groups for d in g]
    topo, topo_note = topology_for(topology, chip_ici, max(ids, default=0) + 1)
    notes += [topo_note] * bool(topo_note)
    estimates = {i: expected_time(c, chip_ici, topo) for i, c in enumerate(collectives) if c is not None}
    per_exec = np.array([estimates[i].time_s if estimates.get(i) else 0.0 for i in range(len(collectives))] + [0.0])
    cid = ops["collective_id"].to_numpy()
    ops["comm_s"] = per_exec[np.where(cid >= 0, cid, len(collectives))] * ops["executions"].to_numpy()
    ops["comm_latency_bound"] = _latency_bound(estimates, len(collectives))[np.where(cid >= 0, cid, len(collectives))]
    ops = apply_roofline(ops, target)
    for col in ("comm_window_s", "comm_hidden_s", "comm_exposed_s"):
        ops[col] = np.nan  # an export has no timeline: overlap cannot be measured
    steps = [t for t in ctx.step_times_s if np.isfinite(t) and t > 0]
    cores = max(ctx.device_core_count, 1)
    total_s = float(ops["measured_s"].sum())
    if steps:
        full = [t for t in steps if t >= 0.5 * max(steps)]
        step_mean = float(np.mean(full))
        step_std = float(np.std(full, ddof=1)) if len(full) > 1 else 0.0
        eff_steps = sum(steps) / step_mean
    else:
        step_mean, step_std, eff_steps = total_s / cores, 0.0, 1.0
        notes.append("no overview_page export beside the HLO Op Stats: the whole capture is one step")
        if not (np.isfinite(step_mean) and step_mean > 0):
            notes.append(f"no step time: the export's op times add up to {total_s:.3g} s, not a positive time")
            step_mean = float("nan")
    if len(steps) != len(ctx.step_times_s) or (steps and len(full) < len(steps)):
        notes.append(f"{len(steps)} steps in the overview, {len(steps) - len(full)} partial: per-step figures "
                     f"divide totals by {eff_steps:.3g} effective steps x {cores} cores")
    per = eff_steps * cores
    counted = ops[ops["counted"]]
    flops = float(counted["flops"].sum()) / per
    expected = float(counted["expected_s"].sum()) / per
    peak, peak_key = main_matmul_peak(counted, target, "bf16")
    model_flops, model_source, mfu, hfu = flop_utilization(counted, per, step_mean, peak, cores,
                                                           model_flops_per_step)
    efficiency = expected / step_mean if step_mean > 0 and expected > 0 else float("nan")
    notes += utilization_notes(mfu, hfu, peak, peak_key, efficiency)
    n = len(ops)
    join = JoinReport(n, n, int(ops["duration_ps"].sum()), int(ops["duration_ps"].sum()), (), 0, ())
    notes.append("rows are XProf's aggregates: FLOPs and HBM bytes are libtpu's measured per-op counts "
                 "(model_flop_rate x time, hbm_bw x time); shapes and padding come from each row's HLO text")
    summary = Summary(
        input=str(path), device=f"{ctx.device_type or 'unknown device'} ({cores} TensorCores), XProf HLO Op Stats "
                                f"export", chip_id=target.id, chip_name=target.name, chip_note=note,
        peak_flops_per_s=target.peak_flops_per_s, hbm_bandwidth_bytes_per_s=target.hbm_bandwidth_bytes_per_s,
        step_annotation="XProf overview steps", steps_total=len(ctx.step_times_s),
        steps_used=tuple(range(len(steps))) or (0,), warmup_steps=0, step_time_mean_s=step_mean,
        step_time_std_s=step_std, flops_per_step=flops, hbm_bytes_per_step=float(counted["hbm_bytes"].sum()) / per,
        expected_per_step_s=expected, op_time_per_step_s=float(counted["measured_s"].sum()) / per,
        mfu=mfu, mfu_peak_key=peak_key,
        roofline_efficiency=efficiency, devices=cores, hosts=1, join=join,
        step_times_s=tuple(full) if steps else (),
        hlo_sources={"XProf hlo_stats export (instruction text per row)": 1}, notes=tuple(notes),
        exposed_comm_per_step_s=float("nan"),  # an export has no timeline
        model_flops_per_step=model_flops, model_flops_source=model_source, hfu=hfu,
        chip_calibrated_at=target.calibrated_at,
    )
    layers = rollup(ops, per, step_mean)
    coll_table = collectives_table(ops[ops["counted"]], collectives, estimates, per, pd.DataFrame(), 0)
    stats = execution_stats(counted)
    a = Analysis(summary, ops, layers, top_ops(counted, per, top, stats), pd.DataFrame(), depth, (), coll_table,
                 topo.describe() + " (chips of the program's replica groups)", per)
    return with_findings(a, FindingInputs(a, counted, target, stats))
