"""Open any input, pick the op events, find the steps, and join events to HLO instructions.

Inputs: an ``.xplane.pb`` file, a run directory (``plugins/profile/<run>/``: every host's file is read), a
TensorBoard logdir (the latest run), a trace JSON file, or a folder holding one of those plus HLO dumps (as the
project's fixtures do). HLO comes from ``--hlo`` paths (files or dump folders) and from ``*after_optimizations*``
dumps found beside the profile. Events join to instructions by ``(program_id, hlo_op)``, or by module name when a
module name is unique and the input has no program ids; never by op name alone across modules
(``docs/reference/xplane-format.md`` §7).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from parsers.errors import InputError
from parsers.hlo import HloModule
from parsers import storage
from parsers.trace_json import read_trace_json
from parsers.xspace import AGGREGATE_START_PS, DURATION_LIMIT_PS, read_xspace
from traceroof.discovery import TRACE_JSON_SUFFIXES, XPLANE_SUFFIXES, Inputs
from traceroof.hlo_source import (check_dumps, embedded_hlo, parse_dumps,
                                  profile_hlo, reconcile, relevant_dumps)
from traceroof.steps import (assign_steps, device_step_spans, dominant_program_steps, kernel_launch_times,
                             launch_events, launch_times)

OP_STATS = ("hlo_op", "hlo_module", "program_id", "device_ordinal", "step_num")
MAX_OP_EVENT_PS = 86_400 * 10**12  # one op event lasting longer than a day is corrupt, not slow
MAX_HOST_SKEW_PS = DURATION_LIMIT_PS  # hosts whose profile_start_time differ by more are not aligned (13 days)


@dataclass(eq=False)
class Profile:
    """Op events and steps of a profile, with the HLO modules it may join to.

    ``events``: one row per op execution: ``host``, ``device``, ``program_id`` (Int64, NA when unknown),
    ``module``, ``hlo_op``, ``start_ps``, ``duration_ps`` (int64, one clock across hosts), ``step`` (Int64; NA
    outside marked steps). ``steps``: ``host``, ``step``, ``start_ps``, ``end_ps``. ``device_kind`` is ``cpu``,
    ``gpu`` or ``tpu``; ``notes`` says what was missing or odd. ``decoder``: the wire scanner that read the
    ``.xplane.pb`` files, ``"c"`` or ``"python"`` (:func:`parsers.xspace.scanner`); ``""`` for trace JSON.
    """

    inputs: Inputs
    events: pd.DataFrame
    steps: pd.DataFrame
    modules: list[HloModule]
    device_kind: str
    device_description: str
    step_annotation: str
    plane_stats: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    hlo_sources: dict[str, int] = field(default_factory=dict)
    dump_sources: frozenset[str] = frozenset()  # HLO text files superseded by the profile's own HLO
    decoder: str = ""


def load_profile(inputs: Inputs) -> Profile:
    """Read the profile files and the HLO of an :class:`Inputs`.

    :raises FormatError: a profile or HLO file is corrupt.
    :raises InputError: the profile holds no XLA op events.
    """
    notes: list[str] = []
    frames, step_frames = [], []
    device_kind, device_desc, annotation = "cpu", "", ""
    plane_stats: dict[str, object] = {}
    starts = []
    counts: dict[str, int] = {}
    embedded: list[tuple[int | None, str, bytes, str]] = []
    decoder = ""
    if inputs.kind == "xplane":
        spaces = [read_xspace(p) for p in inputs.profiles]
        decoder = ",".join(sorted({xs.decoder for xs in spaces}))
        starts = [xs.profile_start_time_ns for xs in spaces]
        known = [s for s in starts if s is not None]
        base = min(known, default=None)
        skewed = bool(known) and (max(known) - min(known)) * 1000 > MAX_HOST_SKEW_PS
        if skewed:
            notes.append(f"the hosts' profile_start_time values lie {(max(known) - min(known)) / 1e9:,.0f} s apart "
                         "(corrupt or unrelated captures): their clocks were not aligned")
            starts = [None] * len(spaces)
        for xs, s in zip(spaces, starts):
            offset_ps = (s - base) * 1000 if (s is not None and base is not None) else 0
            ev, st, kind, desc, ann, stats, info = _xspace_events(xs)
            for k, v in info.items():
                counts[k] = counts.get(k, 0) + v
            embedded += embedded_hlo(xs)
            notes += xs.notes
            ev["start_ps"] += offset_ps
            ev["launch_ps"] += offset_ps
            st["start_ps"] += offset_ps
            st["end_ps"] += offset_ps
            frames.append(ev)
            step_frames.append(st)
            device_kind, device_desc, annotation = kind, desc, ann or annotation
            plane_stats.update(stats)
        if len(spaces) > 1 and not skewed and any(s is None for s in starts):
            notes.append("some hosts have no profile_start_time: their clocks were not aligned")
    else:
        for p in inputs.profiles:
            tj = read_trace_json(p)
            notes += tj.notes
            if tj.maybe_truncated:
                notes.append(f"{storage.name(p)} holds exactly {len(tj.complete_events):,} events, a trace-viewer cap: "
                             "events were probably dropped; analyze the .xplane.pb instead")
            ev, st, ann = _trace_json_events(tj, p, counts)
            frames.append(ev)
            step_frames.append(st)
            annotation = ann or annotation
        device_desc = "host CPU (trace JSON: no plane stats, no program ids)"
    events = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    steps = pd.concat(step_frames, ignore_index=True) if step_frames else pd.DataFrame()
    if events.empty:
        if counts.get("launches"):
            raise InputError(f"{inputs.description}: {counts['launches']} program launches but no XLA op events: "
                             "the work ran after the trace stopped; call jax.block_until_ready() on the last "
                             "step's outputs before jax.profiler.stop_trace()")
        raise InputError(f"{inputs.description}: the profile holds no XLA op events (no hlo_op stats); "
                         "profile a jitted JAX/XLA program")
    long_ops = (events["duration_ps"] > MAX_OP_EVENT_PS).to_numpy(bool)
    if long_ops.any():
        events = events[~long_ops].reset_index(drop=True)
        notes.append(f"{int(long_ops.sum()):,} op events lasting more than a day dropped: no op of a profiled "
                     "program runs that long (corrupt times)")
        if events.empty:
            raise InputError(f"{inputs.description}: every op event lasts more than a day; the profile's times "
                             "are corrupt")
    bad_ids = {k[4:]: v for k, v in counts.items() if k.startswith("bad:")}
    if bad_ids:
        notes.append(f"op events with an id stat that is not a valid integer (corrupt stats) lost it: "
                     f"{', '.join(f'{n:,} {k}' for k, n in sorted(bad_ids.items()))}; they join to HLO and steps "
                     "without it")
    hlo_notes: list[str] = []  # stated after the step notes, as before async ends needed the HLO
    extra = profile_hlo(events, embedded, inputs.hlo_proto_files, hlo_notes)
    truth = [m for m, _ in extra]
    texts = parse_dumps(relevant_dumps(inputs.hlo_files, events), events, hlo_notes,
                        covered={m.program_id for m in truth if m.program_id is not None})
    dumps, superseded = reconcile(texts, truth, hlo_notes)
    check_dumps(dumps, events)
    events = _bound_async_ends(events, truth + dumps, notes)
    events, steps, annotation = _steps_by_execution(events, steps, annotation, notes)
    notes += hlo_notes
    sources = {"HLO text dumps": len(dumps),
               "HloProtos embedded in the profile": sum(1 for _, how in extra if how == "embedded"),
               "HloProto files beside the profile": sum(1 for _, how in extra if how == "sidecar"),
               "HLO text dumps of the same programs (not needed)": len(superseded)}
    return Profile(inputs, events, steps, truth + dumps, device_kind, device_desc, annotation, plane_stats, notes,
                   {k: v for k, v in sources.items() if v}, superseded, decoder)


def _host_of(path: str) -> str:
    name = Path(path).name
    for suf in XPLANE_SUFFIXES + TRACE_JSON_SUFFIXES:
        if name.endswith(suf):
            return name[: -len(suf)]
    return name


def _xspace_events(xs) -> tuple[pd.DataFrame, pd.DataFrame, str, str, str, dict]:
    host = _host_of(xs.path)  # the file name: unique per host in a run directory
    device_planes = [p for p in xs.planes if p.name.startswith("/device:")]
    gpu = [p for p in device_planes if re.match(r"/device:GPU:\d+$", p.name)]
    tpu = [p for p in device_planes if re.match(r"/device:TPU:\d+$", p.name)]
    cpu = xs.plane("/host:CPU")
    frames = []
    fw_steps = None
    stats: dict[str, object] = {}
    info: dict[str, int] = {}
    if tpu and any(line.name == "XLA Ops" and line.event_count for p in tpu for line in p.lines):
        kind = "tpu"
        frames, fw_steps = _tpu_ops(tpu, host, xs, info)
        stats.update(next(p.stats for p in tpu if any(line.name == "XLA Ops" for line in p.lines)))
        desc = f"{len(frames)} TPU core plane(s) with XLA Ops"
    elif gpu and any(line.event_count for p in gpu for line in p.lines):
        kind = "gpu"
        active = []
        host_ev = _checked_ids(cpu.events(stats=("correlation_id", "step_num"), require=("correlation_id", "step_num")),
                               info) if cpu else pd.DataFrame()
        api = host_ev[host_ev["correlation_id"].notna()] if len(host_ev) else host_ev
        step_events = host_ev[host_ev["step_num"].notna()] if len(host_ev) else host_ev
        api_calls = ((api["correlation_id"].to_numpy(dtype="float64", na_value=np.nan), api["start_ps"].to_numpy())
                     if len(api) else (np.zeros(0), np.zeros(0, np.int64)))
        for p in gpu:
            streams = [line for line in p.lines if line.name.startswith("Stream")]
            if not streams:
                continue
            active.append(p)
            ev = _checked_ids(p.events(stats=(*OP_STATS, "correlation_id"), lines=streams), info)
            ev = ev[ev["start_ps"] != AGGREGATE_START_PS]
            ev = ev.assign(launch_ps=kernel_launch_times(
                ev["correlation_id"].to_numpy(dtype="float64", na_value=np.nan), *api_calls))
            attributed = ev["hlo_op"].notna().to_numpy()
            kernel = ev["display_name"].astype(str)
            ev = ev.assign(device=f"{host}/{p.name}", kernel=kernel.to_numpy(),
                           hlo_op=np.where(attributed, ev["hlo_op"].astype(object), "(kernel) " + kernel),
                           hlo_module=np.where(attributed, ev["hlo_module"].astype(object), ""),
                           attributed=attributed)
            frames.append(ev)
        if active:
            stats.update(active[0].stats)
        vendors = sorted({str(p.stats.get("device_vendor", "")) for p in active} - {""})
        desc = (f"{len(active)} active GPU plane(s) of {len(gpu)}"
                + (f" ({', '.join(vendors)})" if vendors else "") + "; kernels on Stream lines")
        if not any(f["attributed"].any() for f in frames):
            fw = _framework_ops(gpu, host)
            if fw is not None:
                frames, fw_steps = [fw[0]], fw[1]
                desc += "; no XLA ops: TensorFlow/framework ops only"
    else:
        kind = "cpu"
        if cpu is None:
            raise InputError(f"{xs.path}: no /host:CPU or device plane: not a JAX/XLA profile")
        both = _checked_ids(cpu.events(stats=(*OP_STATS, "run_id", "_p", "_c"), require=("hlo_op", "step_num"),
                                       names=HOST_EVENT_NAMES), info)
        step_events = both[both["step_num"].notna()]
        ev = both[both["hlo_op"].notna() & (both["start_ps"] != AGGREGATE_START_PS)]
        ends = _name_mask(both["name"], r"end: ")
        ev = _async_thunk_ends(ev, both[ends])
        launches = launch_events(both[_name_mask(both["name"], HOST_EVENT_NAMES) & ~ends
                                      & both["hlo_op"].isna().to_numpy()])
        info["launches"] = len(launches)
        host_ops = ev.assign(module=ev["hlo_module"])
        launch, info["executions_matched"] = launch_times(host_ops, launches)
        ev = ev.assign(launch_ps=launch)
        del both, host_ops
        ordinal = ev["device_ordinal"].to_numpy(dtype="int64", na_value=0)
        uniq, inv = np.unique(ordinal, return_inverse=True)
        ev = ev.assign(device=pd.Categorical.from_codes(inv, categories=[f"{host}/cpu:{u}" for u in uniq]))
        frames.append(ev)
        meta = xs.plane("/host:metadata")
        version = meta.stats.get("jax_version", "") if meta else ""
        desc = f"XLA:CPU host threads{f' (jax {version})' if version else ''}"
    events = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if len(events) and "kernel" not in events:
        events = events.assign(kernel="", attributed=True)
    out = pd.DataFrame({
        "host": pd.Categorical([host] * len(events)),
        "device": pd.Categorical(events["device"]) if len(events) else pd.Categorical([]),
        "program_id": events["program_id"].astype("Int64") if len(events) else pd.array([], "Int64"),
        "module": events["hlo_module"].astype("category") if len(events) else pd.Categorical([]),
        "hlo_op": events["hlo_op"].astype("category") if len(events) else pd.Categorical([]),
        "start_ps": events["start_ps"].to_numpy(np.int64) if len(events) else np.zeros(0, np.int64),
        "duration_ps": events["duration_ps"].to_numpy(np.int64) if len(events) else np.zeros(0, np.int64),
        "kernel": pd.Categorical(events["kernel"]) if len(events) else pd.Categorical([]),
        "attributed": events["attributed"].to_numpy(bool) if len(events) else np.zeros(0, bool),
        "run_id": pd.array(events["run_id"], "Int64") if "run_id" in events else pd.array([pd.NA] * len(events),
                                                                                           "Int64"),
        "launch_ps": pd.array(events["launch_ps"].to_numpy(np.float64), "Float64").astype("Int64")
        if "launch_ps" in events else pd.array([pd.NA] * len(events), "Int64"),
    })
    if len(events) and "async_end_ps" in events:
        out["async_end_ps"] = pd.array(events["async_end_ps"], "Int64")
    if len(events) and "framework_scope" in events:
        out["framework_scope"] = pd.Categorical(events["framework_scope"])
    for st in TPU_COST_STATS:
        if len(events) and f"profile_{st}" in events:
            out[f"profile_{st}"] = events[f"profile_{st}"].to_numpy(np.float64)
    if fw_steps is not None and len(fw_steps):
        return out, fw_steps.reset_index(drop=True), kind, desc, "Steps", stats, info
    if kind == "tpu":
        step_events = _checked_ids(cpu.events(stats=("step_num",), require=("step_num",)), info) if cpu \
            else pd.DataFrame()
    steps, ann = _steps_from_events(step_events, host)
    return out, steps, kind, desc, ann, stats, info


TPU_COST_STATS = ("flops", "model_flops", "bytes_accessed")
ASYNC_NOTE_SHARE = 0.05  # async thunk ends adding more than this share of op time are stated in a note
ASYNC_CUT_NOTE_SHARE = 0.01  # async thunk ends cut by more than this share of op time get a note of their own
# host events read besides ops and steps: async thunk ends, PjRt launches and the PjitFunction events around them
HOST_EVENT_NAMES = r"end: |PjitFunction\(|(?:\w+::)*\w*PjRt\w*Executable::Execute"


def _device_steps(plane, host: str) -> list[pd.DataFrame]:
    """Steps of a device plane's ``Steps`` line (events named by step number), one row per step."""
    out = []
    for line in plane.lines:
        if line.name == "Steps":
            st = plane.events(lines=[line])
            num = pd.to_numeric(st["name"].astype(str), errors="coerce")
            out.append(pd.DataFrame({"host": host, "device": f"{host}/{plane.name}", "step": pd.array(num, "Int64"),
                                     "start_ps": st["start_ps"].to_numpy(np.int64),
                                     "end_ps": (st["start_ps"] + st["duration_ps"]).to_numpy(np.int64)}))
    return out


