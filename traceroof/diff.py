"""``traceroof diff``: structural comparison of two profiles, with a noise-aware regression gate.

Ops are matched by what they are (``OP_KEY``: layer and scope path, phase, opcode, category, dtype, operand and
result shapes, collective kind and group), never by HLO name alone, which changes between compilations. What is
left is matched in more passes where the looser key is unique on both sides: without the scope (a renamed scope);
without the operand shapes (the same result in the same place reading other inputs, e.g. a backward fusion that
reads a saved activation through a fused dynamic-slice of the scan's stacked buffer where the rematerialised
program read the recomputed value); without the shapes (a resized op in the same place). These two passes take
the HLO name as tie-breaker where the looser key alone is not unique. The rest are reported as added or removed.
The step-time change is called noise when it is within two standard errors (:func:`standard_error`): of the
per-step differences when both profiles have as many steps (step i against step i), else of the difference of the
two step-time means (per-step spread of both profiles).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from parsers.errors import FormatError, InputError
from traceroof.memory_diff import memory_delta, memory_from_json
from traceroof.analysis import HLO_IGNORED, Analysis, analyze
from traceroof.breakdown import BREAKDOWN_COLUMNS, LABELS, breakdown_delta
from traceroof.opstats import OP_KEY
from traceroof.profile import PARTIAL
from traceroof.units import fmt_time

NOISE_SIGMAS = 2.0  # a change within 2 standard errors (~95 % for normal step times) is called noise
PAIRED_MIN_STEPS = 3  # steps per side from which the sides' steps are paired (2 give a difference spread of 1 df)
METRICS = ["time_per_step_s", "expected_per_step_s", "flops_per_step", "hbm_bytes_per_step",
           "exposed_comm_per_step_s", "executions_per_step"]
LAYER_METRICS = ["time_per_step_s", "expected_per_step_s", "flops_per_step", "hbm_bytes_per_step",
                 "exposed_comm_per_step_s"]


@dataclass(frozen=True)
class Side:
    """One side of a diff: what an analysis (or its saved JSON report) says per step."""

    label: str
    chip: str
    step_times_s: tuple[float, ...]
    step_time_mean_s: float
    flops_per_step: float
    exposed_comm_per_step_s: float
    layers: pd.DataFrame
    op_stats: pd.DataFrame
    step_breakdown: pd.DataFrame = field(default_factory=pd.DataFrame)  # traceroof.breakdown rows
    memory: dict | None = None  # the JSON ``memory`` object (traceroof.memory)
    devices: int = 0  # devices that ran the profiled steps (0: unknown, a report without it)
    input_notes: tuple[str, ...] = ()  # the analysis' notes that say input given was left out (:func:`input_notes`)
    steps_used: tuple[int, ...] = ()  # the step numbers of step_times_s, where known


def input_notes(notes: Sequence[object]) -> tuple[str, ...]:
    """The notes of an analysis that say some input given was not used: hosts left out (``PARTIAL:``, a corrupt
    host file) or ``--hlo`` dumps of none of the profiled programs (ignored). A diff shows them: its figures are
    right, but not of everything the user passed (s36 trial: ``diff --hlo-new`` given the other variant's dump
    exited 0 with the dump silently unused)."""
    return tuple(n for n in notes if isinstance(n, str) and n.startswith((PARTIAL, HLO_IGNORED)))


def side_from_analysis(a: Analysis, label: str) -> Side:
    """A side from an :class:`Analysis` in memory."""
    s = a.summary
    return Side(label, s.chip_id, s.step_times_s, s.step_time_mean_s, s.flops_per_step, s.exposed_comm_per_step_s,
                a.layers, a.op_stats, a.step_breakdown,
                a.memory.to_json() if a.memory is not None else None, int(s.devices), input_notes(s.notes),
                tuple(s.steps_used))


def _number(value: object) -> float | None:
    """A JSON number as a float (``None`` for null); raises ``TypeError`` for anything else (bools included)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(type(value).__name__)
    return float(value)


def _table(path: Path, doc: dict, name: str, numeric: Sequence[str]) -> pd.DataFrame:
    """A report table (a list of records) with its ``numeric`` columns checked: numbers or null, finite and not
    negative.

    :raises FormatError: naming the file, table, row and column."""
    rows = doc[name]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise FormatError(f"{path}: {name} is not a list of records; write the report with "
                          "`traceroof analyze ... --format json -o base.json`")
    for i, r in enumerate(rows):
        for c in numeric:
            try:
                v = _number(r.get(c))
            except TypeError as e:
                raise FormatError(f"{path}: {name}[{i}].{c} is a {e}, not a number") from None
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise FormatError(f"{path}: {name}[{i}].{c} is {v}; expected a finite number >= 0")
    return pd.DataFrame(rows)


