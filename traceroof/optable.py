"""The op table, in two levels: op events (one per execution, millions) aggregated at once into op rows (one per
host, device, program, HLO op, kernel and step: thousands), which every later stage reads.

Level 1, :class:`Timeline`: the events' start, duration and row, kept as three arrays for the analyses that need
a timeline (exposed communication and arrival skew of collectives: :mod:`traceroof.overlap`) or the spread of
single executions (median, p90, outliers: :func:`traceroof.opstats.execution_stats`).

Level 2, the op rows of :func:`build_op_table`: additive columns (``events``, ``duration_ps``, ``measured_s``,
``executions``, FLOPs, bytes, and later expected and lost time) are sums over the row's events, so any sum of
rows equals the sum of the events it covers; ``start_ps`` is the row's first start.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from parsers.hlo import Instruction, is_retiling
from traceroof.codes import group_codes
from traceroof.collectives import classify, module_devices
from traceroof.cost import CONTROL_OPCODES, CostModel, categorize, dot_precision
from traceroof.layers import DEFAULT_OPTIMIZER_PATTERN, LayerNamer, parse_scope, phase_of
from traceroof.join import JoinReport, match_modules
from traceroof.profile import Profile
from traceroof.scopes import ModuleScopes, ScopeInfo, assign_scopes

# what makes an op row: events sharing these are executions of one op in one step on one device
ROW_KEY = ("host", "device", "program_id", "module", "hlo_op", "kernel", "attributed", "step", "framework_scope")
TPU_COST_COLUMNS = ("profile_flops", "profile_model_flops", "profile_bytes_accessed")
ADDITIVE = ("flops", "transcendentals", "logical_bytes", "padded_bytes", "hbm_bytes")


class SharedList(list):
    """A list kept in ``DataFrame.attrs`` that pandas does not deep-copy at every operation (it is read-only)."""

    def __deepcopy__(self, memo: dict) -> SharedList:
        return self


@dataclass(frozen=True, eq=False)
class Timeline:
    """Level 1: one entry per op event, in the profile's event order. ``row``: index of the event's op row
    (int64); ``start_ps``, ``duration_ps``: int64 picoseconds on the profile's clock."""

    row: np.ndarray
    start_ps: np.ndarray
    duration_ps: np.ndarray

    def __len__(self) -> int:
        return len(self.row)


def aggregate_events(events: pd.DataFrame) -> tuple[pd.DataFrame, Timeline]:
    """Op events -> op rows (:data:`ROW_KEY` columns present in ``events``, first-seen order) with ``events``
    (count), ``duration_ps`` (sum), ``start_ps`` (first start) and, for TPU profiles, the sums of libtpu's per-op
    costs (NaN for a row where some event lacks them); and the :class:`Timeline` of the events."""
    keys = [c for c in ROW_KEY if c in events]
    row = group_codes([events[c] for c in keys]) if keys else np.zeros(len(events), np.int64)
    n_rows = int(row.max()) + 1 if len(row) else 0
    order = np.argsort(row, kind="stable")
    bounds = np.flatnonzero(np.diff(row[order], prepend=-1)) if len(row) else np.zeros(0, np.int64)
    first = order[bounds]
    start = events["start_ps"].to_numpy(np.int64)
    duration = events["duration_ps"].to_numpy(np.int64)
    rows = events[keys].iloc[first].reset_index(drop=True)
    rows["events"] = np.bincount(row, minlength=n_rows).astype(np.int64)
    rows["duration_ps"] = np.add.reduceat(duration[order], bounds) if n_rows else np.zeros(0, np.int64)
    rows["start_ps"] = np.minimum.reduceat(start[order], bounds) if n_rows else np.zeros(0, np.int64)
    for c in TPU_COST_COLUMNS:
        if c in events:
            v = events[c].to_numpy(np.float64)
            rows[c] = np.add.reduceat(v[order], bounds) if n_rows else np.zeros(0)  # NaN if any event lacks it
    return rows, Timeline(row, start, duration)


_ATTR_COLUMNS = ["opcode", "category", "fusion_kind", "dtype", "shape", "operand_shapes", "scope", "phase",
                 "source", "flops", "transcendentals", "logical_bytes", "padded_bytes", "hbm_bytes", "opaque",
                 "cost_note", "called", "retiling", "collective", "dot_precision"]
_BLANK = {"opcode": "", "category": "unknown", "fusion_kind": "", "dtype": "", "shape": "", "operand_shapes": "",
          "scope": "(no HLO)", "phase": "forward", "source": "", "flops": 0.0, "transcendentals": 0.0,
          "logical_bytes": 0.0, "padded_bytes": 0.0, "hbm_bytes": 0.0, "opaque": False, "cost_note": "",
          "called": (), "retiling": False, "collective": None, "dot_precision": ""}


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
        "flops": cost.flops, "transcendentals": cost.transcendentals,
        "logical_bytes": cost.bytes_accessed, "padded_bytes": cost.padded_bytes, "hbm_bytes": cost.hbm_bytes,
        "opaque": cost.opaque, "cost_note": cost.note,
        "called": tuple(inst.called) if inst.opcode in CONTROL_OPCODES else (),
        "retiling": is_retiling(inst, model.operand_shape(inst, 0)),
        "collective": coll, "dot_precision": dot_precision(model, inst),
    }


