"""Pure-Python twin of the C scanner ``parsers/_wirescan.c``, used when the C extension is not built (no
compiler at install time) or when ``TRACEROOF_DECODER=python`` asks for it.

Same functions, arguments, results, input contract and error messages as the C module (see the comments there):
``scan_fields``, ``split_fields``, ``decode_events``, ``TIME_LIMIT_PS``, ``DURATION_LIMIT_PS``. Field number 0
or above 2^29 - 1 and wire types 3, 4, 6, 7 are a ``ValueError`` naming the key's byte; lengths past the range
are "corrupt or truncated at byte N"; event times use checked arithmetic and events with impossible times are
marked (start_ps = INT64_MIN + 1/2/3) and counted.

Speed: ``decode_events`` parses a line with protobuf (upb, a private schema whose strings are ``bytes`` so that
nothing checks UTF-8) and accepts that parse only when re-serializing the events gives back the input's bytes
exactly: then the input is protobuf's own canonical encoding, without unknown fields or groups, on which the C
walk and protobuf read the same values. Anything else (corrupt, truncated, hand-made or non-canonical bytes, a
stat string of 16 MiB or more, more events than rows) goes through :func:`_decode_exact`, a byte-by-byte walk that
mirrors the C code line for line, errors and their byte offsets included. About 0.4 M events/s of CPU on the fast
path (the C scanner: about 7 M/s, same benchmark).
"""

from __future__ import annotations

import gc
import struct
from functools import lru_cache
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

TIME_LIMIT_PS = 1 << 62  # 53 days: profile times are relative to the capture's start
DURATION_LIMIT_PS = 1 << 60  # 13.3 days
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_M64 = (1 << 64) - 1
_MAX_FIELD = (1 << 29) - 1  # protobuf's largest field number
AGGREGATE_START = _INT64_MIN
BAD_START, BAD_NEGATIVE_DURATION, BAD_LONG_DURATION = _INT64_MIN + 1, _INT64_MIN + 2, _INT64_MIN + 3
_STR_LEN_BITS = 24
_K_ABSENT, _K_INT, _K_UINT, _K_DOUBLE, _K_REF, _K_STR, _K_BYTES, _K_ZSTR = range(8)
_E_CORRUPT, _E_LONG_STR, _E_KEY = 1, 3, 4
_MAX_SSIZE = (1 << 63) - 1


def impossible_times(start_ps: Any) -> Any:
    """Whether a start code (an int, or an int64 array: elementwise) marks an event with impossible times: one of
    ``BAD_START``, ``BAD_NEGATIVE_DURATION``, ``BAD_LONG_DURATION``, which the scanners write instead of the
    start (the C scanner tests the same range, ``_wirescan.c``)."""
    return (start_ps > AGGREGATE_START) & (start_ps <= BAD_LONG_DURATION)


class _WireError(Exception):
    """A wire-format error (code as in the C module) at a byte of the buffer."""

    def __init__(self, code: int, at: int) -> None:
        super().__init__(code, at)
        self.code, self.at = code, at

    def value_error(self) -> ValueError:
        """The C module's ValueError for this error."""
        if self.code == _E_KEY:
            return ValueError(f"field key with field number 0 or an impossible wire type at byte {self.at}")
        if self.code == _E_LONG_STR:
            return ValueError(f"an event stat string longer than 16 MiB at byte {self.at}")
        return ValueError(f"wire format is corrupt or truncated at byte {self.at}")


# -- the byte walk (mirrors _wirescan.c) -----------------------------------------------------------------------

def _varint(b: Any, p: int, end: int) -> tuple[int, int, int]:
    """(value as uint64, position after it, error code or 0). Like ``rd_varint``: more than 10 bytes is corrupt
    (10 bytes consumed); bits above 64 are dropped."""
    v = shift = 0
    while p < end:
        x = b[p]
        p += 1
        v |= (x & 0x7F) << shift
        if x < 0x80:
            return v & _M64, p, 0
        shift += 7
        if shift > 63:
            return 0, p, _E_CORRUPT
    return 0, p, _E_CORRUPT


