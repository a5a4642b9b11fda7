"""HLO text parser: the grammar of docs/reference/hlo-text.md on real dumps and hand-written edge cases."""

from __future__ import annotations

import re

import pytest

from parsers.errors import HloParseError
from parsers.hlo_text import async_pairs, is_known_opcode, parse_hlo_file, parse_hlo_text, parse_replica_groups
from tests.conftest import FIXTURES, THIRD_PARTY, third_party


# the HLO modules (*_optimizations.txt): a dump folder also has buffer-assignment, live-range, ... reports
@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*/hlo/*optimizations.txt")), ids=lambda p: p.name)
def test_every_fixture_dump_parses(path):
    (module,) = parse_hlo_file(path)
    assert module.program_id == int(path.name.split(".")[0].split("_")[1])
    assert module.entry.is_entry and module.entry.root is not None
    unknown = [i.opcode for c in module.computations.values() for i in c.instructions if not is_known_opcode(i.opcode)]
    assert unknown == []
    # operands resolve within their computation
    for comp in module.computations.values():
        for inst in comp.instructions:
            for op in inst.operands:
                assert op in comp.by_name, (inst.name, op)


def test_train_step_dump_details():
    path = next((FIXTURES / "transformer" / "hlo").glob("*jit_train_step*"))
    (m,) = parse_hlo_file(path)
    assert m.name == "jit_train_step" and m.attrs["is_scheduled"] == "true"
    assert "input_output_alias" in m.attrs
    # stack-frame tables resolve to the generator's source
    assert m.stack_frames and all(f.file_name.endswith("generate.py") for f in m.stack_frames.values())
    fusion = next(i for i in m.entry.instructions if i.name.startswith("ynn_fusion"))
    assert fusion.opcode == "fusion" and fusion.fusion_kind == "kCustom"
    assert fusion.backend_config["fusion_config"]["kind"] == "__ynn_fusion"
    assert fusion.called and fusion.called[0] in m.computations
    assert re.fullmatch(r".*generate\.py:\d+", m.source_line(fusion))
    param = next(i for i in m.entry.instructions if i.opcode == "parameter")
    assert param.metadata.op_name.startswith("params['")  # \' escapes decoded


def test_while_trip_count_attribute():
    path = next((FIXTURES / "scan_mlp" / "hlo").glob("*jit_train_step*"))
    (m,) = parse_hlo_file(path)
    whiles = [i for c in m.computations.values() for i in c.instructions if i.opcode == "while"]
    assert len(whiles) == 2
    assert all(w.backend_config["known_trip_count"]["n"] == "6" for w in whiles)
    assert all({w.attrs["condition"].lstrip("%"), w.attrs["body"].lstrip("%")} <= set(m.computations)
               for w in whiles)


GRAMMAR = r'''
HloModule edge_cases, entry_computation_layout={(f32[8]{0})->f32[8]{0}}, replica_count=1

%fused_computation.1 (param_0: bf16[16,2048]) -> bf16[16,2048] {
  %param_0 = bf16[16,2048]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  ROOT %neg = bf16[16,2048]{1,0:T(8,128)(2,1)}negate(%param_0)
}

%add.clone (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main (p0: bf16[16,2048], p1: s4[64,128], p2: f32[<=8,?]) -> (bf16[16,2048], f32[]) {
  %p0 = bf16[16,2048]{1,0:T(8,128)(2,1)} parameter(0), sharding={devices=[2,2]<=[4]}
  %p1 = s4[64,128]{1,0:E(4)} parameter(1)
  %p2 = f32[<=8,?]{1,0} parameter(2)
  %constant.12144..sunk.2 = f32[] constant(0)
  %fusion.41 = bf16[16,2048]{1,0:T(8,128)(2,1)S(1)} fusion(bf16[16,2048]{1,0:T(8,128)(2,1)} %p0), kind=kLoop, calls=%fused_computation.1, metadata={op_type="neg" op_name="jit(f)/jvp(layer_0)/neg" source_file="/x/train.py" source_line=37}
  %all-reduce-start.1 = f32[] all-reduce-start(%constant.12144..sunk.2), channel_id=3, replica_groups=[2,2]<=[4], use_global_device_ids=true, to_apply=%add.clone, backend_config="{\"collective_backend_config\":{\"is_sync\":true}}"
  %all-reduce-done.1 = f32[] all-reduce-done(%all-reduce-start.1)
  %ag = f32[2]{0} all-gather(%constant.12144..sunk.2), channel_id=4, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}
  %rs = f32[] reduce-scatter(%constant.12144..sunk.2), replica_groups={{0,1},{2,3}}, dimensions={0}, to_apply=%add.clone
  %weird = f32[] my-new-op(%constant.12144..sunk.2), some_new_attr={a=1
      b=2}, backend_config={"a": {"b": [1, 2,
      3]}}
  ROOT %t = (bf16[16,2048]{1,0:T(8,128)(2,1)S(1)}, /*index=1*/f32[]) tuple(%fusion.41, %all-reduce-done.1) // trailing comment
}
'''


def test_grammar_edge_cases():
    (m,) = parse_hlo_text(GRAMMAR)
    e = m.entry
    assert m.entry_name == "main" and m.attrs["replica_count"] == "1"
    f = e.by_name["fusion.41"]
    lay = f.shape.layout
    assert lay.tiles == ((8, 128), (2, 1)) and lay.memory_space == 1
    assert f.operand_shapes[0].layout.memory_space == 0
    assert f.metadata.op_name == "jit(f)/jvp(layer_0)/neg" and f.metadata.source_line == 37
    p1 = e.by_name["p1"]
    assert p1.shape.layout.element_size_bits == 4 and p1.shape.byte_size() == 64 * 128 // 2
    p2 = e.by_name["p2"]
    assert p2.shape.dynamic == (True, True) and p2.shape.dims == (8, -1)
    assert "constant.12144..sunk.2" in e.by_name
    ar = e.by_name["all-reduce-start.1"]
    assert ar.backend_config == {"collective_backend_config": {"is_sync": True}}
    assert ar.called == ("add.clone",)
    assert async_pairs(e) == {"all-reduce-done.1": "all-reduce-start.1"}
    weird = e.by_name["weird"]
    assert not is_known_opcode("my-new-op") and weird.opcode == "my-new-op"
    assert weird.backend_config == {"a": {"b": [1, 2, 3]}}
    assert "some_new_attr" in weird.attrs
    root = e.root
    assert root.name == "t" and root.shape.is_tuple and len(root.shape.tuple_shapes) == 2
    assert parse_replica_groups(ar.attrs["replica_groups"]) == [[0, 1], [2, 3]]
    assert parse_replica_groups(e.by_name["ag"].attrs["replica_groups"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert parse_replica_groups(e.by_name["rs"].attrs["replica_groups"]) == [[0, 1], [2, 3]]


def test_no_percent_no_entry_no_signature():
    text = """HloModule m
comp {
  a = f32[4] parameter(0)
  b = f32[4] exponential(a)
}
main2 {
  x = f32[4] parameter(0)
  ROOT c = f32[4] call(x), to_apply=comp
}
"""
    (m,) = parse_hlo_text(text)
    assert m.entry_name == "main2" and m.entry.root.called == ("comp",)
    assert m.computations["comp"].root.name == "b"  # no ROOT: the last instruction


@pytest.mark.parametrize("text, expected", [
    ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("{{0,1,2,3},{4,5,6,7}}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_replica_group_forms(text, expected):
    assert parse_replica_groups(text) == expected


def test_mesh_form_equals_iota_form_of_same_parameter():
    # hlo-text.md §9.1: the backward mesh form equals the forward iota form [2,4]<=[4,2]T(1,0)
    assert parse_replica_groups("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}") == parse_replica_groups("[2,4]<=[4,2]T(1,0)")


def test_empty_replica_groups_mean_all():
    assert parse_replica_groups("{}", num_devices=4) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("text", ["HloModule x\nENTRY e {\n a = f32[2] parameter(0\n}", "not hlo at all",
                                  "HloModule x\nENTRY e {\n  a = f32[2 parameter(0)\n}"])
def test_malformed_text_raises_one_line_error(text):
    with pytest.raises(HloParseError) as err:
        parse_hlo_text(text, source="bad.txt")
    assert "\n" not in str(err.value) and "bad.txt" in str(err.value)


@pytest.mark.parametrize("bad, line", [("  c = f32[2]{0} add(f32[2]{0} , f32[2]{0} %b)", 6),  # in an operand
                                       ("  c = f32[2]{0} add(f32[2]{0} %a, %b)\n  d = f32[2]{0} add(f32[2]{0} , %b)", 7),
                                       ("  c = f32[2]{0} add(f32[2]{0} %a, f32[2]{0} %b", 6),  # an unclosed call
                                       ("  c f32[2]{0} add(f32[2]{0} %a)", 6)])
def test_a_parse_error_names_its_line(bad, line):
    """The line number in an error counts the newlines before the bad text, however many instructions with
    operands came before it (the parser counts each newline once, from the last position it asked about)."""
    text = ("HloModule m\n\nENTRY e {\n  a = f32[2]{0} parameter(0)\n  b = f32[2]{0} negate(f32[2]{0} %a)\n"
            + bad + "\n  ROOT r = f32[2]{0} negate(f32[2]{0} %b)\n}\n")
    with pytest.raises(HloParseError, match=rf"^bad\.txt:{line}: "):
        parse_hlo_text(text, source="bad.txt")


def test_third_party_samples_parse():
    d = THIRD_PARTY / "xla_hlo_samples"
    if not d.exists():
        pytest.skip("third-party HLO samples not present")
    for f in sorted(d.glob("*.hlo")):
        (m,) = parse_hlo_file(f)
        assert m.entry.instructions, f


def test_tpu_sample_layouts_and_collective_fusion():
    (m,) = parse_hlo_file(third_party("xla_hlo_samples/tpu_layout_while_dus_pad.xla_test.hlo"))
    tiled = [i for c in m.computations.values() for i in c.instructions
             if i.shape.layout is not None and i.shape.layout.tiles]
    assert any(i.shape.layout.tiles == ((8, 128), (2, 1)) for i in tiled)  # T(8,128)(2,1) in the sample
    (ag,) = parse_hlo_file(third_party("xla_hlo_samples/tpu_style_collective_fusion_kcustom_allgather.xla_test.hlo"))
    fusions = [i for c in ag.computations.values() for i in c.instructions if i.opcode == "fusion"]
    assert any(i.fusion_kind == "kCustom" and any(c.startswith("all-gather") for c in i.called) for i in fusions)
    (a2a,) = parse_hlo_file(third_party("xla_hlo_samples/async_all_to_all_start_context_u32.xla_test.hlo"))
    start = next(i for i in a2a.entry.instructions if i.opcode == "all-to-all-start")
    assert start.shape.is_tuple and [s.element_type for s in start.shape.tuple_shapes[-2:]] == ["u32", "u32"]
    assert async_pairs(a2a.entry)


def test_tpu_padded_bytes_worked_example():
    # hlo-text.md §6.2: TPU v5e relu(x @ w + b) parameters: logical 656 B, padded 6656 B
    (m,) = parse_hlo_text("""HloModule t
ENTRY e {
  x = f32[16,8]{0,1:T(8,128)} parameter(0)
  w = f32[8,4]{0,1:T(4,128)} parameter(1)
  b = f32[4]{0:T(128)} parameter(2)
  ROOT t = (f32[16,8]{0,1:T(8,128)}, f32[8,4]{0,1:T(4,128)}, f32[4]{0:T(128)}) tuple(x, w, b)
}""")
    params = [m.entry.by_name[n].shape for n in ("x", "w", "b")]
    assert sum(s.byte_size() for s in params) == 656
    assert [s.padded_byte_size() for s in params] == [4096, 2048, 512]


def test_embedded_hlo_proto_keeps_the_schedule_and_the_donated_buffers():
    """The HloProto a profile embeds carries XLA's schedule and input_output_alias: the module read from it
    runs its instructions in the dump's (scheduled) order and has the dump's aliases, so scopes inherited from
    neighbours and the live-range memory estimate agree whichever of the two is read."""
    import glob

    from parsers.hlo_proto import module_from_proto
    from parsers.xspace import read_xspace
    from traceroof.hlo_source import embedded_hlo
    from traceroof.scopes import _alias_outputs

    (pb,) = glob.glob("fixtures/mem_remat_on/logdir/**/*.xplane.pb", recursive=True)
    (dump,) = glob.glob("fixtures/mem_remat_on/hlo/*jit_train_step.cpu_after_optimizations.txt")
    (text,) = [m for m in parse_hlo_file(dump) if m.name == "jit_train_step"]
    (proto,) = [module_from_proto(data, "embedded") for _, name, data, _ in embedded_hlo(read_xspace(pb))
                if name == "jit_train_step"]
    assert [i.name for i in proto.entry.instructions] == [i.name for i in text.entry.instructions]
    assert _alias_outputs(proto) == _alias_outputs(text) and len(_alias_outputs(text)) > 2


@pytest.mark.parametrize("name", ["fw_gpt2", "fw_keras_cnn"])
def test_dump_stack_frames_equal_the_embedded_hloprotos(name):
    """XLA's text writes each stack frame's parent id plus one (a root reads its own id or 1): read as written,
    walks up a stack looped on a frame or went to a sibling, and "your code" lines from dumps were missing or
    wrong. The dump's frames now equal those of the same program's HloProto in the profile."""
    import glob

    from parsers.hlo_proto import module_from_proto
    from parsers.xspace import read_xspace
    from traceroof.hlo_source import embedded_hlo

    (pb,) = glob.glob(f"fixtures/{name}/blocking/logdir/**/*.xplane.pb", recursive=True)
    (dump,) = glob.glob(f"fixtures/{name}/hlo/*jit_train_step.cpu_after_optimizations.txt")
    (text,) = [m for m in parse_hlo_file(dump) if m.name == "jit_train_step"]
    (proto,) = [module_from_proto(data, "embedded") for _, n, data, _ in embedded_hlo(read_xspace(pb))
                if n == "jit_train_step"]
    assert len(text.stack_frames) > 50 and text.stack_frames == proto.stack_frames
    assert not any(f.parent_frame_id == i for i, f in text.stack_frames.items())
    assert any(f.column > 0 for f in proto.stack_frames.values())  # the columns, read from both


def test_an_hloproto_embedded_by_every_host_is_decoded_once(monkeypatch):
    """Every host of a pod embeds its program's HloProto: the same bytes from another host's file give a module
    of that file, decoded once per process."""
    import glob

    import parsers.hlo_proto as hlo_proto
    from parsers.xspace import read_xspace
    from traceroof.hlo_source import embedded_hlo

    (pb,) = glob.glob("fixtures/mem_remat_on/logdir/**/*.xplane.pb", recursive=True)
    (data,) = [d for _, name, d, _ in embedded_hlo(read_xspace(pb)) if name == "jit_train_step"]
    calls = []
    decode = hlo_proto._decode
    monkeypatch.setattr(hlo_proto, "_decode", lambda *a: (calls.append(a[1]), decode(*a))[1])
    monkeypatch.setattr(hlo_proto, "_DECODED", type(hlo_proto._DECODED)())
    a = hlo_proto.module_from_proto(data, "host_a.xplane.pb", 3)
    b = hlo_proto.module_from_proto(bytes(data), "host_b.xplane.pb", 3)
    c = hlo_proto.module_from_proto(data, "host_c.xplane.pb", 4)  # another program id: decoded again
    assert calls == ["host_a.xplane.pb", "host_c.xplane.pb"]
    assert (a.source, b.source, c.source) == ("host_a.xplane.pb", "host_b.xplane.pb", "host_c.xplane.pb")
    assert b.computations is a.computations  # shared: nothing modifies them
    assert [i.name for i in b.entry.instructions] == [i.name for i in a.entry.instructions]


def _parsed(module) -> list:
    """Everything the parser read of a module, as plain values (Instruction compares by identity)."""
    from dataclasses import fields

    return [module.name, module.entry_name, module.attrs, [
        (c.name, c.is_entry, c.execution_thread, [tuple(getattr(i, f.name) for f in fields(i)) for i in c.instructions])
        for c in module.computations.values()]]


def test_fast_paths_read_what_the_general_walk_reads(monkeypatch):
    """The instruction head, plain operands and plain attributes are matched by regular expressions when they can
    be (``_HEAD``, ``_PLAIN_OPERANDS``, ``_PLAIN_ATTR``); with those made never to match, the character walk they
    short-cut reads every fixture dump, the grammar edge cases and the third-party samples the same way."""
    from parsers import hlo_text

    texts = [GRAMMAR] + [p.read_text() for p in sorted(FIXTURES.glob("*/hlo/*optimizations.txt"))]
    texts += [p.read_text() for p in sorted((THIRD_PARTY / "xla_hlo_samples").glob("*.hlo"))]
    walked = []  # attribute values read by the walk, per parse
    walk = hlo_text._Parser.value

    def counted(self):
        walked[-1] += 1
        return walk(self)

    monkeypatch.setattr(hlo_text._Parser, "value", counted)
    walked.append(0)
    fast = [_parsed(m) for t in texts for m in parse_hlo_text(t)]
    never = re.compile(r"(?!)")
    for name in ("_HEAD", "_PLAIN_OPERANDS", "_PLAIN_ATTR"):
        monkeypatch.setattr(hlo_text, name, never)
    walked.append(0)
    slow = [_parsed(m) for t in texts for m in parse_hlo_text(t)]
    assert walked[1] > 10 * walked[0] and walked[1] > 1000  # the fast paths took most attributes; the walk all
    assert len(fast) == len(texts) >= 100 and slow == fast
