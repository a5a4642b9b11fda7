"""Memory view (issue 14 part 3 and the memory half of part 4): XLA's buffer-assignment reports read and checked
against XLA's own totals, remat on -> off, traceroof's live-range estimate against XLA, categories, the book's
model, allocator events, reports, diff, and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parsers.buffer_assignment import (MemoryReportError, read_buffer_assignment, read_live_range,
                                       read_memory_usage_report, report_files)
from parsers.hlo_text import parse_hlo_file
from traceroof.analysis import analyze
from traceroof.diff import diff, side_from_analysis, side_from_json
from traceroof.memory import CATEGORIES, allocator_peaks, program_memory, value_categories
from traceroof.report.data import render_json
from traceroof.report.diff import render_diff_text
from traceroof.report.html import render_html
from traceroof.report.text import render_markdown, render_terminal
from traceroof.scopes import assign_scopes
from traceroof.units import fmt_bytes

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DUMPS = sorted(f for f in FIXTURES.glob("*/hlo/*after_optimizations.txt") if report_files(f))
THIRD_PARTY = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "third_party"


@pytest.fixture(scope="module")
def remat():
    return {name: analyze(FIXTURES / f"mem_remat_{name}") for name in ("on", "off")}


def _facts(name: str) -> dict:
    return json.loads((FIXTURES / f"mem_remat_{name}" / "facts.json").read_text())


@pytest.mark.parametrize("dump", DUMPS, ids=lambda f: f"{f.parts[-3]}/{f.name.split('.')[1]}")
def test_peak_equals_xla_memory_usage_report_total(dump):
    files = report_files(dump)
    xla = read_memory_usage_report(files["memory-usage-report"]).total_bytes()
    pm = program_memory(parse_hlo_file(dump)[0], dump)
    assert pm.source == "xla_buffer_assignment"
    assert abs(pm.peak_bytes - xla) <= 0.01 * xla
    assert pm.xla_report_total_bytes == xla
    assert sum(pm.categories.values()) == pm.peak_bytes


def test_live_range_estimate_against_xla_where_both_exist():
    """traceroof's sequential estimate (the fallback) against XLA's allocation total on every train step with a
    buffer assignment: measured 0.81x (Equinox) to 1.01x (Keras, remat off); XLA's total also holds outputs
    beside the donated-or-not state and the heap's packing, so the estimate is usually below it."""
    ratios = {}
    for dump in DUMPS:
        if "train_step" not in dump.name:
            continue
        pm = program_memory(parse_hlo_file(dump)[0], dump)
        ratios[dump.parts[-3]] = pm.live_range_peak_bytes / pm.peak_bytes
    assert len(ratios) >= 7
    assert all(0.75 <= r <= 1.1 for r in ratios.values()), ratios
    off = program_memory(parse_hlo_file(next(d for d in DUMPS if "mem_remat_off" in str(d)))[0], None)
    assert off.source == "traceroof_live_ranges" and sum(off.categories.values()) == off.peak_bytes


def test_the_estimate_follows_xlas_schedule_and_is_not_shown_as_a_check(remat):
    """The profile's HloProto lists instructions in another order than the schedule: the estimate now takes
    XLA's schedule from the live-range file, so the profile's module and the text dump agree (mem_remat_off:
    10.23 MB from the proto's order before, 10.71 MB now; the user's remat.py: 53.5 MB -> 62.4 MB of 75 MB,
    XLA's own live values 60.3 MB). What is left is XLA's packing, so the line says so and is no "check"."""
    off = remat["off"].memory.peak
    dump = next(d for d in DUMPS if "mem_remat_off" in str(d))
    text = program_memory(parse_hlo_file(dump)[0], dump).live_range_peak_bytes
    assert abs(off.live_range_peak_bytes - text) <= 8  # the proto carries no input_output_alias: two s32 counters
    assert 0.9 <= off.live_range_peak_bytes / off.xla_live_range_peak_bytes <= 1.0
    text = render_terminal(remat["off"])
    checks = next(line for line in text.splitlines() if line.startswith("checks"))
    assert "traceroof" not in checks
    assert "traceroof's own estimate (live values only, no XLA heap packing" in text


