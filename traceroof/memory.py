"""Memory view: per program and device, the peak memory, what it holds, the largest live buffers, headroom on
the chip's HBM, the book's memory model beside it, and the allocator's own figures when the profile has them.

Sources, best first:

* **XLA's buffer assignment** (``-buffer-assignment.txt`` beside the program's after-optimization dump, read by
  :mod:`parsers.buffer_assignment`): the peak is the sum of the program's allocations in the device memory
  space (color 0), which is the total of XLA's memory-usage report and what the runtime reserves for one
  execution: entry parameters, outputs, constants, and the preallocated temporaries packed by XLA's heap
  simulator.
* **traceroof's live ranges** when the dump has no buffer assignment: :mod:`traceroof.liveranges`.

Categories (they add up to the peak; one categorisation, :func:`value_categories`, serves the split and the
largest-buffers table): ``parameters`` (model weights among the entry parameters, and their updates returned in
the donated buffers), ``weight_copies`` (the weights moved or cast and nothing else: FSDP's all-gathered
weights, a bf16 cast of f32 weights, a transposed weight), ``optimizer_state`` (entry parameters only optimizer
ops read: Adam's moments, the step count), ``inputs`` (the other entry parameters: the batch), ``gradients`` and
``activations`` (values defined by backward ops with the shape of a parameter are gradients, the rest activations
and scratch), ``outputs`` (returned values not aliased to a parameter: new weights when the state is not donated,
the loss) and ``other`` (constants, thread-local scratch). Each allocation counts the values it holds at XLA's
live-range peak under their categories (XLA's packed temporary block in their proportion), the rest by its kind.
An entry parameter's category follows the phases (:mod:`traceroof.scopes`) of the instructions that read it.

The book's model (How to Scale Your Model, part 5 "How to Parallelize a Transformer for Training", §5.1.1: per
device, parameters + optimizer state + gradients + activations; part 4 §4.3.2 on rematerialisation) is filled
from this program: parameters and optimizer state as held (per device: the partitioned HLO's shapes already
carry the sharding), gradients as one copy of the parameters, activations as the values the forward pass
leaves for the backward pass (defined by forward or remat ops, read by backward ops; not the weights, their
all-gathers and slices, nor the weights a forward loop carries through). The difference from the
peak is what the model leaves out: the batch, outputs written beside the donated state, backward temporaries
beyond the saved activations, and gradients XLA never materialises all at once.

Allocator events (``MemoryAllocation`` / ``MemoryDeallocation`` on the ``/host:CPU`` plane, written by the GPU
BFC allocators, XProf's memory-profile source) give each allocator's bytes in use and its peak during the
trace; the view reports them per allocator and the device allocators' peak beside XLA's figure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import pandas as pd

from parsers.buffer_assignment import (BufferAssignment, read_buffer_assignment, read_live_range,
                                       read_memory_usage_report, report_files)
from parsers.dump_folder import dump_file_kind
from parsers.errors import TraceroofError
from parsers.hlo import Computation, HloModule, Instruction
from traceroof.codes import first_rows, group_codes
from traceroof.cost import trip_count
from traceroof.liveranges import data_bytes, live_range_peak, own_bytes
from traceroof.scopes import ModuleScopes, _alias_outputs, assign_scopes, while_body
from traceroof.units import fmt_list

CATEGORIES = ("parameters", "weight_copies", "optimizer_state", "inputs", "gradients", "activations", "outputs",
              "other")
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
    sum, and the lines explaining the difference from the peak. ``recomputed_activations_bytes``: what remat
    recomputes in the backward pass instead of saving (saving it would add about this; not in the sum)."""

    parameters_bytes: int
    optimizer_state_bytes: int
    gradients_bytes: int
    activations_bytes: int
    recomputed_activations_bytes: int = 0
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
    ``xla_live_range_peak_bytes`` the sum of values XLA lists at its live-range peak (no packing);
    ``allocation_bytes_by_kind`` XLA's allocations by kind (``parameter``, ``output``, ``temp``, ``constant``,
    ``thread-local``, ``other``: :attr:`parsers.buffer_assignment.Allocation.kind`), whatever they hold at the
    peak (empty without a buffer assignment)."""

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
    allocation_bytes_by_kind: Mapping[str, int] = field(default_factory=dict)


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
                "xla_allocation_bytes_by_kind": dict(q.allocation_bytes_by_kind),
                "largest_buffers": [vars(b) for b in q.largest],
                "book_model": {"parameters_bytes": q.book.parameters_bytes,
                               "optimizer_state_bytes": q.book.optimizer_state_bytes,
                               "gradients_bytes": q.book.gradients_bytes,
                               "activations_bytes": q.book.activations_bytes,
                               "recomputed_activations_bytes": q.book.recomputed_activations_bytes,
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

def parameter_categories(module: HloModule, scopes: ModuleScopes) -> dict[int, str]:
    """Entry parameter number -> ``parameters`` / ``optimizer_state`` / ``inputs`` (see the module docstring):
    read only by optimizer ops -> optimizer state; read by model ops and by the optimizer (the update reads the
    old weight), aliased to an output, or named like a weight -> parameters; else inputs. A program without
    backward ops (inference) holds parameters and inputs only."""
    entry = module.entry
    users = entry.users()
    training = any(i.phase == "backward" for i in scopes.infos.values())
    aliased = _updated_in_place(module)
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


def _updated_in_place(module: HloModule) -> set[int]:
    """Entry parameters aliased to an output of their own shape (``input_output_alias``): state updated in place.
    XLA may give a donated buffer to any output of its size: Equinox's ``filter_jit(donate="all-except-first")``
    donates the batch, which XLA reused for a new weight of another shape (the s41 trial: an f32[8,1,16,16] batch
    for an f32[32,64] weight), and the batch is not a parameter."""
    entry = module.entry
    outs = entry.results()
    params = entry.parameters()
    out = set()
    for i, n in _alias_outputs(module).items():
        inst = entry.by_name.get(outs[i]) if i < len(outs) else None
        p = params.get(n)
        if inst is not None and p is not None and (inst.shape.element_type, inst.shape.dims) == \
                (p.shape.element_type, p.shape.dims):
            out.add(n)
    return out


def _param_shapes(module: HloModule, cats: Mapping[int, str]) -> set[tuple[str, tuple[int, ...]]]:
    return {(p.shape.element_type, p.shape.dims) for n, p in module.entry.parameters().items()
            if cats.get(n) == "parameters" and not p.shape.is_tuple}


def _outputs(module: HloModule, cats: Mapping[int, str]) -> dict[str, str]:
    """Entry values the program returns -> their category: an output aliased to a parameter
    (``input_output_alias``: the donated state updated in place) takes that parameter's category, the others
    (new weights when the state is not donated, the loss) are ``outputs``. Followed back through bitcasts and
    copies, so the value computing the update is the output, not only its bitcast."""
    entry = module.entry
    outs = entry.results()
    alias = _alias_outputs(module)
    out: dict[str, str] = {}
    for i, name in enumerate(outs):
        category = cats.get(alias[i], "parameters") if i in alias else "outputs"
        if category == "inputs":  # a donated input's buffer holding a result
            category = "outputs"
        while name not in out:
            inst = entry.by_name.get(name)
            if inst is None or inst.opcode in ("parameter", "constant"):
                break
            out[name] = category
            if inst.opcode not in ("bitcast", "copy") or not inst.operands:
                break
            name = inst.operands[0]
    return out


def value_categories(module: HloModule, scopes: ModuleScopes, cats: Mapping[int, str] | None = None,
                     copies: set[str] | None = None):
    """The one categorisation of values that the category split and the largest-buffers table share: a function
    (instruction name, XLA shape index such as ``"{3}"``) -> category. Entry parameters by
    :func:`parameter_categories`, constants ``other``, returned values by :func:`_outputs` (an updated weight is
    ``parameters`` when donated, ``outputs`` when written beside the old one), backward values shaped like a
    parameter ``gradients``, the weights moved or cast ``weight_copies`` (:func:`_weight_copies`), the rest
    ``activations`` (activations and scratch, including values of called
    computations). A loop-carried slot (element k of a ``while``'s result or of its body's parameter) takes the
    category of what fills it (:func:`_slot_value`): a gradient-accumulation scan's accumulators are
    ``gradients``, the weights it carries through are the weights' category. ``copies``: the
    :func:`_weight_copies` when already worked out."""
    cats = parameter_categories(module, scopes) if cats is None else cats
    pshapes = _param_shapes(module, cats)
    outputs = _outputs(module, cats)
    entry = module.entry
    loops = _loops(module)
    copies = _weight_copies(module, cats, loops) if copies is None else copies

    def category_of(name: str, index: str = "") -> str:
        if name in outputs:
            return outputs[name]
        inst = module.instruction(name)
        if inst is None:
            return "activations"
        if inst.opcode == "parameter" and name in entry.by_name:
            return cats.get(inst.parameter_number, "inputs")
        if inst.opcode == "constant":
            return "other"
        slot = index.strip("{}").split(",")[0].strip()
        if slot.isdigit() and inst.shape.is_tuple:
            loop = inst if inst.opcode == "while" else loops.by_body_param.get(name)
            filled = _slot_value(module, loops, loop, int(slot), set()) if loop is not None else None
            if filled is not None:
                return category_of(filled)
        if name in copies:
            return "weight_copies"
        if scopes.get(name).phase == "backward" and (inst.shape.element_type, inst.shape.dims) in pshapes:
            return "gradients"
        return "activations"

    return category_of


@dataclass(frozen=True)
class _Loops:
    """A module's ``while`` loops: ``by_body_param`` maps a body's parameter name to the ``while`` that runs the
    body; ``unchanged`` maps a ``while``'s name to the slots its body passes through (:func:`_carried_unchanged`),
    found once per loop rather than once per slot."""

    by_body_param: dict[str, Instruction]
    unchanged: dict[str, set[int]]


def _loops(module: HloModule) -> _Loops:
    """The module's :class:`_Loops`."""
    by_param: dict[str, Instruction] = {}
    unchanged: dict[str, set[int]] = {}
    for comp in module.computations.values():
        for w in comp.instructions:
            body = while_body(module, w)
            if body is not None:
                by_param.update((p.name, w) for p in body.parameters().values())
                unchanged[w.name] = _carried_unchanged(module, w)
    return _Loops(by_param, unchanged)


