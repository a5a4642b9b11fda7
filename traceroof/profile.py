"""Open any input: read every host's profile file (in parallel: :mod:`traceroof.host`), align the hosts'
clocks and merge their op events, steps, HLO modules and notes into one :class:`Profile`.

Inputs: an ``.xplane.pb`` file, a run directory (``plugins/profile/<run>/``: every host's file is read), a
TensorBoard logdir (the latest run), a trace JSON file, or a folder holding one of those plus HLO dumps (as the
project's fixtures do), locally or as fsspec URLs (``gs://``, ``s3://``). HLO comes from ``--hlo`` paths (files
or dump folders) and from ``*after_optimizations*`` dumps found beside the profile.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import pandas as pd
from pandas.api.types import union_categoricals

from parsers import storage
from parsers.errors import FormatError, HloParseError, InputError
from parsers.hlo import HloModule
from parsers.xspace import DURATION_LIMIT_PS
from traceroof.aggregate import Timeline
from traceroof.discovery import Inputs
from traceroof.codes import constant_categorical
from traceroof.asyncends import async_notes
from traceroof.hlo_source import fingerprint
from traceroof.hostactivity import empty_activity, shifted_activity
from traceroof.host import HostEvents, HostTask, ModuleRef, read_host, step_notes
from traceroof.memory import NO_ALLOCATOR_EVENTS, AllocatorPeak, merge_allocators
from traceroof.parallel import map_hosts
from traceroof.units import fmt_list

PARTIAL = "PARTIAL:"  # how the note and the input line begin when hosts' files are left out (read_host_or_skip)
MAX_HOST_SKEW_PS = DURATION_LIMIT_PS  # hosts whose profile_start_time differ by more are not aligned (13 days)


@dataclass(eq=False)
class Profile:
    """Op rows, op event timeline and steps of a profile, with the HLO modules it may join to.

    ``rows``: the op events of every host aggregated into op rows (:func:`traceroof.aggregate.aggregate_events`:
    one per ``host``, ``device``, ``program_id`` (Int64, NA when unknown), ``module``, ``hlo_op``, ``kernel``,
    ``attributed`` and ``step`` (Int64; NA outside marked steps), with ``events``, ``duration_ps`` and the first
    ``start_ps``); ``timeline``: their events (:class:`~traceroof.aggregate.Timeline`; int64 picoseconds, one clock
    across hosts). ``steps``: ``host``, ``step``, ``start_ps``, ``end_ps``. ``device_kind`` is ``cpu``,
    ``gpu`` or ``tpu``; ``notes`` says what was missing or odd. ``decoder``: the wire scanner that read the
    ``.xplane.pb`` files, ``"c"`` or ``"python"`` (:func:`parsers.xspace.scanner`); ``""`` for trace JSON.
    """

    inputs: Inputs
    rows: pd.DataFrame
    timeline: Timeline
    steps: pd.DataFrame
    modules: list[HloModule]
    device_kind: str
    device_description: str
    step_annotation: str
    plane_stats: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    hlo_sources: dict[str, int] = field(default_factory=dict)
    dump_sources: frozenset[str] = frozenset()  # HLO text files superseded by the profile's own HLO, equal to it
    decoder: str = ""
    host_activity: pd.DataFrame = field(default_factory=empty_activity)  # traceroof.hostactivity, one clock
    allocators: tuple[AllocatorPeak, ...] = ()  # traceroof.memory.merge_allocators of the hosts'
    allocator_note: str = NO_ALLOCATOR_EVENTS

    def events(self) -> pd.DataFrame:
        """The op events, one row per execution, rebuilt from :attr:`rows` and :attr:`timeline`: each event's
        row key (``host``, ``device``, ``program_id``, ``module``, ``hlo_op``, ``kernel``, ``attributed``,
        ``step``...), ``start_ps`` and ``duration_ps`` (int64), ``run_id`` and ``launch_ps`` (float64, NaN where
        unknown). As many rows as op events (millions on a large profile): for tests and inspection; the analysis
        reads the rows and the timeline."""
        t = self.timeline
        key = [c for c in self.rows.columns if c not in ("events", "duration_ps", "start_ps")]
        out = self.rows[key].take(t.row).reset_index(drop=True)
        out["start_ps"], out["duration_ps"] = t.start_ps, t.duration_ps
        for name in ("run_id", "launch_ps"):
            values = getattr(t, name)
            out[name] = values if values is not None else np.full(len(t), np.nan)
        return out


def load_profile(inputs: Inputs, jobs: int | None = 1, dask_address: str | None = None) -> Profile:
    """Read the profile files and the HLO of an :class:`Inputs`, one host per task of
    :func:`traceroof.parallel.map_hosts` (``jobs`` processes, or the Dask cluster at ``dask_address``).

    A run directory's host whose own file is corrupt or truncated is left out, with a note that begins
    ``PARTIAL:`` (:func:`read_host_or_skip`).

    :raises FormatError: the one profile file, or every host's, is corrupt; an HLO file is corrupt.
    :raises InputError: the profile holds no XLA op events; its hosts are not of one capture (:func:`merge_hosts`).
    """
    analysis_id = uuid.uuid4().hex
    tasks = [HostTask(p, inputs.kind, inputs.hlo_files, inputs.hlo_proto_files, analysis_id) for p in inputs.profiles]
    if any(storage.process_local(p) for p in inputs.profiles):
        jobs, dask_address = 1, None
    read = read_host if len(tasks) == 1 else read_host_or_skip  # one file: its error is the error
    got = map_hosts(read, tasks, jobs=jobs, dask_address=dask_address, label="hosts")
    hosts = [h for h in got if isinstance(h, HostEvents)]
    bad = [h for h in got if isinstance(h, UnreadableHost)]
    if not hosts:
        raise FormatError(bad[0].error)
    if bad:  # the header's input line says so too
        names = fmt_list(b.name for b in bad)
        inputs = replace(inputs, description=f"{inputs.description} ({PARTIAL} {len(hosts)} of {len(tasks)} hosts; "
                                             f"unreadable: {names})")
    profile = merge_hosts(inputs, hosts)
    if bad:
        profile.notes.insert(0, f"{PARTIAL} {len(bad)} of {len(tasks)} hosts' profiles cannot be read and are left "
                                f"out ({names}); every figure covers the other {len(hosts)} hosts only. "
                                f"{bad[0].error}")
    return profile


@dataclass(frozen=True)
class UnreadableHost:
    """A host of a run directory whose own profile file is corrupt or truncated: ``name`` (the file's) and the
    one-line ``error`` that says so."""

    name: str
    error: str


def read_host_or_skip(task: HostTask) -> HostEvents | UnreadableHost:
    """:func:`traceroof.host.read_host`, or an :class:`UnreadableHost` when the host's own file is corrupt or
    truncated (a :class:`FormatError`): one bad file of a pod's hundreds leaves a partial report, not none.

    :raises HloParseError: an HLO file does not parse (shared by the hosts: no host is read without it); and
        every error of :func:`~traceroof.host.read_host` that is not about the file being corrupt.
    """
    try:
        return read_host(task)
    except HloParseError:
        raise
    except FormatError as e:
        return UnreadableHost(storage.name(task.path), str(e))


def _dedup(notes: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(notes))


def _concat(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate tables whose categorical columns have different categories, keeping them categorical."""
    frames = [f for f in frames if len(f.columns)]
    if len(frames) <= 1:
        return frames[0].reset_index(drop=True) if frames else pd.DataFrame()
    cats = {c for f in frames for c in f.columns if isinstance(f[c].dtype, pd.CategoricalDtype)}
    out = pd.concat([f.drop(columns=[c for c in cats if c in f]) for f in frames], ignore_index=True)
    for c in cats:
        parts = [pd.Categorical(f[c]) if c in f else constant_categorical(None, len(f)) for f in frames]
        out[c] = union_categoricals(parts, ignore_order=True)
    return out[[c for c in frames[0].columns] + [c for c in out.columns if c not in frames[0].columns]]


def _same_capture(spans: Sequence[tuple[int, int, str]]) -> None:
    """Hosts of one capture trace at the same time: their op events' spans (first start, last end, host; one
    clock) overlap, each one with some other so that they chain into one. Hosts whose events lie wholly apart were
    captured at different times (different runs, or captures of one job minutes apart): merged, their steps would
    span the gap between them.

    :raises InputError: the spans fall into groups that do not overlap.
    """
    order = sorted(spans)
    end_ps, last = order[0][1] if order else 0, order[0][2] if order else ""
    for start_ps, stop_ps, host in order[1:]:
        if start_ps > end_ps:
            which = f"{last}'s op events end" if last != host else "one host's op events end"
            whose = f"{host}'s" if last != host else "another's"
            raise InputError(f"the hosts' profiles were captured at different times ({which} "
                             f"{(start_ps - end_ps) / 1e12:,.3f} s before {whose} begin): they are not the hosts of "
                             "one capture but different runs (or hosts whose clocks disagree); analyze them one at "
                             "a time, or compare two with traceroof diff")
        if stop_ps > end_ps:
            end_ps, last = stop_ps, host


def merge_hosts(inputs: Inputs, hosts: Sequence[HostEvents]) -> Profile:
    """One :class:`Profile` of the hosts' tables: times shifted onto one clock (the earliest host's
    ``profile_start_time``; not aligned, with a note, when the hosts' starts lie more than
    ``MAX_HOST_SKEW_PS`` apart or some are unknown), op rows, timelines and steps concatenated (a host's rows
    never merge with another's: the host is part of the row key), modules of the same program
    kept once, notes once each (counts in them summed over the hosts).

    :raises InputError: no host holds XLA op events; the hosts were captured at different times
        (:func:`_same_capture`) or hold different HLO under one program id and name (different runs).
    """
    notes: list[str] = _dedup([n for h in hosts for n in h.read_notes])
    counts: dict[str, int] = {}
    for h in hosts:
        for k, v in h.counts.items():
            counts[k] = counts.get(k, 0) + v
    starts = [h.start_ns for h in hosts]
    known = [s for s in starts if s is not None]
    base = min(known, default=None)
    if bool(known) and (max(known) - min(known)) * 1000 > MAX_HOST_SKEW_PS:
        notes.insert(0, f"the hosts' profile_start_time values lie {(max(known) - min(known)) / 1e9:,.0f} s apart "
                        "(corrupt or unrelated captures): their clocks were not aligned")
        starts = [None] * len(hosts)
    elif len(hosts) > 1 and inputs.kind == "xplane" and any(s is None for s in starts):
        notes.append("some hosts have no profile_start_time: their clocks were not aligned")
    idle = [h.host for h in hosts if h.rows.empty]
    if idle and len(idle) < len(hosts):
        notes.append(f"{len(idle)} host(s) hold no op events ({', '.join(idle[:4])}{' ...' if len(idle) > 4 else ''}): "
                     "their steps are left out (a host that ran no XLA program, or whose trace missed it)")
    frames, step_frames, timelines = [], [], []
    row_offsets: list[int] = []
    time_offsets_ps: list[int] = []
    spans: list[tuple[int, int, str]] = []  # each host's first op start and last op end, on the common clock
    n_rows = 0
    for h, s in zip(hosts, starts):
        if h.rows.empty:
            continue
        offset_ps = (s - base) * 1000 if (s is not None and base is not None) else 0
        if s is not None and base is not None and len(hosts) > 1:
            t = h.timeline
            spans.append((int(t.start_ps.min()) + offset_ps, int((t.start_ps + t.duration_ps).max()) + offset_ps,
                          h.host))
        rows, st = h.rows, h.steps
        if offset_ps:
            rows = rows.assign(start_ps=rows["start_ps"] + offset_ps)
        if offset_ps and len(st):
            st = st.assign(**{c: st[c] + offset_ps for c in ("start_ps", "end_ps", "device_start_ps", "device_end_ps")
                              if c in st})
        frames.append(rows)
        timelines.append(h.timeline)
        row_offsets.append(n_rows)
        time_offsets_ps.append(offset_ps)
        n_rows += len(rows)
        step_frames.append(st)
    _same_capture(spans)
    rows = _concat(frames)
    steps = _concat([f for f in step_frames if len(f)])
    if rows.empty:
        if counts.get("long_ops"):
            raise InputError(f"{inputs.description}: every op event lasts more than a day; the profile's times "
                             "are corrupt")
        if counts.get("launches"):
            raise InputError(f"{inputs.description}: {counts['launches']} program launches but no XLA op events: "
                             "the work ran after the trace stopped; call jax.block_until_ready() on the last "
                             "step's outputs before jax.profiler.stop_trace()")
        if counts.get("trace_cap_events"):  # s37 trial: a heavy Python tracer filled the export's cap first
            raise InputError(f"{inputs.description}: holds exactly {counts['trace_cap_events']:,} events, the cap "
                             "of the trace viewer's export, and no XLA op event among them (the events kept were "
                             "others, e.g. Python tracer calls): analyze the .xplane.pb the profiler wrote beside it")
        raise InputError(f"{inputs.description}: the profile holds no XLA op events (no hlo_op stats); "
                         "profile a jitted JAX/XLA program")
    if counts.get("long_ops"):
        notes.append(f"{counts['long_ops']:,} op events lasting more than a day dropped: no op of a profiled "
                     "program runs that long (corrupt times)")
    bad_ids = {k[4:]: v for k, v in counts.items() if k.startswith("bad:")}
    if bad_ids:
        notes.append(f"op events with an id stat that is not a valid integer (corrupt stats) lost it: "
                     f"{', '.join(f'{n:,} {k}' for k, n in sorted(bad_ids.items()))}; they join to HLO and steps "
                     "without it")
    notes += async_notes(counts) + _dedup([n for h in hosts for n in h.event_notes]) + step_notes(counts)
    notes += _dedup([n for h in hosts for n in h.hlo_notes])
    # each module as (program id, name, fingerprint): a ModuleRef names one an earlier host returned
    ids = [[(m.program_id, m.name, m.fingerprint if isinstance(m, ModuleRef) else
             fingerprint(m)[0] if len(hosts) > 1 else "") for m, _ in h.modules] for h in hosts]
    sent = {full: m for h, fulls in zip(hosts, ids) for (m, _), full in zip(h.modules, fulls)
            if not isinstance(m, ModuleRef)}
    seen: dict[tuple, tuple[HloModule, str]] = {}
    owner: dict[tuple, tuple[str, str]] = {}  # program -> (first host holding it, its fingerprint)
    differing: list[str] = []
    for h, fulls in zip(hosts, ids):  # one module per program (id and name; by name without an id)
        for (m, how), full in zip(h.modules, fulls):
            key = full[:2]
            if key not in seen:
                if isinstance(m, ModuleRef):  # the same program, returned with another host: as read from this one
                    ref, m = m, copy.copy(sent[full])
                    m.source = ref.source
                seen[key] = (m, how)
                owner[key] = (h.host, full[2])
            elif len(hosts) > 1 and full[2] != owner[key][1]:
                differing.append(f"{m.name} ({owner[key][0]} vs {h.host})")
    if differing:  # one program's figures would come from another's HLO
        raise InputError(f"{inputs.description}: the hosts hold different HLO under the same program id and name "
                         f"({', '.join(differing[:3])}{' ...' if len(differing) > 3 else ''}): these are different "
                         "runs or programs, not the hosts of one; analyze them one at a time, or compare two with "
                         "traceroof diff")
    modules = [m for m, _ in seen.values()]
    hows = [how for _, how in seen.values()]
    superseded = frozenset().union(*(h.superseded for h in hosts))
    dumps = ("HLO text dumps" if inputs.kind == "xplane" else  # nothing to check a trace JSON's dumps against
             "HLO text dumps matched by op name only, unchecked (a trace JSON carries no HLO: analyze the .xplane.pb)")
    sources = {dumps: hows.count("dump"), "HloProtos embedded in the profile": hows.count("embedded"),
               "HloProto files beside the profile": hows.count("sidecar"),
               "HLO text dumps equal to the profile's HLO": len(superseded)}
    last = [h for h in hosts if len(h.rows)][-1]
    plane_stats: dict[str, object] = {}
    for h in hosts:
        plane_stats.update(h.plane_stats)
    annotation = next((h.step_annotation for h in reversed(hosts) if h.step_annotation), "")
    timeline = Timeline.concat(timelines, row_offsets, time_offsets_ps)
    return Profile(inputs, rows, timeline, steps, modules, last.device_kind, last.device_description, annotation,
                   plane_stats, notes,
                   {k: v for k, v in sources.items() if v}, superseded,
                   ",".join(sorted({h.decoder for h in hosts} - {""})),
                   shifted_activity([(h.host_activity, (s - base) * 1000 if s is not None and base is not None
                                      else 0) for h, s in zip(hosts, starts) if not h.rows.empty]),
                   *merge_allocators(h.allocators for h in hosts))