def test_remat_off_raises_peak_memory_as_xla_says(remat):
    on, off = (remat[k].memory for k in ("on", "off"))
    for name, view in (("on", on), ("off", off)):
        f = _facts(name)
        assert view.peak_bytes_per_device == f["xla_memory_usage_report_total_bytes"]
        m = f["xla_memory_analysis"]  # compiled.memory_analysis(): arguments + outputs - aliased + temporaries
        xla = m["argument_size_in_bytes"] + m["output_size_in_bytes"] - m["alias_size_in_bytes"] + m["temp_size_in_bytes"]
        assert abs(view.peak_bytes_per_device - xla) <= 0.01 * xla
        # at remat off's peak XLA keeps a 4 B loop counter in the head bias's buffer (the bias was copied out)
        assert f["parameter_bytes"] - 4 * (name == "off") == view.peak.categories["parameters"]
        assert view.peak.categories["optimizer_state"] == 2 * f["parameter_bytes"] + 8  # Adam mu, nu, 2 counters
        assert view.peak.categories["outputs"] < 1024  # the state is donated: updated in place
    ratio = off.peak_bytes_per_device / on.peak_bytes_per_device
    xla_ratio = _facts("off")["xla_memory_usage_report_total_bytes"] / _facts("on")["xla_memory_usage_report_total_bytes"]
    assert ratio == pytest.approx(xla_ratio, rel=0.01) and ratio > 2
    # remat keeps only the scan carry per layer; without it the forward leaves several [batch, seq, d_ff] tensors
    assert off.peak.book.activations_bytes > 5 * on.peak.book.activations_bytes
    assert off.peak.categories["activations"] - on.peak.categories["activations"] > 5e6


@pytest.mark.parametrize("dump", DUMPS, ids=lambda f: f"{f.parts[-3]}/{f.name.split('.')[1]}")
def test_the_table_and_the_split_share_one_categorisation(dump):
    """A buffer's category in the largest-buffers table is the one its bytes are counted under in the split:
    the table's bytes per category never exceed the split's (before: tp_mlp's four 524 kB weight gradients
    in the output buffers were "gradients" in the table while the split counted them as outputs)."""
    pm = program_memory(parse_hlo_file(dump)[0], dump)
    shown: dict[str, int] = {}
    for b in pm.largest:
        shown[b.category] = shown.get(b.category, 0) + b.size_bytes
    assert all(n <= pm.categories[c] for c, n in shown.items()), (shown, pm.categories)


# The user's hostbound.py step (w - 0.1 * grad, state not donated), its dump cut to plain ops; the buffer
# assignment and live ranges are XLA's, as written for it. The gradient ``dot`` and the new weight share the
# output buffer: at the peak the update writes the new weight over the gradient.
HOSTBOUND_HLO = """HloModule jit_step, entry_computation_layout={(f32[512,512]{1,0}, f32[256,512]{1,0})->f32[512,512]{1,0}}

ENTRY %main.1 (w.1: f32[512,512], x.1: f32[256,512]) -> f32[512,512] {
  %w.1 = f32[512,512]{1,0} parameter(0), metadata={op_name="w"}
  %x.1 = f32[256,512]{1,0} parameter(1), metadata={op_name="x"}
  %ynn_fusion = f32[256,512]{1,0} dot(%x.1, %w.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp()/dot_general"}
  %multiply_add_fusion = f32[256,512]{1,0} tanh(%ynn_fusion), metadata={op_name="jit(step)/transpose(jvp())/add_any"}
  %dot = f32[512,512]{1,0} dot(%x.1, %multiply_add_fusion), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp())/transpose"}
  ROOT %multiply_subtract_fusion = f32[512,512]{1,0} subtract(%w.1, %dot), metadata={op_name="jit(step)/sub"}
}
"""
HOSTBOUND_BA = """BufferAssignment:
allocation 0: size 1048576, output shape is |f32[512,512]|, maybe-live-out:
 value: <22 ynn_fusion @0> (size=524288,offset=0): f32[256,512]{1,0}
 value: <24 dot @0> (size=1048576,offset=0): f32[512,512]{1,0}
 value: <25 multiply_subtract_fusion @0> (size=1048576,offset=0): f32[512,512]{1,0}
allocation 1: size 1048576, parameter 0, shape |f32[512,512]| at ShapeIndex {}:
 value: <20 w.1 @0> (size=1048576,offset=0): f32[512,512]{1,0}
allocation 2: size 524288, parameter 1, shape |f32[256,512]| at ShapeIndex {}:
 value: <21 x.1 @0> (size=524288,offset=0): f32[256,512]{1,0}
allocation 3: size 524288, preallocated-temp:
 value: <23 multiply_add_fusion @0> (size=524288,offset=0): f32[256,512]{1,0}
"""
HOSTBOUND_LIVE = """HloLiveRange (max 6):
  InstructionSequence:
    0:w.1
    1:x.1
    2:ynn_fusion
    3:multiply_add_fusion
    4:dot
    5:multiply_subtract_fusion
  BufferLiveRange:
    w.1{}:0-6
    x.1{}:0-6
    ynn_fusion{}:2-3
    multiply_add_fusion{}:3-4
    dot{}:4-5
    multiply_subtract_fusion{}:5-6
  Live ranges at 5 (peak):
    dot{}: 1048576 bytes (cumulative: 1048576 bytes)
    multiply_subtract_fusion{}: 1048576 bytes (cumulative: 2097152 bytes)
    w.1{}: 1048576 bytes (cumulative: 3145728 bytes)
    x.1{}: 524288 bytes (cumulative: 3670016 bytes)
"""


