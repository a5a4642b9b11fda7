"""``host-bound`` and ``comm-bound-axis`` against the column contracts of the step breakdown
(``Analysis.step_breakdown``) and the parallelism analysis (``Analysis.parallelism``), on small frames made
here (those analyses are built beside this one); and that they stay quiet while the analysis has neither."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pandas as pd
import pytest

from traceroof.chips import get_chip
from traceroof.findings import FindingInputs, run_rules
from traceroof.findings.rules_system import comm_bound_axis, host_bound

STEP_S = 10e-3


@dataclass(frozen=True)
class FakeAnalysis:
    """The parts of an Analysis the two rules read, with the new tables as the other helpers will add them."""

    summary: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(
        step_time_mean_s=STEP_S, op_time_per_step_s=9e-3))
    collectives: pd.DataFrame = field(default_factory=pd.DataFrame)
    per_step_divisor: float = 1.0
    step_breakdown: pd.DataFrame | None = None
    parallelism: pd.DataFrame | None = None


def inputs(**tables) -> FindingInputs:
    return FindingInputs(FakeAnalysis(**tables), pd.DataFrame(columns=["hlo_op", "measured_s"]), get_chip("tpu_v5p"))


def breakdown(host_bound_s: float) -> pd.DataFrame:
    rows = [{"step": s, "device": d, "step_time_s": STEP_S, "compute_s": 6e-3, "exposed_comm_s": 1e-3,
             "launch_gap_s": 0.5e-3, "host_bound_s": host_bound_s, "outside_program_s": 0.2e-3}
            for s in range(3) for d in ("TPU:0", "TPU:1")]
    return pd.DataFrame(rows)


def test_host_bound_from_the_step_breakdown():
    (f,) = host_bound(inputs(step_breakdown=breakdown(2.5e-3)))
    assert f.code == "host-bound" and f.lost_per_step_s == pytest.approx(2.5e-3) and f.severity == "high"
    assert "25.0% of the step" in f.title and "launch gap 500.0 µs" in f.evidence[0]
    assert "prefetch" in f.advice
    assert host_bound(inputs(step_breakdown=breakdown(0.1e-3))) == []  # 1 % of the step: not worth a finding


def test_host_bound_waits_for_the_breakdown_columns():
    assert host_bound(inputs(step_breakdown=pd.DataFrame({"step": [0], "device": ["x"]}))) == []
    assert host_bound(inputs()) == []  # no breakdown; ops cover 90 % of the step


def axes(t_comm_s: float) -> pd.DataFrame:
    return pd.DataFrame([
        {"axis": "data", "size": 16, "strategy": "fsdp", "batch_per_device": 256, "critical_batch_per_device": 850,
         "t_math_s": 2e-3, "t_comm_s": t_comm_s, "bound": "communication" if t_comm_s > 2e-3 else "compute",
         "evidence": "all-gather of weights + reduce-scatter of gradients"},
        {"axis": "model", "size": 4, "strategy": "tensor", "batch_per_device": 256,
         "critical_batch_per_device": float("nan"), "t_math_s": 2e-3, "t_comm_s": 1e-3, "bound": "compute",
         "evidence": ""}])


def test_comm_bound_axis_gives_the_book_remedy():
    (f,) = comm_bound_axis(inputs(parallelism=axes(5e-3)))
    assert f.code == "comm-bound-axis" and "axis data (fsdp, size 16)" in f.title
    assert f.lost_per_step_s == pytest.approx(3e-3)
    assert "now 256, needs about 850" in f.advice and "§5" in f.source
    assert "all-gather of weights" in " ".join(f.evidence)
    assert comm_bound_axis(inputs(parallelism=axes(1e-3))) == []  # every axis compute-bound


def test_engine_runs_without_the_new_tables():
    x = inputs()
    assert [f.code for f in run_rules(x, ("host-bound", "comm-bound-axis"))] == []
    x = inputs(step_breakdown=breakdown(2.5e-3), parallelism=axes(5e-3))
    assert [f.code for f in run_rules(x, ("host-bound", "comm-bound-axis"))] == ["comm-bound-axis", "host-bound"]
