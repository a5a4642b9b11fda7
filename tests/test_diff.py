"""traceroof diff: the same model recorded twice is no regression; a 2x wider MLP is located in the MLP layers
with the FLOPs ratio the change implies; JSON baselines; renamed scopes; the gate's exit codes."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from traceroof import analyze
from traceroof.diff import diff, gate, load_side, side_from_analysis
from traceroof.report.diff import render_diff_json
from traceroof.report.text import header_lines
from traceroof.units import fmt_time
from tests.conftest import FIXTURES, HOST_CHIP, ROOT, facts


@pytest.fixture(scope="module")
def sides():
    return {name: load_side(FIXTURES / name, chip=HOST_CHIP) for name in ("diff_base", "diff_rerun", "diff_wide")}


def test_same_model_twice_is_not_a_regression(sides):
    r = diff(sides["diff_base"], sides["diff_rerun"])
    assert r.unmatched.empty and (r.ops["matched_by"] == "identity").all()
    assert (r.ops["flops_per_step_delta"] == 0).all()
    assert r.step.noise, r.contributors[0]
    assert gate(r, 5.0) == (False, f"step time {r.step.delta_pct * 100:+.1f}% (within noise)")


def test_wider_mlp_regression_is_located_in_the_mlp(sides):
    r = diff(sides["diff_base"], sides["diff_wide"])
    assert not r.step.noise and r.step.delta_s > 0
    failed, why = gate(r, 5.0)
    assert failed and why == f"step time {r.step.delta_pct * 100:+.1f}% (above the +5% limit)"
    # the other way round the step is faster: a capture's "-6.3% (limit 5%)" read like a failure
    back = diff(sides["diff_wide"], sides["diff_base"])
    assert gate(back, 5.0) == (False, f"step time {back.step.delta_pct * 100:+.1f}% (within the +5% limit)")
    assert back.step.delta_pct < 0
    ratio = facts("diff_wide")["config"]["d_ff"] / facts("diff_base")["config"]["d_ff"]
    layers = r.layers.set_index(["layer", "phase"])
    for block in ("block_0", "block_1"):
        for phase in ("forward", "backward"):
            row = layers.loc[(f"{block}/mlp", phase)]
            assert row["flops_ratio"] == pytest.approx(ratio, rel=0.01)
            assert row["time_per_step_s_delta"] > 0
    # the norm layers' work does not change
    for block in ("block_0", "block_1"):
        assert layers.loc[(f"{block}/norm", "forward"), "flops_ratio"] == pytest.approx(1.0)
    top = r.layers.head(4)
    assert set(top["layer"]) == {"block_0/mlp", "block_1/mlp"}
    assert all("mlp" in c for c in r.contributors[2:5])  # after the verdict and the work line
    assert gate(r, 5.0, layer="block_0/mlp")[0]
    assert not gate(r, 200.0, layer="block_0/norm")[0]


def test_other_work_per_step_gets_a_time_per_flop_line(sides, tmp_path):
    """A user's doubled batch was judged per step only ("slower" for twice the work in less than twice the time):
    when the steps do different work, a line gives the change of time per FLOP and the throughput. The work ratio
    is checked against the generator's analytic matmul FLOPs (2 x the hidden width; the norms' few FLOPs do not
    grow), and the same model twice gets no such line."""
    from traceroof.diff import work_ratio

    analytic = (facts("diff_wide")["analytic"]["matmul_flops_per_step"]
                / facts("diff_base")["analytic"]["matmul_flops_per_step"])
    assert analytic == 2.0
    ratio = work_ratio(sides["diff_base"], sides["diff_wide"])
    assert ratio == pytest.approx(analytic, rel=0.01)
    r = diff(sides["diff_base"], sides["diff_wide"])
    per_flop = r.step.new_s / ratio / r.step.base_s - 1
    work = r.contributors[1]
    assert work.startswith(f"work per step x{ratio:.2f} (FLOPs, all devices): time per FLOP {per_flop:+.1%}, ")
    assert f"(throughput x{1 / (1 + per_flop):.2f})" in work
    back = diff(sides["diff_wide"], sides["diff_base"]).contributors[1]
    assert back.startswith(f"work per step x{1 / ratio:.2f}") and f"time per FLOP {1 / (1 + per_flop) - 1:+.1%}" in back
    rerun = diff(sides["diff_base"], sides["diff_rerun"])
    assert work_ratio(sides["diff_base"], sides["diff_rerun"]) == 1.0
    assert not any(c.startswith("work per step") for c in rerun.contributors)
    out = tmp_path / "d.json"
    subprocess.run([sys.executable, "-m", "traceroof.cli", "diff", str(FIXTURES / "diff_base"),
                    str(FIXTURES / "diff_wide"), "--chip", str(HOST_CHIP), "--format", "json", "-o", str(out)],
                   check=True, cwd=ROOT)
    doc = json.loads(out.read_text())
    assert doc["work_ratio"] == pytest.approx(analytic, rel=0.01)
    assert doc["contributors"][1].startswith("work per step x2.00")


def test_diff_wide_prints_every_cell_in_full():
    """`analyze --wide` existed and `diff --wide` was refused; the diff's op table shortened shapes and the match
    pass ("scope (sha…s changed)")."""
    cmd = [sys.executable, "-m", "traceroof.cli", "diff", str(FIXTURES / "diff_base"), str(FIXTURES / "diff_wide"),
           "--chip", str(HOST_CHIP)]
    short = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    wide = subprocess.run(cmd + ["--wide"], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "…" in short and "…" not in wide
    assert "scope (shapes changed)" in wide and "f32[256,512] -> f32[256,1024]" in wide


def test_json_report_is_a_baseline(tmp_path):
    from traceroof.report import render

    a = analyze(FIXTURES / "diff_base", chip=HOST_CHIP)
    f = tmp_path / "base.json"
    f.write_text(render(a, "json"))
    from_json = diff(load_side(f), load_side(FIXTURES / "diff_wide", chip=HOST_CHIP))
    from_profile = diff(side_from_analysis(a, "base"), load_side(FIXTURES / "diff_wide", chip=HOST_CHIP))
    cols = ["layer", "phase", "time_per_step_s_delta", "flops_ratio"]
    assert from_json.layers[cols].round(12).equals(from_profile.layers[cols].round(12))
    assert from_json.step.delta_s == pytest.approx(from_profile.step.delta_s)
    assert len(from_json.ops) == len(from_profile.ops)


def test_renamed_scope_is_matched_by_shape(sides):
    base = sides["diff_base"]
    renamed = base.op_stats.copy()
    for col in ("layer", "scope"):
        renamed[col] = renamed[col].astype(str).str.replace("block_1/norm", "block_1/rmsnorm")
    new = type(base)(**{**base.__dict__, "op_stats": renamed})
    r = diff(base, new)
    moved = r.ops[r.ops["matched_by"] == "shape (scope renamed)"]
    assert len(moved) and r.unmatched.empty


def test_other_chip_changes_expectations_not_times(sides):
    h100 = load_side(FIXTURES / "diff_base", chip="h100")
    r = diff(sides["diff_base"], h100)
    assert r.step.delta_s == 0 and r.step.noise
    assert (r.layers["time_per_step_s_delta"] == 0).all()
    assert (r.layers["expected_per_step_s_delta"] < 0).all()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "traceroof.cli", "diff", *args], capture_output=True, text=True,
                          cwd=ROOT)


def test_cli_exit_codes_and_json(tmp_path):
    ok = _cli("fixtures/diff_base", "fixtures/diff_rerun", "--chip", HOST_CHIP, "--fail-above", "5",
              "--format", "json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["gate"]["failed"] is False and doc["step"]["noise"] is True
    bad = _cli("fixtures/diff_base", "fixtures/diff_wide", "--chip", HOST_CHIP, "--fail-above", "5")
    assert bad.returncode == 1 and "regression" in bad.stderr and "block_" in bad.stdout
    missing = _cli("fixtures/diff_base", str(tmp_path / "nope"), "--chip", HOST_CHIP)
    assert missing.returncode == 2 and missing.stderr.startswith("traceroof: error:")
    junk = tmp_path / "junk.json"
    junk.write_text('{"a": 1}')
    wrong = _cli(str(junk), "fixtures/diff_base", "--chip", HOST_CHIP)
    assert wrong.returncode == 2 and "op_stats" in wrong.stderr and "Traceback" not in wrong.stderr
    nolayer = _cli("fixtures/diff_base", "fixtures/diff_wide", "--chip", HOST_CHIP, "--fail-above", "5",
                   "--layer", "nope")
    assert nolayer.returncode == 2


def test_dumps_of_another_program_are_named_not_dropped(tmp_path):
    """s36 trial: diff --hlo-new with another variant's dump exited 0 with the dump silently unused (analyze notes
    it; diff showed no analysis notes). The figures stay the profile's own HLO's; the note names the option."""
    args = ("fixtures/diff_base", "fixtures/diff_rerun", "--hlo-new", "fixtures/scan_mlp/hlo", "--chip", HOST_CHIP)
    text = _cli(*args)
    assert text.returncode == 0, text.stderr
    assert "note (new): the HLO given (--hlo-new) describes none of the profiled programs" in text.stdout
    doc = json.loads(_cli(*args, "--format", "json").stdout)
    assert doc["input_notes"]["base"] == [] and len(doc["input_notes"]["new"]) == 1
    plain = json.loads(_cli(*args[:2], "--chip", HOST_CHIP, "--format", "json").stdout)
    assert plain["input_notes"] == {"base": [], "new": []} and plain["step"] == doc["step"]
    from traceroof.report import render  # a saved report keeps the note it was written with

    saved = tmp_path / "base.json"
    saved.write_text(render(analyze(FIXTURES / "diff_base", hlo=FIXTURES / "scan_mlp" / "hlo", chip=HOST_CHIP),
                            "json"))
    assert load_side(saved).input_notes[0].startswith("the HLO given (--hlo) describes none")


def test_a_host_left_out_of_one_side_is_named(tmp_path):
    """A run directory whose host1 file is truncated (a partial report of host0) compared with the whole run: the
    diff says the new side covers one host of two."""
    import shutil

    run = tmp_path / "logdir" / "plugins" / "profile" / "run"
    shutil.copytree(next((FIXTURES / "multihost_dp8" / "logdir" / "plugins" / "profile").iterdir()), run)
    host1 = run / "host1.xplane.pb"
    host1.write_bytes(host1.read_bytes()[: host1.stat().st_size // 2])
    r = _cli("fixtures/multihost_dp8/logdir", str(run), "--chip", HOST_CHIP, "--format", "json")
    assert r.returncode == 0, r.stderr
    notes = json.loads(r.stdout)["input_notes"]
    assert notes["base"] == [] and len(notes["new"]) == 1
    assert notes["new"][0].startswith("PARTIAL: 1 of 2 hosts' profiles cannot be read") and "host1" in notes["new"][0]


def test_collectives_match_on_kind_and_group():
    a = analyze(FIXTURES / "sharded_mlp", chip=HOST_CHIP)
    stats = a.op_stats
    groups = set(stats.loc[stats["category"] == "collective", "collective_group"])
    assert {"all-gather/4x2", "all-to-all/2x4"} <= groups
    r = diff(side_from_analysis(a, "a"), side_from_analysis(a, "b"))
    assert r.unmatched.empty and r.step.delta_s == 0


def test_remat_on_off_matches_the_same_op_reading_other_operands():
    """With remat off, a backward fusion reads the saved activation through a fused dynamic-slice of the scan's
    stacked buffer (operands f32[4,...], s32[]) where with remat on it read the recomputed value: same op, same
    name, same result shape, other operand shapes. It is matched, not listed as both added and removed; the
    rematerialised ops (phase remat) stay removed."""
    on, off = ({"hlo": [FIXTURES / f"mem_remat_{n}" / "hlo"], "chip": HOST_CHIP} for n in ("on", "off"))
    r = diff(load_side(FIXTURES / "mem_remat_on" / "logdir", **on),
             load_side(FIXTURES / "mem_remat_off" / "logdir", **off))
    moved = r.ops[r.ops["matched_by"].str.contains("operands changed")]
    assert len(moved) >= 5
    assert (moved["hlo_ops_base"] == moved["hlo_ops_new"]).all()
    assert "multiply_add_fusion" in set(moved["hlo_ops_base"])  # unique only with its name as tie-breaker
    where = ["hlo_ops", "phase", "scope", "shape"]
    u = r.unmatched
    both_sides = u[u["side"] == "added"][where].merge(u[u["side"] == "removed"][where])
    assert both_sides.empty, both_sides
    assert (u[u["phase"] == "remat"]["side"] == "removed").all() and (u["phase"] == "remat").any()


def test_other_operands_with_another_name_and_no_unique_place_stay_unmatched(sides):
    """Two new ops with the same result shape in the place of one removed op: without a name to tell them apart
    neither is matched to it."""
    base = sides["diff_base"]
    ops = base.op_stats.copy()
    row = ops[ops["category"] == "elementwise"].iloc[[0]]
    rest = ops.drop(index=row.index)
    gone = row.assign(operand_shapes="f32[1]", hlo_ops="gone_fusion")
    new_a = row.assign(operand_shapes="f32[2]", hlo_ops="new_fusion.1")
    new_b = row.assign(operand_shapes="f32[3]", hlo_ops="new_fusion.2")
    b = type(base)(**{**base.__dict__, "op_stats": pd.concat([rest, gone], ignore_index=True)})
    n = type(base)(**{**base.__dict__, "op_stats": pd.concat([rest, new_a, new_b], ignore_index=True)})
    r = diff(b, n)
    assert sorted(r.unmatched["hlo_ops"]) == ["gone_fusion", "new_fusion.1", "new_fusion.2"]
    one = diff(b, type(base)(**{**base.__dict__, "op_stats": pd.concat([rest, new_a], ignore_index=True)}))
    assert one.unmatched.empty and one.ops["matched_by"].str.contains("operands changed").sum() == 1


def test_wider_mlp_matches_every_resized_op(sides):
    """d_ff doubled: every op is still there, resized. The down-projections keep their result shape (operands
    changed); the two backward dots of a block share their place and differ in shape, told apart by name."""
    r = diff(sides["diff_base"], sides["diff_wide"])
    assert r.unmatched.empty
    how = r.ops.set_index("hlo_ops_new")["matched_by"]
    assert how["dot.2"] == how["dot.3"] == "name (shapes changed)"
    assert how["ynn_fusion.3"] == "shape (operands changed)"
    assert (r.ops["hlo_ops_base"] == r.ops["hlo_ops_new"])[r.ops["matched_by"].str.startswith("name")].all()


@pytest.mark.parametrize("hlo_ops", [["a", "b", None, "d"], [1, 2, None, 4]])
def test_pairing_is_what_an_outer_merge_pairs(hlo_ops):
    # text keys are paired in plain Python, other key dtypes by pandas: both as the merge does it (order, nulls
    # paired with nulls, integer and boolean columns of a side whose partner has unpaired rows made float / object)
    from traceroof.diff import _match
    b = pd.DataFrame({"k": pd.Series(["z", "y", None, "x"], dtype="str"), "h": hlo_ops, "n": [1, 2, 3, 4],
                      "f": [True, False, True, True]})
    n = pd.DataFrame({"k": pd.Series(["y", "w", "z", None], dtype="str"), "h": hlo_ops[1:] + hlo_ops[:1],
                      "n": [5, 6, 7, 8], "f": [False] * 4})
    for key in (["k"], ["k", "h"]):
        want = b.merge(n, on=key, how="outer", suffixes=("_base", "_new"), indicator=True)
        want = want[want["_merge"] == "both"].drop(columns="_merge").reset_index(drop=True)
        got, rows_b, rows_n = _match(b, n, key)
        pd.testing.assert_frame_equal(got, want)
        assert b["n"].iloc[rows_b].tolist() == want["n_base"].tolist()
        assert n["n"].iloc[rows_n].tolist() == want["n_new"].tolist()


def test_two_different_jobs_are_flagged_and_the_gate_says_so(sides):
    """A CI gate given another program's report passed "within noise" with no word that the sides differ (a
    user's 8-device MoE base against a 4-device pipeline): now a warning names the op time found in both and the
    device counts, and the gate line carries it. Runs of one job (same model, a wider MLP) get none."""
    assert diff(sides["diff_base"], sides["diff_rerun"]).warnings == ()
    assert diff(sides["diff_base"], sides["diff_wide"]).warnings == ()
    other = load_side(FIXTURES / "sharded_mlp", chip=HOST_CHIP)
    assert (sides["diff_base"].devices, other.devices) == (1, 8)
    r = diff(sides["diff_base"], other)
    (devices, programs) = r.warnings
    assert devices.startswith("the profiles ran on different numbers of devices (base 1, new 8)")
    assert "look like different programs" in programs
    share = r.ops["time_per_step_s_base"].sum() / sides["diff_base"].op_stats["time_per_step_s"].sum()
    assert f"only {share:.0%} of the base's op time" in programs and share < 0.5
    assert gate(r, 5.0)[1].endswith("; but 2 warning(s): the sides may not be one job")


def test_a_json_base_keeps_the_device_count(tmp_path, sides):
    out = tmp_path / "base.json"
    subprocess.run([sys.executable, "-m", "traceroof.cli", "analyze", str(FIXTURES / "sharded_mlp"), "--chip",
                    str(HOST_CHIP), "--format", "json", "-o", str(out)], check=True, cwd=ROOT)
    assert load_side(out).devices == 8


def test_a_host_side_change_is_named_before_the_layers():
    """A user's faster data loader (the same program): the headline named three layers' -0.4 ms as the cause of a
    -24 ms step, while host-bound time fell by 30.5 ms, shown only in the breakdown table."""
    from traceroof.diff import StepDelta, _contributors

    step = StepDelta(0.0942, 0.0698, -0.0244, -0.259, 0.0039, False)
    layers = pd.DataFrame({"layer": ["down1/conv1", "up1/conv1"], "phase": ["backward", "forward"],
                           "time_per_step_s_delta": [-0.000399, 0.0012], "flops_ratio": [1.0, 1.0]})
    parts = pd.DataFrame({"component": ["step_time_s", "compute_s", "exposed_comm_s", "launch_gap_s", "host_bound_s",
                                        "outside_program_s"],
                          "delta_s": [-0.0244, 0.001, 0.0, -0.0002, -0.030509, 0.0]})
    lines = _contributors(step, layers, pd.DataFrame(), parts)
    assert lines[1] == "host-bound (step breakdown, no op's time): -30.509 ms per step, more than any layer's change"
    assert lines[2].startswith("down1/conv1 (backward): -0.399 ms")
    small = parts.assign(delta_s=parts["delta_s"].where(parts["component"] != "host_bound_s", -0.0001))
    assert not any("host-bound" in line for line in _contributors(step, layers, pd.DataFrame(), small))


def test_a_layer_gate_says_it_has_no_noise_estimate(sides):
    """A user's --layer gate failed CI on a change within the noise of their per-step layer times; the line now
    says the threshold alone decides, as the README's gate line does."""
    failed, why = gate(diff(sides["diff_base"], sides["diff_wide"]), 5.0, layer="block_0/mlp")
    assert failed and why.endswith("(above the +5% limit; a layer's time has no noise estimate, unlike the step's: "
                                   "the threshold alone decides)")