def test_an_updated_weight_is_never_an_activation(tmp_path):
    """hostbound.py: before, the table showed ``dot`` as gradients (no gradients in the split) and the new
    weight as activations. The new weight is an output (not donated), counted once in its buffer; the
    gradient it overwrites in place is not listed beside it."""
    dump = tmp_path / "module_0012.jit_step.cpu_after_optimizations.txt"
    dump.write_text(HOSTBOUND_HLO)
    (tmp_path / f"{dump.stem}-buffer-assignment.txt").write_text(HOSTBOUND_BA)
    (tmp_path / f"{dump.stem}-live-range.txt").write_text(HOSTBOUND_LIVE)
    pm = program_memory(parse_hlo_file(dump)[0], dump)
    assert [(b.name, b.category) for b in pm.largest] == [
        ("multiply_subtract_fusion", "outputs"), ("w.1", "parameters"), ("x.1", "inputs")]
    assert {c: n for c, n in pm.categories.items() if n} == {
        "parameters": 1048576, "inputs": 524288, "outputs": 1048576, "activations": 524288}  # the temp block
    # the saved activation: the forward dot's output, read by the backward (x is an input, w a weight)
    assert pm.book.activations_bytes == 256 * 512 * 4
    # the same categories from the fixtures: returned updates are outputs without donation, the updated
    # parameters and optimizer state with it
    for fixture, expected in (("fw_scan_remat", {"outputs"}), ("mem_remat_on", {"parameters", "optimizer_state"})):
        module = parse_hlo_file(next(d for d in DUMPS if fixture in str(d) and "train_step" in d.name))[0]
        category_of = value_categories(module, assign_scopes(module))
        got = {category_of(n) for n in module.entry.root.operands}
        assert got == expected, (fixture, got)


