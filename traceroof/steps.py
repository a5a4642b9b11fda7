"""Steps by execution: each op event belongs to the step whose launch produced it.

Under JAX's asynchronous dispatch a ``StepTraceAnnotation`` closes as soon as the step's programs are *launched*;
their ops run later, often after the annotation (and the next ones) closed. Putting ops in steps by wall-clock
overlap with the annotation then gives empty steps. Instead:

- **XLA:CPU** (read from real jax 0.10 profiles): every op event of one execution carries the same ``run_id``;
  run ids are issued per program, consecutively, in launch order (``launch_id`` = a per-executable base + a launch
  counter, as a signed 32-bit value that may wrap). The launch is the PjRt execute event on the thread that called
  the program (``CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice`` nested in ``PjitFunction(<fn>)``, or
  ``CommonPjRtLoadedExecutable::Execute (<module>)`` for multi-device programs), inside the step annotation that
  issued it. Executions of a program are matched to that program's launches in order (:func:`launch_times`).
- **GPU**: a kernel's launch is the host API event with the same ``correlation_id`` (CUPTI / roctracer).
- **TPU**: the device's own ``Steps`` line.

A step's device time runs from its first launch (no earlier than the previous step's last op end: a device runs
executions in order) to its last op end; :func:`device_step_spans`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from parsers.errors import InputError
from parsers.hlo import HloModule
from traceroof.codes import RunGroups, as_float64, first_rows, group_codes, na_int64, run_starts, sorted_codes

# PjRt execute events (the launch of one execution), jax 0.4.3x-0.10: the multi-device form names the module
LAUNCH_EVENT = re.compile(r"^(?:\w+::)*\w*PjRt\w*Executable::Execute(?:HelperOnSingleDevice|Helper|Sharded|"
                          r"Portable)?(?: \((?P<module>[^()]*)\))?$")
PJIT_EVENT = re.compile(r"^PjitFunction\((?P<fn>.*)\)$")
MAX_PJIT_LOOKBACK = 100_000  # PjitFunction events (tracing, nested calls) searched back for a launch's caller
# candidate offsets x executions above which only start/end alignments are tried. The search no longer costs
# offsets x executions (a difference array), so this bound is historical: it keeps which alignments are tried on
# very long profiles (a few thousand executions of one program) as they were; lifting it changes results there.
MAX_OFFSET_WORK = 20_000_000
# run ids of one program spanning more than this x (executions + launches) are not one launch counter: no guess
RUN_ID_GAP_FACTOR = 4


def _name_matches(names: pd.Series, pattern: re.Pattern) -> tuple[np.ndarray, list[re.Match]]:
    """The events whose name ``pattern`` matches (a missing name matches nothing), and each one's match; tried
    once per distinct name."""
    codes, distinct = pd.factorize(names)
    tried = [pattern.match(str(n)) for n in distinct]
    rows = np.flatnonzero(np.array([m is not None for m in tried] + [False])[codes])  # code -1: the False appended
    return rows, [tried[c] for c in codes[rows].tolist()]


def jit_module_name(fn: str) -> str:
    """The HLO module name of ``jax.jit(fn)`` from the name in its ``PjitFunction(<name>)`` event: ``jit_`` and
    the name with characters other than letters, digits, ``_``, ``.`` and ``-`` made ``_`` (JAX's
    ``mlir.sanitize_name``) and trailing ``_`` dropped, as the compiled module shows (checked with jax 0.10:
    ``<lambda>`` -> ``jit__lambda``, ``step_`` -> ``jit_step``, a callable object's ``<unnamed function>`` ->
    ``jit__unnamed_function``)."""
    return "jit_" + _UNSAFE_NAME.sub("_", fn).rstrip("_")


_UNSAFE_NAME = re.compile(r"[^\w.-]")


def launch_events(events: Mapping[str, Any]) -> pd.DataFrame:
    """The launch events among a host's events, with the module each launched where it can be told.

    ``events``: ``line_id``, ``name``, ``start_ps``, ``duration_ps`` and optionally ``run_id`` (launch events and
    ``PjitFunction(...)`` events, any order; a DataFrame or equally long arrays by name). Returns ``line_id``,
    ``start_ps``, ``end_ps``, ``module`` (the module named in the event, else :func:`jit_module_name` of the
    innermost enclosing ``PjitFunction(<fn>)`` on the same line, else '') and, when given, ``run_id`` (float64, NaN
    where the event has none: PjRt's ``Execute`` events of multi-device programs carry the run id of the execution
    they launch, its single-device ``ExecuteHelperOnSingleDevice`` events do not).
    """
    line = np.asarray(events["line_id"], np.int64)
    ev_start = np.asarray(events["start_ps"], np.int64)
    ev_end = ev_start + np.asarray(events["duration_ps"], np.int64)
    lau, matches = _name_matches(events["name"], LAUNCH_EVENT)
    o_line, o_start, o_end = line[lau], ev_start[lau], ev_end[lau]
    module = np.array([m.group("module") or "" for m in matches] + [""], dtype=object)[:-1]
    pj, matches = _name_matches(events["name"], PJIT_EVENT) if (module == "").any() else (lau[:0], [])
    if len(pj):
        by_line = np.lexsort((ev_start[pj], line[pj]))
        pj, fn = pj[by_line], [matches[k].group("fn") for k in by_line.tolist()]
        pline, pstart, pend = line[pj], ev_start[pj], ev_end[pj]
        todo = np.flatnonzero(module == "")
        t_line, s, e = o_line[todo], o_start[todo], o_end[todo]
        # per launch, the last PjitFunction event on its line starting at or before it: the PjitFunction events
        # (by line, by start) that sort before the launch, the launch after those starting at its own start
        merged = np.lexsort((np.r_[np.zeros(len(pj), np.int8), np.ones(len(todo), np.int8)],
                             np.r_[pstart, s], np.r_[pline, t_line]))
        before = np.cumsum(merged < len(pj))
        j = np.empty(len(todo), np.int64)
        j[merged[merged >= len(pj)] - len(pj)] = before[merged >= len(pj)] - 1
        # the innermost enclosing event is the latest started one that is still open; none before the line's first
        stop = np.maximum(j - MAX_PJIT_LOOKBACK, np.searchsorted(pline, t_line, side="left") - 1)
        active = np.arange(len(j))
        while len(active):  # a sibling that ended before the launch: look further out (at most the lookback)
            jj = j[active]
            active = active[(jj > stop[active]) & (pend[np.maximum(jj, 0)] < e[active])]
            j[active] -= 1
        found = j > stop
        module[todo[found]] = [jit_module_name(fn[k]) for k in j[found].tolist()]
    order = np.argsort(o_start, kind="stable")
    out = pd.DataFrame({"line_id": o_line[order], "start_ps": o_start[order], "end_ps": o_end[order],
                        "module": module[order]})
    if "run_id" in events:
        out["run_id"] = as_float64(events["run_id"])[lau][order]
    return out


def _unwrapped(run_ids: np.ndarray) -> np.ndarray:
    """Run ids (signed 32-bit values, possibly wrapped) as a monotonic launch counter."""
    r = run_ids.astype(np.int64) % (1 << 32)
    if len(r) and r.max() - r.min() > (1 << 31):
        r = np.where(r < (1 << 31), r + (1 << 32), r)
    return r


def _best_offset(offsets: np.ndarray, first_start: np.ndarray, launch_start: np.ndarray,
                 last_cut: bool = False) -> tuple[int, int]:
    """The launch index ``o`` of the first execution maximising executions ``k`` whose launch
    ``o + offsets[k]`` exists and starts no later than their first op; ties go to the ``o`` that leaves the
    fewest executions after the last launch, then to the smallest ``|o|`` (the negative first). An execution
    whose ops ran while the trace recorded was launched while it recorded (its launch is in the profile) or
    before it started, never after the last launch the profile holds: when the host runs far ahead of the
    device (every launch precedes every op, so several alignments tie) the executions without a launch are the
    first ones, still queued when the trace started. ``last_cut``: the last execution was still running when
    the trace stopped, so its launch event, still open then, may be missing. ``offsets``: non-decreasing from
    0; ``launch_start``: sorted."""
    n_l = len(launch_start)
    span = int(offsets[-1]) if len(offsets) else 0
    candidates = np.arange(-span, n_l)
    if len(candidates) * len(offsets) > MAX_OFFSET_WORK:
        candidates = np.array(sorted({0, n_l - 1 - span}))
    # execution k counts for every o from -offsets[k] up to (not including) the number of launches starting no
    # later than its first op, less offsets[k]: per o, the intervals containing it (a difference array)
    lo = -offsets
    hi = np.searchsorted(launch_start, first_start, side="right") - offsets
    ok = hi > lo
    diff = np.bincount(lo[ok] + span, minlength=n_l + span + 1) - np.bincount(hi[ok] + span, minlength=n_l + span + 1)
    valid = np.cumsum(diff)[candidates + span]
    counted = offsets[:-1] if last_cut else offsets
    late = len(counted) - np.searchsorted(counted, n_l - candidates, side="left")  # o + offsets[k] >= n_l
    order = np.lexsort((candidates, np.abs(candidates), late))
    best = order[np.argmax(valid[order])]
    return int(candidates[best]), int(valid[best])


def launch_times(ops: Mapping[str, Any], launches: pd.DataFrame) -> tuple[np.ndarray, int]:
    """The launch time (ps) of every op event's execution, NaN where it cannot be told, and how many
    executions were matched to a launch.

    ``ops``: one host's op events with ``program_id``, ``module``, ``run_id`` (nullable), ``start_ps`` (a
    DataFrame or equally long arrays by name).
    ``launches``: :func:`launch_events` of the same host. Where a module's launches carry run ids and some equal
    its executions' (:func:`_by_run_id`), each execution takes the launch of its run id. Otherwise the executions
    of each module, ordered by run id (:func:`_launch_counter`), are matched to the launches of that module (by
    name) in time order; the alignment (which launch the first execution had: the profile may start after some
    launches and stop before some executions ran) is the one under which the most launches precede their
    execution's first op (:func:`_best_offset`).
    """
    n = len(ops["start_ps"])
    out = np.full(n, np.nan)
    if not n or launches.empty or "run_id" not in ops:
        return out, 0
    rid = as_float64(ops["run_id"])
    has = ~np.isnan(rid)
    if not has.any():
        return out, 0
    pid = as_float64(ops["program_id"], -1) if "program_id" in ops else np.full(n, -1.0)
    rows = slice(None) if has.all() else np.flatnonzero(has)  # (every event: views, not copies)
    module_col = ops["module"]
    module_col = module_col.array if isinstance(module_col, pd.Series) else module_col
    if isinstance(module_col, pd.Categorical):  # its codes (-1: none), the modules present: no hash of every event
        module, names = module_col.codes[rows], module_col.categories
        present = np.flatnonzero(np.bincount(module[module >= 0], minlength=len(names))).tolist()
    else:
        module, names = pd.factorize(module_col[rows])
        present = range(len(names))
    run, start, pid = rid[rows].astype(np.int64), np.asarray(ops["start_ps"], np.int64)[rows], pid[rows]
    lau_module = launches["module"].to_numpy(object)
    lau_start = launches["start_ps"].to_numpy(np.int64)
    lau_run = launches["run_id"].to_numpy(np.float64) if "run_id" in launches else None
    matched = 0
    for k in present:  # (each module's events are matched on their own: the order does not matter)
        mine, name = np.flatnonzero(module == k), str(names[k])
        on = lau_module == name
        starts = lau_start[on] if name else lau_start[:0]
        exact = _by_run_id(run[mine], lau_run[on], starts) if lau_run is not None and len(starts) else None
        if exact is not None:
            when_ev, executions = exact
            matched += executions
            out[mine if isinstance(rows, slice) else rows[mine]] = when_ev
            continue
        found = _launch_counter(pid[mine], run[mine], start[mine], len(starts)) if len(starts) else None
        if found is None:
            continue
        runs, at, first_start = found
        order = np.argsort(runs, kind="stable")
        runs, first_start = runs[order], first_start[order]
        o, _ = _best_offset(runs - runs[0], first_start, starts,
                            last_cut=bool(_cut_short(np.bincount(at, minlength=len(runs))[order])[-1]))
        idx = o + (runs - runs[0])
        ok = (idx >= 0) & (idx < len(starts))
        when = np.full(len(runs), np.nan)
        when[order[ok]] = starts[idx[ok]]
        matched += int(ok.sum())
        out[mine if isinstance(rows, slice) else rows[mine]] = when[at]
    return out, matched


def _by_run_id(run: np.ndarray, launch_run: np.ndarray, launch_start: np.ndarray) -> tuple[np.ndarray, int] | None:
    """Each op event's launch time by run id (``run``: the events' run ids; ``launch_run``, ``launch_start``: the
    module's launches, NaN where a launch carries none; the earliest launch of a run id counts), NaN for an
    event whose run id no launch carries (launched before the trace started), and how many executions were
    matched; ``None`` when no event's run id is a launch's (launches without run ids, or numbered otherwise)."""
    known = ~np.isnan(launch_run)
    if not known.any():
        return None
    keys, starts = launch_run[known].astype(np.int64), launch_start[known]
    order = np.lexsort((starts, keys))
    keys, starts = keys[order], starts[order]
    at = np.minimum(np.searchsorted(keys, run), len(keys) - 1)  # the first (earliest) launch of each run id
    hit = keys[at] == run
    if not hit.any():
        return None
    return np.where(hit, starts[at], np.nan), len(np.unique(run[hit]))


def _launch_counter(pid: np.ndarray, run: np.ndarray, start: np.ndarray, launches: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The executions of one module name's op events (``pid``, ``run``, ``start``: program id, run id and start
    of each): (each execution's place in the name's launch order, each event's execution, each execution's first
    op start), or ``None`` where the order cannot be told.

    One program: its run ids count its launches (unwrapped; ``None`` when they span more than
    ``RUN_ID_GAP_FACTOR`` x the executions and ``launches``: not one counter). Several programs under one name
    (two ``jax.jit(lambda ...)`` are both ``jit__lambda``; the launch events carry the name only): each program
    counts its own launches, so their launches interleave under the name; the executions are ordered by their
    first op's start, the launch order when each device runs its executions in launch order, and ``None`` unless
    that order keeps every program's run-id order and each program's run ids are consecutive.
    """
    programs = np.unique(pid)
    if len(programs) == 1:
        runs, at, first_start = _executions(run, start)
        return None if runs.max() - runs.min() > RUN_ID_GAP_FACTOR * (len(runs) + launches) else \
            (runs, at, first_start)
    at = np.empty(len(pid), np.int64)
    firsts: list[np.ndarray] = []
    n = 0
    for p in programs:
        sel = np.flatnonzero(pid == p)
        runs, mine, first_start = _executions(run[sel], start[sel])
        order = np.argsort(runs, kind="stable")
        if runs[order[-1]] - runs[order[0]] + 1 != len(runs) or (np.diff(first_start[order]) < 0).any():
            return None
        at[sel] = mine + n
        firsts.append(first_start)
        n += len(runs)
    first_start = np.concatenate(firsts)
    rank = np.empty(n, np.int64)
    rank[np.argsort(first_start, kind="stable")] = np.arange(n)
    return rank, at, first_start


