"""One host's profile file -> its op events and steps (event level, one row per op execution): the op lines of
XLA:CPU host threads, GPU streams (kernels tied to launches by correlation id), TPU ``XLA Ops`` lines, framework
ops, or trace JSON; async thunk ``end:`` events and launch times read alongside (``docs/reference/xplane-format.md``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from parsers.errors import InputError
from parsers.trace_json import text_categorical
from parsers.xspace import AGGREGATE_START_PS
from traceroof.codes import as_float64, constant_categorical, na_int64, run_codes, sorted_codes
from traceroof.discovery import TRACE_JSON_SUFFIXES, XPLANE_SUFFIXES
from traceroof.steps import kernel_launch_times, launch_events, launch_times


OP_STATS = ("hlo_op", "hlo_module", "program_id", "device_ordinal", "step_num")


TPU_COST_STATS = ("flops", "model_flops", "bytes_accessed")


# host events read besides ops and steps: async thunk ends, PjRt launches and the PjitFunction events around them
HOST_EVENT_NAMES = r"end: |PjitFunction\(|(?:\w+::)*\w*PjRt\w*Executable::Execute"


FRAMEWORK_OP_LINES = ("Framework Ops", "TensorFlow Ops")


ID_STATS = {"program_id": 0, "step_num": 0, "device_ordinal": 0, "run_id": -2**63,
            "correlation_id": -2**63}  # integer stats and the least valid value of each


FLOW_STATS = ("_p", "_c")  # uint64 flow ids (may exceed 2^63): compared as float64


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
        # the CPU plane's events as columns (no DataFrame until the op table: on a small profile pandas' fixed
        # cost per frame operation is most of the time)
        both = _checked_ids(cpu.columns(stats=(*OP_STATS, "run_id", "_p", "_c"), require=("hlo_op", "step_num"),
                                        names=HOST_EVENT_NAMES), info)
        no_op = np.asarray(pd.isna(both["hlo_op"]), bool)
        step_events = _take(both, ~np.asarray(pd.isna(both["step_num"]), bool))
        ends = _name_mask(both["name"], r"end: ")
        end_events = _take(both, ends, ("line_id", "start_ps", "duration_ps", "_c"))  # what the async ends use
        launch_rows = _take(both, _name_mask(both["name"], HOST_EVENT_NAMES) & ~ends & no_op,
                            ("line_id", "name", "start_ps", "duration_ps", "run_id"))
        op_rows = ~no_op & (both["start_ps"] != AGGREGATE_START_PS)
        keep = ("line_id", "start_ps", "duration_ps", "hlo_op", "hlo_module", "program_id", "device_ordinal",
                "run_id", "_p")
        both = {k: both[k] for k in keep}  # the others let go before the ops' are copied (20 M: 950 -> 738 MB peak)
        ev = _take_out(both, op_rows)
        del both, no_op, ends, op_rows
        ev["async_end_ps"] = _async_thunk_ends(ev, end_events)
        launches = launch_events(launch_rows)
        info["launches"] = len(launches)
        launch, info["executions_matched"] = launch_times({**ev, "module": ev["hlo_module"]}, launches)
        known = ~np.isnan(launch)
        ev["launch_ps"] = pd.arrays.IntegerArray(np.where(known, launch, 0).astype(np.int64), ~known)
        info["launches_after_steps"] = _launches_after_steps(launches, launch[known], step_events)
        ordinal = ev["device_ordinal"].to_numpy(dtype="int64", na_value=0)  # ids: >= 0 (_checked_ids)
        uniq, inv = sorted_codes(ordinal) if len(ordinal) else (ordinal, ordinal)
        n = len(ordinal)
        ev.update(device=pd.Categorical.from_codes(inv, categories=[f"{host}/cpu:{u}" for u in uniq]),
                  kernel=constant_categorical("", n), attributed=np.ones(n, bool))
        frames.append(ev)
        meta = xs.plane("/host:metadata")
        version = meta.stats.get("jax_version", "") if meta else ""
        desc = f"XLA:CPU host threads{f' (jax {version})' if version else ''}"
    if kind == "cpu":
        events = frames[0]
    else:
        events = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        if len(events) and "kernel" not in events:
            events = events.assign(kernel="", attributed=True)
    n = len(events["start_ps"]) if "start_ps" in events else 0
    out = pd.DataFrame({
        "host": constant_categorical(host, n),
        "device": _category(events["device"]) if n else pd.Categorical([]),
        "program_id": pd.array(events["program_id"], "Int64", copy=False) if n else pd.array([], "Int64"),
        "module": _category(events["hlo_module"]) if n else pd.Categorical([]),
        "hlo_op": _category(events["hlo_op"]) if n else pd.Categorical([]),
        "start_ps": np.asarray(events["start_ps"], np.int64) if n else np.zeros(0, np.int64),
        "duration_ps": np.asarray(events["duration_ps"], np.int64) if n else np.zeros(0, np.int64),
        "kernel": _category(events["kernel"]) if n else pd.Categorical([]),
        "attributed": np.asarray(events["attributed"], bool) if n else np.zeros(0, bool),
        "run_id": pd.array(events["run_id"], "Int64", copy=False) if "run_id" in events else na_int64(n),
        "launch_ps": (events["launch_ps"] if isinstance(events["launch_ps"], pd.arrays.IntegerArray) else
                      pd.array(np.asarray(events["launch_ps"], np.float64), "Float64").astype("Int64"))
        if "launch_ps" in events else na_int64(n),
    }, copy=False)
    if n and "async_end_ps" in events:
        out["async_end_ps"] = pd.array(events["async_end_ps"], "Int64", copy=False)
    if n and "framework_scope" in events:
        out["framework_scope"] = pd.Categorical(events["framework_scope"])
    for st in TPU_COST_STATS:
        if n and f"profile_{st}" in events:
            out[f"profile_{st}"] = np.asarray(events[f"profile_{st}"], np.float64)
    if fw_steps is not None and len(fw_steps):
        return out, fw_steps.reset_index(drop=True), kind, desc, "Steps", stats, info
    if kind == "tpu":
        step_events = _checked_ids(cpu.events(stats=("step_num",), require=("step_num",)), info) if cpu \
            else pd.DataFrame()
    steps, ann = _steps_from_events(step_events, host)
    return out, steps, kind, desc, ann, stats, info


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


def _name_mask(names: pd.Series | pd.Categorical, pattern: str) -> np.ndarray:
    """Events whose (categorical) name matches ``pattern`` at its start, tested once per distinct name."""
    cat = names if isinstance(names, pd.Categorical) else pd.Categorical(names)
    match = re.compile(pattern).match
    hit = np.array([match(str(c)) is not None for c in cat.categories] + [False])
    return hit[np.where(cat.codes >= 0, cat.codes, len(cat.categories))]


def _take(columns: dict[str, Any], rows: np.ndarray, names: Sequence[str] | None = None) -> dict[str, Any]:
    """The ``rows`` (a boolean mask or positions) of equally long columns (numpy or pandas arrays), of the columns
    ``names`` (default: all); every row of a mask: the same arrays."""
    if rows.dtype == bool and rows.all():
        return {k: columns[k] for k in (columns if names is None else names)}
    at = _positions(rows)
    return {k: columns[k].take(at) for k in (columns if names is None else names)}


def _positions(rows: np.ndarray) -> np.ndarray:
    """A boolean mask as the positions it selects (positions as they are): each column is then taken by position,
    which beats a mask (a count and a branch per row, each time) on the interleaved rows of a host's events."""
    return np.flatnonzero(rows) if rows.dtype == bool else rows


