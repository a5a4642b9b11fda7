"""The pure-Python wire scanner (parsers/_wirescan_py.py) against the C one (parsers/_wirescan.c): every fixture
decodes to the same events, column for column, and every corrupt input fails with the same error class and message
(or drops the same events with the same notes). Also: which decoder runs, and how it is chosen."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from parsers import _wirescan_py as P
from parsers import xspace
from parsers.errors import InputError
from parsers.xspace import SCHEMA, parse_full, read_xspace
from tests.conftest import FIXTURES, HOST_CHIP, ROOT, THIRD_PARTY, fixture_xplane

C = pytest.importorskip("parsers._wirescan", reason="the C scanner is not built: nothing to compare with")

XPLANES = sorted(FIXTURES.rglob("*.xplane.pb")) + sorted(THIRD_PARTY.rglob("*.xplane.pb"))
SRC = fixture_xplane("scan_mlp")


STATS = ("hlo_op", "hlo_module", "program_id", "device_ordinal", "step_num", "correlation_id", "run_id", "_p", "_c",
         "group_id", "kernel_details", "tf_op", "shape", "kernel_name", "bytes_allocated", "flops")


def _outcome(path, decoder: str):
    """Everything read_xspace and Plane.events give for a file (stats of every kind as columns; the raw test
    below compares all of them), or the error raised."""
    try:
        xs = read_xspace(path, decoder)
        assert xs.decoder == decoder
        planes = []
        for p in xs.planes:
            ev = p.events(stats=STATS)
            # with require the scanner filters the events
            kept = p.events(stats=("hlo_op", "_c"), require=("hlo_op", "step_num"), names="end: ")
            planes.append((p.id, p.name, p.stats, p.event_metadata, p.stat_names, p.lines, ev, p.notes, kept))
        return (xs.hostnames, xs.errors, xs.warnings, planes, xs.notes)
    except Exception as e:  # compared by class and message
        return (type(e), str(e))


def _assert_same(path):
    c, py = _outcome(path, "c"), _outcome(path, "python")
    if isinstance(c[0], type) or isinstance(py[0], type):
        assert py == c
        return c
    assert py[:3] == c[:3] and py[4] == c[4]
    assert len(py[3]) == len(c[3])
    for a, b in zip(c[3], py[3]):
        assert a[:6] == b[:6] and a[7] == b[7]
        pd.testing.assert_frame_equal(a[6], b[6], check_exact=True)
        pd.testing.assert_frame_equal(a[8], b[8], check_exact=True)
    return c


@pytest.mark.parametrize("path", XPLANES, ids=[str(p.relative_to(p.parents[len(p.parents) - 4])) for p in XPLANES])
def test_every_fixture_decodes_alike(path):
    """read_xspace and Plane.events agree; decode_events writes the same arrays for every line, every stat of
    the plane wanted."""
    _assert_same(path)
    data = path.read_bytes()
    for fs, fe, ts, count, ids in _lines(data):
        assert _decode(P, data, fs, fe, ts, count, ids) == _decode(C, data, fs, fe, ts, count, ids)


# -- the functions themselves, on raw bytes --------------------------------------------------------------------

def _lines(data: bytes):
    """(payload start, end, timestamp_ns, event count, stat ids) of every XLine in the file."""
    out = []
    for _, _, _, s, e, _ in C.scan_fields(data, 0, len(data), 1):
        xp = SCHEMA["XPlane"]()
        xp.ParseFromString(C.split_fields(data, s, e, 3)[0])
        for _, _, _, fs, fe, _ in C.scan_fields(data, s, e, 3):
            head, count = C.split_fields(data, fs, fe, 4)
            xl = SCHEMA["XLine"]()
            xl.ParseFromString(head)
            out.append((fs, fe, xl.timestamp_ns, count, sorted(xp.stat_metadata)))
    return out


def _call(fn):
    try:
        r = fn()
    except Exception as e:
        return type(e), str(e)
    return r


def _decode(mod, data, fs, fe, ts, rows, ids, first=0):
    """decode_events' result and every output array (bytes), or its error."""
    n, ncol = rows + first, len(ids)
    arrays = [np.zeros(n, np.int64) for _ in range(3)] + [np.zeros(n * ncol, np.int64), np.zeros(n * ncol, np.int8)]
    got = _call(lambda: mod.decode_events(data, fs, fe, ts, np.array(ids, np.int64).tobytes(), first, *arrays))
    return got, [a.tobytes() for a in arrays] if not isinstance(got[0], type) else None