def _slot_value(module: HloModule, loops: _Loops, loop: Instruction, k: int, seen: set[str]) -> str | None:
    """The instruction whose value fills slot ``k`` of ``loop``'s carried tuple: what its body writes there
    (a gradient accumulator's add), or, for a slot the body passes through unchanged, the value the loop starts
    with (through the init tuple and outer loops). ``None`` when the HLO does not say (no tuple root or init)."""
    if loop.name in seen:
        return None
    seen.add(loop.name)
    body = while_body(module, loop)
    if body is None or body.root is None or body.root.opcode != "tuple" or k >= len(body.root.operands):
        return None
    if k not in loops.unchanged.get(loop.name, ()):
        return body.root.operands[k]
    init = module.instruction(loop.operands[0]) if loop.operands else None
    if init is None or init.opcode != "tuple" or k >= len(init.operands):
        return None
    src = module.instruction(init.operands[k])
    while src is not None and src.opcode in ("bitcast", "copy") and src.operands:
        src = module.instruction(src.operands[0])
    if src is not None and src.opcode == "get-tuple-element" and src.operands:  # an outer loop's slot
        outer = loops.by_body_param.get(src.operands[0])
        if outer is not None:
            return _slot_value(module, loops, outer, src.tuple_index, seen)
    return src.name if src is not None else None


