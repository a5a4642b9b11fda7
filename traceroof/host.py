"""The per-host map of an analysis: one profile file (one host) read, its op events bounded and put in steps,
with the HLO of the programs it ran (:func:`read_host`). Hosts are independent, so a run directory's files
are read in parallel processes or on a Dask cluster (:func:`traceroof.parallel.map_hosts`); what travels back
is a :class:`HostEvents`: the events aggregated into op rows and their slim timeline
(:func:`traceroof.aggregate.aggregate_events`), the steps, the HLO modules and the notes."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from parsers import storage
from parsers.errors import FormatError, TraceroofError
from parsers.hlo import HloModule
from parsers.storage import Location
from parsers.trace_json import read_trace_json
from parsers.xspace import read_xspace
from traceroof.aggregate import Timeline, aggregate_events
from traceroof.asyncends import _bound_async_ends
from traceroof.discovery import RUN_TRACE_JSON_SUFFIXES, XPLANE_SUFFIXES
from traceroof.events import _host_of, _trace_json_events, _xspace_events
from traceroof.hlo_source import (check_dumps, embedded_hlo, fingerprint, parse_dumps, profile_hlo, reconcile,
                                  relevant_dumps)
from traceroof.hostactivity import host_activity
from traceroof.memory import AllocatorPeak, plane_allocators
from traceroof.steps import (assign_steps, device_step_spans, dominant_program_steps, entry_schedule,
                             left_out_executions, occasional_programs)
from traceroof.units import fmt_list

MAX_OP_EVENT_PS = 86_400 * 10**12  # one op event lasting longer than a day is corrupt, not slow


@dataclass(frozen=True)
class HostTask:
    """What one worker reads: a profile file (local path or URL) of ``kind`` ``xplane`` or ``trace_json``, and the
    HLO files (text dumps, HloProto files) that may describe its programs."""

    path: Location
    kind: str
    hlo_files: tuple[Location, ...] = ()
    hlo_proto_files: tuple[Location, ...] = ()
    analysis_id: str = ""  # one per analysis: a worker sends each program's HLO once per analysis (ModuleRef)


@dataclass(frozen=True)
class ModuleRef:
    """In :attr:`HostEvents.modules`, instead of an HLO module the same worker process already returned for an
    earlier host of the same analysis: its program id, name, :func:`~traceroof.hlo_source.fingerprint` and
    ``source`` (where this host's copy came from: an embedded HloProto names the host's file). The
    hosts of a pod run one program, so without this every host ships (pickles) its own copy of the program's
    HLO back, and the merge unpickles and fingerprints each one: 74 ms per host for the transformer fixture's
    2,209-instruction program, tens of seconds for a pod of hundreds of hosts running a large one."""

    program_id: int | None
    name: str
    fingerprint: str
    source: str = ""


_RETURNED: dict[str, set[tuple[int | None, str, str]]] = {}  # per analysis id: the modules this process returned
_RETURNED_ANALYSES = 4  # analysis ids remembered (``attach`` runs one analysis after another in one process)
_RETURNED_LOCK = threading.Lock()  # a Dask worker runs tasks in threads


@dataclass(eq=False)
class HostEvents:
    """One host's op events as op rows and their timeline (:func:`~traceroof.aggregate.aggregate_events`; times
    on the host's own clock), steps, HLO and notes.

    ``start_ns``: the host's ``profile_start_time`` (ns since the epoch) that aligns hosts, ``None`` when
    unknown. ``read_notes``: the file's own (parser notes); ``event_notes``: async ends and steps;
    ``hlo_notes``: HLO found, skipped or superseded. ``counts``: events dropped or repaired by kind, summed over
    hosts for the report's notes. ``modules``: ``(module, how)`` with how ``embedded`` / ``sidecar`` / ``dump``;
    a :class:`ModuleRef` instead of the module when this process returned it already (:func:`send_once`).
    """

    host: str
    rows: pd.DataFrame
    timeline: Timeline
    steps: pd.DataFrame
    device_kind: str = "cpu"
    device_description: str = ""
    step_annotation: str = ""
    plane_stats: dict[str, object] = field(default_factory=dict)
    start_ns: int | None = None
    decoder: str = ""
    read_notes: list[str] = field(default_factory=list)
    event_notes: list[str] = field(default_factory=list)
    hlo_notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    modules: list[tuple[HloModule | ModuleRef, str]] = field(default_factory=list)
    superseded: frozenset[str] = frozenset()
    host_activity: pd.DataFrame | None = None  # host threads' busy intervals (traceroof.hostactivity)
    allocators: tuple[AllocatorPeak, ...] = ()  # traceroof.memory.plane_allocators of the /host:CPU plane


def read_host(task: HostTask) -> HostEvents:
    """Read one host's profile file and HLO; bound async ends and put every event in its step.

    :raises FormatError: the file is corrupt. :raises HloParseError: an HLO file given does not parse.
    :raises HloMismatchError: a dump is not the program the events ran.
    """
    counts: dict[str, int] = {}
    read_notes: list[str] = []
    if task.kind == "xplane":
        try:
            xs = read_xspace(task.path)
            ev, steps, kind, desc, ann, stats, counts = _xspace_events(xs)
        except FormatError as e:
            raise FormatError(str(e) + _sibling_trace_json_hint(task.path)) from None
        embedded = embedded_hlo(xs)
        activity = host_activity(xs, _host_of(str(task.path)))
        try:
            allocators = plane_allocators(xs.plane("/host:CPU"))
        except TraceroofError as e:
            allocators = ()
            read_notes.append(f"allocator events not read: {e}")
        read_notes += xs.notes
        start_ns, decoder = xs.profile_start_time_ns, xs.decoder
        del xs
    else:
        tj = read_trace_json(task.path)
        read_notes += tj.notes
        if tj.maybe_truncated:
            counts["trace_cap_events"] = len(tj.complete_events)
            read_notes.append(f"{storage.name(task.path)} holds exactly {len(tj.complete_events):,} events, a "
                              "trace-viewer cap: events were probably dropped; analyze the .xplane.pb instead")
        ev, steps, ann = _trace_json_events(tj, task.path, counts)
        activity, allocators = None, ()
        kind, desc, stats, start_ns, decoder = ("cpu", "host CPU (trace JSON: no plane stats, no program ids)", {},
                                                None, "")
        embedded = []
        if task.hlo_files:
            read_notes += _sibling_xplane_note(task.path)
        del tj
    none, no_events = aggregate_events(ev.iloc[:0])
    out = HostEvents(_host_of(str(task.path)), none, no_events, steps, kind, desc, ann, stats, start_ns, decoder,
                     read_notes, counts=counts, host_activity=activity, allocators=allocators)
    if ev.empty:
        return out
    long_ops = (ev["duration_ps"] > MAX_OP_EVENT_PS).to_numpy(bool)
    if long_ops.any():
        ev = ev[~long_ops].reset_index(drop=True)
        counts["long_ops"] = counts.get("long_ops", 0) + int(long_ops.sum())
        if ev.empty:
            return out
    extra = profile_hlo(ev, embedded, task.hlo_proto_files, out.hlo_notes)
    truth = [m for m, _ in extra]
    texts = parse_dumps(relevant_dumps(task.hlo_files, ev), ev, out.hlo_notes,
                        covered={m.program_id for m in truth if m.program_id is not None})
    dumps, out.superseded = reconcile(texts, truth, out.hlo_notes)
    dumps = check_dumps(dumps, ev, out.hlo_notes)
    ev = _bound_async_ends(ev, truth + dumps, counts)
    schedules = {(m.program_id, m.name): entry_schedule(m) for m in truth + dumps}
    ev, out.steps, out.step_annotation = _steps_by_execution(ev, steps, ann, out.event_notes, counts, schedules)
    out.rows, out.timeline = aggregate_events(ev)
    out.modules = send_once(task.analysis_id, list(extra) + [(m, "dump") for m in dumps])
    return out


def _sibling_xplane_note(path: Location) -> list[str]:
    """The note that a trace JSON analyzed with HLO dumps was matched to them by op name only: it carries no HLO
    (nor program ids or shapes), so a dump of another compilation with the same op names (another batch size,
    sequence length or width) is taken for the program that ran, unchecked (a user's seq-128 dump for a seq-64
    run doubled the FLOPs; a s34 trial's batch-128 dump for a batch-64 run, exit 0). It names JAX's
    ``<host>.xplane.pb`` when it lies beside the trace: the xplane carries the HloProto that ran, against which
    dumps are checked."""
    sibling = _sibling(path, XPLANE_SUFFIXES)
    instead = (f"analyze {storage.name(sibling)} beside it instead, which carries that program's HLO" if sibling
               is not None else "analyze the .xplane.pb of the same capture instead (JAX writes it beside the trace "
               "JSON), which carries that program's HLO")
    return [f"a trace JSON carries no HLO, so the dumps given (--hlo) were matched by op name only, unchecked against "
            f"the program that ran (a dump of another batch size or sequence length would give wrong FLOPs and "
            f"bytes): {instead} (a dump of another compilation with the same op names is then dropped)"]


def _sibling(path: Location, suffixes: Sequence[str]) -> Location | None:
    """The same host's file of another kind beside ``path`` (its host name and the first of ``suffixes`` that
    exists), or None."""
    folder, host = storage.parent(path), _host_of(storage.name(path))
    return next((f for f in (storage.join(folder, host + suffix) for suffix in suffixes) if storage.is_file(f)), None)


def _sibling_trace_json_hint(path: Location) -> str:
    """For a corrupt ``.xplane.pb``: the hint to analyze the host's trace JSON beside it (TensorBoard writes both
    into a run directory), which a user with a truncated xplane may not think of; '' when there is none."""
    sibling = _sibling(path, RUN_TRACE_JSON_SUFFIXES)
    return (f"; or analyze {storage.name(sibling)} beside it, the same capture as a trace JSON (op times only: it "
            "carries no HLO)") if sibling is not None else ""


def send_once(analysis_id: str, modules: list[tuple[HloModule, str]]) -> list[tuple[HloModule | ModuleRef, str]]:
    """``modules`` with each one this process already returned for ``analysis_id`` replaced by its
    :class:`ModuleRef` (none replaced without an id). Called last in :func:`read_host`, so a module counts as
    returned only with a host that was read whole."""
    if not analysis_id:
        return list(modules)
    keys = [(m.program_id, m.name, fingerprint(m)[0]) for m, _ in modules]
    with _RETURNED_LOCK:
        if analysis_id not in _RETURNED:
            while len(_RETURNED) >= _RETURNED_ANALYSES:
                _RETURNED.pop(next(iter(_RETURNED)))
            _RETURNED[analysis_id] = set()
        sent = _RETURNED[analysis_id]
        out: list[tuple[HloModule | ModuleRef, str]] = [
            (ModuleRef(*key, m.source), how) if key in sent else (m, how) for (m, how), key in zip(modules, keys)]
        sent.update(keys)
    return out


def _steps_by_execution(events: pd.DataFrame, steps: pd.DataFrame, annotation: str, notes: list[str],
                        facts: dict[str, int], schedules: Mapping[tuple[int | None, str], Sequence[str]] | None = None
                        ) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """Put every op event in the step whose launch produced it (:mod:`traceroof.steps`); without step markers,
    each execution of the dominant program is a step. Steps gain ``device_start_ps`` / ``device_end_ps``. Op
    time not tied to a launch and executions launched outside the marked steps are added to ``facts`` (summed
    over hosts; :func:`step_notes` states them). ``schedules``: the programs' entry schedules, which tell an
    execution cut by the trace's start or stop when its program ran too few times to compare
    (:func:`~traceroof.steps.left_out_executions`)."""
    if not steps.empty and "device" in steps and steps["device"].notna().all():  # TPU / framework Steps lines
        step = assign_steps(events["start_ps"].to_numpy(np.int64), events["device"], steps, by="device")
        events = events.assign(step=pd.arrays.IntegerArray(np.maximum(step, 0), step < 0))
        return events, steps.assign(device_start_ps=steps["start_ps"], device_end_ps=steps["end_ps"]), annotation
    launch = events["launch_ps"].to_numpy(dtype="float64", na_value=np.nan)
    known = ~np.isnan(launch)
    start = events["start_ps"].to_numpy(np.int64)
    when = np.where(known, launch, start).astype(np.int64)  # (float64 both, as launch is)
    hosts = pd.Categorical(events["host"])
    cut = left_out_executions(events, known, schedules)
    before, after = cut.before, cut.after
    left_out = before | after
    if steps.empty:
        steps, module = (dominant_program_steps(events[~left_out], when[~left_out]) if left_out.any() else
                         dominant_program_steps(events, when))
        if module:
            annotation = f"executions of {module}"
            repeated = len(steps) > steps["host"].nunique()  # a step per execution: it ran more than once
            notes.append(f"no steps marked (jax.profiler.StepTraceAnnotation): each execution of {module}, the "
                         f"program with the most op time{' of those run more than once' if repeated else ''}, is a "
                         "step")
    step = assign_steps(when, hosts, steps)
    if annotation.startswith("executions of"):
        step[occasional_programs(step, hosts, events["module"], annotation.removeprefix("executions of "))] = -1
    has_run = events["run_id"].notna().to_numpy() if "run_id" in events else np.zeros(len(events), bool)
    duration = events["duration_ps"].to_numpy(np.int64)
    outside = (step < 0) & (known | has_run) & ~left_out
    marked = bool(annotation) and not annotation.startswith("executions of")
    runs = len(events.loc[outside, ["program_id", "run_id"]].drop_duplicates()) if outside.any() else 0
    untied = has_run & ~known & ~left_out
    cut_steps = np.unique(step[after & (step >= 0)]) if marked else step[:0]
    if runs:  # which programs (facts are counts summed over hosts: each name's own key)
        for name in set(events.loc[outside, "module"].dropna().astype(str).unique().tolist()) - {"", "nan"}:
            facts[OUTSIDE_PROGRAM + name] = facts.get(OUTSIDE_PROGRAM + name, 0) + 1
    for k, v in (("steps_op_ps", int(duration.sum())), ("steps_untied_ps", int(duration[untied].sum())),
                 ("steps_untied", int(untied.sum())), ("steps_outside_runs", runs),
                 ("steps_outside_ps", int(duration[outside].sum()) if runs else 0),
                 ("steps_before_runs", cut.executions_before), ("steps_before_ps", int(duration[before].sum())),
                 ("steps_cut_runs", cut.executions_after), ("steps_cut_ps", int(duration[after].sum())),
                 ("steps_cut_steps", len(cut_steps))):
        facts[k] = facts.get(k, 0) + v
    if left_out.any():  # and a marked step that launched an execution cut off at the end is incomplete: all of it
        step[left_out | np.isin(step, cut_steps)] = -1
    steps = device_step_spans(step, hosts, when, start + events["duration_ps"].to_numpy(np.int64), steps)
    return events.assign(step=pd.arrays.IntegerArray(np.maximum(step, 0), step < 0)), steps, annotation


OUTSIDE_PROGRAM = "steps_outside_program:"  # a fact per program with executions launched outside the steps


def step_notes(facts: dict[str, int]) -> list[str]:
    """The report's notes from the ``facts`` :func:`_steps_by_execution` recorded (summed over hosts): op time not
    tied to its launch, and executions launched outside the marked steps."""
    out = []
    total = max(facts.get("steps_op_ps", 0), 1)
    if facts.get("steps_untied", 0):
        out.append(f"{facts['steps_untied_ps'] / total:.1%} of op time could not be tied to its launch (no launch "
                   "event of its program in the profile): placed in steps by its own start time")
    if facts.get("launches_after_steps", 0):
        out.append(f"{facts['launches_after_steps']} program launch(es) after the last marked step left no op "
                   "event: a step still open when the trace stopped (its annotation and its device work are not in "
                   "the profile): left out")
    if facts.get("steps_before_runs", 0):
        out.append(f"{facts['steps_before_runs']} execution(s) ({facts['steps_before_ps'] / total:.1%} of op time) "
                   "began before the trace started (launched before it, still queued or running): left out of "
                   "per-step figures")
    if facts.get("steps_cut_runs", 0):
        steps = facts.get("steps_cut_steps", 0)
        out.append(f"{facts['steps_cut_runs']} execution(s) ({facts['steps_cut_ps'] / total:.1%} of op time) were "
                   "still running when the trace stopped (fewer op events than the other executions of their "
                   "program): left out of per-step figures" + (f", with the {steps} step(s) that launched them"
                                                               if steps else ""))
    if facts.get("steps_outside_runs", 0):
        names = sorted(k[len(OUTSIDE_PROGRAM):] for k in facts if k.startswith(OUTSIDE_PROGRAM))
        out.append(f"{facts['steps_outside_runs']} execution(s) ({facts['steps_outside_ps'] / total:.1%} of op time) "
                   f"{f'of {fmt_list(names)} ' if names else ''}were launched outside the steps (before the first, "
                   "between marked steps, in a step still open when the trace stopped, or, where steps are a "
                   "program's executions, by a program run in only some steps): left out of per-step figures")
    return out