def _name_mask(names: pd.Series, pattern: str) -> np.ndarray:
    """Events whose (categorical) name matches ``pattern`` at its start, tested once per distinct name."""
    cat = pd.Categorical(names)
    hit = np.array([re.match(pattern, str(c)) is not None for c in cat.categories] + [False])
    return hit[np.where(cat.codes >= 0, cat.codes, len(cat.categories))]


def _async_thunk_ends(ops: pd.DataFrame, ends: pd.DataFrame) -> pd.DataFrame:
    """XLA:CPU async thunks: an op event may be only the launch of a thunk that completes later; its ``end: <op>``
    event is linked by the flow stats (the op's producer ``_p`` = the end event's consumer ``_c``; xla
    ``backends/cpu/runtime/thunk_executor.cc`` ``TracedExecute``). Returns the ops with ``async_end_ps``: the end
    that event implies, less the time the completing thread spent in other op events meanwhile (a completion
    delayed because that thread ran other ops is scheduling, not this op's work); NA where the event does not
    end after the op event. Durations are unchanged: :func:`_bound_async_ends` bounds these ends by the HLO."""
    implied = pd.array([pd.NA] * len(ops), "Int64")
    if ops.empty or ends.empty or "_p" not in ops or "_c" not in ends:
        return ops.assign(async_end_ps=implied)
    e = pd.DataFrame({"c": ends["_c"].to_numpy(dtype="float64", na_value=np.nan),
                      "end": (ends["start_ps"] + ends["duration_ps"]).to_numpy(np.int64),
                      "line": ends["line_id"].to_numpy(np.int64)}).dropna().drop_duplicates("c", keep="last")
    pos = pd.Series(np.arange(len(e)), index=e["c"].to_numpy())
    k = ops["_p"].to_numpy(dtype="float64", na_value=np.nan)
    idx = pd.Series(k).map(pos).to_numpy(np.float64, na_value=np.nan)
    start = ops["start_ps"].to_numpy(np.int64)
    dur = ops["duration_ps"].to_numpy(np.int64)
    old_end = start + dur
    has = ~np.isnan(idx)
    done = np.zeros(len(ops), np.int64)
    done[has] = e["end"].to_numpy()[idx[has].astype(np.int64)]
    grow = has & (done > old_end)
    if not grow.any():
        return ops.assign(async_end_ps=implied)
    extra = (done - old_end).astype(np.float64)
    end_line = np.full(len(ops), -1, np.int64)
    end_line[has] = e["line"].to_numpy()[idx[has].astype(np.int64)]
    lines = ops["line_id"].to_numpy(np.int64)
    for line in np.unique(end_line[grow]):  # subtract the completing thread's time in other ops
        on = lines == line
        order = np.argsort(start[on], kind="stable")
        s_l, e_l = start[on][order], old_end[on][order]
        cum = np.concatenate([[0], np.cumsum(e_l - s_l)])

        def busy(t: np.ndarray) -> np.ndarray:
            j = np.searchsorted(s_l, t, side="right") - 1
            part = np.where(j >= 0, np.clip(np.minimum(t, e_l[np.maximum(j, 0)]) - s_l[np.maximum(j, 0)], 0, None), 0)
            return cum[np.maximum(j, 0)] * (j >= 0) + part

        sel = grow & (end_line == line)
        extra[sel] -= busy(done[sel]) - busy(old_end[sel])
    extra = np.maximum(extra, 0).astype(np.int64)
    grow &= extra > 0
    return ops.assign(async_end_ps=pd.arrays.IntegerArray(old_end + extra, ~grow))


