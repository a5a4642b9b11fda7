"""The input contract for HLO text, HloProtos, the cost model, chip files, topologies and diff baselines: bad
input ends in one TraceroofError naming the file and the place (never another exception, never recursion
proportional to the input), and figures derived from input are checked before use. Regression tests for the
cases of issue 11's fuzz campaign, each built from real fixture HLO where there is one."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
from click.testing import CliRunner

from parsers.errors import FormatError, HloParseError, InputError, TraceroofError
from parsers.hlo_proto import HloProtoMessage, module_from_proto
from parsers.hlo_text import parse_hlo_text, parse_replica_groups
from tests.conftest import FIXTURES
from traceroof.analysis import analyze
from traceroof.chips import ChipError, all_chips, get_chip, load_chip_file
from traceroof.cli import main
from traceroof.collectives import classify, parse_topology
from traceroof.cost import CostModel, _valid_positions, categorize
from traceroof.diff import Side, diff, gate, side_from_json

SQRT = FIXTURES / "scan_mlp" / "hlo" / "module_0010.jit_sqrt.cpu_after_optimizations.txt"  # a fusion, no layout
TRAIN = FIXTURES / "scan_mlp" / "hlo" / "module_0020.jit_train_step.cpu_after_optimizations.txt"  # while, dots


def _bad(text: str, match: str) -> HloParseError:
    with pytest.raises(HloParseError, match=match) as err:
        parse_hlo_text(text, source="bad.txt")
    message = str(err.value)
    assert "\n" not in message and re.match(r"bad\.txt:\d+: ", message), message
    return err.value


def _line(message: str) -> int:
    return int(re.match(r"bad\.txt:(\d+):", message).group(1))


# -- HLO text --------------------------------------------------------------------------------------------------

def test_parentheses_in_hlo_text_are_a_parse_error_not_a_recursion():
    src = SQRT.read_text()
    line = src.splitlines().index(next(x for x in src.splitlines() if "%x.1 = s32[] parameter(0)" in x)) + 1
    deep = src.replace("%x.1 = s32[] parameter(0)", "%x.1 = " + "(" * 20000 + "s32[] parameter(0)")
    assert _line(str(_bad(deep, "tuple shapes nested deeper"))) == line
    mid = len(src) // 2
    _bad(src[:mid] + "(((" + src[mid:], ".")  # anywhere: one HloParseError


def test_garbage_in_a_layout_names_the_line():
    lines = TRAIN.read_text().splitlines()
    first = next(i for i, x in enumerate(lines, 1) if "{1,0} parameter(" in x)

    def edited(layout: str) -> str:
        return "\n".join(lines[: first - 1] + [lines[first - 1].replace("{1,0}", layout, 1)] + lines[first:])

    assert _line(str(_bad(edited("{1<0}"), "bad layout"))) == first
    _bad(edited("{0,7}"), "not a permutation")
    _bad(edited("{1,0:T(0,128)}"), "tile .* not positive")


@pytest.mark.parametrize("dims, match", [("99999999999,99999999999", "not a real array"),
                                         ("-3", "bad dimension"), ("1" * 30, "bad dimension"), ("4,x", "bad")])
def test_absurd_and_negative_dims_are_refused(dims, match):
    _bad(SQRT.read_text().replace("f32[] convert(", f"f32[{dims}] convert("), match)


def test_garbage_integer_attributes_are_refused():
    src = TRAIN.read_text()
    assert "lhs_contracting_dims={1}" in src
    _bad(src.replace("lhs_contracting_dims={1}", "lhs_contracting_dims={1x}", 1), "lhs_contracting_dims")
    _bad(src.replace("dimensions={", "dimensions={-2,", 1), "not a list of non-negative integers")
    header = src.splitlines()[0]
    _bad(src.replace(header, header + ", num_partitions=0", 1), "num_partitions")


def _self_calling(src: str) -> str:
    return src.replace("%param_0.1 = s32[] parameter(0)\n",
                       "%param_0.1 = s32[] parameter(0)\n  %again = f32[] fusion(%param_0.1), kind=kLoop, "
                       "calls=%fused_computation\n", 1)


def test_a_fusion_calling_its_own_computation_is_refused_at_parse_time():
    err = _bad(_self_calling(SQRT.read_text()), "computation fused_computation calls itself")
    assert "%fused_computation (param_0.1" in str(err)  # the line of the computation


def test_a_cycle_through_a_while_body_names_the_path():
    text = """HloModule cyc