def _executions(run: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One program's op events (``run``: run ids, ``start``: start ps) as executions: (each execution's run id,
    unwrapped (:func:`_unwrapped`), each event's execution, each execution's first op start, ps)."""
    run_keys, at = sorted_codes(run)
    first_start = np.full(len(run_keys), np.iinfo(np.int64).max)
    np.minimum.at(first_start, at, start)
    return _unwrapped(run_keys), at, first_start


def _cut_short(counts: np.ndarray) -> np.ndarray:
    """Per execution of a program (``counts``: its op events, in run id order), whether it is the first or the last
    one and holds fewer op events than every execution between them (at least one): a candidate for an execution
    the trace's start or stop cut off (the ones between ran whole inside the trace)."""
    out = np.zeros(len(counts), bool)
    if len(counts) >= 3:
        least = counts[1:-1].min()
        out[0], out[-1] = counts[0] < least, counts[-1] < least
    return out


@dataclass(frozen=True, eq=False)
class LeftOut:
    """:func:`left_out_executions`' answer: per op event (bool), whether it belongs to an execution that
    ``before`` began before the trace started, or ``after`` was still running when it stopped; and how many
    executions each holds (``executions_before``, ``executions_after``)."""

    before: np.ndarray
    after: np.ndarray
    executions_before: int = 0
    executions_after: int = 0


