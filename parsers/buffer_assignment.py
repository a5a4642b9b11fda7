"""XLA's memory reports from an ``--xla_dump_to`` folder: the buffer assignment, the memory-usage report and the
buffer live ranges of one compiled module.

XLA writes them beside the after-optimization HLO (``module_NNNN.<name>.<backend>_after_optimizations`` +
``-buffer-assignment.txt`` / ``-memory-usage-report.txt`` / ``-live-range.txt``) when the dump is written as
text (``--xla_dump_hlo_as_text``; the CPU and GPU compilers write them for every module). Formats, from
openxla/xla ``xla/service/buffer_assignment.cc`` (``BufferAllocation::ToString``,
``BufferAssignment::MemoryUsageReport``) and ``xla/service/hlo_live_range.cc`` (``HloLiveRange::ToString``)::

    BufferAssignment:
    allocation 6: size 262144, parameter 6, shape |f32[4,64,256]| at ShapeIndex {}:
     value: <1021 state_params.1 @0> (size=262144,offset=0): f32[4,64,256]{2,1,0}
    allocation 112: size 721264, preallocated-temp:
     value: <940 tuple.23{} @0> (size=72,offset=721024): (s32[], f32[16,16,64]{2,1,0})

An allocation header lists, in this order and each only when it applies: ``color N``, ``parameter N, shape |S|
at ShapeIndex {..}`` (an entry parameter), ``output shape is |S|`` (holds the entry root), ``constant``,
``thread-local``, ``maybe-live-out``, ``preallocated-temp`` (the temporaries of the whole program, packed by the
heap simulator). A value is ``<id instruction{shape index} (phi) @color>``. XLA's memory-usage report total per
memory space is the sum of its allocations' sizes::

    Memory Space: default (color=0)
    Total bytes: 4241204 (4.04MiB)
      cumulative_size;       size;       offset; used_by_n_values; shapes_list

The live-range file gives the schedule, each value's ``start-end`` positions in it and the values live at the
peak (``Live ranges at T (peak):`` then ``name{index}: N bytes (cumulative: M bytes)``).

Bad input raises :class:`MemoryReportError` (a :class:`~parsers.errors.FormatError`) naming the file and line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from parsers.errors import FormatError
from parsers.hlo import MAX_ARRAY_BYTES

MAX_REPORT_BYTES = 1 << 30  # a report larger than this is not one XLA wrote for one module


class MemoryReportError(FormatError):
    """A buffer-assignment, memory-usage-report or live-range file that is not what XLA writes."""


@dataclass(frozen=True)
class AssignedValue:
    """One HLO value placed in an allocation: ``instruction`` and ``shape_index`` (``{1}``; ``""`` for an array
    instruction) say where it is defined; ``phi`` marks a loop-carried merge value (no storage of its own)."""

    value_id: int
    instruction: str
    shape_index: str
    phi: bool
    size_bytes: int
    offset_bytes: int
    shape: str


@dataclass(frozen=True)
class Allocation:
    """One ``allocation N:`` block. ``parameter`` is the entry parameter number (``None`` when the allocation
    holds none); ``flags`` the header's other words (``constant``, ``thread-local``, ``maybe-live-out``,
    ``preallocated-temp`` and any XLA adds later)."""

    index: int
    size_bytes: int
    color: int
    parameter: int | None
    parameter_shape: str
    parameter_shape_index: str
    output_shape: str
    flags: frozenset[str]
    values: tuple[AssignedValue, ...]

    @property
    def kind(self) -> str:
        """``parameter``, ``temp`` (preallocated temporaries), ``constant``, ``thread-local``, ``output`` (holds
        the entry root or lives out of the program) or ``other``."""
        if self.parameter is not None:
            return "parameter"
        for flag, kind in (("preallocated-temp", "temp"), ("constant", "constant"), ("thread-local", "thread-local")):
            if flag in self.flags:
                return kind
        return "output" if self.output_shape or "maybe-live-out" in self.flags else "other"


@dataclass(frozen=True)
class BufferAssignment:
    """A module's buffer assignment (``-buffer-assignment.txt``)."""

    source: str
    allocations: tuple[Allocation, ...]

    def total_bytes(self, color: int | None = 0) -> int:
        """Bytes of all allocations in memory space ``color`` (all spaces for ``None``): the total XLA's
        memory-usage report prints."""
        return sum(a.size_bytes for a in self.allocations if color is None or a.color == color)

    def bytes_by_kind(self, color: int | None = 0) -> dict[str, int]:
        """Bytes of the allocations in memory space ``color`` (all spaces for ``None``) by
        :attr:`Allocation.kind`, in the order kinds first appear; XLA's ``memory_analysis()`` argument, output
        (less aliased) and temp sizes are the ``parameter``, ``output`` and ``temp`` entries."""
        out: dict[str, int] = {}
        for a in self.allocations:
            if color is None or a.color == color:
                out[a.kind] = out.get(a.kind, 0) + a.size_bytes
        return out