def _decode_kept(mod, data, fs, fe, ts, rows, ids, keep_ids, keep_columns, first=0):
    """decode_events keeping only some events (``keep_ids``, ``keep_columns``): its result and the rows it wrote
    (bytes), or its error."""
    n, ncol = rows + first, len(ids)
    arrays = [np.zeros(n, np.int64) for _ in range(3)] + [np.zeros(n * ncol, np.int64), np.zeros(n * ncol, np.int8)]
    got = _call(lambda: mod.decode_events(data, fs, fe, ts, np.array(ids, np.int64).tobytes(), first, *arrays,
                                          np.array(keep_ids, np.int64).tobytes(),
                                          np.array(keep_columns, np.int64).tobytes()))
    if isinstance(got[0], type):
        return got, None
    k = got[0]
    values, kinds = (a.reshape(ncol, n)[:, first:first + k] for a in arrays[3:])
    values = np.where(kinds != 0, values, 0)  # where an event lacks a stat its row may hold a dropped event's value
    return got, [a[first:first + k].tobytes() for a in arrays[:3]] + [values.tobytes(), kinds.tobytes()]


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not out[-1] & 0x80:
            return bytes(out)


def _field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def test_constants_are_the_c_ones():
    assert (P.TIME_LIMIT_PS, P.DURATION_LIMIT_PS) == (C.TIME_LIMIT_PS, C.DURATION_LIMIT_PS)


def test_exact_walk_alone_matches_c(monkeypatch):
    """The byte walk the Python module falls back to gives the C results on whole real lines, every stat wanted."""
    data = SRC.read_bytes()
    monkeypatch.setattr(P, "_decode_fast", lambda *a: None)
    for fs, fe, ts, count, ids in _lines(data):
        assert _decode(P, data, fs, fe, ts, count, ids) == _decode(C, data, fs, fe, ts, count, ids)


def _kept_by_hand(every, ncol, keep_ids, keep_columns):
    """The rows of an unfiltered decode (:func:`_decode`) that keep_ids / keep_columns keep, picked with numpy:
    an event of a kept id, or carrying a stat of a kept column, or whose time is impossible."""
    mid, start, dur = (np.frombuffer(a, np.int64) for a in every[1][:3])
    values = np.frombuffer(every[1][3], np.int64).reshape(ncol, -1)
    kinds = np.frombuffer(every[1][4], np.int8).reshape(ncol, -1)
    keep = np.isin(mid, np.array(keep_ids, np.int64)) | (start > P.AGGREGATE_START) & (start <= P.BAD_LONG_DURATION)
    if keep_columns:
        keep |= (kinds[keep_columns] != 0).any(axis=0)
    values = np.where(kinds != 0, values, 0)
    rows = [mid[keep], start[keep], dur[keep], values[:, keep], kinds[:, keep]]
    return (int(keep.sum()), *every[0][1:]), [np.ascontiguousarray(a).tobytes() for a in rows]


def test_kept_events_decode_alike(monkeypatch):
    """With keep_ids / keep_columns both scanners write the same events (those of the ids kept, those carrying a
    stat of a column kept), the protobuf path and the byte walk alike; keeping every id writes every event."""
    data = SRC.read_bytes()
    lines = _lines(data)
    for fs, fe, ts, count, ids in lines:
        mids = sorted(set(np.frombuffer(_decode(C, data, fs, fe, ts, count, ids)[1][0], np.int64).tolist()))
        every = _decode(C, data, fs, fe, ts, count, ids)
        assert _decode_kept(C, data, fs, fe, ts, count, ids, mids, [])[0] == every[0]
        for keep_ids, cols in ((mids[::3] + [5000, 2**40], []), ([-1] + mids[1::2], [0, len(ids) - 1]), ([], [0]),
                               (mids, [])):
            want = _decode_kept(C, data, fs, fe, ts, count + 1, ids, keep_ids, cols, 1)
            assert want == _kept_by_hand(every, len(ids), keep_ids, cols)
            assert _decode_kept(P, data, fs, fe, ts, count + 1, ids, keep_ids, cols, 1) == want
            with monkeypatch.context() as m:
                m.setattr(P, "_decode_fast", lambda *a: None)
                assert _decode_kept(P, data, fs, fe, ts, count + 1, ids, keep_ids, cols, 1) == want
    fs, fe, ts, count, ids = lines[0]
    for keep_ids, cols in (([3, 1], []), ([1], [len(ids)]), ([1], [-1])):
        got = _decode_kept(C, data, fs, fe, ts, count, ids, keep_ids, cols)
        assert got[0][0] is ValueError and got == _decode_kept(P, data, fs, fe, ts, count, ids, keep_ids, cols)


