"""The findings engine, rule by rule: each rule fires on a real program (a fixture, the real-framework corpus,
a third-party profile, or a TPU-shaped HLO written here) and stays quiet on one where it must not; the ranking,
the records in JSON, the top findings in the reports and ``--format summary``."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path


import pandas as pd
import pytest
from click.testing import CliRunner

from traceroof import analyze
from traceroof.units import fmt_bytes
from traceroof.analysis import Analysis
from traceroof.findings import CODES, RULES
from traceroof.report import render
from tests.conftest import FIXTURES, HOST_CHIP, ROOT, third_party


@lru_cache(maxsize=None)
def fixture(name: str, chip: str = HOST_CHIP, warmup_steps: int = 1) -> Analysis:
    if name.startswith("fw_"):
        return analyze(FIXTURES / name / "readme" / "logdir", hlo=[FIXTURES / name / "hlo"], chip=chip,
                       warmup_steps=warmup_steps)
    return analyze(FIXTURES / name, chip=chip, warmup_steps=warmup_steps)


def codes(a: Analysis) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in a.findings:
        out.setdefault(f.code, []).append(f)
    return out


def tpu_program(tmp_path, width: int, custom_call: bool = False):
    """A TPU-shaped program (tiled bf16 layouts, a [256, width] x [width, width] matmul fusion, optionally a
    Pallas-style custom-call) and a 3-step trace of it, analyzed on TPU v5e."""
    w = width
    t = "{1,0:T(8,128)(2,1)}"
    call = (f'  %cc = bf16[256,{w}]{t} custom-call(%fusion.1), custom_call_target="tpu_custom_call", '
            f'metadata={{op_name="jit(step)/mlp/pallas_call" stack_frame_id=2}}\n') if custom_call else ""
    root = "%cc" if custom_call else "%fusion.1"
    hlo = f"""HloModule jit_step, is_scheduled=true, entry_computation_layout={{(bf16[256,{w}]{t}, bf16[{w},{w}]{t})->bf16[256,{w}]{t}}}

FileNames
1 "/home/user/model.py"
2 "/usr/lib/python3.11/site-packages/jax/_src/numpy/lax_numpy.py"

FunctionNames
1 "mlp"
2 "matmul"

FileLocations
1 {{file_name_id=1 function_name_id=1 line=42 end_line=42 column=8 end_column=33}}
2 {{file_name_id=2 function_name_id=2 line=900 end_line=900 column=1 end_column=9}}

StackFrames
1 {{file_location_id=1 parent_frame_id=0}}
2 {{file_location_id=2 parent_frame_id=1}}

%fused_dot (p0: bf16[256,{w}], p1: bf16[{w},{w}]) -> bf16[256,{w}] {{
  %p0 = bf16[256,{w}]{t} parameter(0)
  %p1 = bf16[{w},{w}]{t} parameter(1)
  ROOT %dot.1 = bf16[256,{w}]{t} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="jit(step)/mlp/dot_general" stack_frame_id=2}}
}}

