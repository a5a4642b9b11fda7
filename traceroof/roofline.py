"""Per-op roofline: compute and memory time on a target chip, expected time, bound, efficiency, lost time.

``t_compute = FLOPs / peak FLOP/s (chip, dtype)``, ``t_memory = HBM bytes / HBM bandwidth``, ``t_comm`` from
the collective model (:mod:`traceroof.collectives`, column ``comm_s``), ``expected = max(t_compute, t_memory,
t_comm)``, bound = the largest (compute wins ties with memory), ``efficiency = expected ÷
measured``, ``lost = measured − expected`` (How to Scale Your Model §1 eq. 1.3; ``docs/DESIGN.md``).
Matrix work (category ``matmul``) is judged against the dtype's matrix-unit peak, other work against the vector
peak where the chip file has one; f32 matmuls by their precision (``dot_precision`` column: TF32 or FP32 on
NVIDIA, :meth:`traceroof.chips.Chip.f32_matmul_peak`). A collective whose per-hop latency floor exceeds its
bandwidth term (``comm_latency_bound`` column) is ``latency`` bound when communication sets its expectation.
Opaque ops keep their measured time and get no expectation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import pandas as pd

from parsers.xspace import code_dtype
from traceroof.chips import Chip
from traceroof.codes import as_text, category_text, constant_categorical, first_rows, group_codes

if TYPE_CHECKING:
    from traceroof.rowcosts import RowCosts

BOUNDS = ("communication", "compute", "latency", "memory", "opaque", "unknown")  # sorted, as a Categorical orders them
ROOFLINE_COLUMNS = ("compute_s", "memory_s", "communication_s", "expected_s", "bound", "efficiency",
                    "arithmetic_intensity_flops_per_byte", "lost_s")  # what roofline_values works out, in its order


def _usable(figure: object) -> bool:
    """A chip figure that can divide work into time: a positive finite number (anything else: no expectation)."""
    try:
        return bool(np.isfinite(figure) and figure > 0)
    except TypeError:
        return False


def _reads(col: pd.Series, test: Callable[[str], bool]) -> np.ndarray:
    """Rows whose value as text (``col.astype(str)``) passes ``test`` (missing: never), testing a categorical's
    categories once instead of every row."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        hit = np.array([test(c) for c in category_text(col.array)] + [False])  # code -1: missing
        return hit[col.array.codes]
    return np.array([isinstance(v, str) and test(v) for v in col.astype(str)], bool)


def _precision_key(key: str) -> bool:
    """A peak key set by an f32 dot's precision (TF32 / FP32 on NVIDIA, or a multi-pass ``bf16_x3`` ...)."""
    return key in ("tf32", "fp32") or "_x" in key


def _sorted_categorical(codes: np.ndarray, names: tuple[str, ...]) -> pd.Categorical:
    """``names[codes]`` as ``pd.Categorical`` of those strings makes it (categories: the names present, in order),
    without building the strings; ``names`` sorted and few (a pass over the codes per name finds those present)."""
    used = [i for i in range(len(names)) if (codes == i).any()]
    remap = np.zeros(len(names), np.int8)
    remap[used] = np.arange(len(used))
    return pd.Categorical.from_codes(np.take(remap, codes), categories=pd.Index([names[i] for i in used], dtype="str"),
                                     validate=False)


def op_peaks(ops: pd.DataFrame, chip: Chip) -> tuple[np.ndarray, pd.Categorical]:
    """Per row of ``ops`` (``category``, ``dtype``, ``dot_precision`` where present): the FLOP/s peak it is judged
    against (NaN where the chip has no usable figure) and its ``peak_key``, looked up once per distinct
    (category, dtype, precision)."""
    parts = [(ops[c].array if isinstance(ops[c].dtype, pd.CategoricalDtype) else pd.Categorical(ops[c])) if c in ops
             else constant_categorical("", len(ops)) for c in ("category", "dtype", "dot_precision")]
    codes = group_codes(parts)
    combos = [tuple(str(p.categories[p.codes[i]]) if p.codes[i] >= 0 else "nan" for p in parts)
              for i in first_rows(codes)]
    peaks, peak_keys = [], []
    for cat, dtype, prec in combos:
        value, key = chip.peak_for(dtype, vector=cat != "matmul", precision=prec if cat == "matmul" else "")
        peaks.append(value if _usable(value) else np.nan)
        peak_keys.append(key)
    peak = np.array(peaks, dtype=np.float64)[codes] if len(ops) else np.zeros(0)
    names = sorted(set(peak_keys))  # the categories pd.Categorical(peak_keys) would have
    key_codes = np.array([names.index(k) for k in peak_keys], code_dtype(len(names)))
    peak_key = pd.Categorical.from_codes(key_codes[codes], categories=pd.Index(names, dtype="str"), validate=False) \
        if len(ops) else pd.Categorical([])
    return peak, peak_key