def _key(b: Any, p: int, end: int) -> tuple[int, int, int, int]:
    """(field, wire type, position after the key, error code or 0), like ``rd_key``."""
    key, p, err = _varint(b, p, end)
    if err:
        return 0, 0, p, err
    field, wt = key >> 3, key & 7
    if field == 0 or field > _MAX_FIELD or wt in (3, 4, 6, 7):
        return field, wt, p, _E_KEY
    return field, wt, p, 0


def _skip(b: Any, p: int, end: int, wt: int) -> tuple[int, int, int]:
    """Skip one value: (value start, value end, 0) or (.., .., error), like ``skip_value``."""
    if wt == 0:
        _, q, err = _varint(b, p, end)
        return p, q, err
    if wt == 1 or wt == 5:
        size = 8 if wt == 1 else 4
        return (p, p + size, 0) if end - p >= size else (p, p, _E_CORRUPT)
    if wt == 2:
        n, q, err = _varint(b, p, end)
        if err or n > end - q:
            return q, q, _E_CORRUPT
        return q, q + n, 0
    return p, p, _E_CORRUPT


def _s64(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


def _event(b: Any, es: int, ee: int, want: dict[int, int]) -> tuple[int, int, int, bool, list]:
    """One XEvent payload b[es:ee]: (metadata_id, offset_ps, duration_ps, aggregate, [(column, value, kind)]) in
    the order the C code applies them. :raises _WireError: as the C code would fail (code, byte)."""
    e_mid = e_off = e_dur = 0
    aggregate = False
    sets: list[tuple[int, int, int]] = []
    p = es
    while p < ee:
        at = p
        f, wt, p, err = _key(b, p, ee)
        if err:
            raise _WireError(err, at)
        if wt == 0 and f in (1, 2, 3, 5):
            v, p, err = _varint(b, p, ee)
            if err:  # the C loop goes on and fails on the next key (same E_CORRUPT), else here
                raise _WireError(_E_CORRUPT, p if p < ee else at)
            if f == 1:
                e_mid = _s64(v)
            elif f == 2:
                e_off, aggregate = _s64(v), False
            elif f == 3:
                e_dur = _s64(v)
            else:
                aggregate = True
            continue
        if f != 4 or wt != 2:
            _, p, err = _skip(b, p, ee, wt)
            if err:
                raise _WireError(_E_CORRUPT, at)
            continue
        ss, se, err = _skip(b, p, ee, 2)
        if err:
            raise _WireError(_E_CORRUPT, at)
        p = se
        s_mid = s_val = 0
        s_kind = _K_ABSENT
        q = ss
        while q < se:
            at = q
            sf, swt, q, err = _key(b, q, se)
            if err:
                raise _WireError(err, at)
            if swt == 0:
                v, q, err = _varint(b, q, se)
                if err:
                    raise _WireError(_E_CORRUPT, q if q < se else at)
                if sf == 1:
                    s_mid = _s64(v)
                elif sf == 3:
                    s_val, s_kind = _s64(v), _K_UINT
                elif sf == 4:
                    s_val, s_kind = _s64(v), _K_INT
                elif sf == 7:
                    s_val, s_kind = _s64(v), _K_REF
            elif swt == 1:
                if se - q < 8:
                    raise _WireError(_E_CORRUPT, at)
                if sf == 2:
                    s_val, s_kind = int.from_bytes(b[q:q + 8], "little", signed=True), _K_DOUBLE
                q += 8
            elif swt == 2:
                vs, ve, err = _skip(b, q, se, 2)
                if err:
                    raise _WireError(_E_CORRUPT, at)
                q = ve
                if sf in (5, 6, 8):
                    if ve - vs >= 1 << _STR_LEN_BITS:
                        raise _WireError(_E_LONG_STR, at)
                    s_val = (vs << _STR_LEN_BITS) | (ve - vs)
                    s_kind = _K_STR if sf == 5 else (_K_BYTES if sf == 6 else _K_ZSTR)
            else:
                _, q, err = _skip(b, q, se, swt)
                if err:
                    raise _WireError(_E_CORRUPT, at)
        j = want.get(s_mid)
        if j is not None:
            sets.append((j, s_val, s_kind))
    return e_mid, e_off, e_dur, aggregate, sets


def _event_start(line_ps: int, line_bad: bool, off: int, dur: int, aggregate: bool) -> int:
    """start_ps of one event, or the code of why its times are impossible (as the C code)."""
    if dur < 0:
        return BAD_NEGATIVE_DURATION
    if dur > DURATION_LIMIT_PS:
        return BAD_LONG_DURATION
    if aggregate:
        return AGGREGATE_START
    t = line_ps + off
    if line_bad or not _INT64_MIN <= t <= _INT64_MAX or t > TIME_LIMIT_PS or t < -TIME_LIMIT_PS:
        return BAD_START
    return t


class _Out:
    """The caller's output arrays (numpy views of the writable buffers), sizes checked as in the C code."""

    def __init__(self, ids: Any, mid: Any, st: Any, du: Any, val: Any, kin: Any, blen: int, start: int, end: int,
                 first: int, keep_ids: Any = None, keep_cols: Any = None) -> None:
        def i64(x: Any) -> np.ndarray:
            raw = np.frombuffer(x, np.uint8)
            return raw[: len(raw) // 8 * 8].view(np.int64)

        self.want_ids = i64(ids)
        self.mid, self.st, self.du, self.val = i64(mid), i64(st), i64(du), i64(val)
        self.kin = np.frombuffer(kin, np.int8)
        self.n, self.ncol = len(self.mid), len(self.want_ids)
        n, ncol = self.n, self.ncol
        if (start < 0 or end > blen or start > end or len(self.st) != n or len(self.du) != n
                or len(self.val) != n * ncol or len(self.kin) != n * ncol or first < 0 or blen >= 1 << 39):
            raise ValueError("decode_events: bad range or output sizes")
        self.want: dict[int, int] = {}
        for j, i in enumerate(self.want_ids.tolist()):
            self.want.setdefault(i, j)
        # the events kept (C: keep_ids, keep_columns): None keeps every one
        self.keep_ids = None if keep_ids is None else i64(keep_ids)
        self.keep_cols = np.zeros(0, np.int64) if keep_ids is None or keep_cols is None else i64(keep_cols)
        if ((self.keep_cols < 0) | (self.keep_cols >= self.ncol)).any():
            raise ValueError("decode_events: a keep column outside the columns")
        if self.keep_ids is not None and (self.keep_ids[1:] < self.keep_ids[:-1]).any():
            raise ValueError("decode_events: keep_ids are not sorted")
        self.keep_set = set() if self.keep_ids is None else set(self.keep_ids.tolist())
        self.keep_col_list: list[int] = self.keep_cols.tolist()  # read per event on the exact path

    def kept(self, row: int, e_mid: int, t: int) -> bool:
        """Whether the event just written at ``row`` (metadata id ``e_mid``, start code ``t``) is kept."""
        if self.keep_ids is None or impossible_times(t) or e_mid in self.keep_set:
            return True
        return any(self.kin[c * self.n + row] != _K_ABSENT for c in self.keep_col_list)

    def compact(self, first: int, nev: int, t: np.ndarray) -> int:
        """Keep the kept ones of the ``nev`` events written from row ``first`` (start codes ``t``), moved up to
        rows ``first``..; how many."""
        if self.keep_ids is None:
            return nev
        n, rows = self.n, slice(first, first + nev)
        keep = impossible_times(t) | np.isin(self.mid[rows], self.keep_ids)
        for c in self.keep_col_list:
            keep |= self.kin[c * n + first: c * n + first + nev] != _K_ABSENT
        at = np.flatnonzero(keep)
        k = len(at)
        for a in (self.mid, self.st, self.du):
            a[first: first + k] = a[rows][at]
        for j in range(self.ncol):
            for a in (self.val, self.kin):
                a[j * n + first: j * n + first + k] = a[j * n + first: j * n + first + nev][at]
        return k

    def put(self, row: int, e_mid: int, t: int, dur: int, sets: list) -> None:
        """Write one event's row (the exact path)."""
        n = self.n
        for j in range(self.ncol):
            self.kin[j * n + row] = _K_ABSENT
        for j, v, k in sets:
            self.val[j * n + row] = v
            self.kin[j * n + row] = k
        self.mid[row], self.st[row], self.du[row] = e_mid, t, dur


def _line_ps(line_ns: int) -> tuple[int, bool]:
    if not _INT64_MIN <= line_ns <= _INT64_MAX:
        raise OverflowError("Python int too large to convert to C long")
    line_ps = line_ns * 1000
    return line_ps, not _INT64_MIN <= line_ps <= _INT64_MAX


def _decode_exact(b: Any, start: int, end: int, line_ns: int, first: int, out: _Out) -> tuple[int, int, int]:
    """``decode_events`` byte by byte, as the C code. :raises _WireError:"""
    line_ps, line_bad = _line_ps(line_ns)
    p, row, bad = start, first, 0
    stop = end
    while p < end:
        at = p
        f, wt, p, err = _key(b, p, end)
        if err:
            raise _WireError(err, at)
        es, ee, err = _skip(b, p, end, wt)
        if err:
            raise _WireError(_E_CORRUPT, at)
        p = ee
        if f != 4 or wt != 2:
            continue
        if row >= out.n:  # no row left: the caller goes on from this event
            stop = at
            break
        e_mid, e_off, e_dur, aggregate, sets = _event(b, es, ee, out.want)
        t = _event_start(line_ps, line_bad, e_off, e_dur, aggregate)
        bad += impossible_times(t)
        out.put(row, e_mid, t, e_dur, sets)
        row += out.kept(row, e_mid, t)
    return row - first, bad, stop


# -- the protobuf fast path ------------------------------------------------------------------------------------

def _lean_schema() -> Any:
    """An XLine that declares only its events (other line fields are unknown and discarded), XEvent and XStat as
    in xplane.proto, with every string as ``bytes``."""
    F = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="traceroof_wirescan_py.proto", package="traceroof_wirescan_py",
                                            syntax="proto3")
    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    I64, U64, BYT, DBL, MSG = F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_BYTES, F.TYPE_DOUBLE, F.TYPE_MESSAGE
    specs = {
        "Line": ([("events", 4, MSG, rep, "Event")], []),
        "Event": ([("metadata_id", 1, I64, opt), ("offset_ps", 2, I64, opt, None, 0),
                   ("duration_ps", 3, I64, opt), ("stats", 4, MSG, rep, "Stat"),
                   ("num_occurrences", 5, I64, opt, None, 0)], ["data"]),
        "Stat": ([("metadata_id", 1, I64, opt), ("double_value", 2, DBL, opt, None, 0),
                  ("uint64_value", 3, U64, opt, None, 0), ("int64_value", 4, I64, opt, None, 0),
                  ("str_value", 5, BYT, opt, None, 0), ("bytes_value", 6, BYT, opt, None, 0),
                  ("ref_value", 7, U64, opt, None, 0), ("compressed_str_value", 8, BYT, opt, None, 0)], ["value"]),
    }
    for name, (fields, oneofs) in specs.items():
        m = fd.message_type.add(name=name)
        for o in oneofs:
            m.oneof_decl.add(name=o)
        for fname, num, ftype, label, *rest in fields:
            f = m.field.add(name=fname, number=num, type=ftype, label=label)
            if ftype == MSG:
                f.type_name = ".traceroof_wirescan_py." + rest[0]
            if len(rest) > 1:
                f.oneof_index = rest[1]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("traceroof_wirescan_py.Line"))