def test_saved_activations_are_what_the_forward_leaves_for_the_backward():
    """The book's activations term on the scan + remat fixtures (batch 16 x seq 16, d_model 64, d_ff 256, 4
    layers, f32), counted by hand. With remat the forward scan keeps each layer's input, f32[4,16,16,64]
    (262144 B), and leaves its final carry, f32[16,16,64] (65536 B), and the head's output, f32[256,64]
    (65536 B), to the backward: 393216 B. Before, the forward ``while``'s whole tuple was counted, the weights
    it carries included: 941060 B on mem_remat_on and 924676 B on fw_scan_remat, more than that program's
    whole temporaries block (721264 B). Without remat the scan also stacks what the backward of LayerNorm,
    Dense and gelu reads: 6 x f32[4,16,16,256] + 4 x f32[4,16,16,64] + LayerNorm statistics (16384 + 1024 B)
    + the same carry and head output: 7488512 B. (The user's programs: remat.py REMAT=1 11.0 MB -> 2.62 MB =
    4 layer inputs of 8x64x256 f32, 2.10 MB, + the final carry 0.52 MB; fsdp.py 6.13 MB -> 884736 B = 3 layers
    x 32 tokens x (256 + 1024 + 1024) x 4 B, the gathered weights no longer counted.)"""
    def saved(fixture):
        dump = next(d for d in DUMPS if fixture in str(d) and "train_step" in d.name)
        return program_memory(parse_hlo_file(dump)[0], dump).book.activations_bytes

    carry_and_head = 16 * 16 * 64 * 4 + 256 * 64 * 4
    assert saved("mem_remat_on") == saved("fw_scan_remat") == 4 * 16 * 16 * 64 * 4 + carry_and_head == 393216
    assert saved("mem_remat_off") == (6 * 4 * 16 * 16 * 256 * 4 + 4 * 4 * 16 * 16 * 64 * 4 + 16384 + 1024
                                      + carry_and_head) == 7488512


def test_gradient_accumulation_holds_accumulators_and_one_micro_batch_of_activations():
    """mem_accum: mem_remat_on's model and batch of 16 as 4 micro-batches of 4 in a lax.scan that adds each
    micro-batch's gradients into accumulators (a user's Llama-style FSDP step, 4 micro-batches, read 125 kB of
    gradients for its 985,600 B of accumulators and 985,600 B of saved activations: the accumulators). XLA
    keeps the accumulators in its temporaries block as loop-carried (phi) values, which the split skipped; the
    forward and backward run in the loop body, so the activations live at once are one micro-batch's: by hand
    4 layer inputs f32[4,4,16,64] + the final carry f32[4,16,64] + the head's output f32[64,64] = 98,304 B,
    a quarter of mem_remat_on's 393,216 B."""
    facts = json.loads((FIXTURES / "mem_accum" / "facts.json").read_text())
    assert facts["config"]["micro_batches"] == 4
    a = analyze(FIXTURES / "mem_accum")
    pm = a.memory.peak
    assert pm.peak_bytes == facts["xla_memory_usage_report_total_bytes"]
    assert sum(pm.categories.values()) == pm.peak_bytes
    # the peak is inside the loop: the accumulators (one copy of the weights) and a micro-batch's gradients
    assert facts["parameter_bytes"] < pm.categories["gradients"] < 2.5 * facts["parameter_bytes"]
    assert pm.book.activations_bytes == 4 * 4 * 16 * 64 * 4 + 4 * 16 * 64 * 4 + 64 * 64 * 4 == 98304
    assert any("one micro-batch's" in line for line in pm.book.explanation)
    on = analyze(FIXTURES / "mem_remat_on").memory.peak
    assert on.categories["gradients"] >= facts["parameter_bytes"]  # the backward scan's stacked weight gradients
    assert not any("micro-batch" in line for line in on.book.explanation)


def test_recomputed_activations_are_near_what_xla_adds_without_remat():
    """What remat recomputes and the backward reads, against XLA's own peak without remat (mem_remat_off's
    report total minus mem_remat_on's: 6.32 MB; XLA saves some values unfused that remat recomputes fused):
    the remat-cost finding used to multiply every recomputed op's output by its executions per step (a user's
    4-micro-batch step: 23.5 MB, where XLA's peak without remat was 1.47 MB higher). With gradient
    accumulation the figure is one micro-batch's: mem_accum's is about a quarter of mem_remat_on's."""
    total = "xla_memory_usage_report_total_bytes"
    xla_added = _facts("off")[total] - _facts("on")[total]
    on = analyze(FIXTURES / "mem_remat_on")
    recomputed = on.memory.peak.book.recomputed_activations_bytes
    assert 0.5 * xla_added < recomputed <= xla_added
    assert analyze(FIXTURES / "mem_remat_off").memory.peak.book.recomputed_activations_bytes == 0
    accum = analyze(FIXTURES / "mem_accum")
    assert accum.memory.peak.book.recomputed_activations_bytes == pytest.approx(recomputed / 4, rel=0.1)
    for a in (on, accum):
        (f,) = [f for f in a.findings if f.code == "remat-cost"]
        assert f"about {fmt_bytes(a.memory.peak.book.recomputed_activations_bytes)} more" in f.evidence[1]