def test_a_loop_of_block_instances_pairs_with_one_scanned_block(sides):
    """s31 trial: the same Equinox model run as a Python loop over its blocks (layers ``Block_*``) and under
    ``lax.scan`` (one ``Block``) had no layer in common, so diff listed each block twice (removed and added). The
    two names now pair, as ``Block_*/mlp -> Block/mlp``, and --layer gates on either name."""
    from dataclasses import replace

    def renamed(side, name):  # the diff_base fixture's block_0 as a loop's collapsed instances, or a scan's body
        layers = side.layers.copy()
        layers["layer"] = layers["layer"].str.replace("block_0", name, regex=False)
        return replace(side, layers=layers)

    r = diff(renamed(sides["diff_base"], "block_*"), renamed(sides["diff_rerun"], "block"))
    layers = r.layers.set_index(["layer", "phase"])
    row = layers.loc[("block_*/mlp -> block/mlp", "forward")]
    base = sides["diff_base"].layers.set_index(["layer", "phase"]).loc[("block_0/mlp", "forward")]
    assert row["time_per_step_s_base"] == base["time_per_step_s"] and row["time_per_step_s_new"] > 0
    assert not any(n.startswith(("block_*/", "block/")) and " -> " not in n for n in layers.index.get_level_values(0))
    assert "block_1/mlp" in layers.index.get_level_values(0)  # a layer on both sides keeps its name
    assert gate(r, 1e6, layer="block/mlp")[1].startswith("layer block/mlp: ")