def hbm_bandwidth(chip: Chip) -> float:
    """The chip's HBM bandwidth (bytes/s) memory time divides by; NaN when the chip file has no usable figure."""
    return chip.hbm_bandwidth_bytes_per_s if _usable(chip.hbm_bandwidth_bytes_per_s) else np.nan


def roofline_values(work_flops: np.ndarray, hbm_bytes: np.ndarray, comm_s: np.ndarray | None,
                    peak_flops_per_s: np.ndarray, hbm_bandwidth_bytes_per_s: float, joined: np.ndarray,
                    opaque: np.ndarray, latency_bound: np.ndarray | None, measured_s: np.ndarray | None,
                    names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The roofline of rows (float64 arrays, one value per row): ``work_flops`` (FLOPs + transcendentals),
    ``hbm_bytes`` (HBM traffic, bytes), ``comm_s`` (modelled communication time, s; NaN or None: none),
    ``peak_flops_per_s`` (the peak each row is judged against, FLOP/s), ``hbm_bandwidth_bytes_per_s`` (the
    chip's, one figure), ``joined`` / ``opaque`` / ``latency_bound`` (bool: an HLO op; no cost model; a
    latency-bound collective; None: none is), ``measured_s`` (measured time, s; None where ``names`` leaves out
    ``efficiency`` and ``lost_s``). Returns ``compute_s``, ``memory_s``, ``communication_s``, ``expected_s``
    (s; NaN where not ``joined`` or ``opaque``), ``bound`` (int8 codes into :data:`BOUNDS`), ``efficiency``
    (expected ÷ measured), ``arithmetic_intensity_flops_per_byte`` and ``lost_s`` (measured − expected, s); with
    ``names``, only those, and only what they need is computed (formulas: the module docstring)."""
    want = set(ROOFLINE_COLUMNS if names is None else names)
    out: dict[str, np.ndarray] = {}
    if want - {"arithmetic_intensity_flops_per_byte"}:
        compute = work_flops / peak_flops_per_s
        np.copyto(compute, 0.0, where=~(work_flops > 0))
        memory = hbm_bytes / hbm_bandwidth_bytes_per_s
        if comm_s is None:
            comm = np.zeros(len(work_flops))
        else:  # np.nan_to_num, without its passes for infinities where there are none
            comm = np.nan_to_num(comm_s) if np.isinf(comm_s).any() else np.where(np.isnan(comm_s), 0.0, comm_s)
        unknown = ~joined | opaque if want - {"bound", "arithmetic_intensity_flops_per_byte"} else None
        if want & {"expected_s", "efficiency", "lost_s"}:
            expected = np.maximum(compute, memory)
            np.maximum(expected, comm, out=expected)
            np.copyto(expected, np.nan, where=unknown)
        if "bound" in want:  # compute wins ties with memory
            bound = np.where(compute >= memory, np.int8(BOUNDS.index("compute")), np.int8(BOUNDS.index("memory")))
            lat = latency_bound if latency_bound is not None else np.zeros(len(work_flops), bool)
            over = (comm > compute) & (comm > memory)
            np.copyto(bound, np.where(lat, np.int8(BOUNDS.index("latency")), np.int8(BOUNDS.index("communication"))),
                      where=over)
            np.copyto(bound, np.int8(BOUNDS.index("opaque")), where=opaque)
            np.copyto(bound, np.int8(BOUNDS.index("unknown")), where=~joined)
        for name, v in (("compute_s", compute), ("memory_s", memory), ("communication_s", comm)):
            if name in want:  # the figures above are read no more: NaN where unknown in place
                np.copyto(v, np.nan, where=unknown)
                out[name] = v
        if "expected_s" in want:
            out["expected_s"] = expected
        if "bound" in want:
            out["bound"] = bound
    with np.errstate(divide="ignore", invalid="ignore"):
        if "efficiency" in want:
            out["efficiency"] = np.where(measured_s > 0, expected / measured_s, np.nan)
        if "arithmetic_intensity_flops_per_byte" in want:
            out["arithmetic_intensity_flops_per_byte"] = np.where(hbm_bytes > 0, work_flops / hbm_bytes, np.nan)
    if "lost_s" in want:
        out["lost_s"] = measured_s - expected
    return out


def apply_roofline(ops: pd.DataFrame, chip: Chip) -> pd.DataFrame:
    """Add roofline columns to an op table with every cost column (an XProf export's; the op table of a profile
    keeps its costs per op instead: :mod:`traceroof.rowcosts`).

    Needs ``category``, ``dtype``, ``flops``, ``transcendentals``, ``hbm_bytes``, ``measured_s``, ``opaque``.
    Uses ``comm_s``, ``comm_latency_bound`` and ``dot_precision`` when present. Adds ``peak_flops_per_s``,
    ``peak_key`` (``tf32`` / ``fp32`` for f32 matmuls on NVIDIA), ``compute_s``, ``memory_s``,
    ``communication_s``, ``expected_s``, ``bound`` (``compute`` / ``memory`` / ``communication`` / ``latency``
    (a collective whose per-hop latency floor sets its time) / ``opaque`` / ``unknown`` for ops without HLO),
    ``efficiency``, ``lost_s``
    and ``arithmetic_intensity_flops_per_byte`` to ``ops`` (in place: no copy) and returns it.
    """
    out = ops
    out["peak_flops_per_s"], out["peak_key"] = op_peaks(out, chip)
    values = roofline_values(
        out["flops"].to_numpy(np.float64) + out["transcendentals"].to_numpy(np.float64),
        out["hbm_bytes"].to_numpy(np.float64), out["comm_s"].to_numpy(np.float64) if "comm_s" in out else None,
        out["peak_flops_per_s"].to_numpy(np.float64), hbm_bandwidth(chip), out["joined"].to_numpy(bool),
        out["opaque"].to_numpy(bool),
        out["comm_latency_bound"].to_numpy(bool) if "comm_latency_bound" in out else None,
        out["measured_s"].to_numpy(np.float64))
    for name in ROOFLINE_COLUMNS:
        out[name] = _sorted_categorical(values[name], BOUNDS) if name == "bound" else values[name]
    return out


def roofline_rows(ops: pd.DataFrame, costs: RowCosts, chip: Chip) -> tuple[pd.DataFrame, RowCosts]:
    """The roofline of a profile's op table, whose cost columns are kept per op (:mod:`traceroof.rowcosts`):
    adds ``peak_key`` and ``bound`` (categorical, as :func:`apply_roofline` has them) to ``ops`` in place, and
    returns it with ``costs`` knowing each op's peak and the chip's HBM bandwidth (the float columns
    :func:`apply_roofline` adds are worked out from those when read). An op's rows share its category, dtype and
    precision, so its peak is its first row's."""
    peak, ops["peak_key"] = op_peaks(ops, chip)
    per_op_peak = np.full(len(costs.per_event.get("flops", ())), np.nan)
    key = ops["op_key"].to_numpy(np.int64)
    first = first_rows(key)
    per_op_peak[key[first]] = peak[first]
    costs = costs.with_roofline(per_op_peak, hbm_bandwidth(chip))
    ops["bound"] = _sorted_categorical(costs.bound_codes(ops), BOUNDS)
    return ops, costs


def main_matmul_peak(ops: pd.DataFrame, chip: Chip, default_dtype: str = "f32") -> tuple[float | None, str]:
    """The peak the MFU divides by: that of the matmuls doing most FLOPs (their ``peak_key`` from
    :func:`apply_roofline`), else the chip's peak for ``default_dtype``."""
    if "peak_flops_per_s" in ops:
        peak = ops["peak_flops_per_s"].to_numpy(np.float64)
        mm = np.flatnonzero(_reads(ops["category"], lambda c: c == "matmul") & ~np.isnan(peak))
        if len(mm) and np.nansum(ops["flops"].to_numpy(np.float64)[mm]) > 0:
            keys = as_text(ops["peak_key"], "nan")[mm]
            distinct = set(keys.tolist())  # one key: the most FLOPs without a groupby
            key = distinct.pop() if len(distinct) == 1 else \
                str(ops["flops"].iloc[mm].groupby(pd.Series(keys, index=ops.index[mm])).sum().idxmax())
            return float(peak[mm][keys == key][0]), key
    value, key = chip.peak_for(default_dtype)
    return (value if _usable(value) else None), key


def precision_notes(ops: pd.DataFrame, chip: Chip, costs: RowCosts | None = None) -> list[str]:
    """A report note for f32 matmuls judged against a precision-specific peak (TF32 or FP32 on NVIDIA): their
    share of matmul FLOPs per key and the rule (XLA ``GetBlasComputationType``). ``costs``: where ``ops`` keeps
    its cost columns per op (:mod:`traceroof.rowcosts`); default its ``flops`` column."""
    if "dot_precision" not in ops or "peak_key" not in ops:
        return []
    # matmuls with a precision request (a missing one counts as one, as astype(str) != "" has it) and its peak
    mm = np.flatnonzero(_reads(ops["category"], lambda c: c == "matmul")
                        & ~_reads(ops["dot_precision"], lambda p: p == "") & _reads(ops["peak_key"], _precision_key))
    if not len(mm):
        return []
    flops = ops["flops"].to_numpy(np.float64)[mm] if costs is None else costs.columns(ops, ("flops",), mm)["flops"]
    by_key = pd.Series(flops).groupby(ops["peak_key"].iloc[mm].astype(str).to_numpy()).sum()
    total = by_key.sum()
    parts = ", ".join(f"{k} {v / total:.0%}" if total > 0 else k
                      for k, v in by_key.sort_values(ascending=False).items())
    return [f"f32 matmuls judged against precision-specific peaks ({parts} of their FLOPs): on {chip.name} XLA runs "
            "an f32 dot at DEFAULT/HIGH precision as TF32 and at HIGHEST (or algorithm dot_f32_f32_f32) as FP32 "
            "(openxla/xla xla/service/gpu/matmul_utils.cc GetBlasComputationType)"]
