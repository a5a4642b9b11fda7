"""The finding record and what every rule reads (:class:`FindingInputs`), with the small helpers rules share:
per-step sums, severity from the share of the step, the user's source lines of a set of ops.

Rules select op rows as positions in ``FindingInputs.counted`` (numpy int arrays) over its columns as numpy arrays
(:class:`OpColumns`): selecting rows of the 54-column pandas table costs 50-300 us each time, a numpy mask about
a microsecond, and a tiny analysis runs some twenty such selections."""

from __future__ import annotations

import math
from collections import Counter
from functools import cached_property
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import pandas as pd

from traceroof.codes import category_text
from traceroof.findings.hlo_graph import Programs
from traceroof.units import fmt_time

if TYPE_CHECKING:
    from parsers.hlo import HloModule
    from traceroof.chips import Chip
    from traceroof.results import Analysis

SEVERITIES = ("high", "medium", "low", "info")
HIGH_SHARE = 0.10  # a finding costing this share of the step or more is "high"
MEDIUM_SHARE = 0.02  # ... this share or more "medium"; below it "low"; no time figure: "info"
BOOK = "How to Scale Your Model (Austin et al., 2025)"  # the source most rules cite, by section
MAX_SOURCE_LINES = 5
MAX_OPS = 12


@dataclass(frozen=True)
class Finding:
    """One finding: what is wrong, what it costs, what to do, and where.

    ``code``: stable kebab-case rule id (README "Findings"); ``severity``: ``high`` / ``medium`` / ``low`` by the
    share of the step lost (:data:`HIGH_SHARE`, :data:`MEDIUM_SHARE`), ``info`` when no time can be put on it;
    ``title``: one line saying what was seen; ``lost_per_step_s``: the time it costs per step and device (the
    ranking key; NaN when unknown); ``advice``: what to change in the code or flags; ``source``: the book or
    vendor section the rule and advice come from; ``evidence``: figures and shapes; ``ops``: the HLO ops
    involved (most time first); ``source_lines``: ``file:line`` of the user's code from the HLO metadata."""

    code: str
    severity: str
    title: str
    lost_per_step_s: float
    advice: str
    source: str
    evidence: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    source_lines: tuple[str, ...] = ()

    def __str__(self) -> str:
        lost = f" (~{fmt_s(self.lost_per_step_s)} per step)" if self.lost_per_step_s > 0 else ""
        return f"[{self.code}] {self.title}{lost}: {self.advice}"


