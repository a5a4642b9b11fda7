"""The op table, in two levels: op events (one per execution, millions) aggregated at once, per host, into op rows
(one per host, device, program, HLO op, kernel and step: :mod:`traceroof.aggregate`), which every later stage reads.

Level 1, :class:`~traceroof.aggregate.Timeline`: the events' row, start and duration (and execution and launch),
kept as arrays for the analyses that need a timeline (exposed communication and arrival skew of collectives:
:mod:`traceroof.overlap`; the step breakdown: :mod:`traceroof.breakdown`) or the spread of single executions
(median, p90, outliers: :func:`traceroof.opstats.execution_stats`).

Level 2, the op rows of :func:`build_op_table`: the rows of every host joined to their HLO instruction and costs.
Additive columns (``events``, ``duration_ps``, ``measured_s``, ``executions``, FLOPs, bytes, and later expected
and lost time) are sums over the row's events, so any sum of rows equals the sum of the events it covers;
``start_ps`` is the row's first start.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import pandas as pd

from parsers.hlo import Instruction, is_retiling
from parsers.xspace import code_dtype
from traceroof.aggregate import Timeline
from traceroof.codes import first_rows, group_codes, group_codes_at, run_starts
from traceroof.collectives import KINDS, classify, module_devices
from traceroof.cost import CONTROL_OPCODES, CostModel, categorize, dot_precision
from traceroof.layers import DEFAULT_OPTIMIZER_PATTERN, LayerNamer, parse_scope, phase_of
from traceroof.join import JoinReport, match_modules
from traceroof.profile import Profile
from traceroof.rowcosts import ADDITIVE, RowCosts
from traceroof.scopes import ModuleScopes, ScopeInfo, assign_scopes



class SharedList(list):
    """A list kept in ``DataFrame.attrs`` that pandas does not deep-copy at every operation (it is read-only)."""

    def __deepcopy__(self, memo: dict) -> SharedList:
        return self


_JAX_COLLECTIVES = ("psum", "psum_invariant", "pmax", "pmin", "all_gather", "psum_scatter", "reduce_scatter",
                    "all_to_all", "ppermute")  # the primitives JAX names instructions after
COLLECTIVE_NAME = re.compile("(" + "|".join(map(re.escape, (*KINDS, *_JAX_COLLECTIVES))) + r")(-start|-done)?(\.\d+)?$")
"""An HLO op name that is a collective's (``all-reduce.14``, ``all-gather-start``, ``ppermute.12``): without HLO
(a trace JSON alone) the op table takes such ops for collectives (category ``collective``), so that exposed
communication is measured; XLA's instruction names (the opcode, made unique with ``.N``: xla/service/name_uniquer.cc)
and JAX's (the primitive's name, as in the par_* fixtures: ``ppermute.12``, ``psum_invariant.49``)."""

CONTROL_NAME = re.compile("(" + "|".join(sorted(CONTROL_OPCODES)) + r")(\.\d+)?$")
"""An HLO op name that is a control op's (``while.5``, ``conditional``): without HLO its event is taken for the
container of its body's op events, which are events of their own (XLA:CPU and GPU trace each), and not counted
again when the module has other op events."""

_ATTR_COLUMNS = ["opcode", "category", "fusion_kind", "dtype", "shape", "operand_shapes", "scope", "phase",
                 "source", "flops", "matmul_flops", "routing_flops", "transcendentals", "logical_bytes",
                 "padded_bytes", "hbm_bytes", "opaque", "cost_note", "called", "retiling", "collective",
                 "dot_precision"]
_BLANK = {"opcode": "", "category": "unknown", "fusion_kind": "", "dtype": "", "shape": "", "operand_shapes": "",
          "scope": "(no HLO)", "phase": "forward", "source": "", "flops": 0.0, "matmul_flops": 0.0,
          "routing_flops": 0.0, "transcendentals": 0.0, "logical_bytes": 0.0, "padded_bytes": 0.0, "hbm_bytes": 0.0,
          "opaque": False, "cost_note": "", "called": (), "retiling": False, "collective": None, "dot_precision": ""}


def _attrs(model: CostModel, inst: Instruction, optimizer_pattern: str, info: ScopeInfo | None = None,
           devices: int | None = None) -> dict[str, object]:
    """An instruction's op-table attributes: costs of one execution (:meth:`CostModel.cost`), category, scope.
    ``devices``: how many devices ran the program (what ``replica_groups={}`` or no groups spans)."""
    cost = model.cost(inst)
    category, dtype = categorize(model, inst)
    coll = classify(model, inst, devices)
    if coll is not None:
        category = "collective"
    scope, phase = (info.scope, info.phase) if info is not None else parse_scope(inst.metadata.op_name,
                                                                                    optimizer_pattern)
    operand_shapes = []
    for i in range(len(inst.operands)):
        s = model.operand_shape(inst, i)
        operand_shapes.append(str(s) if s is not None else "?")
    return {
        "opcode": inst.opcode, "category": category, "fusion_kind": inst.fusion_kind, "dtype": dtype,
        "shape": str(inst.shape), "operand_shapes": ", ".join(operand_shapes), "scope": scope, "phase": phase,
        "source": info.source if info is not None and info.source else model.module.source_line(inst),
        "flops": cost.flops, "matmul_flops": cost.matmul_flops, "routing_flops": cost.routing_flops,
        "transcendentals": cost.transcendentals,
        "logical_bytes": cost.bytes_accessed, "padded_bytes": cost.padded_bytes, "hbm_bytes": cost.hbm_bytes,
        "opaque": cost.opaque, "cost_note": cost.note,
        "called": tuple(inst.called) if inst.opcode in CONTROL_OPCODES else (),
        "retiling": is_retiling(inst, model.operand_shape(inst, 0)),
        "collective": coll, "dot_precision": dot_precision(model, inst),
    }


def build_op_table(profile: Profile, depth: int = 2, optimizer_pattern: str = DEFAULT_OPTIMIZER_PATTERN,
                   expand: bool = False) -> tuple[pd.DataFrame, JoinReport, Timeline]:
    """Join the profile's op rows (:func:`traceroof.aggregate.aggregate_events` of each host) to their HLO
    instructions and costs. Returns the op table, the :class:`JoinReport` and the events' :class:`Timeline`.

    Columns: the row key (``host``, ``device``, ``program_id``, ``module``, ``hlo_op``, ``kernel``,
    ``attributed``, ``step``), ``events``, ``start_ps`` (first), ``duration_ps`` and ``measured_s`` (sums),
    ``joined`` (an instruction was found), the instruction's ``opcode``, ``category``, ``fusion_kind``,
    ``dtype``, ``shape``, ``operand_shapes``, ``scope``, ``layer``, ``phase``, ``source`` (scope, phase and source
    by :mod:`traceroof.scopes`; ``layer`` and ``instance`` of a repeated block by
    :class:`~traceroof.layers.LayerNamer`, each instance its own layer with ``expand``), ``flops``,
    ``transcendentals``, ``logical_bytes``, ``padded_bytes``, ``hbm_bytes`` (the row's executions x the op's
    per-execution cost), ``opaque``, ``cost_note``, ``retiling`` (a layout-changing copy),
    ``kernels_per_execution`` and ``executions`` (GPU N:M estimate; one execution per event elsewhere), and
    ``counted`` (False for control ops such as ``while`` whose bodies' ops are events of their own, so time is not
    counted twice). TPU rows add ``traceroof_flops`` / ``traceroof_hbm_bytes`` (our count) beside libtpu's
    numbers, which win.
    """
    rows, report, timeline, collectives, _, costs = op_table(profile, depth, optimizer_pattern, expand)
    out = costs.wide(rows)
    out.attrs["collectives"] = SharedList(collectives)
    return out, report, timeline


def op_table(profile: Profile, depth: int = 2, optimizer_pattern: str = DEFAULT_OPTIMIZER_PATTERN,
             expand: bool = False
             ) -> tuple[pd.DataFrame, JoinReport, Timeline, list, dict[int, ModuleScopes], RowCosts]:
    """:func:`build_op_table` without ``attrs`` (pandas deep-copies a frame's attrs into every column and row
    selection made of it: 3 µs each), the collectives (``attrs["collectives"]`` of build_op_table: per
    ``collective_id``, its :class:`~traceroof.collectives.Collective` or None) and the scopes it assigned
    (:func:`~traceroof.scopes.assign_scopes` with ``optimizer_pattern``) by position in ``profile.modules``: the
    modules with a joined op."""
    rows, timeline = profile.rows, profile.timeline
    modules = profile.modules
    n_events = rows["events"].to_numpy(np.float64)
    mod_idx, partial = match_modules(rows, modules, weights=rows["events"].to_numpy(np.int64))
    op_names = list(rows["hlo_op"].cat.categories)
    op_codes = rows["hlo_op"].cat.codes.to_numpy()
    keys = group_codes([mod_idx, op_codes])  # per row, its (module, HLO op) pair, in order of first appearance
    first = first_rows(keys)
    u_mod, u_op = mod_idx[first].tolist(), op_codes[first].tolist()  # each pair's module and op code
    models: dict[int, CostModel] = {}
    module_scopes: dict[int, ModuleScopes] = {}
    devices_of: dict[int, int] = {}
    attrs: list[dict[str, object] | None] = []
    comps_with_events: set[tuple[int, str]] = set()
    comp_u: list[tuple[int, str] | None] = []  # per pair: its (module, computation)
    operands_u: list[int] = []
    ran_on: np.ndarray | None = None  # devices that ran each module
    for mi, oc in zip(u_mod, u_op):
        comp_u.append(None)
        operands_u.append(0)
        if mi < 0 or mi >= len(modules):
            attrs.append(None)
            continue
        model = models.get(mi) or models.setdefault(mi, CostModel(modules[mi]))
        comp = model.comp_of.get(op_names[oc])  # name -> computation index the cost model already built
        inst = comp.by_name[op_names[oc]] if comp is not None else None
        if inst is None:
            attrs.append(None)
            continue
        comps_with_events.add((mi, comp.name))
        comp_u[-1], operands_u[-1] = (mi, comp.name), len(inst.operands)
        if mi not in module_scopes:
            module_scopes[mi] = assign_scopes(modules[mi], optimizer_pattern)
            # an HloProto from the profile has no num_partitions: the devices that ran it count instead
            ran_on = _devices_per_module(rows["device"], mod_idx, len(modules)) if ran_on is None else ran_on
            devices_of[mi] = max(module_devices(modules[mi]), int(ran_on[mi]))
        attrs.append(_attrs(model, inst, optimizer_pattern, module_scopes[mi].get(inst.name), devices_of[mi]))
    table = {c: [(a if a is not None else _BLANK)[c] for a in attrs] for c in _ATTR_COLUMNS}  # per op
    for k, (a, oc) in enumerate(zip(attrs, u_op)):  # no HLO: a collective known by its name, as XLA names it
        if a is None and COLLECTIVE_NAME.match(op_names[oc]):
            table["category"][k] = "collective"
    joined_u = np.array([a is not None for a in attrs] or [False])
    # control ops (while/call/conditional): not counted when their bodies' ops show up as events
    counted_u = np.array([not any((mi, c) in comps_with_events for c in called)
                          for mi, called in zip(u_mod, table["called"])] or [True])
    control = [a is None and bool(CONTROL_NAME.match(op_names[oc])) for a, oc in zip(attrs, u_op)]
    if any(control):  # without HLO: a control op's event holds its body's, when its module has others
        busy = {mi for mi, c in zip(u_mod, control) if not c}
        counted_u &= ~np.array([c and mi in busy for mi, c in zip(u_mod, control)])
    kernel_codes = rows["kernel"].cat.codes.to_numpy() if "kernel" in rows else np.zeros(len(rows), np.int64)
    executions = _executions_per_op(keys, kernel_codes, n_events, len(u_mod))
    events_u = np.bincount(keys, weights=n_events, minlength=len(u_mod)).astype(np.float64)
    if profile.device_kind == "cpu":
        executions = _cpu_sort_executions(executions, events_u, table["opcode"], comp_u, operands_u)
    k_u = np.maximum(events_u / np.maximum(executions, 1.0), 1.0)
    collectives = table["collective"]
    coll_id = np.array([i if c is not None else -1 for i, c in enumerate(collectives)] or [-1], dtype=np.int64)
    cols: dict[str, object] = {c: rows[c].array for c in rows.columns}
    cols["measured_s"] = rows["duration_ps"].to_numpy(np.float64) * 1e-12
    cols["joined"] = joined_u[keys] if len(rows) else np.zeros(0, bool)
    cols["kernels_per_execution"] = k_u[keys] if len(rows) else np.zeros(0)
    cols["executions"] = n_events / cols["kernels_per_execution"] if len(rows) else np.zeros(0)
    cols["collective_id"] = coll_id[keys] if len(rows) else np.zeros(0, np.int64)
    cols["collective_group"] = _broadcast([f"{c.kind}/{c.group_size}x{c.num_groups}" if c is not None else ""
                                           for c in collectives] or [""], keys)
    for col in _ATTR_COLUMNS:
        if col in ("called", "collective"):
            continue
        if col in ADDITIVE:
            continue
        if col in ("opaque", "retiling"):
            cols[col] = np.array(table[col], bool)[keys] if len(rows) else np.zeros(0, bool)
        else:
            cols[col] = _broadcast(table[col], keys)
    cols["counted"] = counted_u[keys] if len(rows) else np.zeros(0, bool)
    cols["op_key"] = keys  # one per (module, HLO op): what :func:`per_op` groups by
    scope_of_op = True  # the scope column is the ops' (else relabelled per row below)
    if "framework_scope" in rows:  # framework ops without HLO: scope and phase from the framework op path
        scope_of_op = False
        scopes = rows["framework_scope"].astype(str)
        cols["scope"] = pd.Categorical(scopes)
        phases = {sc: phase_of(sc.split("/"), False, optimizer_pattern) for sc in scopes.unique()}
        cols["phase"] = pd.Categorical(scopes.map(phases))
        cols["category"] = pd.Categorical(["framework op"] * len(rows))
    elif "attributed" in rows and not rows["attributed"].all():
        scope_of_op = False
        un = ~rows["attributed"].to_numpy(bool)
        for col, label in (("category", "unattributed kernel"), ("scope", "(unattributed kernels)")):
            cat = cols[col] if label in cols[col].categories else cols[col].add_categories([label])
            cat[un] = label
            cols[col] = cat
    scope = cols["scope"]
    if scope_of_op:  # events per scope from the ops' (sums of whole event counts: exact in any order)
        at, codes = keys, _categories(table["scope"])[1]  # the scope of each op (its code in scope.categories)
        scope_events = np.bincount(codes, weights=events_u, minlength=len(scope.categories))
        rows_of = np.bincount(codes, minlength=len(scope.categories))
    else:
        at, codes = scope.codes, np.arange(len(scope.categories))
        named = at >= 0
        scope_events = np.bincount(at[named], weights=n_events[named], minlength=len(scope.categories))
        rows_of = np.bincount(at[named], minlength=len(scope.categories))
    namer = LayerNamer.build({str(sc): int(e) for sc, e, r in zip(scope.categories, scope_events, rows_of) if r},
                             {k: v for ms in module_scopes.values() for k, v in ms.repeats.items()})
    layers = [namer.layer(str(sc), depth, expand) for sc in scope.categories]
    instances = ["" if expand else namer.instance(str(sc), depth) for sc in scope.categories]
    cols["layer"] = _broadcast([layers[c] for c in codes], at)  # per op (taken at keys) or per scope
    cols["instance"] = _broadcast([instances[c] for c in codes], at)
    out = pd.DataFrame(cols, copy=False)  # every column is a new array
    events_joined, time_joined_ps = n_events, rows["duration_ps"].to_numpy()
    if not joined_u.all():
        events_joined, time_joined_ps = events_joined[cols["joined"]], time_joined_ps[cols["joined"]]
    report = JoinReport(partial.events_total, int(events_joined.sum()), partial.time_total_ps,
                        int(time_joined_ps.sum()), partial.unmatched_modules,
                        sum(1 for mi, a in zip(u_mod, attrs) if a is None and 0 <= mi < len(modules)),
                        partial.ambiguous_modules, partial.matched_sources)
    costs = RowCosts({c: np.array(table[c], np.float64) / k_u for c in ADDITIVE}, tpu="profile_flops" in rows)
    return out, report, timeline, collectives, module_scopes, costs


def _broadcast(values: Sequence[str], at: np.ndarray) -> pd.Categorical:
    """``pd.Categorical(values)`` taken at ``at``: a column of text ``values`` (one per distinct op or scope;
    code -1 in ``at``: missing). Categories sorted, found with a set and a dict (``np.unique`` of an object
    array and pandas' factorize cost more on the tens of values of a small profile); the codes taken in the
    dtype pandas keeps them in (int8 below 127 categories ...), so the column is one pass over ``at``."""
    if not len(at):
        return pd.Categorical([])
    names, codes = _categories(values)
    codes = np.append(codes, -1).astype(code_dtype(len(names)))  # at -1 -> -1
    return pd.Categorical.from_codes(codes[at], dtype=pd.CategoricalDtype(names), validate=False)


def _categories(values: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """The distinct ``values`` sorted, and the position of each value among them (int64)."""
    names = sorted(set(values))
    pos = {v: i for i, v in enumerate(names)}
    return names, np.fromiter((pos[v] for v in values), np.int64, len(values))


def _devices_per_module(device: pd.Series, mod_idx: np.ndarray, n_modules: int) -> np.ndarray:
    """Per module (index into the profile's modules), how many distinct devices (NA not counted) ran rows of it
    (``mod_idx``: each row's module, -1 for none)."""
    dev = device.cat.codes.to_numpy() if isinstance(device.dtype, pd.CategoricalDtype) else pd.factorize(device)[0]
    n_dev = int(dev.max()) + 1 if len(dev) else 0
    if not n_dev:
        return np.zeros(n_modules, np.int64)
    # the pairs of the first rows of runs of one (module, device) are those of every row
    heads = run_starts(dev, mod_idx)
    module, dev = mod_idx[heads], dev[heads].astype(np.int64)
    on = (module >= 0) & (dev >= 0)
    ran = np.bincount(module[on] * n_dev + dev[on], minlength=n_modules * n_dev) > 0
    return ran.reshape(n_modules, n_dev).sum(axis=1)


def _executions_per_op(op: np.ndarray, kernel: np.ndarray, n_events: np.ndarray, n_ops: int) -> np.ndarray:
    """Per op (codes ``op`` of the rows, 0..n_ops-1), its executions. GPU: an op execution may launch several
    kernels (N:M); helper kernels (fills, copies) may run twice in one execution and autotuning kernels only once
    in the run. Estimator: executions of an op = the most common launch count among its kernel names (ties: the
    larger). Each kernel event carries executions / events of the op's cost, so sums over rows count executions x
    cost. CPU and TPU (one kernel name per op): one per event."""
    if not len(kernel) or kernel.min() == kernel.max():  # one kernel name: one execution per event
        out = np.ones(n_ops)
        events = np.bincount(op, weights=n_events, minlength=n_ops)
        ran = np.bincount(op, minlength=n_ops) > 0
        out[ran] = events[ran]
        return out
    pair = group_codes([op, kernel])  # (op, kernel name)
    first = first_rows(pair)
    launches = np.bincount(pair, weights=n_events)  # events of each kernel name of each op
    op_of = op[first]
    count = group_codes([op_of, launches])  # (op, launch count)
    names = np.bincount(count)[count]  # kernel names of the op sharing this launch count
    order = np.lexsort((-launches, -names, op_of))  # per op: the most common count, ties the larger
    best = order[np.flatnonzero(np.diff(op_of[order], prepend=-1))]
    out = np.ones(n_ops)
    out[op_of[best]] = launches[best]
    return out


def _cpu_sort_executions(executions: np.ndarray, events: np.ndarray, opcode: list[str],
                         comp: list[tuple[int, str] | None], operands: list[int]) -> np.ndarray:
    """Per (module, HLO op) pair: ``executions`` with those of XLA:CPU sorts corrected. The CPU runtime runs a
    sort as a copy of each operand whose buffer is not the result's, then the sort, every thunk traced as an event
    named after the op (xla ``service/cpu/thunk_emitter.cc`` ``EmitSortThunk``), and the executor may run other
    thunks between the copy and the sort (s39 trial: ``jax.random.permutation``'s sort, 0.5 µs + 320 µs, counted
    as two executions and its median halved). Every instruction of a computation runs once per execution of it, so
    a sort's executions are those of the other ops of its computation (the median of their ``events``); its events
    per execution, 1 to 1 + its operands, are the ratio rounded. A sort with no other op of its computation in the
    profile keeps one execution per event."""
    by_comp: dict[tuple[int, str], list[float]] = {}
    for k, (c, op) in enumerate(zip(comp, opcode)):
        if c is not None and op != "sort" and events[k] > 0:
            by_comp.setdefault(c, []).append(events[k])
    out = executions
    for k, (c, op) in enumerate(zip(comp, opcode)):
        if op != "sort" or c not in by_comp:
            continue
        runs = float(np.median(by_comp[c]))
        per_run = min(max(round(events[k] / runs), 1), 1 + operands[k])
        if per_run > 1:
            out = out.copy() if out is executions else out
            out[k] = events[k] / per_run
    return out


# numeric columns that are not sums over events: per-op constants or ratios, taken from the op's first row
# (efficiency is recomputed from the sums)
_NOT_ADDITIVE = ("op_key", "step", "program_id", "efficiency", "kernels_per_execution", "peak_flops_per_s",
                 "arithmetic_intensity_flops_per_byte", "collective_id")


def per_op(rows: pd.DataFrame, at: np.ndarray | None = None, costs: RowCosts | None = None) -> pd.DataFrame:
    """Op rows summed over hosts, devices, kernels and steps: one row per op (``op_key``) and scope. Numeric
    columns that are sums over events (time, executions, FLOPs, bytes, expected and lost time, communication)
    are summed (NaN stays NaN: an op without an expectation has none in any row), ``start_ps`` is the first
    start, ``efficiency`` is recomputed (expected ÷ measured); every other column is the op's own (its first
    row's). Totals over the result equal totals over ``rows``; use it for per-op and per-layer figures, not for
    anything per device or per step. ``at``: positions of the rows to sum (``per_op(rows.take(at))`` without
    selecting the table twice); default all. ``costs``: the rows' costs kept per op
    (:class:`~traceroof.rowcosts.RowCosts`): the result has every column of the whole table (cost columns worked
    out for the rows and summed as stored ones are)."""
    if rows.empty or "op_key" not in rows or (at is not None and not len(at)):
        if costs is not None:
            return costs.wide(rows, at)
        return rows if at is None else rows.take(at)
    if at is not None and (at[1:] <= at[:-1]).any():  # the sums below add rows in their order
        return per_op(rows.take(at), costs=costs)
    # every row's op (the rows left out in one more, n, dropped) and each op's first row, by first appearance
    key, first = group_codes_at([rows["op_key"].to_numpy(np.int64), rows["scope"].array], at)
    n = len(first)
    summed: dict[str, np.ndarray] = costs.sums(rows, key, n, at) if costs is not None else {}
    for c, dtype in rows.dtypes.items():
        if c in _NOT_ADDITIVE or dtype.kind not in "iuf":  # bool, text, categories: the op's own
            continue
        if dtype.kind in "iu":  # integer sums and minima in any order: no sort of the rows
            v = rows[c].to_numpy(np.int64)
            total = np.append(v[first], 0) if c == "start_ps" else np.zeros(n + 1, np.int64)
            (np.minimum if c == "start_ps" else np.add).at(total, key, v)
        else:  # in row order, as np.bincount adds (np.add.at skips its pass for the codes' range)
            v, total = rows[c].to_numpy(np.float64), np.zeros(n + 1)
            if v.any():  # zeros (communication without collectives) sum to zeros
                np.add.at(total, key, v)
        summed[c] = total[:n]
    if "efficiency" in rows or "expected_s" in summed:
        m = summed["measured_s"]
        with np.errstate(divide="ignore", invalid="ignore"):
            summed["efficiency"] = np.where(m > 0, summed["expected_s"] / m, np.nan)
    if costs is not None:  # the other worked-out columns: the op's own (its first row's)
        out = costs.wide(rows, first, summed)
        out.index = pd.RangeIndex(n)
        return out
    out = rows.take(first)
    out.index = pd.RangeIndex(n)
    for kind in "fi":  # one assignment per kind: a column at a time splits pandas' block each time
        names = [c for c, v in summed.items() if v.dtype.kind == kind]
        if names:
            out[names] = np.column_stack([summed[c] for c in names])
    return out