# --------------------------------------------------------------------------------------------------------------
# one program
# --------------------------------------------------------------------------------------------------------------

_PLUMBING = {"get-tuple-element", "bitcast", "tuple", "copy"}
# ops that only move, gather or cast their operand: what they make of a weight is a copy of it (weight_copies)
_MOVES = {"all-gather", "all-gather-start", "all-gather-done", "collective-permute", "collective-permute-start",
          "collective-permute-done", "convert", "copy", "copy-start", "copy-done", "transpose", "bitcast",
          "bitcast-convert", "reshape", "slice", "dynamic-slice", "broadcast", "concatenate", "get-tuple-element",
          "parameter", "constant", "tuple"}


def _runs(module: HloModule, inst: Instruction) -> list[Instruction]:
    """``inst`` itself, or the instructions a fusion runs (nested fusions included)."""
    if inst.opcode != "fusion":
        return [inst]
    return [i for c in module.called_closure(inst.called, fused=True) for i in module.computations[c].instructions]


def _moves_only(module: HloModule, inst: Instruction) -> bool:
    """Whether ``inst`` only moves, gathers or casts its operands (:data:`_MOVES`; a fusion of such ops too)."""
    if inst.opcode in ("parameter", "constant", "tuple"):
        return False
    return all(i.opcode in _MOVES for i in _runs(module, inst))


def _is_scalar(comp: Computation, op: str) -> bool:
    """Whether the value ``op`` of ``comp`` is a scalar (a loop index, a learning rate), not an array."""
    x = comp.by_name.get(op)
    return x is not None and not x.shape.is_tuple and not x.shape.dims


def _entered_loops(module: HloModule, loops: _Loops, comp: Computation,
                   ) -> Iterator[tuple[Instruction, Computation, dict[str, str | None]]]:
    """Each ``while`` of ``comp`` with its body and the body's reads of the slots it passes through unchanged:
    get-tuple-element name -> the value that fills the slot (:func:`_slot_value`)."""
    for w in comp.instructions:
        body = while_body(module, w)
        param = next(iter(body.parameters().values()), None) if body is not None else None
        if param is None:
            continue
        unchanged = loops.unchanged.get(w.name, set())
        yield w, body, {i.name: _slot_value(module, loops, w, i.tuple_index, set()) for i in body.instructions
                        if i.opcode == "get-tuple-element" and i.operands[:1] == (param.name,)
                        and i.tuple_index in unchanged}


def _weight_copies(module: HloModule, cats: Mapping[int, str], loops: _Loops) -> set[str]:
    """Values that are a weight moved or cast and nothing else (:func:`_moves_only`, from the weights' entry
    parameters and scalars alone): FSDP's all-gathered weights, a compute-dtype cast, a transposed weight; in the
    entry computation and in the bodies of the loops the weights enter unchanged (a layer scan's per-layer
    gathers). A backward pass that reads them keeps them live from the forward pass (s43 trial: the shard_map
    tutorial's FSDP MLP held 794 kB of gathered weights that the report called activations)."""
    out: set[str] = set()

    def walk(comp: Computation, seeds: set[str]) -> None:
        made = set(seeds)
        for inst in comp.instructions:
            big = [op for op in inst.operands if not _is_scalar(comp, op)]
            if big and all(op in made for op in big) and _moves_only(module, inst):
                made.add(inst.name)
                out.add(inst.name)
        for _, body, slots in _entered_loops(module, loops, comp):
            inside = {n for n, v in slots.items() if v in made}
            if inside:
                walk(body, inside)

    entry = module.entry
    walk(entry, {p.name for n, p in entry.parameters().items() if cats.get(n) == "parameters"})
    return out


