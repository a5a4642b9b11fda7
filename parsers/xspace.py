"""XSpace (``.xplane.pb``) decoder.

The schema is ``tensorflow.profiler`` ``xplane.proto`` (openxla/xla ``third_party/tsl/tsl/profiler/protobuf/
xplane.proto``; ``docs/reference/xplane-format.md`` §2), built at runtime from a ``FileDescriptorProto`` so no
``protoc`` is needed. Protobuf decodes every plane header, metadata map and stat; the events of each line, which
are millions in real profiles, are walked by the C scanner in ``parsers/_wirescan.c`` straight into numpy arrays
(no Python object per event). Times follow ``XEventVisitor::TimestampPs``:
``start_ps = line.timestamp_ns * 1000 + event.offset_ps``.

Decoders: the C scanner when it was built (a C compiler at install time), else its pure-Python twin
``parsers/_wirescan_py.py`` (same results and errors, much slower); ``TRACEROOF_DECODER=python`` (or ``c``)
chooses one, and :attr:`XSpace.decoder` says which ran.

Input contract: a byte layout protobuf cannot have written (field number 0, group or undefined wire types,
lengths past the buffer) is a :class:`FormatError` naming the byte; more than :data:`MAX_PLANES` planes or
:data:`MAX_LINES` lines is a :class:`FormatError` too, so memory follows what is decoded. Events with impossible
times (a negative duration, one above 2^60 ps = 13 days, a start that overflows or lies beyond +-2^62 ps) are
dropped, counted, and stated in :attr:`XSpace.notes`; the rest of the profile is used.
"""

from __future__ import annotations

import mmap
import os
import re
from types import ModuleType
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from parsers import _wirescan_py, storage
from parsers._wirescan_py import impossible_times
from parsers.errors import FormatError, InputError, SizeLimitError
from parsers.inflate import inflate
from parsers.storage import Location

_F = descriptor_pb2.FieldDescriptorProto
_KIND_INT, _KIND_UINT, _KIND_DOUBLE, _KIND_REF, _KIND_STR, _KIND_BYTES, _KIND_ZSTR = 1, 2, 3, 4, 5, 6, 7
_STR_LEN_BITS = 24
AGGREGATE_START_PS = np.iinfo(np.int64).min  # start_ps of events that carry num_occurrences instead of a time
TIME_LIMIT_PS = _wirescan_py.TIME_LIMIT_PS  # 2^62 ps: |start_ps| beyond this is impossible (profile times are relative)
DURATION_LIMIT_PS = _wirescan_py.DURATION_LIMIT_PS  # 2^60 ps (13.3 days)
# start_ps codes the scanner writes for events with impossible times, and why (the events are dropped)
_BAD_TIMES = {_wirescan_py.BAD_START: "a start time that overflows or lies beyond 2^62 ps (53 days)",
              _wirescan_py.BAD_NEGATIVE_DURATION: "a negative duration",
              _wirescan_py.BAD_LONG_DURATION: "a duration above 2^60 ps (13 days)"}
MAX_PLANES = 1 << 16
MAX_LINES = 1 << 20
_BATCH_ROWS = 1 << 16  # rows decoded into scratch arrays before the kept ones are copied out
_CHUNK_ROWS = 1 << 20  # events a stat is resolved over at a time
_RELEASE_BYTES = 8 << 20  # pages of the file read once let go this many bytes at a time (_Releaser)
try:
    from parsers import _wirescan as _wirescan_c  # built from parsers/_wirescan.c when a C compiler was there
except ImportError:
    _wirescan_c = None
DECODERS = ("c", "python")


def scanner(decoder: str | None = None) -> tuple[str, ModuleType]:
    """The wire scanner to use: (``"c"`` or ``"python"``, its module). ``decoder`` (else the environment
    variable ``TRACEROOF_DECODER``) names one; by default the C scanner, or the Python one when the C extension
    is not built.

    :raises InputError: an unknown name, or ``"c"`` where the C extension cannot be imported.
    """
    name = decoder or os.environ.get("TRACEROOF_DECODER", "") or ("c" if _wirescan_c is not None else "python")
    if name not in DECODERS:
        raise InputError(f"TRACEROOF_DECODER={name!r} is not one of {', '.join(DECODERS)}; unset it to choose "
                         "automatically")
    if name == "python":
        return name, _wirescan_py
    if _wirescan_c is None:
        raise InputError("the C decoder (parsers/_wirescan.c) is not built in this installation; use "
                         "TRACEROOF_DECODER=python, or reinstall traceroof where a C compiler is available")
    return name, _wirescan_c


