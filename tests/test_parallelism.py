"""Strategy per mesh axis on real sharded steps (fixtures/generate_parallel.py), mesh recovery from every
replica-group form, and the book's thresholds (How to Scale Your Model §5, §6, §12.4) reproduced from the chip
files within ±5 %, on formulas and on hand-written TPU-sized HLO."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import textwrap

import pytest

from parsers.hlo_text import parse_hlo_file, parse_hlo_text
from tests.conftest import FIXTURES
from traceroof.book_math import (Link, axis_link, critical_batch_data, fsdp_tp_critical_batch, optimal_fsdp,
                                 tensor_parallel_limit, training_memory)
from traceroof.chips import get_chip
from traceroof.collectives import parse_topology
from traceroof.mesh import group_factors, recover_mesh
from traceroof.mesh_book import book_on_mesh
from traceroof.parallelism import classify_axes, collect_evidence, state_params

PAR = sorted(p.name for p in FIXTURES.glob("par_*"))


def _module(name: str):
    (m,) = parse_hlo_file(next((FIXTURES / name / "hlo").glob("*jit_train_step*")))
    return m


@pytest.mark.parametrize("name", PAR)
def test_fixture_strategies(name: str) -> None:
    """Each profiled step's mesh and per-axis strategy are the ones it was written with (facts.json)."""
    cfg = json.loads((FIXTURES / name / "facts.json").read_text())["config"]
    m = _module(name)
    mesh = recover_mesh(m)
    assert [a.size for a in mesh.axes] == cfg["mesh"] and mesh.regular
    got = [s.strategy for s in classify_axes(mesh, collect_evidence(m, mesh, state_params(m)))]
    assert got == [cfg["strategy"][axis] for axis in cfg["axes"]]


def test_fixture_evidence_and_sizes() -> None:
    """Evidence names what was seen (XLA:CPU's all-reduce + dynamic-slice for FSDP gradients); D, F, L and the
    tokens per device come out of the HLO."""
    m = _module("par_fsdp8")
    mesh = recover_mesh(m)
    (row,) = classify_axes(mesh, collect_evidence(m, mesh, state_params(m)))
    assert "weights all-gathered before use" in row.evidence and "dynamic-slice" in row.evidence
    v5p = get_chip("v5p")
    rep = book_on_mesh([m], v5p, parse_topology("2x2x2", v5p))
    s = rep.sizes
    assert (s.d_model, s.d_ff, s.layers, s.tokens, s.tokens_per_device) == (128, 384, 2, 160, 20)
    assert rep.rows[0].bound == "communication" and rep.findings and "fewer fsdp ways" in rep.findings[0][2]
    assert sum(w.best for w in rep.what_if) == 1 and any(w.current and w.name == "fsdp8" for w in rep.what_if)


def test_mesh_forms() -> None:
    """Explicit lists, iota ``[G,S]<=[dims]T(perm)`` and ``mesh[...]`` groups give the same 4 x 2 mesh; groups that
    fit no row-major mesh become one axis per partition."""
    assert group_factors((0, 1, 4, 5)) == ((1, 2), (4, 2)) and group_factors((0, 1, 3)) is None
    forms = {"explicit": "{{0,2,4,6},{1,3,5,7}}", "iota": "[2,4]<=[4,2]T(1,0)", "mesh": "mesh['a'=4,'b'=2] {'a'}"}
    for form, groups in forms.items():
        m = _hlo(f"""  %ag = f32[8,4]{{1,0}} all-gather(%p), channel_id=1, replica_groups={groups}, dimensions={{0}}, use_global_device_ids=true
  %ar = f32[8,4]{{1,0}} all-reduce(%ag), channel_id=2, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add""")
        mesh = recover_mesh(m)
        assert [(a.size, a.stride) for a in mesh.axes] == [(4, 2), (2, 1)], form
        assert [pc.axes for pc in mesh.collectives] == [("axis0",), ("axis1",)], form
    odd = recover_mesh(_hlo("""  %ar = f32[2,4]{1,0} all-reduce(%p), channel_id=2, replica_groups={{0,3},{1,2},{4,7},{5,6}}, use_global_device_ids=true, to_apply=%add"""))
    assert not odd.regular and [a.size for a in odd.axes] == [2] and "permuted" in odd.note


def _hlo(body: str, devices: int = 8):
    text = f"""HloModule t, num_partitions={devices}

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}}

ENTRY %main (p: f32[2,4]) -> f32[2,4] {{
  %p = f32[2,4]{{1,0}} parameter(0)
{body}
  ROOT %r = f32[2,4]{{1,0}} copy(%p)
}}
"""
    (m,) = parse_hlo_text(text)
    return m


# -- the book's numbers from the chip files -------------------------------------------------------------------

def _close(got: float, book: float) -> bool:
    return abs(got - book) <= 0.05 * book


def test_book_thresholds_from_chip_files() -> None:
    """§5: v5p C/W_ici = 2550 (850 over 3 axes); TP limit F/2550 ≈ 11 for F ≈ 28.7k-30k; FSDP+TP 2·2550²/F = 453
    (LLaMA 3-70B, §6); X_opt = 1618; DCN ≈ 76,000 per pod's chip (§5 Between Pods); §12.4.1 H100 ≈ 2200 in a node,
    ≈ 2475 across nodes. Every figure from traceroof/chips/*.toml through the topology model."""
    v5p = get_chip("v5p")
    c = v5p.peak_for("bf16")[0]
    one = axis_link(v5p, parse_topology("16x16x16", v5p), tuple(range(16)))
    assert one.axes == 1 and one.name == "ICI"
    assert _close(critical_batch_data(c, one), 2550)
    three = axis_link(v5p, parse_topology("4x4x4", v5p), tuple(range(64)))
    assert three.axes == 3 and _close(critical_batch_data(c, three), 850)
    assert _close(tensor_parallel_limit(c, one, 30_000), 30_000 / 2550) and _close(tensor_parallel_limit(c, one, 28_672), 11)
    two = Link(one.bandwidth_bytes_per_s, 2, "ICI")
    assert _close(fsdp_tp_critical_batch(c, two, one, 28_672), 453)
    assert _close(optimal_fsdp(4 * 1024 * 1024, 28_672, 8960, 2, 1), 1618)
    dcn = axis_link(v5p, parse_topology("2x4x4x4", v5p), (0, 64))
    assert dcn.name == "DCN" and _close(critical_batch_data(c, dcn), 76_000)
    h100 = get_chip("h100")
    c = h100.peak_for("bf16")[0]
    assert _close(critical_batch_data(c, axis_link(h100, parse_topology("8x2", h100), tuple(range(8)))), 2200)
    assert _close(critical_batch_data(c, axis_link(h100, parse_topology("8x2", h100), (0, 8))), 2475)


def test_book_llama_memory() -> None:
    """§6: LLaMA 3-70B, 4M-token batch, 4 checkpoints per layer: 140 GB params + 560 GB Adam + 20.9 TB checkpoints
    ≈ 21.6 TB, ≈ 2.4 GB per chip on 8960 v5p chips (gradients are counted beside, the book leaves them out)."""
    whole = training_memory(70e9, 4e6, 8192, 80, 1, 1, 2, 8, checkpoints_per_layer=4)
    assert _close(whole.params_bytes, 140e9) and _close(whole.optimizer_bytes, 560e9)
    assert _close(whole.activations_bytes, 20.9e12)
    book_total = whole.params_bytes + whole.optimizer_bytes + whole.activations_bytes
    assert _close(book_total, 21.6e12) and _close(book_total / 8960, 2.4e9)