NO_BOUND_PS = np.iinfo(np.int64).max


def _bound_async_ends(events: pd.DataFrame, modules: Sequence[HloModule], notes: list[str]) -> pd.DataFrame:
    """Stretch async-thunk launches to the ends :func:`_async_thunk_ends` found, bounded by later work that
    needed the result; drop ``async_end_ps``. Notes state the stretch (over ``ASYNC_NOTE_SHARE`` of op time,
    with the number of ends cut) and, on their own, ends cut by over ``ASYNC_CUT_NOTE_SHARE`` of op time.

    The ``end:`` event is not the thunk's completion but when the completion callback ran, which can be much
    later: XLA registers the trace callback on the thunk's event before the executor registers its continuation,
    and ``tsl::AsyncValue`` runs waiters newest first (``xla/tsl/concurrency/async_value.cc`` ``EnqueueWaiter``
    / ``RunWaiters``), so the completing thread first runs the continuation (the thunks that became ready, in
    sequence or by the execution graph, possibly to the end of the execution and PjRt's completion work) and
    only then emits ``end:``; a descheduled thread delays it further (a profile showed ``end:`` events 1.7 and
    2.2 ms after a 25 µs weight-gradient convolution, while the next step's convolution reading those weights
    had already started; in the transformer fixture 166 of 273 such ends lie after an op reading the result had
    started, by 0.955 ms in all, 0.4% of op time). Two bounds cut the end:

    (a) the first start, in the same execution (host, device, ``run_id``), of an op that uses the result: an
        instruction reading it in the HLO, looked through instructions with no op events (bitcasts, tuples).
        The executor launches a thunk only after every thunk it reads from completed (``ExecutionGraph`` edges
        include all data dependencies), in sequential and concurrent mode alike.
    (b) the first op start of the next execution of the same program on that device, when the two executions'
        op events do not otherwise overlap. An assumption, not a fact of XLA: successive executions of a program
        are successive steps, and a training step reads the state the previous one wrote. It matters only for
        an op no later op of its execution reads (its result an output of the program).

    A bound by the execution's last other op end is not used: an async thunk may be the execution's last work
    (its result an output), and then its real end is after every other op's. Without HLO only (b) applies.
    """
    if "async_end_ps" not in events:
        return events
    implied_col = pd.array(events["async_end_ps"], "Int64")
    events = events.drop(columns="async_end_ps")
    start = events["start_ps"].to_numpy(np.int64)
    end = start + events["duration_ps"].to_numpy(np.int64)
    grow = ~implied_col.isna()
    implied = implied_col.to_numpy(np.int64, na_value=0)
    grow &= implied > end
    if not grow.any():
        return events
    by_user = _first_user_starts(events, modules, grow)
    by_next = _next_execution_starts(events, grow)
    new_end = np.where(grow, np.maximum(end, np.minimum(implied, np.minimum(by_user, by_next))), end)
    cut_user = grow & (by_user < implied) & (by_user <= by_next)
    cut_next = grow & (by_next < implied) & ~cut_user
    op_ps = int((end - start).sum())
    extra_ps = int((new_end - end).sum())
    cut = cut_user | cut_next
    removed_ps = int((implied - new_end)[cut].sum())
    if removed_ps > ASYNC_CUT_NOTE_SHARE * op_ps:
        notes.append(f"{int(cut.sum()):,} async thunk ends came after later work had started (their `end:` event "
                     f"is when the completion was processed, not the op's end): their time is cut at the first "
                     f"start of an op using the result ({int(cut_user.sum()):,}) or of the program's next "
                     f"execution ({int(cut_next.sum()):,}), {removed_ps / 1e9:,.3f} ms of op time removed")
    if extra_ps > ASYNC_NOTE_SHARE * op_ps:
        notes.append(f"{int((new_end > end).sum()):,} op events are launches of asynchronous thunks: their time "
                     f"runs to the thunk's `end:` event (+{extra_ps / op_ps:.0%} op time"
                     + (f"; {int(cut.sum()):,} ends cut at later work that needed the result" if cut.any() else "")
                     + ")")
    return events.assign(duration_ps=new_end - start)