def test_largest_buffers_carry_op_layer_and_shape(remat):
    off = remat["off"].memory.peak
    big = off.largest[0]
    assert big.size_bytes == 4 * 16 * 16 * 256 * 4 and big.shape == "f32[4,16,16,256]"  # a stacked activation
    assert big.phase == "forward" and big.layer.startswith("layers") and big.opcode == "fusion"
    assert [b.size_bytes for b in off.largest] == sorted((b.size_bytes for b in off.largest), reverse=True)


def test_reports_show_memory_and_json_has_the_keys(remat):
    a = remat["on"]
    doc = json.loads(render_json(a))["memory"]
    assert doc["peak_bytes_per_device"] == _facts("on")["xla_memory_usage_report_total_bytes"]
    assert doc["source"] == "xla_buffer_assignment" and set(doc["categories"]) == set(CATEGORIES)
    assert doc["programs"][0]["book_model"]["total_bytes"] > 0
    assert "Memory (per device)" in render_terminal(a)
    assert "## Memory (per device)" in render_markdown(a)
    assert "memory-buffers-table" in render_html(a)


def test_the_book_counts_the_whole_donated_state():
    """Keras donates its state: XLA reuses a parameter's buffer once the parameter is dead, so the peak holds
    fewer parameter bytes than the model has. The book's parameters term was the peak's 2.99 kB beside an adam
    state of 15.2 kB (2 x parameters); it is the model's parameters: 1,898 f32 (conv 3x3x1x8+8, conv 3x3x8x16+16,
    dense 64x10+10; fixtures/generate_frameworks.py), 7,592 B (+ 8 B of metric state), the split's shortfall
    explained."""
    name = "fw_keras_cnn"
    a = analyze(FIXTURES / name / "blocking" / "logdir", hlo=[FIXTURES / name / "hlo"])
    pm = a.memory.peak
    params_bytes = 4 * ((3 * 3 * 1 * 8 + 8) + (3 * 3 * 8 * 16 + 16) + (2 * 2 * 16 * 10 + 10))
    metrics_bytes = 2 * 4  # state[3]: the loss metric's f32 total and count, updated in place like a weight
    assert pm.book.parameters_bytes == pm.book.gradients_bytes == params_bytes + metrics_bytes == 7600
    assert 2 * params_bytes <= pm.book.optimizer_state_bytes <= 2 * params_bytes + 64  # adam's m, v and counters
    assert pm.categories["parameters"] < params_bytes
    assert any("of the donated state's buffers hold other values at the peak" in line
               for line in pm.book.explanation), pm.book.explanation


def test_diff_shows_flops_down_and_memory_up(remat, tmp_path):
    r = diff(side_from_analysis(remat["on"], "on"), side_from_analysis(remat["off"], "off"))
    assert r.new.flops_per_step < r.base.flops_per_step
    p = r.memory["peak_bytes_per_device"]
    assert p["delta_bytes"] == _facts("off")["xla_memory_usage_report_total_bytes"] - \
        _facts("on")["xla_memory_usage_report_total_bytes"]
    assert "peak memory per device 4.33 MB -> 10.6 MB (+146.1%): activations +" in render_diff_text(r)
    saved = tmp_path / "on.json"
    saved.write_text(render_json(remat["on"], tables=("layers", "op-stats")))
    assert side_from_json(saved).memory["peak_bytes_per_device"] == p["base_bytes"]
    assert "not one measure" not in render_diff_text(r)
    doc = json.loads(saved.read_text())
    doc["memory"]["peak_bytes_per_device"] = "lots"
    saved.write_text(json.dumps(doc))
    with pytest.raises(MemoryReportError.__mro__[1], match=r"on.json: memory.peak_bytes_per_device is 'lots'"):
        side_from_json(saved)