def _schema() -> dict[str, Any]:
    """Build the XSpace message classes (field numbers from xplane.proto; newest schema: hostnames, child_id,
    compressed_str_value)."""
    fd = descriptor_pb2.FileDescriptorProto(name="traceroof_xplane.proto", package="tensorflow.profiler",
                                            syntax="proto3")

    def msg(name: str, fields: list[tuple], nested: list | None = None, oneofs: Sequence[str] = ()):
        m = fd.message_type.add(name=name)
        for o in oneofs:
            m.oneof_decl.add(name=o)
        for spec in fields:
            fname, num, ftype, label = spec[:4]
            f = m.field.add(name=fname, number=num, type=ftype, label=label)
            if ftype == _F.TYPE_MESSAGE:
                f.type_name = spec[4]
            if len(spec) > 5:
                f.oneof_index = spec[5]
        for n in nested or []:
            m.nested_type.append(n)
        return m

    opt, rep = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
    I64, U64, STR, BYT, DBL, MSG = (_F.TYPE_INT64, _F.TYPE_UINT64, _F.TYPE_STRING, _F.TYPE_BYTES, _F.TYPE_DOUBLE,
                                    _F.TYPE_MESSAGE)
    p = ".tensorflow.profiler."
    msg("XSpace", [("planes", 1, MSG, rep, p + "XPlane"), ("errors", 2, STR, rep), ("warnings", 3, STR, rep),
                   ("hostnames", 4, STR, rep)])

    def entry(name: str, value_type: str) -> descriptor_pb2.DescriptorProto:
        e = descriptor_pb2.DescriptorProto(name=name)
        e.field.add(name="key", number=1, type=I64, label=opt)
        e.field.add(name="value", number=2, type=MSG, label=opt, type_name=p + value_type)
        e.options.map_entry = True
        return e

    msg("XPlane", [("id", 1, I64, opt), ("name", 2, STR, opt), ("lines", 3, MSG, rep, p + "XLine"),
                   ("event_metadata", 4, MSG, rep, p + "XPlane.EventMetadataEntry"),
                   ("stat_metadata", 5, MSG, rep, p + "XPlane.StatMetadataEntry"),
                   ("stats", 6, MSG, rep, p + "XStat")],
        nested=[entry("EventMetadataEntry", "XEventMetadata"), entry("StatMetadataEntry", "XStatMetadata")])
    msg("XLine", [("id", 1, I64, opt), ("display_id", 10, I64, opt), ("name", 2, STR, opt),
                  ("display_name", 11, STR, opt), ("timestamp_ns", 3, I64, opt), ("duration_ps", 9, I64, opt),
                  ("events", 4, MSG, rep, p + "XEvent")])
    msg("XEvent", [("metadata_id", 1, I64, opt), ("offset_ps", 2, I64, opt, None, 0),
                   ("num_occurrences", 5, I64, opt, None, 0), ("duration_ps", 3, I64, opt),
                   ("stats", 4, MSG, rep, p + "XStat")], oneofs=["data"])
    msg("XStat", [("metadata_id", 1, I64, opt), ("double_value", 2, DBL, opt, None, 0),
                  ("uint64_value", 3, U64, opt, None, 0), ("int64_value", 4, I64, opt, None, 0),
                  ("str_value", 5, STR, opt, None, 0), ("bytes_value", 6, BYT, opt, None, 0),
                  ("ref_value", 7, U64, opt, None, 0), ("compressed_str_value", 8, BYT, opt, None, 0)],
        oneofs=["value"])
    msg("XEventMetadata", [("id", 1, I64, opt), ("name", 2, STR, opt), ("display_name", 4, STR, opt),
                           ("metadata", 3, BYT, opt), ("stats", 5, MSG, rep, p + "XStat"),
                           ("child_id", 6, I64, rep)])
    msg("XStatMetadata", [("id", 1, I64, opt), ("name", 2, STR, opt), ("description", 3, STR, opt)])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.profiler." + n))
            for n in ("XSpace", "XPlane", "XLine", "XEvent", "XStat", "XEventMetadata", "XStatMetadata")}


SCHEMA = _schema()


def stat_value(stat: Any, stat_names: dict[int, str], source: str = "a compressed stat") -> Any:
    """Value of a protobuf ``XStat``: the set oneof field; ``ref_value`` resolved to the interned string;
    ``compressed_str_value`` gunzipped (``source`` names it in errors)."""
    kind = stat.WhichOneof("value")
    if kind is None:
        return None
    if kind == "ref_value":
        return stat_names.get(stat.ref_value, "")
    if kind == "compressed_str_value":
        return _gunzip_text(stat.compressed_str_value, source)
    return getattr(stat, kind)