def _derived(comp: Computation, seeds: set[str]) -> set[str]:
    """Values of ``comp`` computed from the ``seeds`` alone (the weights as ``comp`` receives them, or the
    batch): the seeds, constants, and every value all of whose non-scalar operands are such (the weights'
    all-gathers, slices, copies, casts; a micro-batch sliced at a loop's scalar index)."""
    out = set(seeds)
    for inst in comp.instructions:
        if inst.opcode != "parameter" and all(op in out for op in inst.operands if not _is_scalar(comp, op)):
            out.add(inst.name)
    return out


def _carried_unchanged(module: HloModule, loop: Instruction) -> set[int]:
    """Tuple indices a ``while`` body passes through unchanged (``root[i] = get-tuple-element(param), index=i``,
    through bitcasts and copies): loop-carried weights and inputs, not made by the loop."""
    body = while_body(module, loop)
    if body is None or body.root is None or body.root.opcode != "tuple":
        return set()
    out = set()
    for i, op in enumerate(body.root.operands):
        x = body.by_name.get(op)
        while x is not None and x.opcode in ("bitcast", "copy") and x.operands:
            x = body.by_name.get(x.operands[0])
        src = body.by_name.get(x.operands[0]) if x is not None and x.operands else None
        if (x is not None and x.opcode == "get-tuple-element" and x.tuple_index == i
                and src is not None and src.opcode == "parameter"):
            out.add(i)
    return out


def _activations(module: HloModule, scopes: ModuleScopes, cats: Mapping[int, str]) -> tuple[int, int, str]:
    """Bytes of the book's activations, of the activations remat recomputes instead (what saving them would
    add, about: every recomputed value the backward reads), and whose they are: ``"micro-batch"`` (one
    micro-batch's), ``"iteration"`` (one iteration's of a loop of whole training steps) or ``""`` (the step's).

    Saved: values defined by forward ops and read by backward ops (through tuple / get-tuple-element / bitcast
    / copy plumbing), excluding the weights and the batch (entry parameters and the values computed from the
    weights alone or from the batch alone, :func:`_derived`: the weights' all-gathers and casts, a reshaped
    batch). Counted in the entry computation, plus, where the forward and backward run inside a ``while`` (a
    gradient-accumulation scan over micro-batches: a loop whose body adds gradients into carried accumulators,
    :func:`traceroof.scopes.assign_scopes`), in the largest such loop body: one micro-batch's worth; so in a
    loop whose iterations each run a forward and a backward (sequential minibatch updates, as PPO's epochs: s39
    trial, "saved activations 0 B" beside 524 kB of tanh outputs the backward read): one iteration's.
    A tuple-shaped value (a ``while``'s result) counts per element: the elements backward ops read, and of a
    ``while`` only those its body changes and not with a backward op (a scan's stacked residuals and final
    carry; not the weights it carries through, nor gradient accumulators).

    Recomputed: the same count over values defined by ``remat`` ops (the forward recomputed in the backward
    pass), at every depth, times the trip counts of the loops they run in below the micro-batch loop (a
    layer scan would stack one per layer)."""
    entry = module.entry
    params = entry.parameters()
    seeds = ({p.name for n, p in params.items() if cats.get(n) in ("parameters", "optimizer_state")},
             {p.name for n, p in params.items() if cats.get(n) == "inputs"})
    loops = _loops(module)

    def walk(comp: Computation, seeds: tuple[set[str], ...], trips: int, top: bool) -> tuple[int, int]:
        derived = [_derived(comp, s) for s in seeds]
        excluded = set().union(*derived)
        saved = _saved_in(module, comp, scopes, excluded, "forward") if top else 0
        recomputed = _saved_in(module, comp, scopes, excluded, "remat") * trips
        inner: list[tuple[int, int]] = [(0, 0)]
        for w, body, slots in _entered_loops(module, loops, comp):
            body_seeds = tuple({n for n, v in slots.items() if v in d} for d in derived)
            if comp is entry and body.root is not None and any(  # the micro-batch loop: one micro-batch live
                    scopes.get(r).how == "accumulate" for r in body.root.operands):
                inner.append(walk(body, body_seeds, trips, True))
                kinds.add("micro-batch")
                continue
            phases = _phases_run(module, scopes, body.name) if top else set()
            step = walk(body, body_seeds, trips, True) if {"forward", "backward"} <= phases else (0, 0)
            if step[0]:  # forward and backward in one iteration: a loop of whole steps, one iteration live
                inner.append(step)
                kinds.add("iteration")
            else:
                recomputed += walk(body, body_seeds, trips * trip_count(module, w)[0], False)[1]
        return saved + max(s for s, _ in inner), recomputed + max(r for _, r in inner)

    kinds: set[str] = set()  # whose activations the loops walked hold (walk adds to it)
    saved, recomputed = walk(entry, seeds, 1, True)
    return saved, recomputed, "micro-batch" if "micro-batch" in kinds else "iteration" if kinds else ""


