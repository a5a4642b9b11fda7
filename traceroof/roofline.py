"""Per-op roofline: compute and memory time on a target chip, expected time, bound, efficiency, lost time.

``t_compute = FLOPs / peak FLOP/s (chip, dtype)``, ``t_memory = HBM bytes / HBM bandwidth``, ``t_comm`` from
the collective model (:mod:`traceroof.collectives`, column ``comm_s``), ``expected = max(t_compute, t_memory,
t_comm)``, bound = the largest (compute wins ties with memory), ``efficiency = expected ÷
measured``, ``lost = measured − expected`` (How to Scale Your Model §1 eq. 1.3; ``docs/DESIGN.md``).
Matrix work (category ``matmul``) is judged against the dtype's matrix-unit peak, other work against the vector
peak where the chip file has one. Opaque ops keep their measured time and get no expectation.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from traceroof.chips import Chip


def apply_roofline(ops: pd.DataFrame, chip: Chip) -> pd.DataFrame:
    """Add roofline columns to an op table.

    Needs ``category``, ``dtype``, ``flops``, ``transcendentals``, ``hbm_bytes``, ``measured_s``, ``opaque``.
    Uses ``comm_s`` when present. Adds ``peak_flops_per_s``, ``peak_key``, ``compute_s``, ``memory_s``,
    ``communication_s``, ``expected_s``, ``bound`` (``compute`` / ``memory`` / ``communication`` / ``opaque`` /
    ``unknown`` for ops without HLO), ``efficiency``, ``lost_s``
    and ``arithmetic_intensity_flops_per_byte``. Returns a new DataFrame.
    """
    out = ops.copy()
    pairs = out[["category", "dtype"]].astype(str).drop_duplicates()
    peak_of: dict[tuple[str, str], tuple[float, str]] = {}
    for cat, dtype in pairs.itertuples(index=False):
        value, key = chip.peak_for(dtype, vector=cat != "matmul")
        peak_of[(cat, dtype)] = (value if value else np.nan, key)
    keys = list(zip(out["category"].astype(str), out["dtype"].astype(str)))
    peak = np.array([peak_of[k][0] for k in keys], dtype=np.float64) if len(out) else np.zeros(0)
    out["peak_flops_per_s"] = peak
    out["peak_key"] = pd.Categorical([peak_of[k][1] for k in keys])
    bw = chip.hbm_bandwidth_bytes_per_s or np.nan
    work = out["flops"].to_numpy(np.float64) + out["transcendentals"].to_numpy(np.float64)
    compute = np.where(work > 0, work / peak, 0.0)
    memory = out["hbm_bytes"].to_numpy(np.float64) / bw
    comm = out["comm_s"].to_numpy(np.float64) if "comm_s" in out else np.zeros(len(out))
    comm = np.nan_to_num(comm)
    known = out["joined"].to_numpy(bool) & ~out["opaque"].to_numpy(bool)
    expected = np.where(known, np.maximum(np.maximum(compute, memory), comm), np.nan)
    out["compute_s"] = np.where(known, compute, np.nan)
    out["memory_s"] = np.where(known, memory, np.nan)
    out["communication_s"] = np.where(known, comm, np.nan)
    out["expected_s"] = expected
    bound = np.where(compute >= memory, "compute", "memory")
    bound = np.where((comm > compute) & (comm > memory), "communication", bound)
    bound = np.where(out["opaque"].to_numpy(bool), "opaque", bound)
    bound = np.where(out["joined"].to_numpy(bool), bound, "unknown")
    out["bound"] = pd.Categorical(bound)
    measured = out["measured_s"].to_numpy(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["efficiency"] = np.where(measured > 0, expected / measured, np.nan)
        hbm = out["hbm_bytes"].to_numpy(np.float64)
        out["arithmetic_intensity_flops_per_byte"] = np.where(hbm > 0, work / hbm, np.nan)
    out["lost_s"] = measured - expected
    return out
