"""The costs of op rows, kept per op: level 2 of the op table stores per row only what differs between rows
(events, time, executions, step...), and every cost column that is one op's cost times the row's events (FLOPs,
bytes, modelled communication) or follows from those by the roofline (compute, memory, expected and lost time,
efficiency, arithmetic intensity) is worked out from a :class:`RowCosts` for the rows that ask, with the very
arithmetic a stored column had (so sums and reports are the same to the last bit). On a profile whose ops run
once per step there are as many op rows as op events (3.4 million on the 21.6-million-event benchmark profile):
the 16 float columns these replace took 128 of the 246 bytes of a row.

:meth:`RowCosts.wide` rebuilds the whole table (``traceroof analyze --table ops``, :attr:`Analysis.ops`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from traceroof.roofline import roofline_values

ADDITIVE = ("flops", "transcendentals", "logical_bytes", "padded_bytes", "hbm_bytes")  # per event x events
TPU_OURS = ("traceroof_flops", "traceroof_hbm_bytes")  # our count beside libtpu's, on TPU rows
ROOFLINE_FLOATS = ("compute_s", "memory_s", "communication_s", "expected_s", "efficiency",
                   "arithmetic_intensity_flops_per_byte", "lost_s")
CHUNK_ROWS = 1 << 18  # op rows whose worked-out columns are computed at once when reducing them: ~2 MB per column
NOT_SUMMED = ("peak_flops_per_s", "efficiency", "arithmetic_intensity_flops_per_byte")  # an op's own, or a ratio
# where each worked-out column stands in the whole table: after the stored column named
_AFTER = {"source": ADDITIVE, "op_key": TPU_OURS, "instance": ("comm_s",), "comm_latency_bound": ("peak_flops_per_s",),
          "peak_key": ("compute_s", "memory_s", "communication_s", "expected_s"),
          "bound": ("efficiency", "arithmetic_intensity_flops_per_byte", "lost_s")}


@dataclass(frozen=True, eq=False)
class RowCosts:
    """Per op (index: the op table's ``op_key``): ``per_event``, the cost of one op event by :data:`ADDITIVE`
    column (one execution's FLOPs, transcendentals and bytes ÷ the op's kernels per execution; a row's value is
    this times its ``events``); ``comm_per_execution_s``, the modelled time of one execution of a collective (0
    for other ops; ``None`` before the collective model ran); ``peak_flops_per_s``, the peak the op is judged
    against (``None`` before the roofline; NaN: no usable figure); ``hbm_bandwidth_bytes_per_s`` of the chip.
    ``tpu``: the rows carry libtpu's own ``profile_flops`` / ``profile_bytes_accessed`` sums, which win over
    ours where present (ours stay as ``traceroof_flops`` / ``traceroof_hbm_bytes``)."""

    per_event: dict[str, np.ndarray] = field(default_factory=dict)
    comm_per_execution_s: np.ndarray | None = None
    peak_flops_per_s: np.ndarray | None = None
    hbm_bandwidth_bytes_per_s: float = float("nan")
    tpu: bool = False

    def with_communication(self, comm_per_execution_s: np.ndarray) -> RowCosts:
        """These costs with the collective model's time per execution of each op (s; 0 for other ops)."""
        return replace(self, comm_per_execution_s=np.asarray(comm_per_execution_s, np.float64))

    def with_roofline(self, peak_flops_per_s: np.ndarray, hbm_bandwidth_bytes_per_s: float) -> RowCosts:
        """These costs with each op's peak (FLOP/s) and the chip's HBM bandwidth (bytes/s)."""
        return replace(self, peak_flops_per_s=np.asarray(peak_flops_per_s, np.float64),
                       hbm_bandwidth_bytes_per_s=hbm_bandwidth_bytes_per_s)

    def names(self) -> tuple[str, ...]:
        """The columns :meth:`columns` works out, in the order of the whole table."""
        out = ADDITIVE + (TPU_OURS if self.tpu else ())
        if self.comm_per_execution_s is not None:
            out += ("comm_s",)
        if self.peak_flops_per_s is not None:
            out += ("peak_flops_per_s",) + ROOFLINE_FLOATS
        return out

    def columns(self, ops: pd.DataFrame, names: tuple[str, ...] | None = None,
                at: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The worked-out columns ``names`` (default :meth:`names`) of the rows ``at`` (positions; default all) of
        ``ops`` (the op table's stored columns ``op_key``, ``events``, ``executions``, ``measured_s``,
        ``joined``, ``opaque``, ``comm_latency_bound`` and on TPU ``profile_flops`` / ``profile_bytes_accessed``),
        float64, computed as the stored columns were: a cost column is the op's cost per event x the row's
        events, the roofline :func:`traceroof.roofline.roofline_values` of the row."""
        want = self.names() if names is None else names
        if not want:
            return {}

        def col(name: str, dtype: type = np.float64) -> np.ndarray:
            v = ops[name].to_numpy(dtype)
            return v if at is None else v[at]

        key = col("op_key", np.int64)
        n_events = col("events")
        out = {c: self.per_event[c][key] * n_events for c in ADDITIVE}
        if self.tpu:  # libtpu's own per-op FLOPs and bytes win where present; ours kept beside
            out["traceroof_flops"], out["traceroof_hbm_bytes"] = out["flops"], out["hbm_bytes"]
            pf, pb = col("profile_flops"), col("profile_bytes_accessed")
            out["flops"] = np.where(np.isnan(pf), out["flops"], pf)
            out["hbm_bytes"] = np.where(np.isnan(pb), out["hbm_bytes"], pb)
        comm = None
        if self.comm_per_execution_s is not None:
            comm = out["comm_s"] = self.comm_per_execution_s[key] * col("executions")
        roof = [c for c in want if c in ROOFLINE_FLOATS or c == "bound"]  # bound: codes into roofline.BOUNDS
        if self.peak_flops_per_s is not None:
            out["peak_flops_per_s"] = self.peak_flops_per_s[key]
            if roof:
                out.update(roofline_values(
                    out["flops"] + out["transcendentals"], out["hbm_bytes"], comm, out["peak_flops_per_s"],
                    self.hbm_bandwidth_bytes_per_s, col("joined", bool), col("opaque", bool),
                    col("comm_latency_bound", bool) if "comm_latency_bound" in ops else None, col("measured_s"),
                    tuple(roof)))
        return {c: out[c] for c in want}

    def sums(self, ops: pd.DataFrame, group: np.ndarray, n_groups: int, at: np.ndarray | None = None,
             ) -> dict[str, np.ndarray]:
        """Per group (``group``: codes 0..n_groups-1 of the rows ``at`` of ``ops``, default all), the sums of the
        worked-out columns that add up (all but :data:`NOT_SUMMED`), float64: equal to the last bit to
        ``np.bincount(group, weights=column)`` of the stored column, worked out :data:`CHUNK_ROWS` rows at a time
        so memory stays flat (each chunk's bincount starts from the sums so far: the additions run in the same
        order)."""
        names = tuple(c for c in self.names() if c not in NOT_SUMMED)
        rows = np.arange(len(ops)) if at is None else at
        total = {c: np.zeros(n_groups) for c in names}
        start = np.arange(n_groups)
        for lo in range(0, len(rows), CHUNK_ROWS):
            part = rows[lo:lo + CHUNK_ROWS]
            codes = np.concatenate([start, group[lo:lo + CHUNK_ROWS]])
            for c, v in self.columns(ops, names, part).items():
                total[c] = np.bincount(codes, weights=np.concatenate([total[c], v]), minlength=n_groups)
        return total

    def bound_codes(self, ops: pd.DataFrame) -> np.ndarray:
        """Per row of ``ops``, what bounds it (int8 codes into :data:`traceroof.roofline.BOUNDS`), worked out
        :data:`CHUNK_ROWS` rows at a time."""
        out = np.zeros(len(ops), np.int8)
        for lo in range(0, len(ops), CHUNK_ROWS):
            part = np.arange(lo, min(lo + CHUNK_ROWS, len(ops)))
            out[part] = self.columns(ops, ("bound",), part)["bound"]
        return out

    def wide(self, ops: pd.DataFrame, at: np.ndarray | None = None,
             values: dict[str, np.ndarray] | None = None) -> pd.DataFrame:
        """The whole op table: ``ops``'s rows ``at`` (default all) with every worked-out column in its place
        (``values``: some of them already worked out for those rows, e.g. sums)."""
        got = dict(values or {})
        missing = tuple(c for c in self.names() if c not in got)
        got.update(self.columns(ops, missing, at))
        rows = ops if at is None else ops.take(at)
        cols: dict[str, object] = {}
        for c in ops.columns:
            cols[c] = got[c] if c in got else rows[c].array
            cols.update((d, got[d]) for d in _AFTER.get(c, ()) if d in got)
        placed = set(cols)
        cols.update((c, v) for c, v in got.items() if c not in placed)  # a stored column it follows is absent
        out = pd.DataFrame(cols, copy=False)
        out.index = rows.index
        out.attrs.update(ops.attrs)
        return out