def _phases_run(module: HloModule, scopes: ModuleScopes, name: str) -> set[str]:
    """The phases of the ops computation ``name`` runs: its own and those of the computations its loops, calls
    and conditionals run (not fused ones)."""
    return {scopes.get(i.name).phase for c in module.called_closure([name], fused=False)
            for i in module.computations[c].instructions}


def _saved_in(module: HloModule, comp: Computation, scopes: ModuleScopes, excluded: set[str], phase: str) -> int:
    """Bytes of ``comp``'s values defined by ``phase`` ops and read by backward ops (:func:`_activations`),
    less the ``excluded`` (weights and batch)."""
    users = comp.users()

    def read_by_backward(readers: list[Instruction]) -> bool:
        seen: set[str] = set()
        while readers:
            u = readers.pop()
            if u.name in seen:
                continue
            seen.add(u.name)
            if scopes.get(u.name).phase == "backward":
                return True
            if u.opcode in _PLUMBING:
                readers.extend(users.get(u.name, ()))
        return False

    total = 0
    for inst in comp.instructions:
        if inst.opcode == "parameter" or inst.name in excluded or scopes.get(inst.name).phase != phase:
            continue
        readers = users.get(inst.name, [])
        if not inst.shape.is_tuple:
            total += own_bytes(inst) if read_by_backward(list(readers)) else 0
            continue
        skip = set()
        body = while_body(module, inst)
        if body is not None:
            skip = _carried_unchanged(module, inst)
            if body.root is not None:  # gradient accumulators: the body adds a gradient
                skip |= {k for k, r in enumerate(body.root.operands) if scopes.get(r).phase == "backward"}
        for i, element in enumerate(inst.shape.tuple_shapes):
            if i not in skip and read_by_backward([u for u in readers if u.opcode != "get-tuple-element"
                                                   or u.tuple_index == i]):
                total += data_bytes(element)
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
    copies = _weight_copies(module, cats, _loops(module))
    category_of = value_categories(module, scopes, cats, copies)
    gathered = any(x.opcode.startswith("all-gather") for i in map(module.instruction, copies) if i is not None
                   for x in _runs(module, i))
    files = report_files(dump_file) if dump_file else {}
    xla_live = read_live_range(files["live-range"]) if "live-range" in files else None
    ours = live_range_peak(module, xla_live.schedule if xla_live else ())
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

    saved, recomputed, saved_of = _activations(module, scopes, cats)
    if "buffer-assignment" in files:
        ba = read_buffer_assignment(files["buffer-assignment"])
        report = read_memory_usage_report(files["memory-usage-report"]) if "memory-usage-report" in files else None
        if xla_live is not None:
            live_at_peak = {n for n, _ in xla_live.peak_values}
            order = {n: t for t, n in enumerate(xla_live.schedule)}
        else:  # traceroof's live values, every element of a tuple-shaped one
            names = {n for n, _ in ours.live}
            live_at_peak = {_key(v) for a in ba.allocations for v in a.values if v.instruction in names}
            order = {i.name: t for t, i in enumerate(module.entry.instructions)}
        split, held = _peak_contents(ba, cats, live_at_peak, order, category_of)
        largest = sorted((describe(n, s, c) for n, s, c in held), key=lambda b: -b.size_bytes)
        pm = ProgramMemory(module.name, module.program_id, devices, "xla_buffer_assignment", ba.total_bytes(), split,
                           tuple(largest[:TOP_BUFFERS]), BookModel(0, 0, 0, 0),
                           report.total_bytes() if report else None, ours.peak_bytes,
                           xla_live.peak_bytes if xla_live else None, tuple(str(f) for f in files.values()),
                           ba.bytes_by_kind())
    else:
        split = dict.fromkeys(CATEGORIES, 0)
        for name, size in ours.live:
            split[category_of(name)] += size
        split["activations"] += ours.peak_bytes - sum(split.values())  # called computations' scratch
        largest = sorted((describe(n, s, category_of(n)) for n, s in ours.live), key=lambda b: -b.size_bytes)
        pm = ProgramMemory(module.name, module.program_id, devices, "traceroof_live_ranges", ours.peak_bytes, split,
                           tuple(largest[:TOP_BUFFERS]), BookModel(0, 0, 0, 0), None, ours.peak_bytes, None, ())
    state = dict.fromkeys(("parameters", "optimizer_state"), 0)
    for n, p in module.entry.parameters().items():
        if cats.get(n) in state:
            state[cats[n]] += p.shape.byte_size()
    alias = _alias_outputs(module)
    root = module.entry.root.shape if module.entry.root is not None else None
    leaves = (root.tuple_shapes if root.is_tuple else (root,)) if root is not None else ()
    written = sum(leaf.byte_size() for i, leaf in enumerate(leaves) if i not in alias)
    donated = any(cats.get(n) in state for n in alias.values())
    return replace(pm, book=_book(pm, state["parameters"], state["optimizer_state"], saved, recomputed, saved_of,
                                  written, donated, gathered))