def test_a_saved_report_missing_a_layer_name_diffs_and_gates(tmp_path):
    """A saved report whose layer row lost its name (NaN under pandas 3, whose astype(str) keeps NaN) crashed the
    loop/scan pairing and the --layer gate's list of layers (fuzz json_report 366)."""
    from parsers.errors import InputError

    doc = json.loads((FIXTURES / "fuzz" / "tiny_report.json").read_text())
    del doc["layers"][0]["layer"]
    broken = tmp_path / "base.json"
    broken.write_text(json.dumps(doc))
    r = diff(load_side(broken), load_side(FIXTURES / "fuzz" / "tiny_report.json"))
    with pytest.raises(InputError, match="is in neither profile"):
        gate(r, 5.0, layer="nosuch")


_TRIP_COUNT_JOB = """
import os, sys
out, recompile = sys.argv[1], sys.argv[2].endswith("recompiled")
extra = 4 if "heavy" in sys.argv[2] else 1 if "slow" in sys.argv[2] else 0  # matmuls more per trip
flat = sys.argv[2].startswith("flat")  # 4 trips every step
os.environ["XLA_FLAGS"] = f"--xla_dump_to={out}/hlo --xla_dump_hlo_as_text"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp

@jax.jit
def step(w, x, trips):  # a while loop whose trip count is the step's data (an adaptive solver's, say)
    def body(c):
        i, y = c
        y = jnp.tanh(y @ w)
        for _ in range(extra):  # the regression
            y = y + 1e-6 * jnp.tanh(y @ w.T)
        return i + 1, y
    return jax.lax.while_loop(lambda c: c[0] < trips, body, (0, x))[1]

w = jax.random.normal(jax.random.PRNGKey(0), (256, 256)) / 16
x = jnp.ones((256, 256))
jax.block_until_ready(step(w, x, 1))
with jax.profiler.trace(f"{out}/logdir"):
    for i, trips in enumerate([4] * 9 if flat else [2, 2, 30, 4, 26, 3, 32, 6, 24]):
        if recompile and i == 5:  # step 5 compiles the program again
            jax.clear_caches()
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
            jax.block_until_ready(step(w, x, trips))
"""