def test_fast_path_is_taken_on_real_lines(monkeypatch):
    data = SRC.read_bytes()
    monkeypatch.setattr(P, "_decode_exact", lambda *a: pytest.fail("the byte walk ran on a canonical line"))
    for fs, fe, ts, count, ids in _lines(data):
        assert _decode(P, data, fs, fe, ts, count, ids)[0][0] == count


EDGE_EVENTS = [
    b"\x08\x01\x10" + _varint(2**63 - 10) + b"\x18\x05",  # line_ps + offset_ps wraps
    b"\x08\x01\x10\x01\x18" + _varint(-5),  # negative duration
    b"\x08\x01\x28\x03\x18" + _varint(2**63 - 1),  # aggregate with a huge duration
    b"\x08\x01\x10" + _varint(-2**63) + b"\x18" + _varint(2**63 - 1),
    b"\x08\x01\x10\x05\x18" + _varint(2**60 + 1),  # a duration just above the limit
    b"\x10" + _varint(-2**62 - 1000) + b"\x18\x00",  # a start just below -2^62
    b"\x08\x01\x10\x05\x22\x0b\x08\x02\x11" + bytes(6) + b"\xf8\x7f",  # a NaN double stat
    b"\x08\x01\x10\x05\x22\x06\x08\x02\x2a\x02hi",  # a str stat
    b"\x08\x01\x10\x05\x22\x06\x08\x02\x42\x02hi",  # a compressed_str stat (not gzip)
    b"\x08\x01\x10\x05\x22\x0d\x08\x02\x18" + _varint(2**64 - 3),  # a uint64 stat above 2^63
    b"\x08\x01\x10\x05\x22\x02\x08\x02\x22\x04\x08\x02\x20\x07",  # a stat without value, then one with
    b"\x08\x01\x10\x05\x22\x04\x08\x02\x20\x07\x22\x02\x08\x02",  # ... and the other way round
    b"\x08" + b"\x80" * 10 + b"\x01",  # an 11-byte varint
    b"\x18" + b"\xff" * 9 + b"\x7f\x10\x01",  # a 10-byte varint with bits above 64
    b"\x08\x00\x10\x05",  # an explicit zero metadata id (not canonical)
    b"\x10\x05\x08\x01",  # fields out of order (not canonical)
    b"\x08\x01\x10\x05\x0b\x0c",  # an empty group
    b"\x08\x01\x10\x05\x22\x04\x08\x02\x13\x14",  # an empty group in a stat
    b"\x08\x01\x10\x05\x22\x03\x08\x02\x11",  # a double cut short
    b"\x08\x01\x10\x05\x22\x09\x08\x02\x2a\x02\xff\xfe\x38\x05\x35",  # bad UTF-8, then a fixed32 cut short
]


@pytest.mark.parametrize("ts", [1000, 2**62, 9223372036854775])
@pytest.mark.parametrize("i", range(len(EDGE_EVENTS)))
def test_edge_events_decode_alike(i, ts):
    """Hand-made events at the edges of the input contract, alone and after a real line's events, with room for
    more rows than events and for fewer."""
    data = SRC.read_bytes()
    fs, fe, _, count, _ = min((x for x in _lines(data) if x[3] > 1), key=lambda x: x[3])
    line = data[fs:fe] + _field(4, EDGE_EVENTS[i])
    for payload, rows in ((_field(4, EDGE_EVENTS[i]), 1), (line, count + 1), (line, count), (line, count + 3)):
        buf = b"\x07" * 5 + payload
        for ids in ([], [2], [9, 2, 2]):
            assert _decode(P, buf, 5, len(buf), ts, rows, ids, 1) == _decode(C, buf, 5, len(buf), ts, rows, ids, 1)
            for keep in (([], []), ([1], [])) + ((([7], [len(ids) - 1]),) if ids else ()):  # impossible times kept
                assert (_decode_kept(P, buf, 5, len(buf), ts, rows, ids, *keep, 1)
                        == _decode_kept(C, buf, 5, len(buf), ts, rows, ids, *keep, 1))
        for fn in (lambda m: m.split_fields(buf, 5, len(buf), 4), lambda m: m.split_fields(buf, 5, len(buf), 1),
                   lambda m: m.scan_fields(buf, 5, len(buf), 4, 1000)):
            assert _call(lambda: fn(P)) == _call(lambda: fn(C))


def test_long_stat_strings_fail_alike():
    ev = b"\x08\x01\x10\x05" + _field(4, b"\x08\x09" + _field(6, bytes(1 << 24)))
    buf = _field(4, b"\x08\x01") + _field(4, ev)
    for ids in ([], [9]):
        got = _decode(C, buf, 0, len(buf), 0, 2, ids)
        assert got[0] == (ValueError, "an event stat string longer than 16 MiB at byte 20")
        assert _decode(P, buf, 0, len(buf), 0, 2, ids) == got