_LINE = _lean_schema()
_NUMERIC = {"int64_value": _K_INT, "uint64_value": _K_UINT, "ref_value": _K_REF, "double_value": _K_DOUBLE}
_STRINGS = ("str_value", "bytes_value", "compressed_str_value")


@lru_cache(maxsize=None)
def _split_schema(number: int) -> Any:
    """A message whose only field is ``repeated bytes f = number``: protobuf keeps every other field as unknown
    bytes, verbatim and in order (what :func:`split_fields` returns)."""
    F = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name=f"traceroof_split_{number}.proto", package="traceroof_split",
                                            syntax="proto3")
    m = fd.message_type.add(name=f"Split{number}")
    m.field.add(name="f", number=number, type=F.TYPE_BYTES, label=F.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"traceroof_split.Split{number}"))


def _split_fast(b: memoryview, start: int, end: int, field: int) -> tuple[bytes, int] | None:
    """``split_fields`` through protobuf: the fields numbered ``field`` (length-delimited) counted, the others kept
    verbatim; ``None`` when the kept bytes hold what the C walk refuses (a bad key, ``field`` with another wire
    type) or protobuf refuses the bytes, so that the exact walk decides."""
    msg = _split_schema(field)()
    try:
        with b[start:end] as payload:
            msg.ParseFromString(payload)
    except Exception as e:  # protobuf's DecodeError (or a nesting limit)
        if type(e).__name__ != "DecodeError":
            raise
        return None
    count = len(msg.f)
    msg.ClearField("f")
    kept = msg.SerializeToString()
    p = 0
    while p < len(kept):
        f, wt, p, err = _key(kept, p, len(kept))
        if not err:
            _, p, err = _skip(kept, p, len(kept), wt)
        if err or f == field:
            return None
    return kept, count


