"""End to end: analyze() on the fixtures; per-step figures checked against independent numbers."""

from __future__ import annotations

import numpy as np
import pytest

from parsers.xspace import read_xspace
from traceroof import analyze
from traceroof.chips import get_chip
from tests.conftest import FIXTURES, HOST_CHIP, facts, fixture_trace_json, fixture_xplane


@pytest.fixture(scope="module")
def transformer():
    return analyze(FIXTURES / "transformer", chip=HOST_CHIP)


@pytest.fixture(scope="module")
def scan():
    return analyze(FIXTURES / "scan_mlp", chip=HOST_CHIP)


def test_every_op_event_joins(transformer, scan):
    for a in (transformer, scan):
        assert a.summary.join.events_joined == a.summary.join.events_total > 500
        # nothing missing or odd; XLA:CPU async thunks (op time running to their `end:` events, ops overlapping)
        assert all("asynchronous thunks" in n or "ops overlapped" in n for n in a.summary.notes), a.summary.notes


def test_warm_up_that_excludes_every_step_is_refused():
    """s37 trial: --warmup-steps 6 on a 6-step profile excluded none, the compiling step included (500 ms against
    193 ms), with exit 0 and a note at the bottom. Asking for more warm-up than there are steps is an error; the
    default of one step on a one-step profile keeps its note."""
    from click.testing import CliRunner

    from parsers.errors import InputError
    from traceroof.cli import main

    n = facts("transformer")["steps_profiled"]
    with pytest.raises(InputError, match=f"--warmup-steps {n} excludes all {n} marked step"):
        analyze(FIXTURES / "transformer", chip=HOST_CHIP, warmup_steps=n)
    r = CliRunner().invoke(main, ["analyze", "fixtures/transformer", "--chip", HOST_CHIP, "--warmup-steps", str(n)])
    assert r.exit_code == 2 and f"pass at most {n - 1}" in r.output
    assert analyze(FIXTURES / "transformer", chip=HOST_CHIP, warmup_steps=n - 1).summary.steps_used == (n - 1,)


def test_steps_from_step_trace_annotations(transformer):
    s = transformer.summary
    assert s.step_annotation == "train" and s.steps_total == facts("transformer")["steps_profiled"]
    assert s.steps_used == (1, 2, 3, 4) and s.warmup_steps == 1
    # the step time is the mean of the marked "train" events, read independently here
    ev = read_xspace(fixture_xplane("transformer")).plane("/host:CPU").events(stats=["step_num"])
    train = ev[(ev["name"] == "train") & ev["step_num"].isin([1, 2, 3, 4])]
    assert s.host_step_time_mean_s == pytest.approx(train["duration_ps"].mean() * 1e-12)
    # the step time is the step's period: from the end of the step before to its own end (a blocking loop's ops
    # end inside their annotation), so the Python time between the annotations counts, as on the wall clock
    ends_ps = ev[(ev["name"] == "train") & ev["step_num"].isin([0, 1, 2, 3, 4])].sort_values("step_num")
    ends_ps = (ends_ps["start_ps"] + ends_ps["duration_ps"]).to_numpy()
    assert s.step_time_mean_s == pytest.approx(np.diff(ends_ps).mean() * 1e-12, rel=1e-9)
    assert s.step_times_s == pytest.approx(tuple(np.diff(ends_ps) * 1e-12), rel=1e-9)
    assert s.step_time_mean_s > s.host_step_time_mean_s


def test_per_step_flops_equal_xla_cost_analysis(transformer):
    # no loop in the transformer step: each step runs the module once
    assert transformer.summary.flops_per_step == pytest.approx(facts("transformer")["xla_cost_analysis"]["flops"],
                                                               rel=0.01)


def test_a_trace_json_alone_counts_a_while_loop_once():
    """Without HLO the while loop's event (``while.14``, holding its body's op events) was counted beside its body:
    op time too high (trial: 218.3 ms per step vs 132.2 ms with the dump). Its ops are the same with and without."""
    (tj,) = (FIXTURES / "scan_mlp").glob("logdir/plugins/profile/*/vm.trace.json.gz")
    alone = analyze(tj, chip=HOST_CHIP)
    with_hlo = analyze(tj, hlo=FIXTURES / "scan_mlp" / "hlo", chip=HOST_CHIP)
    whiles = alone.ops[alone.ops["hlo_op"].astype(str).str.startswith("while")]
    assert len(whiles) and not whiles["counted"].any() and not whiles["joined"].any()
    assert alone.summary.op_time_per_step_s == pytest.approx(with_hlo.summary.op_time_per_step_s)