def _broadcast(values: list | np.ndarray, keys: np.ndarray) -> pd.Categorical:
    """A categorical column of ``values`` (one per distinct op) taken at ``keys``."""
    cat = pd.Categorical(values)
    return pd.Categorical.from_codes(cat.codes[keys], categories=cat.categories) if len(keys) \
        else pd.Categorical([])


def build_op_table(profile: Profile, depth: int = 2, optimizer_pattern: str = DEFAULT_OPTIMIZER_PATTERN,
                   expand: bool = False) -> tuple[pd.DataFrame, JoinReport, Timeline]:
    """Aggregate the profile's events into op rows (:func:`aggregate_events`) and join each to its HLO
    instruction and costs. Returns the op table, the :class:`JoinReport` and the events' :class:`Timeline`.

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
    rows, timeline = aggregate_events(profile.events)
    modules = profile.modules
    n_events = rows["events"].to_numpy(np.float64)
    mod_idx, partial = match_modules(rows, modules, weights=rows["events"].to_numpy(np.int64))
    op_codes = rows["hlo_op"].cat.codes.to_numpy().astype(np.int64)
    keys, uniques = pd.factorize(mod_idx * (1 << 32) + op_codes)
    op_names = list(rows["hlo_op"].cat.categories)
    models: dict[int, CostModel] = {}
    module_scopes: dict[int, ModuleScopes] = {}
    devices_of: dict[int, int] = {}
    attrs: list[dict[str, object] | None] = []
    comps_with_events: set[tuple[int, str]] = set()
    for key in uniques:
        mi, oc = int(key) >> 32, int(key) & 0xFFFFFFFF
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
        if mi not in module_scopes:
            module_scopes[mi] = assign_scopes(modules[mi], optimizer_pattern)
            # an HloProto from the profile has no num_partitions: the devices that ran it count instead
            ran_on = int(rows["device"][mod_idx == mi].nunique())
            devices_of[mi] = max(module_devices(modules[mi]), ran_on)
        attrs.append(_attrs(model, inst, optimizer_pattern, module_scopes[mi].get(inst.name), devices_of[mi]))
    joined_u = np.array([a is not None for a in attrs] or [False])
    table = pd.DataFrame([a if a is not None else _BLANK for a in attrs], columns=_ATTR_COLUMNS)
    # control ops (while/call/conditional): not counted when their bodies' ops show up as events
    counted_u = np.array([not any((int(uniques[u]) >> 32, c) in comps_with_events for c in table.at[u, "called"])
                          for u in range(len(uniques))] or [True])
    # GPU: an op execution may launch several kernels (N:M); helper kernels (fills, copies) may run twice in
    # one execution and autotuning kernels only once in the run. Estimator: executions of an op = the most
    # common launch count among its kernel names (ties: the larger). Each kernel event carries executions /
    # events of the op's cost, so sums over rows count executions x cost. CPU and TPU: one per execution.
    kernel_codes = rows["kernel"].cat.codes.to_numpy() if "kernel" in rows else np.zeros(len(rows), np.int64)
    counts = pd.DataFrame({"k": keys, "kernel": kernel_codes, "n": n_events}).groupby(
        ["k", "kernel"], sort=False)["n"].sum().reset_index()
    freq = counts.groupby(["k", "n"]).size().rename("names").reset_index()
    mode = freq.sort_values(["k", "names", "n"], ascending=[True, False, False]).drop_duplicates("k")
    executions = mode.set_index("k")["n"].reindex(range(len(uniques)), fill_value=1).to_numpy(np.float64)
    events_u = np.bincount(keys, weights=n_events, minlength=len(uniques)).astype(np.float64)
    k_u = np.maximum(events_u / np.maximum(executions, 1.0), 1.0)
    out = rows
    out["measured_s"] = rows["duration_ps"].to_numpy(np.float64) * 1e-12
    out["joined"] = joined_u[keys] if len(rows) else np.zeros(0, bool)
    out["kernels_per_execution"] = k_u[keys] if len(rows) else np.zeros(0)
    out["executions"] = n_events / out["kernels_per_execution"].to_numpy() if len(rows) else np.zeros(0)
    collectives = list(table["collective"])
    coll_id = np.array([i if c is not None else -1 for i, c in enumerate(collectives)] or [-1], dtype=np.int64)
    out["collective_id"] = coll_id[keys] if len(rows) else np.zeros(0, np.int64)
    out.attrs["collectives"] = SharedList(collectives)
    out["collective_group"] = _broadcast([f"{c.kind}/{c.group_size}x{c.num_groups}" if c is not None else ""
                                          for c in collectives] or [""], keys)
    for col in _ATTR_COLUMNS:
        if col in ("called", "collective"):
            continue
        vals = table[col].to_numpy()
        if col in ADDITIVE:
            out[col] = (vals.astype(np.float64) / k_u)[keys] * n_events if len(rows) else np.zeros(0)
        elif col in ("opaque", "retiling"):
            out[col] = vals.astype(bool)[keys] if len(rows) else np.zeros(0, bool)
        else:
            out[col] = _broadcast(vals, keys)
    out["counted"] = counted_u[keys] if len(rows) else np.zeros(0, bool)
    out["op_key"] = keys.astype(np.int64)  # one per (module, HLO op): what :func:`per_op` groups by
    if "profile_flops" in rows:  # TPU: libtpu's own per-op FLOPs and bytes win where present; ours kept beside
        out["traceroof_flops"] = out["flops"]
        out["traceroof_hbm_bytes"] = out["hbm_bytes"]
        pf, pb = rows["profile_flops"].to_numpy(np.float64), rows["profile_bytes_accessed"].to_numpy(np.float64)
        out["flops"] = np.where(np.isnan(pf), out["flops"], pf)
        out["hbm_bytes"] = np.where(np.isnan(pb), out["hbm_bytes"], pb)
    if "framework_scope" in rows:  # framework ops without HLO: scope and phase from the framework op path
        scopes = rows["framework_scope"].astype(str)
        out["scope"] = pd.Categorical(scopes)
        phases = {sc: phase_of(sc.split("/"), False, optimizer_pattern) for sc in scopes.unique()}
        out["phase"] = pd.Categorical(scopes.map(phases))
        out["category"] = pd.Categorical(["framework op"] * len(rows))
    elif "attributed" in rows and not rows["attributed"].all():
        un = ~rows["attributed"].to_numpy(bool)
        for col, label in (("category", "unattributed kernel"), ("scope", "(unattributed kernels)")):
            out[col] = out[col].cat.add_categories([label]) if label not in out[col].cat.categories else out[col]
            out.loc[un, col] = label
    scope_events = out.groupby("scope", observed=True)["events"].sum() if len(rows) else pd.Series(dtype=float)
    namer = LayerNamer.build({str(k): int(v) for k, v in scope_events.items()},
                             {k: v for ms in module_scopes.values() for k, v in ms.repeats.items()})
    scope_codes = out["scope"].cat.codes.to_numpy()
    for col, name in (("layer", lambda sc: namer.layer(sc, depth, expand)),
                      ("instance", lambda sc: "" if expand else namer.instance(sc, depth))):
        out[col] = _broadcast([name(str(sc)) for sc in out["scope"].cat.categories], scope_codes)
    joined_mask = out["joined"].to_numpy(bool)
    report = JoinReport(partial.events_total, int(n_events[joined_mask].sum()), partial.time_total_ps,
                        int(rows["duration_ps"].to_numpy()[joined_mask].sum()), partial.unmatched_modules,
                        int(sum(1 for u, a in enumerate(attrs) if a is None and 0 <= int(uniques[u]) >> 32
                                < len(modules))),
                        partial.ambiguous_modules, partial.matched_sources)
    return out, report, timeline


# numeric columns that are not sums over events: per-op constants or ratios, taken from the op's first row
# (efficiency is recomputed from the sums)
_NOT_ADDITIVE = ("op_key", "step", "program_id", "efficiency", "kernels_per_execution", "peak_flops_per_s",
                 "arithmetic_intensity_flops_per_byte", "collective_id")


def per_op(rows: pd.DataFrame) -> pd.DataFrame:
    """Op rows summed over hosts, devices, kernels and steps: one row per op (``op_key``) and scope. Numeric
    columns that are sums over events (time, executions, FLOPs, bytes, expected and lost time, communication)
    are summed (NaN stays NaN: an op without an expectation has none in any row), ``start_ps`` is the first
    start, ``efficiency`` is recomputed (expected ÷ measured); every other column is the op's own (its first
    row's). Totals over the result equal totals over ``rows``; use it for per-op and per-layer figures, not for
    anything per device or per step."""
    if rows.empty or "op_key" not in rows:
        return rows
    key = group_codes([rows["op_key"].to_numpy(np.int64), rows["scope"]])
    n = int(key.max()) + 1
    order = np.argsort(key, kind="stable")
    bounds = np.flatnonzero(np.diff(key[order], prepend=-1))
    out = rows.iloc[order[bounds]].copy()
    for c in rows.columns:
        v = rows[c]
        if c in _NOT_ADDITIVE or not pd.api.types.is_numeric_dtype(v) or pd.api.types.is_bool_dtype(v):
            continue
        if c == "start_ps":
            out[c] = np.minimum.reduceat(v.to_numpy(np.int64)[order], bounds)
        elif pd.api.types.is_integer_dtype(v):
            out[c] = np.add.reduceat(v.to_numpy(np.int64)[order], bounds)
        else:
            out[c] = np.bincount(key, weights=v.to_numpy(np.float64), minlength=n)[key[order[bounds]]]
    if "efficiency" in out:
        m = out["measured_s"].to_numpy(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            out["efficiency"] = np.where(m > 0, out["expected_s"].to_numpy(np.float64) / m, np.nan)
    return out.reset_index(drop=True)
