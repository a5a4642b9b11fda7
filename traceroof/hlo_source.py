"""Which HLO describes the profiled programs: the profile's own HloProtos first, dumps checked against it.

The HLO joined must be the HLO that ran. The ``xla.HloProto`` of every program a profile ran (embedded in its
``/host:metadata`` plane, or written beside it as ``<module>(<program_id>).hlo_proto.pb``) is the truth. A text
dump of the same program that differs from it (another run's dump folder, an edited file) is dropped with a note
naming both; compared by a fingerprint of every instruction's name, opcode, element type and dims. Without a
profile HloProto, a dump must name every op the program's events ran (``hlo_op``) or it is refused
(:class:`HloMismatchError`, exit status 2). Dump folders are read as XLA writes them
(:mod:`parsers.dump_folder`); a file that does not parse as HLO becomes a note, unless it is the only
HLO of a profiled program.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from parsers import storage
from parsers.dump_folder import _SNIFF_BYTES, HLO_TEXT_SUFFIXES, dump_file_kind, hlo_text_files
from parsers.errors import HloParseError, TraceroofError
from parsers.hlo import HloModule
from parsers.hlo_proto import module_from_proto, read_hlo_proto_file
from parsers.hlo_text import parse_hlo_file, parse_hlo_text
from parsers.storage import Location
from traceroof.codes import run_starts

_DUMP_NAME = re.compile(r"module_(\d+)\.(.+?)\.")


class HloMismatchError(TraceroofError):
    """The HLO given does not describe the profiled program."""


def hlo_files(path: Location, explicit: bool = True) -> list[Location]:
    """HLO text files under ``path`` (local or a URL): XLA's after-optimization dumps; for an explicit ``--hlo``
    folder without them, other ``.txt`` / ``.hlo`` files with an ``HloModule`` header. A file is taken as given.

    :raises InputError: a URL that cannot be listed or read (:mod:`parsers.storage`)."""
    if storage.is_file(path):
        return [path]
    after, other = hlo_text_files(path) if isinstance(path, Path) else _remote_hlo_text_files(path)
    return after if after or not explicit else other


def _remote_hlo_text_files(folder: str) -> tuple[list[Location], list[Location]]:
    """:func:`parsers.dump_folder.hlo_text_files` for a URL folder."""
    after: list[Location] = []
    other: list[Location] = []
    for f, parts in storage.walk(folder):
        kind = dump_file_kind(Path(parts[-1]))
        if "plugins" in parts:
            continue
        if kind == "hlo_after":
            after.append(f)
        elif (kind == "other" and parts[-1].endswith(HLO_TEXT_SUFFIXES)
              and re.search(rb"(?m)^[ \t]*HloModule\s", storage.read_head(f, _SNIFF_BYTES))):
            other.append(f)
    return after, other


_PARSED: dict[tuple[str, int, int], list[HloModule]] = {}  # per process: hosts of one run share their dumps


def _parse_file(f: Location) -> list[HloModule]:
    """:func:`parsers.hlo_text.parse_hlo_file` of a local file or a URL (program id from a dump name). A local
    file is parsed once per process while its size and modification time stay the same (a worker reading
    several hosts of one run parses their shared dumps once)."""
    if isinstance(f, Path):
        st = f.stat()
        key = (str(f), st.st_size, st.st_mtime_ns)  # as spelled: modules keep it as their source
        if key not in _PARSED:
            _PARSED[key] = parse_hlo_file(f)
        return list(_PARSED[key])
    modules = parse_hlo_text(storage.read_bytes(f).decode("utf-8", "replace"), source=f)
    m = re.match(r"module_(\d+)\.", storage.name(f))
    if m and len(modules) == 1:
        modules[0].program_id = int(m.group(1))
    return modules


def _read_sidecar(f: Location) -> HloModule:
    """:func:`parsers.hlo_proto.read_hlo_proto_file` of a local file or a URL."""
    return read_hlo_proto_file(f) if isinstance(f, Path) else module_from_proto(storage.read_bytes(f), f)


def fingerprint(module: HloModule) -> tuple[str, int]:
    """(sha1 hex digest, number of instructions) over the sorted set of every instruction's computation, name,
    opcode, element type and dims: equal for the same compiled program read from a text dump or an HloProto
    (which may order computations and instructions differently)."""
    lines = sorted(f"{comp.name}/{inst.name}={inst.opcode}:{inst.shape.element_type}{list(inst.shape.dims)}"
                   for comp in module.computations.values() for inst in comp.instructions)
    return hashlib.sha1("\n".join(lines).encode()).hexdigest(), len(lines)


def _first_difference(a: HloModule, b: HloModule) -> str:
    left = {i.name: i for c in a.computations.values() for i in c.instructions}
    right = {i.name: i for c in b.computations.values() for i in c.instructions}
    for name, inst in left.items():
        other = right.get(name)
        if other is None:
            return f"{name} is not in the profile's HLO"
        if (inst.opcode, inst.shape.element_type, inst.shape.dims) != (other.opcode, other.shape.element_type,
                                                                       other.shape.dims):
            return (f"{name} is {inst.opcode} {inst.shape.element_type}{list(inst.shape.dims)} in the dump, "
                    f"{other.opcode} {other.shape.element_type}{list(other.shape.dims)} in the profile")
    extra = sorted(set(right) - set(left))
    return f"{extra[0]} is missing from the dump" if extra else "computations differ"


def _profiled(events: pd.DataFrame, without_id: bool = False) -> tuple[set[int], set[str]]:
    """The program ids and module names (missing ones left out) of the events; with ``without_id`` the names
    only of events without a program id."""
    pid = events["program_id"].array
    missing = np.asarray(pid.isna(), bool)
    ids = set(_distinct(pid.to_numpy("int64", na_value=0)[~missing] if missing.any() else
                        pid.to_numpy("int64", na_value=0)).tolist())
    module = events["module"].array
    if without_id:
        module = module[missing]
    if isinstance(module, pd.Categorical):
        used = _distinct(module.codes)
        names = {str(c) for c in module.categories[used[used >= 0]]}
    else:
        names = {x for x in pd.Series(module).astype(str).unique() if isinstance(x, str)}
    return ids, names


def _distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` of a column of events, which come in long runs of one program: the distinct values
    among each run's first (no sort of every event)."""
    return np.unique(values[run_starts(values)])