def test_scan_per_step_flops_equal_analytic_count(scan):
    f = facts("scan_mlp")
    assert scan.summary.flops_per_step == pytest.approx(f["analytic"]["matmul_flops_per_step"], rel=0.02)
    # the body's ops were seen trip-count times per step in the profile itself
    body = scan.ops[(scan.ops["hlo_op"] == "ynn_fusion") & scan.ops["step"].notna()]
    assert body["events"].sum() / len(scan.summary.steps_used) == f["analytic"]["loop_trip_count"]
    # while events are containers: not counted twice
    whiles = scan.ops[scan.ops["opcode"] == "while"]
    assert len(whiles) and not whiles["counted"].any()


def test_layers_and_phases(transformer):
    layers = transformer.layers
    got = set(zip(layers["layer"], layers["phase"]))
    for part in ("attention", "mlp"):  # layer_0 and layer_1 are the same block: one row, two instances
        assert (f"layer_*/{part}", "forward") in got
        assert (f"layer_*/{part}", "backward") in got
    assert ("optimizer", "optimizer") in got
    blocks = layers[layers["layer"].str.startswith("layer_*/")]
    assert (blocks["instances"] == 2).all()
    assert (blocks["instance_min_s"] <= blocks["instance_median_s"]).all()
    assert (blocks["instance_median_s"] <= blocks["instance_max_s"]).all()
    assert (blocks["instance_min_s"] + blocks["instance_max_s"]).to_numpy() == pytest.approx(
        blocks["time_per_step_s"].to_numpy())
    others = layers[~layers["layer"].str.startswith("layer_*/")]
    assert (others["instances"] == 1).all() and others["instance_median_s"].isna().all()
    # the rollup is a view of the op table
    counted = transformer.ops[transformer.ops["counted"] & transformer.ops["step"].notna()]
    assert layers["time_per_step_s"].sum() == pytest.approx(counted["measured_s"].sum() / 4)


def test_expand_keeps_instances_and_their_flops():
    layers = analyze(FIXTURES / "transformer", chip=HOST_CHIP, expand=True).layers
    got = set(zip(layers["layer"], layers["phase"]))
    for i in (0, 1):
        for part in ("attention", "mlp"):
            assert (f"layer_{i}/{part}", "forward") in got
            assert (f"layer_{i}/{part}", "backward") in got
    # layer FLOPs: the matmul count of the generator within 5 % (elementwise work on top)
    analytic = facts("transformer")["analytic"]["matmul_flops_per_layer"]
    per_layer = layers.groupby("layer")["flops_per_step"].sum()
    for name, flops in analytic.items():
        assert per_layer[name] == pytest.approx(flops, rel=0.05), name


def test_depth_one_merges_attention_and_mlp():
    a = analyze(FIXTURES / "transformer", chip=HOST_CHIP, depth=1)
    assert {"layer_*", "head", "optimizer"} <= set(a.layers["layer"])


def test_roofline_columns_consistent(transformer):
    ops = transformer.ops[transformer.ops["joined"] & ~transformer.ops["opaque"]]
    assert np.allclose(ops["expected_s"], np.maximum(ops["compute_s"], ops["memory_s"]))
    assert np.allclose(ops["lost_s"], ops["measured_s"] - ops["expected_s"])
    mm = ops[ops["category"] == "matmul"]
    assert (mm["peak_key"] == "f32").all()
    s = transformer.summary
    peak = get_chip(HOST_CHIP).peak_for("f32")[0]
    assert s.hfu == pytest.approx(s.flops_per_step / s.step_time_mean_s / peak)
    assert s.mfu == pytest.approx(s.model_flops_per_step / s.step_time_mean_s / peak)