@dataclass(frozen=True)
class MemorySpace:
    """One ``Memory Space:`` section of the memory-usage report: its name, color and total bytes."""

    name: str
    color: int
    total_bytes: int
    rows: int  # slices listed under it


@dataclass(frozen=True)
class MemoryUsageReport:
    """A module's memory-usage report (``-memory-usage-report.txt``)."""

    source: str
    spaces: tuple[MemorySpace, ...]

    def total_bytes(self, color: int | None = 0) -> int:
        """The report's total for memory space ``color`` (all spaces for ``None``)."""
        return sum(s.total_bytes for s in self.spaces if color is None or s.color == color)


@dataclass(frozen=True)
class LiveRange:
    """A module's buffer live ranges (``-live-range.txt``): the entry schedule (instruction names in order), each
    value's ``(start, end)`` position by ``name{index}``, the peak position and the values live there with
    their bytes."""

    source: str
    schedule: tuple[str, ...]
    ranges: dict[str, tuple[int, int]]
    peak_time: int
    peak_values: tuple[tuple[str, int], ...]

    @property
    def peak_bytes(self) -> int:
        """Bytes live at the peak (XLA's sum, without the heap's packing or fragmentation)."""
        return sum(b for _, b in self.peak_values)


def _read(path: str | Path) -> tuple[str, list[str]]:
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_REPORT_BYTES:
            raise MemoryReportError(f"{p}: {size:,} bytes, more than XLA writes for one module "
                                    f"({MAX_REPORT_BYTES:,}); pass the report of one module")
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise MemoryReportError(f"{p}: cannot be read ({e.strerror or e}); check the path") from None
    return str(p), text.splitlines()


def _bad(source: str, line: int, what: str) -> MemoryReportError:
    return MemoryReportError(f"{source}:{line}: {what}; pass the file XLA wrote (--xla_dump_to with "
                             "--xla_dump_hlo_as_text) unchanged, or remove it from the dump folder")


_ALLOC = re.compile(r"allocation (\d+): size (\d+)(.*):$")
_PARAM = re.compile(r", parameter (\d+), shape \|([^|]*)\| at ShapeIndex (\{[\d,\s]*\})")
_OUTPUT = re.compile(r", output shape is \|([^|]*)\|")
_VALUE = re.compile(r" value: <(\d+) ([^\s{>]+)(\{[\d,\s]*\})?( \(phi\))?(?: @(\d+))?> "
                    r"\(size=(\d+),offset=(\d+)\): (.*)$")