def test_diff_says_when_the_two_peaks_are_not_one_measure(remat, tmp_path):
    """A side without its dump folder has traceroof's live-range estimate, the other XLA's buffer assignment: the
    diff says the two peaks are not the same measure (a user saw "-6.6 %" between them for one program)."""
    shutil.copytree(FIXTURES / "mem_remat_on" / "logdir", tmp_path / "logdir")  # the profile without its dumps
    alone = analyze(tmp_path / "logdir")
    assert alone.memory.peak.source == "traceroof_live_ranges"
    r = diff(side_from_analysis(remat["on"], "with dumps"), side_from_analysis(alone, "without"))
    assert ("; not one measure: base from XLA's buffer assignment, new from traceroof's live ranges (pass "
            "--hlo-base / --hlo-new dumps for XLA's figure on both)") in render_diff_text(r)


def test_allocator_events_of_a_gpu_profile():
    f = THIRD_PARTY / "tracelens_mi300x" / "jax08_gemm.xplane.pb"
    if not f.exists():
        pytest.skip("third-party GPU profiles absent (../shared/fixtures/third_party)")
    peaks, note = allocator_peaks([f])
    gpu = {a.allocator: a for a in peaks}["GPU_0_bfc"]
    assert note == "" and gpu.max_in_use_bytes == 482345216 and gpu.peak_in_use_bytes == 738197504
    assert gpu.limit_bytes > 150e9  # in use + available on a 192 GB MI300X
    assert allocator_peaks(sorted((FIXTURES / "mem_remat_on").rglob("*.xplane.pb")))[0] == ()


# -- bad input ----------------------------------------------------------------------------------------------

def _copy(tmp_path: Path, kind: str) -> Path:
    src = next((FIXTURES / "mem_remat_on" / "hlo").glob(f"*-{kind}.txt"))
    return Path(shutil.copy(src, tmp_path / src.name))


