"""The finding record and what every rule reads (:class:`FindingInputs`), with the small helpers rules share:
per-step sums, severity from the share of the step, the user's source lines of a set of ops."""

from __future__ import annotations

import math
from functools import cached_property
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import pandas as pd

from traceroof.findings.hlo_graph import Programs
from traceroof.units import fmt_si, fmt_time

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
    host time between them included) when the analysis has one, else the header's step time. In a loop that
    blocks on the host the two differ (the header's device step leaves the host's time out), and a finding
    about host time must not exceed 100 % of the step. NaN when unknown."""
    b = getattr(analysis, "step_breakdown", None)
    if isinstance(b, pd.DataFrame) and len(b) and "step_time_s" in b:
        mean = float(b["step_time_s"].mean())
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


def fmt_bytes(b: float) -> str:
    """Bytes with a decimal prefix (:func:`traceroof.units.fmt_si`)."""
    return fmt_si(b, "B")


def ops_by_time(rows: pd.DataFrame, limit: int = MAX_OPS) -> tuple[str, ...]:
    """HLO op names of ``rows`` (per-op sums), most measured time first."""
    if rows.empty:
        return ()
    t = rows.groupby(rows["hlo_op"].astype(str), observed=True)["measured_s"].sum().sort_values(
        ascending=False, kind="stable")
    return tuple(t.index[:limit])


def source_lines(rows: pd.DataFrame, programs: Programs | None = None, limit: int = MAX_SOURCE_LINES
                 ) -> tuple[str, ...]:
    """``file:line`` of the user's code behind ``rows``, most time first: the innermost stack frame outside
    installed packages (:meth:`ModuleIndex.user_line`) where the HLO is at hand, else the rows' ``source``."""
    if rows.empty:
        return ()
    src = rows["source"].astype(str) if "source" in rows else pd.Series("", index=rows.index)
    if programs is not None and {"module", "program_id"} <= set(rows.columns):
        lines = []
        ident = rows[["module", "program_id", "hlo_op"]].itertuples(index=False)  # 3 columns: itertuples is slow
        for r, fallback in zip(ident, src):                                      # on the op table's ~60
            got = programs.instruction(r.module, r.program_id, r.hlo_op)
            lines.append((got[0].user_line(got[1]) if got else "") or fallback)
        src = pd.Series(lines, index=rows.index, dtype=object)
    keep = src.str.len() > 0
    if not keep.any():
        return ()
    t = rows.loc[keep, "measured_s"].groupby(src[keep]).sum().sort_values(ascending=False, kind="stable")
    return tuple(t.index[:limit])


def make(x: FindingInputs, code: str, title: str, lost_s: float, advice: str, source: str,
         evidence: list[str] | tuple[str, ...] = (), rows: pd.DataFrame | None = None,
         ops: tuple[str, ...] | None = None, level: str | None = None) -> Finding:
    """A finding whose severity follows from ``lost_s`` and the step time (or ``level``), with the ops and
    source lines of ``rows`` (per-op sums) unless ``ops`` is given."""
    rows = rows if rows is not None else x.counted.iloc[:0]
    return Finding(code=code, severity=level or severity(lost_s, x.step_s), title=title,
                   lost_per_step_s=float(lost_s), advice=advice, source=source,
                   evidence=tuple(e for e in evidence if e), ops=ops if ops is not None else ops_by_time(rows),
                   source_lines=source_lines(rows, x.programs if x.modules else None))


def as_record(f: Finding) -> dict[str, Any]:
    """A finding as a JSON-ready dict (lists for tuples; NaN left for the caller's cleaning)."""
    return {"code": f.code, "severity": f.severity, "title": f.title, "lost_per_step_s": f.lost_per_step_s,
            "evidence": list(f.evidence), "advice": f.advice, "source": f.source, "source_lines": list(f.source_lines),
            "ops": list(f.ops)}