ENTRY %main (x: bf16[256,{w}], w: bf16[{w},{w}]) -> bf16[256,{w}] {{
  %x = bf16[256,{w}]{t} parameter(0)
  %w = bf16[{w},{w}]{t} parameter(1)
  %fusion.1 = bf16[256,{w}]{t} fusion(%x, %w), kind=kOutput, calls=%fused_dot, metadata={{op_name="jit(step)/mlp/dot_general" stack_frame_id=2}}
{call}  ROOT %out = bf16[256,{w}]{t} copy({root})
}}
"""
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "python"}},
              {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "tf_XLAPjRtCpuClient/1"}}]
    for s in range(3):
        events.append({"ph": "X", "pid": 1, "tid": 1, "ts": 100.0 * s, "dur": 90.0, "name": "train",
                       "args": {"step_num": str(s)}})
        for i, op in enumerate(["fusion.1"] + (["cc"] if custom_call else [])):
            events.append({"ph": "X", "pid": 1, "tid": 2, "ts": 100.0 * s + 5 + 30 * i, "dur": 25.0, "name": op,
                           "args": {"device_ordinal": "0", "hlo_module": "jit_step", "hlo_op": op}})
    (tmp_path / "step.hlo.txt").write_text(hlo)
    (tmp_path / "run.trace.json").write_text(json.dumps({"displayTimeUnit": "ns", "traceEvents": events}))
    return analyze(tmp_path / "run.trace.json", hlo=tmp_path / "step.hlo.txt", chip="v5e", warmup_steps=0)


# -- one test per rule: where it fires, where it must not ------------------------------------------------------

def test_dtype_upcast_on_the_cpu_bf16_model():
    (f,) = codes(fixture("bf16_mlp"))["dtype-upcast"]
    assert "bf16 inputs up to f32" in f.title and "XLA:CPU has no bf16 matrix unit" in f.advice
    assert {"wrapped_convert", "wrapped_convert.1", "wrapped_convert.3"} <= set(f.ops)  # the converts feeding dots
    assert any(o.startswith("ynn_fusion") for o in f.ops)
    assert f.lost_per_step_s > 0 and all(re.search(r"generate_bf16\.py:4[0-9]$", s) for s in f.source_lines)
    assert "dtype-upcast" not in codes(fixture("transformer"))  # an f32 model converts nothing


def test_mxu_alignment_on_100_wide_dims_not_on_128(tmp_path):
    (tmp_path / "w100").mkdir()
    (tmp_path / "w128").mkdir()
    a = tpu_program(tmp_path / "w100", 100)
    (f,) = codes(a)["mxu-alignment"]
    assert f.ops == ("fusion.1",) and "128x128 MXU" in f.title and "multiples of 128" in f.advice
    assert any("256 x 100 x 100 computed as 256 x 128 x 128 (39%" in e for e in f.evidence)
    assert f.source_lines == ("/home/user/model.py:42",)  # the user's frame, not jax's
    b = tpu_program(tmp_path / "w128", 128)
    assert "mxu-alignment" not in codes(b)
    assert "mxu-alignment" not in codes(fixture("diff_base", "v5e"))  # 256-row batches, 256/512 dims
    assert "mxu-alignment" not in codes(fixture("bf16_mlp"))  # a CPU has no MXU


def test_mxu_alignment_of_weight_gradients_asks_for_rows_per_device():
    """s43 trial (the shard_map tutorial's data-parallel MLP, 32 rows per device): the short K of the weight
    gradients x^T·g is the batch rows each device holds, and the advice was to make the model dims (256 already)
    multiples of 128. sharded_mlp's dump: dot.3 and dot.4 contract dim 0 of both operands (rows), and the batch
    enters as f32[16,256] per device."""
    (f,) = codes(fixture("sharded_mlp", "v5e"))["mxu-alignment"]
    dump = next((FIXTURES / "sharded_mlp" / "hlo").glob("*jit_train_step.cpu_after_optimizations.txt")).read_text()
    assert re.search(r"param\.3: f32\[16,256\]", dump)
    for op in f.ops:
        line = re.search(rf"%{re.escape(op)} = f32\[256,256\]\S* dot\(.*", dump).group(0)
        assert "lhs_contracting_dims={0}, rhs_contracting_dims={0}" in line and "transpose(jvp(" in line
    assert "(K = 16): only more rows per device fill the tile" in f.advice
    assert "make the model dims" not in f.advice  # its 256-wide dims are whole tiles


def test_tile_padding_on_tiled_layouts(tmp_path):
    a = tpu_program(tmp_path, 100)
    (f,) = codes(a)["tile-padding"]
    assert "tile padding" in f.title and "fusion.1" in f.ops
    assert "tile-padding" not in codes(fixture("transformer"))  # CPU layouts have no tiles


def test_small_matmul_under_the_ridge():
    (f,) = codes(fixture("fw_flax_cnn"))["small-matmul"]
    assert "memory-bound" in f.title and "ynn_fusion.3" in f.ops  # the Dense head: 8 x 256 x 10
    assert any("f32[8,256], f32[256,10]" in e for e in f.evidence)
    assert "small-matmul" not in codes(fixture("diff_base"))


def test_memory_bound_chain():
    (f,) = codes(fixture("fw_flax_cnn"))["memory-bound-chain"]
    assert " -> " in f.evidence[0] and f.lost_per_step_s > 0 and f.source_lines
    layout = set(codes(fixture("fw_flax_cnn"))["layout-copy"][0].ops)
    assert not layout & set(f.ops)  # layout-only copies are layout-copy's, not counted twice
    assert "memory-bound-chain" not in codes(fixture("scan_mlp"))


def test_layout_copy():
    (f,) = codes(fixture("transformer"))["layout-copy"]
    assert all(o.startswith(("copy_", "transpose_")) for o in f.ops) and "einsum" in f.advice
    assert "convolution" not in f.title + f.advice
    assert "layout-copy" not in codes(fixture("diff_base"))


def test_layout_copies_feeding_convolutions_get_convolution_advice():
    """A CNN's layout copies are XLA CPU's transposes before its backward-filter convolutions: reordering einsum
    dims cannot drop them (before: the einsum advice alone; the s30 trial's UNet, 39 of 45 copies)."""
    (f,) = codes(fixture("fw_flax_cnn"))["layout-copy"]
    assert f.title.endswith(f"{len(f.ops)} of them (6.2 µs per step) feed convolutions")
    # XLA's own dump, read with a regular expression: each of those ops is an operand of a convolution
    dump = next((FIXTURES / "fw_flax_cnn" / "hlo").glob("*jit_train_step.cpu_after_optimizations.txt")).read_text()
    conv_operands = set(re.findall(r"%([\w.-]+)", " ".join(re.findall(r"= \S+ convolution\(([^)]*)\)", dump))))
    assert len(f.ops) == 4 and set(f.ops) <= conv_operands, (f.ops, conv_operands)
    assert f.advice.startswith("the copies that feed convolutions are the backend's convolution lowering")
    assert "einsum order does not drop them" in f.advice and "for the others" not in f.advice


def test_exposed_collective_and_straggler():
    found = codes(fixture("sharded_mlp"))
    assert len(found["exposed-collective"]) == 3
    # 8 threads of one host: waiting for each other on shared cores is no time to win (s36 trial: ranked high,
    # 34 % "lost", under a header at 102 % of the host's roofline); the exposed time stays in the evidence
    assert all(f.severity == "info" and math.isnan(f.lost_per_step_s) and f.evidence[0].startswith("exposed ")
               for f in found["exposed-collective"])
    assert "collective-straggler" not in found  # 8 threads of one host: no device is last most of the time
    assert "exposed-collective" not in codes(fixture("transformer"))


def test_host_bound_and_device_idle_from_the_step_breakdown():
    """A blocking NNX loop: the device waits while the Python thread works (host-bound). The MI300X attention
    profile: ops cover 12% of the step, but no host thread was busy in the gaps: the device idles between its
    own launches (device-idle), not host-bound."""
    nnx = FIXTURES / "fw_nnx_transformer"
    (f,) = codes(analyze(nnx / "blocking" / "logdir", hlo=[nnx / "hlo"], chip=HOST_CHIP))["host-bound"]
    assert "waits on the host" in f.title and "python" in f.title and f.severity == "high"
    found = codes(analyze(third_party("tracelens_mi300x/jax08_attention.xplane.pb")))
    (idle,) = found["device-idle"]
    assert "(88%)" in idle.title and "launch gaps" in idle.title and idle.severity == "high"
    assert "command_buffer" in idle.advice  # launch gaps dominate: fewer, larger ops, not "one jit"
    # 8 virtual CPU devices on 2 cores: idle is thread scheduling, stated, and worth no time
    (virtual,) = codes(fixture("par_dp8"))["device-idle"]
    assert "virtual CPU devices" in virtual.title and virtual.severity == "info" and "jax.jit" not in virtual.advice
    assert "host-bound" not in found
    assert "host-bound" not in codes(fixture("transformer")) and "device-idle" not in codes(fixture("transformer"))


def test_recompile_tells_a_first_compile_from_a_cache_miss_and_from_compiling_every_step():
    """Synthetic step breakdowns (2 devices per step, steps 1-4 used after warm-up step 0) and op tables: a step
    whose device waits on the host while it compiles is named, with advice that follows what ran there."""
    from types import SimpleNamespace

    from traceroof.findings import FindingInputs
    from traceroof.findings.rules_compile import compiling_steps, recompile

    def run(compile_share, programs):
        steps = [1, 2, 3, 4]
        b = pd.DataFrame({"step": [s for s in steps for _ in (0, 1)], "device": ["h/cpu:0", "h/cpu:1"] * 4,
                          "step_time_s": [0.5 if compile_share[s - 1] else 0.1 for s in steps for _ in (0, 1)],
                          "host_bound_s": [0.4 if compile_share[s - 1] else 0.01 for s in steps for _ in (0, 1)],
                          "host_bound_compile_share": [compile_share[s - 1] for s in steps for _ in (0, 1)]})
        ops = pd.DataFrame([(m, pid, st, t, f"{m}.op{k}") for m, pid, st, t, n in programs for k in range(n)],
                           columns=["module", "program_id", "step", "start_ps", "hlo_op"])
        ops["step"] = pd.array(ops["step"], "Int64")
        x = FindingInputs(SimpleNamespace(step_breakdown=b, ops=ops, steps=pd.DataFrame({"step": range(5)})),
                          pd.DataFrame())
        return compiling_steps(b), recompile(x)

    # step 1 first runs the train step (compiled inside the trace): compile it ahead, or leave the step out
    hit, (f,) = run([0.9, None, None, None], [("jit_train", 5, 1, 10, 40), ("jit_train", 5, 2, 30, 40)])
    assert list(hit.index) == [1] and hit.loc[1, "compile_s"] == pytest.approx(0.36)
    assert f.title.endswith("first run: jit_train (step 1)") and f.advice.endswith("--warmup-steps 2")
    assert "lower(*args).compile()" in f.advice and f.lost_per_step_s == pytest.approx(0.4 / 4)
    # step 3 first runs two eager ops (Keras' metrics at the end of an epoch): no warm-up cuts a middle step
    hit, (f,) = run([None, None, 0.9, None], [("jit_train", 5, 1, 10, 40), ("jit_equal", 7, 3, 31, 1),
                                              ("jit__where", 8, 3, 32, 1)])
    assert f.title.endswith("first run: jit__where (step 3), jit_equal (step 3)")
    assert "run eagerly, outside jit" in f.advice and "--warmup-steps" not in f.advice
    # a compile in every step: a cache miss each call, no warm-up advice
    hit, (f,) = run([0.8] * 4, [("jit_train", 5 + s, s, 10 * s, 40) for s in range(1, 5)])
    assert f.title.startswith("4 of 4 steps waited on tracing and compiling (1.600 s in all, steps 1, 2, 3, 4")
    assert "compiled again: jit_train (step 2), jit_train (step 3), jit_train (step 4)" in f.title
    assert "JAX_EXPLAIN_CACHE_MISSES" in f.advice and "--warmup-steps" not in f.advice
    # compiling with no new program; a share under 10 % of the step is not a compile
    hit, (f,) = run([None, 0.5, None, None], [("jit_train", 5, 1, 10, 40)])
    assert "no program of the profile first ran there" in f.advice and "step 2 waited 400.000 ms" in f.title
    hit, found = run([None, 0.05, None, None], [("jit_train", 5, 1, 10, 40)])
    assert hit.empty and found == []


def test_a_combined_gradient_all_reduce_points_at_the_gradient_call():
    """XLA's combiner makes one all-reduce of every layer's gradient and keeps the first part's metadata: its
    "your code" line was that layer's matmul (generate_parallel.py's _block). It is now the innermost line the
    stacks of all its operands share: the line of the user's code that takes the gradient."""
    (f,) = codes(fixture("par_dp8"))["exposed-collective"]
    (line,) = f.source_lines
    path, number = line.rsplit(":", 1)
    source = (FIXTURES / Path(path).name).read_text().splitlines()[int(number) - 1]
    assert "jax.value_and_grad(loss_fn)" in source, source


def test_remat_cost():
    (f,) = codes(fixture("fw_scan_remat"))["remat-cost"]
    assert "remat" in f.title and "checkpoint_policies" in f.advice and "more activations" in f.evidence[1]
    assert "remat-cost" not in codes(fixture("transformer"))


def test_remat_cost_of_a_checkpointed_solver_loop_names_its_checkpoints():
    """The forward an Equinox checkpointed loop (diffrax's RecursiveCheckpointAdjoint) recomputes is no
    jax.checkpoint policy's: the advice is the adjoint's checkpoint count (s38 trial: 'save_only_these_names ...
    nn.remat' for a diffrax Neural ODE)."""
    from types import SimpleNamespace

    from traceroof.findings import FindingInputs
    from traceroof.findings.rules_memory import remat_cost

    counted = pd.DataFrame({"phase": ["remat", "forward"], "scope": ["outer-loop/checkpointed-bwd", "outer-loop"],
                            "measured_s": [0.03, 0.05], "flops": [6e7, 3e7], "module": "jit_step",
                            "program_id": 1, "hlo_op": ["ynn_fusion.4", "ynn_fusion.7"], "source": ""})
    summary = SimpleNamespace(step_time_mean_s=0.1)
    x = FindingInputs(SimpleNamespace(summary=summary, per_step_divisor=1.0, memory=None), counted)
    (f,) = remat_cost(x)
    assert "RecursiveCheckpointAdjoint(checkpoints=n)" in f.advice and "checkpoint_policies" not in f.advice
    assert f.lost_per_step_s == pytest.approx(0.03) and "diffrax docs" in f.source
    (g,) = remat_cost(FindingInputs(x.analysis, counted.assign(scope=["layers/Dense_0", "layers"])))
    assert "checkpoint_policies" in g.advice  # a jax.checkpoint-ed scope keeps the policy advice


def test_opaque_custom_call(tmp_path):
    (f,) = codes(tpu_program(tmp_path, 128, custom_call=True))["opaque-custom-call"]
    assert f.ops == ("cc",) and f.severity == "info" and math.isnan(f.lost_per_step_s)
    assert "opaque-custom-call" not in codes(fixture("transformer"))


def test_opaque_custom_call_on_a_real_tpu_export():
    a = analyze(third_party("xprof_tpu_v5_goldens"), depth=4)
    assert codes(a)["opaque-custom-call"][0].severity == "info"


def test_outlier_executions():
    (f,) = codes(fixture("fw_keras_cnn"))["outlier-executions"]
    assert "conv_general_dilated.6" in f.ops[:4] and f.lost_per_step_s > 0
    assert "outlier-executions" not in codes(fixture("scan_mlp"))


def test_faster_than_roofline():
    (f,) = codes(fixture("transformer"))["faster-than-roofline"]
    assert "CPU caches" in f.title and f.severity == "info"
    assert "faster-than-roofline" not in codes(fixture("diff_base"))


# -- engine and reports ---------------------------------------------------------------------------------------

def test_findings_are_ranked_by_lost_time_and_documented():
    for name in ("sharded_mlp", "fw_flax_cnn", "bf16_mlp"):
        lost = [f.lost_per_step_s for f in fixture(name).findings]
        timed = [x for x in lost if math.isfinite(x)]
        assert timed == sorted(timed, reverse=True) and lost[:len(timed)] == timed, name
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert set(CODES) == set(RULES)
    for code in RULES:
        assert re.fullmatch(r"[a-z]+(-[a-z]+)*", code) and f"`{code}`" in readme, code


def test_reports_put_the_top_findings_first_and_json_has_all():
    a = fixture("fw_flax_cnn")
    text = render(a, "terminal")
    top = text.index("Top findings")
    assert top < text.index("Per layer") and "your code: " in text[top:text.index("Per layer")]
    md = render(a, "markdown")
    assert md.index("## Top findings") < md.index("## Per layer")
    doc = json.loads(render(a, "json"))
    assert [f["code"] for f in doc["findings"]] == [f.code for f in a.findings]
    assert set(doc["findings"][0]) == {"code", "severity", "title", "lost_per_step_s", "evidence", "advice",
                                       "source", "source_lines", "ops"}


def test_html_links_findings_to_their_ops():
    page = render(fixture("fw_flax_cnn"), "html")
    links = set(re.findall(r'href="#(op-\d+)"', page))
    rows = set(re.findall(r'<tr id="(op-\d+)"', page))
    assert links and links <= rows


def test_format_summary_is_a_short_digest():
    from traceroof.cli import main

    r = CliRunner().invoke(main, ["analyze", str(FIXTURES / "bf16_mlp"), "--chip", HOST_CHIP, "--format", "summary"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert len(lines) <= 60 and lines[0].startswith("# traceroof summary")
    assert "dtype-upcast" in r.output and "generate_bf16.py:" in r.output and "MFU" in r.output


def test_shares_are_of_the_step_the_breakdown_measures():
    """A blocking loop: findings judge shares against the breakdown's step (host time included), which is the
    header's step time too, so the host-bound finding's share stays under 100 % of the step. The device's own
    span (from its first launch, or the previous step's last op end if later, to its last op end) leaves the
    host's time out."""
    from traceroof.findings.record import step_time_s
    from traceroof.report.findings import lost_text
    from traceroof.utilization import DEVICE_SPAN

    nnx = FIXTURES / "fw_nnx_transformer"
    a = analyze(nnx / "blocking" / "logdir", hlo=[nnx / "hlo"], chip=HOST_CHIP)
    step = step_time_s(a)
    assert step == pytest.approx(a.step_breakdown["step_time_s"].mean()) == a.summary.step_time_mean_s
    spans = [n for n in a.summary.notes if n.startswith(f"device step time ({DEVICE_SPAN})")]
    assert spans and float(spans[0].split(") ")[1].split(" ms")[0]) * 1e-3 < step / 1.5
    (hb,) = [f for f in a.findings if f.code == "host-bound"]
    share = float(lost_text(hb, step).split("(")[1].split("%")[0])
    assert 0 < share < 100 and f"{share:.1f}%" in hb.title
    from traceroof.report import render
    assert f"({share:.1f}% of the step)" in render(a, "summary")  # the digest uses the same step


def test_summary_ops_give_the_median_time_their_median_lost_time_is_of():
    """The digest's ops are ranked by median lost time per step; the time beside it is the median execution's
    per step too (it gave the mean one, which a user saw below the lost time: 485.1 µs, 683.6 µs lost)."""
    from traceroof.report import render
    from traceroof.units import fmt_time

    nnx = FIXTURES / "fw_nnx_transformer"
    a = analyze(nnx / "blocking" / "logdir", hlo=[nnx / "hlo"], chip=HOST_CHIP)
    lines = render(a, "summary").split("## Ops losing most time (median, per step)\n\n")[1].splitlines()
    for line, r in zip(lines, a.top_ops.head(3).itertuples(index=False)):
        median_s = r.median_s * r.executions_per_step
        assert line.startswith(f"- {r.hlo_op} (") and f": {fmt_time(median_s)}, " in line
        assert r.median_lost_per_step_s == pytest.approx(median_s - r.expected_per_step_s)


def test_host_bound_names_the_host_where_the_host_work_is():
    """A user's 2-host job, one host's loop 30 ms slower: 'waits on the host 15.5 ms per step' was the mean over
    both hosts' devices and named neither; the host that holds it is named with its own figure."""
    from traceroof.findings.rules_system import _one_host

    def table(host_bound_s):
        return pd.DataFrame({"device": [f"host{h}/cpu:{d}" for h in (0, 1) for d in (0, 1)],
                             "host_bound_s": host_bound_s})

    assert _one_host(table([0.4e-3, 0.4e-3, 30.7e-3, 30.7e-3])) == (
        ", mostly on host1 (30.700 ms per step there, at most 400.0 µs on the other 1 host(s))")
    assert _one_host(table([10e-3, 12e-3, 14e-3, 16e-3])) == ""  # spread over both hosts
    assert _one_host(table([0.0, 0.0, 30e-3, 30e-3]).assign(device=lambda t: "h/cpu:" + t.index.astype(str))) == ""


_LSTM_DP_PROFILE = """
import os, sys
out = sys.argv[1]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 --xla_dump_to={out}/hlo --xla_dump_hlo_as_text"
os.environ["JAX_PLATFORMS"] = "cpu"
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

class CharLSTM(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(12)(nn.RNN(nn.OptimizedLSTMCell(16), name="lstm")(nn.Embed(12, 8)(x)))

model, tx = CharLSTM(), optax.adamw(1e-3)
mesh = Mesh(np.array(jax.devices()), ("data",))
params = jax.device_put(model.init(jax.random.PRNGKey(0), jnp.zeros((16, 8), jnp.int32)), NamedSharding(mesh, P()))
opt = jax.device_put(tx.init(params), NamedSharding(mesh, P()))

@jax.jit
def step(p, o, x, y):
    g = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean())(p)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o

x = jax.device_put(jnp.zeros((16, 8), jnp.int32), NamedSharding(mesh, P("data")))
params, opt = step(params, opt, x, x)
jax.block_until_ready(params)
with jax.profiler.trace(f"{out}/logdir"):
    for i in range(3):
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
            params, opt = step(params, opt, x, x)
            jax.block_until_ready(params)
"""


def test_gradients_all_reduced_inside_a_time_loop(tmp_path):
    """A data-parallel Flax LSTM under jax.jit (s34 trial): XLA all-reduces the cell's weight gradients inside the
    backward time loop, once per time step. The finding counts them from the profile and the dump: as many runs
    per step as the loop's trip count in XLA's dump (8 time steps), bytes as the all-reduces' shapes say."""
    subprocess.run([sys.executable, "-c", _LSTM_DP_PROFILE, str(tmp_path)], check=True, timeout=300,
                   capture_output=True)
    a = analyze(tmp_path / "logdir", hlo=[tmp_path / "hlo"], chip=HOST_CHIP)
    (f,) = codes(a)["gradients-in-loop"]
    dump = next((tmp_path / "hlo").glob("*jit_step*cpu_after_optimizations.txt")).read_text()
    assert re.findall(r'known_trip_count":\{"n":"8"\}', dump) and "8 times per step" in f.title
    shapes = dict(re.findall(r"%(all-reduce[\w.]*) = (\([^)]*\)|\w+\[[\d,]*\])", dump))
    once = sum(4 * math.prod(int(d) for d in dims.split(",") if d)
               for op in f.ops for dims in re.findall(r"f32\[([\d,]*)\]", shapes[op]))
    assert f"would move {fmt_bytes(once)}" in f.title and f"move {fmt_bytes(8 * once)} per step" in f.title
    assert "jax.lax.pmean" in f.advice and [r.strategy for r in a.parallelism.rows] == ["data"]


_SCAN_LAYERS_DP_PROFILE = """
import os, sys
out = sys.argv[1]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 --xla_dump_to={out}/hlo --xla_dump_hlo_as_text"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()), ("data",))
w = jax.device_put(jnp.ones((4, 64, 64)) / 64, NamedSharding(mesh, P()))  # 4 layers' weights, stacked

def loss(w, x):
    h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)  # one layer per iteration
    return jnp.mean(h ** 2)

@jax.jit
def step(w, x):
    return w - 0.1 * jax.grad(loss)(w, x)

x = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("data")))
w = step(w, x)
jax.block_until_ready(w)
with jax.profiler.trace(f"{out}/logdir"):
    for i in range(3):
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
            w = step(w, x)
            jax.block_until_ready(w)
"""


def test_gradients_of_a_scan_over_layers_are_not_reduced_twice(tmp_path):
    """A data-parallel scan over 4 stacked layers (s36 trial's GNN): XLA all-reduces one layer's weight gradient
    per iteration of the backward loop, each into its own slice of the stacked gradient, so reducing once after
    the loop would move the same bytes (the trial measured that rewrite 30 % slower): no gradients-in-loop."""
    subprocess.run([sys.executable, "-c", _SCAN_LAYERS_DP_PROFILE, str(tmp_path)], check=True, timeout=300,
                   capture_output=True)
    a = analyze(tmp_path / "logdir", hlo=[tmp_path / "hlo"], chip=HOST_CHIP)
    dump = next((tmp_path / "hlo").glob("*jit_step*cpu_after_optimizations.txt")).read_text()
    reduced = [r for r in a.collectives.itertuples() if r.kind == "all-reduce" and r.executions_per_step == 4]
    assert reduced and 'known_trip_count":{"n":"4"}' in dump  # precondition: an all-reduce runs in the 4-trip loop
    assert all(r.bytes_out == 64 * 64 * 4 for r in reduced)  # one layer's gradient each time, not the stack's
    assert "gradients-in-loop" not in codes(a)


_MINIBATCH_UPDATES_DP_PROFILE = """
import os, sys
out = sys.argv[1]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 --xla_dump_to={out}/hlo --xla_dump_hlo_as_text"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()), ("data",))
tx = optax.adam(1e-3)
params = jax.device_put({"w1": jnp.ones((32, 64)) / 32, "w2": jnp.ones((64, 1)) / 64}, NamedSharding(mesh, P()))
opt = jax.device_put(tx.init(params), NamedSharding(mesh, P()))

def loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

@jax.jit
def step(p, o, xs):  # PPO-style epochs: an adam update after each of the 4 minibatches
    def minibatch(i, c):
        p, o = c
        u, o = tx.update(jax.grad(loss)(p, xs[i]), o, p)
        return optax.apply_updates(p, u), o
    return jax.lax.fori_loop(0, 4, minibatch, (p, o))

xs = jax.device_put(jnp.ones((4, 256, 32)), NamedSharding(mesh, P(None, "data")))
params, opt = step(params, opt, xs)
jax.block_until_ready(params)
with jax.profiler.trace(f"{out}/logdir"):
    for i in range(3):
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
            params, opt = step(params, opt, xs)
            jax.block_until_ready(params)
"""


def test_gradients_reduced_before_each_update_of_a_loop_are_not_repeated_work(tmp_path):
    """PPO's epochs (s39 trial): a loop over minibatches whose body updates the weights (adam) after each one. Each
    iteration's gradient must be reduced before the next update, so "reduce once after the loop" would change the
    algorithm: no gradients-in-loop, though XLA runs the gradient all-reduce 4 times per step in that loop."""
    subprocess.run([sys.executable, "-c", _MINIBATCH_UPDATES_DP_PROFILE, str(tmp_path)], check=True, timeout=300,
                   capture_output=True)
    a = analyze(tmp_path / "logdir", hlo=[tmp_path / "hlo"], chip=HOST_CHIP)
    dump = next((tmp_path / "hlo").glob("*jit_step*cpu_after_optimizations.txt")).read_text()
    assert 'known_trip_count":{"n":"4"}' in dump
    # precondition: the weight gradients' all-reduce runs in the loop, 4 times per step, beside adam's ops
    grads = [r for r in a.collectives.itertuples() if r.hlo_op in a.parallelism.gradient_ops]
    assert grads and all(r.executions_per_step == 4 for r in grads)
    ops = a.ops[a.ops["counted"]]
    assert (ops.loc[ops["phase"] == "optimizer", "executions"] > 0).any()
    assert "gradients-in-loop" not in codes(a)
