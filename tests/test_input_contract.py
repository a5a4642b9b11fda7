"""Issue 11 regression tests for the profile parsers: every bad input found by the fuzz campaign is a
``TraceroofError`` naming the file and the place, or is dropped with a note saying how many and why. Each bad
input is built here from a real fixture."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from parsers.errors import FormatError, InputError, SizeLimitError, TraceroofError
from parsers.trace_json import read_trace_json
from parsers.xprof_export import ExportContext, op_profile_rows, read_export_context, read_hlo_stats
from parsers.xspace import parse_full, read_xspace
from traceroof.chips import get_chip
from traceroof.discovery import discover
from traceroof.join import match_modules
from traceroof.profile import load_profile
from traceroof.xprof import per_core_chip
from tests.conftest import fixture_trace_json, fixture_xplane

SRC = fixture_xplane("scan_mlp")


def _space():
    """The fixture as a protobuf XSpace, and its /host:CPU plane (with 4 lines of events)."""
    m = parse_full(SRC)
    return m, next(p for p in m.planes if p.name == "/host:CPU")


def _write(tmp_path, m, name="vm.xplane.pb"):
    f = tmp_path / name
    f.write_bytes(m.SerializeToString())
    return f


def _copy_hlo(tmp_path):
    import shutil

    shutil.copytree(SRC.parents[4] / "hlo", tmp_path / "hlo")


# -- .xplane.pb: bounded resources -------------------------------------------------------------------------

def test_zero_bytes_are_refused_at_byte_0(tmp_path):
    f = tmp_path / "zeros.xplane.pb"
    f.write_bytes(bytes(20_000_000))
    with pytest.raises(FormatError, match=r"zeros.xplane.pb: .*field number 0 .* at byte 0"):
        read_xspace(f)


def test_gzip_of_zeros_stops_at_the_inflate_limit(tmp_path, monkeypatch):
    f = tmp_path / "zeros.xplane.pb.gz"
    f.write_bytes(gzip.compress(bytes(100_000_000)))  # 97 kB
    with pytest.raises(SizeLimitError, match="zeros.xplane.pb.gz: gzip data inflates to more than 67,108,864 "
                                             "bytes.*TRACEROOF_MAX_INFLATE_BYTES"):
        read_xspace(f)
    monkeypatch.setenv("TRACEROOF_MAX_INFLATE_BYTES", str(200_000_000))  # the user raises the limit
    with pytest.raises(FormatError, match="field number 0"):
        read_xspace(f)
    monkeypatch.setenv("TRACEROOF_MAX_INFLATE_BYTES", "lots")
    with pytest.raises(FormatError, match="TRACEROOF_MAX_INFLATE_BYTES='lots' is not a positive byte count"):
        read_xspace(f)


def test_one_empty_field_per_two_bytes_is_bounded(tmp_path):
    f = tmp_path / "fields.xplane.pb"
    f.write_bytes(b"\x08\x00" * 5_000_000 + b"\x0a\x00" * 70_000)  # varints, then 70,000 empty planes
    with pytest.raises(FormatError, match="more than 65536 planes"):
        read_xspace(f)


@pytest.mark.parametrize("key", [b"\x0b", b"\x0c", b"\x0e", b"\x0f", b"\xf8\xff\xff\xff\x1f"],
                         ids=["group-start", "group-end", "wire-type-6", "wire-type-7", "field-2^30"])
def test_keys_protobuf_cannot_write_are_refused(tmp_path, key):
    f = tmp_path / "k.xplane.pb"
    data = SRC.read_bytes()
    f.write_bytes(data + key + b"\x00" * 8)
    with pytest.raises(FormatError, match=f"k.xplane.pb: .* at byte {len(data)}"):
        read_xspace(f)


def test_truncated_gzip_xplane(tmp_path):
    f = tmp_path / "vm.xplane.pb.gz"
    f.write_bytes(gzip.compress(SRC.read_bytes())[:-40])
    with pytest.raises(FormatError, match="vm.xplane.pb.gz: gzip data is truncated"):
        read_xspace(f)


# -- .xplane.pb: impossible times are dropped with a note -----------------------------------------------------

def test_line_timestamp_overflowing_picoseconds_drops_that_line(tmp_path):
    m, cpu = _space()
    cpu.lines[0].timestamp_ns = 2**62  # * 1000 overflowed the scanner's argument (OverflowError) before
    xs = read_xspace(_write(tmp_path, m))
    ev = xs.plane("/host:CPU").events()
    assert len(ev) == sum(len(line.events) for line in cpu.lines[1:])
    (note,) = xs.notes
    assert note.startswith(f"vm.xplane.pb plane '/host:CPU': {len(cpu.lines[0].events)} events dropped")
    assert "start time that overflows" in note


def test_negative_huge_and_wrapping_times_are_dropped_and_counted(tmp_path):
    m, cpu = _space()
    evs = cpu.lines[1].events
    evs[0].duration_ps = -5
    evs[1].duration_ps = 4_100_000_000_000_000_000  # an op lasting 4.1e18 ps (47 days)
    evs[2].offset_ps = 2**63 - 10  # line_ps + offset_ps wraps
    f = _write(tmp_path, m)
    xs = read_xspace(f)
    ev = xs.plane("/host:CPU").events()
    assert len(ev) == sum(len(line.events) for line in cpu.lines) - 3
    assert ev["duration_ps"].min() >= 0 and ev["duration_ps"].max() < 2**60
    assert ev["start_ps"].abs().max() < 2**62
    (note,) = xs.notes
    assert ("3 events dropped for impossible times (1 with a start time that overflows or lies beyond 2^62 ps "
            "(53 days), 1 with a negative duration, 1 with a duration above 2^60 ps (13 days))") in note
    xs.plane("/host:CPU").events()  # decoding again does not count twice
    assert xs.notes == [note]
    _copy_hlo(tmp_path)
    profile = load_profile(discover([f]))
    assert any("3 events dropped for impossible times" in n for n in profile.notes)


def test_garbage_profile_start_time_is_ignored(tmp_path):
    m, _ = _space()
    env = next(p for p in m.planes if p.name == "Task Environment")
    sid = next(k for k, v in env.stat_metadata.items() if v.name == "profile_start_time")
    stat = next(s for s in env.stats if s.metadata_id == sid)
    stat.str_value = "yesterday"
    assert read_xspace(_write(tmp_path, m)).profile_start_time_ns is None


# -- ids ------------------------------------------------------------------------------------------------------

def _set_stat(plane, name, value):
    """Set stat ``name`` on every event that has it (as an int64 value, or str_value for text)."""
    sid = next(k for k, v in plane.stat_metadata.items() if v.name == name)
    n = 0
    for line in plane.lines:
        for ev in line.events:
            for st in ev.stats:
                if st.metadata_id == sid:
                    if isinstance(value, str):
                        st.str_value = value
                    else:
                        st.int64_value = value
                    n += 1
    return n


def test_program_id_above_2_40_keeps_the_module_name_in_the_join_key(tmp_path):
    m, cpu = _space()
    _set_stat(cpu, "program_id", 2**41 + 20)
    f = _write(tmp_path, m)
    _copy_hlo(tmp_path)
    profile = load_profile(discover([f]))
    assert (profile.rows["program_id"] == 2**41 + 20).all()
    _, report = match_modules(profile.rows, profile.modules)
    # the (module, program id) key decodes to the right pair: before, 2^41 overflowed the 40 bits of the id
    assert f"jit_train_step({2**41 + 20})" in report.unmatched_modules


@pytest.mark.parametrize("value", [-7, "twelve"], ids=["negative", "text"])
def test_invalid_program_ids_become_na_with_a_note(tmp_path, value):
    m, cpu = _space()
    n = _set_stat(cpu, "program_id", value)
    f = _write(tmp_path, m)
    _copy_hlo(tmp_path)
    profile = load_profile(discover([f]))
    assert profile.rows["program_id"].isna().all()
    note = next(x for x in profile.notes if "id stat that is not a valid integer" in x)
    assert f"lost it: {n:,} program_id;" in note


# -- trace JSON -----------------------------------------------------------------------------------------------

def _trace(tmp_path, mutate, name="vm.trace.json.gz"):
    data = json.loads(gzip.decompress(fixture_trace_json("scan_mlp").read_bytes()))
    xs = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    mutate(xs, data)
    f = tmp_path / name
    f.write_bytes(gzip.compress(json.dumps(data).encode()))
    return f, len(xs)


BAD_EVENTS = {
    "pid-text": ({"pid": "seven"}, "a pid or tid that is not an integer"),
    "tid-huge": ({"tid": 10**30}, "a pid or tid that is not an integer"),
    "ts-text": ({"ts": "noon"}, "a missing or impossible ts"),
    "ts-huge": ({"ts": 1e300}, "a missing or impossible ts"),
    "dur-negative": ({"dur": -1.5}, "an impossible dur"),
    "dur-huge": ({"dur": 4.1e12}, "an impossible dur"),
    "name-object": ({"name": {"a": 1}}, "a name that is not a string"),
    "args-list": ({"args": ["hlo_op", "dot"]}, "args that are not a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_EVENTS))
def test_trace_events_of_the_wrong_type_are_dropped_with_a_note(tmp_path, case):
    change, why = BAD_EVENTS[case]
    f, n = _trace(tmp_path, lambda xs, _: [e.update(change) for e in xs[:5]])
    tj = read_trace_json(f)
    assert len(tj.complete_events) == n - 5
    (note,) = tj.notes
    assert note.startswith("vm.trace.json.gz: 5 trace events dropped (5 with " + why)
    ev = tj.events(args=("hlo_op", "program_id"))
    assert len(ev) == n - 5 and ev["duration_ps"].min() >= 0


def test_trace_args_values_of_the_wrong_type_are_not_used(tmp_path):
    f, n = _trace(tmp_path, lambda xs, _: [e["args"].update(hlo_op=["x"], program_id={"v": 1})
                                           for e in xs if isinstance(e.get("args"), dict)][:1])
    ev = read_trace_json(f).events(args=("hlo_op", "program_id"))
    assert len(ev) == n


def test_trace_metadata_of_the_wrong_type_is_ignored(tmp_path):
    def mutate(_, data):
        for e in data["traceEvents"]:
            if e.get("ph") == "M":
                e["args"] = ["name"]
    f, n = _trace(tmp_path, mutate)
    tj = read_trace_json(f)
    assert tj.process_names == {} and len(tj.complete_events) == n


def test_deeply_nested_trace_json_is_a_format_error(tmp_path):
    f = tmp_path / "deep.trace.json"
    f.write_text('{"traceEvents": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(FormatError, match="deep.trace.json: JSON nested too deeply"):
        read_trace_json(f)


def test_truncated_gzip_trace_json(tmp_path):
    f = tmp_path / "vm.trace.json.gz"
    f.write_bytes(fixture_trace_json("scan_mlp").read_bytes()[:-100])
    with pytest.raises(FormatError, match="vm.trace.json.gz: gzip data is truncated"):
        read_trace_json(f)


def test_an_op_event_lasting_days_is_dropped_with_a_note(tmp_path):  # fuzz: a 7.8-day op below the parser limit
    ops = [e for e in json.loads(gzip.decompress(fixture_trace_json("scan_mlp").read_bytes()))["traceEvents"]
           if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})]
    f, _ = _trace(tmp_path, lambda xs, _: next(e for e in xs if e is not None and e.get("name") == ops[5]["name"]
                                               and e.get("ts") == ops[5]["ts"]).update(dur=6.74e11))
    _copy_hlo(tmp_path)
    profile = load_profile(discover([f]))
    assert any("1 op events lasting more than a day dropped" in n for n in profile.notes), profile.notes
    assert profile.timeline.duration_ps.max() < 86_400 * 10**12


def test_trace_json_profile_notes_what_was_dropped(tmp_path):
    f, _ = _trace(tmp_path, lambda xs, _: [e.update(dur=-1) for e in xs[:3]])
    _copy_hlo(tmp_path)
    profile = load_profile(discover([f]))
    assert any("3 trace events dropped" in n for n in profile.notes)


# -- XProf exports --------------------------------------------------------------------------------------------

def _hlo_stats(tmp_path, mutate, name="x.hlo_stats.json"):
    cols = [{"id": c, "label": c, "type": "string"} for c in
            ("program_id", "category", "hlo_op_name", "hlo_op_expression", "occurrences", "total_time",
             "total_self_time", "model_flop_rate", "hbm_bw")]
    rows = [{"c": [{"v": v} for v in ("7", "loop fusion", f"fusion.{i}", "", 2.0, 10.0, 10.0, 1.0, 3.0)]}
            for i in range(4)]
    data = {"cols": cols, "rows": rows}
    mutate(data)
    f = tmp_path / name
    f.write_bytes(gzip.compress(json.dumps(data).encode()) if name.endswith(".gz") else json.dumps(data).encode())
    return f


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(rows={"c": []}), r"table 0: 'rows' is not a list"),
    (lambda d: d.update(cols="rank"), r"table 0: 'cols' is not a list of column objects"),
    (lambda d: d["rows"].__setitem__(2, ["x"]), r"table 0 row 2: not an object with a list of cells"),
    (lambda d: d["rows"][3]["c"][6].update(v="fast"), r"row 3 column total_self_time: 'fast' is not a finite"),
    (lambda d: d["rows"][1]["c"][4].update(v=-2), r"row 1 column occurrences: '-2.0' is not a finite"),
    (lambda d: d["rows"][0]["c"][2].update(v={"a": 1}), r"row 0 column hlo_op_name: a JSON dict"),
    (lambda d: d.update(cols=d["cols"][:4]), r"missing columns total_self_time, occurrences"),
    (lambda d: d["cols"].__setitem__(3, dict(d["cols"][2])), r"column 'hlo_op_name' appears more than once"),
], ids=["rows-object", "cols-text", "row-list", "cell-text", "cell-negative", "cell-object", "missing-columns",
        "column-twice"])
def test_hlo_stats_export_of_unexpected_shape(tmp_path, mutate, match):
    f = _hlo_stats(tmp_path, mutate)
    with pytest.raises(FormatError, match=r"x.hlo_stats.json: .*" + match):
        read_hlo_stats(f)


def test_hlo_stats_export_well_formed_and_truncated(tmp_path):
    f = _hlo_stats(tmp_path, lambda d: None, "x.hlo_stats.json.gz")
    assert read_hlo_stats(f)["total_self_time"].sum() == 40.0
    f.write_bytes(f.read_bytes()[:-12])
    with pytest.raises(FormatError, match="x.hlo_stats.json.gz: gzip data is truncated"):
        read_hlo_stats(f)


@pytest.mark.parametrize("cell, value, match", [
    (6, 1e30, r"row 1: op 'fusion.1' totals 1e\+24 s, beyond 13 days"),  # int(ps) would overflow int64
    (7, 1e300, r"row 1: op 'fusion.1': FLOP or HBM rate times its time overflows"),  # FLOPs would be inf
], ids=["huge-time", "overflowing-rate"])
def test_export_figures_that_overflow_are_format_errors(tmp_path, cell, value, match):
    from traceroof.xprof import export_op_table

    f = _hlo_stats(tmp_path, lambda d: d["rows"][1]["c"][cell].update(v=value))
    with pytest.raises(FormatError, match=match):
        export_op_table(f)


def test_an_export_without_op_rows_is_an_input_error(tmp_path):  # fuzz: a KeyError on the empty table
    from traceroof.xprof import export_op_table

    with pytest.raises(InputError, match="x.hlo_stats.json: the HLO Op Stats export holds no op rows"):
        export_op_table(_hlo_stats(tmp_path, lambda d: d.update(rows=[])))


def test_hlo_stats_csv_with_a_non_numeric_cell(tmp_path):
    f = tmp_path / "x_hlo_stats.csv.gz"
    f.write_bytes(gzip.compress(b"HLO op name,#Occurrences,Total self time (us)\nfusion.1,3,12.5\nfusion.2,x,1\n"))
    with pytest.raises(FormatError, match="x_hlo_stats.csv.gz: row 1 column occurrences: 'x'"):
        read_hlo_stats(f)


def test_op_profile_of_unexpected_shape_and_depth():
    leaf = {"name": "fusion.1", "xla": {"expression": "", "category": "loop fusion"},
            "metrics": {"occurrences": 2, "rawTime": 1e6, "rawFlops": 10.0}}
    tree = {"children": [leaf]}
    for _ in range(5000):  # far deeper than Python's recursion limit: the walk uses a stack
        tree = {"name": "p", "children": [tree]}
    assert len(op_profile_rows({"byProgram": tree})) == 1
    with pytest.raises(FormatError, match="op.json: byProgram child 0: 'children' is not a list"):
        op_profile_rows({"byProgram": {"children": [{"children": "x"}]}}, "op.json")
    bad = dict(leaf, metrics={"occurrences": 1, "rawTime": "slow"})
    with pytest.raises(FormatError, match="op.json: byProgram child 0 metric rawTime: 'slow'"):
        op_profile_rows({"byProgram": {"children": [bad]}}, "op.json")


def test_export_context_properties_are_checked(tmp_path):
    table = {"cols": [{"id": "a"}], "rows": [], "p": {"peak_flop_rate": "NaN", "device_type": "TPU v4"}}
    (tmp_path / "x.roofline_model.json").write_text(json.dumps([table]))
    with pytest.raises(FormatError, match="x.roofline_model.json: property peak_flop_rate: 'NaN'"):
        read_export_context(tmp_path)
    table["p"] = {"peak_flop_rate": "275000", "peak_hbm_bw": "1120", "megacore": "1"}
    (tmp_path / "x.roofline_model.json").write_text(json.dumps([table]))
    ctx = read_export_context(tmp_path)
    assert ctx.peak_flops_per_s == 2.75e14 and ctx.megacore is True


# -- per-device chip figures of an export ---------------------------------------------------------------------

def test_export_devices_follow_the_per_device_rule():
    v4, v3, v5p = get_chip("tpu_v4"), get_chip("tpu_v3"), get_chip("tpu_v5p")
    same, note = per_core_chip(v4, ExportContext())
    assert same is v4 and note == ""  # a v4 megacore device is the whole chip: peaks not halved
    assert per_core_chip(v5p, ExportContext(megacore=True))[0] is v5p
    half, note = per_core_chip(v3, ExportContext())  # v3: each device is one of the 2 TensorCores
    assert half.peak_flops_per_s["bf16"] == pytest.approx(v3.peak_flops_per_s["bf16"] / 2) and "TensorCores" in note
    off, note = per_core_chip(v5p, ExportContext(megacore=False))  # the export says megacore is off
    assert off.peak_flops_per_s["bf16"] == pytest.approx(v5p.peak_flops_per_s["bf16"] / 2)
    assert "megacore is off" in note


def test_every_bad_input_here_is_a_traceroof_error():
    assert issubclass(SizeLimitError, FormatError) and issubclass(FormatError, TraceroofError)


def test_a_saved_report_given_to_analyze_points_to_diff():
    """A user passed `traceroof analyze --format json`'s output back to analyze and read "JSON without
    'traceEvents'"; the line now says it is a report and how to compare two."""
    report = Path(__file__).resolve().parents[1] / "reports" / "transformer.json"
    with pytest.raises(FormatError, match=r"a traceroof report, not a profile: .*`traceroof diff BASE.json NEW.json`"):
        read_trace_json(report)


def test_a_truncated_xplane_points_to_the_trace_json_beside_it(tmp_path):
    """TensorBoard writes a host's capture both ways; a user whose .xplane.pb was cut short got the error alone."""
    run = tmp_path / "plugins" / "profile" / "r1"
    run.mkdir(parents=True)
    xp = fixture_xplane("sharded_mlp")
    (run / "vm.xplane.pb").write_bytes(xp.read_bytes()[: xp.stat().st_size // 2])
    with pytest.raises(FormatError) as alone:
        load_profile(discover([tmp_path], []))
    assert "pass an intact .xplane.pb" in str(alone.value) and "trace JSON" not in str(alone.value)
    (run / "vm.trace.json.gz").write_bytes(fixture_trace_json("sharded_mlp").read_bytes())
    with pytest.raises(FormatError) as beside:
        load_profile(discover([tmp_path], []))
    assert str(beside.value).endswith("; or analyze vm.trace.json.gz beside it, the same capture as a trace JSON "
                                      "(op times only: it carries no HLO)")
    assert "\n" not in str(beside.value)
