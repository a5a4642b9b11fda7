"""traceroof's live-range estimate of a program's peak memory, for dumps without XLA's buffer assignment (an HloProto
from the profile, hand-written HLO): a sequential model over the entry computation in XLA's schedule (the live-range
file's, when the dump has one; else the text order, which is the schedule in a dump but not in a profile's
HloProto). Every instruction that produces data gets a buffer of its shape's bytes (tuple leaves summed), live from
its definition to its last use in the entry computation; entry parameters and constants live for the whole program,
as do the root's operands from their definition on. ``bitcast``, ``get-tuple-element`` and ``tuple`` add no data
(they alias their operands; a tuple adds its pointer table), a ``while`` reuses its operand's buffer, and an output
aliased to a parameter by ``input_output_alias`` reuses that parameter's buffer. A
``while``/``call``/``conditional`` adds, while it runs, the peak of its called computations' own buffers
(recursively, body parameters excluded). The model does not pack buffers into a heap, so it is an estimate; tests
compare it with XLA's figure where both exist (:mod:`traceroof.memory`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from parsers.hlo import Computation, HloModule, Instruction, Shape
from traceroof.scopes import _alias_outputs

NO_DATA = {"bitcast", "get-tuple-element", "tuple", "after-all", "add-dependency", "opt-barrier"}
CALLS = {"while", "call", "conditional"}


@dataclass(frozen=True)
class Live:
    peak_bytes: int
    peak_time: int
    live: tuple[tuple[str, int], ...]  # (instruction, bytes) live at the peak


def data_bytes(shape: Shape) -> int:
    return sum(s.byte_size() for s in shape.leaves())


def own_bytes(inst: Instruction) -> int:
    """Bytes an instruction's own buffer holds: none for aliases, the pointer table of a tuple."""
    if inst.opcode in NO_DATA:
        return inst.shape.byte_size() if inst.opcode == "tuple" else 0
    if inst.opcode == "while":
        return 0
    return data_bytes(inst.shape)


_SHARE_OPS = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "select", "convert", "exponential",
              "tanh", "negate", "dynamic-update-slice", "scatter"}


def _may_share(module: HloModule, inst: Instruction) -> bool:
    """True for ops XLA lets write into an operand's buffer (elementwise ops, loop fusions, in-place updates:
    ``HloDataflowAnalysis::CanShareOperandBufferWithUser``)."""
    if inst.opcode == "fusion":
        return inst.fusion_kind == "kLoop" or any(
            (c := module.computations.get(n)) is not None and c.root is not None
            and c.root.opcode in ("dynamic-update-slice", "scatter") for n in inst.called)
    return inst.opcode in _SHARE_OPS


def _computation_peak(module: HloModule, comp: Computation, depth: int = 0, schedule: Sequence[str] = ()) -> int:
    """Peak of a called computation's own buffers (its parameters are the caller's)."""
    if depth > 16:
        return 0
    live = _sequential(module, comp, depth, whole_program=set(), entry=False, schedule=schedule)
    return live.peak_bytes


