"""HLO lookups for the rules that read the program, not only the op table: an op row's instruction, the dot
inside a fusion, where a dot's operand came from (an up-cast from a narrower float), and an op's producers and
users in its computation."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import pandas as pd

from parsers.hlo import Computation, HloModule, Instruction, Shape
from traceroof.layers import is_combined

NARROW_FLOATS = ("bf16", "f16")  # and every f8* / f4* type: inputs a matrix unit takes natively
WIDE_FLOATS = ("f32", "f64")
PASS_THROUGH = ("bitcast", "copy", "transpose", "reshape")  # follow an operand through these
MATMUL_OPCODES = ("dot", "convolution")
LAYOUT_ONLY = frozenset({"parameter", "transpose", "copy", "bitcast", "reshape", "tuple", "get-tuple-element"})
CONVERT_ONLY = frozenset({"parameter", "convert", "bitcast", "copy", "reshape", "broadcast", "transpose", "tuple",
                          "get-tuple-element"})

LIBRARY_PATH = re.compile(r"[/\\](site|dist)-packages[/\\]|^<frozen |^<string>|[/\\]lib[/\\]python3[.0-9]*[/\\]")


def is_narrow(element_type: str) -> bool:
    """bf16, f16 and the 8- and 4-bit float types."""
    return element_type in NARROW_FLOATS or element_type.startswith(("f8", "f4"))


@dataclass(eq=False)
class ModuleIndex:
    """One module's instructions by name, with their computation, and each fused computation's caller."""

    module: HloModule
    where: dict[str, tuple[Computation, Instruction]] = field(default_factory=dict)
    caller: dict[str, Instruction] = field(default_factory=dict)  # called computation -> fusion/call instruction
    runner: dict[str, Instruction] = field(default_factory=dict)  # computation -> while/call/conditional running it

    def __post_init__(self) -> None:
        for comp in self.module.computations.values():
            for inst in comp.instructions:
                self.where[inst.name] = (comp, inst)
                for c in inst.called:
                    (self.caller if inst.opcode == "fusion" else self.runner).setdefault(c, inst)

    def instruction(self, name: str) -> Instruction | None:
        hit = self.where.get(name)
        return hit[1] if hit else None

    def computation_of(self, name: str) -> Computation | None:
        hit = self.where.get(name)
        return hit[0] if hit else None

    def loop_body(self, comp: Computation) -> str | None:
        """The body of the innermost ``while`` loop that runs ``comp`` (itself, or a computation a call or a
        conditional in that body runs); None outside any loop."""
        name, seen = comp.name, set()
        while name not in seen:
            seen.add(name)
            inst = self.runner.get(name)
            if inst is None:
                return None
            if inst.opcode == "while" and inst.attrs.get("body", "").lstrip("%") == name:
                return name
            outer = self.computation_of(inst.name)
            if outer is None:
                return None
            name = outer.name
        return None

    def run_by(self, name: str) -> set[str]:
        """``name`` and the computations its instructions run (calls, loops, conditionals; not fused ones),
        transitively."""
        return set(self.module.called_closure([name], fused=False))

    def users(self, comp: Computation) -> dict[str, list[Instruction]]:
        """Operand name -> the instructions of ``comp`` that read it (:meth:`Computation.users`)."""
        return comp.users()

    def fused(self, inst: Instruction) -> list[Instruction]:
        """Instructions of the computations a fusion calls, nested fusions included (each computation once)."""
        return [i for c in self.module.called_closure(inst.called, fused=True)
                for i in self.module.computations[c].instructions]

    def dot_of(self, inst: Instruction) -> Instruction | None:
        """The dot (or convolution) an op runs: itself, or the first one inside a fusion."""
        if inst.opcode in MATMUL_OPCODES:
            return inst
        if inst.opcode == "fusion":
            return next((i for i in self.fused(inst) if i.opcode in MATMUL_OPCODES), None)
        return None

    def user_line(self, inst: Instruction) -> str:
        """``file:line`` of the user's code behind ``inst``: its innermost stack frame outside installed packages
        (:meth:`user_frames`); for an op XLA's combiner made from several (one all-reduce of every layer's
        gradient), whose metadata is its first part's, the innermost frame all its operands' stacks share (the
        line that calls the model, not the first layer's); '' when none."""
        frames = self.user_frames(inst)
        comp = self.computation_of(inst.name) if is_combined(inst.metadata.op_name) else None
        if comp is None:
            return frames[0] if frames else ""
        chains = [self.user_frames(op) for op in (comp.by_name.get(n) for n in inst.operands) if op is not None]
        chains = [c for c in chains if c]
        if not chains:
            return ""
        shared = set.intersection(*(set(c) for c in chains))
        return next((f for f in chains[0] if f in shared), "")

    def user_frames(self, inst: Instruction) -> list[str]:
        """``file:line`` of the stack frames of ``inst`` outside installed packages, innermost first (a fusion
        without frames: those of its first fused instruction with some), else its metadata's own source line."""
        carriers = [inst] + (self.fused(inst) if inst.opcode == "fusion" else [])
        for c in carriers:
            fid, seen, out = c.metadata.stack_frame_id, set(), []
            while fid and fid not in seen:
                seen.add(fid)
                frame = self.module.stack_frames.get(fid)
                if frame is None:
                    break
                if not LIBRARY_PATH.search(frame.file_name):
                    out.append(f"{frame.file_name}:{frame.line}")
                fid = frame.parent_frame_id
            if out:
                return out
            if c.metadata.source_file and not LIBRARY_PATH.search(c.metadata.source_file):
                return [f"{c.metadata.source_file}:{c.metadata.source_line}"]
        return []

    def operand_shape(self, inst: Instruction, i: int) -> Shape | None:
        if i < len(inst.operand_shapes) and inst.operand_shapes[i] is not None:
            return inst.operand_shapes[i]
        comp = self.computation_of(inst.name)
        src = comp.by_name.get(inst.operands[i]) if comp is not None and i < len(inst.operands) else None
        return src.shape if src is not None else None

    def upcast_source(self, inst: Instruction, i: int, outside: list[str], depth: int = 0) -> str:
        """The narrow float type operand ``i`` of ``inst`` was converted up from ('' when none), following
        pass-through ops, fusion roots and fused parameters; the top-level ops that only convert (a
        ``wrapped_convert`` fusion, a bare ``convert``) are appended to ``outside``."""
        comp = self.computation_of(inst.name)
        if comp is None or i >= len(inst.operands) or depth > 16:
            return ""
        src = comp.by_name.get(inst.operands[i])
        return self._origin(comp, src, outside, depth + 1) if src is not None else ""

    def _origin(self, comp: Computation, src: Instruction, outside: list[str], depth: int) -> str:
        if depth > 16:
            return ""
        op = src.opcode
        if op == "convert":
            before = self.operand_shape(src, 0)
            if before is not None and is_narrow(before.element_type) and src.shape.element_type in WIDE_FLOATS:
                if comp.name not in self.caller:
                    outside.append(src.name)
                return before.element_type
            return self.upcast_source(src, 0, outside, depth) if before is not None and \
                before.element_type in WIDE_FLOATS else ""
        if op in PASS_THROUGH:
            return self.upcast_source(src, 0, outside, depth)
        if op == "fusion":
            called = self.module.computations.get(src.called[0]) if src.called else None
            if called is None or called.root is None:
                return ""
            mark: list[str] = []
            found = self._origin(called, called.root, mark, depth + 1)
            if found and comp.name not in self.caller and all(i.opcode in CONVERT_ONLY for i in self.fused(src)):
                outside.append(src.name)
            return found
        if op == "parameter" and comp.name in self.caller:
            fusion = self.caller[comp.name]
            return self.upcast_source(fusion, src.parameter_number, outside, depth)
        return ""


def dot_dims(ix: ModuleIndex, dot: Instruction) -> tuple[int, int, int] | None:
    """(M, K, N) of a dot: rows of the left operand without batch and contracting dims, the contracted
    size, columns of the right operand without batch and contracting dims (products over several dims)."""
    if dot.opcode != "dot":
        return None
    lhs, rhs = ix.operand_shape(dot, 0), ix.operand_shape(dot, 1)
    if lhs is None or rhs is None:
        return None
    lc, rc = set(dot.attr_ints("lhs_contracting_dims")), set(dot.attr_ints("rhs_contracting_dims"))
    lb, rb = set(dot.attr_ints("lhs_batch_dims")), set(dot.attr_ints("rhs_batch_dims"))
    m = math.prod(d for j, d in enumerate(lhs.dims) if j not in lc | lb)
    k = math.prod(d for j, d in enumerate(lhs.dims) if j in lc)
    n = math.prod(d for j, d in enumerate(rhs.dims) if j not in rc | rb)
    return m, k, n


class Programs:
    """The HLO modules by (name, program id), each indexed (:class:`ModuleIndex`) the first time a rule asks."""

    def __init__(self, modules: tuple[HloModule, ...] | list[HloModule]) -> None:
        self._modules: dict[tuple[str, int | None], HloModule] = {}
        for m in modules:
            self._modules.setdefault((m.name, m.program_id), m)
            self._modules.setdefault((m.name, None), m)
        self._index: dict[int, ModuleIndex] = {}

    def index(self, module: object, program_id: object) -> ModuleIndex | None:
        """The index of the module an op row names (by name and program id, else by name alone)."""
        pid = None if program_id is None or pd.isna(program_id) else int(program_id)
        m = self._modules.get((str(module), pid)) or self._modules.get((str(module), None))
        if m is None:
            return None
        if id(m) not in self._index:
            self._index[id(m)] = ModuleIndex(m)
        return self._index[id(m)]

    def instruction(self, module: object, program_id: object, name: object) -> tuple[ModuleIndex, Instruction] | None:
        """An op row's module index and instruction, or None."""
        ix = self.index(module, program_id)
        inst = ix.instruction(str(name)) if ix is not None else None
        return (ix, inst) if inst is not None else None