@pytest.mark.parametrize("args", [(-1, 5), (0, 10**9), (7, 3)], ids=["negative", "past-end", "reversed"])
def test_bad_ranges_fail_alike(args):
    data = SRC.read_bytes()[:100]
    for fn in (lambda m: m.scan_fields(data, *args), lambda m: m.split_fields(data, *args, 3),
               lambda m: _decode(m, data, *args, 0, 1, [1])[0]):
        assert _call(lambda: fn(P)) == _call(lambda: fn(C))


def test_random_corruptions_fail_or_decode_alike():
    """Seeded byte flips, cuts and insertions in real lines: decode_events, scan_fields and split_fields agree."""
    data = SRC.read_bytes()
    lines = _lines(data)
    rng = random.Random(12)
    inserts = [b"\x0b", b"\x0c", b"\x0e", b"\x0f", b"\x00", b"\xff" * 11, b"\xf8\xff\xff\xff\x1f", b"\x22\x7f"]
    outcomes = set()
    for _ in range(150):
        fs, fe, ts, count, ids = rng.choice(lines)
        b = bytearray(data[:fe])
        kind = rng.randrange(4)
        if kind == 0:
            for _ in range(rng.randrange(1, 6)):
                b[rng.randrange(fs, fe)] = rng.randrange(256)
        elif kind == 1:
            del b[rng.randrange(fs, fe):]
        elif kind == 2:
            pos = rng.randrange(fs, fe)
            b[pos:pos] = rng.choice(inserts)
        else:
            b[rng.randrange(fs, fe)] |= 0x80
        b = bytes(b)
        end = min(fe + (kind == 2) * 11, len(b))
        got = _decode(C, b, fs, end, ts, count + rng.choice([0, 1]), ids)
        assert _decode(P, b, fs, end, ts, count + 1, ids)[0] == _decode(C, b, fs, end, ts, count + 1, ids)[0]
        for fn in (lambda m: m.scan_fields(b, fs, end), lambda m: m.scan_fields(b, fs, end, 4, 3),
                   lambda m: m.split_fields(b, fs, end, 4)):
            assert _call(lambda: fn(P)) == _call(lambda: fn(C))
        outcomes.add(got[0][1].split(" at byte")[0] if isinstance(got[0][0], type) else
                     "decoded" if got[0][2] == end else "stopped: no row left")
    assert len(outcomes) >= 4, outcomes  # the corruptions reach several different errors, some decode, some stop


# -- whole files through read_xspace and Plane.events ------------------------------------------------------------

def _space():
    m = parse_full(SRC)
    return m, next(p for p in m.planes if p.name == "/host:CPU")


def _bad_times(m, cpu):
    cpu.lines[0].timestamp_ns = 2**62
    evs = cpu.lines[1].events
    evs[0].duration_ps = -5
    evs[1].duration_ps = 4_100_000_000_000_000_000
    evs[2].offset_ps = 2**63 - 10


def _bytes_of(mutate):
    m, cpu = _space()
    mutate(m, cpu)
    return m.SerializeToString()


