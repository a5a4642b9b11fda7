"""TensorBoard / Perfetto trace JSON reader (``*.trace.json.gz``, ``perfetto_trace.json.gz``).

Format (openxla/xla ``xla/tsl/profiler/convert/xplane_to_trace_events.cc``; ``docs/reference/xplane-format.md``
§8): ``{"traceEvents": [...]}`` with ``ph: "M"`` metadata events naming processes (planes) and threads (lines),
and ``ph: "X"`` complete events whose ``ts`` / ``dur`` are microseconds as floats with nanosecond resolution and
whose ``args`` hold stat values as strings. The array may end with an empty object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from parsers import storage
from parsers.errors import FormatError, InputError
from parsers.inflate import inflate
from parsers.storage import Location

# Event caps of the XSpace -> trace JSON conversion (GetTraceViewerMaxEvents): a file holding exactly this many
# complete events was probably truncated.
KNOWN_EVENT_CAPS = (1_000_000, 5_000_000)
# Times past these are impossible (the same limits as the XSpace decoder): |ts| above 2^62 ps, dur above 2^60 ps.
TIME_LIMIT_US = 2.0**62 / 1e6
DURATION_LIMIT_US = 2.0**60 / 1e6
ID_LIMIT = 2**62
_SCALARS = (str, int, float)


@dataclass(eq=False)
class TraceJson:
    """A decoded trace JSON: process (plane) and thread (line) names, the complete events, and notes on what was
    dropped (events whose ids, times, name or args have the wrong JSON type or an impossible value)."""

    path: str
    process_names: dict[int, str]
    thread_names: dict[tuple[int, int], str]
    complete_events: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)

    @property
    def maybe_truncated(self) -> bool:
        """True when the event count equals a known trace-viewer cap (the export dropped events)."""
        return len(self.complete_events) in KNOWN_EVENT_CAPS

    def events(self, args: Sequence[str] = ()) -> pd.DataFrame:
        """Complete events, one row each: :meth:`columns` as a DataFrame."""
        return pd.DataFrame(self.columns(args), copy=False)

    def columns(self, args: Sequence[str] = (), raw: Sequence[str] = ()) -> dict[str, Any]:
        """Complete events, one row each, as equally long columns by name: ``pid``, ``tid``, ``plane`` and
        ``line_name`` (category), ``name``, ``start_ps`` and ``duration_ps`` (int64, from µs floats rounded to the
        picosecond), then one column per requested ``args`` key (strings or numbers as written; ``None`` where
        absent or not a JSON scalar): a category, or for the keys in ``raw`` an object array of the values (for a
        caller that converts them).
        Every event was checked by :func:`read_trace_json`, so the casts cannot fail."""
        ev = self.complete_events
        pid = np.fromiter((e.get("pid", 0) for e in ev), np.int64, len(ev))
        tid = np.fromiter((e.get("tid", 0) for e in ev), np.int64, len(ev))
        ts = np.fromiter((e["ts"] for e in ev), np.float64, len(ev))
        dur = np.fromiter((e.get("dur", 0.0) for e in ev), np.float64, len(ev))
        pids, tids = pid.tolist(), tid.tolist()
        planes = {p: self.process_names.get(p, str(p)) for p in set(pids)}
        lines = {k: self.thread_names.get(k, str(k[1])) for k in set(zip(pids, tids))}
        df: dict[str, Any] = {
            "pid": pid, "tid": tid,
            "plane": text_categorical([planes[p] for p in pids]),
            "line_name": text_categorical([lines[k] for k in zip(pids, tids)]),
            "name": text_categorical([e.get("name", "") for e in ev]),
            "start_ps": np.rint(ts * 1e6).astype(np.int64),
            "duration_ps": np.rint(dur * 1e6).astype(np.int64),
        }
        event_args = [e.get("args") or {} for e in ev] if args else []
        for key in args:
            values = [a.get(key) for a in event_args]
            values = [v if isinstance(v, _SCALARS) and not isinstance(v, bool) else None for v in values]
            if key in raw:
                df[key] = np.empty(len(values), dtype=object)
                df[key][:] = values
            else:
                df[key] = text_categorical(values)
        return df


def text_categorical(values: list) -> pd.Categorical:
    """``pd.Categorical(values)``, built directly where the values are text and ``None`` (pandas' constructor
    costs ~0.1 ms even for a few values); other values go through pandas' constructor and its rules for them."""
    distinct = set(values)
    distinct.discard(None)
    if not distinct and values:  # all missing: as pandas infers it, no categories of dtype float64
        return pd.Categorical.from_codes(np.full(len(values), -1, np.int8),
                                         dtype=pd.CategoricalDtype(pd.Index([], dtype=np.float64)), validate=False)
    if not distinct or not all(type(v) is str for v in distinct):
        return pd.Categorical(values)
    categories = sorted(distinct)
    code = {v: i for i, v in enumerate(categories)}
    return pd.Categorical.from_codes(np.array([code.get(v, -1) for v in values], np.int64),
                                     dtype=pd.CategoricalDtype(pd.Index(categories, dtype="str")), validate=False)