def _sequential(module: HloModule, comp: Computation, depth: int, whole_program: set[str], entry: bool,
                schedule: Sequence[str] = ()) -> Live:
    order = _scheduled(comp, schedule)
    pos = {i.name: t for t, i in enumerate(order)}
    last = {i.name: t for t, i in enumerate(order)}
    for t, inst in enumerate(order):
        for op in inst.operands:
            if op in last:
                last[op] = max(last[op], t)
    end = len(order)
    roots = set(comp.root.operands if comp.root is not None and comp.root.opcode == "tuple" else
                ([comp.root.name] if comp.root is not None else []))
    # aliases: a bitcast / gte / while keeps its operand's buffer alive as long as it is used
    owner: dict[str, str] = {}
    for inst in order:
        if inst.opcode in ("bitcast", "get-tuple-element", "while") and inst.operands:
            owner[inst.name] = owner.get(inst.operands[0], inst.operands[0])
    for inst in reversed(order):  # a tuple keeps its elements alive while it is used
        if inst.opcode == "tuple":
            for op in inst.operands:
                if op in last:
                    last[op] = max(last[op], last[inst.name])
    for name in list(last):
        o = owner.get(name)
        if o is not None and o in last:
            last[o] = max(last[o], last[name])
    for r in roots:
        last[owner.get(r, r)] = end
    for t, inst in enumerate(order):  # an op that may write into a same-sized operand dying here reuses its buffer
        if not _may_share(module, inst):
            continue
        for op in inst.operands:
            o = owner.get(op, op)
            src = comp.by_name.get(o)
            if (src is not None and last.get(o) == t and pos.get(o, t) < t
                    and src.opcode not in ("parameter", "constant") and own_bytes(src) == own_bytes(inst)):
                last[o] = t - 1
                break
    delta = [0] * (end + 1)
    extra = [0] * (end + 1)
    sizes: dict[str, int] = {}
    for inst in order:
        t = pos[inst.name]
        if inst.opcode == "parameter":
            if not entry:
                continue
            size, start, stop = own_bytes(inst), 0, end
        elif inst.opcode == "constant":
            size, start, stop = own_bytes(inst), 0, end
        elif inst.name in whole_program:
            continue  # an output aliased to a parameter: the parameter's buffer
        else:
            size, start, stop = own_bytes(inst), t, last[inst.name]
            if not entry and _may_share(module, inst) and any(  # updates a loop-carried buffer in place
                    (src := comp.by_name.get(owner.get(op, op))) is not None and src.opcode == "parameter"
                    and data_bytes(comp.by_name[op].shape) == size for op in inst.operands if op in comp.by_name):
                size = 0
        if inst.opcode in CALLS:
            extra[t] = sum(_computation_peak(module, module.computations[c], depth + 1, schedule)
                           for c in inst.called if c in module.computations)
        if size:
            sizes[inst.name] = size
            delta[start] += size
            delta[min(stop, end - 1) + 1 if stop < end else end] -= size
    best, best_t, cur = 0, 0, 0
    for t in range(end):
        cur += delta[t]
        if cur + extra[t] > best:
            best, best_t = cur + extra[t], t
    live = []
    for inst in order:
        s = sizes.get(inst.name)
        if not s:
            continue
        start = 0 if inst.opcode in ("parameter", "constant") else pos[inst.name]
        stop = end if inst.opcode in ("parameter", "constant") else last[inst.name]
        if start <= best_t <= stop:
            live.append((inst.name, s))
    return Live(best, best_t, tuple(live))


def _scheduled(comp: Computation, schedule: Sequence[str]) -> list[Instruction]:
    """``comp``'s instructions in ``schedule``'s order (instructions it does not name keep their place after the
    last one it names before them), or in text order without one."""
    if not schedule:
        return list(comp.instructions)
    pos = {n: t for t, n in enumerate(schedule)}
    keys, last = [], -1.0
    for i, inst in enumerate(comp.instructions):
        last = pos.get(inst.name, last + 1e-6)
        keys.append((last, i))
    return [comp.instructions[i] for _, i in sorted(keys)]


def live_range_peak(module: HloModule, schedule: Sequence[str] = ()) -> Live:
    """traceroof's sequential live-range estimate of the entry computation (see the module docstring).

    :param schedule: instruction names in execution order (XLA's live-range file lists it): an HloProto from a
        profile keeps its instructions in another order than the schedule the text dump follows."""
    entry = module.entry
    aliased = set()
    if entry.root is not None and entry.root.opcode == "tuple":
        outs = entry.root.operands
        aliased = {outs[i] for i in _alias_outputs(module) if i < len(outs)}
    return _sequential(module, entry, 0, aliased, entry=True, schedule=schedule)