def side_from_json(path: Path) -> Side:
    """A side from ``traceroof analyze --format json`` output, checked: the step time a positive finite number,
    step times and per-step figures finite and not negative, ``layers`` and ``op_stats`` lists of records whose
    times, FLOPs and bytes are finite and not negative.

    :raises FormatError: the JSON is not a traceroof report with ``op_stats`` (truncated, of another shape, of the
        wrong types), or a figure that fails those checks (the message names the file and the key).
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        detail = e.strerror if isinstance(e, OSError) else " ".join(str(e).split())[:200] or type(e).__name__
        raise FormatError(f"{path}: not a readable JSON report ({detail})") from None
    if not isinstance(doc, dict) or "summary" not in doc or "op_stats" not in doc or "layers" not in doc \
            or not isinstance(doc["summary"], dict):
        raise FormatError(f"{path}: not a traceroof JSON report with op_stats; write one with "
                          "`traceroof analyze ... --format json -o base.json`")
    s = doc["summary"]
    figures: dict[str, float | None] = {}
    for key in ("step_time_mean_s", "flops_per_step", "exposed_comm_per_step_s"):
        try:
            figures[key] = _number(s.get(key))
        except TypeError as e:
            raise FormatError(f"{path}: summary.{key} is a {e}, not a number") from None
        v = figures[key]
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise FormatError(f"{path}: summary.{key} is {v}; expected a finite number >= 0")
    step = figures["step_time_mean_s"]
    if step is None or not step > 0:
        raise FormatError(f"{path}: summary.step_time_mean_s is {step if step is not None else 'missing'}: the "
                          "report has no step time to compare with; save a report of a profile with steps")
    times = s.get("step_times_s") or []
    if not isinstance(times, list) or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                              and math.isfinite(t) and t > 0 for t in times):
        raise FormatError(f"{path}: summary.step_times_s is not a list of positive finite step times")
    chip = s.get("chip_id", "")
    devices, used = s.get("devices"), s.get("steps_used")
    return Side(str(path), chip if isinstance(chip, str) else str(chip), tuple(float(t) for t in times), step,
                figures["flops_per_step"] or 0.0, figures["exposed_comm_per_step_s"] or 0.0,
                _table(path, doc, "layers", LAYER_METRICS), _table(path, doc, "op_stats", METRICS),
                _table(path, doc, "step_breakdown", BREAKDOWN_COLUMNS) if "step_breakdown" in doc else pd.DataFrame(),
                memory_from_json(path, doc.get("memory")),
                devices if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0 else 0,
                input_notes(s["notes"]) if isinstance(s.get("notes"), list) else (),
                tuple(used) if isinstance(used, list) and all(type(x) is int for x in used) else ())


def load_side(path: str | Path, hlo: Sequence[str | Path] = (), chip: str | None = None, depth: int = 2,
              warmup_steps: int = 1, label: str = "", jobs: int | None = 1, dask_address: str | None = None,
              hlo_option: str = "--hlo") -> Side:
    """Analyze a profile (anything ``analyze`` accepts; hosts read as :func:`traceroof.parallel.map_hosts` with
    ``jobs`` / ``dask_address``) or read a saved JSON report. ``hlo_option``: the option that gave ``hlo``, as
    the side's notes name it (``--hlo-new``)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".json" and not p.name.endswith((".trace.json",)) and "hlo_stats" not in p.name:
        return side_from_json(p)
    side = side_from_analysis(analyze(path, hlo=hlo, chip=chip, depth=depth, warmup_steps=warmup_steps, jobs=jobs,
                                      dask_address=dask_address), label or str(path))
    return replace(side, input_notes=tuple(n.replace("(--hlo)", f"({hlo_option})") for n in side.input_notes))


@dataclass(frozen=True)
class StepDelta:
    """Step time of both sides (means), the change, its standard error (:func:`standard_error`; ``paired``: of
    the per-step differences) and whether it is within noise."""

    base_s: float
    new_s: float
    delta_s: float
    delta_pct: float
    standard_error_s: float
    noise: bool
    paired: bool = False
    left_out: tuple[str, ...] = ()  # steps not compared (:func:`typical_steps`), e.g. "new step 5 (2.090 s, ...)"