def _vlen(x: np.ndarray) -> np.ndarray:
    """Bytes of the varint of each (non-negative) value."""
    return 1 + sum((x >= (1 << (7 * k))).astype(np.int64) for k in range(1, 10))


def _has_long_string(events: Any) -> bool:
    """Whether a stat string of 16 MiB or more is among these events (the C code fails on it)."""
    for e in events:
        if e.ByteSize() >= 1 << _STR_LEN_BITS:
            for s in e.stats:
                k = s.WhichOneof("value")
                if k in _STRINGS and len(getattr(s, k)) >= 1 << _STR_LEN_BITS:
                    return True
    return False


def _fields_ok(b: Any, p: int, end: int, stop_at_event: bool) -> int | None:
    """Walk well-formed fields from p: the position of the first event field (``stop_at_event``), else ``end``;
    ``None`` for a malformed field, or an event field when not ``stop_at_event``."""
    while p < end:
        at = p
        f, wt, p, err = _key(b, p, end)
        if not err:
            _, p, err = _skip(b, p, end, wt)
        if err:
            return None
        if f == 4 and wt == 2:
            if stop_at_event:
                return at
            return None
    return end


def _decode_fast(b: memoryview, start: int, end: int, line_ns: int, first: int, out: _Out
                 ) -> tuple[int, int, int] | None:
    """``decode_events`` through protobuf when the line's event fields are protobuf's canonical encoding, one run
    between well-formed other fields, and every event has a row; ``None`` when not (then :func:`_decode_exact`
    decides)."""
    a = _fields_ok(b, start, end, True)
    if a is None:
        return None
    line = _LINE()
    try:
        with b[start:end] as payload:
            line.ParseFromString(payload)
    except Exception as e:  # protobuf's DecodeError (or a nesting limit): not for the fast path
        if type(e).__name__ != "DecodeError":
            raise
        return None
    line.DiscardUnknownFields()
    events_bytes = line.SerializeToString()
    run_end = a + len(events_bytes)
    if run_end > end:
        return None
    with b[a:run_end] as run:
        if run != events_bytes:
            return None
    del events_bytes
    if _fields_ok(b, run_end, end, False) is None:
        return None
    evs = list(line.events)  # one wrapper per event, then every attribute pass is cheap
    nev, n = len(evs), out.n
    if first + nev > n or (end - start >= 1 << _STR_LEN_BITS and _has_long_string(evs)):
        return None
    line_ps, line_bad = _line_ps(line_ns)
    mid = np.array([e.metadata_id for e in evs], np.int64)
    off = np.array([e.offset_ps for e in evs], np.int64)
    dur = np.array([e.duration_ps for e in evs], np.int64)
    agg = np.array([e.WhichOneof("data") == "num_occurrences" for e in evs], bool)
    with np.errstate(over="ignore"):
        if line_bad:
            t = np.full(nev, BAD_START, np.int64)
        else:
            t = off + np.int64(line_ps)  # wraps on overflow, detected next
            wrapped = ((t ^ off) & (t ^ np.int64(line_ps))) < 0
            t[wrapped | (t > TIME_LIMIT_PS) | (t < -TIME_LIMIT_PS)] = BAD_START
    t[agg] = AGGREGATE_START
    t[dur > DURATION_LIMIT_PS] = BAD_LONG_DURATION
    t[dur < 0] = BAD_NEGATIVE_DURATION
    rows = slice(first, first + nev)
    out.mid[rows], out.st[rows], out.du[rows] = mid, t, dur
    if out.ncol:
        _write_stats(b, a, evs, first, out)
    bad = int(np.count_nonzero(impossible_times(t)))
    return out.compact(first, nev, t), bad, end