def _first_user_starts(events: pd.DataFrame, modules: Sequence[HloModule], grow: np.ndarray) -> np.ndarray:
    """Per event (``NO_BOUND_PS`` where none or not ``grow``): the first start after its own of an op event of
    the same host, device and execution whose instruction uses the event's result (bound (a) of
    :func:`_bound_async_ends`)."""
    out = np.full(len(events), NO_BOUND_PS, np.int64)
    if not modules or "run_id" not in events:
        return out
    mod, _ = match_modules(events, modules)
    run = events["run_id"].to_numpy(dtype="int64", na_value=0)
    sel = np.flatnonzero(grow & (mod >= 0) & events["run_id"].notna().to_numpy(bool))
    if not sel.size:
        return out
    op_code, op_names = pd.factorize(events["hlo_op"].astype(object))
    code_of = {n: i for i, n in enumerate(op_names)}
    host = pd.factorize(events["host"].astype(object))[0]
    device = pd.factorize(events["device"].astype(object))[0]
    start = events["start_ps"].to_numpy(np.int64)
    users: dict[tuple[int, int], set[int]] = {}
    for m in np.unique(mod[sel]):
        evented = {str(op_names[c]) for c in np.unique(op_code[mod == m])}
        graph = _users(modules[m])
        for c in np.unique(op_code[sel[mod[sel] == m]]):
            users[(int(m), int(c))] = {code_of[u] for u in _evented_users(str(op_names[c]), graph, evented)}
    wanted = set().union(*users.values())
    runs = np.unique(run[sel])
    cand = np.flatnonzero(np.isin(mod, np.unique(mod[sel])) & np.isin(run, runs) & np.isin(op_code, list(wanted))
                          & events["run_id"].notna().to_numpy(bool))
    keys = pd.DataFrame({"h": host[cand], "d": device[cand], "m": mod[cand], "r": run[cand], "o": op_code[cand]})
    groups = {k: np.sort(start[cand[v]]) for k, v in keys.groupby(["h", "d", "m", "r", "o"]).indices.items()}
    for i in sel:
        best = NO_BOUND_PS
        for u in users[(int(mod[i]), int(op_code[i]))]:
            starts = groups.get((host[i], device[i], mod[i], run[i], u))
            if starts is not None:
                j = np.searchsorted(starts, start[i], side="right")
                if j < len(starts):
                    best = min(best, int(starts[j]))
        out[i] = best
    return out


