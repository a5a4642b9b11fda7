"""Find what to read: resolve user paths (profile files, run directories, TensorBoard logdirs, folders with HLO
dumps) to the profile files of one capture and the HLO files beside them (:class:`Inputs`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from parsers.errors import InputError
from parsers.xprof_export import is_hlo_stats
from traceroof.hlo_source import hlo_files

XPLANE_SUFFIXES = (".xplane.pb", ".xspace.pb", ".xplane.pb.gz")
TRACE_JSON_SUFFIXES = (".trace.json.gz", ".trace.json", "perfetto_trace.json.gz", ".json.gz", ".json")
RUN_TRACE_JSON_SUFFIXES = (".trace.json.gz", ".trace.json", "perfetto_trace.json.gz")


@dataclass(frozen=True)
class Inputs:
    """Files an analysis reads: profile files of one kind (``xplane`` or ``trace_json``) and HLO text files."""

    profiles: tuple[Path, ...]
    kind: str
    hlo_files: tuple[Path, ...]
    description: str
    hlo_proto_files: tuple[Path, ...] = ()
    user_hlo_files: tuple[Path, ...] = ()


def _is_xplane(p: Path) -> bool:
    return p.name.endswith(XPLANE_SUFFIXES)


def _is_trace_json(p: Path) -> bool:
    return p.name.endswith(TRACE_JSON_SUFFIXES)


def _run_dirs(root: Path) -> list[Path]:
    runs = [d for d in (root / "plugins" / "profile").glob("*") if d.is_dir()]
    return sorted(runs, key=lambda d: d.name)


def _profiles_in_run(run: Path) -> tuple[list[Path], str]:
    xplanes = sorted(p for p in run.iterdir() if p.is_file() and _is_xplane(p))
    if xplanes:
        return xplanes, "xplane"
    jsons = sorted(p for p in run.iterdir() if p.is_file() and p.name.endswith(RUN_TRACE_JSON_SUFFIXES))
    return jsons, "trace_json"


def discover(paths: Sequence[str | Path], hlo: Sequence[str | Path] = ()) -> Inputs:
    """Resolve user paths to the profile and HLO files to read.

    :raises InputError: a path does not exist, or holds no profile traceroof can read.
    """
    profiles: list[Path] = []
    kinds: set[str] = set()
    found_hlo: list[Path] = []
    described = []
    if not paths:
        raise InputError("no input given: pass a .xplane.pb, a run directory or a TensorBoard logdir")
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise InputError(f"{p} does not exist; pass a .xplane.pb, a run directory or a TensorBoard logdir")
        if p.is_file():
            if is_hlo_stats(p) and p.name.endswith((".json", ".json.gz", ".csv", ".csv.gz")):
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
            described.append(str(p))
            continue
        found, kind = _profiles_in_run(p)
        run = p
        if not found:
            stats = sorted((f for f in p.iterdir() if f.is_file() and is_hlo_stats(f)),
                           key=lambda f: ("op_profile" in f.name, f.name))  # HLO Op Stats first
            if stats:
                found, kind = stats[:1], "xprof_hlo_stats"
        if not found:
            roots = [p, *sorted(d for d in p.iterdir() if d.is_dir())]
            runs = [r for root in roots for r in _run_dirs(root)]
            for r in sorted(runs, key=lambda d: d.name, reverse=True):
                found, kind = _profiles_in_run(r)
                if found:
                    run = r
                    break
        if not found:
            raise InputError(f"{p}: no .xplane.pb or trace JSON found (looked in it and in plugins/profile/<run>/); "
                             "pass a profile file, a run directory or a logdir")
        profiles += found
        kinds.add(kind)
        described.append(str(run))
        found_hlo += hlo_files(p, explicit=False)
    for h in hlo:
        hp = Path(h)
        if not hp.exists():
            raise InputError(f"--hlo {hp} does not exist; pass HLO text files or an --xla_dump_to folder")
        files = hlo_files(hp)
        if not files:
            raise InputError(f"--hlo {hp}: no HLO text found (XLA's *after_optimizations.txt dumps, or files starting with HloModule); pass an --xla_dump_to folder written with --xla_dump_hlo_as_text")
        found_hlo += files
    if len(kinds) > 1:
        raise InputError("mixing .xplane.pb and trace JSON inputs is not supported; pass one kind")
    user_files = tuple(f for h in hlo for f in hlo_files(Path(h)))
    sidecars = sorted({f for prof in profiles for f in prof.parent.glob("*.hlo_proto.pb")}
                      | {f for d in described if Path(d).is_dir() for f in Path(d).rglob("*.hlo_proto.pb")})
    return Inputs(tuple(dict.fromkeys(profiles)), kinds.pop(), tuple(dict.fromkeys(found_hlo)),
                  ", ".join(described), tuple(sidecars), user_files)