def _write_stats(b: memoryview, a: int, evs: list, first: int, out: _Out) -> None:
    """Write the wanted stats of a line's events (protobuf messages; their event fields start at byte ``a``) into
    rows ``first``.. of the value and kind columns. Stats are flattened and matched to the wanted ids with numpy;
    an event's last stat of an id wins (as in the C code); events with a wanted string stat are decoded again by
    :func:`_event`, which gives the strings' byte offsets."""
    n, nev = out.n, len(evs)
    for j in range(out.ncol):
        out.kin[j * n + first: j * n + first + nev] = _K_ABSENT
    per_event = [e.stats for e in evs]
    flat = [s for stats in per_event for s in stats]
    if not flat:
        return
    ids = np.array(sorted(out.want), np.int64)
    cols = np.array([out.want[i] for i in ids.tolist()], np.int64)
    smid = np.array([s.metadata_id for s in flat], np.int64)
    at = np.minimum(np.searchsorted(ids, smid), len(ids) - 1)
    hits = np.flatnonzero(ids[at] == smid)
    if not len(hits):
        return
    event_of = np.repeat(np.arange(nev, dtype=np.int64), list(map(len, per_event)))[hits]
    cell = cols[at[hits]] * n + first + event_of
    values, kinds = np.zeros(len(hits), np.int64), np.zeros(len(hits), np.int8)
    redo: set[int] = set()  # events with a wanted string stat
    for h, k in enumerate(hits.tolist()):
        s = flat[k]
        w = s.WhichOneof("value")
        if w is None:
            continue
        if w in _STRINGS:
            redo.add(int(event_of[h]))
            continue
        v = getattr(s, w)
        if w == "double_value":
            v = struct.unpack("<q", struct.pack("<d", v))[0]
        elif v > _INT64_MAX:  # uint64 and ref values, bit-cast
            v -= 1 << 64
        values[h], kinds[h] = v, _NUMERIC[w]
    if redo:
        keep = ~np.isin(event_of, np.fromiter(redo, np.int64, len(redo)))
        cell, values, kinds = cell[keep], values[keep], kinds[keep]
        size = np.array([e.ByteSize() for e in evs], np.int64)
        payload_start = a + np.concatenate(([0], np.cumsum(1 + _vlen(size) + size)[:-1])) + 1 + _vlen(size)
        extra = [(j * n + first + i, v, k) for i in sorted(redo)
                 for j, v, k in _event(b, int(payload_start[i]), int(payload_start[i] + size[i]), out.want)[4]]
        if extra:
            cell = np.concatenate([cell, np.array([x[0] for x in extra], np.int64)])
            values = np.concatenate([values, np.array([x[1] for x in extra], np.int64)])
            kinds = np.concatenate([kinds, np.array([x[2] for x in extra], np.int8)])
    # the last write of each cell wins: stats are in file order, and an event's cells are not shared with others
    last = len(cell) - 1 - np.unique(cell[::-1], return_index=True)[1]
    out.val[cell[last]] = values[last]
    out.kin[cell[last]] = kinds[last]