def _users(module: HloModule) -> dict[str, list[str]]:
    """Instruction name -> names of the instructions that read it (operands name instructions of the same
    computation; names are unique in a module)."""
    graph: dict[str, list[str]] = {}
    for comp in module.computations.values():
        for inst in comp.instructions:
            for o in inst.operands:
                graph.setdefault(o, []).append(inst.name)
    return graph


def _evented_users(name: str, graph: dict[str, list[str]], evented: set[str]) -> set[str]:
    """The instructions with op events that read ``name``, directly or through instructions without events."""
    found: set[str] = set()
    seen = {name}
    todo = list(graph.get(name, ()))
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        if u in evented:
            found.add(u)
        else:
            todo.extend(graph.get(u, ()))
    return found


def _next_execution_starts(events: pd.DataFrame, grow: np.ndarray) -> np.ndarray:
    """Per event (``NO_BOUND_PS`` where none or not ``grow``): the first op start of the next execution of its
    program on its host and device, when the two executions' op events do not overlap (bound (b) of
    :func:`_bound_async_ends`)."""
    out = np.full(len(events), NO_BOUND_PS, np.int64)
    if "run_id" not in events:
        return out
    has_run = events["run_id"].notna().to_numpy(bool)
    if not (grow & has_run).any():
        return out
    start = events["start_ps"].to_numpy(np.int64)
    d = pd.DataFrame({"h": events["host"].to_numpy(object), "d": events["device"].to_numpy(object),
                      "m": events["module"].to_numpy(object),
                      "p": events["program_id"].to_numpy(dtype="int64", na_value=-1),
                      "r": events["run_id"].to_numpy(dtype="int64", na_value=0),
                      "s": start, "e": start + events["duration_ps"].to_numpy(np.int64)})[has_run]
    key = ["h", "d", "m", "p"]
    ex = d.groupby([*key, "r"], sort=False).agg(s=("s", "min"), e=("e", "max")).reset_index()
    ex = ex.sort_values([*key, "s"], kind="stable")
    nxt = ex.groupby(key, sort=False)["s"].shift(-1, fill_value=NO_BOUND_PS).to_numpy(np.int64)
    ex["bound"] = np.where(ex["e"].to_numpy(np.int64) <= nxt, nxt, NO_BOUND_PS)
    g = d[grow[has_run]].reset_index().merge(ex[[*key, "r", "bound"]], on=[*key, "r"], how="left")
    out[g["index"].to_numpy()] = g["bound"].to_numpy(np.int64)
    return out