def read_buffer_assignment(path: str | Path) -> BufferAssignment:
    """Parse a ``-buffer-assignment.txt`` file (see the module docstring for the format). Text after the
    allocations (older XLA appends ``Total bytes used`` and ``Used values:``) is ignored.

    :raises MemoryReportError: no ``BufferAssignment:`` header, an unreadable allocation or value line, an
        allocation index repeated, a value outside its allocation, or a size no device holds.
    """
    source, lines = _read(path)
    if not lines or lines[0].strip() != "BufferAssignment:":
        raise _bad(source, 1, "expected 'BufferAssignment:' (not an XLA buffer-assignment file)")
    allocs: list[Allocation] = []
    head: dict | None = None
    values: list[AssignedValue] = []

    def close() -> None:
        if head is not None:
            allocs.append(Allocation(values=tuple(values), **head))

    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        if line.startswith(("Total bytes used", "Used values:")):
            break
        m = _ALLOC.match(line)
        if m:
            close()
            index, size, rest = int(m.group(1)), int(m.group(2)), m.group(3)
            if size > MAX_ARRAY_BYTES:
                raise _bad(source, n, f"allocation {index} of {size:,} bytes is larger than any device memory")
            if index != len(allocs):
                raise _bad(source, n, f"allocation {index} out of order (expected {len(allocs)})")
            p, o = _PARAM.search(rest), _OUTPUT.search(rest)
            words = _OUTPUT.sub("", _PARAM.sub("", rest))
            flags = {w.strip() for w in words.split(",") if w.strip()}
            color = next((int(w.split()[1]) for w in flags if re.fullmatch(r"color \d+", w)), 0)
            head = dict(index=index, size_bytes=size, color=color, parameter=int(p.group(1)) if p else None,
                        parameter_shape=p.group(2) if p else "", parameter_shape_index=p.group(3) if p else "",
                        output_shape=o.group(1) if o else "",
                        flags=frozenset(w for w in flags if not w.startswith("color ")))
            values = []
            continue
        v = _VALUE.match(line)
        if v is None or head is None:
            raise _bad(source, n, f"expected 'allocation N: size S...:' or ' value: <id name @color> (size=S,"
                                  f"offset=O): shape', found {line.strip()[:60]!r}")
        size, offset = int(v.group(6)), int(v.group(7))
        if offset + size > head["size_bytes"]:
            raise _bad(source, n, f"value {v.group(2)} (offset {offset}, size {size}) lies outside allocation "
                                  f"{head['index']} of {head['size_bytes']} bytes")
        values.append(AssignedValue(int(v.group(1)), v.group(2), v.group(3) or "", bool(v.group(4)), size, offset,
                                    v.group(8).strip()))
    close()
    return BufferAssignment(source, tuple(allocs))


_SPACE = re.compile(r"Memory Space: (.*?) \(color=(\d+)\)$")
_TOTAL = re.compile(r"Total bytes: (\d+)\b")


def read_memory_usage_report(path: str | Path) -> MemoryUsageReport:
    """Parse a ``-memory-usage-report.txt`` file: each memory space's name, color, total bytes and rows.

    :raises MemoryReportError: no ``Memory Space:`` section, a section without its ``Total bytes:`` line, or a
        table row that is not ``cumulative; size; offset; used_by_n_values; shapes``.
    """
    source, lines = _read(path)
    spaces: list[MemorySpace] = []
    current: dict | None = None
    for n, line in enumerate(lines, start=1):
        s = line.strip()
        if not s or s.startswith(("cumulative_size", "---", "The rest ")):  # "The rest N values are less than ..."
            continue
        m = _SPACE.match(s)
        if m:
            if current is not None and current["total_bytes"] is None:
                raise _bad(source, n, f"memory space {current['name']!r} has no 'Total bytes:' line")
            if current is not None:
                spaces.append(MemorySpace(**current))
            current = dict(name=m.group(1), color=int(m.group(2)), total_bytes=None, rows=0)
            continue
        if current is None:
            raise _bad(source, n, f"expected 'Memory Space: name (color=N)', found {s[:60]!r}")
        t = _TOTAL.match(s)
        if t and current["total_bytes"] is None:
            if int(t.group(1)) > MAX_ARRAY_BYTES:
                raise _bad(source, n, f"total of {int(t.group(1)):,} bytes is larger than any device memory")
            current["total_bytes"] = int(t.group(1))
            continue
        cells = [c.strip() for c in s.split(";", 4)]
        if len(cells) != 5 or not cells[2].isdigit() or not cells[3].isdigit() or current["total_bytes"] is None:
            raise _bad(source, n, f"expected a row 'cumulative; size; offset; used_by_n_values; shapes', "
                                  f"found {s[:60]!r}")
        current["rows"] += 1
    if current is None:
        raise _bad(source, 1, "no 'Memory Space:' section (not an XLA memory-usage report)")
    if current["total_bytes"] is None:
        raise _bad(source, len(lines), f"memory space {current['name']!r} has no 'Total bytes:' line (truncated?)")
    spaces.append(MemorySpace(**current))
    return MemoryUsageReport(source, tuple(spaces))


