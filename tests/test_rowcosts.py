"""The op table keeps its cost columns per op (traceroof/rowcosts.py): what is worked out from them must equal,
to the last bit and in the same column order, what stored columns gave. Checked on real fixtures (collectives
included) against the whole table summed the stored-column way, with chunks small enough to split every op."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import traceroof.rowcosts as rowcosts
from tests.conftest import FIXTURES, HOST_CHIP
from traceroof import analyze
from traceroof.optable import build_op_table, per_op
from traceroof.profile import load_profile
from traceroof.discovery import discover


@pytest.fixture(scope="module", params=[("transformer", HOST_CHIP), ("scan_mlp", HOST_CHIP),
                                        ("sharded_mlp", "tpu_v5p")])  # on a TPU's links: modelled collectives
def analysis(request):
    name, chip = request.param
    return analyze(FIXTURES / name, chip=chip)


def test_the_whole_table_adds_the_cost_columns_in_place(analysis) -> None:
    a = analysis
    wide = a.ops
    assert len(wide) == len(a.op_rows) and set(a.op_rows.columns) < set(wide.columns)
    worked = a.row_costs.names()
    assert set(wide.columns) - set(a.op_rows.columns) == set(worked)
    assert "flops" not in a.op_rows and "expected_s" not in a.op_rows  # not stored per row
    # the order every earlier report and CSV had: costs after ``source``, roofline after ``peak_key``
    cols = list(wide.columns)
    assert cols[cols.index("source") + 1: cols.index("source") + 1 + len(rowcosts.ADDITIVE)] == list(rowcosts.ADDITIVE)
    assert cols[cols.index("peak_key") + 1: cols.index("peak_key") + 5] == ["compute_s", "memory_s",
                                                                              "communication_s", "expected_s"]
    # a row's cost is its op's cost per event times its events
    per_event = a.row_costs.per_event["flops"][a.op_rows["op_key"].to_numpy()]
    assert np.array_equal(wide["flops"].to_numpy(), per_event * a.op_rows["events"].to_numpy(np.float64))
    # the roofline's own columns agree with each other
    known = wide["expected_s"].notna()
    assert np.array_equal(wide["lost_s"][known], (wide["measured_s"] - wide["expected_s"])[known])


def test_per_op_sums_equal_the_stored_columns_to_the_last_bit(analysis, monkeypatch) -> None:
    """per_op over the stored rows with their costs == per_op over the whole table (every cost column stored),
    chunked 7 rows at a time so sums run across chunk edges."""
    a = analysis
    monkeypatch.setattr(rowcosts, "CHUNK_ROWS", 7)
    rows = a.op_rows
    at = np.flatnonzero(rows["counted"].to_numpy(bool) & rows["step"].notna().to_numpy(bool))
    narrow = per_op(rows, at, a.row_costs)
    wide = per_op(a.ops, at)
    pd.testing.assert_frame_equal(narrow, wide, check_exact=True)
    assert a.collectives.empty or narrow["comm_s"].sum() > 0  # sharded_mlp: the collective model's time is in
    assert narrow["expected_s"].notna().any() and (narrow["flops"] > 0).any()


@pytest.mark.parametrize("name, chip_name", [("transformer", HOST_CHIP), ("sharded_mlp", "tpu_v5p")])
def test_the_roofline_worked_out_per_op_equals_the_roofline_of_stored_columns(name, chip_name) -> None:
    """The roofline columns RowCosts works out from per-op costs equal apply_roofline's on a table whose cost
    columns are stored (the path of XProf exports, which never goes through RowCosts), value for value."""
    from traceroof.chips import get_chip, per_device_chip
    from traceroof.roofline import ROOFLINE_COLUMNS, apply_roofline

    wide = analyze(FIXTURES / name, chip=chip_name).ops
    worked = [*ROOFLINE_COLUMNS, "peak_flops_per_s", "peak_key"]
    chip = per_device_chip(get_chip(str(chip_name)))[0]
    stored = apply_roofline(wide.drop(columns=worked).copy(), chip)
    for c in worked:
        pd.testing.assert_series_equal(stored[c], wide[c], check_exact=True, check_categorical=False)
    assert (wide["expected_s"] > 0).any()


def test_the_public_op_table_is_the_whole_table() -> None:
    """build_op_table (the library's op table before the roofline) has every cost column, as before."""
    profile = load_profile(discover([FIXTURES / "transformer"]))
    ops, join, _ = build_op_table(profile)
    assert {"flops", "hbm_bytes", "logical_bytes"} <= set(ops.columns) and join.events_joined > 0
    assert ops["flops"].sum() > 0


def test_chunked_sums_add_in_row_order(monkeypatch) -> None:
    """RowCosts.sums == np.bincount of the worked-out column over all rows, bit for bit, though it works out 7
    rows at a time: each chunk's rows are added to the sums so far (a sum of per-chunk partial sums would
    round differently on these random values); of all rows, of some (their columns copied) and of most (every row
    worked out, the others dropped)."""
    rng = np.random.default_rng(0)
    n_ops, n_rows = 5, 400
    costs = rowcosts.RowCosts({c: rng.random(n_ops) * 10 ** rng.uniform(-3, 12, n_ops) for c in rowcosts.ADDITIVE})
    costs = costs.with_communication(rng.random(n_ops) * 1e-3)
    ops = pd.DataFrame({"op_key": rng.integers(0, n_ops, n_rows), "events": rng.integers(1, 1000, n_rows),
                        "executions": rng.random(n_rows) * 100})
    group = ops["op_key"].to_numpy() % 3  # groups that are not the ops
    whole = costs.columns(ops)
    monkeypatch.setattr(rowcosts, "CHUNK_ROWS", 7)
    some, most = (np.flatnonzero(rng.random(n_rows) < share) for share in (0.5, 0.95))  # rows copied; all worked out
    assert len(some) < rowcosts.ALL_ROWS_FROM * n_rows <= len(most)
    for positions in (None, some, most):
        rows = np.arange(n_rows) if positions is None else positions
        every = np.full(n_rows, 3)  # the rows left out: group 3, dropped
        every[rows] = group[rows]
        got = costs.sums(ops, every, 3, positions)
        for c, v in got.items():
            assert np.array_equal(v, np.bincount(group[rows], weights=whole[c][rows], minlength=3)), c