def relevant_dumps(files: Sequence[Location], events: pd.DataFrame) -> list[Location]:
    """The HLO files that can describe the profiled programs: a dump ``module_NNNN.<name>.*`` is kept when the
    profile ran program NNNN or a module of that name; files not named like dumps are always kept."""
    ids, names = _profiled(events)
    return [f for f in files if not (m := _DUMP_NAME.match(storage.name(f))) or int(m.group(1)) in ids
            or m.group(2) in names]


def parse_dumps(files: Sequence[Location], events: pd.DataFrame, notes: list[str], covered: set[int] = frozenset()
                ) -> list[HloModule]:
    """Parse HLO text files; a file that fails to parse becomes a note, unless it is the only HLO of a profiled
    program (a dump named for a program the profile ran and whose HLO the profile does not carry: ``covered``)
    or the only file given.

    :raises HloParseError: that file does not parse.
    """
    ids, _ = _profiled(events)
    ids = ids - set(covered)
    modules: list[HloModule] = []
    for f in files:
        try:
            modules += _parse_file(f)
        except HloParseError as e:
            m = _DUMP_NAME.match(storage.name(f))
            if (len(files) == 1 and not covered) or (m and int(m.group(1)) in ids):
                raise
            notes.append(f"skipped {storage.name(f)}: it does not parse as HLO ({e})")
    return modules


def embedded_hlo(xs) -> list[tuple[int | None, str, bytes, str]]:
    """(program id, module name, HloProto bytes, source) of every program in an XSpace's ``/host:metadata``."""
    meta = xs.plane("/host:metadata")
    out = []
    if meta is None:
        return out
    for em in meta.event_metadata.values():
        data = em.stats.get("Hlo Proto")
        if not isinstance(data, (bytes, bytearray)):
            continue
        m = re.fullmatch(r"(.*)\((\d+)\)", em.name)
        pid = em.stats.get("program_id")
        pid = int(pid) if isinstance(pid, int) else (int(m.group(2)) if m else None)
        out.append((pid, m.group(1) if m else em.name, bytes(data), f"{xs.path}:/host:metadata:{em.name}"))
    return out