_RANGE = re.compile(r"(\S+?\{[\d,\s]*\}):(\d+)-(\d+)$")
_PEAK = re.compile(r"Live ranges at (\d+) \(peak\):$")
_PEAK_VALUE = re.compile(r"(\S+?\{[\d,\s]*\}): (\d+) bytes \(cumulative: \d+ bytes\)$")


def read_live_range(path: str | Path) -> LiveRange:
    """Parse a ``-live-range.txt`` file: schedule, value ranges and the peak's live values (the stack-trace
    breakdown after them is ignored).

    :raises MemoryReportError: no ``HloLiveRange`` header or an unreadable line in the schedule, ranges or peak.
    """
    source, lines = _read(path)
    if not lines or not lines[0].startswith("HloLiveRange"):
        raise _bad(source, 1, "expected 'HloLiveRange (max N):' (not an XLA live-range file)")
    schedule: list[str] = []
    ranges: dict[str, tuple[int, int]] = {}
    peak: list[tuple[str, int]] = []
    peak_time = -1
    section = ""
    for n, line in enumerate(lines[1:], start=2):
        s = line.strip()
        if not s:
            continue
        if s in ("InstructionSequence:", "BufferLiveRange:"):
            section = s
            continue
        m = _PEAK.match(s)
        if m:
            section, peak_time = "peak", int(m.group(1))
            continue
        if s.startswith("Stack trace breakdown") or s.startswith("Total bytes"):
            break
        if section == "InstructionSequence:":
            pos, _, name = s.partition(":")
            if not pos.isdigit() or int(pos) != len(schedule) or not name:
                raise _bad(source, n, f"expected schedule entry {len(schedule)}:name, found {s[:60]!r}")
            schedule.append(name)
        elif section == "BufferLiveRange:":
            r = _RANGE.match(s)
            if r is None:
                raise _bad(source, n, f"expected a live range 'name{{index}}:start-end', found {s[:60]!r}")
            ranges[r.group(1)] = (int(r.group(2)), int(r.group(3)))
        elif section == "peak":
            v = _PEAK_VALUE.match(s)
            if v is None:
                raise _bad(source, n, f"expected 'name{{index}}: N bytes (cumulative: M bytes)', found {s[:60]!r}")
            peak.append((v.group(1), int(v.group(2))))
        else:
            raise _bad(source, n, f"unexpected line {s[:60]!r} before 'InstructionSequence:'")
    return LiveRange(source, tuple(schedule), ranges, peak_time, tuple(peak))


def report_files(after_optimizations: str | Path) -> dict[str, Path]:
    """The memory reports XLA wrote beside an after-optimization HLO text file (``...after_optimizations.txt``),
    by kind (``buffer-assignment``, ``memory-usage-report``, ``live-range``), those that exist."""
    p = Path(after_optimizations)
    if not p.name.endswith(".txt"):
        return {}
    stem = p.name[: -len(".txt")]
    found = {k: p.with_name(f"{stem}-{k}.txt") for k in ("buffer-assignment", "memory-usage-report", "live-range")}
    return {k: f for k, f in found.items() if f.is_file()}