@dataclass(frozen=True, eq=False)
class DiffResult:
    """``step``: the step-time change; ``layers``: per (layer, phase) deltas; ``ops``: matched ops with deltas;
    ``unmatched``: ops only one side has (``side`` = ``added`` / ``removed``); ``contributors``: lines naming
    the largest contributors to the change."""

    base: Side
    new: Side
    step: StepDelta
    layers: pd.DataFrame
    ops: pd.DataFrame
    unmatched: pd.DataFrame
    contributors: tuple[str, ...]
    memory: dict | None = None  # peak memory and category deltas (traceroof.memory.memory_delta)
    warnings: tuple[str, ...] = ()  # the two sides may not be the same job (:func:`_warnings`)
    step_breakdown: pd.DataFrame = field(default_factory=pd.DataFrame)  # breakdown_delta of the steps compared


def standard_error(base_s: Sequence[float], new_s: Sequence[float]) -> tuple[float, bool]:
    """The standard error (s) of the change of mean step time from the step times ``base_s`` to ``new_s``, and
    whether the steps were paired.

    Paired when both sides have as many steps, at least :data:`PAIRED_MIN_STEPS`: step i of one against step i of
    the other (both in step order), SE = std(new_i - base_i) / sqrt(n). The work a step does may vary with its
    data (an adaptive ODE solver's or a while loop's trip count, sequence lengths); two runs of one job with the
    same seeds vary alike, and the differences leave that shared variation out (s38 trial, a diffrax model whose
    steps took 14-48 ms: a +37 % regression was "within noise" at +/- 13 ms, and is +/- 4 ms paired). For
    independent steps the paired estimate is unbiased for the same quantity as the unpaired one (the paired
    t-test: Montgomery, *Design and Analysis of Experiments*, section 2.5). Otherwise the standard error of the
    difference of the two means, hypot(SE_base, SE_new) with SE = std / sqrt(n) (Welch). Sample standard
    deviations (ddof 1); a side of one step contributes 0."""
    b, n = np.asarray(base_s, np.float64), np.asarray(new_s, np.float64)
    if len(b) == len(n) >= PAIRED_MIN_STEPS:
        return float(np.std(n - b, ddof=1) / math.sqrt(len(b))), True

    def se(times: np.ndarray) -> float:
        return float(np.std(times, ddof=1) / math.sqrt(len(times))) if len(times) > 1 else 0.0

    return math.hypot(se(b), se(n)), False


OUTLIER_STEP_RATIO = 3.0  # a step over 3x its side's median step: a compilation, a checkpoint, a pause,
OUTLIER_STEP_MADS = 10.0  # and over 10 median absolute deviations above it (~7 sigma of normal step times): steps
# whose work varies with the data (trip counts of 2-32 in a while loop) spread wide and keep their slowest
MAX_OUTLIER_SHARE = 0.25  # more of a side's steps than this that slow: the side's steps are bimodal, none left out


@dataclass(frozen=True)
class TypicalSteps:
    """:func:`typical_steps`: the step times (s) compared, the step numbers left out of each side and the lines
    that say so."""

    base_s: np.ndarray
    new_s: np.ndarray
    base_left_out: tuple[int, ...] = ()
    new_left_out: tuple[int, ...] = ()
    said: tuple[str, ...] = ()

    def breakdowns(self, base: Side, new: Side) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Both sides' step breakdowns without the steps left out."""
        def kept(rows: pd.DataFrame, out: tuple[int, ...]) -> pd.DataFrame:
            return rows[~rows["step"].isin(out)] if out and len(rows) and "step" in rows else rows
        return kept(base.step_breakdown, self.base_left_out), kept(new.step_breakdown, self.new_left_out)