def profile_hlo(events: pd.DataFrame, embedded: list[tuple[int | None, str, bytes, str]],
                sidecars: Sequence[Location], notes: list[str] | None = None) -> list[tuple[HloModule, str]]:
    """Modules decoded from the profile's own HloProtos (embedded, then sidecar files) for the programs the
    events ran, with how each was found (``embedded`` / ``sidecar``). Matched by program id (by name only
    for events without ids). An embedded HloProto that does not decode is skipped with a note in ``notes`` (a
    dump of the program is used instead; else its ops stay unjoined and the report says so); a sidecar file that
    does not decode raises :class:`HloParseError`, as an unparsable dump does.
    """
    ids, names = _profiled(events, without_id=True)
    candidates: list[tuple[int | None, str, str, Callable[[], HloModule]]] = [
        (pid, name, "embedded", lambda d=data, src=src, pid=pid: module_from_proto(d, src, pid))
        for pid, name, data, src in embedded]
    for f in sidecars:
        m = re.fullmatch(r"(.*)\((\d+)\)\.hlo_proto\.pb", storage.name(f))
        candidates.append((int(m.group(2)) if m else None, m.group(1) if m else storage.name(f), "sidecar",
                           lambda f=f: _read_sidecar(f)))
    out: list[tuple[HloModule, str]] = []
    seen_ids: set[int] = set()
    seen_names: set[str] = set()
    for pid, name, how, load in candidates:
        if (pid is not None and pid in ids and pid not in seen_ids) or (name in names and name not in seen_names):
            try:
                module = load()
            except HloParseError as e:
                if notes is None or how != "embedded":
                    raise
                notes.append(f"an HloProto of {name} in the profile does not decode, skipped: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
                continue
            if pid is not None:
                module.program_id = pid
                seen_ids.add(pid)
            seen_names.add(name)
            out.append((module, how))
    return out


def reconcile(dumps: list[HloModule], truth: list[HloModule], notes: list[str]
              ) -> tuple[list[HloModule], frozenset[str]]:
    """The dumps not superseded by the profile's own HLO, and the sources of those superseded that equal it (a
    dump's reports, such as its buffer assignment, describe the profiled program only then): a dump of a program
    the profile carries is dropped (with a note naming both when it differs)."""
    by_key = {(m.program_id, m.name): m for m in truth}
    kept = []
    equal = set()
    for d in dumps:
        t = by_key.get((d.program_id, d.name))
        if t is None:
            kept.append(d)
        elif fingerprint(d)[0] == fingerprint(t)[0]:
            equal.add(d.source)
        else:
            notes.append(f"{d.source} is not the HLO that ran as {d.name}({d.program_id}) ({_first_difference(d, t)}):"
                         f" dropped; using the HLO the profile carries ({t.source})")
    return kept, frozenset(equal)


def _op_names(module: HloModule) -> set[str]:
    return {i.name for c in module.computations.values() for i in c.instructions}


def _mismatch(d: HloModule, missing: list[str], program_id: int | None) -> HloMismatchError:
    return HloMismatchError(
        f"{d.source} is not the HLO of the profiled {d.name}{f'({program_id})' if program_id is not None else ''}:"
        f" the profile ran {missing[0]!r}{f' and {len(missing) - 1} more ops' if len(missing) > 1 else ''} that it "
        "lacks; pass the --xla_dump_to folder of the profiled run")


def check_dumps(dumps: Sequence[HloModule], events: pd.DataFrame, notes: list[str]) -> list[HloModule]:
    """The dumps that can be the programs the events ran, a dump that cannot refused.

    A dump named for a program id the events ran must hold every ``hlo_op`` those events name. Events without
    program ids (trace JSON) are matched by module name, and XLA dumps one module per compilation (jax compiles
    ``jit_convert_element_type`` once per dtype and shape): of the dumps of that name, the one holding every op
    the events ran is kept and the others dropped (several equal ones: the first). When several different dumps
    hold them all, or none does and each op is in one of them, the events cannot tell which ran: no dump of that
    name is kept, with a note in ``notes``. Dumps of programs the events did not run are kept.

    :raises HloMismatchError: a dump of a profiled program id lacks an op its events ran, or an op that events
        without ids ran is in no dump of their module's name (naming the first such op).
    """
    if not dumps or events.empty:
        return list(dumps)
    ops = events[["program_id", "module", "hlo_op"]].drop_duplicates()
    ops = ops.assign(pid=ops["program_id"].astype("Int64"), module=ops["module"].astype(str),
                     hlo_op=ops["hlo_op"].astype(str))
    no_id = ops["pid"].isna().to_numpy()
    by_name: dict[str, list[HloModule]] = {}  # dumps told apart by the ops of events without ids
    for d in dumps:
        named = (ops["module"] == d.name).to_numpy()
        mine = ops[named & (ops["pid"] == d.program_id).to_numpy(dtype=bool, na_value=False)] \
            if d.program_id is not None else ops.iloc[:0]
        if not mine.empty:
            missing = sorted(set(mine["hlo_op"]) - _op_names(d))
            if missing:
                raise _mismatch(d, missing, d.program_id)
        elif (named & no_id).any():
            by_name.setdefault(d.name, []).append(d)
    dropped: set[int] = set()
    for name, candidates in by_name.items():
        ran = set(ops.loc[(ops["module"] == name).to_numpy() & no_id, "hlo_op"])
        holders = [d for d in candidates if ran <= _op_names(d)]
        if len(holders) == 1 or holders and len({fingerprint(d)[0] for d in holders}) == 1:
            dropped |= {id(d) for d in candidates if d is not holders[0]}
            continue
        if not holders:
            missing = sorted(ran - set().union(*map(_op_names, candidates)))
            if missing:
                if len(candidates) == 1:
                    raise _mismatch(candidates[0], missing, None)
                more = f" and {len(missing) - 1} more ops" if len(missing) > 1 else ""
                raise HloMismatchError(
                    f"none of the {len(candidates)} dumps of {name} (such as {candidates[0].source}) is the HLO the "
                    f"profile ran: it ran {missing[0]!r}{more} that none holds; pass the --xla_dump_to folder of the "
                    "profiled run")
        dropped |= {id(d) for d in candidates}
        which = holders or candidates
        differ = len({fingerprint(d)[0] for d in which})
        notes.append(
            f"{len(which)} dumps of {name} ({differ} different programs) hold "
            f"{'every op its events ran' if holders else 'the ops its events ran only between them'} "
            f"({', '.join(storage.name(d.source) for d in which[:3])}{' ...' if len(which) > 3 else ''}) and the "
            "events carry no program ids to tell which ran: none is used (the .xplane.pb of the same capture "
            "carries the ids)")
    return [d for d in dumps if id(d) not in dropped]