def _key(v) -> str:
    """An assigned value's name as XLA's live-range file writes it (``name{}``, ``name{1}``)."""
    return f"{v.instruction}{v.shape_index or '{}'}"


def _peak_contents(ba: BufferAssignment, cats: Mapping[int, str], live_at_peak: set[str], order: Mapping[str, int],
                   category_of) -> tuple[dict[str, int], list[tuple[str, int, str]]]:
    """Allocation bytes by category (device memory space, color 0) and the values held at the peak, each with
    the category its bytes are counted under: one categorisation for the split and the largest-buffers table.

    The values an allocation holds at the peak count under their :func:`value_categories` category (a value
    returned in a parameter's buffer under that parameter's: the donated state updated in place); where two
    values overlap in an allocation at the peak (an op writing its result over its operand in place) the
    later-defined one is held. XLA's packed temporaries block is split in proportion of its values at the
    peak; the rest of any other allocation (all of it when it holds no live value) goes by its kind: an entry
    parameter's by the parameter's category, output allocations to ``outputs``, the temporaries' block to
    ``activations``, constants and thread-local scratch to ``other``."""
    split = dict.fromkeys(CATEGORIES, 0)
    held: list[tuple[str, int, str]] = []
    for a in ba.allocations:
        if a.color != 0:
            continue
        live = sorted((v for v in a.values if _key(v) in live_at_peak),
                      key=lambda v: -order.get(v.instruction, -1))
        kept: list = []
        for v in live:
            if all(v.offset_bytes + v.size_bytes <= k.offset_bytes or k.offset_bytes + k.size_bytes <= v.offset_bytes
                   for k in kept):
                kept.append(v)
        kind = a.kind
        default = (cats.get(a.parameter, "inputs") if kind == "parameter" else "outputs" if kind == "output"
                   else "activations" if kind == "temp" else "other")
        by_category: dict[str, int] = {}
        for v in kept:
            c = category_of(v.instruction, v.shape_index)
            if c == "outputs" and kind == "parameter":  # returned in a parameter's buffer: the donated state
                c = default
            by_category[c] = by_category.get(c, 0) + v.size_bytes
            held.append((_key(v), v.size_bytes, c))
        if kind == "temp" and by_category:  # XLA's packed block: in proportion of the values live at the peak
            total = sum(by_category.values())
            biggest = max(by_category, key=by_category.get)
            shares = {c: round(a.size_bytes * b / total) for c, b in by_category.items() if c != biggest}
            shares[biggest] = a.size_bytes - sum(shares.values())
        else:  # the values live at the peak, the rest by the allocation's kind
            shares = dict(by_category)
            shares[default] = shares.get(default, 0) + max(a.size_bytes - sum(by_category.values()), 0)
        for c, b in shares.items():
            split[c] += b
    return split, held