def typical_steps(base: Side, new: Side) -> TypicalSteps:
    """The steps of both sides that the comparison uses: not a step over :data:`OUTLIER_STEP_RATIO` times its
    side's median and :data:`OUTLIER_STEP_MADS` median absolute deviations above it (at most
    :data:`MAX_OUTLIER_SHARE` of its steps, from 3 steps) nor, where the steps are paired
    (:func:`standard_error`), its pair on the other side. One compiling step (s39 trial: 2.09 s among 33-49 ms
    steps after jax.clear_caches) made the band +/- 456 ms, and a +110 % regression passed the gate as "within
    noise"; its time is the compiler's, which `analyze` reports (``recompile``), not the step's."""
    b, n = np.asarray(base.step_times_s, np.float64), np.asarray(new.step_times_s, np.float64)

    def slow(t: np.ndarray) -> np.ndarray:
        if len(t) < 3:
            return np.zeros(len(t), bool)
        mid = np.median(t)
        out = (t > OUTLIER_STEP_RATIO * mid) & (t > mid + OUTLIER_STEP_MADS * np.median(np.abs(t - mid)))
        return out if out.sum() <= MAX_OUTLIER_SHARE * len(t) else np.zeros(len(t), bool)

    slow_b, slow_n = slow(b), slow(n)
    keep_b, keep_n = ~slow_b, ~slow_n
    if len(b) == len(n) >= PAIRED_MIN_STEPS:
        keep_b = keep_n = ~(slow_b | slow_n)
    said, numbers = [], []
    for name, side, t, out, keep in (("base", base, b, slow_b, keep_b), ("new", new, n, slow_n, keep_n)):
        nums = side.steps_used if len(side.steps_used) == len(t) else tuple(range(1, len(t) + 1))
        said += [f"{name} step {nums[i]} ({fmt_time(float(t[i]))}, {t[i] / np.median(t):.0f}x its median)"
                 for i in np.flatnonzero(out)]
        numbers.append(tuple(nums[i] for i in np.flatnonzero(~keep)))
    return TypicalSteps(b[keep_b], n[keep_n], numbers[0], numbers[1], tuple(said))


def step_delta(base: Side, new: Side, typical: TypicalSteps | None = None) -> StepDelta:
    """The step-time change of the means of ``typical`` (default: :func:`typical_steps`), within noise when within
    :data:`NOISE_SIGMAS` standard errors (:func:`standard_error`). With no step left out the means are the sides'
    own (a saved report without step times has its mean only)."""
    t = typical if typical is not None else typical_steps(base, new)
    base_s = float(t.base_s.mean()) if t.said else base.step_time_mean_s
    new_s = float(t.new_s.mean()) if t.said else new.step_time_mean_s
    d = new_s - base_s
    err, paired = standard_error(t.base_s, t.new_s)
    return StepDelta(base_s, new_s, d, d / base_s if base_s else float("nan"), err, abs(d) <= NOISE_SIGMAS * err,
                     paired, t.said)


_NULL = object()  # every null key value (None, NaN): pandas' merge and duplicated take nulls as equal
_ROW = "_traceroof_row"  # row positions carried through a pandas merge


def _key_rows(df: pd.DataFrame, cols: list[str]) -> list[tuple]:
    """Each row's values of ``cols`` as a tuple, nulls as :data:`_NULL`: tuples are equal where pandas' merge and
    ``duplicated`` call the rows' keys equal."""
    columns = [[_NULL if v is None or v is pd.NA or (isinstance(v, float) and v != v) else v
                for v in df[c].tolist()] for c in cols]
    return list(zip(*columns))


def _merge_order(rows: list[tuple]) -> list[int]:
    """Positions of ``rows`` (text key tuples, nulls as :data:`_NULL`) in the order pandas' outer merge gives its
    keys: sorted column by column, nulls last."""
    return sorted(range(len(rows)), key=lambda i: tuple((v is _NULL, "" if v is _NULL else v) for v in rows[i]))


def _with_missing(df: pd.DataFrame, cols: list[str]) -> pd.DataFrame:
    """``df`` with the dtypes pandas' outer merge gives a side's ``cols`` where the other side has unpaired rows
    (filled with NaN there): integers become floats, booleans objects."""
    promoted = {c: "float64" if df[c].dtype.kind in "iu" else object for c in cols if df[c].dtype.kind in "iub"}
    return df.astype(promoted) if promoted else df


def _unique_rows(df: pd.DataFrame, cols: list[str]) -> list[int]:
    """Positions of the rows whose ``cols`` no other row of ``df`` has (``~df.duplicated(cols, keep=False)``)."""
    rows = _key_rows(df, cols)
    counts = Counter(rows)
    return [i for i, k in enumerate(rows) if counts[k] == 1]


