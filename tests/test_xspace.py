"""XSpace decoder: event for event against protobuf's own full parse, and corrupt inputs."""

from __future__ import annotations

import gzip
import shutil

import numpy as np
import pytest

from parsers.errors import FormatError, InputError
from parsers.xspace import AGGREGATE_START_PS, parse_full, read_xspace, stat_value
from tests.conftest import THIRD_PARTY, fixture_xplane

THIRD_PARTY_PROFILES = sorted(THIRD_PARTY.rglob("*.xplane.pb")) if THIRD_PARTY.exists() else []


def _check_against_protobuf(path) -> int:
    xs = read_xspace(path)
    full = parse_full(path)
    assert [p.name for p in xs.planes] == [p.name for p in full.planes]
    total = 0
    for plane, ref in zip(xs.planes, full.planes):
        names = {k: v.name for k, v in ref.stat_metadata.items()}
        assert plane.stat_names == names
        assert {k: v.name for k, v in ref.event_metadata.items()} == {k: m.name for k, m in plane.event_metadata.items()}
        assert plane.stats == {names.get(s.metadata_id, str(s.metadata_id)): stat_value(s, names) for s in ref.stats}
        used = {names[st.metadata_id] for line in ref.lines for ev in line.events for st in ev.stats}
        df = plane.events(stats=sorted(used), merge_metadata_stats=False)
        rows = df.to_dict("list")
        i = 0
        for line in ref.lines:
            for ev in line.events:
                assert rows["line_id"][i] == line.id
                assert rows["metadata_id"][i] == ev.metadata_id
                assert rows["duration_ps"][i] == ev.duration_ps
                if ev.WhichOneof("data") == "num_occurrences":
                    assert rows["start_ps"][i] == AGGREGATE_START_PS
                else:
                    assert rows["start_ps"][i] == line.timestamp_ns * 1000 + ev.offset_ps
                last = {names[s.metadata_id]: s for s in ev.stats}  # a repeated stat: the last one wins
                for name, st in last.items():
                    want, got = stat_value(st, names), rows[name][i]
                    if isinstance(want, float):
                        assert got == pytest.approx(want, rel=1e-12, nan_ok=True)
                    else:
                        assert got == want, (name, got, want)
                i += 1
        assert i == len(df)
        total += i
    return total


@pytest.mark.parametrize("name", ["transformer", "scan_mlp"])
def test_fixture_events_match_protobuf(name):
    assert _check_against_protobuf(fixture_xplane(name)) > 3000


@pytest.mark.parametrize("path", THIRD_PARTY_PROFILES, ids=lambda p: p.name[:40])
def test_third_party_events_match_protobuf(path):
    assert _check_against_protobuf(path) > 1000


def test_third_party_present_or_skipped():
    if not THIRD_PARTY_PROFILES:
        pytest.skip("../shared/fixtures/third_party not present")
    assert len(THIRD_PARTY_PROFILES) >= 7


def test_metadata_stats_merge_and_require_filter():
    xs = read_xspace(fixture_xplane("transformer"))
    cpu = xs.plane("/host:CPU")
    ops = cpu.events(stats=["program_id"], require=["hlo_op"])
    full = next(p for p in parse_full(fixture_xplane("transformer")).planes if p.name == "/host:CPU")
    hlo_op = next(k for k, v in full.stat_metadata.items() if v.name == "hlo_op")
    with_op = sum(1 for line in full.lines for ev in line.events if any(st.metadata_id == hlo_op for st in ev.stats))
    assert len(ops) == with_op  # counted with protobuf alone
    assert set(ops["program_id"].dropna().unique()) == {54}
    meta = xs.plane("/host:metadata")
    assert all("Hlo Proto" in m.stats for m in meta.event_metadata.values())
    assert xs.profile_start_time_ns and xs.host == "vm"


def test_gzip_xplane_reads_the_same(tmp_path):
    src = fixture_xplane("scan_mlp")
    gz = tmp_path / "x.xplane.pb.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    a = read_xspace(src).plane("/host:CPU").events(stats=["hlo_op"])
    b = read_xspace(gz).plane("/host:CPU").events(stats=["hlo_op"])
    assert a.equals(b)


def test_truncated_file_is_a_format_error(tmp_path):
    data = fixture_xplane("scan_mlp").read_bytes()
    bad = tmp_path / "cut.xplane.pb"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError) as err:
        xs = read_xspace(bad)
        for p in xs.planes:
            p.events()
    assert "cut.xplane.pb" in str(err.value) and "\n" not in str(err.value)
    assert "the file is cut short" in str(err.value)  # the plane at byte 0 claims more bytes than remain


def test_text_mangled_file_is_named(tmp_path):
    data = fixture_xplane("scan_mlp").read_bytes()
    mangled = b"".join(b"\xef\xbf\xbd" if b >= 0x80 else bytes([b]) for b in data[:20000])
    bad = tmp_path / "mangled.xplane.pb"
    bad.write_bytes(mangled)
    with pytest.raises(FormatError) as err:
        xs = read_xspace(bad)
        for p in xs.planes:
            p.events()
    assert "mangled.xplane.pb" in str(err.value)


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "e.xplane.pb"
    empty.write_bytes(b"")
    with pytest.raises(FormatError):
        read_xspace(empty)
    with pytest.raises(InputError):
        read_xspace(tmp_path / "missing.xplane.pb")


def test_input_is_never_modified(tmp_path):
    src = tmp_path / "copy.xplane.pb"
    shutil.copy(fixture_xplane("scan_mlp"), src)
    before = src.read_bytes()
    read_xspace(src).plane("/host:CPU").events(stats=["hlo_op"])
    assert src.read_bytes() == before


def test_gpu_kernel_events_carry_hlo_ops():
    path = THIRD_PARTY / "tracelens_mi300x" / "jax08_gemm.xplane.pb"
    if not path.exists():
        pytest.skip("third-party MI300X profile not present")
    xs = read_xspace(path)
    gpu = [p for p in xs.planes if p.name.startswith("/device:GPU:")]
    ev = [p.events(stats=["hlo_op", "hlo_module", "program_id"], require=["hlo_op"]) for p in gpu]
    kernels = sum(len(e) for e in ev)
    assert kernels > 0
    assert all(np.all(e["program_id"].notna()) for e in ev if len(e))