def _tpu_step(devices: int, x: int, y: int, d: int, f: int, tokens_per_device: int) -> str:
    """A bf16 MLP training step of a FSDP (x ways, major) x tensor (y ways, minor) mesh as XLA prints it: weights
    all-gathered over x before the dots, activations all-reduced over y, gradients all-reduced over x."""
    dx, fy = d // x, f // y
    fsdp = f"[{y},{x}]<=[{x},{y}]T(1,0)" if y > 1 else f"[1,{x}]<=[{x}]"
    tp = f"[{x},{y}]<=[{devices}]"
    tensor = f"""
  %h = bf16[{tokens_per_device},{fy}]{{1,0}} dot(%x, %wi), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="jit(step)/jvp(mlp)/dot_general"}}
  %o = bf16[{tokens_per_device},{d}]{{1,0}} dot(%h, %wo), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="jit(step)/jvp(mlp)/dot_general"}}
  %ar = bf16[{tokens_per_device},{d}]{{1,0}} all-reduce(%o), channel_id=3, replica_groups={tp}, use_global_device_ids=true, to_apply=%add, metadata={{op_name="jit(step)/jvp(mlp)/dot_general"}}""" if y > 1 else f"""
  %h = bf16[{tokens_per_device},{fy}]{{1,0}} dot(%x, %wi), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="jit(step)/jvp(mlp)/dot_general"}}
  %ar = bf16[{tokens_per_device},{d}]{{1,0}} dot(%h, %wo), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="jit(step)/jvp(mlp)/dot_general"}}"""
    tiles_in = f"devices=[{x},{y}]<=[{devices}]"
    tiles_out = f"devices=[{y},{x}]<=[{x},{y}]T(1,0)"
    return f"""HloModule step, num_partitions={devices}, input_output_alias={{ {{0}}: (0, {{}}, may-alias), {{1}}: (1, {{}}, may-alias) }}

%add (a: bf16[], b: bf16[]) -> bf16[] {{
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}}

ENTRY %main (wi0: bf16[{dx},{fy}], wo0: bf16[{fy},{dx}], x: bf16[{tokens_per_device},{d}]) -> (bf16[{dx},{fy}], bf16[{fy},{dx}]) {{
  %wi0 = bf16[{dx},{fy}]{{1,0}} parameter(0), sharding={{{tiles_in}}}
  %wo0 = bf16[{fy},{dx}]{{1,0}} parameter(1), sharding={{{tiles_out}}}
  %x = bf16[{tokens_per_device},{d}]{{1,0}} parameter(2), sharding={{devices=[{x},1,{y}]<=[{devices}] last_tile_dim_replicate}}
  %wi = bf16[{d},{fy}]{{1,0}} all-gather(%wi0), channel_id=1, replica_groups={fsdp}, dimensions={{0}}, use_global_device_ids=true, metadata={{op_name="jit(step)/jvp(mlp)/dot_general"}}
  %wo = bf16[{fy},{d}]{{1,0}} all-gather(%wo0), channel_id=2, replica_groups={fsdp}, dimensions={{1}}, use_global_device_ids=true, metadata={{op_name="jit(step)/jvp(mlp)/dot_general"}}{tensor}
  %gw = bf16[{d},{fy}]{{1,0}} dot(%x, %h), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}, metadata={{op_name="jit(step)/transpose(jvp(mlp))/dot_general"}}
  %gr = bf16[{d},{fy}]{{1,0}} all-reduce(%gw), channel_id=4, replica_groups={fsdp}, use_global_device_ids=true, to_apply=%add, metadata={{op_name="jit(step)/transpose(jvp(mlp))/dot_general"}}
  %pid = u32[] partition-id()
  %zero = u32[] constant(0)
  %gs = bf16[{dx},{fy}]{{1,0}} dynamic-slice(%gr, %pid, %zero), dynamic_slice_sizes={{{dx},{fy}}}
  %nwi = bf16[{dx},{fy}]{{1,0}} subtract(%wi0, %gs)
  ROOT %out = (bf16[{dx},{fy}]{{1,0}}, bf16[{fy},{dx}]{{1,0}}) tuple(%nwi, %wo0)
}}
"""