def _gunzip_text(data: bytes, source: str = "a compressed stat") -> str:
    """A ``compressed_str_value``: gzip text, "" when corrupt.

    :raises SizeLimitError: it inflates past :func:`parsers.inflate.inflate_limit`."""
    try:
        return inflate(data, source).decode("utf-8", "replace")
    except SizeLimitError:
        raise
    except FormatError:
        return ""


@dataclass(frozen=True)
class EventMetadata:
    """An ``XEventMetadata``: name, display name and its constant stats (names resolved)."""

    id: int
    name: str
    display_name: str
    stats: dict[str, Any]
    raw_metadata: bytes = b""


@dataclass(frozen=True)
class Line:
    """An ``XLine`` header; its events stay in the file until :meth:`Plane.events` decodes them."""

    id: int
    display_id: int
    name: str
    display_name: str
    timestamp_ns: int
    duration_ps: int
    event_count: int
    _ranges: tuple[tuple[int, int], ...] = ()


@dataclass(eq=False)
class Plane:
    """An ``XPlane``. ``stats`` are the plane stats by name; ``event_metadata`` by id; ``stat_names`` maps
    XStatMetadata ids to names. :meth:`events` decodes the lines' events into a DataFrame."""

    id: int
    name: str
    stats: dict[str, Any]
    event_metadata: dict[int, EventMetadata]
    stat_names: dict[int, str]
    lines: list[Line]
    _buf: Any = field(repr=False, default=None)
    source: str = ""
    _dropped: dict[int, dict[int, int]] = field(repr=False, default_factory=dict)  # line index -> {code: count}
    _scan: ModuleType = field(repr=False, default=_wirescan_py)  # the wire scanner (see scanner())
    _dtypes: dict[tuple[str, ...], tuple[pd.CategoricalDtype, np.ndarray | None]] = field(
        repr=False, default_factory=dict)  # categories -> (dtype, code remap) of :meth:`_categorical`
    _meta_stats: dict[str, tuple[list[Any], bool, bool]] = field(repr=False, default_factory=dict)  # _meta_stat

    @property
    def notes(self) -> list[str]:
        """What :meth:`events` dropped from this plane so far: events with impossible times, how many and why."""
        total: dict[int, int] = {}
        for counts in self._dropped.values():
            for code, n in counts.items():
                total[code] = total.get(code, 0) + n
        if not total:
            return []
        why = ", ".join(f"{n:,} with {_BAD_TIMES[c]}" for c, n in sorted(total.items()))
        return [f"{Path(self.source).name} plane {self.name!r}: {sum(total.values()):,} events dropped for "
                f"impossible times ({why}); the file is partly corrupt - figures exclude them"]

    def events(self, stats: Sequence[str] = (), lines: Iterable[Line] | None = None,
               merge_metadata_stats: bool = True, require: Sequence[str] = (),
               names: str | None = None) -> pd.DataFrame:
        """Events of this plane (or of the given lines), one row each: :meth:`columns` as a DataFrame."""
        return pd.DataFrame(self.columns(stats, lines, merge_metadata_stats, require, names), copy=False)

    def columns(self, stats: Sequence[str] = (), lines: Iterable[Line] | None = None,
                merge_metadata_stats: bool = True, require: Sequence[str] = (),
                names: str | None = None) -> dict[str, Any]:
        """Events of this plane (or of the given lines), one row each, as equally long columns by name (numpy or
        pandas arrays; a DataFrame costs more than the decode on a small plane).

        Columns: ``line_id`` (int64), ``line_name`` (category), ``metadata_id`` (int64), ``name`` and
        ``display_name`` (category, from the event metadata), ``start_ps`` and ``duration_ps`` (int64,
        picoseconds; ``start_ps`` is :data:`AGGREGATE_START_PS` for aggregated events), then one column per
        requested stat name: refs and strings as category, integers as nullable ``Int64``, doubles as float.
        With ``merge_metadata_stats`` a stat absent on the event is taken from its ``XEventMetadata`` (the
        event wins when both have it; a project convention, xplane-format.md §3). With ``require`` (stat
        names, added to ``stats``) only events that carry one of them, on the event or its metadata, are kept;
        they are filtered batch by batch, so memory follows the kept events. ``names`` (a regular expression
        matched at the start of event metadata names) keeps those events too when filtering with ``require``.

        :raises FormatError: the event data is corrupt or truncated.
        """
        chosen = list(self.lines if lines is None else lines)
        require = (require,) if isinstance(require, str) else tuple(require)
        want = list(dict.fromkeys([*stats, *require]))
        col_of: list[tuple[str, int]] = [(s, i) for s in want for i, nm in self.stat_names.items() if nm == s]
        stat_ids = np.array([i for _, i in col_of], dtype=np.int64).tobytes()
        ncol = len(col_of)
        name_re = re.compile(names) if names else None
        meta_ids = np.array(sorted(self.event_metadata), dtype=np.int64)
        metas = [self.event_metadata[int(i)] for i in meta_ids]
        meta_code, meta_dtype = _code_lookup(meta_ids)
        # with ``require``, the scanner writes only the events kept: those of the metadata (ids) that have a required
        # stat or a name ``names`` matches, and those that carry a required stat (columns)
        keep = () if not require else (
            meta_ids[[any(r in m.stats for r in require) or (name_re is not None and name_re.match(m.name) is not None)
                      for m in metas]].tobytes(),
            np.array([j for j, (nm, _) in enumerate(col_of) if nm in require], np.int64).tobytes())
        line_names = sorted({line.name for line in chosen})
        code_of = {nm: i for i, nm in enumerate(line_names)}
        # Lines are decoded one after another into scratch arrays of a batch of rows (reused, so they stay in
        # cache); each batch's rows (the kept events) are copied once into the output arrays, sized for every event
        # but written (and so made resident) only as far as rows are kept. Each stat has its own value and kind
        # arrays, which become its column (or are freed once it is resolved), so no stat is copied whole. A line
        # longer than a batch (a thread of a long capture holds millions of events) is decoded a batch at a time;
        # the pure-Python scanner decodes a line whole (protobuf parses it at once), so its batch holds the longest.
        total = sum(line.event_count for line in chosen)
        size = max(min(total, _BATCH_ROWS), 1)
        if self._scan is _wirescan_py:
            size = max(size, max((line.event_count for line in chosen), default=0))
        out = [np.empty(total, np.int64) for _ in range(4)]  # metadata_id, start_ps, duration_ps, line_id
        lcode, codes = np.empty(total, code_dtype(len(line_names))), np.empty(total, meta_dtype)
        vals, kinds = [np.empty(total, np.int64) for _ in col_of], [np.empty(total, np.int8) for _ in col_of]
        s_mid, s_start, s_dur, s_line = (np.empty(size, np.int64) for _ in range(4))
        s_lcode = np.empty(size, lcode.dtype)
        s_vals, s_kinds = np.zeros(ncol * size, np.int64), np.zeros(ncol * size, np.int8)
        s_vals2, s_kinds2 = s_vals.reshape(ncol, size), s_kinds.reshape(ncol, size)
        sources, targets = [s_mid, s_start, s_dur, s_line, s_lcode], [*out, lcode]
        n = row = 0
        batch: list[tuple[Line, int, int, int]] = []  # (line, first row, end row, events with impossible times)
        dropped_now: dict[int, dict[int, int]] = {}  # line index -> {code: count}, summed over the line's batches

        def flush() -> int:
            """Copy the rows of the batch (``row`` rows) to the output from row ``n``, less the events with impossible
            times (counted in ``_dropped``); how many were copied."""
            rows = slice(0, row)
            if n + row > total:
                raise FormatError(f"{self.source}: plane {self.name!r} has more events than it had when counted: "
                                  "the file changed while it was read - analyze a finished copy")
            s_code = meta_code(s_mid[rows])
            if not any(bad for *_, bad in batch):
                for src, dst in zip([*sources, s_code], [*targets, codes]):
                    dst[n:n + row] = src[rows]
                for j in range(ncol):
                    vals[j][n:n + row], kinds[j][n:n + row] = s_vals2[j, rows], s_kinds2[j, rows]
                return row
            for line, a, b, bad in batch:
                if bad:
                    t = s_start[a:b]
                    found, counts = np.unique(t[impossible_times(t)], return_counts=True)
                    dropped = dropped_now.setdefault(self.lines.index(line), {})
                    for code, count in zip(found.tolist(), counts.tolist()):
                        dropped[code] = dropped.get(code, 0) + count
            t = s_start[rows]
            at = np.flatnonzero(~impossible_times(t))
            k = len(at)
            for src, dst in zip([*sources, s_code], [*targets, codes]):
                np.take(src, at, out=dst[n:n + k], mode="clip")
            for j in range(ncol):
                np.take(s_vals2[j], at, out=vals[j][n:n + k], mode="clip")
                np.take(s_kinds2[j], at, out=kinds[j][n:n + k], mode="clip")
            return k

        def close(line: Line, first: int, bad: int) -> None:
            """End the batch's rows of ``line`` (from ``first`` to ``row``): their line id and code, and the piece."""
            s_line[first:row], s_lcode[first:row] = line.id, code_of[line.name]
            batch.append((line, first, row, bad))

        read = _Releaser(self._buf)
        for line in chosen:
            if row and row + line.event_count > size:
                n += flush()
                row, batch = 0, []
            first, bad = row, 0
            for s, e in line._ranges:
                pos = s
                while True:
                    piece = pos
                    try:
                        done, nbad, pos = self._scan.decode_events(self._buf, pos, e, line.timestamp_ns, stat_ids,
                                                                     row, s_mid, s_start, s_dur, s_vals, s_kinds, *keep)
                    except ValueError as err:
                        raise FormatError(f"{self.source}: plane {self.name!r} line {line.name!r}: {err}; "
                                          "the file is corrupt or truncated - capture the profile again") from None
                    row += done
                    bad += nbad
                    read.add(piece, min(pos, e))  # the bytes decoded so far: a long line is let go as it goes
                    if pos >= e:
                        break
                    # the batch is full (a long line): its rows go out, and the line goes on from byte ``pos``
                    close(line, first, bad)
                    n += flush()
                    row, batch, first, bad = 0, [], 0, 0
            close(line, first, bad)
        read.done()
        if row:
            n += flush()
        self._dropped.update(dropped_now)  # (a line decoded again is counted once)
        mid, start, dur, line_id = (x[:n] for x in out)
        codes = codes[:n]  # display_name's codes (from_codes keeps them), read by _resolve
        columns: dict[str, object] = {
            "line_id": line_id,
            "line_name": self._categorical(lcode[:n], line_names) if line_names else pd.Categorical([]),
            "metadata_id": mid,
            "name": self._categorical(codes.copy(), [m.name for m in metas]),  # its own codes array
            "display_name": self._categorical(codes, [m.display_name or m.name for m in metas]),
            "start_ps": start,
            "duration_ps": dur,
        }
        for s in want:
            cols = [j for j, (nm, _) in enumerate(col_of) if nm == s]
            if not cols:
                v, k = np.zeros(n, np.int64), np.zeros(n, np.int8)
            else:
                v, k = vals[cols[0]][:n], kinds[cols[0]][:n]
                for j in cols[1:]:  # a name owning several ids: the later id wins where both are set (rare)
                    set_ = kinds[j][:n] != 0
                    v[set_] = vals[j][:n][set_]
                    k[set_] = kinds[j][:n][set_]
                for j in cols:  # the arrays are v and k now, or no longer needed
                    vals[j] = kinds[j] = None
            columns[s] = self._resolve(v, k, codes, s, metas if merge_metadata_stats else None)
            del v, k
        return columns

    def _categorical(self, codes: np.ndarray, categories: list[str]) -> pd.Categorical:
        """Codes into ``categories`` (-1: NA) as a Categorical of the distinct categories (the first of equal ones
        keeps its place); the dtype is built once per plane and category list."""
        key = tuple(categories)
        got = self._dtypes.get(key)
        if got is None:
            uniq = list(dict.fromkeys(categories))
            remap = None if len(uniq) == len(categories) else np.array(
                [uniq.index(c) for c in categories] + [-1], dtype=np.int32)
            got = self._dtypes[key] = (pd.CategoricalDtype(uniq), remap)
        dtype, remap = got
        if remap is not None:
            codes = remap[np.where(codes >= 0, codes, len(categories))]
        return pd.Categorical.from_codes(codes, dtype=dtype)

    def _meta_stat(self, stat: str) -> tuple[list[Any], bool, bool]:
        """The value of ``stat`` in each event metadata (by id; ``None`` where absent), whether any has it, and
        whether every one present is an integer; worked out once per plane and stat."""
        got = self._meta_stats.get(stat)
        if got is None:
            vals = [self.event_metadata[i].stats.get(stat) for i in sorted(self.event_metadata)]
            got = self._meta_stats[stat] = (vals, any(x is not None for x in vals),
                                            all(isinstance(x, (int, np.integer)) or x is None for x in vals))
        return got

    def _resolve(self, v: np.ndarray, k: np.ndarray, codes: np.ndarray, stat: str,
                 metas: list[EventMetadata] | None) -> Any:
        """The column of ``stat`` from its raw values ``v`` (int64 bits) and kinds ``k`` (int8, 0: absent), one
        per event; ``codes``: each event's position in the sorted event metadata (-1: none). ``v`` and ``k`` are
        used up: an integer or float column is built in their memory, so it costs no copy."""
        kinds = _kinds_present(k)
        present = {kind for kind in range(1, 8) if kinds >> kind & 1}
        meta_vals, has_meta, meta_ints = self._meta_stat(stat) if metas else ([], False, True)
        numeric = present <= {_KIND_INT, _KIND_UINT} and meta_ints
        if numeric and _KIND_UINT in present and np.any((k == _KIND_UINT) & (v < 0)):  # uint64 values above 2**63 - 1
            big = v.view(np.uint64)
            return pd.Series([int(big[i]) if k[i] == _KIND_UINT else (int(v[i]) if k[i] else None)
                              for i in range(len(v))], dtype=object).array
        if numeric:
            missing = np.equal(k, 0, out=k.view(np.bool_))
            if has_meta:
                fill = pd.array([x for x in meta_vals] + [None], dtype="Int64")
                at = np.where(codes[missing] >= 0, codes[missing], len(meta_vals))
                v[missing] = fill.to_numpy(np.int64, na_value=0)[at]
                missing[missing] = fill.isna()[at]
            else:
                np.putmask(v, missing, 0)  # (a masked assignment branches on every row)
            return pd.arrays.IntegerArray(v, missing)
        if present and present <= {_KIND_INT, _KIND_UINT, _KIND_DOUBLE} and not has_meta:
            out = v.view(np.float64)  # doubles are in place already
            for kind, raw in ((_KIND_UINT, np.uint64), (_KIND_INT, np.int64)):
                if kind in present:
                    at = np.flatnonzero(k == kind)
                    out[at] = v[at].view(raw).astype(np.float64)
            out[k == 0] = np.nan
            return out
        # strings (refs, str, bytes) or a mix: categories of distinct values, in the order of each kind's first
        # appearance (kinds in ascending order), factorized a chunk of events at a time
        index: dict[Any, int] = {}
        n = len(v)
        cat_codes = np.full(n, -1, np.int32)
        for kind in sorted(present):
            category_of: dict[int, int] = {}  # raw value -> category
            for a in range(0, n, _CHUNK_ROWS):
                b = min(a + _CHUNK_ROWS, n)
                sel = None if kinds == 1 << kind else np.flatnonzero(k[a:b] == kind)  # every event: this kind
                inv, uniq = pd.factorize(v[a:b] if sel is None else v[a:b][sel])
                uniq = uniq.tolist()
                for u in uniq:
                    if u not in category_of:
                        category_of[u] = index.setdefault(self._decode_value(kind, u), len(index))
                ids = np.array([category_of[u] for u in uniq] or [0], dtype=np.int32)
                if sel is None:
                    cat_codes[a:b] = ids[inv]
                else:
                    cat_codes[a:b][sel] = ids[inv]
        del v, k
        values = list(index)
        if has_meta:
            missing = np.flatnonzero(cat_codes < 0)
            mc = codes[missing]
            meta_codes = np.array([index.setdefault(x, len(index)) if x is not None else -1 for x in meta_vals]
                                  + [-1], dtype=np.int32)
            cat_codes[missing] = meta_codes[np.where(mc >= 0, mc, len(meta_vals))]
            values = list(index)
        if any(not isinstance(x, str) for x in values):  # mixed kinds: keep each value as decoded
            return pd.Series([values[c] if c >= 0 else None for c in cat_codes], dtype=object).array
        return self._categorical(cat_codes, values) if values else pd.Categorical([None] * n)

    def _decode_value(self, kind: int, raw: int) -> Any:
        if kind == _KIND_REF:
            return self.stat_names.get(raw, "")
        if kind == _KIND_DOUBLE:
            return float(np.int64(raw).view(np.float64))
        if kind in (_KIND_INT, _KIND_UINT):
            return raw
        off, length = raw >> _STR_LEN_BITS, raw & ((1 << _STR_LEN_BITS) - 1)
        data = bytes(self._buf[off: off + length])
        if kind == _KIND_STR:
            return data.decode("utf-8", "replace")
        if kind == _KIND_ZSTR:
            return _gunzip_text(data, f"{self.source}: plane {self.name!r}: a compressed stat")
        return data