# -- the module's functions ------------------------------------------------------------------------------------

def _bytes_view(buf: Any) -> memoryview:
    """A flat byte view of a buffer (``bytes``, ``bytearray``, ``mmap``, numpy array...), like the C ``y*``."""
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        flat = mv.cast("B")
        mv.release()
        return flat
    return mv


def _range_ok(mv: memoryview, start: int, end: int) -> None:
    if start < 0 or end > len(mv) or start > end:
        raise ValueError("range outside the buffer")


def scan_fields(buf: Any, start: int, end: int, field: int = -1, limit: int = _MAX_SSIZE) -> list[tuple]:
    """(field, wire_type, tag_start, value_start, value_end, varint) for every top-level field of buf[start:end],
    or only those numbered ``field`` (the others are checked and skipped); more than ``limit`` of them is a
    ValueError. :raises ValueError: a malformed field (at its key's byte) or a range outside the buffer."""
    with _bytes_view(buf) as b:
        _range_ok(b, start, end)
        found: list[tuple] = []
        p = start
        while p < end:
            tag = p
            f, wt, p, err = _key(b, p, end)
            if err:
                raise _WireError(err, tag).value_error()
            iv = 0
            if wt == 0:
                vs = p
                iv, p, err = _varint(b, p, end)
                ve = p
            else:
                vs, ve, err = _skip(b, p, end, wt)
                p = ve
            if err:
                raise _WireError(_E_CORRUPT, tag).value_error()
            if field >= 0 and f != field:
                continue
            if len(found) >= limit:
                raise ValueError(f"more than {limit} fields numbered {field}")
            found.append((f, wt, tag, vs, ve, _s64(iv)))
        return found