# entry-computation instructions that XLA:CPU runs as no thunk (no op event): values, tuples and views. Every other
# instruction of the entry ran in each whole execution of every fixture program (fusion, dot, copy, while,
# partition-id, concatenate, the collectives; 1,005 instructions of jax 0.10 profiles)
NO_EVENT_OPCODES = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
                              "add-dependency", "opt-barrier", "domain"})


def entry_schedule(module: HloModule) -> tuple[str, ...]:
    """The instructions of ``module``'s entry computation that run as an op event of their own on XLA:CPU, in the
    order the (scheduled, after-optimization) HLO lists them: the order one execution runs them."""
    return tuple(i.name for i in module.entry.instructions if i.opcode not in NO_EVENT_OPCODES)


def left_out_executions(events: pd.DataFrame, tied: np.ndarray,
                        schedules: Mapping[tuple[int | None, str], Sequence[str]] | None = None) -> LeftOut:
    """Per op event, whether its execution ran only partly inside the profile, so no step may hold it:
    ``before``: began before the trace started, either launched before it (its run id precedes that of its
    program's first execution tied to a launch in the profile: run ids are issued in launch order, and a launch
    while the trace recorded is in it) or already running (cut off at the start); ``after``: still running when
    the trace stopped (cut off at the end). An execution is cut off when it is the first or the last of its
    program in the profile, holds fewer op events than every execution between them (:func:`_cut_short`) and
    lacks an op that each of those ran. A program with fewer than three executions has none to compare with; there
    its HLO decides (``schedules``: per ``(program_id, module)``, :func:`entry_schedule`): a first execution that
    ran only the end of its entry schedule, or none of it, began before the trace; a last one that ran only its
    beginning was cut by the stop (a capture started while the job compiled holds one execution, cut short).

    ``events``: one host's op events with ``program_id``, ``module``, ``run_id`` (nullable: events without one
    are never left out) and ``hlo_op``; ``tied``: per event, whether its execution was tied to its launch.
    """
    n = len(events)
    before, after = np.zeros(n, bool), np.zeros(n, bool)
    has = events["run_id"].notna().to_numpy(bool) if n and "run_id" in events else before
    if not has.any():
        return LeftOut(before, after)
    rows = np.flatnonzero(has)
    run = events["run_id"].to_numpy(np.int64, na_value=0)
    pid, module = events["program_id"].array, events["module"].array
    if len(rows) < n:
        run, pid, module = run[rows], pid[rows], module[rows]
    program = group_codes([pid, module])
    exe = group_codes([program, run])  # one code per execution
    first = first_rows(exe)
    exe_program, exe_run, exe_tied = program[first], run[first], tied[rows[first]]
    count = np.bincount(exe, minlength=len(first))
    exe_before, exe_after = np.zeros(len(first), bool), np.zeros(len(first), bool)
    for p in range(int(program.max()) + 1):
        mine = np.flatnonzero(exe_program == p)
        runs = _unwrapped(exe_run[mine])
        by_run = np.argsort(runs, kind="stable")
        mine, runs = mine[by_run], runs[by_run]
        if exe_tied[mine].any():
            exe_before[mine] = runs < runs[exe_tied[mine]].min()
        short = np.flatnonzero(_cut_short(count[mine]))
        if len(mine) < 3 and schedules:
            key = (None if pd.isna(pid[first[mine[0]]]) else int(pid[first[mine[0]]]), str(module[first[mine[0]]]))
            order = schedules.get(key)
            if order:
                at = np.flatnonzero(program == p)
                for k in sorted({0, len(mine) - 1}):
                    ran = set(events["hlo_op"].array[rows[at[exe[at] == mine[k]]]].astype(str))
                    cut = _schedule_cut(order, ran)
                    if k == len(mine) - 1 and cut in ("end", "all"):  # a sole execution that ran none: the stop
                        exe_after[mine[k]] = True
                    elif k == 0 and cut in ("start", "all"):
                        exe_before[mine[k]] = True
            continue
        if not len(short):
            continue
        at = np.flatnonzero(program == p)
        op = pd.factorize(events["hlo_op"].array[rows[at]], use_na_sentinel=False)[0]
        pairs = first_rows(group_codes([exe[at], op]))  # each (execution, op) once
        ran_exe, ran_op = exe[at][pairs], op[pairs]
        between = np.isin(ran_exe, mine[1:-1])
        every = np.bincount(ran_op[between], minlength=op.max() + 1) == len(mine) - 2  # ops each of those ran
        for k in short:
            if every.sum() > every[ran_op[ran_exe == mine[k]]].sum():  # it lacks one
                (exe_before if k == 0 else exe_after)[mine[k]] = True
    for mask, exe_mask in ((before, exe_before), (after, exe_after)):
        if exe_mask.any():  # rarely: most profiles leave nothing out
            mask[rows] = exe_mask[exe]
    return LeftOut(before, after, int(exe_before.sum()), int(exe_after.sum()))