def _take_out(columns: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
    """:func:`_take` of every column, each one removed from ``columns`` as it is taken (so that a large table and
    its copy are never both held whole); ``columns`` is left empty."""
    every = rows.dtype == bool and rows.all()
    at = None if every else _positions(rows)
    return {k: columns.pop(k) if every else columns.pop(k).take(at) for k in list(columns)}


def _category(values: Any) -> pd.Categorical:
    """A column as categorical (``Series.astype("category")``): a Categorical as it is (its categories kept)."""
    if isinstance(values, pd.Categorical):
        return values
    if isinstance(values, pd.Series) and isinstance(values.dtype, pd.CategoricalDtype):
        return values.array
    return pd.Series(values).astype("category").array


def _async_thunk_ends(ops: dict[str, Any], ends: dict[str, Any]) -> pd.arrays.IntegerArray:
    """XLA:CPU async thunks: an op event may be only the launch of a thunk that completes later; its ``end: <op>``
    event is linked by the flow stats (the op's producer ``_p`` = the end event's consumer ``_c``; xla
    ``backends/cpu/runtime/thunk_executor.cc`` ``TracedExecute``). Returns the ops with ``async_end_ps``: the end
    that event implies, less the time the completing thread spent in other op events meanwhile (a completion
    delayed because that thread ran other ops is scheduling, not this op's work); NA where the event does not
    end after the op event. Durations are unchanged: :func:`_bound_async_ends` bounds these ends by the HLO.
    ``ops`` and ``ends``: columns as :meth:`parsers.xspace.Plane.columns` gives them (``_p`` / ``_c`` float64)."""
    n_ops = len(ops["start_ps"])
    implied = na_int64(n_ops)
    if not n_ops or not len(ends["start_ps"]) or "_p" not in ops or "_c" not in ends:
        return implied
    # (arrays over every op event made in place where they can be: on a fresh process each new one costs its
    # page faults, about as much as computing it)
    end_event = _flow_ends(as_float64(ops["_p"]), as_float64(ends["_c"]))
    start = np.asarray(ops["start_ps"], np.int64)
    old_end = start + np.asarray(ops["duration_ps"], np.int64)
    done = (np.asarray(ends["start_ps"], np.int64) + np.asarray(ends["duration_ps"], np.int64)).take(end_event)
    sel = np.flatnonzero((end_event >= 0) & (done > old_end))
    if not len(sel):
        return implied
    done, end_event = done[sel], end_event[sel]
    q_line = np.asarray(ends["line_id"], np.int64)[end_event]
    busy = _busy(np.asarray(ops["line_id"], np.int64), start, old_end, np.tile(q_line, 2),
                 np.concatenate([done, old_end[sel]]))
    extra = (done - old_end[sel]).astype(np.float64)
    extra -= busy[:len(sel)] - busy[len(sel):]  # the completing thread's time in other ops meanwhile
    extra = np.maximum(extra, 0).astype(np.int64)
    implied_ps = old_end  # (no longer needed as it is)
    implied_ps[sel] += extra
    missing = np.ones(n_ops, bool)
    missing[sel[extra > 0]] = False
    return pd.arrays.IntegerArray(implied_ps, missing)


def _flow_ends(p: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Per op event, the last end event whose flow id ``c`` equals the op's ``p`` (float64, NaN: none); -1 where
    none does."""
    # a stable sort of the end events' ids (NaN last, cut off; a thread's end events come by time, so their flow ids
    # are nearly sorted: merged runs, not a full sort), the last of each run of equal ids
    by_flow = np.argsort(c, kind="stable")[:len(c) - int(np.isnan(c).sum())]
    if not len(by_flow):
        return np.full(len(p), -1, np.int64)
    flows = c[by_flow]
    last = flows[1:] != flows[:-1]
    if not last.all():  # equal ids (usually each end event has its own)
        run_end = np.append(last, True)
        flows, by_flow = flows[run_end], by_flow[run_end]
    pos = np.searchsorted(flows, p)
    np.minimum(pos, len(flows) - 1, out=pos)
    out = by_flow.take(pos)
    np.putmask(out, flows.take(pos) != p, -1)  # NaN never equals
    return out


def _busy(lines: np.ndarray, start: np.ndarray, end: np.ndarray, q_line: np.ndarray, q_t: np.ndarray) -> np.ndarray:
    """Per query: the time (ps) thread ``q_line`` spent in op events (``lines``, ``start``, ``end``; one thread's
    events do not overlap) up to time ``q_t``."""
    out = np.zeros(len(q_t), np.int64)
    # threads numbered in order of first appearance (a plane's events come by thread and by time, so the
    # (thread, start) keys below are usually sorted already)
    thread, ids = run_codes(lines)
    q_thread = pd.Index(ids).get_indexer(q_line)  # -1: a thread without op events (0 busy)
    q = np.flatnonzero(q_thread >= 0)
    if not len(q):
        return out
    q_thread, q_t = q_thread[q], q_t[q]
    # (thread, time) as one sortable int64 key: thread x width + time from the earliest (or, when a time span
    # that wide could overflow, the time's rank among all times), for as many threads at a time as fit
    lo = min(int(start.min()), int(q_t.min()))
    width = max(int(start.max()), int(q_t.max())) - lo + 1
    if width < 2**62:
        t, q_tt = lo, q_t - lo  # (the events' times: start - lo, made with their keys)
    else:
        times, rank = np.unique(np.concatenate([start, q_t]), return_inverse=True)
        width = len(times) + 1
        t, q_tt = rank[:len(start)], rank[len(start):]
    n_threads = len(ids)
    per = max(2**63 // width, 1)  # keys below per x width: at most 2^63 - 1
    if per < n_threads:  # more threads than one key holds: only the threads queried, numbered 0..n-1 again
        wanted = np.zeros(n_threads, bool)
        wanted[q_thread] = True
        renumber = np.cumsum(wanted) - 1
        on = np.flatnonzero(wanted[thread])
        thread, start, end = renumber[thread[on]], start[on], end[on]
        t = t if isinstance(t, int) else t[on]
        q_thread, n_threads = renumber[q_thread], int(renumber[-1]) + 1
    if per >= n_threads:
        out[q] = _busy_of_threads(thread, n_threads, t, start, end, q_thread, q_tt, q_t, width)
        return out
    res = np.zeros(len(q), np.int64)
    for a in range(0, n_threads, per):
        ev = np.flatnonzero((thread >= a) & (thread < a + per))
        qs = np.flatnonzero((q_thread >= a) & (q_thread < a + per))
        res[qs] = _busy_of_threads(thread[ev] - a, min(per, n_threads - a), t if isinstance(t, int) else t[ev],
                                   start[ev], end[ev], q_thread[qs] - a, q_tt[qs], q_t[qs], width)
    out[q] = res
    return out


def _busy_of_threads(thread: np.ndarray, n_threads: int, t: np.ndarray | int, start: np.ndarray, end: np.ndarray,
                     q_thread: np.ndarray, q_tt: np.ndarray, q_t: np.ndarray, width: int) -> np.ndarray:
    """:func:`_busy` of threads ``thread`` numbered 0..n_threads-1 (below ``2**63 // width``; int64, used up: the
    array becomes the keys), times also as ``t`` / ``q_tt`` in [0, width) (``t`` an int: the events' times are
    ``start - t``)."""
    key = thread
    key *= width
    if isinstance(t, int):
        key += start  # (modular int64: the sum after the next line fits)
        key -= t
    else:
        key += t
    q_key = q_thread * width + q_tt
    if not (key[1:] >= key[:-1]).all():  # sorted already when the events come by thread and by time
        order = np.argsort(key, kind="stable")
        key, start, end = key[order], start[order], end[order]
    duration = end - start
    cum = np.cumsum(duration)
    cum -= duration  # time in events before each one, from the first event
    first = np.searchsorted(key, np.arange(n_threads) * width)  # each thread's first event (each has some)
    before = cum[np.minimum(first, len(key) - 1)]  # time before it
    j = np.searchsorted(key, q_key, side="right") - 1  # the thread's last event starting at or before t
    ok = j >= 0
    ok[ok] = key[j[ok]] // width == q_thread[ok]
    np.maximum(j, 0, out=j)
    part = np.minimum(q_t, end[j])
    part -= start[j]
    np.maximum(part, 0, out=part)  # of that event, up to t
    busy = cum[j]
    busy -= before[q_thread]
    busy += part
    busy[~ok] = 0
    return busy


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
            "device": f"{host}/{p.name}", "program_id": na_int64(len(ev)),
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


def _steps_from_events(ev: Any, host: str) -> tuple[pd.DataFrame, str]:
    """The step-marker events (``step_num`` set) of the most frequent name (the step annotation), by start, as
    steps (``host``, ``step``, ``start_ps``, ``end_ps``), and that name. ``ev``: a DataFrame or columns by
    name (:meth:`parsers.xspace.Plane.columns`)."""
    num = ev["step_num"] if "step_num" in ev else None
    num = num.array if isinstance(num, pd.Series) else num
    marked = np.flatnonzero(~np.asarray(pd.isna(num), bool)) if num is not None else []
    if not len(marked):
        return pd.DataFrame({"host": pd.Series([], dtype=object), "step": pd.array([], "Int64"),
                             "start_ps": np.zeros(0, np.int64), "end_ps": np.zeros(0, np.int64)}), ""
    name_col = ev["name"].array if isinstance(ev["name"], pd.Series) else ev["name"]
    codes = np.unique(name_col.codes[marked]) if isinstance(name_col, pd.Categorical) else []
    if len(codes) == 1:  # one name (the usual case)
        name = "" if codes[0] < 0 else str(name_col.categories[codes[0]])
    else:
        names = pd.Series(name_col[marked]).astype(object)
        names = names.where(names.notna(), "").astype(str)  # a corrupt event: no name
        distinct = set(names)
        name = distinct.pop() if len(distinct) == 1 else names.value_counts().idxmax()
        if distinct:
            marked = marked[(names == name).to_numpy(bool)]
    start = np.asarray(ev["start_ps"], np.int64)[marked]
    order = np.argsort(start, kind="stable")
    steps = pd.DataFrame({
        "host": host,
        "step": pd.array(np.asarray(pd.to_numeric(num[marked]), np.int64)[order], "Int64"),
        "start_ps": start[order],
        "end_ps": (start + np.asarray(ev["duration_ps"], np.int64)[marked])[order],
    })
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


def _ids(values: Any, lo: int = -2**63) -> tuple[pd.arrays.IntegerArray, int]:
    """Integer ids (program, run, correlation ids, step numbers, ordinals) as ``Int64``: anything that is not an
    integer in [lo, 2^63) (text, fractions, NaN, 2^70, or a negative program id) becomes NA. Also returns how
    many values were present but invalid. Exact for every int64 (no float round trip). ``values``: a Series or
    an array."""
    values = values.array if isinstance(values, pd.Series) else values
    if isinstance(values.dtype, pd.Int64Dtype):
        if lo == -2**63 or not (values < lo).any():  # every value valid (NA skipped): as it is, no copy
            return values, 0
        v = values.to_numpy(np.int64, na_value=0)
        present = ~values.isna()
        ok = present & (v >= lo)
        return pd.arrays.IntegerArray(np.where(ok, v, 0), ~ok), int((present & ~ok).sum())
    codes, uniq = pd.factorize(np.asarray(values, dtype=object), use_na_sentinel=True)
    conv = [as_id(u, lo) for u in uniq]
    good = np.array([c is not None for c in conv] + [False])
    vals = np.array([c if c is not None else 0 for c in conv] + [0], np.int64)
    idx = np.where(codes >= 0, codes, len(uniq))
    return pd.arrays.IntegerArray(vals[idx], ~good[idx]), int(((codes >= 0) & ~good[idx]).sum())


def _launches_after_steps(launches: pd.DataFrame, matched_ps: np.ndarray, step_events: dict) -> int:
    """Launches after the end of the last marked step whose execution left no op event: the launch of a step
    whose annotation was still open when the trace stopped (it is not in the profile: jax writes no unfinished
    annotation), its device work cut off too. ``matched_ps``: launch times matched to executions."""
    ends = np.asarray(step_events["start_ps"], np.int64) + np.asarray(step_events["duration_ps"], np.int64)
    if not len(ends) or launches.empty:
        return 0
    start = launches["start_ps"].to_numpy(np.int64)
    late = start[start > ends.max()]  # few: looked up among the matched times only when there are some
    return int((~np.isin(late, matched_ps.astype(np.int64))).sum()) if len(late) else 0


def _checked_ids(table: Any, counts: dict[str, int]) -> Any:
    """``table`` (a DataFrame, or columns by name as :meth:`parsers.xspace.Plane.columns` gives them) with its
    integer stats (:data:`ID_STATS`) as valid ``Int64`` ids and its flow ids as float64; invalid values (a corrupt
    stat of the wrong type or range) become NA and are counted in ``counts["bad:<stat>"]``."""
    cols = {}
    for name, lo in ID_STATS.items():
        if name in table:
            cols[name], bad = _ids(table[name], lo)
            if bad:
                counts[f"bad:{name}"] = counts.get(f"bad:{name}", 0) + bad
    for name in FLOW_STATS:
        if name in table and not pd.api.types.is_numeric_dtype(table[name].dtype):
            raw = np.asarray(table[name], dtype=object)
            cols[name] = np.asarray(pd.to_numeric(raw, errors="coerce"), dtype=np.float64)
            bad = int((~np.asarray(pd.isna(raw), bool) & np.isnan(cols[name])).sum())
            if bad:
                counts[f"bad:{name}"] = counts.get(f"bad:{name}", 0) + bad
    if isinstance(table, dict):
        return {**table, **cols}
    return table.assign(**cols) if cols else table


def _text_category(values: Any) -> pd.Categorical:
    """A categorical column as text, a category per text value present (``values.astype(str).astype("category")``;
    without the round trip where the categories are text already). ``values``: a Series or an array."""
    values = values.array if isinstance(values, pd.Series) else values
    if isinstance(values, pd.Categorical) and isinstance(values.categories.dtype, pd.StringDtype):
        return values.remove_unused_categories()
    return pd.Series(values).astype(str).astype("category").array


def _trace_json_events(tj, path: Path, counts: dict[str, int]) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    host = _host_of(str(path))
    ids = ("program_id", "device_ordinal", "step_num", "run_id")  # made Int64 by _checked_ids
    ev = _checked_ids(tj.columns(args=("hlo_op", "hlo_module", *ids), raw=ids), counts)
    has_op = ~np.asarray(pd.isna(ev["hlo_op"]), bool)
    ops = _take(ev, has_op & _name_mask(ev["plane"], "/host:CPU|/device:"))
    run_id = ops["run_id"]
    named = _name_mask(ev["name"], HOST_EVENT_NAMES) & ~has_op
    launches = launch_events({"line_id": ev["tid"][named], "name": ev["name"][named],
                              "start_ps": ev["start_ps"][named], "duration_ps": ev["duration_ps"][named]})
    module = _text_category(ops["hlo_module"])
    launch, _ = launch_times({"module": np.asarray(module, dtype=object), "run_id": run_id,
                              "start_ps": ops["start_ps"]}, launches)
    n = len(ops["start_ps"])
    ordinal = ops["device_ordinal"].to_numpy(np.int64, na_value=0).tolist()
    cpus = {o: f"{host}/cpu:{o}" for o in set(ordinal)}
    known = ~np.isnan(launch)
    out = pd.DataFrame({
        "host": constant_categorical(host, n),
        "device": text_categorical([cpus[o] for o in ordinal]) if n else pd.Categorical(pd.array([], "str")),
        "program_id": ops["program_id"],
        "module": module,
        "hlo_op": _text_category(ops["hlo_op"]),
        "start_ps": ops["start_ps"],
        "duration_ps": ops["duration_ps"],
        "kernel": constant_categorical("", n),
        "attributed": np.ones(n, bool),
        "run_id": run_id,
        "launch_ps": pd.arrays.IntegerArray(np.where(known, launch, 0).astype(np.int64), ~known),
    }, copy=False)
    steps, ann = _steps_from_events(ev, host)
    return out, steps, ann