@pytest.mark.parametrize("kind,mutate,reader,match", [
    ("buffer-assignment", lambda t: "garbage\n" + t, read_buffer_assignment, r":1: expected 'BufferAssignment:'"),
    ("buffer-assignment", lambda t: t.replace("(size=262144,offset=0)", "(size=262144,offset=9)", 1),
     read_buffer_assignment, r":3: value .* lies outside allocation 0"),
    ("buffer-assignment", lambda t: t.replace("allocation 1:", "allocation 7:", 1), read_buffer_assignment,
     r"allocation 7 out of order \(expected 1\)"),
    ("buffer-assignment", lambda t: t[: t.index(" value:") + 12], read_buffer_assignment, r":3: expected"),
    ("memory-usage-report", lambda t: t.replace("Total bytes", "Total"), read_memory_usage_report,
     r":2: expected a row"),
    ("memory-usage-report", lambda t: "", read_memory_usage_report, r":1: no 'Memory Space:'"),
    ("live-range", lambda t: t.replace("    1:", "    7:", 1), read_live_range, r"expected schedule entry 1:name"),
])
def test_bad_reports_name_file_and_line(tmp_path, kind, mutate, reader, match):
    f = _copy(tmp_path, kind)
    f.write_text(mutate(f.read_text()))
    with pytest.raises(MemoryReportError, match=match) as e:
        reader(f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_a_corrupt_report_in_the_dump_falls_back_with_a_note(tmp_path):
    shutil.copytree(FIXTURES / "mem_remat_on", tmp_path / "run")
    ba = next((tmp_path / "run" / "hlo").glob("*-buffer-assignment.txt"))
    text = ba.read_text()
    ba.write_text(text[: text.index("(size=", 300) + 3])  # truncated inside a value line
    a = analyze(tmp_path / "run")
    assert a.memory.peak.source == "traceroof_live_ranges"
    assert any("buffer-assignment.txt:" in n and "estimated from live ranges" in n for n in a.memory.notes)
    # one note for the one fallback: not also "no XLA buffer assignment in the dump", which there is
    assert sum("estimated from" in n for n in a.memory.notes) == 1, a.memory.notes


def test_another_runs_dump_folder_is_named_as_such_not_as_missing_a_buffer_assignment():
    """A user passed the dump folder of another run (s34 trial): the memory note said the dump held no XLA buffer
    assignment, which it does (of that other program). It says none of the dumps given is of this program."""
    a = analyze(FIXTURES / "mem_remat_on" / "logdir", hlo=[FIXTURES / "mem_remat_off" / "hlo"])
    assert a.memory.peak.source == "traceroof_live_ranges"
    assert not any("no XLA buffer assignment in the dump" in n for n in a.memory.notes), a.memory.notes
    assert any(n.startswith("jit_train_step(54): none of the 1 dump(s) given is of this program") for n in a.memory.notes)


def test_diff_of_two_live_range_estimates_says_so(remat, tmp_path):
    """Neither side has its dumps: both peaks are traceroof's live-range estimate, and the diff's headline says
    so (the s30 trial's diff printed "peak memory 1.99 MB -> 1.99 MB" where XLA says 2.43 MB, unqualified)."""
    shutil.copytree(FIXTURES / "mem_remat_on" / "logdir", tmp_path / "logdir")
    alone = analyze(tmp_path / "logdir")
    r = diff(side_from_analysis(alone, "a"), side_from_analysis(alone, "b"))
    assert ("; an estimate from traceroof's live ranges on both (pass --hlo-base / --hlo-new dumps for XLA's buffer "
            "assignment)") in render_diff_text(r)
    assert "estimate" not in render_diff_text(diff(side_from_analysis(remat["on"], "a"),
                                                   side_from_analysis(remat["on"], "b")))


@pytest.mark.parametrize("donate", [False, True])
def test_a_state_not_donated_is_named_with_what_xla_writes_beside_it(tmp_path, donate):
    """s31 trial (Equinox, eqx.filter_jit without donation): the memory view said "outputs written beside the
    inputs (state not donated, or results): 0.008 kB", which read as a donated state. Without donation it now
    says so, with the results XLA writes beside the state (its memory_analysis().output_size_in_bytes) and what
    of them is live at the peak; with donation only the loss is written beside it."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jnp = jax.numpy
    opt = optax.adam(1e-3)
    params = {"w1": jnp.ones((64, 128)), "w2": jnp.ones((128, 8))}

    def step(params, state, x, y):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2))(params)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, loss

    compiled = jax.jit(step, donate_argnums=(0, 1) if donate else ()).lower(
        params, opt.init(params), jnp.ones((32, 64)), jnp.ones((32, 8))).compile()
    dump = tmp_path / "module_0001.jit_step.cpu_after_optimizations.txt"
    dump.write_text(compiled.as_text())
    book = program_memory(parse_hlo_file(dump)[0], dump).book
    written = [line for line in book.explanation if "not donated" in line]
    if donate:
        assert not written and any(line.startswith("results written beside the donated state")
                                   for line in book.explanation), book.explanation
        return
    xla_written = compiled.memory_analysis().output_size_in_bytes
    analytic = 3 * 4 * (64 * 128 + 128 * 8) + 4 + 4  # new w1 and w2, adam's mu and nu of each, its count, the loss
    assert analytic <= xla_written <= analytic + 8 * 8  # (and the output tuple's table of pointers)
    assert len(written) == 1 and f"writes {xla_written / 1e6:.3g} MB of results" in written[0], written


@pytest.mark.parametrize("name", ["on", "off"])
def test_allocations_by_kind_equal_xlas_memory_analysis(remat, name):
    """The split says what buffers hold at the peak instant, which a user read as wrong against XLA's sizes (an
    output's buffer holding a temporary then); the report now shows XLA's allocations by kind beside it, and they
    are XLA's own: compiled.memory_analysis() of the same program (arguments; outputs less those aliased to an
    argument, the donated state; temporaries)."""
    m = _facts(name)["xla_memory_analysis"]
    kinds = remat[name].memory.peak.allocation_bytes_by_kind
    assert kinds["parameter"] == m["argument_size_in_bytes"]
    assert kinds["output"] == m["output_size_in_bytes"] - m["alias_size_in_bytes"]
    assert kinds["temp"] == m["temp_size_in_bytes"]
    checks = next(line for line in render_terminal(remat[name]).splitlines() if line.startswith("checks"))
    assert checks.startswith(f"checks    XLA's allocations arguments {fmt_bytes(m['argument_size_in_bytes'])}, "
                             f"outputs {fmt_bytes(kinds['output'])}, temporaries {fmt_bytes(m['temp_size_in_bytes'])}")


_EPOCHS_JOB = """
import os, sys
os.environ["XLA_FLAGS"] = f"--xla_dump_to={sys.argv[1]} --xla_dump_hlo_as_text"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, optax
tx = optax.adam(1e-3)

def loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

@jax.jit
def epochs(p, o, xs):  # an adam update after each of 4 minibatches of 256, as PPO's epochs
    def minibatch(i, c):
        u, o = tx.update(jax.grad(loss)(c[0], xs[i]), c[1], c[0])
        return optax.apply_updates(c[0], u), o
    return jax.lax.fori_loop(0, 4, minibatch, (p, o))

p = {"w1": jnp.ones((32, 128)) / 32, "w2": jnp.ones((128, 1)) / 128}
jax.block_until_ready(epochs(p, tx.init(p), jnp.ones((4, 256, 32))))
"""


def test_a_loop_of_training_steps_saves_one_iterations_activations(tmp_path):
    """s39 trial (PPO): the forward and backward ran inside the step's loop of minibatch updates, and the book's
    line read "saved activations 0 B" beside 524 kB of tanh outputs the backward read. One iteration's are
    counted: the 256 x 128 tanh output and the 256 x 1 model output the squared loss's gradient reads."""
    subprocess.run([sys.executable, "-c", _EPOCHS_JOB, str(tmp_path)], check=True, timeout=300, capture_output=True)
    dump = next(tmp_path.glob("*jit_epochs.cpu_after_optimizations.txt"))
    assert 'known_trip_count":{"n":"4"}' in dump.read_text()
    book = program_memory(parse_hlo_file(dump)[0], dump).book
    assert 256 * 128 * 4 + 256 * 4 <= book.activations_bytes <= 1.01 * (256 * 128 * 4 + 256 * 4)
    assert any("one iteration's" in line for line in book.explanation)
    assert not any("micro-batch" in line for line in book.explanation)


_DONATED_BATCH_JOB = """\
import os, sys
os.environ["XLA_FLAGS"] = f"--xla_dump_to={sys.argv[1]} --xla_dump_hlo_as_text"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, optax
tx = optax.adam(1e-3)

def loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

def step(p, o, x):  # the weights not donated; the optimizer state and the batch donated
    u, o = tx.update(jax.grad(loss)(p, x), o, p)
    return optax.apply_updates(p, u), o

p = {"w1": jnp.ones((32, 128)) / 32, "w2": jnp.ones((128, 1)) / 128}
jax.block_until_ready(jax.jit(step, donate_argnums=(1, 2))(p, tx.init(p), jnp.ones((128, 32))))
"""


def test_a_donated_batch_is_an_input_even_where_xla_reuses_its_buffer(tmp_path):
    """s41 trial (Equinox, ``filter_jit(donate="all-except-first")``): XLA gives a donated buffer to any output
    of its size, here the f32[128,32] batch's to an f32[32,128] optimizer moment, and the aliased batch was
    counted as parameters (774 kB with an 8 kB batch), so everything computed from it counted as made from the
    weights alone: "saved activations 0 B" beside 12 MB of forward activations. By hand: the weights are
    (32 x 128 + 128) x 4 = 16,896 B; the forward leaves the backward the 128 x 128 tanh output and the 128 x 1
    model output, 66,048 B."""
    subprocess.run([sys.executable, "-c", _DONATED_BATCH_JOB, str(tmp_path)], check=True, timeout=300,
                   capture_output=True)
    dump = next(tmp_path.glob("*jit_step.cpu_after_optimizations.txt"))
    module = parse_hlo_file(dump)[0]
    batch = next(p for p in module.entry.parameters().values() if p.metadata.op_name == "x")
    assert f": ({batch.parameter_number}, {{}}, may-alias)" in module.attrs["input_output_alias"]  # XLA reused it
    pm = program_memory(module, dump)
    assert pm.book.parameters_bytes == (32 * 128 + 128) * 4
    assert pm.book.activations_bytes == 128 * 128 * 4 + 128 * 4
    assert {(b.name, b.category) for b in pm.largest} >= {(batch.name, "inputs")}
