"""Memory view: per program and device, the peak memory, what it holds, the largest live buffers, headroom on
the chip's HBM, the book's memory model beside it, and the allocator's own figures when the profile has them.

Sources, best first:

* **XLA's buffer assignment** (``-buffer-assignment.txt`` beside the program's after-optimization dump, read by
  :mod:`parsers.buffer_assignment`): the peak is the sum of the program's allocations in the device memory
  space (color 0), which is the total of XLA's memory-usage report and what the runtime reserves for one
  execution: entry parameters, outputs, constants, and the preallocated temporaries packed by XLA's heap
  simulator.
* **traceroof's live ranges** when the dump has no buffer assignment: :mod:`traceroof.liveranges`.

Categories (they add up to the peak): ``parameters`` (model weights among the entry parameters),
``optimizer_state`` (entry parameters only optimizer ops read: Adam's moments, the step count), ``inputs`` (the
other entry parameters: the batch), ``gradients`` and ``activations`` (temporaries: values defined by backward
ops with the shape of a parameter are gradients, the rest activations and scratch; XLA's packed temporary block
is split in the proportion of those values live at XLA's peak), ``outputs`` (results not aliased to a parameter:
new weights when the state is not donated, the loss) and ``other`` (constants, thread-local scratch). An entry
parameter's category follows the phases (:mod:`traceroof.scopes`) of the instructions that read it.

The book's model (How to Scale Your Model, part 5 "How to Parallelize a Transformer for Training", §5.1.1: per
device, parameters + optimizer state + gradients + activations; part 4 §4.3.2 on rematerialisation) is filled
from this program: parameters and optimizer state as held (per device: the partitioned HLO's shapes already
carry the sharding), gradients as one copy of the parameters, activations as the values the forward pass
leaves for the backward pass (defined by forward or remat ops, read by backward ops). The difference from the
peak is what the model leaves out: the batch, outputs written beside the donated state, backward temporaries
beyond the saved activations, and gradients XLA never materialises all at once.

Allocator events (``MemoryAllocation`` / ``MemoryDeallocation`` on the ``/host:CPU`` plane, written by the GPU
BFC allocators, XProf's memory-profile source) give each allocator's bytes in use and its peak during the
trace; the view reports them per allocator and the device allocators' peak beside XLA's figure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Mapping

import pandas as pd

from parsers.buffer_assignment import (BufferAssignment, LiveRange, read_buffer_assignment, read_live_range,
                                       read_memory_usage_report, report_files)
from parsers.dump_folder import dump_file_kind
from parsers.errors import TraceroofError
from parsers.hlo import Computation, HloModule, Instruction
from traceroof.liveranges import data_bytes, live_range_peak, own_bytes
from traceroof.scopes import ModuleScopes, _alias_outputs, assign_scopes

CATEGORIES = ("parameters", "optimizer_state", "inputs", "gradients", "activations", "outputs", "other")
TOP_BUFFERS = 8
_MODEL_PHASES = {"forward", "backward", "remat"}
_OPT_NAME = re.compile(r"opt_state|optimizer|\.(mu|nu|count)\b|momentum|exp_avg", re.I)
_PARAM_NAME = re.compile(r"param|weight|kernel|bias|scale|embedding", re.I)
SCALING_BOOK = ("How to Scale Your Model (Austin et al., Google DeepMind 2025), part 5 §5.1.1: per-device memory "
                "= parameters + optimizer state + gradients + activations; part 4 §4.3.2: remat keeps fewer "
                "activations for one more forward")


@dataclass(frozen=True)
class Buffer:
    """One buffer live at the peak: the instruction defining it, its opcode, layer (scope), phase, shape and
    bytes, and its category."""

    name: str
    opcode: str
    layer: str
    phase: str
    shape: str
    size_bytes: int
    category: str


@dataclass(frozen=True)
class BookModel:
    """The book's per-device memory model for this program (see the module docstring): bytes per term, their
    sum, and the lines explaining the difference from the peak."""

    parameters_bytes: int
    optimizer_state_bytes: int
    gradients_bytes: int
    activations_bytes: int
    explanation: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.parameters_bytes + self.optimizer_state_bytes + self.gradients_bytes + self.activations_bytes


@dataclass(frozen=True)
class ProgramMemory:
    """One program's memory on one device (every device of an SPMD program holds the same).

    ``source``: ``xla_buffer_assignment`` or ``traceroof_live_ranges``; ``categories`` add up to
    ``peak_bytes``; ``xla_report_total_bytes`` is XLA's memory-usage report total (``None`` without one);
    ``live_range_peak_bytes`` traceroof's own sequential estimate (always computed, for comparison);
    ``xla_live_range_peak_bytes`` the sum of values XLA lists at its live-range peak (no packing)."""

    program: str
    program_id: int | None
    devices: int
    source: str
    peak_bytes: int
    categories: dict[str, int]
    largest: tuple[Buffer, ...]
    book: BookModel
    xla_report_total_bytes: int | None = None
    live_range_peak_bytes: int = 0
    xla_live_range_peak_bytes: int | None = None
    files: tuple[str, ...] = ()


@dataclass(frozen=True)
class AllocatorPeak:
    """One allocator's figures from the profile's allocator events: its name (``GPU_0_bfc``), the most bytes in
    use seen during the trace, its own ``peak_bytes_in_use`` (since the process started) and its limit (bytes in
    use + available) in bytes."""

    allocator: str
    max_in_use_bytes: int
    peak_in_use_bytes: int
    limit_bytes: int
    events: int


@dataclass(frozen=True)
class MemoryView:
    """The memory section: every program's memory, the peak per device (the largest program's peak), its
    source, category split, headroom against the chip's HBM and allocator figures."""

    programs: tuple[ProgramMemory, ...]
    hbm_bytes: float | None
    allocators: tuple[AllocatorPeak, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def peak(self) -> ProgramMemory | None:
        """The program with the largest peak."""
        return max(self.programs, key=lambda p: p.peak_bytes, default=None)

    @property
    def peak_bytes_per_device(self) -> int | None:
        p = self.peak
        return p.peak_bytes if p is not None else None

    @property
    def headroom_bytes(self) -> float | None:
        """HBM left at the peak (negative: does not fit), ``None`` when the chip's HBM is unknown."""
        p = self.peak_bytes_per_device
        return self.hbm_bytes - p if self.hbm_bytes and p is not None else None

    def to_json(self) -> dict:
        """The JSON ``memory`` object (bytes as integers)."""
        p = self.peak
        return {
            "peak_bytes_per_device": self.peak_bytes_per_device,
            "source": p.source if p else "none",
            "program": p.program if p else None,
            "categories": dict(p.categories) if p else {},
            "hbm_bytes": self.hbm_bytes,
            "headroom_bytes": self.headroom_bytes,
            "programs": [{
                "program": q.program, "program_id": q.program_id, "devices": q.devices, "source": q.source,
                "peak_bytes": q.peak_bytes, "categories": dict(q.categories),
                "xla_report_total_bytes": q.xla_report_total_bytes,
                "live_range_peak_bytes": q.live_range_peak_bytes,
                "xla_live_range_peak_bytes": q.xla_live_range_peak_bytes,
                "largest_buffers": [vars(b) for b in q.largest],
                "book_model": {"parameters_bytes": q.book.parameters_bytes,
                               "optimizer_state_bytes": q.book.optimizer_state_bytes,
                               "gradients_bytes": q.book.gradients_bytes,
                               "activations_bytes": q.book.activations_bytes,
                               "total_bytes": q.book.total_bytes, "explanation": list(q.book.explanation),
                               "source": SCALING_BOOK},
                "files": list(q.files),
            } for q in self.programs],
            "allocators": [vars(a) for a in self.allocators],
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------------------------------------------
# entry parameters and values: categories
# --------------------------------------------------------------------------------------------------------------

def _users(comp: Computation) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = {}
    for inst in comp.instructions:
        for op in inst.operands:
            users.setdefault(op, []).append(inst)
    return users


def parameter_categories(module: HloModule, scopes: ModuleScopes) -> dict[int, str]:
    """Entry parameter number -> ``parameters`` / ``optimizer_state`` / ``inputs`` (see the module docstring):
    read only by optimizer ops -> optimizer state; read by model ops and by the optimizer (the update reads the
    old weight), aliased to an output, or named like a weight -> parameters; else inputs. A program without
    backward ops (inference) holds parameters and inputs only."""
    entry = module.entry
    users = _users(entry)
    training = any(i.phase == "backward" for i in scopes.infos.values())
    aliased = set(_alias_outputs(module).values())
    out: dict[int, str] = {}
    for n, p in entry.parameters().items():
        phases: set[str] = set()
        stack, seen = list(users.get(p.name, ())), set()
        while stack:  # through copies and bitcasts to the ops that compute with the value
            u = stack.pop()
            if u.name in seen:
                continue
            seen.add(u.name)
            if u.opcode in ("copy", "bitcast") and users.get(u.name):
                stack.extend(users[u.name])
            else:
                phases.add(scopes.get(u.name).phase)
        named = p.metadata.op_name or p.name
        if not training:
            out[n] = "parameters" if (_PARAM_NAME.search(named) or n in aliased) else "inputs"
        elif _OPT_NAME.search(named) or (phases and not phases & _MODEL_PHASES):
            out[n] = "optimizer_state"
        elif "optimizer" in phases or n in aliased or _PARAM_NAME.search(named):
            out[n] = "parameters"
        else:
            out[n] = "inputs"
    return out


def _param_shapes(module: HloModule, cats: Mapping[int, str]) -> set[tuple[str, tuple[int, ...]]]:
    return {(p.shape.element_type, p.shape.dims) for n, p in module.entry.parameters().items()
            if cats.get(n) == "parameters" and not p.shape.is_tuple}


def _value_category(inst: Instruction | None, scopes: ModuleScopes, param_shapes: set) -> str:
    """``gradients`` for a backward value shaped like a parameter, else ``activations``."""
    if inst is None:
        return "activations"
    if scopes.get(inst.name).phase == "backward" and (inst.shape.element_type, inst.shape.dims) in param_shapes:
        return "gradients"
    return "activations"


# --------------------------------------------------------------------------------------------------------------
# traceroof's sequential live-range model
# --------------------------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------------------------
# one program
# --------------------------------------------------------------------------------------------------------------

def _saved_activations(module: HloModule, scopes: ModuleScopes) -> int:
    """Bytes of entry values defined by forward / remat ops and read by backward ops (the book's activations)."""
    entry = module.entry
    users = _users(entry)
    total = 0
    for inst in entry.instructions:
        if inst.opcode in ("parameter", "constant") or scopes.get(inst.name).phase not in ("forward", "remat"):
            continue
        readers = list(users.get(inst.name, ()))
        seen: set[str] = set()
        backward = False
        while readers and not backward:  # through gte / bitcast / tuple plumbing to the reading ops
            u = readers.pop()
            if u.name in seen:
                continue
            seen.add(u.name)
            if u.opcode in ("get-tuple-element", "bitcast", "tuple", "copy"):
                readers.extend(users.get(u.name, ()))
            backward = scopes.get(u.name).phase == "backward"
        if backward:
            total += own_bytes(inst) if inst.opcode != "while" else data_bytes(inst.shape)
    return total


def program_memory(module: HloModule, dump_file: str | Path | None = None, layers: Mapping[str, str] | None = None,
                   scopes: ModuleScopes | None = None) -> ProgramMemory:
    """The memory of one program: from XLA's buffer assignment beside ``dump_file`` (its after-optimization HLO
    text) when present, else from traceroof's live ranges.

    :param layers: instruction name -> layer (the report's layer names, from the op table); other buffers show
        their scope.
    :raises MemoryReportError: a memory report beside ``dump_file`` that is not what XLA writes.
    """
    scopes = scopes or assign_scopes(module)
    layers = layers or {}
    cats = parameter_categories(module, scopes)
    pshapes = _param_shapes(module, cats)
    ours = live_range_peak(module)
    files = report_files(dump_file) if dump_file else {}
    devices = _devices(module)

    def describe(value: str, size: int, category: str) -> Buffer:
        name, _, index = value.partition("{")  # XLA's ``name{1}``: element 1 of a tuple-shaped instruction
        inst = module.instruction(name)
        info = scopes.get(name)
        layer = layers.get(name) or (inst.metadata.op_name if inst is not None and inst.opcode == "parameter"
                                     else info.scope)
        shape = inst.shape if inst is not None else None
        for i in index.rstrip("}").split(","):
            if shape is not None and i.strip().isdigit() and shape.is_tuple and int(i) < len(shape.tuple_shapes):
                shape = shape.tuple_shapes[int(i)]
        return Buffer(value if index.strip("}") else name, inst.opcode if inst else "", layer, info.phase,
                      str(shape) if shape is not None else "", size, category)

    def category_of(name: str) -> str:
        inst = module.instruction(name)
        if inst is not None and inst.opcode == "parameter" and name in module.entry.by_name:
            return cats.get(inst.parameter_number, "inputs")
        if inst is not None and inst.opcode == "constant":
            return "other"
        return _value_category(inst, scopes, pshapes)

    saved = _saved_activations(module, scopes)
    if "buffer-assignment" in files:
        ba = read_buffer_assignment(files["buffer-assignment"])
        report = read_memory_usage_report(files["memory-usage-report"]) if "memory-usage-report" in files else None
        xla_live = read_live_range(files["live-range"]) if "live-range" in files else None
        split = _split_assignment(ba, cats, xla_live, category_of)
        peak_values = xla_live.peak_values if xla_live else tuple((n, s) for n, s in ours.live)
        largest = [describe(n, s, category_of(n.split("{")[0])) for n, s in peak_values]
        largest = sorted(largest, key=lambda b: -b.size_bytes)[:TOP_BUFFERS]
        pm = ProgramMemory(module.name, module.program_id, devices, "xla_buffer_assignment", ba.total_bytes(), split,
                           tuple(largest), BookModel(0, 0, 0, 0),
                           report.total_bytes() if report else None, ours.peak_bytes,
                           xla_live.peak_bytes if xla_live else None, tuple(str(f) for f in files.values()))
    else:
        split = dict.fromkeys(CATEGORIES, 0)
        for name, size in ours.live:
            split[_live_category(module, name, cats, category_of)] += size
        split["activations"] += ours.peak_bytes - sum(split.values())  # called computations' scratch
        largest = sorted((describe(n, s, category_of(n)) for n, s in ours.live), key=lambda b: -b.size_bytes)
        pm = ProgramMemory(module.name, module.program_id, devices, "traceroof_live_ranges", ours.peak_bytes, split,
                           tuple(largest[:TOP_BUFFERS]), BookModel(0, 0, 0, 0), None, ours.peak_bytes, None, ())
    return replace(pm, book=_book(pm, saved))


def _live_category(module: HloModule, name: str, cats: Mapping[int, str], category_of) -> str:
    entry = module.entry
    root = entry.root
    if root is not None and name in (root.operands if root.opcode == "tuple" else (root.name,)):
        inst = entry.by_name.get(name)
        if inst is not None and inst.opcode != "parameter":
            return "outputs"
    return category_of(name)


def _split_assignment(ba: BufferAssignment, cats: Mapping[int, str], xla_live: LiveRange | None,
                      category_of) -> dict[str, int]:
    """Allocation bytes by category (device memory space): parameters by their category, live-out allocations
    as outputs, constants and thread-local as other, the temporary block split between gradients and
    activations in the proportion of its values live at XLA's peak (all activations without a live-range)."""
    split = dict.fromkeys(CATEGORIES, 0)
    live_at_peak = {n: s for n, s in (xla_live.peak_values if xla_live else ())}
    for a in ba.allocations:
        if a.color != 0:
            continue
        kind = a.kind
        if kind == "parameter":
            split[cats.get(a.parameter, "inputs")] += a.size_bytes
        elif kind == "output":
            split["outputs"] += a.size_bytes
        elif kind in ("constant", "thread-local", "other"):
            split["other"] += a.size_bytes
        else:
            grads = acts = 0
            for v in a.values:
                s = live_at_peak.get(f"{v.instruction}{v.shape_index or '{}'}", 0)
                if category_of(v.instruction) == "gradients":
                    grads += s
                else:
                    acts += s
            g = round(a.size_bytes * grads / (grads + acts)) if grads + acts else 0
            split["gradients"] += g
            split["activations"] += a.size_bytes - g
    return split


def _book(pm: ProgramMemory, saved_bytes: int) -> BookModel:
    c = pm.categories
    params, opt = c["parameters"], c["optimizer_state"]
    training = opt > 0 or c["gradients"] > 0 or saved_bytes > 0
    grads = params if training else 0
    book = BookModel(params, opt, grads, saved_bytes)
    diff = pm.peak_bytes - book.total_bytes
    lines = [f"the book's model gives {_mb(book.total_bytes)} per device, the peak is {_mb(pm.peak_bytes)} "
             f"({'+' if diff >= 0 else '-'}{_mb(abs(diff))})"]
    if c["inputs"]:
        lines.append(f"the batch (inputs) held on the device: {_mb(c['inputs'])}, outside the model")
    if c["outputs"]:
        lines.append(f"outputs written beside the inputs (state not donated, or results): {_mb(c['outputs'])}")
    temps = c["gradients"] + c["activations"]
    if training:
        lines.append(f"temporaries at the peak: {_mb(temps)} against the model's gradients + saved activations "
                     f"{_mb(grads + saved_bytes)}: " + (
                         "XLA keeps more live at once (backward scratch beyond the saved activations)"
                         if temps > grads + saved_bytes else
                         "XLA never holds every gradient at once (each is consumed by the update as it is made)"))
    if c["other"]:
        lines.append(f"constants and thread-local scratch: {_mb(c['other'])}")
    return replace(book, explanation=tuple(lines))


def _mb(n: float) -> str:
    return f"{n / 1e6:.3g} MB" if abs(n) >= 1e5 else f"{n / 1e3:.3g} kB"


def _devices(module: HloModule) -> int:
    from traceroof.collectives import module_devices

    return module_devices(module)


# --------------------------------------------------------------------------------------------------------------
# the view of an analysis
# --------------------------------------------------------------------------------------------------------------

def _dump_files(hlo_files: Iterable) -> dict[tuple[int, str], Path]:
    """(program id, module name) -> after-optimization dump file, for local ``module_NNNN.<name>.*`` files."""
    out: dict[tuple[int, str], Path] = {}
    for f in hlo_files:
        if not isinstance(f, Path) or dump_file_kind(f) != "hlo_after":
            continue
        m = re.match(r"module_(\d+)\.([^.]+)\.", f.name)
        if m:
            out[(int(m.group(1)), m.group(2))] = f
    return out


def allocator_peaks(profile_files: Iterable) -> tuple[tuple[AllocatorPeak, ...], str]:
    """Per allocator figures from the ``MemoryAllocation`` / ``MemoryDeallocation`` events of the profiles'
    ``/host:CPU`` planes, and a note when none carry them."""
    from parsers.xspace import read_xspace

    rows: dict[str, AllocatorPeak] = {}
    stats = ["allocator_name", "bytes_allocated", "bytes_available", "peak_bytes_in_use"]
    for f in profile_files:
        name = str(f)
        if not name.endswith((".xplane.pb", ".xplane.pb.gz")):
            continue
        plane = read_xspace(f).plane("/host:CPU")
        if plane is None or "bytes_allocated" not in plane.stat_names.values():
            continue
        ev = plane.events(stats=stats, names="Memory(De)?[Aa]llocation", require=["bytes_allocated"])
        ev = ev[ev["name"].astype(str).str.startswith("Memory")]
        if ev.empty or "allocator_name" not in ev:
            continue
        for alloc, g in ev.groupby("allocator_name", observed=True):
            used = pd.to_numeric(g["bytes_allocated"], errors="coerce").fillna(0)
            avail = pd.to_numeric(g.get("bytes_available", 0), errors="coerce").fillna(0)
            peak = pd.to_numeric(g.get("peak_bytes_in_use", 0), errors="coerce").fillna(0)
            a = AllocatorPeak(str(alloc), int(used.max()), int(peak.max()), int((used + avail).max()), len(g))
            old = rows.get(a.allocator)
            rows[a.allocator] = a if old is None else AllocatorPeak(
                a.allocator, max(a.max_in_use_bytes, old.max_in_use_bytes),
                max(a.peak_in_use_bytes, old.peak_in_use_bytes), max(a.limit_bytes, old.limit_bytes),
                a.events + old.events)
    if not rows:
        return (), "no allocator events in the profile (GPU/TPU memory profile): XLA's figures only"
    return tuple(sorted(rows.values(), key=lambda a: a.allocator)), ""


def memory_view(modules: Iterable[HloModule], hlo_files: Iterable, profile_files: Iterable,
                ran: Iterable[tuple[object, str]], hbm_bytes: float | None,
                layers: Mapping[tuple[object, str], Mapping[str, str]] | None = None) -> MemoryView:
    """The memory view of the programs that ran (``ran``: (program id, module name) pairs of the op table).

    A program's XLA reports are found beside its after-optimization dump (``module_NNNN.<name>...``) among
    ``hlo_files``; a report that cannot be read becomes a note and the live-range estimate is used.
    """
    ran = {(int(p) if p is not None and not pd.isna(p) else None, str(m)) for p, m in ran}
    dumps = _dump_files(hlo_files)
    notes: list[str] = []
    programs = []
    for module in modules:
        key = (module.program_id, module.name)
        if key not in ran and (None, module.name) not in ran:
            continue
        dump = dumps.get(key) if module.program_id is not None else None
        if dump is None:
            dump = next((f for (pid, name), f in dumps.items() if name == module.name and len(
                [k for k in dumps if k[1] == module.name]) == 1), None)
        try:
            pm = program_memory(module, dump, (layers or {}).get(key))
        except TraceroofError as e:
            notes.append(f"{e}; memory of {module.name} estimated from live ranges")
            pm = program_memory(module, None, (layers or {}).get(key))
        if pm.source != "xla_buffer_assignment":
            notes.append(f"{module.name}: no XLA buffer assignment in the dump (--xla_dump_to with "
                         "--xla_dump_hlo_as_text writes one): peak memory estimated from traceroof's live ranges")
        programs.append(pm)
    try:
        allocators, note = allocator_peaks(profile_files)
    except TraceroofError as e:
        allocators, note = (), f"allocator events not read: {e}"
    if note and programs:
        notes.append(note)
    return MemoryView(tuple(sorted(programs, key=lambda p: -p.peak_bytes)), hbm_bytes, allocators, tuple(notes))


def analysis_memory(profile, ops: pd.DataFrame, hbm_bytes: float | None) -> MemoryView:
    """:func:`memory_view` of a loaded :class:`~traceroof.profile.Profile` and its op table (layer names)."""
    ran = ops[["program_id", "module"]].drop_duplicates().itertuples(index=False) if len(ops) else ()
    ran = list(ran)
    layers: dict[tuple[object, str], dict[str, str]] = {}
    if len(ops) and "layer" in ops:
        for (pid, mod, op, layer) in ops[["program_id", "module", "hlo_op", "layer"]].drop_duplicates(
                ["program_id", "module", "hlo_op"]).itertuples(index=False):
            key = (int(pid) if not pd.isna(pid) else None, str(mod))
            layers.setdefault(key, {})[str(op)] = str(layer)
    return memory_view(profile.modules, profile.inputs.hlo_files, profile.inputs.profiles, ran, hbm_bytes, layers)


# --------------------------------------------------------------------------------------------------------------
# diff: memory deltas
# --------------------------------------------------------------------------------------------------------------