def _tpu_ops(planes: Sequence, host: str, xs, info: dict[str, int]) -> tuple[list[pd.DataFrame], pd.DataFrame]:
    """Op events of TPU core planes: the ``XLA Ops`` line (one event per HLO op execution; the event metadata's
    display name is the instruction, its stats ``program_id`` and libtpu's ``flops`` / ``bytes_accessed``), the
    module from the enclosing ``XLA Modules`` event (``<module>(<program_id>)``), steps from the ``Steps`` line.
    Layout after openxla/xprof ``xprof/convert/xplane_to_op_stats.cc`` (docs/reference/xplane-format.md §5-6)."""
    frames, steps = [], []
    for p in planes:
        ops_lines = [line for line in p.lines if line.name == "XLA Ops"]
        if not ops_lines:
            continue
        ev = _checked_ids(p.events(lines=ops_lines, stats=("program_id", *TPU_COST_STATS)), info)
        ev = ev[ev["start_ps"] != AGGREGATE_START_PS]
        mods = p.events(lines=[line for line in p.lines if line.name == "XLA Modules"])
        module = np.full(len(ev), "", dtype=object)
        pid_na = ev["program_id"].isna().to_numpy().copy()
        pid = ev["program_id"].to_numpy(dtype="int64", na_value=0).copy()
        if len(mods):
            mods = mods.sort_values("start_ps", kind="stable")
            starts, ends = mods["start_ps"].to_numpy(), (mods["start_ps"] + mods["duration_ps"]).to_numpy()
            idx = np.searchsorted(starts, ev["start_ps"].to_numpy(), side="right") - 1
            inside = (idx >= 0) & (ev["start_ps"].to_numpy() < ends[np.maximum(idx, 0)])
            names = mods["name"].astype(str).to_numpy()
            for i in np.flatnonzero(inside):
                m = re.fullmatch(r"(.*)\((\d+)\)", names[idx[i]])
                module[i] = m.group(1) if m else names[idx[i]]
                if m and pid_na[i] and int(m.group(2)) < 2**63:
                    pid[i], pid_na[i] = int(m.group(2)), False
        frame = pd.DataFrame({
            "device": f"{host}/{p.name}", "program_id": pd.arrays.IntegerArray(pid, pid_na),
            "hlo_module": module, "hlo_op": ev["display_name"].astype(str).to_numpy(),
            "start_ps": ev["start_ps"].to_numpy(), "duration_ps": ev["duration_ps"].to_numpy(), "kernel": "",
            "attributed": True,
        })
        for st in TPU_COST_STATS:
            frame[f"profile_{st}"] = pd.to_numeric(ev[st].astype(object), errors="coerce").to_numpy(np.float64)
        frames.append(frame)
        steps += _device_steps(p, host)
    st = pd.concat(steps, ignore_index=True).dropna(subset=["step"]) if steps else None
    return frames, st


FRAMEWORK_OP_LINES = ("Framework Ops", "TensorFlow Ops")


def _framework_ops(planes: Sequence, host: str) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """Framework-op events (``TensorFlow Ops`` / ``Framework Ops`` lines, e.g. a TensorFlow profile without XLA)
    and the device ``Steps`` line, for a report per framework op and name scope without HLO."""
    frames, steps = [], []
    for p in planes:
        lines = [line for line in p.lines if line.name in FRAMEWORK_OP_LINES]
        if not lines:
            continue
        ev = p.events(lines=lines)
        names = ev["name"].astype(str)
        path = names.str.split(":").str[0]
        frames.append(pd.DataFrame({
            "device": f"{host}/{p.name}", "program_id": pd.array([pd.NA] * len(ev), "Int64"),
            "hlo_module": "", "hlo_op": path.to_numpy(), "start_ps": ev["start_ps"].to_numpy(),
            "duration_ps": ev["duration_ps"].to_numpy(), "kernel": "", "attributed": False,
            "framework_scope": path.str.replace(r"(^|/)replica_\d+(?=/|$)", "", regex=True).str.lstrip("/")
            .str.rsplit("/", n=1).str[0].to_numpy(),
        }))
        steps += _device_steps(p, host)
    if not frames:
        return None
    st = pd.concat(steps, ignore_index=True) if steps else pd.DataFrame(
        {"host": pd.Series([], dtype=object), "step": pd.array([], "Int64"), "start_ps": np.zeros(0, np.int64),
         "end_ps": np.zeros(0, np.int64)})
    return pd.concat(frames, ignore_index=True), st.dropna(subset=["step"]).reset_index(drop=True)


