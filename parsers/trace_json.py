"""TensorBoard / Perfetto trace JSON reader (``*.trace.json.gz``, ``perfetto_trace.json.gz``).

Format (openxla/xla ``xla/tsl/profiler/convert/xplane_to_trace_events.cc``; ``docs/reference/xplane-format.md``
§8): ``{"traceEvents": [...]}`` with ``ph: "M"`` metadata events naming processes (planes) and threads (lines),
and ``ph: "X"`` complete events whose ``ts`` / ``dur`` are microseconds as floats with nanosecond resolution and
whose ``args`` hold stat values as strings. The array may end with an empty object.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from parsers.errors import FormatError, InputError

# Event caps of the XSpace -> trace JSON conversion (GetTraceViewerMaxEvents): a file holding exactly this many
# complete events was probably truncated.
KNOWN_EVENT_CAPS = (1_000_000, 5_000_000)


@dataclass(eq=False)
class TraceJson:
    """A decoded trace JSON: process (plane) and thread (line) names, and the complete events."""

    path: str
    process_names: dict[int, str]
    thread_names: dict[tuple[int, int], str]
    complete_events: list[dict[str, Any]]

    @property
    def maybe_truncated(self) -> bool:
        """True when the event count equals a known trace-viewer cap (the export dropped events)."""
        return len(self.complete_events) in KNOWN_EVENT_CAPS

    def events(self, args: Sequence[str] = ()) -> pd.DataFrame:
        """Complete events, one row each: ``pid``, ``tid``, ``plane`` and ``line_name`` (category), ``name``,
        ``start_ps`` and ``duration_ps`` (int64, from µs floats rounded to the picosecond), then one column per
        requested ``args`` key (strings as written; ``None`` where absent)."""
        ev = self.complete_events
        pid = np.fromiter((e.get("pid", 0) for e in ev), np.int64, len(ev))
        tid = np.fromiter((e.get("tid", 0) for e in ev), np.int64, len(ev))
        ts = np.fromiter((float(e.get("ts", 0.0)) for e in ev), np.float64, len(ev))
        dur = np.fromiter((float(e.get("dur", 0.0)) for e in ev), np.float64, len(ev))
        df = pd.DataFrame({
            "pid": pid, "tid": tid,
            "plane": pd.Categorical([self.process_names.get(int(p), str(p)) for p in pid]),
            "line_name": pd.Categorical([self.thread_names.get((int(p), int(t)), str(t)) for p, t in zip(pid, tid)]),
            "name": pd.Categorical([e.get("name", "") for e in ev]),
            "start_ps": np.rint(ts * 1e6).astype(np.int64),
            "duration_ps": np.rint(dur * 1e6).astype(np.int64),
        })
        for key in args:
            df[key] = pd.Categorical([(e.get("args") or {}).get(key) for e in ev])
        return df


def load_json(path: Path) -> Any:
    """JSON from a plain or gzip-compressed file.

    :raises InputError: the file cannot be opened. :raises FormatError: corrupt gzip or invalid JSON.
    """
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot open {path}: {e.strerror}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise FormatError(f"{path}: gzip data is corrupt or truncated ({e}); export the file again") from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: not valid JSON ({e}); the file is corrupt or truncated") from None


def read_trace_json(path: str | Path) -> TraceJson:
    """Read a (gzip-compressed or plain) trace JSON file.

    :raises InputError: the file cannot be opened.
    :raises FormatError: corrupt gzip, invalid JSON, or JSON without ``traceEvents``.
    """
    p = Path(path)
    data = load_json(p)
    events = data.get("traceEvents") if isinstance(data, dict) else data if isinstance(data, list) else None
    if not isinstance(events, list):
        raise FormatError(f"{p}: JSON without 'traceEvents': not a TensorBoard/Perfetto trace")
    procs: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    complete = []
    for e in events:
        if not isinstance(e, dict) or not e:
            continue
        ph = e.get("ph")
        if ph == "X":
            complete.append(e)
        elif ph == "M":
            name = (e.get("args") or {}).get("name")
            if e.get("name") == "process_name" and name is not None:
                procs[int(e.get("pid", 0))] = str(name)
            elif e.get("name") == "thread_name" and name is not None:
                threads[(int(e.get("pid", 0)), int(e.get("tid", 0)))] = str(name)
    return TraceJson(str(p), procs, threads, complete)
