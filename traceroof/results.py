"""What an analysis returns: the report header (:class:`Summary`) and every table (:class:`Analysis`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from traceroof.join import JoinReport
from traceroof.optable import per_op
from traceroof.opstats import op_stats

if TYPE_CHECKING:
    from traceroof.findings import Finding
    from traceroof.memory import MemoryView
    from traceroof.mesh_book import ParallelismReport
    from traceroof.rowcosts import RowCosts


FLOP_CONVENTION = ("FLOPs and bytes follow XLA HloCostAnalysis on the after-optimization HLO (2 per multiply-add, "
                   "executed work incl. rematerialisation, while bodies x trip count; a scatter updating its operand "
                   "in place is charged the bytes it updates, where XLA charges the whole operand)")


@dataclass(frozen=True)
class Summary:
    """Report header: input, device, chip, steps, and whole-step figures (per device, per step).

    ``flops_per_step`` are executed FLOPs (rematerialised forward included); ``model_flops_per_step`` the
    model's FLOPs (without the recomputation, or the user's ``--model-flops-per-step`` / devices; the source in
    ``model_flops_source``). ``mfu`` = model FLOPs ÷ step time ÷ peak, ``hfu`` = executed FLOPs ÷ step time ÷
    peak (How to Scale Your Model §4.3.2: remat adds ~one forward; hardware-and-rooflines.md §1), both against
    the ``mfu_peak_key`` peak.
    """

    input: str
    device: str
    chip_id: str
    chip_name: str
    chip_note: str
    peak_flops_per_s: dict[str, float]
    hbm_bandwidth_bytes_per_s: float | None
    step_annotation: str
    steps_total: int
    steps_used: tuple[int, ...]
    warmup_steps: int
    step_time_mean_s: float
    step_time_std_s: float
    flops_per_step: float
    hbm_bytes_per_step: float
    expected_per_step_s: float
    op_time_per_step_s: float
    mfu: float
    mfu_peak_key: str
    roofline_efficiency: float
    devices: int
    hosts: int  # hosts holding op events (one profile file each)
    join: JoinReport
    exposed_comm_per_step_s: float = 0.0
    step_times_s: tuple[float, ...] = ()
    step_flops: tuple[float, ...] = ()  # FLOPs per device of each used step (steps_used order); () without HLO
    hlo_sources: dict[str, int] = field(default_factory=dict)
    flop_convention: str = FLOP_CONVENTION
    notes: tuple[str, ...] = ()
    host_step_time_mean_s: float = float("nan")  # the step annotations' own mean (host time), for comparison
    model_flops_per_step: float = float("nan")
    model_flops_source: str = ""
    hfu: float = float("nan")
    chip_calibrated_at: str = ""  # when a calibrated host chip was measured (UTC, from its chip file)
    decoder: str = ""  # wire scanner that read the .xplane.pb files: "c" or "python" (Profile.decoder); "" otherwise
    virtual_devices: bool = False  # devices that are threads of CPU hosts (XLA:CPU): their collectives mostly wait


@dataclass(frozen=True, eq=False)
class Analysis:
    """Everything a report shows. ``op_rows`` is the op table (one row per host, device, program, op, kernel
    and step: :func:`traceroof.optable.build_op_table`) as stored, its cost columns kept per op in ``row_costs``
    (:class:`~traceroof.rowcosts.RowCosts`; ``None``: the table has them, as an XProf export's has), and
    :attr:`ops` the whole table; ``layers`` the
    per-(layer, phase) rollup; ``top_ops`` the ops losing most time per step; ``steps`` the marked steps;
    ``collectives`` one row per collective op (see :func:`collectives_table`); ``topology`` the topology used;
    ``per_step_divisor`` turns op-table totals into per-step, per-device figures; ``step_breakdown``,
    ``memory`` and ``parallelism`` the step, memory and mesh views; ``findings`` ranked by time lost."""

    summary: Summary
    op_rows: pd.DataFrame
    layers: pd.DataFrame
    top_ops: pd.DataFrame
    steps: pd.DataFrame
    depth: int = 2
    findings: tuple[Finding, ...] = field(default_factory=tuple)  # ranked (traceroof.findings)
    collectives: pd.DataFrame = field(default_factory=pd.DataFrame)
    topology: str = ""
    per_step_divisor: float = 1.0  # op-table totals / this = per step, per device (steps used x devices)
    per_op_rows: pd.DataFrame | None = None  # per_op() of the counted rows of the used steps, when already made
    step_breakdown: pd.DataFrame = field(default_factory=pd.DataFrame)  # traceroof.breakdown, per step and device
    step_timeline: pd.DataFrame = field(default_factory=pd.DataFrame)  # traceroof.breakdown.timeline_items (HTML)
    memory: MemoryView | None = None  # the programs that ran (traceroof.memory; None for XProf exports)
    parallelism: ParallelismReport | None = None  # strategy per mesh axis, the book's arithmetic (mesh_book)
    row_costs: RowCosts | None = None  # the op rows' cost columns, per op (traceroof.rowcosts)

    @cached_property
    def ops(self) -> pd.DataFrame:
        """The whole op table: :attr:`op_rows` with its cost and roofline columns (``flops`` ... ``lost_s``)
        worked out from :attr:`row_costs`, built on first use (about twice the memory of ``op_rows``)."""
        return self.op_rows if self.row_costs is None else self.row_costs.wide(self.op_rows)

    @property
    def op_stats(self) -> pd.DataFrame:
        """Per-step figures of every distinct op, keyed by what it is, not what it is called (see
        :func:`op_stats`): the table ``traceroof diff`` matches on."""
        rows = self.per_op_rows
        if rows is None:
            d = self.op_rows
            rows = per_op(d, np.flatnonzero(d["counted"].to_numpy(bool) & d["step"].notna().to_numpy(bool)),
                          self.row_costs)
        return op_stats(rows, self.per_step_divisor)