def _steps_from_events(ev: pd.DataFrame, host: str) -> tuple[pd.DataFrame, str]:
    empty = pd.DataFrame({"host": pd.Series([], dtype=object), "step": pd.array([], "Int64"),
                          "start_ps": np.zeros(0, np.int64), "end_ps": np.zeros(0, np.int64)})
    if ev.empty or "step_num" not in ev:
        return empty, ""
    marked = ev[ev["step_num"].notna()]
    if marked.empty:
        return empty, ""
    names = marked["name"].astype(object).where(marked["name"].notna(), "").astype(str)  # a corrupt event: no name
    name = names.value_counts().idxmax()
    marked = marked[(names == name).to_numpy(bool)]
    steps = pd.DataFrame({
        "host": host,
        "step": pd.array(pd.to_numeric(marked["step_num"]).astype("int64"), "Int64"),
        "start_ps": marked["start_ps"].to_numpy(np.int64),
        "end_ps": (marked["start_ps"] + marked["duration_ps"]).to_numpy(np.int64),
    }).sort_values("start_ps", kind="stable").reset_index(drop=True)
    return steps, name


def as_id(x: object, lo: int) -> int | None:
    """An integer in [lo, 2^63) from a stat or args value (int, integral float, or text of one), else None."""
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, str):
        try:
            x = int(x)
        except ValueError:
            try:
                x = float(x)
            except ValueError:
                return None
    if isinstance(x, (float, np.floating)):
        if not np.isfinite(x) or x != np.floor(x):
            return None
        x = int(x)
    if not isinstance(x, (int, np.integer)):
        return None
    return int(x) if lo <= int(x) < 2**63 else None


def _ids(values: pd.Series, lo: int = -2**63) -> tuple[pd.arrays.IntegerArray, int]:
    """Integer ids (program, run, correlation ids, step numbers, ordinals) as ``Int64``: anything that is not an
    integer in [lo, 2^63) (text, fractions, NaN, 2^70, or a negative program id) becomes NA. Also returns how
    many values were present but invalid. Exact for every int64 (no float round trip)."""
    if isinstance(values.dtype, pd.Int64Dtype):
        v = values.to_numpy(np.int64, na_value=0)
        present = values.notna().to_numpy()
        ok = present & (v >= lo)
        return pd.arrays.IntegerArray(np.where(ok, v, 0), ~ok), int((present & ~ok).sum())
    codes, uniq = pd.factorize(values.astype(object), use_na_sentinel=True)
    conv = [as_id(u, lo) for u in uniq]
    good = np.array([c is not None for c in conv] + [False])
    vals = np.array([c if c is not None else 0 for c in conv] + [0], np.int64)
    idx = np.where(codes >= 0, codes, len(uniq))
    return pd.arrays.IntegerArray(vals[idx], ~good[idx]), int(((codes >= 0) & ~good[idx]).sum())


ID_STATS = {"program_id": 0, "step_num": 0, "device_ordinal": 0, "run_id": -2**63,
            "correlation_id": -2**63}  # integer stats and the least valid value of each
FLOW_STATS = ("_p", "_c")  # uint64 flow ids (may exceed 2^63): compared as float64


def _checked_ids(df: pd.DataFrame, counts: dict[str, int]) -> pd.DataFrame:
    """``df`` with its integer stats (:data:`ID_STATS`) as valid ``Int64`` ids and its flow ids as float64;
    invalid values (a corrupt stat of the wrong type or range) become NA and are counted in
    ``counts["bad:<stat>"]``."""
    cols = {}
    for name, lo in ID_STATS.items():
        if name in df:
            cols[name], bad = _ids(df[name], lo)
            if bad:
                counts[f"bad:{name}"] = counts.get(f"bad:{name}", 0) + bad
    for name in FLOW_STATS:
        if name in df and not pd.api.types.is_numeric_dtype(df[name].dtype):
            raw = df[name].astype(object)
            cols[name] = pd.to_numeric(raw, errors="coerce").astype(np.float64)
            bad = int((raw.notna() & cols[name].isna()).sum())
            if bad:
                counts[f"bad:{name}"] = counts.get(f"bad:{name}", 0) + bad
    return df.assign(**cols) if cols else df


def _trace_json_events(tj, path: Path, counts: dict[str, int]) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    host = _host_of(str(path))
    ev = tj.events(args=("hlo_op", "hlo_module", "program_id", "device_ordinal", "step_num", "run_id"))
    ev = _checked_ids(ev, counts)
    ops = ev[ev["hlo_op"].notna() & ev["plane"].astype(str).str.startswith(("/host:CPU", "/device:"))]
    run_id = ops["run_id"].array
    named = ev[ev["name"].astype(str).str.match(HOST_EVENT_NAMES).to_numpy(bool) & ev["hlo_op"].isna().to_numpy()]
    launches = launch_events(named.assign(line_id=named["tid"]))
    launch, _ = launch_times(pd.DataFrame({"module": ops["hlo_module"].astype(str).to_numpy(), "run_id": run_id,
                                           "start_ps": ops["start_ps"].to_numpy(np.int64)}), launches)
    ordinal = ops["device_ordinal"].fillna(0).astype("int64")
    out = pd.DataFrame({
        "host": pd.Categorical([host] * len(ops)),
        "device": pd.Categorical(host + "/cpu:" + ordinal.astype(str)),
        "program_id": ops["program_id"].array,
        "module": ops["hlo_module"].astype(str).astype("category"),
        "hlo_op": ops["hlo_op"].astype(str).astype("category"),
        "start_ps": ops["start_ps"].to_numpy(np.int64),
        "duration_ps": ops["duration_ps"].to_numpy(np.int64),
        "kernel": pd.Categorical([""] * len(ops)),
        "attributed": np.ones(len(ops), bool),
        "run_id": run_id,
        "launch_ps": pd.array(launch, "Float64").astype("Int64"),
    })
    steps, ann = _steps_from_events(ev[ev["step_num"].notna()], host)
    return out, steps, ann