def _schedule_cut(order: Sequence[str], ran: set[str]) -> str:
    """Where an execution that ran the instructions ``ran`` of an entry schedule ``order`` (:func:`entry_schedule`)
    was cut: ``"end"`` (it ran a beginning of the schedule, not all of it), ``"start"`` (an end of it), ``"all"``
    (none of it: it ran only inside a loop or a call), or ``""`` (whole, or gaps that no cut explains)."""
    did = np.array([name in ran for name in order], bool)
    if did.all():
        return ""
    if not did.any():
        return "all"
    first, last = int(np.argmax(did)), len(did) - 1 - int(np.argmax(did[::-1]))
    if not did[first:last + 1].all():
        return ""
    return "end" if first == 0 else ("start" if last == len(did) - 1 else "")


def kernel_launch_times(kernel_correlation: np.ndarray, api_correlation: np.ndarray,
                        api_start_ps: np.ndarray) -> np.ndarray:
    """GPU: the start (ps) of the host API call (``cuLaunchKernel``, ``hipModuleLaunchKernel``...) that launched
    each kernel, matched on ``correlation_id`` (CUPTI / roctracer); NaN where no API event has the id."""
    out = np.full(len(kernel_correlation), np.nan)
    ok = ~np.isnan(kernel_correlation)
    if not ok.any() or not len(api_correlation):
        return out
    first = pd.Series(api_start_ps, index=api_correlation).groupby(level=0).min()
    out[ok] = pd.Series(kernel_correlation[ok]).map(first).to_numpy(np.float64, na_value=np.nan)
    return out