def _book(pm: ProgramMemory, params_bytes: int, optimizer_bytes: int, saved_bytes: int, recomputed_bytes: int,
          saved_of: str = "", written_bytes: int = 0, donated: bool = True, gathered: bool = False) -> BookModel:
    """The book's model of ``pm``: the program's whole parameter and optimizer-state inputs (``params_bytes``,
    ``optimizer_bytes``: its entry parameters of those categories, per device), as many gradient bytes as
    parameters when it trains, and the ``saved_bytes`` of activations; with the lines explaining its difference
    from the peak. ``saved_of``: whose activations they are (:func:`_activations`). ``written_bytes``: the
    program's results that no input's buffer holds (XLA's ``memory_analysis().output_size_in_bytes``);
    ``donated``: whether it updates any of its state in place (``input_output_alias``: the state donated);
    ``gathered``: whether its weight copies include all-gathered weights (FSDP)."""
    c = pm.categories
    training = optimizer_bytes > 0 or c["optimizer_state"] > 0 or c["gradients"] > 0 or saved_bytes > 0
    grads = params_bytes if training else 0
    book = BookModel(params_bytes, optimizer_bytes, grads, saved_bytes, recomputed_bytes)
    diff = pm.peak_bytes - book.total_bytes
    lines = [f"the book's model gives {_mb(book.total_bytes)} per device, the peak is {_mb(pm.peak_bytes)} "
             f"({'+' if diff >= 0 else '-'}{_mb(abs(diff))})"]
    reused = params_bytes + optimizer_bytes - c["parameters"] - c["optimizer_state"]
    if reused > 0.01 * (params_bytes + optimizer_bytes):  # not an optimizer's step counter
        lines.append(f"{_mb(reused)} of the donated state's buffers hold other values at the peak (XLA reuses a "
                     "donated parameter's buffer once its last reader ran): the split counts them there")
    if c["inputs"]:
        lines.append(f"the batch (inputs) held on the device: {_mb(c['inputs'])}, outside the model")
    if training and not donated and params_bytes + optimizer_bytes:
        lines.append(f"the state is not donated (no input's buffer is reused for an output): the step writes "
                     f"{_mb(written_bytes)} of results, the new parameters and optimizer state among them, beside "
                     f"the old ones ({_mb(c['outputs'])} of them live at the peak); donating the state "
                     "(jax.jit donate_argnums) lets XLA update it in place")
    elif c["outputs"]:
        lines.append(f"results written beside the donated state (the loss, metrics): {_mb(c['outputs'])} at the "
                     "peak")
    temps = c["gradients"] + c["activations"]
    if training:
        lines.append(f"temporaries at the peak: {_mb(temps)} against the model's gradients + saved activations "
                     f"{_mb(grads + saved_bytes)}: " + (
                         "XLA keeps more live at once (backward scratch beyond the saved activations)"
                         if temps > grads + saved_bytes else
                         "XLA never holds every gradient at once (each is consumed by the update as it is made)"))
    if c["weight_copies"] and gathered:
        lines.append(f"weight copies at the peak: {_mb(c['weight_copies'])}, the weights all-gathered from their "
                     "shards (FSDP) and their casts and layout copies; the book counts the sharded weights only: a "
                     "gathered weight the backward pass reads stays live from the forward pass unless XLA gathers it "
                     "again there (remat of the layer, jax.checkpoint, allows that, though XLA may still gather it "
                     "early: compare the weight copies of both runs)")
    elif c["weight_copies"]:
        lines.append(f"weight copies at the peak: {_mb(c['weight_copies'])}, the weights copied, cast or re-laid out "
                     "(computed from the weights alone: XLA's copies of weights it updates in place while the old "
                     "values are still read, compute-dtype casts, transposes); the book counts the weights once")
    if saved_of == "iteration":
        lines.append("saved activations are one iteration's: the forward and backward run inside a loop of the "
                     "step (one update per iteration, as minibatch epochs do), one iteration's live at a time")
    if saved_of == "micro-batch":
        lines.append("saved activations are one micro-batch's: the forward and backward run in a gradient-"
                     "accumulation loop, whose accumulators are held beside each micro-batch's gradients (up to 2x "
                     "the gradients term)")
    if recomputed_bytes:
        lines.append(f"remat recomputes {_mb(recomputed_bytes)} of activations the backward reads: saving them "
                     "instead would add about that")
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


NO_ALLOCATOR_EVENTS = ("no allocator events in the profile (a GPU/TPU memory profile records them): no measured "
                       "peak to compare with")


def plane_allocators(plane: Any) -> tuple[AllocatorPeak, ...]:
    """Per allocator figures from the ``MemoryAllocation`` / ``MemoryDeallocation`` events of one host's
    ``/host:CPU`` plane (a :class:`parsers.xspace.Plane`, or ``None``); ``()`` when it carries none.

    :raises FormatError: the plane's event data is corrupt."""
    stats = ["allocator_name", "bytes_allocated", "bytes_available", "peak_bytes_in_use"]
    if plane is None or "bytes_allocated" not in plane.stat_names.values():
        return ()
    ev = plane.events(stats=stats, names="Memory(De)?[Aa]llocation", require=["bytes_allocated"])
    ev = ev[ev["name"].astype(str).str.startswith("Memory")]
    if ev.empty or "allocator_name" not in ev:
        return ()
    out = []
    for alloc, g in ev.groupby("allocator_name", observed=True):
        used = pd.to_numeric(g["bytes_allocated"], errors="coerce").fillna(0)
        avail = pd.to_numeric(g.get("bytes_available", 0), errors="coerce").fillna(0)
        peak = pd.to_numeric(g.get("peak_bytes_in_use", 0), errors="coerce").fillna(0)
        out.append(AllocatorPeak(str(alloc), int(used.max()), int(peak.max()), int((used + avail).max()), len(g)))
    return tuple(out)


def merge_allocators(per_host: Iterable[tuple[AllocatorPeak, ...]]) -> tuple[tuple[AllocatorPeak, ...], str]:
    """The allocators of several hosts' :func:`plane_allocators` by name (largest figures, events summed), sorted
    by name, and a note when there are none."""
    rows: dict[str, AllocatorPeak] = {}
    for peaks in per_host:
        for a in peaks:
            old = rows.get(a.allocator)
            rows[a.allocator] = a if old is None else AllocatorPeak(
                a.allocator, max(a.max_in_use_bytes, old.max_in_use_bytes),
                max(a.peak_in_use_bytes, old.peak_in_use_bytes), max(a.limit_bytes, old.limit_bytes),
                a.events + old.events)
    if not rows:
        return (), NO_ALLOCATOR_EVENTS
    return tuple(sorted(rows.values(), key=lambda a: a.allocator)), ""


def allocator_peaks(profile_files: Iterable) -> tuple[tuple[AllocatorPeak, ...], str]:
    """:func:`merge_allocators` of the ``.xplane.pb`` files given (each read again: an analysis takes them from
    the hosts it already read, :attr:`traceroof.profile.Profile.allocators`).

    :raises TraceroofError: a file cannot be read or is corrupt."""
    from parsers.xspace import read_xspace

    return merge_allocators(plane_allocators(read_xspace(f).plane("/host:CPU")) for f in profile_files
                            if str(f).endswith((".xplane.pb", ".xplane.pb.gz")))