%body (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  ROOT %c = s32[] call(%p), to_apply=%helper
}
%helper (q: s32[]) -> s32[] {
  %q = s32[] parameter(0)
  ROOT %w = s32[] while(%q), condition=%cond, body=%body
}
%cond (r: s32[]) -> pred[] {
  %r = s32[] parameter(0)
  ROOT %k = pred[] constant(true)
}
ENTRY %main (x: s32[]) -> s32[] {
  %x = s32[] parameter(0)
  ROOT %w = s32[] while(%x), condition=%cond, body=%body
}
"""
    _bad(text, r"computation body calls itself through helper")


def test_call_depth_is_bounded_and_diamonds_are_counted_without_blowup():
    def chain(n: int, calls_per_level: int) -> str:
        parts = ["HloModule deep", "%c0 (p: f32[]) -> f32[] {\n  %p = f32[] parameter(0)\n  ROOT %e = f32[] "
                 "exponential(%p)\n}"]
        for i in range(1, n):
            body = "".join(f"  %k{j} = f32[] call(%p), to_apply=%c{i - 1}\n" for j in range(calls_per_level))
            parts.append(f"%c{i} (p: f32[]) -> f32[] {{\n  %p = f32[] parameter(0)\n{body}  ROOT %r = f32[] "
                         f"add(%p, %k0)\n}}")
        parts.append(f"ENTRY %main (x: f32[]) -> f32[] {{\n  %x = f32[] parameter(0)\n  ROOT %r = f32[] "
                     f"call(%x), to_apply=%c{n - 1}\n}}")
        return "\n".join(parts) + "\n"

    _bad(chain(200, 1), "nest deeper than 64 levels")
    (m,) = parse_hlo_text(chain(40, 2), source="diamond.txt")  # 2**39 paths: counted per computation, not per path
    model = CostModel(m)
    assert model.executions["c0"] == 2.0**39
    assert model.module_cost().transcendentals == 2.0**39


def test_token_garbage_in_hlo_text_is_a_parse_error_or_a_finite_cost():
    rng = random.Random(11)
    texts = [SQRT.read_text(), TRAIN.read_text()]
    tokens = ["(((", ")", "}", "{", "[", "]", "1<0", "99999999999999", "-1", "?", "<=", "x", '"', ",", "=", "%"]
    outcomes = {"error": 0, "parsed": 0}
    for _ in range(150):
        t = rng.choice(texts)
        for _ in range(rng.randint(1, 3)):
            p = rng.randrange(len(t))
            t = t[:p] + rng.choice(tokens) + t[p:] if rng.random() < 0.7 else t[:p] + t[p + rng.randint(1, 9):]
        try:
            modules = parse_hlo_text(t, source="fuzz.txt")
        except HloParseError as e:
            assert str(e).startswith("fuzz.txt:") and "\n" not in str(e)
            outcomes["error"] += 1
            continue
        outcomes["parsed"] += 1
        for m in modules:
            model = CostModel(m)
            total = model.module_cost()
            for v in (total.flops, total.transcendentals, total.bytes_accessed, total.hbm_bytes):
                assert math.isfinite(v) and v >= 0
            for _, inst, _ in model.executed_instructions():
                categorize(model, inst)
                classify(model, inst)
    assert outcomes["error"] and outcomes["parsed"]


def test_replica_groups_garbage_is_a_parse_error_without_allocating():
    for text in ("[1,1]<=[100000000000]", "[2,2]<=[5]", "mesh['a'=4] {'b'}", "mesh['a'=4] {'a':(0)2}", "{{0,x}}"):
        with pytest.raises(HloParseError, match="replica_groups"):
            parse_replica_groups(text)


# -- cost model --------------------------------------------------------------------------------------------------

def test_unbounded_dims_give_no_negative_flops_but_a_note():
    src = TRAIN.read_text()
    m = re.search(r"%(\S+) = f32\[(\d+),(\d+)\]\{1,0\} dot\(", src)
    assert m, "the train step has a dot"
    text = src.replace(m.group(0), f"%{m.group(1)} = f32[?,{m.group(3)}]{{1,0}} dot(", 1)
    (mod,) = parse_hlo_text(text, source="dyn.txt")
    model = CostModel(mod)
    cost = model.cost(mod.instruction(m.group(1)))
    assert cost.flops >= 0 and math.isfinite(model.module_cost().flops)


def test_garbage_trip_counts_are_unknown_not_used():
    src = TRAIN.read_text()
    assert '"known_trip_count":{"n":"' in src
    for n in ('"99999999999999999999"', '"abc"', "-4", "[1]"):
        text = re.sub(r'"known_trip_count":\{"n":"\d+"\}', f'"known_trip_count":{{"n":{n}}}', src)
        (mod,) = parse_hlo_text(text, source="trip.txt")
        model = CostModel(mod)
        loop = next(i for c in mod.computations.values() for i in c.instructions if i.opcode == "while")
        assert model.trip_count(loop)[1] != "known_trip_count"
        assert math.isfinite(model.module_cost().flops)


def test_convolution_positions_in_closed_form_match_the_brute_force_count():
    def brute(in_size, k_size, out_size, w):
        dilated = (in_size - 1) * w["lhs_dilate"] + 1 if in_size > 0 else 0
        return sum(1 for k in range(k_size) for o in range(out_size)
                   if 0 <= (pos := o * w["stride"] + k * w["rhs_dilate"] - w["pad_lo"]) < dilated
                   and pos % w["lhs_dilate"] == 0)

    rng = random.Random(3)
    for _ in range(2000):
        w = dict(stride=rng.randint(1, 4), rhs_dilate=rng.randint(1, 3), lhs_dilate=rng.randint(1, 4),
                 pad_lo=rng.randint(-4, 6))
        sizes = (rng.randint(0, 12), rng.randint(0, 6), rng.randint(0, 14))
        assert _valid_positions(*sizes, w) == brute(*sizes, w)
    # a huge output costs no time: closed form per kernel position
    assert _valid_positions(10**9, 3, 10**9, dict(stride=1, rhs_dilate=1, lhs_dilate=1, pad_lo=1)) == 3 * 10**9 - 2


# -- HloProto ------------------------------------------------------------------------------------------------------

def _proto(mutate=None) -> bytes:
    """A small valid HloProto: ENTRY main(x) = fusion(x) calling fused(p) = exponential(p)."""
    msg = HloProtoMessage()
    mod = msg.hlo_module
    mod.name, mod.entry_computation_name, mod.entry_computation_id = "m", "main", 2
    fused = mod.computations.add(name="fused", id=1, root_id=11)
    p = fused.instructions.add(name="p", opcode="parameter", id=10, parameter_number=0)
    p.shape.element_type, p.shape.dimensions[:] = 11, [8, 128]
    e = fused.instructions.add(name="e", opcode="exponential", id=11, operand_ids=[10])
    e.shape.CopyFrom(p.shape)
    main_ = mod.computations.add(name="main", id=2, root_id=21)
    x = main_.instructions.add(name="x", opcode="parameter", id=20, parameter_number=0)
    x.shape.CopyFrom(p.shape)
    f = main_.instructions.add(name="f", opcode="fusion", id=21, operand_ids=[20], called_computation_ids=[1],
                               fusion_kind="kLoop")
    f.shape.CopyFrom(p.shape)
    if mutate:
        mutate(mod)
    return msg.SerializeToString()


def test_a_valid_proto_decodes_and_costs():
    m = module_from_proto(_proto(), "m(7).hlo_proto.pb")
    assert m.program_id == 7 and CostModel(m).module_cost().transcendentals == 8 * 128


@pytest.mark.parametrize("mutate, match", [
    (lambda m: m.computations[1].instructions[1].operand_ids.__setitem__(0, 99), "operand id 99 names no"),
    (lambda m: m.computations[1].instructions[1].called_computation_ids.__setitem__(0, 5), "computation id 5"),
    (lambda m: m.computations[0].instructions[1].called_computation_ids.append(1), "fused calls itself"),
    (lambda m: setattr(m.computations[1].instructions[1], "id", 20), "appears twice"),
    (lambda m: m.computations[0].instructions[0].shape.dimensions.__setitem__(0, -7), "negative dimension"),
    (lambda m: m.computations[0].instructions[0].shape.dimensions.__setitem__(0, 2**60), "not a real array"),
    (lambda m: m.computations[0].instructions[1].dimensions.append(-1), "negative dimensions"),
])
def test_proto_garbage_is_a_parse_error(mutate, match):
    with pytest.raises(HloParseError, match=match) as err:
        module_from_proto(_proto(mutate), "bad(1).hlo_proto.pb")
    assert str(err.value).startswith("bad(1).hlo_proto.pb: ")


def test_proto_bytes_that_do_not_decode_are_a_parse_error():
    data = _proto()
    for bad in (data[: len(data) // 2], b"\xff" * 64, b"\x0a\x80\x80\x80\x80\x10", b"(((" * 100):
        with pytest.raises(HloParseError):
            module_from_proto(bad, "junk.hlo_proto.pb")


# -- chips -----------------------------------------------------------------------------------------------------------

GOOD_CHIP = ('name = "My GPU"\nvendor = "me"\nkind = "gpu"\n[peak_flops_per_s]\n'
             'bf16 = { value = 1e15, source = "sheet" }\n[memory]\n'
             'hbm_bandwidth_bytes_per_s = { value = 2e12, source = "sheet" }\n[interconnect]\n'
             'gpus_per_node = { value = 8, source = "sheet" }\n')


@pytest.mark.parametrize("edit, key", [
    (("bf16 = { value = 1e15", "bf16 = { value = 0"), "peak_flops_per_s.bf16"),
    (("bf16 = { value = 1e15", "bf16 = { value = nan"), "peak_flops_per_s.bf16"),
    (("bf16 = { value = 1e15", "bf16 = { value = -1e15"), "peak_flops_per_s.bf16"),
    (("bf16 = { value = 1e15", "bf16 = { value = inf"), "peak_flops_per_s.bf16"),
    (("bf16 = { value = 1e15", "bf16 = { value = '1e15'"), "peak_flops_per_s.bf16"),
    (("bf16 = {", "bf17 = {"), "peak_flops_per_s.bf17 is not a known dtype"),
    (("value = 2e12", "value = 0.0"), "memory.hbm_bandwidth_bytes_per_s"),
    (("value = 2e12", "value = -2e12"), "memory.hbm_bandwidth_bytes_per_s"),
    (("value = 8,", "value = 0,"), "interconnect.gpus_per_node"),
    (("value = 8,", "value = 2.5,"), "interconnect.gpus_per_node"),
    (('name = "My GPU"', "name = 3"), "name"),
    (('kind = "gpu"', 'kind = "fpga"'), "kind"),
    (('vendor = "me"', 'aliases = "x"'), "aliases"),
    (('source = "sheet" }\n[memory]', 'source = 7 }\n[memory]'), "source"),
])
def test_bad_chip_figures_name_the_file_and_the_key(tmp_path, edit, key):
    f = tmp_path / "mine.toml"
    f.write_text(GOOD_CHIP.replace(*edit, 1))
    with pytest.raises(ChipError, match=re.escape(key)) as err:
        load_chip_file(f)
    assert str(f) in str(err.value) and "\n" not in str(err.value)


def test_non_utf8_chip_file_is_a_chip_error(tmp_path):
    f = tmp_path / "latin.toml"
    f.write_bytes(GOOD_CHIP.replace("My GPU", "Mein Ger\xe4t").encode("latin-1"))
    with pytest.raises(ChipError, match="not UTF-8"):
        load_chip_file(f)


def test_every_bundled_chip_passes_validation():
    assert len(all_chips()) >= 16


def test_a_bad_user_chip_file_is_skipped_with_a_note_and_named_when_asked_for(tmp_path, monkeypatch):
    (tmp_path / "broken.toml").write_text(GOOD_CHIP.replace("value = 8,", "value = 0,"))
    (tmp_path / "mine.toml").write_text(GOOD_CHIP)
    monkeypatch.setenv("TRACEROOF_CHIPS_DIR", str(tmp_path))
    notes: list[str] = []
    ids = [c.id for c in all_chips(notes)]
    assert "mine" in ids and "broken" not in ids and "h100" in ids
    assert len(notes) == 1 and "broken.toml" in notes[0] and "gpus_per_node" in notes[0]
    assert get_chip("h100").id == "h100"
    with pytest.raises(ChipError, match="gpus_per_node"):
        get_chip("broken")
    r = CliRunner().invoke(main, ["chips"])
    assert r.exit_code == 0 and "h100" in r.output


def test_a_corrupt_calibration_cache_is_measured_again(tmp_path, monkeypatch):
    import traceroof.chips as chips
    from traceroof.chips import Calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "traceroof" / "host.toml"
    cache.parent.mkdir()
    cache.write_bytes(b"name = \"calibrated host\"\n[peak_flops_per_s]\nf32 = { value = nan }\n\xff\xfe")
    measured = []
    cal = Calibration({"f32": 1e11}, 2e10, 1e10, "Test CPU", 2, "2026-01-02T03:04:05Z", "numpy")
    monkeypatch.setattr(chips, "calibrate", lambda: measured.append(1) or cal)
    chip = chips.host_chip()
    assert measured == [1] and chip.peak_for("f32") == (1e11, "f32")
    assert load_chip_file(cache).calibrated_at == "2026-01-02T03:04:05Z"
    assert list(cache.parent.iterdir()) == [cache]  # no temporary file left
    chips.host_chip()
    assert measured == [1]  # the good cache is used


# -- topology --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["0x0", "4x0", "-1x4", "axb", "", "4x4x4x4x4x4x4", "100000x100000", "8x", "1e3"])
def test_garbage_topologies_are_one_input_error(text):
    for chip in ("tpu_v5p", "h100"):
        with pytest.raises(InputError, match="--topology"):
            parse_topology(text, get_chip(chip))


def test_valid_topologies_still_parse():
    assert parse_topology("2x4x4x4", get_chip("tpu_v5p")).slices == 2
    assert parse_topology("8x2", get_chip("h100")).shape == (8, 2)


# -- diff baselines --------------------------------------------------------------------------------------------------

def _report(tmp_path, name="base.json", **summary):
    doc = {"summary": {"step_time_mean_s": 0.010, "step_times_s": [0.010, 0.011, 0.009], "chip_id": "host",
                       **summary},
           "layers": [{"layer": "mlp", "phase": "forward", "time_per_step_s": 0.005}],
           "op_stats": [{"layer": "mlp", "phase": "forward", "opcode": "dot", "time_per_step_s": 0.005,
                         "flops_per_step": 1e9}]}
    f = tmp_path / name
    f.write_text(json.dumps(doc))
    return f


@pytest.mark.parametrize("summary, match", [
    ({"step_time_mean_s": 0}, "step_time_mean_s is 0"), ({"step_time_mean_s": float("nan")}, "step_time_mean_s"),
    ({"step_time_mean_s": -3.07e6}, "step_time_mean_s"), ({"step_time_mean_s": None}, "missing"),
    ({"step_time_mean_s": "10ms"}, "not a number"), ({"step_times_s": "0.01"}, "step_times_s"),
    ({"step_times_s": [0.01, -1]}, "step_times_s"), ({"step_times_s": [0.0, 4.3e-05]}, "positive finite step"),
    ({"flops_per_step": float("inf")}, "flops_per_step"),
])
def test_bad_baseline_figures_are_format_errors(tmp_path, summary, match):
    with pytest.raises(FormatError, match=match):
        side_from_json(_report(tmp_path, **summary))


def test_truncated_or_misshapen_baselines_are_format_errors(tmp_path):
    good = _report(tmp_path).read_text()
    for i, text in enumerate([good[: len(good) // 2], "[" * 100000, json.dumps({"summary": [], "layers": [],
                                                                                 "op_stats": []}),
                              good.replace('"layers": [{', '"layers": [3, {'),
                              good.replace('"time_per_step_s": 0.005', '"time_per_step_s": -0.005')]):
        f = tmp_path / f"bad{i}.json"
        f.write_text(text)
        with pytest.raises(FormatError) as err:
            side_from_json(f)
        assert str(f) in str(err.value)


def test_the_gate_refuses_a_side_without_a_positive_finite_step_time(tmp_path):
    base = side_from_json(_report(tmp_path))
    slower = side_from_json(_report(tmp_path, "new.json", step_time_mean_s=0.02, step_times_s=[0.02, 0.02]))
    assert gate(diff(base, slower), 5.0)[0]
    for bad in (float("nan"), 0.0, -1.0):
        broken = Side(**{**base.__dict__, "step_time_mean_s": bad})
        with pytest.raises(TraceroofError, match="step time"):
            gate(diff(broken, slower), 5.0)


def test_diff_cli_exits_2_for_a_bad_baseline_and_1_only_for_a_regression(tmp_path):
    base = _report(tmp_path)
    slower = _report(tmp_path, "new.json", step_time_mean_s=0.02, step_times_s=[0.02, 0.02, 0.02])
    zero = _report(tmp_path, "zero.json", step_time_mean_s=0.0)
    runner = CliRunner()
    assert runner.invoke(main, ["diff", str(base), str(slower), "--fail-above", "5"]).exit_code == 1
    r = runner.invoke(main, ["diff", str(zero), str(slower), "--fail-above", "5"])
    assert r.exit_code == 2 and "zero.json" in r.output and "Traceback" not in r.output


def test_analyze_cli_with_a_garbage_topology_is_exit_2_and_one_line():
    r = CliRunner().invoke(main, ["analyze", str(FIXTURES / "scan_mlp"), "--chip",
                                  str(FIXTURES / "fixture_host.toml"), "--topology", "0x0"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "--topology '0x0'" in r.output


def test_garbage_device_stats_are_ignored_by_chip_detection():
    from traceroof.chips import detect_chip

    chip, note = detect_chip({"device_vendor": "Nvidia", "compute_cap_major": 9, "compute_cap_minor": "x",
                              "memory_size": "lots", "memory_bandwidth": float("nan"),
                              "peak_teraflops_per_second": "1e999"})
    assert chip.id == "h100" and "claims" not in note
    with pytest.raises(ChipError, match="unknown device") as err:
        detect_chip({"compute_cap_major": "nine\nlines", "memory_size": -1})
    assert "\n" not in str(err.value)


def test_a_deeply_nested_backend_config_is_kept_as_text_not_a_recursion():
    depth = 200_000
    text = ("HloModule m\n\nENTRY e {\n  p = f32[4]{0} parameter(0)\n"
            f"  ROOT c = f32[4]{{0}} custom-call(p), custom_call_target=\"foo\", backend_config=\"{'[' * depth}{']' * depth}\"\n}}\n")
    (module,) = parse_hlo_text(text, "deep.txt")
    (inst,) = [i for c in module.computations.values() for i in c.instructions if i.opcode == "custom-call"]
    assert isinstance(inst.backend_config, str) and inst.backend_config.startswith("[[[")


def _with_corrupt_embedded_hlo(tmp_path):
    from parsers.xspace import parse_full
    from tests.conftest import fixture_xplane

    xs = parse_full(fixture_xplane("transformer"))
    (meta,) = [p for p in xs.planes if p.name == "/host:metadata"]
    hlo_stat = next(k for k, m in meta.stat_metadata.items() if m.name == "Hlo Proto")
    broken = 0
    for em in meta.event_metadata.values():
        for st in em.stats:
            if st.metadata_id == hlo_stat and "train_step" in em.name:
                st.bytes_value = b"\x0a\x05" + b"\xff" * 40  # a module name cut short, then garbage
                broken += 1
    assert broken == 1
    run = tmp_path / "run"
    run.mkdir()
    (run / "vm.xplane.pb").write_bytes(xs.SerializeToString())
    return run


def test_a_corrupt_embedded_hloproto_is_skipped_with_a_note_and_a_dump_takes_its_place(tmp_path):
    import traceroof

    run = _with_corrupt_embedded_hlo(tmp_path)
    a = traceroof.analyze(run, hlo=[FIXTURES / "transformer" / "hlo"], chip="h100")
    notes = a.summary.notes
    assert any("HloProto of jit_train_step in the profile does not decode" in n for n in notes), notes
    assert a.summary.flops_per_step > 0 and a.summary.join.events_joined == a.summary.join.events_total
    partial = traceroof.analyze(run, chip="h100")  # no other HLO: a partial report that says what is missing
    assert any("does not decode" in n for n in partial.summary.notes)
    assert any("times only" in n for n in partial.summary.notes), partial.summary.notes


def test_parameter_numbers_must_be_0_to_n_minus_1():  # fuzz: parameter(2147483648) made a 2^31-bit mask
    text = "HloModule m\n\nENTRY e {\n  a = f32[4]{0} parameter(1)\n  b = f32[4]{0} parameter(2147483648)\n" \
           "  ROOT c = f32[4]{0} add(a, b)\n}\n"
    with pytest.raises(HloParseError, match=r"parameter numbers \[1, 2147483648\] are not 0..1"):
        parse_hlo_text(text, "p.txt")
    ok = text.replace("parameter(1)", "parameter(0)").replace("parameter(2147483648)", "parameter(1)")
    assert len(parse_hlo_text(ok, "p.txt")) == 1


def test_an_unrelated_dump_reusing_a_profiled_program_id_does_not_hide_the_profiles_hlo(tmp_path):
    """--hlo names a dump folder of another program whose file number is the profiled program's id: the
    profile's own HloProto (same id, another module name) still joins every event."""
    from traceroof.analysis import analyze

    from tests.conftest import HOST_CHIP

    own = analyze(FIXTURES / "transformer" / "logdir", chip=str(HOST_CHIP))
    pid = int(own.ops["program_id"].dropna().mode().iloc[0])
    other = next((FIXTURES / "scan_mlp" / "hlo").glob("*jit_train_step*"))
    (tmp_path / f"module_{pid:04d}.jit_other_program.cpu_after_optimizations.txt").write_text(
        other.read_text().replace("HloModule jit_train_step", "HloModule jit_other_program", 1))
    a = analyze(FIXTURES / "transformer" / "logdir", hlo=[tmp_path], chip=str(HOST_CHIP))
    assert a.summary.join.events_joined == a.summary.join.events_total == own.summary.join.events_total
    assert a.summary.flops_per_step == own.summary.flops_per_step