def test_steps_of_data_dependent_work_are_paired(tmp_path):
    """s38 trial: a diffrax model's steps did 67-264 MFLOP as the adaptive solver's trip count went, and `diff
    --fail-above 5` passed a +37 % regression as "within noise": the band was the step-to-step spread of the work
    itself. Two runs of a while loop with the same per-step trip counts (2-32), the second with a matmul more per
    trip: paired step by step the change is beyond noise and the gate fails; the difference of means' standard
    error, from the same step times, is wider than the change (what the old gate judged by)."""
    for variant in ("base", "slow"):
        subprocess.run([sys.executable, "-c", _TRIP_COUNT_JOB, str(tmp_path / variant), variant], check=True,
                       timeout=300, capture_output=True)
    runs = [analyze(tmp_path / v / "logdir", hlo=[tmp_path / v / "hlo"], chip=HOST_CHIP) for v in ("base", "slow")]
    base, slow = (side_from_analysis(a, v) for a, v in zip(runs, ("base", "slow")))
    b, n = np.array(base.step_times_s), np.array(slow.step_times_s)
    assert len(b) == len(n) == 8  # the first step is warm-up
    # each step's FLOPs follow its trip count: one 256^3 matmul per trip (two in the slow run), tanh's few aside
    trips = np.array([2, 30, 4, 26, 3, 32, 6, 24])
    for a, dots in zip(runs, (1, 2)):
        assert np.array(a.summary.step_flops) == pytest.approx(trips * dots * 2 * 256**3, rel=0.01)
    work = dict(header_lines(runs[0]))["work"]
    assert "(67.1 MFLOP to 1.07 GFLOP over the 8 steps: the work varies from step to step)" in work
    r = diff(base, slow)
    assert r.step.paired and not r.step.noise and r.step.delta_s > 0
    assert r.step.standard_error_s == pytest.approx(np.std(n - b, ddof=1) / math.sqrt(8))
    welch = math.hypot(np.std(b, ddof=1) / math.sqrt(8), np.std(n, ddof=1) / math.sqrt(8))
    assert abs(n.mean() - b.mean()) < 2 * welch
    failed, why = gate(r, 5.0)
    assert failed and "above the +5% limit" in why
    assert "of the step-by-step differences): slower" in r.contributors[0]