def assign_steps(when_ps: np.ndarray, keys: pd.Series | pd.Categorical, steps: pd.DataFrame,
                 by: str = "host") -> np.ndarray:
    """The step (int64, -1 outside every step) whose interval in ``steps`` (``by``, ``step``, ``start_ps``,
    ``end_ps``) on the same ``by`` key (host annotations; a TPU device's ``Steps`` line) contains each time (ps).
    ``keys``: the ``by`` value of every time, compared through categorical codes."""
    if steps.empty:
        return np.full(len(when_ps), -1, np.int64)
    out = None
    cat = keys if isinstance(keys, pd.Categorical) else pd.Categorical(keys)
    codes = cat.codes
    step_key, key_names = pd.factorize(steps[by])
    starts_all = steps["start_ps"].to_numpy(np.int64)
    ends_all = steps["end_ps"].to_numpy(np.int64)
    step_all = steps["step"].to_numpy(np.int64, na_value=-1)
    for k, pos in enumerate(cat.categories.get_indexer(key_names)):
        if pos < 0:
            continue
        st = np.flatnonzero(step_key == k)
        st = st[np.argsort(starts_all[st], kind="stable")]
        on = codes == pos
        every = bool(on.all())  # one key (a host's annotations): the times as they are
        rows = None if every else np.flatnonzero(on)
        t = when_ps if every else when_ps[rows]
        heads = run_starts(t)  # the events of an execution come together, at its launch: one look-up per run
        t_heads = t[heads]
        # the step starting last at or before each time (position 0: before the first step, which ends before
        # every time), if the time is before its end
        at = np.searchsorted(starts_all[st], t_heads, side="right")
        found = np.append(-1, step_all[st])[at]
        found[t_heads >= np.append(np.iinfo(np.int64).min, ends_all[st])[at]] = -1
        if len(heads) < len(t):
            found = np.repeat(found, np.diff(heads, append=len(t)))
        if every:
            return found
        if out is None:
            out = np.full(len(when_ps), -1, np.int64)
        out[rows] = found
    return np.full(len(when_ps), -1, np.int64) if out is None else out