def load_json(path: Location, redo: str = "export the file again") -> Any:
    """JSON from a plain or gzip-compressed file, local or a URL (:mod:`parsers.storage`; decompression bounded
    by :mod:`parsers.inflate`).

    :raises InputError: the file cannot be opened. :raises FormatError: corrupt or truncated gzip, invalid JSON,
        or JSON nested deeper than Python's recursion limit.
    """
    if isinstance(path, Path):
        try:
            raw: bytes | bytearray = path.read_bytes()
        except OSError as e:
            raise InputError(f"cannot open {path}: {e.strerror}") from None
    else:
        raw = storage.read_bytes(path)
    if raw[:2] == b"\x1f\x8b":
        raw = inflate(raw, str(path), redo)
    try:
        return json.loads(raw)
    except RecursionError:
        raise FormatError(f"{path}: JSON nested too deeply to be a trace or an export; the file is corrupt") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: not valid JSON ({e}); the file is corrupt or truncated") from None


def _id(x: Any) -> int | None:
    """A pid/tid: a JSON integer (or integral number) below 2^62 in magnitude, else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x if -ID_LIMIT < x < ID_LIMIT else None
    if isinstance(x, float) and x.is_integer() and abs(x) < ID_LIMIT:
        return int(x)
    return None


def _time(x: Any, lo: float, hi: float) -> bool:
    """A JSON number within [lo, hi] (NaN and infinities compare false; big integers compare exactly)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and lo <= x <= hi


def _why_bad(e: dict[str, Any]) -> str | None:
    """Why a complete event cannot be used, or None."""
    if _id(e.get("pid", 0)) is None or _id(e.get("tid", 0)) is None:
        return "a pid or tid that is not an integer below 2^62"
    if "ts" not in e or not _time(e["ts"], -TIME_LIMIT_US, TIME_LIMIT_US):
        return "a missing or impossible ts (not a number within 2^62 ps)"
    if not _time(e.get("dur", 0), 0.0, DURATION_LIMIT_US):
        return "an impossible dur (negative, not a number, or above 2^60 ps = 13 days)"
    if not isinstance(e.get("name", ""), str):
        return "a name that is not a string"
    if not isinstance(e.get("args") or {}, dict):
        return "args that are not a JSON object"
    return None


def read_trace_json(path: str | Path) -> TraceJson:
    """Read a (gzip-compressed or plain) trace JSON file. Complete events with an id, time, name or args of the
    wrong JSON type or an impossible value are dropped and counted in :attr:`TraceJson.notes`.

    ``path`` is local or a URL (``gs://...``, :mod:`parsers.storage`).

    :raises InputError: the file cannot be opened.
    :raises FormatError: corrupt gzip, invalid JSON, or JSON without ``traceEvents``.
    """
    p = storage.location(path)
    data = load_json(p)
    events = data.get("traceEvents") if isinstance(data, dict) else data if isinstance(data, list) else None
    if not isinstance(events, list):
        if isinstance(data, dict) and {"summary", "layers"} <= set(data):  # `traceroof analyze --format json`
            raise FormatError(f"{p}: a traceroof report, not a profile: analyze the profile it came from, or "
                              "compare two reports with `traceroof diff BASE.json NEW.json`")
        raise FormatError(f"{p}: JSON without 'traceEvents': not a TensorBoard/Perfetto trace")
    procs: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    complete = []
    dropped: dict[str, int] = {}
    for e in events:
        if not isinstance(e, dict) or not e:
            if e is not None and e != {}:
                dropped["not a JSON object"] = dropped.get("not a JSON object", 0) + 1
            continue
        ph = e.get("ph")
        if ph == "X":
            why = _why_bad(e)
            if why is None:
                complete.append(e)
            else:
                dropped[why] = dropped.get(why, 0) + 1
        elif ph == "M":
            args = e.get("args")
            name = args.get("name") if isinstance(args, dict) else None
            pid, tid = _id(e.get("pid", 0)), _id(e.get("tid", 0))
            if not isinstance(name, (str, int, float)) or pid is None or tid is None:
                continue  # a metadata event we cannot use: the process or thread keeps its number as its name
            if e.get("name") == "process_name":
                procs[pid] = str(name)
            elif e.get("name") == "thread_name":
                threads[(pid, tid)] = str(name)
    notes = []
    if dropped:
        why = ", ".join(f"{n:,} with {w}" if w != "not a JSON object" else f"{n:,} {w}"
                        for w, n in sorted(dropped.items(), key=lambda x: -x[1]))
        notes.append(f"{storage.name(p)}: {sum(dropped.values()):,} trace events dropped ({why}); the file is "
                     "partly corrupt - figures exclude them")
    return TraceJson(str(p), procs, threads, complete, notes)