def test_a_topology_is_checked_against_the_programs_devices():
    """A user's 8-device step with --topology 2x2 (v5p) placed devices 4..7 in a second slice and called the
    collectives DCN; 4x4x4 and a host target's --topology were taken silently. Too few devices is bad input;
    more is a note; a CPU-host target says the topology is not used."""
    fixture = str(FIXTURES / "par_fsdp4_tp2")
    r = CliRunner().invoke(main, ["analyze", fixture, "--chip", "v5p", "--topology", "2x2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert "--topology 2x2 holds 4 devices but the program runs on 8" in r.output and "2x2x2" in r.output
    big = analyze(fixture, chip="v5p", topology="4x4x4")
    assert big.topology.startswith("4x4x4") and (big.collectives["link"] == "ICI").all()
    assert any("holds 64 devices, the program runs on 8" in n for n in big.summary.notes)
    host = analyze(fixture, chip=str(FIXTURES / "fixture_host.toml"), topology="2x2")
    assert host.topology == "8 device(s) on one host"
    assert any(n.startswith("--topology 2x2 not used") for n in host.summary.notes)


def test_a_file_that_is_not_hlo_beside_the_profiles_own_is_a_note_saying_so(tmp_path):
    """s38 trial: a --hlo file holding "hello" was "skipped: it looks like HLO but does not parse". The profile
    carries its own HLO, so the analysis goes on, with a note that says the file is not HLO."""
    junk = tmp_path / "hello.txt"
    junk.write_text("hello\n")
    a = analyze(FIXTURES / "transformer", hlo=[FIXTURES / "transformer" / "hlo", junk], chip="h100")
    (note,) = [n for n in a.summary.notes if "hello.txt" in n]
    assert note.startswith("skipped hello.txt: it does not parse as HLO (") and "not HLO text" in note
    assert a.summary.join.events_joined == a.summary.join.events_total