def dominant_program_steps(ops: pd.DataFrame, when_ps: np.ndarray) -> tuple[pd.DataFrame, str]:
    """Steps when the profile marks none: each execution of the dominant program (most op time; of the programs
    executed more than once, when one is: a generation's one prefill does not make the whole run one step of its
    own, its decode executions do) is a step, spanning from its launch (or first op) to the next one's; the last
    ends at the host's last op end.

    Returns the steps table (``host``, ``step``, ``start_ps``, ``end_ps``) and the program's module name, with
    its program id when other programs share the name (two ``jax.jit(lambda ...)`` are both ``jit__lambda``); an
    empty table when the program's executions carry no run ids to tell them apart."""
    g = ops.groupby(["module", "program_id"], observed=True, dropna=False)
    dur = g["duration_ps"].sum()
    if dur.empty:
        return pd.DataFrame(columns=["host", "step", "start_ps", "end_ps"]), ""
    if "run_id" in ops:  # a program run once (a prefill) is no step beside one run again and again (its decode)
        repeated = g["run_id"].nunique() > 1
        if repeated.any() and not repeated[dur.idxmax()]:
            dur = dur[repeated]
    module, pid = dur.idxmax()
    mask = (ops["module"] == module).to_numpy(dtype=bool, na_value=False)
    if not pd.isna(pid):
        mask = mask & (ops["program_id"] == pid).to_numpy(dtype=bool, na_value=False)
    if "run_id" not in ops or ops.loc[mask, "run_id"].isna().any():  # executions cannot be told apart
        return pd.DataFrame(columns=["host", "step", "start_ps", "end_ps"]), ""
    hosts = pd.Categorical(ops["host"])
    end_ps = (ops["start_ps"] + ops["duration_ps"]).to_numpy(np.int64)
    rows = []
    for code, host in enumerate(hosts.categories):
        on_host = hosts.codes == code
        hmask = mask & on_host
        if not hmask.any():
            continue
        key = _unwrapped(ops.loc[hmask, "run_id"].to_numpy(np.int64))
        starts = pd.Series(when_ps[hmask]).groupby(key).min().sort_index().to_numpy(np.int64)
        ends = np.append(starts[1:], max(int(end_ps[on_host].max()), int(starts[-1]) + 1))
        rows.append(pd.DataFrame({"host": host, "step": np.arange(len(starts)), "start_ps": starts, "end_ps": ends}))
    steps = pd.concat(rows, ignore_index=True)
    steps["step"] = steps["step"].astype("Int64")
    shared = not pd.isna(pid) and (g.size().index.get_level_values(0) == module).sum() > 1
    return steps, f"{module} (program {int(pid)})" if shared else str(module)