def _match(b: pd.DataFrame, n: pd.DataFrame, key: list[str]) -> tuple[pd.DataFrame, list[int], list[int]]:
    """The rows of ``b`` and ``n`` (each unique on ``key``) whose keys agree, as
    ``b.merge(n, on=key, how="outer", suffixes=("_base", "_new"))`` gives them (its order, its dtypes), and their
    positions in ``b`` and in ``n``. Text keys are paired in plain Python (a merge costs milliseconds even on a few
    rows); other key dtypes (a damaged report's ``hlo_ops``) go through the merge and its rules for them."""
    if not all(isinstance(b[c].dtype, pd.StringDtype) and b[c].dtype == n[c].dtype for c in key):
        m = b.assign(**{_ROW: range(len(b))}).merge(n.assign(**{_ROW: range(len(n))}), on=key, how="outer",
                                                    suffixes=("_base", "_new"), indicator=True)
        m = m[m["_merge"] == "both"].reset_index(drop=True)
        return (m.drop(columns=["_merge", f"{_ROW}_base", f"{_ROW}_new"]), m[f"{_ROW}_base"].astype(int).tolist(),
                m[f"{_ROW}_new"].astype(int).tolist())
    kb, kn = _key_rows(b, key), _key_rows(n, key)
    where_n = {k: j for j, k in enumerate(kn)}
    pairs = [(i, where_n[k]) for i, k in enumerate(kb) if k in where_n]
    pairs = [pairs[p] for p in _merge_order([kb[i] for i, _ in pairs])]
    rows_b, rows_n = [i for i, _ in pairs], [j for _, j in pairs]
    values_b = [c for c in b.columns if c not in key]
    values_n = [c for c in n.columns if c not in key]
    left = b.iloc[rows_b].reset_index(drop=True)
    right = n[values_n].iloc[rows_n].reset_index(drop=True)
    if len(n) > len(pairs):
        left = _with_missing(left, values_b)
    if len(b) > len(pairs):
        right = _with_missing(right, values_n)
    left = left.rename(columns={c: f"{c}_base" for c in values_b if c in values_n})
    right = right.rename(columns={c: f"{c}_new" for c in values_n if c in values_b})
    return pd.concat([left, right], axis=1), rows_b, rows_n


def _without(df: pd.DataFrame, rows: list[int]) -> pd.DataFrame:
    """``df`` less the rows at positions ``rows``."""
    keep = np.ones(len(df), dtype=bool)
    keep[rows] = False
    return df[keep]