def _release(buf: Any, start: int, end: int) -> None:
    """Let the OS drop the pages of buf[start:end] from RSS when ``buf`` is a memory-mapped file (they are read
    again from the page cache if needed), so that a file read once, to count or decode its events, does not
    stay resident."""
    if isinstance(buf, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        page = mmap.PAGESIZE
        lo, hi = (start // page) * page, (end // page) * page
        if hi > lo:
            buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class _Releaser:
    """Byte ranges of a buffer read once (counted or decoded), their pages let go (:func:`_release`) a run of
    adjacent ranges at a time, once it spans :data:`_RELEASE_BYTES`, and at :meth:`done`: one call per few MiB
    instead of one per line (a host plane has thousands)."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.lo, self.hi = buf, 0, 0

    def add(self, start: int, end: int) -> None:
        if self.hi > self.lo and not self.lo <= start <= self.hi + mmap.PAGESIZE:  # not next to the run
            self.done()
        if self.hi <= self.lo:
            self.lo = start
        self.hi = max(self.hi, end)
        if self.hi - self.lo >= _RELEASE_BYTES:
            self.done()

    def done(self) -> None:
        if self.hi > self.lo:
            _release(self.buf, self.lo, self.hi)
        self.lo = self.hi = 0


def code_dtype(count: int) -> type:
    """The integer dtype pandas gives the codes of a Categorical of ``count`` categories (so that
    ``Categorical.from_codes`` keeps an array of it as it is, without a copy)."""
    for dtype in (np.int8, np.int16, np.int32):
        if count < np.iinfo(dtype).max:
            return dtype
    return np.int64


def _code_lookup(ids: np.ndarray) -> tuple[Any, type]:
    """For the sorted distinct int64 ``ids``: a function giving, for an int64 array, each value's position in
    ``ids`` (-1: not there), and the dtype of those positions (:func:`code_dtype`). A lookup table when the ids
    are small non-negative integers, as XEventMetadata ids are; a binary search otherwise."""
    dtype = code_dtype(len(ids))
    if len(ids) and 0 <= ids[0] and ids[-1] < (1 << 20):
        table = np.full(int(ids[-1]) + 2, -1, dtype)
        table[ids] = np.arange(len(ids))
        last = np.uint64(len(table) - 1)  # -1: every value outside the table (negative ones too) lands here
        return lambda x: table[np.minimum(x.view(np.uint64), last)], dtype

    def search(x: np.ndarray) -> np.ndarray:
        if not len(ids):
            return np.full(len(x), -1, dtype)
        pos = np.minimum(np.searchsorted(ids, x), len(ids) - 1)
        return np.where(ids[pos] == x, pos, -1).astype(dtype)
    return search, dtype


def _kinds_present(kinds: np.ndarray) -> int:
    """The values (0..7) among the int8 ``kinds`` as a bit mask, bit k set when some row holds k (an OR of
    ``1 << kind`` a chunk at a time: a bincount converts every row to a platform integer first)."""
    mask = 0
    for a in range(0, len(kinds), _CHUNK_ROWS):
        mask |= int(np.bitwise_or.reduce(np.left_shift(np.uint8(1), kinds[a:a + _CHUNK_ROWS].view(np.uint8))))
    return mask



@dataclass(eq=False)
class XSpace:
    """A decoded ``.xplane.pb``: planes in file order, plus the XSpace errors/warnings/hostnames. ``decoder``
    is the wire scanner that reads it: ``"c"`` or ``"python"`` (see :func:`scanner`)."""

    path: str
    planes: list[Plane]
    hostnames: list[str]
    errors: list[str]
    warnings: list[str]
    size_bytes: int = 0
    decoder: str = "python"

    @property
    def notes(self) -> list[str]:
        """What was dropped from this file so far (events with impossible times; see :attr:`Plane.notes`)."""
        return [n for p in self.planes for n in p.notes]

    def plane(self, name: str) -> Plane | None:
        """The first plane with this name, or ``None``."""
        return next((p for p in self.planes if p.name == name), None)

    @property
    def host(self) -> str:
        """Host name: the XSpace's own, else the file name before ``.xplane.pb``."""
        if self.hostnames:
            return self.hostnames[0]
        return Path(self.path).name.split(".xplane")[0].split(".xspace")[0]

    @property
    def profile_start_time_ns(self) -> int | None:
        """``profile_start_time`` (epoch ns) of the ``Task Environment`` plane; ``None`` if absent or not an
        integer in [0, 2^63) (a corrupt stat)."""
        env = self.plane("Task Environment")
        value = env.stats.get("profile_start_time") if env else None
        ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value < 2**63
        return int(value) if ok else None


def _load_bytes(path: Location) -> Any:
    """The file's bytes: memory-mapped (local), read into memory (a URL, bounded by
    :data:`parsers.storage.READ_LIMIT_BYTES`), or inflated (gzip, bounded by :mod:`parsers.inflate`)."""
    if isinstance(path, str):
        data = storage.read_bytes(path)
        if data[:2] == b"\x1f\x8b":
            return inflate(data, path, "capture the profile again")
        if not data:
            raise FormatError(f"{path}: the file is empty; capture the profile again")
        return data
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot open {path}: {e.strerror}") from None
    with f:
        head = f.read(2)
        if head == b"\x1f\x8b":
            f.seek(0)
            return inflate(f.read(), str(path), "capture the profile again")
        if not head:
            raise FormatError(f"{path}: the file is empty; capture the profile again")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _truncation(buf: Any, why: str) -> str:
    """When the field at the byte a wire error names is length-delimited and claims more bytes than the file
    has, say so: the file is cut short (an interrupted copy or capture), not corrupt inside."""
    m = re.search(r"at byte (\d+)", why)
    if not m:
        return ""
    at, size, values = int(m.group(1)), len(buf), []
    p = at
    for _ in range(2):  # the key, then the length
        v = shift = 0
        while p < size and shift < 64:
            b = buf[p]
            p += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        else:
            return ""
        values.append(v)
        if v & 7 != 2 and len(values) == 1:
            return ""
    if p + values[1] <= size:
        return ""
    return (f" (the field there claims {values[1]:,} bytes but the file ends {size - p:,} bytes later: the file is "
            "cut short, e.g. an interrupted copy or capture)")


def read_xspace(path: str | Path, decoder: str | None = None) -> XSpace:
    """Decode an ``.xplane.pb`` (or gzip-compressed ``.xplane.pb.gz``) file: a local path, or a URL
    (``gs://...``, read whole into memory through :mod:`parsers.storage`).

    Plane headers, metadata and stats are parsed by protobuf; line events are left in the (memory-mapped)
    file and decoded on demand by :meth:`Plane.events`, with the wire scanner :func:`scanner` picks for
    ``decoder`` (``"c"``, ``"python"``, or ``None``: ``TRACEROOF_DECODER``, else the C one when built).

    :raises InputError: the file cannot be opened (a URL: not found, no access, missing extra); an unknown or
        unavailable decoder.
    :raises FormatError: the bytes are not a valid XSpace (corrupt, truncated, or text-mangled).
    """
    decoder, scan = scanner(decoder)
    p = storage.location(path)
    buf = _load_bytes(p)
    size = len(buf)

    def bad(why: str) -> FormatError:
        hint = _truncation(buf, why)
        if bytes(buf[: min(size, 65536)]).count(b"\xef\xbf\xbd") > 16:
            hint += " (bytes >= 0x80 were replaced by U+FFFD: the file went through a text conversion)"
        return FormatError(f"{p}: not a valid XSpace protobuf: {why}{hint}; pass an intact .xplane.pb")

    try:
        top = scan.scan_fields(buf, 0, size, 1, MAX_PLANES)
    except ValueError as e:
        raise bad(str(e).replace("fields numbered 1", "planes")) from None
    XS, XP, XL = SCHEMA["XSpace"], SCHEMA["XPlane"], SCHEMA["XLine"]
    header = XS()
    planes: list[Plane] = []
    try:
        header.ParseFromString(scan.split_fields(buf, 0, size, 1)[0])
        nlines = 0
        for _, wt, _, s, e, _ in top:
            if wt != 2:
                raise bad("plane field has the wrong wire type")
            fields = scan.scan_fields(buf, s, e, 3, MAX_LINES - nlines)
            nlines += len(fields)
            xp = XP()
            xp.ParseFromString(scan.split_fields(buf, s, e, 3)[0])
            stat_names = {k: v.name for k, v in xp.stat_metadata.items()}
            where = f"{p}: plane {xp.name!r}: a compressed stat"
            lines = []
            read = _Releaser(buf)  # counting the events read them; they are decoded later, line by line
            for _, lwt, _, fs, fe, _ in fields:
                if lwt != 2:
                    raise bad(f"plane {len(planes)}: line field has the wrong wire type")
                head, count = scan.split_fields(buf, fs, fe, 4)
                read.add(fs, fe)
                xl = XL()
                xl.ParseFromString(head)
                lines.append(Line(xl.id, xl.display_id or xl.id, xl.name, xl.display_name or xl.name,
                                  xl.timestamp_ns, xl.duration_ps, count, ((fs, fe),)))
            read.done()
            metas = {
                k: EventMetadata(k, v.name, v.display_name,
                                 {stat_names.get(st.metadata_id, str(st.metadata_id)): stat_value(st, stat_names, where)
                                  for st in v.stats}, bytes(v.metadata))
                for k, v in xp.event_metadata.items()
            }
            pstats = {stat_names.get(st.metadata_id, str(st.metadata_id)): stat_value(st, stat_names, where)
                      for st in xp.stats}
            planes.append(Plane(xp.id, xp.name, pstats, metas, stat_names, lines, buf, str(p), _scan=scan))
    except ValueError as e:
        raise bad(f"plane {len(planes)}: " + str(e).replace("fields numbered 3", "lines in all")) from None
    except Exception as e:  # protobuf's DecodeError
        if type(e).__name__ == "DecodeError":
            raise bad(str(e)) from None
        raise
    return XSpace(str(p), planes, list(header.hostnames), list(header.errors), list(header.warnings), size,
                  decoder)


def parse_full(path: str | Path) -> Any:
    """Parse the whole file with protobuf alone (the reference decoder; one Python object per event).

    Used by tests to check :meth:`Plane.events` event for event; slow and memory-hungry on large files.
    """
    data = _load_bytes(storage.location(path))
    msg = SCHEMA["XSpace"]()
    msg.ParseFromString(bytes(data))
    return msg