def memory_view(modules: Iterable[HloModule], hlo_files: Iterable, allocators: tuple[AllocatorPeak, ...],
                allocator_note: str, ran: Iterable[tuple[object, str]], hbm_bytes: float | None,
                layers: Mapping[tuple[object, str], Mapping[str, str]] | None = None,
                scopes: Mapping[int, ModuleScopes] | None = None, equal_dumps: Iterable[str] = ()) -> MemoryView:
    """The memory view of the programs that ran (``ran``: (program id, module name) pairs of the op table), with
    the profile's allocator figures (:func:`merge_allocators`: ``allocators`` and the note when there are none).

    A program's XLA reports are found beside its after-optimization dump (``module_NNNN.<name>...``) among
    ``hlo_files``, and used only when that dump holds the program's HLO: it is the module's own source, or one of
    ``equal_dumps`` (dumps the profile's own HLO superseded and equals: ``Profile.dump_sources``); another dump
    under the program's id and name (another run's) is left out with a note. A report that cannot be read becomes
    a note; either way the live-range estimate is used. ``scopes``: :func:`~traceroof.scopes.assign_scopes` of
    some modules (default pattern), by position in ``modules``, already made (the others are assigned here).
    """
    ran = {(int(p) if p is not None and not pd.isna(p) else None, str(m)) for p, m in ran}
    hlo_files = list(hlo_files)
    dumps = _dump_files(hlo_files)
    equal = set(equal_dumps)
    notes: list[str] = []
    programs = []
    undumped: list[str] = []
    for at, module in enumerate(modules):
        key = (module.program_id, module.name)
        if key not in ran and (None, module.name) not in ran:
            continue
        dump = dumps.get(key) if module.program_id is not None else None
        other = dump is not None and str(dump) != module.source and str(dump) not in equal
        if other:
            notes.append(f"{module.name}: {dump} is not the HLO that ran: XLA's reports beside it are not used; "
                         "peak memory estimated from traceroof's live ranges")
            dump = None
        known = (scopes or {}).get(at)
        unread = False  # a report that cannot be read: its own note says so
        try:
            pm = program_memory(module, dump, (layers or {}).get(key), known)
        except TraceroofError as e:
            notes.append(f"{e}; memory of {module.name} estimated from live ranges")
            pm = program_memory(module, None, (layers or {}).get(key), known)
            unread = True
        if pm.source != "xla_buffer_assignment" and not other and not unread:
            if dump is None and dumps:  # dumps given, none of this program: they are of another run
                pid = f"({module.program_id})" if module.program_id is not None else ""
                notes.append(f"{module.name}{pid}: none of the {len(dumps)} dump(s) given is of this program (another "
                             "run's dump folder?): XLA's reports not used; peak memory estimated from traceroof's "
                             "live ranges")
            elif not hlo_files:  # no HLO given: one note for every program
                undumped.append(module.name)
            else:
                notes.append(f"{module.name}: no XLA buffer assignment in the dump (--xla_dump_to with "
                             "--xla_dump_hlo_as_text writes one): peak memory estimated from traceroof's live ranges")
        programs.append(pm)
    if undumped:
        notes.append(f"no XLA dump given (--hlo with a --xla_dump_to folder): peak memory of "
                     f"{fmt_list(dict.fromkeys(undumped))} estimated from traceroof's live ranges, not XLA's buffer "
                     "assignment")
    if allocator_note and programs:
        notes.append(allocator_note)
    return MemoryView(tuple(sorted(programs, key=lambda p: -p.peak_bytes)), hbm_bytes, allocators, tuple(notes))


def analysis_memory(profile, ops: pd.DataFrame, hbm_bytes: float | None,
                    scopes: Mapping[int, ModuleScopes] | None = None) -> MemoryView:
    """:func:`memory_view` of a loaded :class:`~traceroof.profile.Profile` and its op table (layer names);
    ``scopes``: those of :func:`memory_view` already assigned."""
    ran: list[tuple[object, object]] = []
    layers: dict[tuple[object, str], dict[str, str]] = {}
    if len(ops):  # the first row of every (program, module, op)
        firsts = first_rows(group_codes([ops["program_id"], ops["module"], ops["hlo_op"]]))
        pids, mods = ops["program_id"].array[firsts], ops["module"].array[firsts]
        ran = list(zip(pids, mods))
        if "layer" in ops:
            for pid, mod, op, layer in zip(pids, mods, ops["hlo_op"].array[firsts], ops["layer"].array[firsts]):
                key = (int(pid) if not pd.isna(pid) else None, str(mod))
                layers.setdefault(key, {})[str(op)] = str(layer)
    return memory_view(profile.modules, profile.inputs.hlo_files, profile.allocators, profile.allocator_note, ran,
                       hbm_bytes, layers, scopes, profile.dump_sources)


# --------------------------------------------------------------------------------------------------------------
# diff: memory deltas
# --------------------------------------------------------------------------------------------------------------
