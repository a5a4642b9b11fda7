"""Roofline arithmetic: expected = max(compute, memory), bound, efficiency, lost time, --chip projection."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from traceroof.chips import get_chip
from traceroof.roofline import apply_roofline


def _ops() -> pd.DataFrame:
    return pd.DataFrame({
        "category": ["matmul", "elementwise", "custom-call", "unknown"],
        "dtype": ["bf16", "bf16", "f32", ""],
        "flops": [2 * 4096.0**3, 1e6, 0.0, 0.0], "transcendentals": [0.0, 0.0, 0.0, 0.0],
        "hbm_bytes": [3 * 2 * 4096.0**2, 4e8, 1e6, 0.0],
        "measured_s": [1e-3, 1e-3, 1e-3, 1e-3],
        "opaque": [False, False, True, False], "joined": [True, True, True, False],
    })


def test_expected_time_on_h100():
    h100 = get_chip("h100")
    r = apply_roofline(_ops(), h100)
    mm, ew, cc, unk = r.itertuples(index=False)
    assert mm.compute_s == pytest.approx(2 * 4096**3 / 9.89e14)
    assert mm.memory_s == pytest.approx(3 * 2 * 4096**2 / 3.35e12)
    assert mm.expected_s == mm.compute_s and mm.bound == "compute"
    assert mm.efficiency == pytest.approx(mm.expected_s / 1e-3)
    assert mm.lost_s == pytest.approx(1e-3 - mm.expected_s)
    assert mm.arithmetic_intensity_flops_per_byte == pytest.approx(4096 / 3)
    assert ew.bound == "memory" and ew.expected_s == pytest.approx(4e8 / 3.35e12)
    assert ew.peak_key == "vector_f32"
    assert cc.bound == "opaque" and np.isnan(cc.expected_s) and np.isnan(cc.lost_s)
    assert unk.bound == "unknown" and np.isnan(unk.expected_s)


def test_projection_changes_expected_not_measured():
    a = apply_roofline(_ops(), get_chip("h100"))
    b = apply_roofline(_ops(), get_chip("b200"))
    assert (a["measured_s"] == b["measured_s"]).all()
    assert b.loc[0, "expected_s"] == pytest.approx(2 * 4096**3 / 2.25e15)
    assert b.loc[0, "expected_s"] < a.loc[0, "expected_s"]