def test_chip_projection_changes_expected_only(transformer):
    h100 = analyze(FIXTURES / "transformer", chip="h100")
    assert h100.summary.chip_id == "h100"
    assert h100.summary.step_time_mean_s == transformer.summary.step_time_mean_s
    assert h100.summary.flops_per_step == transformer.summary.flops_per_step
    assert h100.summary.expected_per_step_s < transformer.summary.expected_per_step_s / 100


def test_top_ops_sorted_by_median_lost_time(transformer):
    top = transformer.top_ops
    assert len(top) == 10
    assert list(top["median_lost_per_step_s"]) == sorted(top["median_lost_per_step_s"], reverse=True)
    assert {"opcode", "category", "shape", "bound", "median_s", "p90_s", "spread"} <= set(top.columns)
    assert (top["median_s"] <= top["p90_s"]).all() and (top["spread"] >= 1).all()
    # the median of one op, read independently from its executions
    first = top.iloc[0]
    runs = transformer.ops[(transformer.ops["hlo_op"] == first["hlo_op"]) & transformer.ops["counted"]
                           & transformer.ops["step"].notna()]["measured_s"].sort_values().to_numpy()
    assert first["median_s"] == runs[(len(runs) - 1) // 2]  # inverted CDF: the lower middle execution


def test_one_slow_execution_is_flagged_not_ranked_worst(transformer):
    from traceroof.findings import FindingInputs
    from traceroof.findings.rules_system import outlier_executions
    from traceroof.optable import per_op
    from traceroof.opstats import execution_stats, top_ops

    counted = transformer.ops[transformer.ops["counted"] & transformer.ops["step"].notna()].copy()
    per = transformer.per_step_divisor
    before = top_ops(counted, per, 1000)
    # an op of about 90 µs per run, outside the top 3, with one execution made 16 ms (a preempted run)
    ranked = before.iloc[3:].assign(gap=(before["median_s"] - 90e-6).abs())
    victim = ranked[ranked["executions_per_step"] >= 1].sort_values("gap").iloc[0]
    assert 20e-6 < victim["median_s"] < 500e-6 and victim["outlier_executions"] == 0
    key = (victim["module"], victim["hlo_op"])
    rows = counted.index[(counted["module"] == key[0]) & (counted["hlo_op"] == key[1])]
    assert len(rows) >= 4
    counted.loc[rows[1], "measured_s"] = 16e-3
    counted.loc[rows[1], "lost_s"] = 16e-3 - counted.loc[rows[1], "expected_s"]
    stats = execution_stats(counted)
    after = top_ops(counted, per, 1000, stats).set_index(["module", "hlo_op"])
    # by its total (mean) lost time the op would now be the worst; by its median it is not
    assert after["lost_per_step_s"].idxmax() == key
    assert after.index[0] != key and after.index.get_loc(key) > 2
    row = after.loc[key]
    assert row["outlier_executions"] == 1 and row["median_s"] == pytest.approx(victim["median_s"], rel=0.5)
    (f,) = outlier_executions(FindingInputs(transformer, per_op(counted), stats=stats))
    assert f.code == "outlier-executions" and f.ops[0] == victim["hlo_op"] and "(--warmup-steps)" in f.advice
    assert f.lost_per_step_s == pytest.approx((16e-3 - victim["median_s"]) / per, rel=0.3)  # the one slow run
    clean = transformer.ops[transformer.ops["counted"] & transformer.ops["step"].notna()]
    assert outlier_executions(FindingInputs(transformer, per_op(clean), stats=execution_stats(clean))) == []


def test_event_quantiles_match_the_weighted_ones():
    """execution_stats' per-op order statistics of one sample per event (partition per op) equal those of the
    general weighted path (one sort of all samples), outlier counts included, on random durations with ties,
    zeros, negatives and ops without samples."""
    from traceroof.opstats import OUTLIER_RATIO, _event_quantiles, _grouped_quantiles

    rng = np.random.default_rng(4)
    for case in range(2000):
        n_ops, n = int(rng.integers(1, 8)), int(rng.integers(1, 60))
        op = rng.integers(0, n_ops, n)
        scale = int(rng.choice([3, 100, 10**6, 10**11]))
        duration = rng.integers(-scale if case % 7 == 0 else 0, scale, n)
        if case % 3 == 0:
            duration[rng.integers(0, n)] = duration.max() * int(rng.integers(5, 30))
        skip = rng.random(n) < 0.2  # events of no op (rows not read): code n_ops
        q, mx, total, mid, far = _event_quantiles(np.where(skip, n_ops, op), duration, n_ops, (0.5, 0.9))
        op, duration, n = op[~skip], duration[~skip], int((~skip).sum())
        t, w = duration.astype(np.float64) * 1e-12, np.ones(n)
        q_ref, mx_ref, total_ref, mid_ref = _grouped_quantiles(op, t, w, n_ops, (0.5, 0.9))
        far_ref = np.bincount(op, weights=np.where(t > OUTLIER_RATIO * q_ref[0.5][op], w, 0.0), minlength=n_ops)
        for got, want in ((q[0.5], q_ref[0.5]), (q[0.9], q_ref[0.9]), (mx, mx_ref), (total, total_ref),
                          (mid, mid_ref), (far, far_ref)):
            np.testing.assert_array_equal(got, want)


def test_execution_stats_keys_ops_by_module_program_and_name():
    """execution_stats' ops are the (module, program id, HLO op) of the rows read, whatever the columns' codes:
    several programs, missing names (written "nan", beside a module named "nan": two ops alike in text, in order
    of first appearance), rows outside ``at``, multi-kernel rows without a device (an op without samples), an
    index that is not the rows' positions, many categories; against order statistics of each op's events taken
    one by one."""
    import pandas as pd

    from traceroof.aggregate import Timeline
    from traceroof.opstats import OUTLIER_RATIO, execution_stats

    rng = np.random.default_rng(7)
    for case in range(40):
        n_rows = int(rng.integers(1, 300))
        module = pd.Categorical.from_codes(rng.integers(-1, 3, n_rows), categories=["b", "nan", "a"])
        names = [f"op{i}" for i in range(70_000 if case % 5 == 0 else 5)]  # many: rows grouped, no key table
        hlo_op = pd.Categorical.from_codes(rng.integers(-1, 5, n_rows), categories=names)
        pid = pd.array(rng.choice([7, 3, 10**12], n_rows) if case % 2 else np.full(n_rows, 5), "Int64")
        pid[rng.random(n_rows) < 0.1] = pd.NA
        kernels = np.where(rng.random(n_rows) < (0.1 if case else 1.0), 2.0, 1.0)  # case 0: no op sampled
        counted = pd.DataFrame({"module": module, "program_id": pid, "hlo_op": hlo_op,
                                "kernels_per_execution": kernels, "device": pd.array([None] * n_rows, "string")},
                               index=np.arange(n_rows) * 3 + 2 if case % 3 == 0 else None)
        at = np.flatnonzero(rng.random(n_rows) < 0.8) if case % 4 else None
        n_ev = int(rng.integers(1, 2000))
        timeline = Timeline(rng.choice(counted.index.to_numpy(), n_ev), np.zeros(n_ev, np.int64),
                            rng.integers(1, 10**6, n_ev) * int(rng.choice([1, 10**6])))
        if at is not None and not len(at):
            continue
        got = execution_stats(counted, timeline, at)
        # the reference: ops in order of first appearance among the rows read, then sorted by their text
        read = counted.iloc[at] if at is not None else counted
        ident = list(zip(read["module"].cat.codes, read["program_id"].fillna(-1), read["hlo_op"].cat.codes))
        ops = list(dict.fromkeys(ident))
        text = [(str(read["module"].cat.categories[m]) if m >= 0 else "nan", int(p),
                 f"op{h}" if h >= 0 else "nan") for m, p, h in ops]
        order = sorted(range(len(ops)), key=lambda i: text[i])  # stable: alike texts keep first appearance
        assert list(got.index) == [text[i] for i in order]
        label_op = {label: ops.index(k) for label, k, kpe in zip(read.index, ident, read["kernels_per_execution"])
                    if kpe <= 1}
        for row, i in zip(got.itertuples(), order):
            x = np.sort([d for r, d in zip(timeline.row, timeline.duration_ps) if label_op.get(r) == i])
            assert row.samples == len(x)
            if not len(x):
                assert np.isnan(row.median_s) and row.outlier_executions == 0
                continue
            at_q = [max(int(np.ceil(q * len(x) - 1e-9 * len(x))), 1) - 1 for q in (0.5, 0.9)]
            assert (row.median_s, row.p90_s, row.max_s) == (x[at_q[0]] * 1e-12, x[at_q[1]] * 1e-12, x[-1] * 1e-12)
            far = int(np.sum(x * 1e-12 > OUTLIER_RATIO * row.median_s)) if len(x) >= 3 else 0
            assert row.outlier_executions == far


def test_execution_stats_weights_multi_kernel_samples_by_their_executions():
    """Multi-kernel rows (GPU: kernels_per_execution > 1) with a device give one sample per (op, device, step):
    the step's time ÷ its executions, weighted by those executions; a single-kernel op beside them gives one
    sample per event. Expected figures worked out by hand, and as numpy's inverted_cdf quantiles of the samples
    repeated by their (whole) weights."""
    import pandas as pd

    from traceroof.aggregate import Timeline
    from traceroof.opstats import execution_stats

    # op "a": (device, step, measured_s, executions) per row; two kernels' rows share (d0, 0); a row without a
    # step is a step of its own; a row without a device gives no sample; the last row is outside ``at``
    a_rows = [("d0", 0, 0.004, 1.0), ("d0", 0, 0.002, 1.0), ("d0", 1, 0.002, 1.0), ("d1", 0, 0.040, 4.0),
              ("d1", 1, 0.001, 1.0), ("d1", None, 0.5, 1.0), (None, 1, 9.0, 1.0), ("d0", 2, 7.0, 1.0)]
    b_durations_ps = [300, 100, 200]  # op "b": one kernel per execution, one event each
    n_a = len(a_rows)
    counted = pd.DataFrame({
        "module": pd.Categorical(["m"] * (n_a + 1)), "program_id": pd.array([1] * (n_a + 1), "Int64"),
        "hlo_op": pd.Categorical(["a"] * n_a + ["b"]),
        "kernels_per_execution": [2.0] * n_a + [1.0],
        "device": pd.array([r[0] for r in a_rows] + ["d0"], "string"),
        "step": pd.array([r[1] for r in a_rows] + [0], "Int64"),
        "measured_s": [r[2] for r in a_rows] + [600e-12],
        "executions": [r[3] for r in a_rows] + [3.0]})
    at = np.arange(n_a + 1)[np.arange(n_a + 1) != n_a - 1]
    rows = np.array([0, 3, 8, 8, 8])  # op a's events are not samples: its kernels are not executions
    timeline = Timeline(rows, np.zeros(len(rows), np.int64), np.array([5, 7] + b_durations_ps, np.int64))
    got = execution_stats(counted, timeline, at)
    assert list(got.index) == [("m", 1, "a"), ("m", 1, "b")]
    # op a's samples: (d0, 0) (0.004 + 0.002) / 2 weight 2, (d0, 1) 0.002, (d1, 0) 0.04 / 4 weight 4,
    # (d1, 1) 0.001, (d1, no step) 0.5: by time 0.001, 0.002, 0.003 (x2), 0.01 (x4), 0.5; weight 9
    t = np.array([(0.004 + 0.002) / 2, 0.002, 0.040 / 4, 0.001, 0.5])
    w = np.array([2, 1, 4, 1, 1])
    a = got.loc[("m", 1, "a")]
    assert a["samples"] == 9
    assert a["median_s"] == 0.040 / 4  # the first sample whose cumulative weight (1, 2, 4, 8) reaches 4.5
    assert a["p90_s"] == 0.5 and a["max_s"] == 0.5  # cumulative weight 9 >= 8.1 only at the last
    assert a["spread"] == 0.5 / (0.040 / 4)
    assert a["midpoint_median_s"] == (0.002 + 0.004) / 2  # unweighted: the middle of 5 samples
    assert a["outlier_executions"] == 1  # 0.5 s > 10 x 0.01 s, weight 1
    repeated = np.repeat(t, w)
    assert a["median_s"] == np.quantile(repeated, 0.5, method="inverted_cdf")
    assert a["p90_s"] == np.quantile(repeated, 0.9, method="inverted_cdf")
    b = got.loc[("m", 1, "b")]
    assert (b["samples"], b["median_s"], b["p90_s"], b["max_s"]) == (3, 200e-12, 300e-12, 300e-12)
    assert b["midpoint_median_s"] == 200e-12 and b["outlier_executions"] == 0


def test_trace_json_gives_the_same_op_times(transformer):
    a = analyze(fixture_trace_json("transformer"), hlo=[FIXTURES / "transformer" / "hlo"], chip=HOST_CHIP)
    assert a.summary.join.events_total == transformer.summary.join.events_total
    # trace JSON has no flow stats (async thunk ends): the last op of a step may end a little earlier
    assert a.summary.step_time_mean_s == pytest.approx(transformer.summary.step_time_mean_s, rel=0.02)
    assert a.summary.flops_per_step == pytest.approx(transformer.summary.flops_per_step)


def test_no_hlo_gives_a_partial_report():
    a = analyze(fixture_trace_json("scan_mlp"), chip=HOST_CHIP)  # trace JSON carries no HLO
    assert a.summary.join.events_joined == 0
    assert any("no usable HLO" in n for n in a.summary.notes)
    assert a.summary.step_time_mean_s > 0 and np.isnan(a.ops["expected_s"]).all()


@pytest.mark.parametrize("name", ["transformer", "scan_mlp"])
def test_embedded_hloproto_gives_the_same_report_as_text_dumps(name):
    bare = analyze(fixture_xplane(name), chip=HOST_CHIP)  # a bare .xplane.pb: HLO from /host:metadata
    dumps = analyze(FIXTURES / name, chip=HOST_CHIP)
    assert bare.summary.join.events_joined == bare.summary.join.events_total
    assert bare.summary.flops_per_step == dumps.summary.flops_per_step
    assert bare.summary.hbm_bytes_per_step == dumps.summary.hbm_bytes_per_step
    cols = ["layer", "phase", "flops_per_step", "hbm_bytes_per_step", "expected_per_step_s"]
    assert bare.layers[cols].equals(dumps.layers[cols])


def test_cpu_profile_defaults_to_calibrated_host(monkeypatch, tmp_path):
    import traceroof.chips as chips

    cached = tmp_path / "host.toml"
    cached.write_text(open(HOST_CHIP).read())
    monkeypatch.setattr(chips, "host_cache_path", lambda: cached)
    import traceroof.analysis as analysis

    monkeypatch.setattr(analysis, "host_cache_path", lambda: cached)
    a = analyze(FIXTURES / "scan_mlp")
    assert a.summary.chip_name == "calibrated host" and "calibration" in a.summary.chip_note


def test_modules_with_the_same_op_names_are_not_mixed(transformer):
    # instruction names repeat across modules (copy.1 etc.): each event joins within its own program id
    ops = transformer.ops[transformer.ops["joined"]]
    assert ops.groupby("hlo_op", observed=True)["program_id"].nunique().max() == 1


def test_several_hosts_in_one_run_are_all_read(tmp_path):
    import shutil

    run = tmp_path / "logdir" / "plugins" / "profile" / "2026_01_01_00_00_00"
    run.mkdir(parents=True)
    src = fixture_xplane("scan_mlp")
    shutil.copy(src, run / "host_a.xplane.pb")
    shutil.copy(src, run / "host_b.xplane.pb")
    one = analyze(src, chip=HOST_CHIP)
    two = analyze(tmp_path / "logdir", chip=HOST_CHIP)
    assert set(two.ops["host"].astype(str)) == {"host_a", "host_b"} and two.ops["device"].nunique() == 2
    assert two.summary.join.events_total == 2 * one.summary.join.events_total
    assert two.summary.flops_per_step == pytest.approx(one.summary.flops_per_step)  # per device


def test_logdir_reads_the_latest_run(tmp_path):
    """The latest run of a logdir is read, from the logdir or from its plugins/profile folder (which exited 2), and
    a note names the runs left out (a user's MoE run was skipped for a later UNet run in silence: s30 trial)."""
    import shutil

    old = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
    new = tmp_path / "plugins" / "profile" / "2026_02_01_00_00_00"
    old.mkdir(parents=True)
    new.mkdir(parents=True)
    (old / "h.xplane.pb").write_bytes(b"garbage")
    shutil.copy(fixture_xplane("scan_mlp"), new / "h.xplane.pb")
    a = analyze(tmp_path, chip=HOST_CHIP)
    assert a.summary.input.endswith("2026_02_01_00_00_00")
    shutil.copy(fixture_xplane("scan_mlp"), old / "h.xplane.pb")
    for given in (tmp_path, tmp_path / "plugins" / "profile"):  # the logdir, or the folder of its runs
        b = analyze(given, chip=HOST_CHIP)
        assert b.summary.input.endswith("2026_02_01_00_00_00")
        (note,) = [n for n in b.summary.notes if "other run" in n]
        assert "1 other run(s) with profiles (2026_01_01_00_00_00): only the latest was analyzed" in note


def test_unknown_opcodes_are_reported_not_fatal(tmp_path):
    import shutil

    fx = tmp_path / "fx"
    shutil.copytree(FIXTURES / "scan_mlp", fx)
    dump = next((fx / "hlo").glob("*jit_train_step*"))
    text = dump.read_text().replace("= f32[256,512]{1,0} copy(", "= f32[256,512]{1,0} my-future-copy(", 1)
    dump.write_text(text)
    a = analyze(fx, chip=HOST_CHIP)
    assert any("my-future-copy" in n for n in a.summary.notes)
    assert a.summary.join.events_joined == a.summary.join.events_total


MULTIHOST = FIXTURES / "multihost_dp8" / "logdir"  # a real 2-process JAX job: 2 hosts x 4 CPU devices, gloo


@pytest.fixture(scope="module")
def multihost():
    return analyze(MULTIHOST, chip=HOST_CHIP)


def _multihost_files() -> tuple:
    (run,) = (MULTIHOST / "plugins" / "profile").iterdir()
    return run, run / "host0.xplane.pb", run / "host1.xplane.pb"


def test_a_step_on_two_hosts_lasts_what_each_host_measures(multihost):
    """A step annotated on both hosts lasted from the earliest start to the latest end over them: the hosts' clock
    offset stretched it (trial: 48.98 ms of annotations where each host measured 43.3 and 43.8 ms; a device step
    time of 272.4 ms in the note against 262.9 ms in the header). Now the mean of each host's own figures."""
    _, host0, host1 = _multihost_files()
    alone = [analyze(p, chip=HOST_CHIP).summary for p in (host0, host1)]
    s = multihost.summary
    assert s.steps_used == alone[0].steps_used == alone[1].steps_used
    assert s.host_step_time_mean_s == pytest.approx(sum(a.host_step_time_mean_s for a in alone) / 2)
    from parsers.xspace import SCHEMA  # the annotations as protobuf decodes them, not traceroof's reader

    def annotation_ps(path, step: int) -> int:
        xs = SCHEMA["XSpace"]()
        xs.ParseFromString(path.read_bytes())
        (plane,) = [p for p in xs.planes if p.name == "/host:CPU"]
        num = next(k for k, m in plane.stat_metadata.items() if m.name == "step_num")
        (d,) = [e.duration_ps for line in plane.lines for e in line.events
                if plane.event_metadata[e.metadata_id].name == "train"
                and any(x.metadata_id == num and x.int64_value == step for x in e.stats)]
        return d

    raw = [annotation_ps(f, k) for f in (host0, host1) for k in s.steps_used]
    assert s.host_step_time_mean_s == pytest.approx(sum(raw) / len(raw) * 1e-12)
    (note,) = [n for n in s.notes if n.startswith("device step time")]
    assert f"{s.step_time_mean_s * 1e3:.3f} ms differs" in note


def test_a_two_host_run_says_two_hosts(multihost):
    """A user's 2-process job (host0.xplane.pb + host1.xplane.pb, an all-reduce over gloo TCP) was reported as '8
    device(s) on one host' with no host count, its collectives said to 'share one memory'."""
    import json

    from traceroof.report import render

    s = multihost.summary
    assert multihost.topology == multihost.parallelism.topology == "8 device(s) on 2 hosts"
    assert (s.devices, s.hosts) == (8, 2)
    assert json.loads(render(multihost, "json"))["summary"]["hosts"] == 2
    assert "8 device(s) with op events on 2 hosts" in render(multihost, "terminal")
    assert "8 device(s) on 2 hosts;" in render(multihost, "summary")
    assert not any("share one memory" in n or "profiles are missing" in n for n in s.notes)
    assert any(n.startswith("collectives between CPU devices on 2 hosts cross processes") for n in s.notes)
    (coll,) = [f for f in multihost.findings if f.code == "exposed-collective"]
    assert "across 2 hosts" in coll.advice and "on shared cores" not in coll.advice


def test_a_missing_host_is_named(multihost, tmp_path):
    """One host's file alone, or a run directory that lost a host's file, read as a whole 4-device job: the
    program's all-reduce spans 8 devices. Per-device figures stay; a note says what is missing."""
    import shutil

    _, host0, host1 = _multihost_files()
    run = tmp_path / "logdir" / "plugins" / "profile" / "2026_11_24_08_45_11"
    run.mkdir(parents=True)
    shutil.copy(host0, run)
    for path, host in ((host1, "host1"), (tmp_path / "logdir", "host0")):
        a = analyze(path, chip=HOST_CHIP)
        (note,) = [n for n in a.summary.notes if "profiles are missing" in n]
        assert note.startswith(f"the program runs on 8 devices but the profile holds op events of 4 (host {host})")
        assert note.endswith("analyze the whole run directory")
        assert a.topology == "8 device(s) on 2 hosts"
        assert (a.summary.devices, a.summary.hosts) == (4, 1)
        assert a.summary.flops_per_step == pytest.approx(multihost.summary.flops_per_step)  # per device


def test_a_capture_split_over_two_run_directories_names_the_other(tmp_path):
    """Hosts that stop their traces in different seconds are written to two run directories; a logdir is read
    at its latest run only, which held half the devices and said nothing of the run 1 s earlier."""
    import shutil

    _, host0, host1 = _multihost_files()
    profile = tmp_path / "plugins" / "profile"
    early, late, old = (profile / n for n in ("2026_11_24_08_29_47", "2026_11_24_08_29_48", "2026_11_24_08_20_00"))
    for run, src in ((early, host0), (late, host1), (old, host0)):
        run.mkdir(parents=True)
        shutil.copy(src, run)
    a = analyze(tmp_path, chip=HOST_CHIP)
    assert a.summary.input == str(late) and a.summary.devices == 4
    (note,) = [n for n in a.summary.notes if "profiles are missing" in n]
    assert f"run {early}, written within 10 s" in note and note.endswith("pass both run directories")
    assert str(old) not in note  # 8 minutes earlier: another capture
    both = analyze([early, late], chip=HOST_CHIP)
    assert (both.summary.devices, both.summary.hosts) == (8, 2)
    assert not any("profiles are missing" in n for n in both.summary.notes)


def test_outlier_executions_on_virtual_cpu_devices_claim_no_time():
    """On virtual CPU devices (threads of one host sharing its cores) a run that waited for the cores looks
    slow: the s40 trial's 8 devices on 2 cores ranked outlier-executions first, "high", 184 ms lost per step that
    no change to the program wins. The op table shows the same outliers; the finding says where they come from and
    claims no time. On one device (the transformer fixture's outlier, test above) it keeps its time."""
    from traceroof import analyze

    a = analyze(str(FIXTURES / "par_dp8" / "logdir"), chip=str(FIXTURES / "fixture_host.toml"))
    assert a.summary.virtual_devices and a.summary.devices == 8
    assert (a.top_ops["outlier_executions"] > 0).any()  # the case at hand: runs more than 10x their op's median
    (f,) = [f for f in a.findings if f.code == "outlier-executions"]
    assert f.title.endswith("on virtual CPU devices") and "threads sharing the host's cores" in f.advice
    assert np.isnan(f.lost_per_step_s) and f.severity == "info"
