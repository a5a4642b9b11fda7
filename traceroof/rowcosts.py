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

from traceroof.roofline import ROOFLINE_COLUMNS, roofline_values

# per event x events
ADDITIVE = ("flops", "matmul_flops", "routing_flops", "transcendentals", "logical_bytes", "padded_bytes", "hbm_bytes")
TPU_OURS = ("traceroof_flops", "traceroof_hbm_bytes")  # our count beside libtpu's, on TPU rows
ROOFLINE_FLOATS = tuple(c for c in ROOFLINE_COLUMNS if c != "bound")  # ("bound" is a code)
CHUNK_ROWS = 1 << 18  # op rows whose worked-out columns are computed at once when reducing them: ~2 MB per column
ALL_ROWS_FROM = 0.8  # RowCosts.sums of rows ``at``: share of all rows from which working out every row costs less
#                      than copying the stored columns of those rows (a row's copy costs a fifth of working it out)
NOT_SUMMED = ("peak_flops_per_s", "efficiency", "arithmetic_intensity_flops_per_byte")  # an op's own, or a ratio
_STORED_TYPES = {"op_key": np.int64, "joined": bool, "opaque": bool, "comm_latency_bound": bool}  # others float64
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
        return self._worked(self._stored(ops, want, at), want, None) if want else {}

    def _stored(self, ops: pd.DataFrame, want: tuple[str, ...], at: np.ndarray | None = None,
                ) -> dict[str, np.ndarray]:
        """The stored columns of ``ops`` (of its rows ``at``; default all) that working out ``want`` reads, as numpy
        arrays of the type the arithmetic takes (``op_key`` int64, flags bool, others float64): converted once
        for all chunks of rows, not per chunk (a column already of that type is not copied)."""
        roof = self._roof(want)
        read = ["op_key", "events"]
        if self.tpu:
            read += ["profile_flops", "profile_bytes_accessed"]
        if self.comm_per_execution_s is not None:
            read.append("executions")
        if roof:
            read += ["joined", "opaque"] + (["comm_latency_bound"] if "comm_latency_bound" in ops else [])
            if {"efficiency", "lost_s"} & set(roof):
                read.append("measured_s")
        return {c: (ops[c] if at is None else ops[c].take(at)).to_numpy(_STORED_TYPES.get(c, np.float64))
                for c in read}

    def _roof(self, want: tuple[str, ...]) -> tuple[str, ...]:
        """The roofline columns among ``want`` (``bound``: codes into :data:`traceroof.roofline.BOUNDS`), none
        before :meth:`with_roofline`."""
        return tuple(c for c in want if c in ROOFLINE_COLUMNS) if self.peak_flops_per_s is not None \
            else ()

    def _worked(self, stored: dict[str, np.ndarray], want: tuple[str, ...], at: np.ndarray | slice | None,
                ) -> dict[str, np.ndarray]:
        """:meth:`columns` ``want`` of the rows ``at`` (positions or a slice; None: all) from :meth:`_stored`."""
        def col(name: str) -> np.ndarray:  # np.take: faster than [at]
            v = stored[name]
            return v if at is None else v[at] if isinstance(at, slice) else np.take(v, at)

        roof = self._roof(want)
        key = col("op_key")
        n_events = col("events")
        out: dict[str, np.ndarray] = {}
        needed = set(want) | ({"flops", "transcendentals", "hbm_bytes"} if roof else set())
        for c in ADDITIVE:
            if c in needed or (self.tpu and "traceroof_" + c in needed):
                out[c] = np.take(self.per_event[c], key).astype(np.float64, copy=False)
                out[c] *= n_events
        if self.tpu:  # libtpu's own per-op FLOPs and bytes win where present; ours kept beside
            for c, libtpu in (("flops", "profile_flops"), ("hbm_bytes", "profile_bytes_accessed")):
                if c in out:
                    out["traceroof_" + c] = out[c]
                    theirs = col(libtpu)
                    out[c] = np.where(np.isnan(theirs), out[c], theirs)
        comm = None
        if self.comm_per_execution_s is not None:
            comm = out["comm_s"] = np.take(self.comm_per_execution_s, key)
            comm *= col("executions")
        if self.peak_flops_per_s is not None and ("peak_flops_per_s" in want or roof):
            out["peak_flops_per_s"] = np.take(self.peak_flops_per_s, key)
        if roof:
            out.update(roofline_values(
                out["flops"] + out["transcendentals"], out["hbm_bytes"], comm, out["peak_flops_per_s"],
                self.hbm_bandwidth_bytes_per_s, col("joined"), col("opaque"),
                col("comm_latency_bound") if "comm_latency_bound" in stored else None,
                col("measured_s") if "measured_s" in stored else None, roof))
        return {c: out[c] for c in want}

    def sums(self, ops: pd.DataFrame, group: np.ndarray, n_groups: int, at: np.ndarray | None = None,
             names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        """Per group (``group``: per row of ``ops``, its code 0..n_groups-1, or ``n_groups`` for a row left out),
        the sums of the worked-out columns ``names`` (default: all that add up, all but :data:`NOT_SUMMED`), float64:
        equal to the last bit to ``np.bincount(group, weights=column)[:n_groups]`` of the stored column, worked out
        :data:`CHUNK_ROWS` rows at a time so memory stays flat (each chunk's rows added to the sums so far,
        ``np.add.at``: the additions run in the same order). ``at``: the positions of the rows not left out
        (increasing), when known: where they are fewer than :data:`ALL_ROWS_FROM` of the rows, only they are
        worked out (their stored columns copied); otherwise every row is (chunks of every stored column are then
        views, not copies) and the rows left out summed into a group dropped."""
        few = at is not None and len(at) < ALL_ROWS_FROM * len(ops)
        if names is None:
            names = tuple(c for c in self.names() if c not in NOT_SUMMED)
        stored = self._stored(ops, names, at if few else None)
        codes_of = np.take(group, at) if few else group
        total = {c: np.zeros(n_groups + 1) for c in names}
        for lo in range(0, len(codes_of), CHUNK_ROWS):
            part = slice(lo, lo + CHUNK_ROWS)
            codes = codes_of[part]
            for c, v in self._worked(stored, names, part).items():
                np.add.at(total[c], codes, v.view(np.float64))  # numpy's float64: an equal type (unpickled) is slow
        return {c: v[:n_groups] for c, v in total.items()}

    def bound_codes(self, ops: pd.DataFrame) -> np.ndarray:
        """Per row of ``ops``, what bounds it (int8 codes into :data:`traceroof.roofline.BOUNDS`), worked out
        :data:`CHUNK_ROWS` rows at a time."""
        out = np.zeros(len(ops), np.int8)
        stored = self._stored(ops, ("bound",))
        for lo in range(0, len(ops), CHUNK_ROWS):
            out[lo:lo + CHUNK_ROWS] = self._worked(stored, ("bound",), slice(lo, lo + CHUNK_ROWS))["bound"]
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