def occasional_programs(step: np.ndarray, hosts: pd.Categorical, programs: pd.Series | pd.Categorical,
                        dominant: str) -> np.ndarray:
    """Where steps are the executions of one program (:func:`dominant_program_steps`), the rows (bool per event)
    of the other programs that ran in only some steps: an evaluation every few steps, the end-of-epoch
    validation of Keras's ``fit``, a sampler; such a program is not the step's work, as it is not in a marked
    step's when launched outside the step annotation. A program counts as the step's where it ran in every step,
    or in all but one per host when hosts have three steps or more (a trace stopped inside the last step's
    helpers). ``step``: each event's step (-1 outside); ``programs``: each event's module name; ``dominant``:
    the step program's name as :func:`dominant_program_steps` gives it (a program id in parentheses after it is
    ignored: other programs that share the name count as the step's)."""
    inside = step >= 0
    if not inside.any():
        return np.zeros(len(step), bool)
    cat = programs if isinstance(programs, pd.Categorical) else pd.Categorical(programs)
    pcode, hcode = cat.codes.astype(np.int64), hosts.codes.astype(np.int64)
    heads = run_starts(pcode, hcode, step)  # an execution's events come together: one look-up per run of them
    runs = pd.DataFrame({"p": pcode[heads], "h": hcode[heads], "s": step[heads]})
    runs = runs[runs["s"] >= 0].drop_duplicates()
    per_host = runs[["h", "s"]].drop_duplicates().groupby("h").size()
    total, hosts_n = int(per_host.sum()), len(per_host)
    need = total - (hosts_n if per_host.min() >= 3 else 0)
    seen = runs.groupby("p").size()
    step_name = dominant.split(" (program ")[0]
    keep = [c for c in seen.index[seen.to_numpy() < need] if c >= 0 and cat.categories[c] != step_name]
    return inside & np.isin(pcode, keep) if keep else np.zeros(len(step), bool)