class OpColumns:
    """The columns of an op table as numpy arrays, each converted on first use and kept for every rule.

    ``num``: float64; ``flag``: bool; ``text``: each value as ``astype(str)`` writes it, None where missing (an
    object array); ``value``: the values themselves (``tolist()``: NaN or <NA> where missing), for lookups and
    messages. A column the table lacks raises KeyError, as the table would."""

    def __init__(self, table: pd.DataFrame) -> None:
        self.table = table
        self._got: dict[tuple[str, str], Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.table

    def _get(self, kind: str, name: str, convert: Callable[[pd.Series], Any]) -> Any:
        if (kind, name) not in self._got:
            self._got[kind, name] = convert(self.table[name])
        return self._got[kind, name]

    def num(self, name: str) -> np.ndarray:
        return self._get("num", name, lambda s: s.to_numpy(np.float64))

    def flag(self, name: str) -> np.ndarray:
        return self._get("flag", name, lambda s: s.to_numpy(bool))

    def text(self, name: str) -> np.ndarray:
        return self._get("text", name, _text)

    def value(self, name: str) -> list[Any]:
        return self._get("value", name, lambda s: s.tolist())

    def isin(self, name: str, values: Sequence[str]) -> np.ndarray:
        """Rows whose ``text`` is one of ``values`` (missing: never)."""
        t = self.text(name)
        return np.fromiter((v in values for v in t), bool, len(t))


def _text(col: pd.Series) -> np.ndarray:
    """``col.astype(str)`` as an object array, None where missing; a categorical's categories converted once."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        names = np.append(category_text(col.array), None)  # code -1: missing
        return names[col.array.codes]
    return col.astype(str).to_numpy(object, na_value=None)


@dataclass(frozen=True, eq=False)
class FindingInputs:
    """What rules read. ``analysis``: the analysis without findings (summary, layers, collectives,
    ``per_step_divisor``, and where present ``step_breakdown`` / ``parallelism``); ``counted``: per-op sums of
    the counted op rows of the used steps (:func:`traceroof.optable.per_op`); ``chip``: the target (per device);
    ``stats``: execution statistics (:func:`traceroof.opstats.execution_stats`); ``skew``: collective arrival
    skew rows; ``steps``: steps used; ``virtual_devices``: devices are threads of one host; ``modules``: the
    HLO modules (empty for an XProf export)."""

    analysis: Analysis
    counted: pd.DataFrame
    chip: Chip | None = None
    stats: pd.DataFrame = field(default_factory=pd.DataFrame)
    skew: pd.DataFrame = field(default_factory=pd.DataFrame)
    steps: int = 0
    virtual_devices: bool = False
    modules: tuple[HloModule, ...] = ()

    @cached_property
    def programs(self) -> Programs:
        """The HLO modules, indexed on first use."""
        return Programs(self.modules)

    @cached_property
    def cols(self) -> OpColumns:
        """``counted``'s columns as numpy arrays: what rules filter and sum."""
        return OpColumns(self.counted)

    @cached_property
    def matmuls(self) -> np.ndarray:
        """Positions in ``counted`` of the matmuls that joined their HLO and ran: what the matrix rules judge."""
        c = self.cols
        return np.flatnonzero((c.text("category") == "matmul") & c.flag("joined") & (c.num("measured_s") > 0))

    @property
    def per(self) -> float:
        """Totals over the op rows ÷ this = per step, per device."""
        return max(float(self.analysis.per_step_divisor), 1e-12)

    @cached_property
    def step_s(self) -> float:
        """Mean step time (s) findings are judged against: :func:`step_time_s`."""
        return step_time_s(self.analysis)

    def table(self, name: str) -> pd.DataFrame | None:
        """An optional analysis table (``step_breakdown``, ``parallelism``): None until it exists or when empty."""
        t = getattr(self.analysis, name, None)
        return t if isinstance(t, pd.DataFrame) and len(t) else None


Rule = Callable[[FindingInputs], list[Finding]]


def step_time_s(analysis: Analysis) -> float:
    """The step a finding's share is of: the step breakdown's mean step (each step from the previous one's end,
    host time between them included) when the analysis has one, else the header's step time. The two are one
    figure (:func:`traceroof.utilization.step_periods`) except in a JSON report saved by a traceroof that took
    the header's step from the device's span alone, which leaves a blocking loop's host time out: a finding about
    host time must not exceed 100 % of the step. NaN when unknown."""
    b = getattr(analysis, "step_breakdown", None)
    if isinstance(b, pd.DataFrame) and len(b) and "step_time_s" in b:
        mean = mean_of(b["step_time_s"])
        if math.isfinite(mean) and mean > 0:
            return mean
    return float(analysis.summary.step_time_mean_s)


def severity(lost_s: float, step_s: float) -> str:
    """``high`` / ``medium`` / ``low`` by ``lost_s`` ÷ ``step_s``; ``info`` when either is unknown."""
    if not (lost_s > 0 and step_s > 0 and math.isfinite(lost_s)):
        return "info"
    share = lost_s / step_s
    return "high" if share >= HIGH_SHARE else "medium" if share >= MEDIUM_SHARE else "low"


def share(lost_s: float, step_s: float) -> str:
    """``lost_s`` as a share of the step ('' when the step time is unknown)."""
    return f"{lost_s / step_s:.1%} of the step" if step_s > 0 and math.isfinite(lost_s) else ""


fmt_s = fmt_time  # seconds with their unit (traceroof.units)


def total(values: np.ndarray) -> float:
    """The sum of ``values`` with NaN left out (0 for none), as pandas' ``Series.sum`` adds them."""
    return float(np.nansum(values))


def mean_of(col: pd.Series) -> float:
    """``col.mean()`` of a numeric column, in numpy: the sum with NaN left out over the count of the others (NaN
    when none), as pandas computes it."""
    v = col.to_numpy(np.float64)
    n = np.count_nonzero(~np.isnan(v))
    return float(np.nansum(v) / n) if n else float("nan")


def descending(values: np.ndarray) -> np.ndarray:
    """Positions of ``values``, largest first and NaN last, in the order pandas' ``sort_values(ascending=False)``
    puts them (its ``nargsort``: numpy's default sort of the reversed non-NaN values, reversed back)."""
    nan = np.isnan(values)
    idx = np.flatnonzero(~nan)[::-1]
    return np.concatenate([idx[values[idx].argsort()][::-1], np.flatnonzero(nan)])


def ranked(keys: Sequence[str | None], weights: np.ndarray, limit: int) -> tuple[str, ...]:
    """The distinct ``keys`` (None: missing, left out) by the sum of their ``weights``, largest first (NaN adds
    nothing; ties in key order), at most ``limit``: the ranking ``Series(weights).groupby(keys).sum()
    .sort_values(ascending=False, kind="stable")`` gives. Plain sums while no key has more than two rows (pandas'
    compensated group sum is the plain sum then), pandas itself otherwise."""
    counts = Counter(k for k in keys if k is not None)
    if counts and max(counts.values()) > 2:
        t = pd.Series(weights).groupby(pd.Series(list(keys), dtype=object)).sum()
        return tuple(t.sort_values(ascending=False, kind="stable").index[:limit])
    sums: dict[str, float] = {}
    for k, w in zip(keys, weights):
        if k is not None:
            sums[k] = sums.get(k, 0.0) + (w if w == w else 0.0)
    order = sorted(sorted(sums), key=lambda k: (sums[k] != sums[k], -sums[k]))
    return tuple(order[:limit])


def ops_by_time(x: FindingInputs, rows: np.ndarray, limit: int = MAX_OPS) -> tuple[str, ...]:
    """HLO op names of ``rows`` (positions in ``x.counted``, per-op sums), most measured time first."""
    if not len(rows):
        return ()
    return ranked(x.cols.text("hlo_op")[rows], x.cols.num("measured_s")[rows], limit)


def source_lines(x: FindingInputs, rows: np.ndarray, limit: int = MAX_SOURCE_LINES) -> tuple[str, ...]:
    """``file:line`` of the user's code behind ``rows`` (positions in ``x.counted``), most time first: the
    innermost stack frame outside installed packages (:meth:`ModuleIndex.user_line`) where the HLO is at hand,
    else the rows' ``source``."""
    if not len(rows):
        return ()
    c = x.cols
    src = list(c.text("source")[rows]) if "source" in c else [""] * len(rows)
    if x.modules and "module" in c and "program_id" in c:
        module, program, op = c.value("module"), c.value("program_id"), c.value("hlo_op")
        for n, i in enumerate(rows):
            got = x.programs.instruction(module[i], program[i], op[i])
            src[n] = (got[0].user_line(got[1]) if got else "") or src[n]
    keep = [n for n, s in enumerate(src) if s]
    if not keep:
        return ()
    return ranked([src[n] for n in keep], c.num("measured_s")[rows[keep]], limit)


def make(x: FindingInputs, code: str, title: str, lost_s: float, advice: str, source: str,
         evidence: list[str] | tuple[str, ...] = (), rows: np.ndarray | None = None,
         ops: tuple[str, ...] | None = None, level: str | None = None) -> Finding:
    """A finding whose severity follows from ``lost_s`` and the step time (or ``level``), with the ops and
    source lines of ``rows`` (positions in ``x.counted``) unless ``ops`` is given."""
    rows = np.zeros(0, np.int64) if rows is None else np.asarray(rows, np.int64)
    return Finding(code=code, severity=level or severity(lost_s, x.step_s), title=title,
                   lost_per_step_s=float(lost_s), advice=advice, source=source,
                   evidence=tuple(e for e in evidence if e), ops=ops if ops is not None else ops_by_time(x, rows),
                   source_lines=source_lines(x, rows))


def as_record(f: Finding) -> dict[str, Any]:
    """A finding as a JSON-ready dict (lists for tuples; NaN left for the caller's cleaning)."""
    return {"code": f.code, "severity": f.severity, "title": f.title, "lost_per_step_s": f.lost_per_step_s,
            "evidence": list(f.evidence), "advice": f.advice, "source": f.source, "source_lines": list(f.source_lines),
            "ops": list(f.ops)}