def split_fields(buf: Any, start: int, end: int, field: int) -> tuple[bytes, int]:
    """(bytes of every top-level field of buf[start:end] except those numbered ``field``, how many of those).
    :raises ValueError: as :func:`scan_fields`."""
    with _bytes_view(buf) as b:
        _range_ok(b, start, end)
        kept: list[tuple[int, int]] = []  # runs of kept fields
        count = 0
        p = start
        budget = 64 if 0 < field <= _MAX_FIELD else -1  # then protobuf splits the rest (many fields)
        while p < end:
            budget -= 1
            if budget == 0:
                rest = _split_fast(b, p, end, field)
                if rest is not None:
                    return b"".join([*(bytes(b[s:e]) for s, e in kept), rest[0]]), count + rest[1]
            tag = p
            f, wt, p, err = _key(b, p, end)
            if err:
                raise _WireError(err, tag).value_error()
            _, p, err = _skip(b, p, end, wt)
            if err:
                raise _WireError(_E_CORRUPT, tag).value_error()
            if f == field:
                count += 1
            elif kept and kept[-1][1] == tag:
                kept[-1] = (kept[-1][0], p)
            else:
                kept.append((tag, p))
        return b"".join(bytes(b[s:e]) for s, e in kept), count


def decode_events(buf: Any, start: int, end: int, line_timestamp_ns: int, stat_ids: Any, first: int, metadata_id: Any,
                  start_ps: Any, duration_ps: Any, values: Any, kinds: Any, keep_ids: Any = None,
                  keep_columns: Any = None) -> tuple[int, int, int]:
    """Decode the XEvents of the line whose payload is buf[start:end] into rows ``first``.. of the output arrays,
    until they are full; returns (events written, events with impossible times, the byte decoding stopped at:
    ``end``, or the first event that found no row). Arguments, layout and codes as ``_wirescan.c``'s
    ``decode_events``; with ``keep_ids`` only the events it keeps are written. :raises ValueError: malformed input
    (the byte named) or output arrays of the wrong size."""
    with _bytes_view(buf) as b:
        out = _Out(stat_ids, metadata_id, start_ps, duration_ps, values, kinds, len(b), start, end, first, keep_ids,
                   keep_columns)
        collecting = gc.isenabled()
        gc.disable()  # the fast path makes ~5 protobuf wrappers per event: collecting them as they come is slow
        try:
            done = _decode_fast(b, start, end, line_timestamp_ns, first, out)
        except _WireError:  # not reached on canonical bytes; the exact walk states the error
            done = None
        finally:
            if collecting:
                gc.enable()
        try:
            return done or _decode_exact(b, start, end, line_timestamp_ns, first, out)
        except _WireError as e:
            raise e.value_error() from None