def device_step_spans(ops_step: np.ndarray, hosts: pd.Categorical | np.ndarray, when_ps: np.ndarray, end_ps: np.ndarray,
                      steps: pd.DataFrame) -> pd.DataFrame:
    """``steps`` with ``device_start_ps`` / ``device_end_ps``: per host and step, the first launch (no earlier
    than the latest op end of the earlier steps, never after the step's own last op end) and the last op end of
    the step's events; NA for steps without ops. A span is never negative."""
    if steps.empty:
        return steps.assign(device_start_ps=na_int64(0), device_end_ps=na_int64(0))
    host, host_names = (hosts.codes, hosts.categories) if isinstance(hosts, pd.Categorical) else pd.factorize(hosts)
    ok = (ops_step >= 0) & (host >= 0)
    if not ok.all():
        ok = np.flatnonzero(ok)
        host, ops_step, when_ps, end_ps = host[ok], ops_step[ok], when_ps[ok], end_ps[ok]
    # a step's events come in runs (an execution's, a thread's): reduced over its runs, not every event
    groups = RunGroups.of([host, ops_step])
    at = groups.first_row
    g_host, g_step = host[at], ops_step[at]
    first, last = groups.reduce(np.minimum, when_ps), groups.reduce(np.maximum, end_ps)
    # per host in order of first launch: no earlier than the latest op end of any earlier step on the host (not
    # only the one before), and never past the step's own last op end: a step whose ops all ran inside an
    # earlier, longer one gets 0 device time
    order = np.lexsort((g_step, first, g_host))
    g_host, g_step, first, last = g_host[order], g_step[order], first[order], last[order]
    bounds = run_starts(g_host).tolist() + [len(g_host)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        first[a + 1:b] = np.maximum(first[a + 1:b], np.maximum.accumulate(last[a:b - 1]))
    first = np.minimum(first, last)
    spans = dict(zip(zip(np.asarray(host_names)[g_host].tolist(), g_step.tolist()),
                     zip(first.tolist(), last.tolist())))
    step_of = steps["step"].to_numpy(np.int64, na_value=0).tolist()
    found = [None if na else spans.get((h, s)) for h, s, na in
             zip(steps["host"].astype(str).tolist(), step_of, steps["step"].isna().to_numpy(bool).tolist())]
    missing = np.array([f is None for f in found], bool)
    start = np.array([f[0] if f else 0 for f in found], np.int64)
    end = np.array([f[1] if f else 0 for f in found], np.int64)
    return steps.assign(device_start_ps=pd.arrays.IntegerArray(start, missing),
                        device_end_ps=pd.arrays.IntegerArray(end, missing.copy()))


def steps_on_every_host(used: tuple[int, ...], steps: pd.DataFrame, hosts: Sequence[str], notes: list[str]
                        ) -> tuple[int, ...]:
    """The steps among ``used`` that every host in ``hosts`` (those holding op events) has in ``steps`` (``host``,
    ``step``: host annotations), the others left out with a note appended to ``notes``: a step one host lacks (its
    trace started later or stopped sooner, or its execution was cut off there) would give per-step, per-device
    figures over only some devices' work. Steps of devices' own ``Steps`` lines (a ``device`` column) are kept:
    they number steps per device."""
    if len(hosts) < 2 or not used or steps.empty or ("device" in steps and steps["device"].notna().any()):
        return used
    on = steps[steps["host"].isin(list(hosts))].groupby("step")["host"].nunique()
    partial = [s for s in used if on.get(s, 0) < len(hosts)]
    if not partial:
        return used
    if len(partial) == len(used):
        return used  # no step on every host: keep them all, each host's own (the merge's notes say why)
    shown = ", ".join(map(str, partial[:6])) + (" ..." if len(partial) > 6 else "")
    notes.append(f"{len(partial)} step(s) are on only some of the {len(hosts)} hosts (steps {shown}): left out, so "
                 "that every step's figures cover every host's devices (hosts whose traces started or stopped at "
                 "other steps)")
    gone = set(partial)
    return tuple(s for s in used if s not in gone)


def steps_with_ops(used: tuple[int, ...], step: pd.Series, annotation: str, description: str, notes: list[str]
                   ) -> tuple[int, ...]:
    """The marked steps among ``used`` that hold op events (``step``: the op rows' step, Int64), the others left
    out with a note appended to ``notes``; ``annotation``: the profile's step annotation (steps that are
    executions of a program always hold ops); ``description``: the input, for the error. Under JAX's
    asynchronous dispatch a loop that never blocks before ``jax.profiler.stop_trace()`` leaves its steps'
    device work outside the profile: their annotations are there, their ops are not (a new user's README loop
    without ``block_until_ready`` reported 5 steps of 0 FLOP and a host-bound device).

    :raises InputError: no used step holds op events (one line saying to block before stopping the trace).
    """
    if not used or not annotation or annotation.startswith("executions of"):
        return used
    empty = [s for s, held in zip(used, np.isin(np.asarray(used, np.int64), step.dropna().to_numpy(np.int64)))
             if not held]
    if not empty:
        return used
    span = f"{empty[0]}" if len(empty) == 1 else f"{empty[0]}-{empty[-1]}" if empty[-1] - empty[0] == len(empty) - 1 \
        else ", ".join(map(str, empty[:6])) + (" ..." if len(empty) > 6 else "")
    advice = ("their device work ran (or was still running) after the trace stopped: call jax.block_until_ready() "
              "on the last step's outputs before jax.profiler.stop_trace()")
    if len(empty) == len(used):
        raise InputError(f"{description}: the {len(used)} marked step(s) after the warm-up "
                         f"(steps {span}) hold no XLA op events of a whole execution; {advice}")
    notes.append(f"{len(empty)} marked step(s) hold no op events (steps {span}): left out; if {advice}")
    gone = set(empty)
    return tuple(s for s in used if s not in gone)
