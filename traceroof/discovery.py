"""Find what to read: resolve user paths (profile files, run directories, TensorBoard logdirs, folders with HLO
dumps) to the profile files of one capture and the HLO files beside them (:class:`Inputs`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Sequence

from parsers import storage
from parsers.errors import InputError
from parsers.storage import Location
from parsers.xprof_export import is_hlo_stats
from traceroof.hlo_source import hlo_files

XPLANE_SUFFIXES = (".xplane.pb", ".xspace.pb", ".xplane.pb.gz")
TRACE_JSON_SUFFIXES = (".trace.json.gz", ".trace.json", "perfetto_trace.json.gz", ".json.gz", ".json")
RUN_TRACE_JSON_SUFFIXES = (".trace.json.gz", ".trace.json", "perfetto_trace.json.gz")
RUN_NAME_FORMAT = "%Y_%m_%d_%H_%M_%S"  # JAX's run directory names (the time the trace stopped, to the second)
NEARBY_RUN_S = 10  # hosts whose traces stopped this many seconds apart land in different run directories


@dataclass(frozen=True)
class Inputs:
    """Files an analysis reads: profile files of one kind (``xplane`` or ``trace_json``) and HLO text files.
    Each is a :class:`Path` (local) or a URL string (object storage, see :mod:`parsers.storage`)."""

    profiles: tuple[Location, ...]
    kind: str
    hlo_files: tuple[Location, ...]
    description: str
    hlo_proto_files: tuple[Location, ...] = ()
    user_hlo_files: tuple[Location, ...] = ()
    nearby_runs: tuple[Location, ...] = ()  # runs of a logdir written within NEARBY_RUN_S of the one chosen
    other_runs: tuple[Location, ...] = ()  # the logdir's other runs holding profiles, not analyzed


def _is_xplane(p: Location) -> bool:
    return storage.name(p).endswith(XPLANE_SUFFIXES)


def _is_trace_json(p: Location) -> bool:
    return storage.name(p).endswith(TRACE_JSON_SUFFIXES)


def _run_dirs(root: Location) -> list[Location]:
    return storage.listing(storage.join(root, "plugins", "profile"))[1]


def _profiles_in_run(files: list[Location]) -> tuple[list[Location], str]:
    xplanes = [p for p in files if _is_xplane(p)]
    if xplanes:
        return xplanes, "xplane"
    return [p for p in files if storage.name(p).endswith(RUN_TRACE_JSON_SUFFIXES)], "trace_json"


def _run_time(run: Location) -> datetime | None:
    try:
        return datetime.strptime(storage.name(run), RUN_NAME_FORMAT)
    except ValueError:
        return None


def _nearby_runs(run: Location, runs: list[Location]) -> list[Location]:
    """The other runs beside ``run`` named (JAX's ``%Y_%m_%d_%H_%M_%S``) within :data:`NEARBY_RUN_S` of it that
    hold profile files: a capture whose hosts stopped their traces in different seconds is split over them."""
    at = _run_time(run)
    if at is None:
        return []
    near = [r for r in runs if r != run and (t := _run_time(r)) is not None
            and abs((t - at).total_seconds()) <= NEARBY_RUN_S]
    return [r for r in sorted(near, key=storage.name) if _profiles_in_run(storage.listing(r)[0])[0]]


def _sidecars(profiles: list[Location], folders: list[Location]) -> list[Location]:
    """``*.hlo_proto.pb`` files beside the profiles and under the folders given."""
    found = {f for d in dict.fromkeys(storage.parent(p) for p in profiles)
             for f in storage.listing(d)[0] if storage.name(f).endswith(".hlo_proto.pb")}
    found |= {f for d in folders for f, _ in storage.walk(d, "*.hlo_proto.pb")}
    return sorted(found, key=str)


def discover(paths: Sequence[str | Path], hlo: Sequence[str | Path] = ()) -> Inputs:
    """Resolve user paths (local, or URLs such as ``gs://bucket/logdir``: :mod:`parsers.storage`) to the profile
    and HLO files to read.

    :raises InputError: a path does not exist, holds no profile traceroof can read, or cannot be reached (a
        URL: missing extra, permission, network).
    """
    profiles: list[Location] = []
    kinds: set[str] = set()
    found_hlo: list[Location] = []
    described: list[Location] = []
    folders: list[Location] = []
    nearby: list[Location] = []
    others: list[Location] = []
    if not paths:
        raise InputError("no input given: pass a .xplane.pb, a run directory or a TensorBoard logdir")
    for raw in paths:
        p = storage.location(raw)
        if not storage.exists(p):
            raise InputError(f"{p} does not exist; pass a .xplane.pb, a run directory or a TensorBoard logdir")
        if storage.is_file(p):
            name = storage.name(p)
            if is_hlo_stats(name) and name.endswith((".json", ".json.gz", ".csv", ".csv.gz")):
                if storage.is_url(p):
                    raise InputError(f"{p}: XProf exports are read from local disk only; copy it to a local folder "
                                     "(with the overview and roofline exports beside it) and pass that path")
                profiles.append(p)
                kinds.add("xprof_hlo_stats")
            elif _is_xplane(p):
                profiles.append(p)
                kinds.add("xplane")
            elif _is_trace_json(p):
                profiles.append(p)
                kinds.add("trace_json")
            else:
                raise InputError(f"{p}: unknown input format; expected .xplane.pb, .trace.json.gz or a directory")
            described.append(p)
            continue
        files, subdirs = storage.listing(p)
        found, kind = _profiles_in_run(files)
        run = p
        if not found:
            stats = sorted((f for f in files if is_hlo_stats(storage.name(f))),
                           key=lambda f: ("op_profile" in storage.name(f), storage.name(f)))  # HLO Op Stats first
            if stats and storage.is_url(p):
                raise InputError(f"{p}: XProf exports are read from local disk only; copy the folder to a local "
                                 "disk and pass that path")
            if stats:
                found, kind = stats[:1], "xprof_hlo_stats"
        if not found:
            # a logdir's runs (<logdir>/plugins/profile/<run>), else the folder's own subfolders (the folder given is
            # plugins/profile itself); the latest that holds profiles is read
            runs = [r for root in (p, *subdirs) for r in _run_dirs(root)] or list(subdirs)
            for r in sorted(runs, key=storage.name, reverse=True):
                found, kind = _profiles_in_run(storage.listing(r)[0])
                if found:
                    run = r
                    near = _nearby_runs(r, runs)
                    nearby += near
                    others += [o for o in sorted(runs, key=storage.name) if o != r and o not in near
                               and _profiles_in_run(storage.listing(o)[0])[0]]
                    break
        if not found:
            raise InputError(f"{p}: no .xplane.pb or trace JSON found (looked in it and in plugins/profile/<run>/); "
                             "pass a profile file, a run directory or a logdir")
        profiles += found
        kinds.add(kind)
        described.append(run)
        folders.append(run)
        found_hlo += hlo_files(p, explicit=False)
    user_files: list[Location] = []
    for h in hlo:
        hp = storage.location(h)
        if not storage.exists(hp):
            raise InputError(f"--hlo {hp} does not exist; pass HLO text files or an --xla_dump_to folder")
        files = hlo_files(hp)
        if not files:
            raise InputError(f"--hlo {hp}: no HLO text found (XLA's *after_optimizations.txt dumps, or files "
                             "starting with HloModule); pass an --xla_dump_to folder written with "
                             "--xla_dump_hlo_as_text")
        found_hlo += files
        user_files += files
    if len(kinds) > 1:
        raise InputError("mixing .xplane.pb and trace JSON inputs is not supported; pass one kind")
    return Inputs(tuple(dict.fromkeys(profiles)), kinds.pop(), tuple(dict.fromkeys(found_hlo)),
                  ", ".join(map(str, described)), tuple(_sidecars(profiles, folders)), tuple(user_files),
                  tuple(r for r in dict.fromkeys(nearby) if r not in described),
                  tuple(r for r in dict.fromkeys(others) if r not in described))