def test_tpu_hlo_llama_fsdp_tp() -> None:
    """LLaMA 3-70B's MLP (D = 8192, F = 28,672) as 256-way FSDP x 4-way tensor parallelism on a v5p 4x16x16 slice
    (tensor on the 4-wrap x axis, FSDP over y and z: M_X·M_Y = 2), 468 tokens per chip as in §6: the strategies,
    the FSDP+TP threshold 2·2550²/F = 453 (the step is just above it), α/M_X = 1275 per device and F/2550 ≈ 11
    tensor ways come out of the HLO within ±5 %."""
    x, y, n = 256, 4, 1024
    m, = parse_hlo_text(_tpu_step(n, x, y, 8192, 28_672, 468 * n // x))
    v5p = get_chip("v5p")
    rep = book_on_mesh([m], v5p, parse_topology("4x16x16", v5p))
    assert [(r.axis, r.size, r.strategy) for r in rep.rows] == [("axis0", 256, "fsdp"), ("axis1", 4, "tensor")]
    fsdp, tensor = rep.rows
    assert (fsdp.link_axes, tensor.link_axes) == (2, 1)
    assert _close(fsdp.critical_batch_per_device, 2550 / 2) and fsdp.batch_per_device == 468 * 4
    assert _close(tensor.max_ways, 28_672 / 2550) and tensor.bound == "compute"
    assert (rep.sizes.d_model, rep.sizes.d_ff, rep.sizes.tokens) == (8192, 28_672, 468 * n)
    note = next(n for n in rep.notes if "4α²" in n)
    crit = float(note.split("= ")[1].split(" tokens")[0].replace(",", ""))
    assert _close(crit, 453) and "compute-bound" in note
    assert not rep.findings
    best = next(w for w in rep.what_if if w.best)
    assert best.tensor > 1 and best.fsdp > 1  # the book's answer: mix FSDP and tensor parallelism


def test_tpu_hlo_pure_fsdp_llama_is_communication_bound() -> None:
    """§6: pure FSDP of LLaMA 3-70B with a 4M-token batch over a full 3D pod is communication-bound (512 tokens per
    chip on 8192 v5p chips, 16x16x32, below 2550/3 = 850), with the book's remedy as a finding."""
    n = 8192
    m, = parse_hlo_text(_tpu_step(n, n, 1, 8192, 28_672, 4 * 1024 * 1024 // n))
    v5p = get_chip("v5p")
    rep = book_on_mesh([m], v5p, parse_topology("16x16x32", v5p))
    (row,) = rep.rows
    assert row.strategy == "fsdp" and row.link_axes == 3 and _close(row.critical_batch_per_device, 850)
    assert row.batch_per_device == 512 and row.bound == "communication"
    assert math.isclose(row.t_comm_s / row.t_math_s, 850 / 512, rel_tol=0.05)
    assert len(rep.findings) == 1 and "raise the per-device batch" in rep.findings[0][2]


def test_report_section_every_format() -> None:
    """A profiled fsdp4 x tp2 step judged on v5p: JSON rows with the issue's keys and the measured communication
    beside the book's, what-ifs with one best, a finding per communication-bound axis, and the section in the
    terminal, Markdown and HTML reports."""
    from traceroof.analysis import analyze
    from traceroof.report import render

    a = analyze(FIXTURES / "par_fsdp4_tp2", chip="v5p", topology="2x2x2")
    doc = json.loads(render(a, "json"))
    rows = doc["parallelism"]
    keys = {"axis", "size", "strategy", "batch_per_device", "critical_batch_per_device", "t_math_s", "t_comm_s",
            "bound", "evidence"}
    assert all(keys <= set(r) for r in rows)
    assert [(r["axis"], r["size"], r["strategy"]) for r in rows] == [("axis0", 4, "fsdp"), ("axis1", 2, "tensor")]
    fsdp = rows[0]
    # 2550 x 2 (f32: 4 bytes per element) x 2 (2x2x2 has no wraparound: one-way links) / 2 ICI axes spanned
    assert fsdp["batch_per_device"] == 40 and fsdp["critical_batch_per_device"] == pytest.approx(2550 * 2 * 2 / 2, 0.05)
    assert fsdp["measured_comm_s"] > 0 and fsdp["expected_comm_s"] > 0 and fsdp["bound"] == "communication"
    assert sum(w["best"] for w in doc["mesh_what_if"]) == 1
    assert [w["name"] for w in doc["mesh_what_if"] if w["current"]] == ["fsdp4 x tp2"]
    (axis0,) = [f for f in doc["findings"] if f["code"] == "comm-bound-axis" and "axis0" in f["title"]]
    assert axis0["title"].startswith("mesh axis axis0 (fsdp, 4-way) is communication-bound")
    # measured on virtual CPU devices: their waits are not what a v5p would lose (worth unknown, evidence says so)
    assert "raise the per-device batch" in axis0["advice"] and axis0["lost_per_step_s"] is None
    assert fsdp["measured_exposed_s"] > 0 and "threads of one CPU host" in axis0["evidence"][0]
    assert "axis1 (tensor): activations" in render(a, "terminal")
    assert "## Parallelism" in render(a, "markdown")
    assert 'id="parallelism-table"' in render(a, "html")


def test_sequence_axis_gathers_tokens() -> None:
    """Activations all-gathered along a token dimension (not the features) in the forward pass: sequence
    parallelism; along the last (feature) dimension: tensor parallelism."""
    for dim, want in ((0, "sequence"), (1, "tensor")):
        shape = "f32[64,32]" if dim == 0 else "f32[8,256]"
        m = _hlo(f"""  %ag = {shape}{{1,0}} all-gather(%p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={{{dim}}}, use_global_device_ids=true, metadata={{op_name="jit(f)/jvp(attn)/all_gather"}}""")
        mesh = recover_mesh(m)
        (s,) = classify_axes(mesh, collect_evidence(m, mesh, state_params(m)))
        assert s.strategy == want, (dim, s)


def _tpu_data_step(devices: int, d: int, f: int, tokens: int) -> str:
    """A bf16 data-parallel MLP step: weights replicated, the batch split ``devices`` ways, both gradients
    all-reduced over every device in the backward pass."""
    meta = 'metadata={op_name="jit(step)/transpose(jvp(mlp))/dot_general"}'
    fwd = 'metadata={op_name="jit(step)/jvp(mlp)/dot_general"}'
    t = tokens // devices
    return f"""HloModule step, num_partitions={devices}, input_output_alias={{ {{0}}: (0, {{}}, may-alias), {{1}}: (1, {{}}, may-alias) }}

%add (a: bf16[], b: bf16[]) -> bf16[] {{
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}}

ENTRY %main (wi: bf16[{d},{f}], wo: bf16[{f},{d}], x: bf16[{t},{d}]) -> (bf16[{d},{f}], bf16[{f},{d}]) {{
  %wi = bf16[{d},{f}]{{1,0}} parameter(0), sharding={{replicated}}
  %wo = bf16[{f},{d}]{{1,0}} parameter(1), sharding={{replicated}}
  %x = bf16[{t},{d}]{{1,0}} parameter(2), sharding={{devices=[{devices},1]<=[{devices}]}}
  %h = bf16[{t},{f}]{{1,0}} dot(%x, %wi), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {fwd}
  %o = bf16[{t},{d}]{{1,0}} dot(%h, %wo), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {fwd}
  %gi = bf16[{d},{f}]{{1,0}} dot(%x, %h), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}, {meta}
  %go = bf16[{f},{d}]{{1,0}} dot(%h, %o), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}, {meta}
  %ri = bf16[{d},{f}]{{1,0}} all-reduce(%gi), channel_id=1, replica_groups=[1,{devices}]<=[{devices}], use_global_device_ids=true, to_apply=%add, {meta}
  %ro = bf16[{f},{d}]{{1,0}} all-reduce(%go), channel_id=2, replica_groups=[1,{devices}]<=[{devices}], use_global_device_ids=true, to_apply=%add, {meta}
  %ni = bf16[{d},{f}]{{1,0}} subtract(%wi, %ri)
  %no = bf16[{f},{d}]{{1,0}} subtract(%wo, %ro)
  ROOT %out = (bf16[{d},{f}]{{1,0}}, bf16[{f},{d}]{{1,0}}) tuple(%ni, %no)
}}
"""


def test_each_row_names_its_pass_and_expected_comm_keeps_the_ring_factor() -> None:
    """T_math/T_comm per layer are in the pass the book compares them in: backward for a data axis (8BDF, the
    gradient all-reduce), forward for FSDP and tensor (4BDF); the report says which. The expected communication
    per step of a data axis on a line (2x2x2 v5p: no wraparound) is L x T_comm/layer x (N-1)/N: the book drops
    the ring's (N-1)/N, traceroof's collective model keeps it."""
    from traceroof.analysis import analyze
    from traceroof.report import render

    v5p = get_chip("v5p")
    d, f, n = 8192, 28_672, 8
    m, = parse_hlo_text(_tpu_data_step(n, d, f, 4096 * n))
    rep = book_on_mesh([m], v5p, parse_topology("2x2x2", v5p))
    (row,) = rep.rows
    assert (row.strategy, row.book_pass, rep.sizes.layers) == ("data", "backward", 1)
    assert row.t_math_s == pytest.approx(8 * 4096 * d * f / v5p.peak_for("bf16")[0])
    assert row.expected_comm_s == pytest.approx(rep.sizes.layers * row.t_comm_s * (n - 1) / n, rel=1e-6)
    assert any("(N−1)/N" in note and "pass" in note for note in rep.notes)
    a = analyze(FIXTURES / "par_fsdp4_tp2", chip="v5p", topology="2x2x2")
    assert [r.book_pass for r in a.parallelism.rows] == ["forward", "forward"]
    doc = json.loads(render(a, "json"))
    assert [r["book_pass"] for r in doc["parallelism"]] == ["forward", "forward"]
    header = next(line for line in render(a, "terminal", wide=True).splitlines() if "T_math/layer" in line)
    assert header.split().index("pass") == header.split().index("T_math/layer") - 1


def test_weight_shapes_hold_every_shard_of_a_weight_over_the_devices() -> None:
    """A (4 data x 2 fsdp) step that accumulates microbatch gradients in a lax.scan: XLA reshards a weight's
    gradient (global [128, 384], rows cut by fsdp: [64, 384] per device) along its columns, [128, 192], before the
    data-parallel all-reduce. That array is a weight's gradient, not an activation: read as one, it made the data
    axis 'tensor' (a user's Llama step). Shards of a cut that does not divide the devices stay out."""
    from traceroof.parallelism import StateParam, weight_shapes

    w = StateParam(0, "w_in", (64, 384), (128, 384), "f32", 64 * 384 * 4, True)
    shapes = weight_shapes([w], 8)
    assert {(64, 384), (128, 384), (128, 192), (32, 384), (64, 192), (16, 384), (128, 48)} <= shapes
    assert (128, 128) not in shapes and (96, 384) not in shapes  # 384 / 3: no cut of 8 devices
    assert weight_shapes([w]) == {(64, 384), (128, 384)}


def test_weights_gathered_before_a_micro_batch_loop_are_gathered_before_use() -> None:
    """XLA hoists a scan's loop-invariant FSDP all-gathers out of a gradient-accumulation loop: the gathered
    weight enters the ``while`` and its body's matmul uses it. A user's 4-micro-batch step read them as
    "updated weights all-gathered" (16 all-gathers, the embedding table's among them)."""
    m, = parse_hlo_text("""HloModule step, num_partitions=8, input_output_alias={ {0}: (0, {}, may-alias) }

%body (s: (s32[], f32[32,16], f32[32,16])) -> (s32[], f32[32,16], f32[32,16]) {
  %s = (s32[], f32[32,16]{1,0}, f32[32,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %w = f32[32,16]{1,0} get-tuple-element(%s), index=1
  %acc = f32[32,16]{1,0} get-tuple-element(%s), index=2
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  %y = f32[32,16]{1,0} dot(%w, %w), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/while/body/jvp(mlp)/dot_general"}
  %g = f32[32,16]{1,0} add(%acc, %y)
  ROOT %t = (s32[], f32[32,16]{1,0}, f32[32,16]{1,0}) tuple(%n, %w, %g)
}

%cond (c: (s32[], f32[32,16], f32[32,16])) -> pred[] {
  %c = (s32[], f32[32,16]{1,0}, f32[32,16]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %four), direction=LT
}

ENTRY %main (p: f32[4,16]) -> f32[4,16] {
  %p = f32[4,16]{1,0} parameter(0), sharding={devices=[8,1]<=[8]}
  %ag = f32[32,16]{1,0} all-gather(%p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/jvp(mlp)/all_gather"}
  %zero = s32[] constant(0)
  %z = f32[] constant(0)
  %zeros = f32[32,16]{1,0} broadcast(%z), dimensions={}
  %init = (s32[], f32[32,16]{1,0}, f32[32,16]{1,0}) tuple(%zero, %ag, %zeros)
  %loop = (s32[], f32[32,16]{1,0}, f32[32,16]{1,0}) while(%init), condition=%cond, body=%body
  %grad = f32[32,16]{1,0} get-tuple-element(%loop), index=2
  %sl = f32[4,16]{1,0} slice(%grad), slice={[0:4], [0:16]}
  ROOT %new = f32[4,16]{1,0} subtract(%p, %sl)
}
""")
    mesh = recover_mesh(m)
    (evidence,) = collect_evidence(m, mesh, state_params(m)).values()
    assert set(evidence.ops) == {"weights_gathered"}, evidence.ops


def test_a_dump_of_another_program_given_with_hlo_is_left_out_of_every_section() -> None:
    """A user passed another job's dump folder (its program also named jit_train_step, another program id): the
    report said it was ignored, yet the parallelism section read that program's mesh and strategies (the
    profile's pipeline x data step showed the FSDP x TP dump's axes). Every section equals the run without it."""
    from traceroof.analysis import analyze

    chip = str(FIXTURES / "fixture_host.toml")
    own = analyze(FIXTURES / "par_pp2" / "logdir", chip=chip)
    other = analyze(FIXTURES / "par_pp2" / "logdir", hlo=FIXTURES / "par_fsdp4_tp2" / "hlo", chip=chip)
    assert any("describes none of the profiled programs" in n for n in other.summary.notes)
    assert [(r.axis, r.size, r.strategy) for r in own.parallelism.rows] == [("axis0", 2, "pipeline"),
                                                                            ("axis1", 4, "data")]
    assert repr(other.parallelism.rows) == repr(own.parallelism.rows)  # (NaN figures: compared as text)
    assert other.parallelism.sizes == own.parallelism.sizes
    assert other.memory.peak == own.memory.peak and other.summary.flops_per_step == own.summary.flops_per_step


def test_a_cpu_profile_judged_on_a_gpu_does_not_count_cpu_waits_as_its_loss() -> None:
    """A user's 8-CPU-device step analyzed with --chip h100: the top finding said the data axis 'lost ~5.461 ms
    per step (60.5 %)' on an H100, the virtual devices' waits for each other, while the finding's own H100
    estimate was 0.146 us per layer. The verdict stays (the book's arithmetic on the target); the measured loss is
    not the target's, and the collectives are judged as virtual CPU devices'."""
    from traceroof.analysis import analyze

    a = analyze(FIXTURES / "par_dp8" / "logdir", chip="h100")
    (axis,) = [f for f in a.findings if f.code == "comm-bound-axis"]
    assert math.isnan(axis.lost_per_step_s) and "threads of one CPU host" in axis.evidence[0]
    exposed = [f for f in a.findings if f.code == "exposed-collective"]
    assert exposed and all("virtual CPU devices" in f.title for f in exposed)


def test_activations_of_a_weight_shape_are_read_by_data_flow_and_phase() -> None:
    """A user's MoE step (2 x 4 mesh, attention tensor-parallel over its 'expert' axis) read as "gradients
    all-reduced + dynamic-slice" and "weights all-gathered before use" with its dump: the forward attention
    output all-reduce, the backward input-gradient all-reduce and the token all-gather all have f32[4,32,64],
    which is its f32[4,128,64] expert weight cut 4 ways on its rows. The same here on 4 devices: the weight
    f32[1,16,8] tiled [4,1,1] is [4,16,8] globally, and [4,16/4,8] = [4,4,8] is the shape of every activation.
    The all-gather's operand comes from a matmul (activations, along dimension 0 of 3: tokens), the forward
    all-reduce feeds the next matmul, the backward one the weight-gradient dot; only the all-reduce of that
    dot's f32[16,8] (the weight's local shape) feeds the update alone: gradients. 4 x 4 x 8 x 4 B = 512 B per
    activation collective, 16 x 8 x 4 B = 512 B for the gradient."""
    m, = parse_hlo_text("""HloModule step, num_partitions=4, input_output_alias={ {0}: (0, {}, may-alias) }

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (w: f32[1,16,8], x: f32[1,4,16]) -> f32[1,16,8] {
  %w = f32[1,16,8]{2,1,0} parameter(0), sharding={devices=[4,1,1]<=[4]}
  %x = f32[1,4,16]{2,1,0} parameter(1), sharding={devices=[4,1,1]<=[4]}
  %w2 = f32[16,8]{1,0} reshape(%w)
  %h = f32[1,4,8]{2,1,0} dot(%x, %w2), lhs_contracting_dims={2}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(layer0)/attn/dot_general"}
  %ag = f32[4,4,8]{2,1,0} all-gather(%h), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/jvp(layer0)/attn/dot_general"}
  %ar = f32[4,4,8]{2,1,0} all-reduce(%ag), channel_id=2, replica_groups=[1,4]<=[4], use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/jvp(layer0)/attn/dot_general"}
  %v = f32[4,4,8]{2,1,0} multiply(%ar, %ar), metadata={op_name="jit(step)/jvp(layer0)/attn/mul"}
  %c = f32[] constant(1)
  %m = f32[8,8]{1,0} broadcast(%c), dimensions={}
  %dy = f32[4,4,8]{2,1,0} dot(%v, %m), lhs_contracting_dims={2}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp(layer0))/attn/dot_general"}
  %dx = f32[4,4,8]{2,1,0} all-reduce(%dy), channel_id=3, replica_groups=[1,4]<=[4], use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp(layer0))/attn/dot_general"}
  %dxs = f32[1,4,8]{2,1,0} slice(%dx), slice={[0:1], [0:4], [0:8]}
  %gw = f32[16,8]{1,0} dot(%x, %dxs), lhs_contracting_dims={0,1}, rhs_contracting_dims={0,1}, metadata={op_name="jit(step)/transpose(jvp(layer0))/attn/dot_general"}
  %gar = f32[16,8]{1,0} all-reduce(%gw), channel_id=4, replica_groups=[1,4]<=[4], use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp(layer0))/attn/dot_general"}
  %g3 = f32[1,16,8]{2,1,0} reshape(%gar)
  ROOT %new = f32[1,16,8]{2,1,0} subtract(%w, %g3), metadata={op_name="jit(step)/sub"}
}
""")
    mesh = recover_mesh(m)
    params = state_params(m)
    assert [(p.global_dims, p.weight) for p in params] == [((4, 16, 8), True)]
    (ev,) = collect_evidence(m, mesh, params).values()
    assert ev.ops == {"activations_tokens": ["ag"], "activations": ["ar", "dx"], "grads_all_reduced": ["gar"]}
    assert ev.bytes == {"activations_tokens": 512, "activations": 1024, "grads_all_reduced": 512}
    (axis,) = classify_axes(mesh, collect_evidence(m, mesh, params))
    assert axis.strategy == "tensor" and "weights all-gathered" not in axis.evidence


def test_an_embedded_hlo_proto_keeps_parameter_shardings() -> None:
    """The profile's own HloProto carries each parameter's OpSharding (field 40); read, it prints as the text dump
    does, so a profile analysed without its dump finds the same global shapes (the user's MoE read 128 tokens
    per step without the dump, 256 with it: x f32[4,32,64] tiled [2,1,1] over the data axis is B = 4 x 2 = 8
    sequences of 32 = 256 tokens). Bytes from that profile: the expert weight (tiled 4 ways on dimension 0,
    replicated over the 2-way data axis, devices as an iota [2,4] transposed) and x (identity iota: no T)."""
    from parsers.hlo_proto import HloProtoMessage, module_from_proto
    from traceroof.parallelism import sharding_tiles

    raw = {"w1": ("08031a040401010230014a02020452020100", [1, 64, 128],
                  "{devices=[4,1,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}", (4, 1, 1)),
           "x": ("08031a040201010430014a0108520100", [4, 32, 64],
                 "{devices=[2,1,1,4]<=[8] last_tile_dim_replicate}", (2, 1, 1)),
           "wr": ("", [64, 4], "{replicated}", (1, 1))}
    proto = HloProtoMessage()
    mod = proto.hlo_module
    mod.name, mod.entry_computation_name, mod.entry_computation_id = "jit_train_step", "main", 1
    comp = mod.computations.add(name="main", id=1, root_id=3)
    for k, (name, (hexed, dims, _, _)) in enumerate(raw.items()):
        p = comp.instructions.add(name=name, opcode="parameter", id=k + 1, parameter_number=k)
        p.shape.element_type, p.shape.dimensions[:] = 11, dims
        p.sharding.ParseFromString(bytes.fromhex(hexed))
        p.sharding.SetInParent()
    m = module_from_proto(proto.SerializeToString())
    for name, (_, dims, text, tiles) in raw.items():
        inst = m.entry.by_name[name]
        assert inst.attrs["sharding"] == text, name
        assert sharding_tiles(inst.attrs["sharding"], len(dims)) == tiles, name
    x_global = [d * t for d, t in zip(raw["x"][1], sharding_tiles(m.entry.by_name["x"].attrs["sharding"], 3))]
    assert x_global == [8, 32, 64] and math.prod(x_global[:-1]) == 256


def test_weights_that_enter_a_loop_are_weights_and_adam_moments_are_not() -> None:
    """A user's 4-stage pipeline (2 layers of 128 x 128 per stage, the stages' matmuls inside a fori_loop) read
    "L = 12 MLP layers" with its dump and "L = 3" without: no matmul within reach of the entry parameters, so
    every state array counted as a weight, Adam's mu and nu with w (3 x 8 matrices / 2), over the local
    [1, 2, 128, 128] without the dump's sharding (3 x 2 / 2). Here w [1,2,16,16] tiled 4 ways is [4,2,16,16]:
    8 matrices of 16 x 16, L = 8 / 2 = 4 layers of the book's W_in, W_out; mu is read by the update only."""
    m, = parse_hlo_text("""HloModule step, num_partitions=4, input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (s: (s32[], f32[2,16,16], f32[4,16])) -> (s32[], f32[2,16,16], f32[4,16]) {
  %s = (s32[], f32[2,16,16]{2,1,0}, f32[4,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %w = f32[2,16,16]{2,1,0} get-tuple-element(%s), index=1
  %h = f32[4,16]{1,0} get-tuple-element(%s), index=2
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  %ws = f32[1,16,16]{2,1,0} slice(%w), slice={[0:1], [0:16], [0:16]}
  %w0 = f32[16,16]{1,0} reshape(%ws)
  %y = f32[4,16]{1,0} dot(%h, %w0), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp()/stage/dense0/dot_general"}
  ROOT %t = (s32[], f32[2,16,16]{2,1,0}, f32[4,16]{1,0}) tuple(%n, %w, %y)
}

%cond (c: (s32[], f32[2,16,16], f32[4,16])) -> pred[] {
  %c = (s32[], f32[2,16,16]{2,1,0}, f32[4,16]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %two = s32[] constant(2)
  ROOT %lt = pred[] compare(%ci, %two), direction=LT
}

ENTRY %main (w: f32[1,2,16,16], mu: f32[1,2,16,16], x: f32[4,16]) -> (f32[1,2,16,16], f32[1,2,16,16], f32[]) {
  %w = f32[1,2,16,16]{3,2,1,0} parameter(0), sharding={devices=[4,1,1,1]<=[4]}
  %mu = f32[1,2,16,16]{3,2,1,0} parameter(1), sharding={devices=[4,1,1,1]<=[4]}
  %x = f32[4,16]{1,0} parameter(2), sharding={replicated}
  %w3 = f32[2,16,16]{2,1,0} reshape(%w)
  %zero = s32[] constant(0)
  %init = (s32[], f32[2,16,16]{2,1,0}, f32[4,16]{1,0}) tuple(%zero, %w3, %x)
  %loop = (s32[], f32[2,16,16]{2,1,0}, f32[4,16]{1,0}) while(%init), condition=%cond, body=%body
  %y = f32[4,16]{1,0} get-tuple-element(%loop), index=2
  %c = f32[] constant(0.1)
  %gb = f32[1,2,16,16]{3,2,1,0} broadcast(%c), dimensions={}
  %mu2 = f32[1,2,16,16]{3,2,1,0} add(%mu, %gb)
  %new = f32[1,2,16,16]{3,2,1,0} subtract(%w, %mu2)
  %l = f32[] reduce(%y, %c), dimensions={0,1}, to_apply=%add
  ROOT %out = (f32[1,2,16,16]{3,2,1,0}, f32[1,2,16,16]{3,2,1,0}, f32[]) tuple(%new, %mu2, %l)
}
""")
    from traceroof.mesh_book import model_sizes

    params = state_params(m)
    assert [(p.name, p.global_dims, p.weight) for p in params] == [("w", (4, 2, 16, 16), True),
                                                                  ("mu", (4, 2, 16, 16), False)]
    sizes = model_sizes(m, params)
    assert (sizes.d_model, sizes.d_ff, sizes.layers, sizes.tokens) == (16, 16, 4, 4)


def test_an_expert_axis_that_also_splits_attention_says_so() -> None:
    """The user's 'expert' axis also carried the attention's tensor parallelism (0.229 MB/step of activations
    all-reduced inside layers beside 65.5 kB of all-to-all): the strategy stays expert (the book's arithmetic),
    the evidence opens with the second role; an expert axis with no activation collectives has none."""
    from traceroof.mesh import Mesh, MeshAxis
    from traceroof.parallelism import AxisEvidence

    mesh = Mesh((MeshAxis("axis0", 4, 1),), 4, True, ())
    both, moe = AxisEvidence(), AxisEvidence()
    for ev in (both, moe):
        ev.add("all_to_all", 65_536, "all-to-all")
    both.add("activations", 229_376, "all-reduce")
    (a,), (b,) = classify_axes(mesh, {"axis0": both}), classify_axes(mesh, {"axis0": moe})
    assert (a.strategy, b.strategy) == ("expert", "expert")
    assert a.evidence.startswith("also tensor parallelism") and "also" not in b.evidence


def test_an_all_to_all_in_the_backward_pass_alone_makes_no_expert_axis() -> None:
    """A user's FSDP step (no experts) read as an expert axis: XLA resharded 12 LayerNorm gradients by all-to-all in
    the backward pass. Here: weights gathered before a forward matmul, and one all-to-all of a backward value; the
    axis is FSDP, the all-to-all in its evidence as what it is. A forward all-to-all (an MoE's dispatch) still
    makes the axis expert."""
    hlo = """HloModule step, num_partitions=4, input_output_alias={ {0}: (0, {}, may-alias) }

ENTRY %main (w: f32[4,16], x: f32[8,16]) -> f32[4,16] {
  %w = f32[4,16]{1,0} parameter(0), sharding={devices=[4,1]<=[4]}
  %x = f32[8,16]{1,0} parameter(1), sharding={replicated}
  %wg = f32[16,16]{1,0} all-gather(%w), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/jvp(mlp)/dot_general"}
  %h = f32[8,16]{1,0} dot(%x, %wg), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(mlp)/dot_general"}
  %t = f32[8,16]{1,0} PHASE_OP, metadata={op_name="jit(step)/PHASE(mlp)/norm/mul"}
  %g = f32[16,16]{1,0} dot(%x, %t), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp(mlp))/dot_general"}
  %gs = f32[4,16]{1,0} slice(%g), slice={[0:4], [0:16]}
  ROOT %new = f32[4,16]{1,0} subtract(%w, %gs), metadata={op_name="jit(step)/sub"}
}
"""
    a2a = "all-to-all(%h), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}"
    for phase, strategy, evidence in (("transpose(jvp(mlp))", "fsdp", "all-to-all outside the forward pass"),
                                      ("jvp(mlp)", "expert", "tokens exchanged by all-to-all")):
        m, = parse_hlo_text(hlo.replace("PHASE_OP", a2a).replace("PHASE(mlp)", phase))
        mesh = recover_mesh(m)
        (axis,) = classify_axes(mesh, collect_evidence(m, mesh, state_params(m)))
        assert axis.strategy == strategy and evidence in axis.evidence, (phase, axis)


def test_a_pipeline_loop_states_its_bubble() -> None:
    """A user's GPipe step (4 stages over 4 devices, ppermute inside a fori_loop of M + S - 1 = 11 iterations for
    8 micro-batches) showed the bubble only as a formula while MFU counted the bubble's work: the note now gives
    (S - 1)/(M + S - 1) = 3/11 = 27 % of the loop (How to Scale Your Model §5) and points to
    --model-flops-per-step. Hand-written HLO of that loop."""
    m, = parse_hlo_text("""HloModule step, num_partitions=4

%body (s: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %s = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %h = f32[8,16]{1,0} get-tuple-element(%s), index=1
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  %y = f32[8,16]{1,0} multiply(%h, %h), metadata={op_name="jit(step)/jvp()/stage/mul"}
  %p = f32[8,16]{1,0} collective-permute(%y), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, metadata={op_name="jit(step)/jvp()/ppermute"}
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%n, %p)
}

%cond (c: (s32[], f32[8,16])) -> pred[] {
  %c = (s32[], f32[8,16]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %k = s32[] constant(11)
  ROOT %lt = pred[] compare(%ci, %k), direction=LT
}

ENTRY %main (x: f32[8,16]) -> f32[16,8] {
  %x = f32[8,16]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %x)
  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body
  %y = f32[8,16]{1,0} get-tuple-element(%loop), index=1
  ROOT %yt = f32[16,8]{1,0} transpose(%y), dimensions={1,0}
}
""")
    v5p = get_chip("v5p")
    rep = book_on_mesh([m], v5p, parse_topology("2x2x1", v5p))
    assert [(r.axis, r.size, r.strategy) for r in rep.rows] == [("axis0", 4, "pipeline")]
    (bubble,) = [n for n in rep.notes if n.startswith("pipeline axis axis0 (4 stages)")]
    assert "M = 11 − 4 + 1 = 8 micro-batches" in bubble and "= 3/11 = 27% of the loop's time" in bubble
    assert bubble.endswith("pass --model-flops-per-step for the model's")



def test_a_conv_net_gets_strategies_without_the_mlp_arithmetic() -> None:
    """A user's data-parallel UNet (53 convolutions, 35 dots) read "D = 64, F = 64, L = 39 MLP layer(s), 16 tokens
    per step" and T_math 0.143 ns per layer, 8 ns per step, where the same report's roofline expected 43.5 us: the
    book's layer In[B, D]·W_in[D, F]·W_out[F, D] leaves out a convolution's positions and taps. The strategies stay;
    the arithmetic is left out with a note saying why."""
    m, = parse_hlo_text(_CONV_NET)
    v5p = get_chip("v5p")
    rep = book_on_mesh([m], v5p, parse_topology("2x2x2", v5p))
    assert [(r.axis, r.size, r.strategy) for r in rep.rows] == [("axis0", 8, "data")]
    assert rep.sizes is None and math.isnan(rep.rows[0].t_math_s) and not rep.what_if
    assert any(n.startswith("4 convolutions to 2 dots: the book's per-layer arithmetic") for n in rep.notes)


_CONV_NET = """HloModule step, num_partitions=8, input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias), {2}: (2, {}, may-alias) }

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (w: f32[64,64], k1: f32[3,3,16,16], k2: f32[3,3,16,16], x: f32[32,64], img: f32[4,16,16,16]) -> (f32[64,64], f32[3,3,16,16], f32[3,3,16,16]) {
  %w = f32[64,64]{1,0} parameter(0)
  %k1 = f32[3,3,16,16]{3,2,1,0} parameter(1)
  %k2 = f32[3,3,16,16]{3,2,1,0} parameter(2)
  %x = f32[32,64]{1,0} parameter(3)
  %img = f32[4,16,16,16]{3,2,1,0} parameter(4)
  %h = f32[32,64]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(Net)/temb/dot_general"}
  %c1 = f32[4,16,16,16]{3,2,1,0} convolution(%img, %k1), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, metadata={op_name="jit(step)/jvp(Net)/conv1/conv_general_dilated"}
  %c2 = f32[4,16,16,16]{3,2,1,0} convolution(%c1, %k2), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, metadata={op_name="jit(step)/jvp(Net)/conv2/conv_general_dilated"}
  %gw = f32[64,64]{1,0} dot(%x, %h), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp(Net))/temb/dot_general"}
  %g1 = f32[3,3,16,16]{3,2,1,0} convolution(%img, %c2), window={size=16x16 pad=1_1x1_1}, dim_labels=f01b_i01o->01bf, metadata={op_name="jit(step)/transpose(jvp(Net))/conv1/conv_general_dilated"}
  %g2 = f32[3,3,16,16]{3,2,1,0} convolution(%c1, %c2), window={size=16x16 pad=1_1x1_1}, dim_labels=f01b_i01o->01bf, metadata={op_name="jit(step)/transpose(jvp(Net))/conv2/conv_general_dilated"}
  %ar = (f32[64,64]{1,0}, f32[3,3,16,16]{3,2,1,0}, f32[3,3,16,16]{3,2,1,0}) all-reduce(%gw, %g1, %g2), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp(Net))/conv1/conv_general_dilated"}
  %a0 = f32[64,64]{1,0} get-tuple-element(%ar), index=0
  %a1 = f32[3,3,16,16]{3,2,1,0} get-tuple-element(%ar), index=1
  %a2 = f32[3,3,16,16]{3,2,1,0} get-tuple-element(%ar), index=2
  %n0 = f32[64,64]{1,0} subtract(%w, %a0)
  %n1 = f32[3,3,16,16]{3,2,1,0} subtract(%k1, %a1)
  %n2 = f32[3,3,16,16]{3,2,1,0} subtract(%k2, %a2)
  ROOT %out = (f32[64,64]{1,0}, f32[3,3,16,16]{3,2,1,0}, f32[3,3,16,16]{3,2,1,0}) tuple(%n0, %n1, %n2)
}
"""


def test_stacked_expert_weights_count_their_layers() -> None:
    """A lax.scan over MoE layers stacks each expert weight as [L, E, D, F]: L layers, E experts (the s30 trial's
    3 scanned MoE blocks read "L = 1", so its what-if T_comm/step equalled the 1-layer program's). Unstacked
    [E, D, F] weights are one layer; a dense scan's [L, D, F] stays L."""
    from traceroof.mesh_book import model_sizes
    from traceroof.parallelism import StateParam

    m, = parse_hlo_text("""HloModule step

ENTRY %main (x: f32[64,16]) -> f32[64,16] {
  ROOT %x = f32[64,16]{1,0} parameter(0)
}
""")

    def weights(*dims: tuple[int, ...]) -> list[StateParam]:
        return [StateParam(10 + i, f"w{i}", d, d, "f32", 4 * math.prod(d), True) for i, d in enumerate(dims)]

    stacked = model_sizes(m, weights((3, 8, 16, 32), (3, 8, 32, 16)), experts=True)
    assert (stacked.d_model, stacked.d_ff, stacked.layers) == (16, 32, 3)
    assert model_sizes(m, weights((8, 16, 32), (8, 32, 16)), experts=True).layers == 1
    assert model_sizes(m, weights((3, 16, 32), (3, 32, 16))).layers == 3


def test_a_collective_over_two_axes_is_said_to_be_in_both_rows() -> None:
    """dp4 x fsdp2's gradient all-reduce runs over both axes: its time is in both rows' measured comm/step, which
    then add up to more than the collective took (the s30 trial's MoE: 4.3 + 9.3 ms of 10.4 ms). A note says so."""
    from traceroof.analysis import analyze

    a = analyze(FIXTURES / "par_dp4_fsdp2", chip=FIXTURES / "fixture_host.toml")
    p = a.parallelism
    (note,) = [n for n in p.notes if "more than one axis" in n]
    assert note.startswith("1 collective(s) run over more than one axis (all-reduce.8)")
    coll = a.collectives.set_index("hlo_op")["time_per_step_s"]
    assert sum(r.measured_comm_s for r in p.rows) > coll.sum()  # all-reduce.8 counted in both rows
    assert sum(r.measured_comm_s for r in p.rows) == pytest.approx(coll.sum() + coll["all-reduce.8"])


_LSTM_DP = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    class CharLSTM(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Embed(12, 8)(x)
            h = nn.RNN(nn.OptimizedLSTMCell(16), name="lstm_0")(h)
            return nn.Dense(12)(h)

    model, tx = CharLSTM(), optax.adamw(1e-3)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params = jax.device_put(model.init(jax.random.PRNGKey(0), jnp.zeros((16, 8), jnp.int32)), NamedSharding(mesh, P()))
    opt = jax.device_put(tx.init(params), NamedSharding(mesh, P()))

    def step(p, o, x, y):
        g = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean())(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    x = jax.device_put(jnp.zeros((16, 8), jnp.int32), NamedSharding(mesh, P("data")))
    print(jax.jit(step, donate_argnums=(0, 1)).lower(params, opt, x, x).compile().as_text())
""")


def test_gradients_reduced_inside_a_recurrent_loop_are_data_parallel() -> None:
    """A data-parallel Flax LSTM (batch sharded, weights replicated; s34 trial) was called tensor-parallel: XLA
    all-reduces the cell's weight gradients inside the backward time loop, concatenated (the four gates' kernels
    as one [4H, H] array, no weight's shape). Gradients of the backward pass that feed no matmul are gradients."""
    out = subprocess.run([sys.executable, "-c", _LSTM_DP], capture_output=True, text=True, timeout=300, check=True)
    (m,) = parse_hlo_text(out.stdout)
    mesh = recover_mesh(m)
    (row,) = classify_axes(mesh, collect_evidence(m, mesh, state_params(m)))
    assert (row.size, row.strategy) == (8, "data") and "activations" not in row.evidence, row
    in_loop = [pc for pc in mesh.collectives if pc.computation != m.entry.name and pc.collective.kind == "all-reduce"]
    assert in_loop  # the case this is about: the loop body's all-reduces


_SYNC_BN_DP = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    class Net(nn.Module):  # the Flax ImageNet example's ResNet: BatchNorm statistics averaged over the devices
        axis: str | None

        @nn.compact
        def __call__(self, x):
            norm = lambda **k: nn.BatchNorm(use_running_average=False, axis_name=self.axis, **k)
            x = nn.relu(norm(name="bn_init")(nn.Conv(16, (3, 3), use_bias=False, name="conv_init")(x)))
            for width in (32, 64):  # blocks with a projected residual
                y = nn.relu(norm()(nn.Conv(width, (3, 3), (2, 2), use_bias=False)(x)))
                y = norm()(nn.Conv(width, (3, 3), use_bias=False)(y))
                x = nn.relu(y + norm(name=f"norm_proj{width}")(nn.Conv(width, (1, 1), (2, 2), use_bias=False)(x)))
            return nn.Dense(10)(x.mean(axis=(1, 2)))

    tx = optax.sgd(0.1, momentum=0.9)

    def step(model, v, o, x, y, pmean):
        def loss(p):
            logits, s = model.apply({"params": p, "batch_stats": v["batch_stats"]}, x, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), s
        (_, s), g = jax.value_and_grad(loss, has_aux=True)(v["params"])
        u, o = tx.update(pmean(g), o, v["params"])
        return {"params": optax.apply_updates(v["params"], u), **s}, o

    x, y = jnp.ones((8, 16, 16, 16, 3)), jnp.zeros((8, 16), jnp.int32)
    v = Net(None).init(jax.random.PRNGKey(0), x[0])
    if sys.argv[1] == "pmap":
        net = Net("batch")
        f = jax.pmap(lambda v, o, x, y: step(net, v, o, x, y, lambda g: jax.lax.pmean(g, "batch")), "batch")
        rep = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (8, *a.shape)), t)
        print(f.lower(rep(v), rep(tx.init(v["params"])), x, y).compile().as_text())
    else:  # jit over a data mesh: XLA's partitioner all-reduces the gradients and the statistics
        mesh = Mesh(np.array(jax.devices()), ("data",))
        put = lambda t, spec: jax.device_put(t, NamedSharding(mesh, spec))
        f = jax.jit(lambda v, o, x, y: step(Net(None), v, o, x, y, lambda g: g))
        xs, ys = put(x.reshape(128, 16, 16, 3), P("data")), put(y.reshape(128), P("data"))
        print(f.lower(put(v, P()), put(tx.init(v["params"]), P()), xs, ys).compile().as_text())
""")


@pytest.mark.parametrize("how", ["pmap", "jit"])
def test_batch_norm_statistics_beside_gradients_are_data_parallel(how: str) -> None:
    """s37 trial: a data-parallel ResNet with cross-replica BatchNorm was called tensor-parallel. XLA's combiner
    joined the weight gradients (306 kB) and a BatchNorm psum that flows on into the backward convolutions into
    one all-reduce, read whole as activations; and the statistics all-reduced in the forward pass (3 kB,
    activations of no weight's shape) outweighed no gradients. Each part of a combined collective is read by its
    own data flow, and an axis is tensor-parallel only when its activations outweigh its gradients."""
    out = subprocess.run([sys.executable, "-c", _SYNC_BN_DP, how], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (m,) = parse_hlo_text(out.stdout)
    mesh = recover_mesh(m)
    (row,) = classify_axes(mesh, collect_evidence(m, mesh, state_params(m)))
    assert (row.size, row.strategy) == (8, "data"), row
    combined = [pc for pc in mesh.collectives if pc.collective.kind == "all-reduce"
                and len(m.computations[pc.computation].by_name[pc.name].shape.leaves()) > 1]
    assert combined  # the case this is about: XLA combined the reductions


def test_unknown_tokens_are_said_so_not_printed_as_nan() -> None:
    """A Neural ODE's inputs are states of width 2, no token ids and no rows of width D (s38 trial: 'nan tokens per
    step (nan per device)')."""
    from traceroof.mesh_book import ModelSizes, _mesh_notes

    sizes = ModelSizes(64, 64, 1, math.nan, math.nan, "f32", 4, 8192, 32768, 65536)
    first = _mesh_notes(sizes, [], {}, 1e12, 8)[0]
    assert "tokens per step unknown (no input of the step is token ids or rows of a weight matrix's width)" in first
    assert "nan" not in first
    known = _mesh_notes(sizes.__class__(64, 64, 1, 4096.0, 512.0, "f32", 4, 8192, 32768, 65536), [], {}, 1e12, 8)[0]
    assert "4,096 tokens per step (512 per device)" in known


_SHARDED_WHILE = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))

    def step(w, x):
        def solve(y):  # iterate until every trajectory is done: jnp.any over the sharded batch
            return jax.lax.while_loop(lambda y: jnp.any(jnp.abs(y) > 1e-3), lambda y: 0.5 * jnp.tanh(y @ w), y)
        loss, g = jax.value_and_grad(lambda w: jnp.sum(solve(x) @ w))(w)
        return w - 0.1 * g, loss

    w = jax.device_put(jnp.eye(16) * 0.9, NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P("data")))
    print(jax.jit(step, donate_argnums=(0,)).lower(w, x).compile().as_text())
""")


def test_a_loop_condition_agreed_over_the_devices_is_said_so() -> None:
    """s38 trial (a diffrax solve, batch over 8 devices): the while loops' exit tests, jnp.any over the sharded
    batch, are pred[] all-reduces run in every iteration, and were listed as "scalars reduced (loss, norms)". In
    XLA's compiled HLO of a sharded while loop they are named as loop conditions; the loss stays a scalar."""
    out = subprocess.run([sys.executable, "-c", _SHARDED_WHILE], capture_output=True, text=True, timeout=300,
                         check=True)
    (m,) = parse_hlo_text(out.stdout)
    mesh = recover_mesh(m)
    # XLA's own text: the pred[] all-reduces whose JAX scope is a while loop's
    conds = set(re.findall(r"%(all-reduce[\w.]*) = pred\[\] all-reduce\(.*op_name=\"[^\"]*/while/", out.stdout))
    assert conds  # XLA made the condition one over the devices
    (row,) = classify_axes(mesh, collect_evidence(m, mesh, state_params(m)))
    assert row.strategy == "data", row
    assert re.search(r"while-loop conditions agreed every iteration \(pred all-reduce: each iteration waits for every "
                     r"device\) \([\d.]+ kB/step, ([\w.-]+(, )?)+", row.evidence), row.evidence
    listed = row.evidence.split("while-loop conditions")[1]
    assert all(name in listed for name in sorted(conds)[:3])


_FSDP_BF16 = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    class MLP(nn.Module):  # f32 parameters, bf16 compute
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = nn.gelu(nn.Dense(128, dtype=jnp.bfloat16, name=f"up_{i}")(x))
                x = nn.Dense(64, dtype=jnp.bfloat16, name=f"down_{i}")(x)
            return x

    model, tx = MLP(), optax.adam(1e-3)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((16, 64)))
    shard = jax.tree.map(lambda a: NamedSharding(mesh, P("fsdp") if a.ndim == 2 else P()), params)
    params = jax.device_put(params, shard)

    def step(p, o, x):
        g = jax.grad(lambda p: jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    x = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P(("data", "fsdp"))))
    f = jax.jit(step, out_shardings=(shard, None), donate_argnums=(0, 1))
    print(f.lower(params, tx.init(params), x).compile().as_text())
