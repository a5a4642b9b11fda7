"""``analyze()``: a profile's hosts read (:mod:`traceroof.profile`), its events aggregated into op rows joined to
HLO costs (:mod:`traceroof.optable`), the roofline on the target chip, steps, and every table of the report
(per-op figures :mod:`traceroof.opstats`, layers :mod:`traceroof.layers`, collectives
:mod:`traceroof.communication`, whole-step figures :mod:`traceroof.utilization`, findings)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from parsers.errors import InputError
from parsers.hlo import HloModule
from parsers import storage
from parsers.storage import Location, is_url
from parsers.hlo_text import is_known_opcode
from traceroof.breakdown import analysis_breakdown
from traceroof.chips import Chip, detect_chip, get_chip, host_cache_path, host_chip, per_device_chip
from traceroof.collectives import Collective, expected_time, module_devices, topology_for
from traceroof.communication import _async_pairs, _latency_bound, collectives_table
from traceroof.discovery import NEARBY_RUN_S, discover
from traceroof.export_analysis import analyze_export
from traceroof.findings import FindingInputs, with_findings
from traceroof.hlo_source import HloMismatchError
from traceroof.layers import DEFAULT_OPTIMIZER_PATTERN, rollup
from traceroof.memory import analysis_memory
from traceroof.mesh_book import book_on_mesh
from traceroof.optable import SharedList, op_table, per_op
from traceroof.opstats import execution_stats, top_ops
from traceroof.overlap import arrival_skew, collective_rows, exposed_communication
from traceroof.profile import Profile, load_profile
from traceroof.progress import progress
from traceroof.rowcosts import RowCosts
from traceroof.results import Analysis, Summary  # noqa: F401 (the API: traceroof.analysis.Analysis)
from traceroof.roofline import main_matmul_peak, precision_notes, roofline_rows
from traceroof.steps import steps_on_every_host, steps_with_ops
from traceroof.utilization import (_step_durations, flop_utilization, overlapping_ops_note, peak_below_achieved,
                                   shared_host_note, step_periods, utilization_notes)

COST_DISAGREEMENT = 0.1  # libtpu vs traceroof per-op FLOPs differing by more than this are listed
HLO_IGNORED = "the HLO given (--hlo) describes none of the profiled programs"  # a note's start: the dumps unused


def resolve_chip(profile: Profile, chip: str | Path | Chip | None) -> tuple[Chip, str]:
    """The target chip and a note saying why it was chosen.

    :raises ChipError: no chip given for a device profile (detection needs a known device), or unknown name.
    """
    if isinstance(chip, Chip):
        return chip, ""
    if chip is not None:
        return get_chip(chip), ""
    if profile.device_kind == "cpu":
        c = host_chip()
        note = (f"CPU profile judged against this machine's calibration ({host_cache_path()}; "
                "`traceroof calibrate` re-measures it)")
        return c, note + (f"; {c.load_note}" if c.load_note else "")
    return detect_chip(profile.plane_stats)


def analyze(paths: str | Path | Sequence[str | Path], hlo: str | Path | Sequence[str | Path] = (),
            chip: str | Path | Chip | None = None, depth: int = 2, warmup_steps: int = 1, top: int = 10,
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
        default: executed FLOPs without the rematerialised forward and the optimizer update.
    :param jobs: hosts (profile files) read in parallel processes (``None``: the cores this process may use).
    :param dask_address: read the hosts on this Dask cluster instead (``tcp://host:8786``; extra ``dask``).
    :raises TraceroofError: bad input (see :mod:`parsers.errors`), unknown chip, HLO that does not match.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if isinstance(hlo, (str, Path)):
        hlo = [hlo]
    if dask_address:  # the workers open the files: relative paths would be relative to their folders
        paths, hlo = ([p if is_url(str(p)) else Path(p).absolute() for p in ps] for ps in (paths, hlo))
    inputs = discover(paths, hlo)
    if inputs.kind == "xprof_hlo_stats":
        return analyze_export(inputs, chip, depth, top, topology, model_flops_per_step)
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
    ops, join, timeline, collectives, scopes, costs = op_table(profile, depth, optimizer_pattern, expand)  # no attrs
    framework = "framework_scope" in ops
    user = {str(f) for f in profile.inputs.user_hlo_files}
    hlo_sources = dict(profile.hlo_sources)
    if user and not user & (set(join.matched_sources) | profile.dump_sources):
        ran = sorted({f"{m}({p})" if pd.notna(p) else str(m) for m, p in
                      profile.rows[["module", "program_id"]].drop_duplicates().itertuples(index=False)})
        before = sorted(Path(f).name for f in user if "before_optimizations" in Path(f).name)
        why = (f" ({', '.join(before[:2])}: HLO before XLA's optimizations, which is not the program that ran; "
               "pass the *after_optimizations* dump)" if before else "")
        if join.events_joined < join.events_total:
            raise HloMismatchError(f"none of the {join.events_total:,} op events match the HLO given (the profile "
                                   f"ran {', '.join(ran[:4])}){why}; pass the after-optimization dumps of the "
                                   "profiled run")
        notes.append(f"{HLO_IGNORED} ({', '.join(ran[:4])}){why}: "
                     "ignored; the profile carries its own")
        ignored = sum(1 for m in profile.modules if str(m.source) in user)
        hlo_sources["HLO text dumps"] = hlo_sources.get("HLO text dumps", 0) - ignored
        hlo_sources = {k: v for k, v in hlo_sources.items() if v > 0}
        # and out of the analysis: a dump of another program (a user's MoE dump given for a pipeline profile)
        # drove the mesh, parallelism and memory sections; the table again, its scopes by the modules' positions
        profile = replace(profile, modules=[m for m in profile.modules if str(m.source) not in user])
        ops, join, timeline, collectives, scopes, costs = op_table(profile, depth, optimizer_pattern, expand)
    unknown = sorted({i.opcode for m in profile.modules for c in m.computations.values() for i in c.instructions
                      if not is_known_opcode(i.opcode)})
    if unknown:
        notes.append(f"opcodes unknown to traceroof kept with no FLOPs (bytes counted): {', '.join(unknown[:8])}")
    if costs.tpu:
        notes += _cost_disagreements(ops, costs)
    if not profile.modules and not framework:
        notes.append("no usable HLO (no dumps, no HloProto in the profile that decodes): times only; pass --hlo DIR "
                     "(an --xla_dump_to folder) for the roofline")
    by_name = ~ops["joined"].to_numpy(bool) & collective_rows(ops)
    if by_name.any() and not framework:
        names = sorted(set(ops["hlo_op"].array[by_name].astype(str)))
        notes.append(f"{len(names)} op(s) without HLO taken for collectives by their names ({', '.join(names[:4])}"
                     f"{' ...' if len(names) > 4 else ''}): exposed communication counts them; their sizes, groups "
                     "and links need the HLO (analyze the .xplane.pb, or pass --hlo)")
    if framework:
        notes.append("no XLA ops in this profile (framework ops without HLO, e.g. TensorFlow without XLA): times "
                     "per framework op and name scope only; no HLO roofline is possible")
    unattributed = ~ops["attributed"].to_numpy(bool) if "attributed" in ops and not framework else \
        np.zeros(len(ops), bool)
    unattributed_ps = int(ops["duration_ps"].to_numpy()[unattributed].sum())
    unattributed_events = int(ops["events"].to_numpy()[unattributed].sum())
    if unattributed.any():
        share = unattributed_ps / max(join.time_total_ps, 1)
        kernels = ", ".join(sorted(ops["kernel"][unattributed].astype(str).unique())[:3])
        notes.append(f"{unattributed_events:,} kernel events ({share:.1%} of kernel time) carry no hlo_op: "
                     f"unattributed kernel time ({kernels})")
    missing = join.events_total - join.events_joined - unattributed_events
    if profile.modules and missing > 0:
        share = 1 - (join.time_joined_ps + unattributed_ps) / max(join.time_total_ps, 1)
        notes.append(f"{missing:,} of {join.events_total:,} op events "
                     f"({share:.1%} of op time) have no HLO"
                     + (f" (modules without HLO: {', '.join(join.unmatched_modules[:5])})"
                        if join.unmatched_modules else "")
                     + (f" (ambiguous module names: {', '.join(join.ambiguous_modules)})"
                        if join.ambiguous_modules else "")
                     + "; pass --hlo DIR with those modules' dumps")
    hosts = _hosts_with_ops(profile.rows)
    profiled = int(ops["device"].nunique())
    needed = _program_devices(profile.modules, collectives)
    n_devices = max(needed, profiled)
    topo, topo_note = topology_for(topology, chip_ici, n_devices, _host_count(len(hosts), profiled, needed))
    notes += [topo_note] * bool(topo_note)
    notes += _missing_hosts(needed, profiled, hosts, profile.inputs.nearby_runs)
    other_runs = profile.inputs.other_runs
    if other_runs:
        names = ", ".join(storage.name(r) for r in other_runs[-3:])
        notes.append(f"the logdir holds {len(other_runs)} other run(s) with profiles ({'..., ' * (len(other_runs) > 3)}"
                     f"{names}): only the latest was analyzed; pass a run directory (plugins/profile/<run>) to "
                     "analyze another")
    estimates = {i: expected_time(c, chip_ici, topo) for i, c in enumerate(collectives) if c is not None}
    comm = np.array([estimates[i].time_s if estimates.get(i) else 0.0 for i in range(len(collectives))] + [0.0])
    cid = ops["collective_id"].to_numpy()
    own_collective = [i if c is not None else len(collectives) for i, c in enumerate(collectives)]  # per op
    costs = costs.with_communication(comm[own_collective])
    ops["comm_latency_bound"] = _latency_bound(estimates, len(collectives))[np.where(cid >= 0, cid, len(collectives))]
    if any(c is not None for c in collectives) and topo.kind == "host":
        notes.append(f"collectives between CPU devices on {topo.hosts} hosts cross processes (over the network, "
                     "e.g. gloo TCP): no link model for CPU hosts, judged on memory traffic only" if topo.hosts > 1
                     else "collectives between virtual CPU devices share one memory: no link model, judged on "
                     "memory traffic only")
    ops, costs = roofline_rows(ops, costs, target)
    notes += precision_notes(ops, target, costs)
    pairs = _async_pairs(profile.modules)  # (program id, -done op) -> -start op, for both timelines below
    ops = exposed_communication(ops, timeline, pairs)

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
        if warmup_steps > 1:  # asked for: keeping every step (the compiling one too) would answer another question
            raise InputError(f"--warmup-steps {warmup_steps} excludes all {len(all_steps)} marked step(s) of "
                             f"{profile.inputs.description}; pass at most {max(len(all_steps) - 1, 0)}, or profile "
                             "more steps")
        notes.append(f"only {len(all_steps)} step(s) marked: none excluded as warm-up")
        warmup_steps = 0
    used = steps_with_ops(tuple(all_steps[warmup_steps:]), ops["step"], profile.step_annotation,
                          profile.inputs.description, notes)
    used = steps_on_every_host(used, steps, hosts, notes)
    sel = steps[steps["step"].isin(used)]
    durations, host_mean = _step_durations(sel, notes, marked=not profile.step_annotation.startswith("executions"))
    step_col = ops["step"]
    if step_col.dtype == "Int64":  # as isin and where, in numpy
        step_values = step_col.to_numpy(dtype="int64", na_value=0)
        in_used = step_col.notna().to_numpy(bool) & np.isin(step_values, np.asarray(used, np.int64))
        ops["step"] = pd.arrays.IntegerArray(step_values, ~in_used)
    else:
        in_used = step_col.isin(used).to_numpy(bool)
        ops["step"] = step_col.where(in_used)
    breakdown, step_timeline = analysis_breakdown(profile, ops, timeline, steps, used, pairs)
    durations = step_periods(breakdown, used, durations, notes)
    step_mean = float(durations.mean()) if len(durations) else float("nan")
    step_std = float(durations.std(ddof=1)) if len(durations) > 1 else 0.0
    at = np.flatnonzero(ops["counted"].to_numpy(bool) & in_used)  # op rows of the used steps
    device = ops["device"].array[at]
    n_dev = max(len(pd.unique(device[pd.notna(device)])), 1)
    stats = execution_stats(ops, timeline, at)
    skew = arrival_skew(ops, timeline)
    counted = per_op(ops, at, costs)  # from here on per-op sums over devices and steps: a small table
    per = max(len(used), 1) * n_dev  # totals over the used steps and devices -> per step, per device
    flops = float(counted["flops"].sum()) / per
    step_flops = _step_flops(ops, at, costs, used, n_dev) if join.events_joined else ()
    hbm = float(counted["hbm_bytes"].sum()) / per
    expected = float(counted["expected_s"].sum()) / per
    op_time = float(counted["measured_s"].sum()) / per
    exposed_comm = float(counted["comm_exposed_s"].sum()) / per
    peak, peak_key = main_matmul_peak(counted, target, "f32")
    program_devices = max(needed, n_dev)
    model_flops, model_source, mfu, hfu = flop_utilization(counted, per, step_mean, peak, program_devices,
                                                           model_flops_per_step)
    if not join.events_joined:
        mfu = hfu = float("nan")
    # no expected time (a chip without figures: an uncalibrated host) gives no efficiency, not 0 %
    efficiency = expected / step_mean if step_mean > 0 and expected > 0 and join.events_joined else float("nan")
    notes += utilization_notes(mfu, hfu, peak, peak_key, efficiency)
    notes += peak_below_achieved(counted, peak, peak_key, target.kind)
    notes += overlapping_ops_note(op_time, step_mean)
    notes += shared_host_note(mfu, hfu, efficiency, n_dev // max(len(hosts), 1), target.kind)
    # devices that are threads of one CPU host, judged on any chip (--chip h100 too); a trace JSON does not say
    virtual = topo.kind == "host" or (profile.device_kind == "cpu" and profile.inputs.kind == "xplane")
    summary = Summary(
        input=profile.inputs.description, device=profile.device_description, chip_id=target.id,
        chip_name=target.name, chip_note=chip_note or target.note, peak_flops_per_s=target.peak_flops_per_s,
        hbm_bandwidth_bytes_per_s=target.hbm_bandwidth_bytes_per_s, step_annotation=profile.step_annotation,
        steps_total=len(all_steps), steps_used=used, warmup_steps=min(warmup_steps, len(all_steps)),
        step_time_mean_s=step_mean, step_time_std_s=step_std, flops_per_step=flops, hbm_bytes_per_step=hbm,
        expected_per_step_s=expected, op_time_per_step_s=op_time, mfu=mfu, mfu_peak_key=peak_key,
        roofline_efficiency=efficiency,
        devices=n_dev, hosts=max(len(hosts), 1), join=join, exposed_comm_per_step_s=exposed_comm,
        step_times_s=tuple(float(x) for x in durations), step_flops=step_flops,
        hlo_sources=hlo_sources, notes=tuple(notes), host_step_time_mean_s=host_mean,
        model_flops_per_step=model_flops, model_flops_source=model_source, hfu=hfu,
        chip_calibrated_at=target.calibrated_at, decoder=profile.decoder, virtual_devices=virtual,
    )
    layers = rollup(counted, per, step_mean, stats)
    coll_table = collectives_table(counted, collectives, estimates, per, skew, len(used))
    par = book_on_mesh(profile.modules, chip_ici, topo, coll_table, profile.dump_sources)  # traceroof.mesh_book
    ops.attrs["collectives"] = counted.attrs["collectives"] = SharedList(collectives)  # as build_op_table's
    # (set last: pandas deep-copies attrs into every selection made of a frame)
    a = Analysis(summary, ops, layers, top_ops(counted, per, top, stats), steps, depth, (), coll_table,
                 topo.describe(), per, per_op_rows=counted, step_breakdown=breakdown, step_timeline=step_timeline,
                 memory=analysis_memory(profile, ops, target.value("memory.hbm_bytes"),
                                        scopes if optimizer_pattern == DEFAULT_OPTIMIZER_PATTERN else None),
                 parallelism=par, row_costs=costs)
    return with_findings(a, FindingInputs(a, counted, target, stats, skew, len(used), virtual,
                                          tuple(profile.modules)))


def _step_flops(ops: pd.DataFrame, at: np.ndarray, costs: RowCosts, used: Sequence[int], n_dev: int,
                ) -> tuple[float, ...]:
    """FLOPs per device of each used step (``used``, in order), summed over the op rows ``at`` (counted rows of
    the used steps) by their ``step``: their mean is the summary's FLOPs per step. Work that varies with the data
    (an adaptive solver's or a while loop's trip count) varies from step to step (s38 trial: 67-264 MFLOP)."""
    step = ops["step"].to_numpy(dtype="int64", na_value=-1)
    order = np.asarray(used, np.int64)
    group = np.full(len(ops), len(order), np.int64)
    group[at] = np.searchsorted(order, step[at])
    return tuple(float(x) / n_dev for x in costs.sums(ops, group, len(order), at, ("flops",))["flops"])


def _hosts_with_ops(rows: pd.DataFrame) -> list[str]:
    """The hosts that hold op rows (the op table's ``host`` column: categorical, or text)."""
    host = rows["host"].array if "host" in rows else pd.Categorical([])
    if isinstance(host, pd.Categorical):
        codes = host.codes[host.codes >= 0]
        return [str(c) for c in host.categories[np.flatnonzero(np.bincount(codes, minlength=len(host.categories)))]]
    return sorted({str(h) for h in pd.unique(host) if pd.notna(h)})


def _program_devices(modules: Sequence[HloModule], collectives: Sequence[Collective | None]) -> int:
    """Devices the programs run on: their headers' ``num_partitions`` x ``replica_count``, or (an HloProto from
    the profile has no header) one more than the largest device its collectives' groups name."""
    ids = [d for c in collectives if c is not None for g in c.groups for d in g] + \
        [d for c in collectives if c is not None for pair in c.source_target_pairs for d in pair]
    return max([module_devices(m) for m in modules] + [max(ids, default=0) + 1])


def _host_count(hosts: int, profiled: int, needed: int) -> int:
    """CPU hosts the program runs on: the ``hosts`` holding op events, and when the program runs on more devices
    (``needed``) than they hold (``profiled``), enough more hosts for the rest at as many devices each."""
    hosts = max(hosts, 1)
    return max(hosts, -(-needed * hosts // profiled)) if needed > profiled > 0 else hosts


def _missing_hosts(needed: int, profiled: int, hosts: Sequence[str], nearby: Sequence[Location]) -> list[str]:
    """A note when the programs run on more devices than the profile holds op events of: hosts' profiles are
    missing (one host's file given, a file lost, or a capture split over run directories: ``nearby`` runs)."""
    if not needed > profiled > 0:
        return []
    where = f" (host{'s' * (len(hosts) > 1)} {', '.join(hosts)})" if hosts else ""
    note = (f"the program runs on {needed:,} devices but the profile holds op events of {profiled:,}{where}: the "
            "other hosts' profiles are missing (each host writes <its hostname>.xplane.pb: processes sharing a "
            "hostname overwrite each other's); ")
    if not nearby:
        return [note + "analyze the whole run directory"]
    return [note + f"run {', '.join(map(str, nearby))}, written within {NEARBY_RUN_S} s of the run analyzed, may "
            "hold them (hosts that stop their traces in different seconds write different run directories): pass "
            "both run directories"]


def _cost_disagreements(ops: pd.DataFrame, costs: RowCosts) -> list[str]:
    """Where libtpu's per-op FLOPs (profile stats) and traceroof's own count differ by more than 10 %."""
    at = np.flatnonzero(ops["joined"].to_numpy(bool) & ops["profile_flops"].notna().to_numpy(bool))
    d = ops.take(at).assign(traceroof_flops=costs.columns(ops, ("traceroof_flops",), at)["traceroof_flops"])
    if d.empty:
        return []
    per_exec = d[["profile_flops", "traceroof_flops"]].div(d["executions"].to_numpy(np.float64), axis=0)
    g = per_exec.groupby([d["module"], d["hlo_op"]], observed=True).first()  # per execution: rows are sums
    diff = g[(g["profile_flops"] - g["traceroof_flops"]).abs()
             > COST_DISAGREEMENT * g[["profile_flops", "traceroof_flops"]].max(axis=1)]
    if diff.empty:
        return [f"libtpu's per-op FLOPs agree with traceroof's count within 10 % on all {len(g)} ops"]
    names = ", ".join(f"{op} (profile {r.profile_flops:.3g}, ours {r.traceroof_flops:.3g})"
                      for (_, op), r in diff.head(3).iterrows())
    return [f"libtpu's per-op FLOPs (used) differ from traceroof's count by > 10 % on {len(diff)} of {len(g)} "
            f"ops: {names}"]