def _steps_by_execution(events: pd.DataFrame, steps: pd.DataFrame, annotation: str, notes: list[str]
                        ) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """Put every op event in the step whose launch produced it (:mod:`traceroof.steps`); without step markers,
    each execution of the dominant program is a step. Steps gain ``device_start_ps`` / ``device_end_ps``."""
    if not steps.empty and "device" in steps and steps["device"].notna().all():  # TPU / framework Steps lines
        step = assign_steps(events["start_ps"].to_numpy(np.int64), events["device"], steps, by="device")
        events = events.assign(step=pd.arrays.IntegerArray(np.maximum(step, 0), step < 0))
        return events, steps.assign(device_start_ps=steps["start_ps"], device_end_ps=steps["end_ps"]), annotation
    launch = events["launch_ps"].to_numpy(dtype="float64", na_value=np.nan)
    known = ~np.isnan(launch)
    start = events["start_ps"].to_numpy(np.int64)
    when = np.where(known, np.nan_to_num(launch), start).astype(np.int64)
    hosts = pd.Categorical(events["host"])
    if steps.empty:
        steps, module = dominant_program_steps(events, when)
        if module:
            annotation = f"executions of {module}"
            notes.append(f"no steps marked (jax.profiler.StepTraceAnnotation): each execution of {module}, the "
                         "program with the most op time, is a step")
    step = assign_steps(when, hosts, steps)
    has_run = events["run_id"].notna().to_numpy() if "run_id" in events else np.zeros(len(events), bool)
    if (has_run & ~known).any():
        share = events["duration_ps"].to_numpy()[has_run & ~known].sum() / max(events["duration_ps"].sum(), 1)
        notes.append(f"{share:.1%} of op time could not be tied to its launch (no launch event of its program "
                     "in the profile): placed in steps by its own start time")
    outside = (step < 0) & known
    if outside.any() and annotation and not annotation.startswith("executions of"):
        runs = events.loc[outside, ["program_id", "run_id"]].drop_duplicates()
        share = events["duration_ps"].to_numpy()[outside].sum() / max(events["duration_ps"].sum(), 1)
        notes.append(f"{len(runs)} execution(s) ({share:.1%} of op time) were launched outside the marked steps "
                     "(work between steps, or a step still open when the trace stopped): left out of per-step "
                     "figures")
    steps = device_step_spans(step, hosts, when, start + events["duration_ps"].to_numpy(np.int64), steps)
    return events.assign(step=pd.arrays.IntegerArray(np.maximum(step, 0), step < 0)), steps, annotation


# -- join ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class JoinReport:
    """How much of the profile joined to HLO: events and time, and why the rest did not."""

    events_total: int
    events_joined: int
    time_total_ps: int
    time_joined_ps: int
    unmatched_modules: tuple[str, ...]
    unmatched_ops: int
    ambiguous_modules: tuple[str, ...]
    matched_sources: tuple[str, ...] = ()  # files (HloModule.source) of the modules events joined to


def match_modules(events: pd.DataFrame, modules: Sequence[HloModule], weights: np.ndarray | None = None
                  ) -> tuple[np.ndarray, JoinReport]:
    """Index into ``modules`` for every event or op row (-1 when no module matches) and a partial
    :class:`JoinReport` (``weights``: events per row, for op rows; 1 each by default).

    An event's module is the one with its program id and name; without a program id, the only module of that
    name (several modules sharing a name and no id to tell them apart: ambiguous, not joined).
    """
    by_id: dict[int, int] = {m.program_id: i for i, m in enumerate(modules) if m.program_id is not None}
    by_name: dict[str, list[int]] = {}
    for i, m in enumerate(modules):
        by_name.setdefault(m.name, []).append(i)
    names = events["module"].astype("category")
    mcodes = names.cat.codes.to_numpy().astype(np.int64)
    pid = events["program_id"].to_numpy(dtype="int64", na_value=-1)  # ids are checked: NA or in [0, 2^63)
    pcodes, pids = pd.factorize(pid)
    width = max(len(pids), 1)
    codes, uniques = pd.factorize(mcodes * width + pcodes)  # (module, program id) pairs; no overflow: both < n
    cats = list(names.cat.categories)
    chosen = np.full(len(uniques), -1, np.int64)
    unmatched, ambiguous = set(), set()
    for u, key in enumerate(uniques):
        mi, pi = divmod(int(key), width)
        name = cats[mi] if 0 <= mi < len(cats) else ""
        p = int(pids[pi])
        idx = -1
        if p >= 0 and p in by_id:
            if modules[by_id[p]].name == name:
                idx = by_id[p]
        elif len(by_name.get(name, [])) == 1 and (p < 0 or modules[by_name[name][0]].program_id is None):
            idx = by_name[name][0]
        elif len(by_name.get(name, [])) > 1:
            ambiguous.add(name)
        if idx < 0 and name and name not in ambiguous:
            unmatched.add(f"{name}({p})" if p >= 0 else name)
        chosen[u] = idx
    n_events = int(weights.sum()) if weights is not None else len(events)
    report = JoinReport(n_events, 0, int(events["duration_ps"].sum()), 0, tuple(sorted(unmatched)), 0,
                        tuple(sorted(ambiguous)), tuple(sorted({modules[i].source for i in chosen if i >= 0})))
    return chosen[codes] if len(events) else np.zeros(0, np.int64), report