""")


def test_a_combined_gradient_all_reduce_cut_to_each_shard_is_a_reduce_scatter() -> None:
    """FSDP with f32 weights and bf16 compute (s40 trial, a Llama on a 2 x 4 data x fsdp mesh): XLA:CPU combines
    the weight gradients' all-reduces into one of a tuple, and each part runs get-tuple-element -> convert to bf16
    -> a fusion holding the dynamic-slice that keeps this device's shard: a reduce-scatter as XLA:CPU lowers it.
    The search for the dynamic-slice stopped after 2 users, one of them the get-tuple-element, and the trial's
    11.6 MB of FSDP gradient reduce-scatters read as "gradients all-reduced". The six weight gradients (64 x 128
    f32 each, 6 x 32 kB = 196,608 B) are the reduce-scatter's."""
    out = subprocess.run([sys.executable, "-c", _FSDP_BF16], capture_output=True, text=True, timeout=300, check=True)
    (m,) = parse_hlo_text(out.stdout)
    entry = m.entry
    users = entry.users()
    # the case at hand, read from the HLO: a tuple all-reduce of the six weight gradients whose every part is
    # get-tuple-element -> convert fusion -> a fusion named for its dynamic-slice
    (combined,) = [i for i in entry.instructions if i.opcode == "all-reduce" and i.shape.tuple_shapes
                   and len(i.shape.tuple_shapes) == 6 and all(p.elements == 64 * 128 for p in i.shape.tuple_shapes)]
    for gte in users[combined.name]:
        (convert,) = users[gte.name]
        assert gte.opcode == "get-tuple-element" and "convert" in convert.name
        assert any("dynamic-slice" in u.name for u in users[convert.name]), convert.name
    mesh = recover_mesh(m)
    ev = collect_evidence(m, mesh, state_params(m))
    fsdp = next(e for e in ev.values() if "weights_gathered" in e.ops)
    assert fsdp.ops["grads_all_reduce_sliced"] == [combined.name]
    assert fsdp.bytes["grads_all_reduce_sliced"] == pytest.approx(6 * 64 * 128 * 4)
    assert combined.name not in fsdp.ops.get("grads_all_reduced", [])