FILES = {
    "impossible-times": lambda: _bytes_of(_bad_times),
    "truncated": lambda: SRC.read_bytes()[: len(SRC.read_bytes()) * 2 // 3],
    "zeros": lambda: bytes(1000),
    "field-0-after-the-planes": lambda: SRC.read_bytes() + b"\x00\x00",
    "wire-type-7-in-a-stat": lambda: _bytes_of(lambda m, cpu: cpu.lines[1].events[3].stats.add(metadata_id=1))
    .replace(b"\x22\x02\x08\x01", b"\x22\x02\x0f\x01"),
    "group-in-an-event": lambda: _bytes_of(lambda m, cpu: cpu.lines[0].events[0].stats.add(metadata_id=77))
    .replace(b"\x22\x02\x08\x4d", b"\x23\x24\x08\x4d"),
    "event-length-past-its-line": lambda: _bytes_of(lambda m, cpu: cpu.lines[2].events[0].stats.add(metadata_id=78))
    .replace(b"\x22\x02\x08\x4e", b"\x22\x7f\x08\x4e"),
}


@pytest.mark.parametrize("case", sorted(FILES))
def test_corrupt_files_fail_or_drop_alike(tmp_path, case):
    f = tmp_path / "vm.xplane.pb"
    f.write_bytes(FILES[case]())
    got = _assert_same(f)
    if case == "impossible-times":
        assert "events dropped for impossible times" in got[4][0]
    else:
        assert got[0] is xspace.FormatError and str(f) in got[1], got


@pytest.mark.parametrize("case", ["scan_mlp", "impossible-times"])
def test_long_lines_decode_a_batch_at_a_time(tmp_path, monkeypatch, case):
    """A line longer than a batch of rows (a thread of a long capture: millions of events) is decoded a batch at a
    time by the C scanner, going on from where the full batch stopped: the same events, columns and notes (events
    dropped for impossible times counted over the pieces of a line) as the Python scanner, which decodes it whole."""
    f = tmp_path / "vm.xplane.pb"
    f.write_bytes(SRC.read_bytes() if case == "scan_mlp" else FILES[case]())
    monkeypatch.setattr(xspace, "_BATCH_ROWS", 5)
    decode, stops = C.decode_events, []

    def counted(buf, start, end, *args):
        got = decode(buf, start, end, *args)
        stops.append(got[2] < end)
        return got
    monkeypatch.setattr(C, "decode_events", counted)
    got = _assert_same(f)
    assert sum(stops) > 10 and not all(stops)  # lines were cut into batches, and each went on to its end
    if case == "impossible-times":
        assert "141 events dropped for impossible times" in got[4][0], got[4]  # line 0 (138) and 3 of line 1


# -- choosing the decoder ------------------------------------------------------------------------------------

def test_the_environment_chooses_the_decoder(monkeypatch):
    monkeypatch.setenv("TRACEROOF_DECODER", "python")
    assert read_xspace(SRC).decoder == "python"
    assert read_xspace(SRC, "c").decoder == "c"  # an explicit choice wins
    monkeypatch.setenv("TRACEROOF_DECODER", "c")
    assert read_xspace(SRC).decoder == "c"
    monkeypatch.setenv("TRACEROOF_DECODER", "fast")
    with pytest.raises(InputError, match="TRACEROOF_DECODER='fast' is not one of c, python"):
        read_xspace(SRC)
    monkeypatch.delenv("TRACEROOF_DECODER")
    assert read_xspace(SRC).decoder == "c"
    monkeypatch.setattr(xspace, "_wirescan_c", None)  # as if the extension were not built
    assert read_xspace(SRC).decoder == "python"
    with pytest.raises(InputError, match="the C decoder .* is not built in this installation"):
        read_xspace(SRC, "c")


def test_profile_says_which_decoder_ran(monkeypatch):
    from traceroof.discovery import discover
    from traceroof.profile import load_profile

    monkeypatch.setenv("TRACEROOF_DECODER", "python")
    assert load_profile(discover([SRC.parents[4]])).decoder == "python"
    monkeypatch.delenv("TRACEROOF_DECODER")
    assert load_profile(discover([SRC.parents[4]])).decoder == "c"


def test_without_the_c_extension_the_cli_runs_on_the_python_decoder(tmp_path):
    """The C module cannot be imported (as in an install without a compiler): the Python decoder runs."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'parsers._wirescan':\n"
        "            raise ImportError('no C scanner here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from parsers.xspace import read_xspace\n"
        f"assert read_xspace({str(SRC)!r}).decoder == 'python'\n"
        "from traceroof.cli import main\n"
        f"main(['analyze', {str(SRC.parents[4])!r}, '--chip', {HOST_CHIP!r}, '--format', 'json', "
        f"'-o', {str(tmp_path / 'r.json')!r}])\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["decoder"] == "python"


def test_the_report_header_says_which_decoder_ran(monkeypatch):
    from traceroof import analyze
    from traceroof.report import render

    monkeypatch.setenv("TRACEROOF_DECODER", "python")
    terminal = render(analyze(SRC.parents[4], chip=HOST_CHIP), "terminal")
    assert "(decoder: pure Python, slower" in " ".join(terminal.split())  # the header wraps after long paths
    monkeypatch.setenv("TRACEROOF_DECODER", "c")
    assert "(decoder: C)" in render(analyze(SRC.parents[4], chip=HOST_CHIP), "markdown")


def test_more_events_than_counted_is_a_format_error(monkeypatch):
    """Events are counted when the file is opened and decoded later: a line holding more events by then (the file
    was rewritten in place meanwhile) is a FormatError, not an array overflow."""
    plane = read_xspace(SRC, "c").plane("/host:CPU")
    plane.lines = [dataclasses.replace(line, event_count=line.event_count // 2) for line in plane.lines]
    with pytest.raises(xspace.FormatError, match="more events than it had when counted"):
        plane.columns(stats=("hlo_op",))