def _one_row_per_key(df: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    """``df.groupby(key, as_index=False).agg(sum of METRICS, first hlo_ops)``: rows of one key summed (a report
    lists an op once per layer and phase; a hand-edited one may not), in the group-by's order (keys sorted). When
    every key is unique already (the usual case) the rows are only sorted: a group-by costs milliseconds."""
    rows = _key_rows(df, key)
    if len(set(rows)) < len(rows) or any(v is _NULL for r in rows for v in r):
        return df.groupby(key, as_index=False).agg({**{c: "sum" for c in METRICS}, "hlo_ops": "first"})
    order = sorted(range(len(rows)), key=rows.__getitem__)
    out = df[key + METRICS + ["hlo_ops"]].iloc[order].reset_index(drop=True)
    missing = [c for c in METRICS if out[c].isna().any()]
    if missing:  # as the group-by's sum of one missing value
        out[missing] = out[missing].fillna(0.0)
    return out


def diff(base: Side, new: Side) -> DiffResult:
    """Compare two sides: step time with noise, per-layer deltas, matched ops, added and removed ops."""
    key = OP_KEY
    b = base.op_stats.copy()
    n = new.op_stats.copy()
    for df in (b, n):
        for c in key:
            df[c] = df[c].astype(str) if c in df else ""
        for c in METRICS:
            df[c] = pd.to_numeric(df[c], errors="coerce") if c in df else np.nan
        if "hlo_ops" not in df:
            df["hlo_ops"] = ""
    b, n = _one_row_per_key(b, key), _one_row_per_key(n, key)
    both, rows_b, rows_n = _match(b, n, key)
    both = both.assign(matched_by="identity")
    only_b, only_n = _without(b, rows_b), _without(n, rows_n)
    # later passes, on what is left and unique on both sides: the scope was renamed (same op and shapes); the
    # operands changed (same result shape and place: a consumer that reads a saved activation through a fused
    # dynamic-slice of the scan's stacked buffer where it read the rematerialised value); the shapes changed (same
    # scope, phase, opcode, category, dtype). The last two first where unique, then where the HLO name agrees too
    for dropped, how, by_name in ((("layer", "scope"), "shape (scope renamed)", False),
                                  (("operand_shapes",), "shape (operands changed)", False),
                                  (("operand_shapes",), "name (operands changed)", True),
                                  (("shape", "operand_shapes"), "scope (shapes changed)", False),
                                  (("shape", "operand_shapes"), "name (shapes changed)", True)):
        if only_b.empty or only_n.empty:
            break
        loose = [c for c in key if c not in dropped] + (["hlo_ops"] if by_name else [])
        ub, un = (df.iloc[_unique_rows(df, loose)] for df in (only_b, only_n))
        pairs, rows_b, rows_n = _match(ub.drop(columns=list(dropped)), un.drop(columns=list(dropped)), loose)
        if pairs.empty:
            continue
        pairs = pd.concat([pairs, ub[list(dropped)].iloc[rows_b].reset_index(drop=True),  # the base's, and:
                           un[list(dropped)].iloc[rows_n].reset_index(drop=True).add_suffix("_new")], axis=1)
        named = pairs.assign(hlo_ops_base=pairs["hlo_ops"], hlo_ops_new=pairs["hlo_ops"]) if by_name else pairs
        both = pd.concat([both, named.drop(columns="hlo_ops", errors="ignore").assign(matched_by=how)],
                         ignore_index=True)
        only_b = only_b.drop(index=ub.index[rows_b])
        only_n = only_n.drop(index=un.index[rows_n])
    for c in METRICS:
        both[f"{c}_delta"] = both[f"{c}_new"] - both[f"{c}_base"]
    both["flops_ratio"] = both["flops_per_step_new"] / both["flops_per_step_base"].replace(0, np.nan)
    both = both.sort_values(["time_per_step_s_delta"], ascending=False, key=abs, kind="stable") \
        .reset_index(drop=True)
    unmatched = pd.concat([only_b.assign(side="removed"), only_n.assign(side="added")], ignore_index=True)
    layers = _layer_deltas(base.layers, new.layers)
    typical = typical_steps(base, new)
    step = step_delta(base, new, typical)
    parts = breakdown_delta(*typical.breakdowns(base, new))
    lines = _contributors(step, layers, unmatched, parts)
    work = _work_line(step, work_ratio(base, new), typical.base_s, typical.new_s)
    lines[1:1] = [work] * bool(work)
    return DiffResult(base, new, step, layers, both, unmatched, tuple(lines),
                      memory_delta(base.memory, new.memory), _warnings(base, new, both, b, n), parts)


MIN_MATCHED_SHARE = 0.5  # less of either side's op time in ops found in both: not two runs of one job
WORK_CHANGE = 0.01  # FLOPs per step (all devices) differing by more than 1 %: the steps do different work


def work_ratio(base: Side, new: Side) -> float | None:
    """The new side's FLOPs per step over the base's, over all devices (``flops_per_step`` x ``devices`` where
    both sides know their devices: the same global batch over twice the devices is the same work), or ``None``
    when either side has no FLOP count (a profile without HLO)."""
    b, n = base.flops_per_step, new.flops_per_step
    if not (b > 0 and n > 0 and math.isfinite(b) and math.isfinite(n)):
        return None
    if base.devices and new.devices:
        b, n = b * base.devices, n * new.devices
    return n / b


def _work_line(step: StepDelta, ratio: float | None, base_s: Sequence[float], new_s: Sequence[float],
               ) -> str | None:
    """When the steps do different work (:data:`WORK_CHANGE`): the change of time per FLOP, the throughput
    figure a larger batch or model is judged by (a doubled batch in a 1.5x longer step is 25 % less time per
    FLOP, and "slower" per step); its noise: :func:`standard_error` of the step times ``base_s`` against
    ``new_s`` scaled to the base's work."""
    if ratio is None or abs(ratio - 1) <= WORK_CHANGE or not (step.base_s > 0 and step.new_s > 0):
        return None
    per_flop = step.new_s / ratio / step.base_s - 1
    verdict = "faster" if per_flop < 0 else "slower"
    err = standard_error(base_s, np.asarray(new_s, np.float64) / ratio)[0]
    if err and abs(step.new_s / ratio - step.base_s) <= NOISE_SIGMAS * err:
        verdict = "within noise"
    return (f"work per step x{ratio:.2f} (FLOPs, all devices): time per FLOP {per_flop:+.1%}, "
            f"{verdict} per unit of work (throughput x{1 / (1 + per_flop):.2f})")


def _warnings(base: Side, new: Side, both: pd.DataFrame, b: pd.DataFrame, n: pd.DataFrame) -> tuple[str, ...]:
    """Lines saying the two sides may not be the same job: other device counts (per-device figures of different
    shardings), or less than :data:`MIN_MATCHED_SHARE` of either side's op time in ops found in both (a CI gate
    given the report of another program passed "within noise", pairing a pipeline's ops with a MoE's)."""
    out = []
    if base.devices and new.devices and base.devices != new.devices:
        out.append(f"the profiles ran on different numbers of devices (base {base.devices}, new {new.devices}): "
                   "per-device figures compare different shardings of the work")
    shares = [float(both[f"time_per_step_s_{side}"].sum()) / total if total > 0 else 1.0
              for side, total in (("base", float(b["time_per_step_s"].sum())),
                                  ("new", float(n["time_per_step_s"].sum())))]
    if min(shares) < MIN_MATCHED_SHARE:
        out.append(f"only {shares[0]:.0%} of the base's op time and {shares[1]:.0%} of the new profile's is in ops "
                   "found in both: these look like different programs, not two runs of one; check that the base "
                   "is the report of this job")
    return tuple(out)


PAIRED = " -> "  # a layer named differently on the two sides and paired (:func:`_loop_and_scan`)


def _loop_and_scan(base: set[str], new: set[str]) -> dict[str, str]:
    """Layer names of one side -> the paired name, for a repeated block that one side runs as instances of a
    Python loop (collapsed ``Block_*``) and the other as one scanned body (``Block``): ``Block_*`` and ``Block``
    -> ``Block_* -> Block`` (base first), when each name is on one side only."""
    out = {}
    for mine, other, base_side in ((base, new, True), (new, base, False)):
        for name in mine:
            if not isinstance(name, str):  # a saved report's missing layer name (NaN)
                continue
            plain = re.sub(r"_\*(?=/|$)", "", name)
            if plain != name and plain in other and plain not in mine and name not in other:
                out[name] = out[plain] = f"{name}{PAIRED}{plain}" if base_side else f"{plain}{PAIRED}{name}"
    return out


def _layer_deltas(b: pd.DataFrame, n: pd.DataFrame) -> pd.DataFrame:
    cols = ["time_per_step_s", "expected_per_step_s", "flops_per_step", "hbm_bytes_per_step", "efficiency",
            "exposed_comm_per_step_s"]
    def prep(df: pd.DataFrame) -> pd.DataFrame:
        df = df.copy()
        for c in ("layer", "phase"):
            df[c] = df[c].astype(str) if c in df else ""
        for c in cols:
            df[c] = pd.to_numeric(df[c], errors="coerce") if c in df else np.nan
        return df[["layer", "phase"] + cols]
    b, n = prep(b), prep(n)
    paired = _loop_and_scan(set(b["layer"]), set(n["layer"]))
    if paired:
        b["layer"], n["layer"] = b["layer"].replace(paired), n["layer"].replace(paired)
    m = b.merge(n, on=["layer", "phase"], how="outer", suffixes=("_base", "_new"))
    for c in cols:
        m[f"{c}_delta"] = m[f"{c}_new"].fillna(0.0) - m[f"{c}_base"].fillna(0.0)
    m["flops_ratio"] = m["flops_per_step_new"] / m["flops_per_step_base"].replace(0, np.nan)
    return m.sort_values("time_per_step_s_delta", ascending=False, key=abs, kind="stable").reset_index(drop=True)


def _contributors(step: StepDelta, layers: pd.DataFrame, unmatched: pd.DataFrame,
                  parts: pd.DataFrame | None = None) -> list[str]:
    """Lines explaining the step-time change: the verdict, then, beyond noise, a component of the step breakdown
    outside the ops (host-bound, launch gaps, outside any program) when it moved more than any layer's op time
    (a faster data loader is no layer's change), and the layers that moved most with the change."""
    verdict = "within noise" if step.noise else ("slower" if step.delta_s > 0 else "faster")
    of = "of the step-by-step differences" if step.paired else "of the difference of means"
    out = [f"step time {step.base_s * 1e3:.3f} ms -> {step.new_s * 1e3:.3f} ms ({step.delta_pct:+.1%}, "
           f"+/- {NOISE_SIGMAS * step.standard_error_s * 1e3:.3f} ms at {NOISE_SIGMAS:g} standard errors {of}): "
           f"{verdict}"]
    if step.left_out:
        pair = "; with its pair, steps compared one to one" if step.paired else ""
        out.append(f"left out of the step time, over {OUTLIER_STEP_RATIO:g}x the median step and far outside the "
                   f"others' spread (a compilation, a checkpoint or a pause: analyze's findings say which{pair}): "
                   f"{', '.join(step.left_out)}")
    if step.noise:
        return out
    if parts is not None and len(parts):
        off_ops = parts[parts["component"].isin(["launch_gap_s", "host_bound_s", "outside_program_s"])]
        off_ops = off_ops[np.sign(off_ops["delta_s"]) == np.sign(step.delta_s)]
        top_layer = float(layers["time_per_step_s_delta"].abs().max()) if len(layers) else 0.0
        if len(off_ops) and float(off_ops["delta_s"].abs().max()) > top_layer:
            r = off_ops.loc[off_ops["delta_s"].abs().idxmax()]
            out.append(f"{LABELS[r['component']]} (step breakdown, no op's time): {r['delta_s'] * 1e3:+.3f} ms per "
                       f"step, more than any layer's change")
    top = layers[np.sign(layers["time_per_step_s_delta"]) == np.sign(step.delta_s)].head(3)
    for r in top.itertuples(index=False):
        ratio = f", FLOPs x{r.flops_ratio:.2f}" if pd.notna(r.flops_ratio) and abs(r.flops_ratio - 1) > 0.01 else ""
        out.append(f"{r.layer} ({r.phase}): {r.time_per_step_s_delta * 1e3:+.3f} ms per step{ratio}")
    if len(unmatched):
        add = unmatched[unmatched["side"] == "added"]["time_per_step_s"].sum()
        rem = unmatched[unmatched["side"] == "removed"]["time_per_step_s"].sum()
        out.append(f"unmatched ops: +{add * 1e3:.3f} ms added, -{rem * 1e3:.3f} ms removed per step")
    return out


def gate(result: DiffResult, fail_above_pct: float | None, layer: str | None = None) -> tuple[bool, str]:
    """True (fail) when step time, or ``layer``'s time (all phases), regressed by more than ``fail_above_pct``
    percent and beyond noise. Layer gating has no per-step spread: only the threshold applies.

    :raises InputError: ``layer`` is in neither profile.
    """
    if fail_above_pct is None:
        return False, "no gate"
    if not math.isfinite(fail_above_pct):
        raise InputError(f"--fail-above {fail_above_pct}: expected a finite percent")
    for side in (result.base, result.new):
        if not (math.isfinite(side.step_time_mean_s) and side.step_time_mean_s > 0):
            raise InputError(f"{side.label}: step time {side.step_time_mean_s} s is not a positive finite number: "
                             "there is no measured step time to gate on (is it a profile with steps?)")
    if layer:
        names = [x if isinstance(x, str) else "" for x in result.layers["layer"]]  # (a saved report's NaN: none)
        rows = result.layers[[n == layer or layer in n.split(PAIRED) for n in names]]
        if rows.empty:
            raise InputError(f"--layer {layer!r} is in neither profile; layers: "
                             + ", ".join(sorted(set(names) - {""})[:8]))
        b = rows["time_per_step_s_base"].fillna(0).sum()
        n = rows["time_per_step_s_new"].fillna(0).sum()
        pct = (n - b) / b * 100 if b else float("inf")
        fail = pct > fail_above_pct
        return fail, (f"layer {layer}: {pct:+.1f}% ({_against(fail, fail_above_pct)}; a layer's time has no noise "
                      "estimate, unlike the step's: the threshold alone decides)")
    pct = result.step.delta_pct * 100
    fail = pct > fail_above_pct and not result.step.noise
    why = "within noise" if result.step.noise else _against(fail, fail_above_pct)
    caveat = f"; but {len(result.warnings)} warning(s): the sides may not be one job" if result.warnings else ""
    return fail, f"step time {pct:+.1f}% ({why}){caveat}"


def _against(fail: bool, fail_above_pct: float) -> str:
    """``above the +5% limit`` / ``within the +5% limit``: a faster step read "-6.3% (limit 5%)"."""
    return f"{'above' if fail else 'within'} the {fail_above_pct:+g}% limit"