def test_a_norm_scale_gathered_from_the_step_input_is_not_an_updated_weight() -> None:
    """FSDP gathers an RMSNorm's scale (an input of the step, sharded 4 ways) for the backward's elementwise
    multiply, with no matmul within reach: the s40 trial's all-gather.36 f32[256] of param.4 read as "updated
    weights all-gathered". A value gathered from the step's own input parameter has not been updated. The
    gather of the updated weight at the step's end stays so."""
    m, = parse_hlo_text("""HloModule step, num_partitions=4, input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }

ENTRY %main (s: f32[64], w: f32[16,256]) -> (f32[64], f32[16,256], f32[256]) {
  %s = f32[64]{0} parameter(0), sharding={devices=[4]<=[4]}
  %w = f32[16,256]{1,0} parameter(1), sharding={devices=[4,1]<=[4]}
  %sc = f32[256]{0} all-gather(%s), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/transpose(jvp(Llama))/layers_0/attn_norm/mul"}
  %wg = f32[64,256]{1,0} all-gather(%w), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/jvp(Llama)/layers_0/mlp/all_gather"}
  %z = f32[] constant(0)
  %x = f32[8,256]{1,0} broadcast(%z), dimensions={}
  %h = f32[8,64]{1,0} dot(%x, %wg), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(step)/jvp(Llama)/layers_0/mlp/dot_general"}
  %gs = f32[256]{0} reduce(%x, %z), dimensions={0}, to_apply=%add
  %m = f32[256]{0} multiply(%sc, %gs), metadata={op_name="jit(step)/transpose(jvp(Llama))/layers_0/attn_norm/mul"}
  %ms = f32[64]{0} slice(%m), slice={[0:64]}
  %ns = f32[64]{0} subtract(%s, %ms)
  %hs = f32[16,256]{1,0} slice(%wg), slice={[0:16], [0:256]}
  %nw = f32[16,256]{1,0} subtract(%w, %hs)
  %out = f32[256]{0} all-gather(%ns), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/all_gather"}
  ROOT %t = (f32[64]{0}, f32[16,256]{1,0}, f32[256]{0}) tuple(%ns, %nw, %out)
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(%x, %y)
}
""")
    mesh = recover_mesh(m)
    (evidence,) = collect_evidence(m, mesh, state_params(m)).values()
    assert "sc" in evidence.ops["weights_gathered"] and "wg" in evidence.ops["weights_gathered"], evidence.ops
    assert evidence.ops.get("weights_gathered_after_update") == ["out"], evidence.ops
