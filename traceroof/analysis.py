"""``analyze()``: the op table of a profile, its roofline verdict and the per-layer rollup."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from parsers.errors import InputError
from parsers.hlo import HloModule
from parsers.hlo_text import async_pairs, is_known_opcode
from traceroof.chips import Chip, detect_chip, get_chip, host_cache_path, host_chip, per_device_chip
from traceroof.collectives import (bus_bandwidth, default_topology, expected_time, module_devices,
                                   parse_topology)
from traceroof.findings import layout_findings
from traceroof.layers import DEFAULT_OPTIMIZER_PATTERN, rollup
from traceroof.optable import build_op_table, per_op
from traceroof.opstats import execution_stats, op_stats, outlier_findings, top_ops
from traceroof.overlap import arrival_skew, exposed_communication
from traceroof.hlo_source import HloMismatchError
from traceroof.discovery import Inputs, discover
from traceroof.join import JoinReport
from traceroof.profile import Profile, load_profile
from traceroof.progress import progress
from traceroof.roofline import apply_roofline, main_matmul_peak, precision_notes
from traceroof.xprof import export_op_table, per_core_chip

# Finding thresholds: traceroof's own heuristics (no external source); each finding states the figure it used.
BUSY_SHARE_MIN = 0.5  # ops covering less of the step than this: host overhead / idle finding
FASTER_THAN_ROOF_RATIO = 1.5  # expected > this x measured: the model or the chip figures are off
EXPOSED_SHARE_MIN = 0.02  # collectives exposed for more than this share of the step are named
STRAGGLER_LAST_SHARE_MIN = 0.5  # a device last at more than this share of collective executions ...
STRAGGLER_WAIT_SHARE_MIN = 0.01  # ... while the others wait more than this share of the step
STEP_TIME_DISAGREEMENT = 0.1  # device vs host-annotation step time differing by more than this get a note
COST_DISAGREEMENT = 0.1  # libtpu vs traceroof per-op FLOPs differing by more than this are listed

FLOP_CONVENTION = ("FLOPs follow XLA HloCostAnalysis on the after-optimization HLO (2 per multiply-add, "
                   "executed work incl. rematerialisation, while bodies x trip count)")


@dataclass(frozen=True)
class Summary:
    """Report header: input, device, chip, steps, and whole-step figures (per device, per step).

    ``flops_per_step`` are executed FLOPs (rematerialised forward included); ``model_flops_per_step`` the
    model's FLOPs (without the recomputation, or the user's ``--model-flops-per-step`` / devices; the source in
    ``model_flops_source``). ``mfu`` = model FLOPs ÷ step time ÷ peak, ``hfu`` = executed FLOPs ÷ step time ÷
    peak (How to Scale Your Model §4.3.2: remat adds ~one forward; hardware-and-rooflines.md §1), both against
    the ``mfu_peak_key`` peak.
    """

    input: str
    device: str
    chip_id: str
    chip_name: str
    chip_note: str
    peak_flops_per_s: dict[str, float]
    hbm_bandwidth_bytes_per_s: float | None
    step_annotation: str
    steps_total: int
    steps_used: tuple[int, ...]
    warmup_steps: int
    step_time_mean_s: float
    step_time_std_s: float
    flops_per_step: float
    hbm_bytes_per_step: float
    expected_per_step_s: float
    op_time_per_step_s: float
    mfu: float
    mfu_peak_key: str
    roofline_efficiency: float
    devices: int
    join: JoinReport
    exposed_comm_per_step_s: float = 0.0
    step_times_s: tuple[float, ...] = ()
    hlo_sources: dict[str, int] = field(default_factory=dict)
    flop_convention: str = FLOP_CONVENTION
    notes: tuple[str, ...] = ()
    host_step_time_mean_s: float = float("nan")  # the step annotations' own mean (host time), for comparison
    model_flops_per_step: float = float("nan")
    model_flops_source: str = ""
    hfu: float = float("nan")
    chip_calibrated_at: str = ""  # when a calibrated host chip was measured (UTC, from its chip file)
    decoder: str = ""  # wire scanner that read the .xplane.pb files: "c" or "python" (Profile.decoder); "" otherwise


@dataclass(frozen=True, eq=False)
class Analysis:
    """Everything a report shows. ``ops`` is the op table (one row per op execution); ``layers`` the
    per-(layer, phase) rollup; ``top_ops`` the ops losing most time per step; ``steps`` the marked steps;
    ``collectives`` one row per collective op (see :func:`collectives_table`); ``topology`` the topology used;
    ``per_step_divisor`` turns op-table totals into per-step, per-device figures."""

    summary: Summary
    ops: pd.DataFrame
    layers: pd.DataFrame
    top_ops: pd.DataFrame
    steps: pd.DataFrame
    depth: int = 2
    findings: tuple[str, ...] = field(default_factory=tuple)
    collectives: pd.DataFrame = field(default_factory=pd.DataFrame)
    topology: str = ""
    per_step_divisor: float = 1.0  # op-table totals / this = per step, per device (steps used x devices)

    @property
    def op_stats(self) -> pd.DataFrame:
        """Per-step figures of every distinct op, keyed by what it is, not what it is called (see
        :func:`op_stats`): the table ``traceroof diff`` matches on."""
        counted = self.ops[self.ops["counted"] & self.ops["step"].notna()]
        return op_stats(per_op(counted), self.per_step_divisor)


def resolve_chip(profile: Profile, chip: str | Chip | None) -> tuple[Chip, str]:
    """The target chip and a note saying why it was chosen.

    :raises ChipError: no chip given for a device profile (detection needs a known device), or unknown name.
    """
    if isinstance(chip, Chip):
        return chip, ""
    if chip:
        return get_chip(chip), ""
    if profile.device_kind == "cpu":
        c = host_chip()
        note = (f"CPU profile judged against this machine's calibration ({host_cache_path()}; "
                "`traceroof calibrate` re-measures it)")
        return c, note + (f"; {c.load_note}" if c.load_note else "")
    return detect_chip(profile.plane_stats)


def analyze(paths: str | Path | Sequence[str | Path], hlo: str | Path | Sequence[str | Path] = (), chip: str | Chip | None = None,
            depth: int = 2, warmup_steps: int = 1, top: int = 10,
            optimizer_pattern: str = DEFAULT_OPTIMIZER_PATTERN, topology: str | None = None,
            model_flops_per_step: float | None = None, expand: bool = False, jobs: int | None = 1,
            dask_address: str | None = None) -> Analysis:
    """Analyze a profile: op table, roofline on ``chip``, per-layer rollup, top ops by lost time.

    :param paths: ``.xplane.pb`` / trace JSON files, run directories or logdirs (one capture; all hosts).
    :param hlo: HLO text files or ``--xla_dump_to`` folders (dumps found beside the profile are added).
    :param chip: chip id/name/alias, a chip ``.toml`` path, or a :class:`Chip`; CPU profiles default to the
        calibrated host.
    :param depth: scope units that make a layer (:class:`~traceroof.layers.LayerNamer`: the model wrapper
        dropped, a repeated block ``h/*`` one unit and the units above it not counted: GPT-2's
        ``transformer/h/*/attn`` at depth 2).
    :param warmup_steps: marked steps excluded from the start of the profile.
    :param top: number of ops in ``top_ops``.
    :param expand: one layer per repeated-block instance (``h/0``, ``h/1``...) instead of ``h/*``.
    :param topology: ``4x4x4`` (TPU slice) or ``8x2`` (GPUs per node x nodes); default from the chip and the
        device count.
    :param model_flops_per_step: the model's FLOPs of one step over all devices (e.g. 6·N·T) for the MFU;
        default: executed FLOPs without the rematerialised forward.
    :param jobs: hosts (profile files) read in parallel processes (``None``: the cores this process may use).
    :param dask_address: read the hosts on this Dask cluster instead (``tcp://host:8786``; extra ``dask``).
    :raises TraceroofError: bad input (see :mod:`parsers.errors`), unknown chip, HLO that does not match.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if isinstance(hlo, (str, Path)):
        hlo = [hlo]
    inputs = discover(paths, hlo)
    if inputs.kind == "xprof_hlo_stats":
        return _analyze_export(inputs, chip, depth, top, topology, model_flops_per_step)
    with progress(2, "analysis") as bar:
        profile = load_profile(inputs, jobs=jobs, dask_address=dask_address)
        bar.advance()
        a = _analyze_profile(profile, chip, depth, warmup_steps, top, optimizer_pattern, topology,
                             model_flops_per_step, expand)
        bar.advance()
    return a


def _analyze_profile(profile: Profile, chip: str | Chip | None, depth: int, warmup_steps: int, top: int,
                     optimizer_pattern: str, topology: str | None, model_flops_per_step: float | None,
                     expand: bool) -> Analysis:
    """The analysis of a loaded profile (see :func:`analyze` for the parameters)."""
    notes = list(profile.notes)
    target, chip_note = resolve_chip(profile, chip)
    chip_ici = target  # links stay per chip
    target, core_note = per_device_chip(target)
    chip_note = "; ".join(x for x in (chip_note or (chip_ici.note if core_note else ""), core_note) if x)
    ops, join, timeline = build_op_table(profile, depth, optimizer_pattern, expand)
    framework = "framework_scope" in ops
    unknown = sorted({i.opcode for m in profile.modules for c in m.computations.values() for i in c.instructions
                      if not is_known_opcode(i.opcode)})
    if unknown:
        notes.append(f"opcodes unknown to traceroof kept with no FLOPs (bytes counted): {', '.join(unknown[:8])}")
    if "traceroof_flops" in ops:
        notes += _cost_disagreements(ops)
    user = {str(f) for f in profile.inputs.user_hlo_files}
    hlo_sources = dict(profile.hlo_sources)
    if user and not user & (set(join.matched_sources) | profile.dump_sources):
        ran = sorted({f"{m}({p})" if pd.notna(p) else str(m) for m, p in
                      profile.events[["module", "program_id"]].drop_duplicates().itertuples(index=False)})
        if join.events_joined < join.events_total:
            raise HloMismatchError(f"none of the {join.events_total:,} op events match the HLO given (the profile "
                                   f"ran {', '.join(ran[:4])}); pass the after-optimization dumps of the profiled run")
        notes.append(f"the HLO given (--hlo) describes none of the profiled programs ({', '.join(ran[:4])}): "
                     "ignored; the profile carries its own")
        ignored = sum(1 for m in profile.modules if str(m.source) in user)
        hlo_sources["HLO text dumps"] = hlo_sources.get("HLO text dumps", 0) - ignored
        hlo_sources = {k: v for k, v in hlo_sources.items() if v > 0}
    if not profile.modules and not framework:
        notes.append("no usable HLO (no dumps, no HloProto in the profile that decodes): times only; pass --hlo DIR "
                     "(an --xla_dump_to folder) for the roofline")
    if framework:
        notes.append("no XLA ops in this profile (framework ops without HLO, e.g. TensorFlow without XLA): times "
                     "per framework op and name scope only; no HLO roofline is possible")
    unattributed = ops[~ops["attributed"]] if "attributed" in ops and not framework else ops.iloc[:0]
    if len(unattributed):
        share = unattributed["duration_ps"].sum() / max(join.time_total_ps, 1)
        kernels = ", ".join(sorted(unattributed["kernel"].astype(str).unique())[:3])
        notes.append(f"{len(unattributed):,} kernel events ({share:.1%} of kernel time) carry no hlo_op: "
                     f"unattributed kernel time ({kernels})")
    missing = join.events_total - join.events_joined - len(unattributed)
    if profile.modules and missing > 0:
        share = 1 - (join.time_joined_ps + unattributed["duration_ps"].sum()) / max(join.time_total_ps, 1)
        notes.append(f"{missing:,} of {join.events_total:,} op events "
                     f"({share:.1%} of op time) have no HLO"
                     + (f" (modules without HLO: {', '.join(join.unmatched_modules[:5])})"
                        if join.unmatched_modules else "")
                     + (f" (ambiguous module names: {', '.join(join.ambiguous_modules)})"
                        if join.ambiguous_modules else "")
                     + "; pass --hlo DIR with those modules' dumps")
    collectives = ops.attrs.get("collectives", [])
    n_devices = max([module_devices(m) for m in profile.modules] + [int(ops["device"].nunique())])
    try:
        topo = parse_topology(topology, chip_ici) if topology else default_topology(chip_ici, n_devices)
    except ValueError as e:
        raise InputError(str(e)) from None
    estimates = {i: expected_time(c, chip_ici, topo) for i, c in enumerate(collectives) if c is not None}
    comm = np.array([estimates[i].time_s if estimates.get(i) else 0.0 for i in range(len(collectives))] + [0.0])
    cid = ops["collective_id"].to_numpy()
    ops["comm_s"] = comm[np.where(cid >= 0, cid, len(collectives))] * ops["executions"].to_numpy()
    ops["comm_latency_bound"] = _latency_bound(estimates, len(collectives))[np.where(cid >= 0, cid, len(collectives))]
    if any(c is not None for c in collectives) and topo.kind == "host":
        notes.append("collectives between virtual CPU devices share one memory: no link model, judged on memory "
                     "traffic only")
    ops = apply_roofline(ops, target)
    notes += precision_notes(ops, target)
    ops = exposed_communication(ops, timeline, _async_pairs(profile.modules))

    steps = profile.steps
    if steps.empty:
        first = int(timeline.start_ps.min()) if len(timeline) else 0
        last = int((timeline.start_ps + timeline.duration_ps).max()) if len(timeline) else 0
        ops["step"] = pd.array(np.zeros(len(ops), np.int64), "Int64")
        steps = pd.DataFrame({"host": [""], "step": pd.array([0], "Int64"), "start_ps": [first], "end_ps": [last]})
        notes.append("no steps marked (jax.profiler.StepTraceAnnotation): the whole profile is one step")
        warmup_steps = 0
    all_steps = sorted(set(int(s) for s in steps["step"].dropna()))
    if len(all_steps) <= warmup_steps and warmup_steps:
        notes.append(f"only {len(all_steps)} step(s) marked: none excluded as warm-up")
        warmup_steps = 0
    used = tuple(all_steps[warmup_steps:])
    sel = steps[steps["step"].isin(used)]
    durations, host_mean = _step_durations(sel, notes, marked=not profile.step_annotation.startswith("executions"))
    step_mean = float(durations.mean()) if len(durations) else float("nan")
    step_std = float(durations.std(ddof=1)) if len(durations) > 1 else 0.0
    ops["step"] = ops["step"].where(ops["step"].isin(used))
    counted = ops[ops["counted"] & ops["step"].notna()]  # op rows of the used steps
    n_dev = max(counted["device"].nunique(), 1)
    stats = execution_stats(counted, timeline)
    skew = arrival_skew(ops, timeline)
    counted = per_op(counted)  # from here on per-op sums over devices and steps: a small table
    per = max(len(used), 1) * n_dev  # totals over the used steps and devices -> per step, per device
    flops = float(counted["flops"].sum()) / per
    hbm = float(counted["hbm_bytes"].sum()) / per
    expected = float(counted["expected_s"].sum()) / per
    op_time = float(counted["measured_s"].sum()) / per
    exposed_comm = float(counted["comm_exposed_s"].sum()) / per
    peak, peak_key = main_matmul_peak(counted, target, "f32")
    program_devices = max([module_devices(m) for m in profile.modules] + [n_dev])
    model_flops, model_source, mfu, hfu = flop_utilization(counted, per, step_mean, peak, program_devices,
                                                           model_flops_per_step)
    if not join.events_joined:
        mfu = hfu = float("nan")
    efficiency = expected / step_mean if step_mean > 0 and join.events_joined else float("nan")
    notes += utilization_notes(mfu, hfu, peak, peak_key, efficiency)
    summary = Summary(
        input=profile.inputs.description, device=profile.device_description, chip_id=target.id,
        chip_name=target.name, chip_note=chip_note or target.note, peak_flops_per_s=target.peak_flops_per_s,
        hbm_bandwidth_bytes_per_s=target.hbm_bandwidth_bytes_per_s, step_annotation=profile.step_annotation,
        steps_total=len(all_steps), steps_used=used, warmup_steps=min(warmup_steps, len(all_steps)),
        step_time_mean_s=step_mean, step_time_std_s=step_std, flops_per_step=flops, hbm_bytes_per_step=hbm,
        expected_per_step_s=expected, op_time_per_step_s=op_time, mfu=mfu, mfu_peak_key=peak_key,
        roofline_efficiency=efficiency,
        devices=n_dev, join=join, exposed_comm_per_step_s=exposed_comm,
        step_times_s=tuple(float(x) for x in durations),
        hlo_sources=hlo_sources, notes=tuple(notes), host_step_time_mean_s=host_mean,
        model_flops_per_step=model_flops, model_flops_source=model_source, hfu=hfu,
        chip_calibrated_at=target.calibrated_at, decoder=profile.decoder,
    )
    layers = rollup(counted, per, step_mean, stats)
    coll_table = collectives_table(counted, collectives, estimates, per, skew, len(used))
    return Analysis(summary, ops, layers, top_ops(counted, per, top, stats), steps, depth,
                    tuple(_findings(summary, counted, per, target.kind) + outlier_findings(stats)
                          + layout_findings(counted, per)
                          + communication_findings(coll_table, skew, summary, len(used), topo.kind == "host")),
                    coll_table, topo.describe(), per)


def _step_durations(sel: pd.DataFrame, notes: list[str], marked: bool = True) -> tuple[np.ndarray, float]:
    """Per-step times (s) of the used steps: the device time (first launch -> last op end, see
    :func:`traceroof.steps.device_step_spans`) where every step has one, else the annotation's; and the
    annotations' mean. For ``marked`` steps (annotations, not executions) a note says when the two differ by more
    than ``STEP_TIME_DISAGREEMENT``, and which side waits."""
    host = _valid_steps((sel["end_ps"] - sel["start_ps"]).to_numpy(np.float64) * 1e-12, "step annotations",
                        notes)
    host_mean = float(host.mean()) if len(host) else float("nan")
    if not len(sel) or "device_end_ps" not in sel or sel["device_end_ps"].isna().any():
        return host, host_mean
    device = _valid_steps((sel["device_end_ps"] - sel["device_start_ps"]).to_numpy(np.float64) * 1e-12,
                          "device steps (first launch -> last op end)", notes)
    if not len(device):
        return host, host_mean
    dev_mean = float(device.mean())
    if marked and abs(dev_mean - host_mean) > STEP_TIME_DISAGREEMENT * max(dev_mean, 1e-30):
        why = ("asynchronous dispatch: the host runs ahead of the device" if dev_mean > host_mean else
               "the host spends longer per step than the device: Python, dispatch or input work")
        notes.append(f"device step time (first launch -> last op end) {dev_mean * 1e3:.3f} ms differs from the "
                     f"step annotations' {host_mean * 1e3:.3f} ms ({why}); per-step figures use the device time")
    return device, host_mean


def _valid_steps(durations_s: np.ndarray, what: str, notes: list[str]) -> np.ndarray:
    """The step durations (s) that are positive and finite; the others (an end before its start, times that
    wrapped or overflowed) are dropped with a note saying how many."""
    ok = np.isfinite(durations_s) & (durations_s > 0)
    if not ok.all():
        bad = durations_s[~ok]
        notes.append(f"{len(bad)} of {len(durations_s)} {what} have a duration that is not a positive time "
                     f"({', '.join(f'{x:.3g} s' for x in bad[:3])}): the profile's times are inconsistent "
                     "(an end before its start, or wrapped timestamps); those steps are left out of the step time")
    return durations_s[ok]


def _findings(s: Summary, counted: pd.DataFrame, per: int, chip_kind: str = "") -> list[str]:
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


def _analyze_export(inputs: Inputs, chip: str | Chip | None, depth: int, top: int,
                    topology: str | None = None, model_flops_per_step: float | None = None) -> Analysis:
    """Analysis of an XProf HLO Op Stats export (rows aggregated over occurrences, cores and steps)."""
    path = inputs.profiles[0]
    ops, ctx, notes = export_op_table(path, depth)
    if isinstance(chip, Chip):
        target, note = chip, ""
    elif chip:
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
    topo = parse_topology(topology, chip_ici) if topology else default_topology(chip_ici, max(ids, default=0) + 1)
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
    efficiency = expected / step_mean if step_mean > 0 else float("nan")
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
        roofline_efficiency=efficiency, devices=cores, join=join,
        step_times_s=tuple(full) if steps else (),
        hlo_sources={"XProf hlo_stats export (instruction text per row)": 1}, notes=tuple(notes),
        exposed_comm_per_step_s=float("nan"),  # an export has no timeline
        model_flops_per_step=model_flops, model_flops_source=model_source, hfu=hfu,
        chip_calibrated_at=target.calibrated_at,
    )
    layers = rollup(ops, per, step_mean)
    coll_table = collectives_table(ops[ops["counted"]], collectives, estimates, per, pd.DataFrame(), 0)
    stats = execution_stats(counted)
    return Analysis(summary, ops, layers, top_ops(counted, per, top, stats), pd.DataFrame(), depth,
                    tuple(_findings(summary, counted, per, target.kind) + outlier_findings(stats)
                          + layout_findings(counted, per)),
                    coll_table, topo.describe() + " (chips of the program's replica groups)", per)


def _latency_bound(estimates: dict, n: int) -> np.ndarray:
    """Per collective id (and one trailing False for non-collectives): the estimate is latency-bound."""
    return np.array([bool(estimates.get(i) and estimates[i].latency_bound) for i in range(n)] + [False])


def flop_utilization(counted: pd.DataFrame, per: float, step_s: float, peak: float | None, program_devices: int,
                     model_flops_per_step: float | None = None) -> tuple[float, str, float, float]:
    """(model FLOPs per step per device, where they came from, MFU, HFU).

    Model FLOPs: the user's whole-program count per step (e.g. 6·N·T) ÷ ``program_devices``, else the executed
    FLOPs of ``counted`` rows without the rematerialised forward (phase ``remat``, or XProf's remat flag) and
    without random-bit generation (:func:`_random_bits`).
    MFU = model FLOPs ÷ step time ÷ peak; HFU = executed FLOPs ÷ step time ÷ peak (How to Scale Your Model
    §4.3.2; ``docs/reference/hardware-and-rooflines.md`` §1). NaN without a peak or a step time.
    """
    executed = float(counted["flops"].sum()) / per if per else float("nan")
    if model_flops_per_step is not None:
        model = float(model_flops_per_step) / max(program_devices, 1)
        source = (f"given: {float(model_flops_per_step):.4g} FLOP per step over {program_devices} device(s) "
                  "(--model-flops-per-step)")
    else:
        remat = counted["phase"].astype(str).to_numpy() == "remat"
        if "remat" in counted:
            remat |= counted["remat"].fillna(False).to_numpy(bool)
        rng = _random_bits(counted) & ~remat
        model = float(counted.loc[~remat & ~rng, "flops"].sum()) / per if per else float("nan")
        recomputed = float(counted.loc[remat, "flops"].sum()) / per if per else 0.0
        source = f"counted: executed FLOPs less {recomputed:.4g} FLOP of rematerialised forward"
        if rng.any():
            random = float(counted.loc[rng, "flops"].sum()) / per if per else 0.0
            source += f" and {random:.4g} FLOP of random-bit generation (unsigned-integer ops)"
    if not peak or not step_s or step_s <= 0 or np.isnan(step_s):
        return model, source, float("nan"), float("nan")
    return model, source, model / step_s / peak, executed / step_s / peak


def _random_bits(counted: pd.DataFrame) -> np.ndarray:
    """Rows that generate random bits (jax.random's threefry hash: unsigned-integer adds, shifts, xors): ops whose
    result is an unsigned integer, and RNG work outside any layer (phase ``other``). They are executed work (HFU)
    but not model FLOPs (the 6·N·T of How to Scale Your Model §4 counts the matmuls' multiply-adds): dropout's
    bits can be a third of a small transformer's counted FLOPs."""
    rng = counted["phase"].astype(str).to_numpy() == "other"
    if "dtype" in counted:
        rng |= counted["dtype"].astype(str).str.fullmatch(r"u\d+").fillna(False).to_numpy(bool)
    return rng


def utilization_notes(mfu: float, hfu: float, peak: float | None, peak_key: str,
                      roofline_efficiency: float = float("nan")) -> list[str]:
    """Notes on whole-step figures that cannot be right, shown as computed: MFU or HFU outside [0, 1] (more FLOPs
    per second than the peak is impossible: the FLOP count, the step time or the chip's peak is wrong), and a
    roofline efficiency above ``FASTER_THAN_ROOF_RATIO`` (the roofline expects far longer than the step took)."""
    out = []
    odd = [f"{name} {v:.3g}" for name, v in (("MFU", mfu), ("HFU", hfu)) if not np.isnan(v) and not 0 <= v <= 1]
    if odd:
        out.append(f"{' and '.join(odd)} outside 0-100 % of the {peak_key} peak ({peak or float('nan'):.3g} "
                   "FLOP/s): impossible, so the FLOP count, the step time or the chip's peak is wrong; check "
                   "--model-flops-per-step, the chip file and the profile's times")
    if roofline_efficiency > FASTER_THAN_ROOF_RATIO:
        out.append(f"roofline efficiency {roofline_efficiency:.3g}: the roofline expects more than "
                   f"{FASTER_THAN_ROOF_RATIO:g}x the measured step time, so the chip's figures understate it or "
                   "the op counts overstate the work (ops counted twice, a step time that is too short)")
    return out


def _cost_disagreements(ops: pd.DataFrame) -> list[str]:
    """Where libtpu's per-op FLOPs (profile stats) and traceroof's own count differ by more than 10 %."""
    d = ops[ops["joined"] & ops["profile_flops"].notna()]
    if d.empty:
        return []
    g = d.groupby(["module", "hlo_op"], observed=True)[["profile_flops", "traceroof_flops"]].first()
    diff = g[(g["profile_flops"] - g["traceroof_flops"]).abs()
             > COST_DISAGREEMENT * g[["profile_flops", "traceroof_flops"]].max(axis=1)]
    if diff.empty:
        return [f"libtpu's per-op FLOPs agree with traceroof's count within 10 % on all {len(g)} ops"]
    names = ", ".join(f"{op} (profile {r.profile_flops:.3g}, ours {r.traceroof_flops:.3g})"
                      for (_, op), r in diff.head(3).iterrows())
    return [f"libtpu's per-op FLOPs (used) differ from traceroof's count by > 10 % on {len(diff)} of {len(g)} "
            f"ops: {names}"]


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


