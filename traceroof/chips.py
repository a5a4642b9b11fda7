"""Chip database: peak FLOP/s per dtype, HBM, on-chip memories and interconnects, as data files.

Each chip is one TOML file (``traceroof/chips/*.toml``, bundled) whose every figure is a table
``{ value = ..., source = "..." }`` naming its datasheet or paper section. Users add chips by writing the same
kind of file into ``$TRACEROOF_CHIPS_DIR`` (or ``~/.config/traceroof/chips``), or by passing a file path to
``--chip``. ``calibrate`` measures this machine into such a file (``kind = "cpu"``).

Every file is validated on load (:func:`load_chip_file`): peaks, bandwidths and sizes positive and finite, counts
positive integers, dtypes known; a bad file is a :class:`ChipError` naming the file and the key. A bad *user* file
in the chip folders is skipped by :func:`all_chips` (with a note where the caller takes notes: chip detection
adds it to the report's chip note), so it never breaks a command that does not use it; asking for it by name
raises its error. A corrupt calibration cache is measured again (:func:`host_chip`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import tomllib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from parsers.errors import TraceroofError

BUNDLED_DIR = Path(__file__).resolve().parent / "chips"

# HLO element type -> keys of [peak_flops_per_s] to try, in order.
DTYPE_PEAK_KEYS: dict[str, tuple[str, ...]] = {
    "bf16": ("bf16", "f16"),
    "f16": ("f16", "bf16"),
    "f32": ("f32", "tf32", "bf16"),
    "f64": ("f64", "f32", "vector_f32"),
    "s8": ("int8",), "u8": ("int8",),
    "s4": ("int4", "int8"), "u4": ("int4", "int8"),
    "f8e4m3fn": ("fp8",), "f8e5m2": ("fp8",), "f8e4m3fnuz": ("fp8",), "f8e5m2fnuz": ("fp8",),
    "f8e4m3": ("fp8",), "f8e3m4": ("fp8",), "f8e4m3b11fnuz": ("fp8",),
    "f4e2m1fn": ("fp4", "fp8"),
}


KIND_VALUES = ("gpu", "tpu", "cpu")
# keys of [peak_flops_per_s]: the dtypes above plus the f32 matmul precisions and vector work
PEAK_KEYS = frozenset(k for keys in DTYPE_PEAK_KEYS.values() for k in keys) | {"tf32", "fp32", "vector_f32"}
# figures that are counts (positive integers) rather than rates or sizes
COUNT_SUFFIXES = ("_per_node", "_per_chip", "_per_gpu")
# figures that are rates or sizes (positive, finite numbers): every [peak_flops_per_s] value and these suffixes
AMOUNT_SUFFIXES = ("_bytes", "_bytes_per_s", "_flops_per_s")


class ChipError(TraceroofError):
    """An unknown chip name or an invalid chip file."""


@dataclass(frozen=True)
class Figure:
    """One chip figure with the source it was taken from."""

    value: Any
    source: str


@dataclass(frozen=True)
class Chip:
    """A chip's figures. ``figures`` maps ``section.key`` (e.g. ``memory.hbm_bandwidth_bytes_per_s``) to a
    :class:`Figure`; the properties below read the common ones. ``path`` is the file it came from."""

    id: str
    name: str
    vendor: str
    kind: str
    aliases: tuple[str, ...]
    figures: dict[str, Figure] = field(default_factory=dict)
    path: str = ""
    note: str = ""
    detect: dict[str, Any] = field(default_factory=dict)
    calibrated_at: str = ""  # a calibrated host's measurement time (UTC, ISO 8601); "" for datasheet chips
    load_note: str = ""  # a calibrated host's warning that the machine was busy while measured; "" when idle

    def figure(self, key: str) -> Figure | None:
        """The figure at ``section.key`` (value and source), or ``None``."""
        return self.figures.get(key)

    def value(self, key: str, default: Any = None) -> Any:
        """The value of the figure at ``section.key``, or ``default``."""
        f = self.figures.get(key)
        return f.value if f is not None else default

    @property
    def peak_flops_per_s(self) -> dict[str, float]:
        """Dense peak FLOP/s by key (``bf16``, ``f32``, ``fp8``, ``vector_f32`` ...)."""
        return {k.split(".", 1)[1]: float(f.value) for k, f in self.figures.items()
                if k.startswith("peak_flops_per_s.")}

    @property
    def hbm_bandwidth_bytes_per_s(self) -> float | None:
        """HBM (or, for a calibrated host, DRAM) bandwidth in bytes per second; ``None`` when unknown."""
        v = self.value("memory.hbm_bandwidth_bytes_per_s")
        return float(v) if v is not None else None

    def peak_for(self, element_type: str, vector: bool = False, precision: str = "") -> tuple[float | None, str]:
        """Peak FLOP/s for work in ``element_type`` and the key used.

        Matrix work (dot, convolution) uses the dtype's dense matrix-unit peak; ``vector`` work (elementwise,
        reductions) uses ``vector_f32`` where the chip file has it. ``precision`` is an f32 dot's request
        (:func:`traceroof.cost.dot_precision`): see :meth:`f32_matmul_peak`. Returns ``(None, "")`` when no
        figure fits.
        """
        peaks = self.peak_flops_per_s
        if vector and "vector_f32" in peaks:
            return peaks["vector_f32"], "vector_f32"
        if not vector and precision and element_type in ("f32", "c64"):
            found = self.f32_matmul_peak(precision)
            if found[0]:
                return found
        for key in DTYPE_PEAK_KEYS.get(element_type, ("f32", "bf16")):
            if key in peaks:
                return peaks[key], key
        if peaks:
            key = max(peaks, key=lambda k: peaks[k])
            return peaks[key], key
        return None, ""


    def f32_matmul_peak(self, precision: str) -> tuple[float | None, str]:
        """Peak FLOP/s of an f32 dot on this chip given its precision request, and the key named in reports.

        The rule is XLA's GPU GEMM choice (openxla/xla ``xla/service/gpu/matmul_utils.cc``
        ``GetBlasComputationType``): with no algorithm, an f32 dot whose largest ``operand_precision`` is
        DEFAULT or HIGH (``compute_precision <= 1``) runs as TF32 on CUDA devices while TF32 execution is enabled
        (the default, ``tsl::tensor_float_32_execution_enabled``); HIGHEST runs true FP32; ROCm always runs FP32.
        An explicit ``algorithm`` decides by itself (``xla/service/algorithm_util.cc``): ``dot_tf32_tf32_f32`` is
        TF32, ``dot_f32_f32_f32`` FP32, ``dot_bf16_bf16_f32`` bf16, and the ``_x3``/``_x6``/``_x9`` forms run 3,
        6 or 9 passes of the narrower type (the peak divided by the passes). Returns ``(None, "")`` when the chip
        file has no fitting figure (the caller falls back to the dtype's keys). Keys: ``tf32``, ``fp32``,
        ``bf16``, ``bf16_x3`` ...
        """
        peaks = self.peak_flops_per_s
        nvidia = self.kind == "gpu" and self.vendor.lower() == "nvidia"
        if precision == "default":
            if not nvidia:
                return None, ""
            precision = "tf32" if "tf32" in peaks else "fp32"
        elif precision == "highest":
            if not nvidia:
                return None, ""
            precision = "fp32"
        base, _, passes = precision.partition("_x")
        n = int(passes) if passes.isdigit() else 1
        if base == "fp32":
            value = peaks.get("fp32", peaks.get("f32"))
        else:
            value = peaks.get(base)
        if not value:
            return None, ""
        return value / n, precision


def per_device_chip(chip: Chip) -> tuple[Chip, str]:
    """The chip's figures per JAX device: TPU v2 and v3 chips hold two TensorCores with separate memories, each
    its own device (``compute.devices_per_chip``; How to Scale Your Model §2, §9), so a profiled device has half
    the chip's peak FLOP/s, HBM bandwidth and HBM. Interconnect figures stay per chip. Chips with one device per
    chip (megacore v4/v5p, v5e, v6e, GPUs) come back unchanged with an empty note."""
    n = int(chip.value("compute.devices_per_chip", 1) or 1)
    if n <= 1:
        return chip, ""
    per = ("peak_flops_per_s.", "memory.hbm_bandwidth_bytes_per_s", "memory.hbm_bytes")
    figures = {k: (Figure(float(f.value) / n, f.source + f"; / {n} devices (TensorCores) per chip")
                   if k.startswith(per) else f) for k, f in chip.figures.items()}
    return (dataclasses.replace(chip, figures=figures, name=f"{chip.name} (per TensorCore)"),
            f"each {chip.name} device is one of its {n} TensorCores: peak FLOP/s and HBM bandwidth / {n}")


def xdg_dir(variable: str, default: str) -> Path:
    """An XDG base directory: ``$variable`` when it is set to an absolute path, else ``~/default``. An empty or
    relative value is ignored, as the XDG Base Directory Specification asks ("If an implementation encounters a
    relative path in any of these variables it should consider the path invalid and ignore it"), so that
    ``XDG_CACHE_HOME=""`` never makes traceroof write into the working directory."""
    value = os.environ.get(variable, "")
    return Path(value) if value and os.path.isabs(value) else Path.home() / default


def _user_dirs() -> list[Path]:
    dirs = []
    env = os.environ.get("TRACEROOF_CHIPS_DIR")
    if env:
        dirs.append(Path(env))
    dirs.append(xdg_dir("XDG_CONFIG_HOME", ".config") / "traceroof" / "chips")
    return dirs


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _figure_problem(section: str, key: str, value: Any) -> str:
    """Why a figure's value cannot be used, or ``""``: peaks, bandwidths and sizes must be positive finite
    numbers, counts positive integers, ``[peak_flops_per_s]`` keys known dtypes."""
    if section == "peak_flops_per_s" and key not in PEAK_KEYS:
        return f"is not a known dtype (known: {', '.join(sorted(PEAK_KEYS))})"
    if key.endswith(COUNT_SUFFIXES):
        if not (_is_number(value) and math.isfinite(value) and value >= 1 and value == int(value)):
            return f"is {value!r}; expected a positive integer"
    elif section == "peak_flops_per_s" or key.endswith(AMOUNT_SUFFIXES):
        if not (_is_number(value) and math.isfinite(value) and value > 0):
            return f"is {value!r}; expected a positive finite number"
    elif not isinstance(value, (str, int, float, bool)):
        return f"is a {type(value).__name__}; expected a number or a string"
    return ""


_DETECT_TYPES: dict[str, tuple[str, Any]] = {
    "device_type": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "compute_capability": ("a list of strings like \"9.0\"",
                           lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "vendor": ("a string", lambda v: isinstance(v, str)),
    "memory_bytes_min": ("a positive number", lambda v: _is_number(v) and math.isfinite(v) and v > 0),
    "memory_bytes_max": ("a positive number", lambda v: _is_number(v) and math.isfinite(v) and v > 0),
}


def load_chip_file(path: str | Path) -> Chip:
    """Read and validate one chip TOML file.

    Checked on load: UTF-8 TOML; ``name`` a non-empty string; ``vendor``, ``note``, ``calibrated_at``,
    ``load_note`` strings; ``kind`` one of :data:`KIND_VALUES` (or absent); ``aliases`` a list of strings; every
    figure a value (or a ``{ value = ..., source = "..." }`` table) that :func:`_figure_problem` accepts; the
    ``[detect]`` keys of the types :func:`detect_chip` reads.

    :raises ChipError: naming the file and the key: unreadable file, not UTF-8, invalid TOML, a missing or
        mistyped field, a figure without a value, a peak, bandwidth or size that is not a positive finite number,
        a count that is not a positive integer, an unknown dtype.
    """
    p = Path(path)
    try:
        data = tomllib.loads(p.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ChipError(f"cannot read chip file {p}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ChipError(f"chip file {p} is not UTF-8 text (byte {e.start}); write it as UTF-8 TOML") from None
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        raise ChipError(f"chip file {p} is not valid TOML: {' '.join(str(e).split())[:200]}") from None

    def bad(key: str, why: str) -> ChipError:
        return ChipError(f"chip file {p}: {key} {why}; fix or remove the file")

    if "name" not in data:
        raise ChipError(f"chip file {p} has no 'name'")
    if not isinstance(data["name"], str) or not data["name"].strip():
        raise bad("name", "is not a non-empty string")
    for key in ("vendor", "kind", "note", "calibrated_at", "load_note"):
        if key in data and not isinstance(data[key], str):
            raise bad(key, f"is a {type(data[key]).__name__}; expected a string")
    if data.get("kind", "") not in ("", *KIND_VALUES):
        raise bad("kind", f"is {data['kind']!r}; expected one of {', '.join(KIND_VALUES)}")
    aliases = data.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise bad("aliases", "is not a list of strings")
    detect = data.get("detect", {})
    if not isinstance(detect, dict):
        raise bad("detect", "is not a table")
    for key, (what, ok) in _DETECT_TYPES.items():
        if key in detect and not ok(detect[key]):
            raise bad(f"detect.{key}", f"is not {what}")
    figures: dict[str, Figure] = {}
    for section, body in data.items():
        if not isinstance(body, dict) or section == "detect":
            continue
        for key, fig in body.items():
            if isinstance(fig, dict):
                if "value" not in fig:
                    raise ChipError(f"chip file {p}: {section}.{key} has no 'value'")
                if not isinstance(fig.get("source", ""), str):
                    raise bad(f"{section}.{key}.source", "is not a string")
                value, source = fig["value"], fig.get("source", "")
            else:
                value, source = fig, ""
            why = _figure_problem(section, key, value)
            if why:
                raise bad(f"{section}.{key}", why)
            figures[f"{section}.{key}"] = Figure(value, source)
    return Chip(id=p.stem, name=data["name"], vendor=data.get("vendor", ""), kind=data.get("kind", ""),
                aliases=tuple(aliases), figures=figures, path=str(p), note=data.get("note", ""),
                detect=dict(detect), calibrated_at=data.get("calibrated_at", ""), load_note=data.get("load_note", ""))


def all_chips(notes: list[str] | None = None) -> list[Chip]:
    """Bundled chips, then user chips (a user file with a bundled id replaces it), sorted by id.

    A user chip file that does not load (:func:`load_chip_file`) is skipped, so one bad file never breaks
    commands that do not use it; its error is appended to ``notes`` when given (``get_chip`` raises it when the
    file's chip is asked for by name).

    :raises ChipError: a bundled chip file is invalid (a packaging bug).
    """
    chips: dict[str, Chip] = {}
    for d in [BUNDLED_DIR, *_user_dirs()]:
        if d.is_dir():
            for f in sorted(d.glob("*.toml")):
                if d == BUNDLED_DIR:
                    chips[f.stem] = load_chip_file(f)
                    continue
                try:
                    chips[f.stem] = load_chip_file(f)
                except ChipError as e:
                    if notes is not None:
                        notes.append(f"skipped user chip file: {e}")
    return [chips[k] for k in sorted(chips)]


def _norm(s: str) -> str:
    return "".join(ch for ch in s.lower() if ch.isalnum())


def get_chip(name_or_path: str | os.PathLike[str]) -> Chip:
    """A chip by id, name or alias (case and punctuation ignored), or a path (``str`` or ``Path``) to a chip file.

    :raises ChipError: no such chip (an empty name too); the message lists the closest known ids.
    """
    name_or_path = os.fspath(name_or_path)
    if not name_or_path.strip():
        raise ChipError("an empty chip name; pass a chip id (see `traceroof chips`) or a chip .toml file, or leave "
                        "--chip out to detect it")
    p = Path(name_or_path)
    if name_or_path.endswith(".toml") or p.is_file():
        if not p.is_file():
            raise ChipError(f"chip file {p} does not exist")
        return load_chip_file(p)
    want = _norm(name_or_path)
    skipped: list[str] = []
    chips = all_chips(skipped)
    for c in chips:
        if want in {_norm(c.id), _norm(c.name), *(_norm(a) for a in c.aliases)}:
            return c
    for d in _user_dirs():  # a user file of that name that does not load: say why, not "unknown chip"
        for f in sorted(d.glob("*.toml")) if d.is_dir() else ():
            if _norm(f.stem) == want:
                load_chip_file(f)
    import difflib

    close = difflib.get_close_matches(want, [_norm(c.id) for c in chips], n=3, cutoff=0.3)
    ids = [c.id for c in chips if _norm(c.id) in close] or [c.id for c in chips]
    raise ChipError(f"unknown chip {name_or_path!r}; closest known: {', '.join(ids)} "
                    "(see `traceroof chips`, or pass a chip .toml file)"
                    + (f"; {len(skipped)} user chip file(s) skipped: {skipped[0]}" if skipped else ""))


# -- detection from profile plane stats -------------------------------------------------------------------

def _stat(stats: dict[str, Any], key: str) -> float | None:
    """A numeric device-plane stat as a positive finite float; ``None`` when absent or not such a number (a
    profile's stats are input: a garbage value is ignored, never used)."""
    v = stats.get(key)
    try:
        f = float(v) if v is not None and not isinstance(v, (bytes, bytearray)) else None
    except (TypeError, ValueError, OverflowError):
        return None
    return f if f is not None and math.isfinite(f) and f > 0 else None


def _matches(chip: Chip, stats: dict[str, Any]) -> bool:
    d = chip.detect
    if not d:
        return False
    dtype = str(stats.get("device_type_string") or stats.get("device_type") or "")
    if "device_type" in d:
        return bool(dtype) and _norm(dtype) in {_norm(x) for x in d["device_type"]}
    major, minor = _stat(stats, "compute_cap_major"), _stat(stats, "compute_cap_minor") or 0.0
    if major is None or major > 1000 or minor > 1000 or \
            f"{int(major)}.{int(minor)}" not in d.get("compute_capability", []):
        return False
    vendor = stats.get("device_vendor")
    if vendor and d.get("vendor") and _norm(str(vendor)) != _norm(d["vendor"]):
        return False
    mem = _stat(stats, "memory_size")
    if mem:
        if "memory_bytes_min" in d and mem < float(d["memory_bytes_min"]):
            return False
        if "memory_bytes_max" in d and mem > float(d["memory_bytes_max"]):
            return False
    return True


def detect_chip(stats: dict[str, Any]) -> tuple[Chip, str]:
    """The chip a device plane describes, from its stats (``device_vendor``, ``compute_cap_major/minor``,
    ``memory_size`` for GPUs; the device type string for TPUs), using each chip file's ``[detect]`` section.

    Returns the chip and a note comparing what the profile itself claims (HBM bandwidth, peak FLOP/s) with the
    database figures when they differ by more than 5 %.

    :raises ChipError: no chip matches; the message names the closest chips and ``--chip``.
    """
    skipped: list[str] = []
    chips = all_chips(skipped)
    found = [c for c in chips if _matches(c, stats)]
    keys = ("device_vendor", "compute_cap_major", "compute_cap_minor", "core_count", "memory_size",
            "device_type_string")
    described = ", ".join(f"{k}={' '.join(str(stats[k]).split())[:40]}" for k in keys if k in stats)
    if not found:
        major = stats.get("compute_cap_major")
        close = [c.id for c in chips if any(str(cc).split(".")[0] == str(major)
                                             for cc in c.detect.get("compute_capability", []))]
        raise ChipError(f"unknown device ({described or 'no device stats'}); closest known chips: "
                        f"{', '.join(close) or ', '.join(c.id for c in chips if c.kind != 'cpu')}; pass --chip")
    chip = found[0]
    notes = [f"detected from the profile ({described})", *skipped]
    if len(found) > 1:
        notes.append(f"also matches {', '.join(c.id for c in found[1:])}: pass --chip to choose")
    claims = []
    bw = _stat(stats, "memory_bandwidth")
    ours = chip.hbm_bandwidth_bytes_per_s
    if bw and ours and abs(bw / ours - 1) > 0.05:
        claims.append(f"HBM {bw / 1e12:.3g} TB/s (database {ours / 1e12:.3g} TB/s)")
    peak = _stat(stats, "peak_teraflops_per_second")
    if peak:
        best, key = chip.peak_for("bf16")
        if best and abs(peak * 1e12 / best - 1) > 0.05:
            claims.append(f"peak {peak:.4g} TFLOP/s (database {key} {best / 1e12:.4g} TFLOP/s)")
    hbm = _stat(stats, "peak_hbm_bw_gigabytes_per_second")
    if hbm and ours and abs(hbm * 1e9 / ours - 1) > 0.05:
        claims.append(f"HBM {hbm:.4g} GB/s (database {ours / 1e9:.4g} GB/s)")
    if claims:
        notes.append("the profile claims " + "; ".join(claims) + "; the database figures are used")
    return chip, "; ".join(notes)


# -- host calibration -------------------------------------------------------------------------------------

def host_cache_path() -> Path:
    """Where the calibrated host chip file is cached: ``$XDG_CACHE_HOME/traceroof/host.toml``, or
    ``~/.cache/traceroof/host.toml`` when that variable is unset, empty or relative (see :func:`xdg_dir`)."""
    return xdg_dir("XDG_CACHE_HOME", ".cache") / "traceroof" / "host.toml"


CALIBRATION_MIN_RUNS = 3  # timed runs per figure at least (the best one counts), however short seconds_per_test
LOADED_BUSY_SHARE = 0.25  # other work using more than this share of the machine's CPU time: a loaded machine
LOAD_SAMPLE_S = 0.25  # how long the CPU-busy share is sampled before and after calibrating


@dataclass(frozen=True)
class Calibration:
    """Measured peaks of this machine: matmul FLOP/s per dtype, vector FLOP/s and memory bandwidth.

    ``runs_per_figure``: timed runs behind each figure (its best counts); ``busy_share_before`` /
    ``busy_share_after``: share of the machine's CPU time (all cores) used by other work in the
    ``LOAD_SAMPLE_S`` before and after measuring (``/proc/stat``; else the 1-minute load average ÷ cores);
    ``busy_share_during``: the same while measuring (the machine's busy time less this process's own CPU time;
    NaN without ``/proc/stat``); ``load_note``: a sentence saying the machine was loaded (figures may be low),
    empty when it was idle.
    """

    matmul_flops_per_s: dict[str, float]
    vector_flops_per_s: float
    memory_bandwidth_bytes_per_s: float
    cpu: str
    threads: int
    measured_at: str
    engine: str = ""
    runs_per_figure: dict[str, int] = field(default_factory=dict)
    busy_share_before: float = float("nan")
    busy_share_after: float = float("nan")
    load_note: str = ""
    busy_share_during: float = float("nan")


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) CPU time of the whole machine in clock ticks from ``/proc/stat`` (Linux), or ``None``.
    Idle time is the ``idle`` and ``iowait`` columns (proc(5))."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    total = sum(fields[:8])
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return total - idle, total


def cpu_busy_share(window_s: float = LOAD_SAMPLE_S) -> float:
    """Share (0..1) of the machine's CPU time in use over the next ``window_s`` seconds, while this process
    sleeps (so: other work). Without ``/proc/stat``, the 1-minute load average ÷ CPU count (capped at 1); NaN
    when neither is available."""
    a = _cpu_times()
    if a is None:
        try:
            return min(os.getloadavg()[0] / (os.cpu_count() or 1), 1.0)
        except (OSError, AttributeError):
            return float("nan")
    time.sleep(window_s)
    b = _cpu_times()
    if b is None or b[1] <= a[1]:
        return float("nan")
    return max(0.0, min((b[0] - a[0]) / (b[1] - a[1]), 1.0))


class OtherWork:
    """Measures the share (0..1) of the machine's CPU time that other processes used from its construction to
    :meth:`share`, while this process works too: the machine's busy time (``/proc/stat``, clock ticks of
    ``SC_CLK_TCK``) less this process's own CPU time (``os.times()``: every thread, XLA's included). NaN without
    ``/proc/stat``. (A calibration whose own threads kept every core busy is not a loaded machine; another
    process sharing the cores is, and the before/after samples miss work that ran only while measuring: the s36
    trial's cached calibration read f32 matmuls a third low with no warning.)"""

    def __init__(self) -> None:
        self._machine, self._own_s = _cpu_times(), _own_cpu_s()

    def share(self) -> float:
        """Other work's share of the machine's CPU time since construction (NaN when unknown)."""
        now = _cpu_times()
        if self._machine is None or now is None or now[1] <= self._machine[1]:
            return float("nan")
        tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        other_s = (now[0] - self._machine[0]) * tick_s - (_own_cpu_s() - self._own_s)
        return max(0.0, min(other_s / ((now[1] - self._machine[1]) * tick_s), 1.0))


def _own_cpu_s() -> float:
    """User + system CPU seconds of this process (all its threads)."""
    t = os.times()
    return t.user + t.system


def load_note(busy_before: float, busy_after: float, busy_during: float = float("nan")) -> str:
    """The chip-note sentence for a calibration measured while other work used more than ``LOADED_BUSY_SHARE``
    of the CPU (before, during or after it); empty otherwise."""
    if not max(busy_before, busy_after, busy_during, 0.0) > LOADED_BUSY_SHARE:  # NaN-safe: unknown is no warning
        return ""
    try:
        avg = f"; load average {os.getloadavg()[0]:.2f} on {os.cpu_count() or 1} CPUs"
    except (OSError, AttributeError):
        avg = ""
    during = f"{busy_during:.0%} while measuring, " if busy_during == busy_during else ""
    return (f"the machine was loaded while calibrating ({busy_before:.0%} of CPU busy with other work before, "
            f"{during}{busy_after:.0%} after{avg}): the figures may be low; run `traceroof calibrate` again on an "
            "idle machine")


def calibrate(seconds_per_test: float = 0.5, matmul_n: int = 1024, copy_bytes: int = 1 << 28,
              min_runs: int = CALIBRATION_MIN_RUNS) -> Calibration:
    """Measure this machine: square matmul FLOP/s (2·n³ per matmul) per dtype, vector FLOP/s of a fused
    elementwise chain on a cache-resident array (2 FLOPs per multiply-add), and DRAM bandwidth from a large array
    copy (read + write bytes). Each figure is the best of at least ``min_runs`` timed runs (after one untimed
    warm-up run), more while ``seconds_per_test`` lasts.

    With JAX installed the matmuls and the vector chain run on XLA:CPU (what a CPU profile ran on; f32 and
    bf16); otherwise numpy runs them (f32 and f64, vector rate of numpy's in-cache add). The figures are a
    practical roof for this machine under its current load, not a datasheet: the CPU-busy share of other work
    is sampled before and after (:func:`cpu_busy_share`) and during (:class:`OtherWork`), and a loaded machine
    is named in ``load_note``.
    """
    import platform

    import numpy as np

    runs: dict[str, int] = {}

    def best(name: str, fn: Any) -> float:
        fn()
        t_best, n, deadline = float("inf"), 0, time.perf_counter() + seconds_per_test
        while n < min_runs or time.perf_counter() < deadline:
            t0 = time.perf_counter()
            fn()
            t_best = min(t_best, time.perf_counter() - t0)
            n += 1
        runs[name] = n
        return max(t_best, 1e-9)  # a clock that saw no time: never a division by zero

    busy_before = cpu_busy_share()
    other = OtherWork()
    matmul: dict[str, float] = {}
    try:
        import jax
        import jax.numpy as jnp

        cpu0 = jax.devices("cpu")[0]
        for key, dt in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
            a = jax.device_put(jnp.ones((matmul_n, matmul_n), dt), cpu0)
            mm = jax.jit(lambda a: a @ a)
            matmul[key] = 2 * matmul_n**3 / best(key, lambda mm=mm, a=a: mm(a).block_until_ready())
        chain = 32

        def fma_chain(x: Any) -> Any:
            for _ in range(chain):
                x = x * 1.0001 + 0.5
            return x

        x = jax.device_put(jnp.ones(1 << 16, jnp.float32), cpu0)
        f = jax.jit(fma_chain)
        vec = 2 * chain * x.size / best("vector_f32", lambda: f(x).block_until_ready())
        engine = f"XLA:CPU (jax {jax.__version__})"
    except ImportError:
        for key, np_dtype in (("f32", "float32"), ("f64", "float64")):
            a = np.random.default_rng(0).standard_normal((matmul_n, matmul_n)).astype(np_dtype)
            matmul[key] = 2 * matmul_n**3 / best(key, lambda a=a: a @ a)
        xs = np.ones(1 << 14, np.float32)
        ys = np.empty_like(xs)
        vec = xs.size / best("vector_f32", lambda: np.add(xs, xs, out=ys))
        engine = f"numpy {np.__version__}"
    n = copy_bytes // 8
    src = np.ones(n, np.float64)
    dst = np.empty_like(src)
    bw = 2 * src.nbytes / best("memory", lambda: np.copyto(dst, src))
    src = dst = np.zeros(0)  # release the copy buffers before the rest
    busy_during = other.share()
    busy_after = cpu_busy_share()
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return Calibration(matmul, vec, bw, cpu, os.cpu_count() or 1,
                       datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), engine, runs, busy_before,
                       busy_after, load_note(busy_before, busy_after, busy_during), busy_during)


def _toml_str(text: str) -> str:
    """A TOML basic string of ``text`` (quotes and backslashes escaped)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def calibration_toml(cal: Calibration, name: str = "calibrated host") -> str:
    """A chip file for a calibration (the same format as the bundled chips), with ``calibrated_at`` (UTC) and,
    when the machine was loaded, ``load_note`` (also appended to ``note``)."""
    src = f"traceroof calibrate on {cal.cpu}, {cal.threads} threads, {cal.engine}, {cal.measured_at}"
    note = f"measured, not a datasheet: {src}" + (f"; {cal.load_note}" if cal.load_note else "")

    def runs(key: str) -> str:
        n = cal.runs_per_figure.get(key)
        return f"best of {n} runs" if n else "best of runs"

    lines = [
        f"name = {_toml_str(name)}", 'vendor = "host"', 'kind = "cpu"', 'aliases = ["host"]',
        f"note = {_toml_str(note)}", f"calibrated_at = {_toml_str(cal.measured_at)}",
    ]
    if cal.load_note:
        lines.append(f"load_note = {_toml_str(cal.load_note)}")
    lines += ["", "[peak_flops_per_s]"]
    for k, v in sorted(cal.matmul_flops_per_s.items()):
        lines.append(f"{k} = {{ value = {v:.4e}, source = {_toml_str(f'{src}: {k} square matmul, {runs(k)}')} }}")
    vector_src = f"{src}: f32 elementwise multiply-add chain in cache, {runs('vector_f32')}"
    memory_src = f"{src}: DRAM bandwidth from an array copy (read + write), {runs('memory')}"
    lines += [f"vector_f32 = {{ value = {cal.vector_flops_per_s:.4e}, source = {_toml_str(vector_src)} }}",
              "", "[memory]",
              f"hbm_bandwidth_bytes_per_s = {{ value = {cal.memory_bandwidth_bytes_per_s:.4e}, "
              f"source = {_toml_str(memory_src)} }}", ""]
    return "\n".join(lines)


CALIBRATION_DRIFT = 1.25
"""A figure that moved by more than this factor between two calibrations of one machine is named
(:func:`calibration_drift`): on a shared or throttled CPU the best of several runs still moved 2x between
calibrations (f32 matmul 95.2 and 199.9 GFLOP/s on one 2-core VM), and MFU and roofline times move with it."""


def calibration_drift(previous: Chip, cal: Calibration) -> list[str]:
    """One sentence per figure of a new calibration ``cal`` that differs from the ``previous`` calibration's (a
    chip file of :func:`calibration_toml`) by more than :data:`CALIBRATION_DRIFT` either way, saying what moves
    with it and how to keep reports comparable; none when every figure held."""
    new = {f"peak_flops_per_s.{k}": v for k, v in cal.matmul_flops_per_s.items()}
    new["peak_flops_per_s.vector_f32"] = cal.vector_flops_per_s
    new["memory.hbm_bandwidth_bytes_per_s"] = cal.memory_bandwidth_bytes_per_s
    when = f" ({previous.calibrated_at})" if previous.calibrated_at else ""
    out = []
    for key, value in new.items():
        old = previous.value(key)
        if not isinstance(old, (int, float)) or not old > 0 or not value > 0:
            continue
        ratio = value / old
        if max(ratio, 1 / ratio) > CALIBRATION_DRIFT:
            unit = "B/s" if key.startswith("memory.") else "FLOP/s"
            what = key.split(".", 1)[1].replace("hbm_bandwidth_bytes_per_s", "memory bandwidth")
            out.append(f"{what}: {value / 1e9:,.1f} G{unit} now, {ratio:.2f}x the {old / 1e9:,.1f} G{unit} of the "
                       f"previous calibration{when}: this machine's speed varies between runs (a shared or "
                       "throttled CPU), and MFU and roofline times move with it; to compare reports, judge them "
                       "against one chip file (traceroof calibrate -o FILE, then --chip FILE)")
    return out


def host_chip(recalibrate: bool = False) -> Chip:
    """The calibrated host chip: read from the cache, measured (and cached) when absent, asked, or when the cached
    file does not load (a corrupt or hand-edited cache is a cache miss, measured again and replaced). A cached
    calibration taken on a loaded machine (its ``load_note``) is measured again when the machine is idle now
    (other work under ``LOADED_BUSY_SHARE`` of the CPU over ``LOAD_SAMPLE_S``), else kept with its note. The cache
    is written atomically (a temporary file renamed over it), so an interrupted write never leaves a torn file.

    :raises ChipError: the cache cannot be written (its folder says where).
    """
    path = host_cache_path()
    if not recalibrate and path.is_file():
        try:
            cached = load_chip_file(path)
            if not cached.load_note or not cpu_busy_share() < LOADED_BUSY_SHARE:  # NaN: unknown, kept
                return cached
        except ChipError:
            pass  # re-measured below
    text = calibration_toml(calibrate())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise ChipError(f"cannot write the calibration cache {path}: {e.strerror}; set XDG_CACHE_HOME to a "
                        "writable folder or pass --chip") from None
    return load_chip_file(path)