def test_a_step_that_compiles_is_left_out_of_the_comparison(tmp_path):
    """s39 trial (PPO): one step of the new run compiled again (jax.clear_caches(): 2.09 s among 33-49 ms steps),
    the band became +/- 456 ms and `diff --fail-above 5` passed a +110 % regression as "within noise". The same
    while-loop job (4 trips every step), its variant with 4 matmuls more per trip compiling again at step 5: that
    step (over 3x its side's median) and its pair are left out, said so, and the gate fails on the other seven
    pairs; the step breakdown compares those too. (The wide 2-32 trip counts of the test above put a compile within
    10 MADs of the slowest steps, and one matmul more per trip was +10 % on a loaded CI machine.)"""
    for variant in ("flat", "flat_heavy_recompiled"):
        subprocess.run([sys.executable, "-c", _TRIP_COUNT_JOB, str(tmp_path / variant), variant], check=True,
                       timeout=300, capture_output=True)
    base, new = (load_side(tmp_path / v / "logdir", hlo=[tmp_path / v / "hlo"], chip=HOST_CHIP)
                 for v in ("flat", "flat_heavy_recompiled"))
    b, n = np.array(base.step_times_s), np.array(new.step_times_s)
    assert new.steps_used == tuple(range(1, 9)) and n[4] > 3 * np.median(n)  # step 5: the compile
    r = diff(base, new)
    assert f"new step 5 ({fmt_time(n[4])}, {n[4] / np.median(n):.0f}x its median)" in r.step.left_out

    def slow(t):  # the documented rule; on a loaded machine a hiccup of a ~1.5 ms step may be one too
        mid = np.median(t)
        return (t > 3 * mid) & (t > mid + 10 * np.median(np.abs(t - mid)))

    keep = ~(slow(b) | slow(n))
    assert not keep[4] and len(r.step.left_out) == int(slow(b).sum() + slow(n).sum())
    assert r.step.delta_s == pytest.approx(n[keep].mean() - b[keep].mean())
    assert r.step.standard_error_s == pytest.approx(np.std(n[keep] - b[keep], ddof=1) / math.sqrt(keep.sum()))
    assert not r.step.noise and gate(r, 5.0)[0]
    assert np.std(n - b, ddof=1) / math.sqrt(8) * 2 > abs(n.mean() - b.mean())  # all 8 pairs: "within noise"
    assert any(line.startswith("left out of the step time") and "new step 5" in line for line in r.contributors)
    parts = {p["component"]: p for p in json.loads(render_diff_json(r, True, ""))["step_breakdown"]}
    for side, got in ((base, "base_s"), (new, "new_s")):  # one device: a breakdown row per step, in step order
        assert parts["step_time_s"][got] == pytest.approx(side.step_breakdown["step_time_s"][keep].mean())
