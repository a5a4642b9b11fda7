"""HLO module objects: modules -> computations -> instructions, with shapes and layouts.

The HLO text parser (:mod:`parsers.hlo_text`) produces these objects. Field meanings follow
openxla/xla ``xla/service/hlo.proto`` and ``xla/xla_data.proto``; byte sizes follow ``ShapeUtil::ByteSizeOf``
(``xla/shape_util.cc``) and TPU tile padding follows ``docs/tiled_layout.md``.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

# Bits per element by primitive type (xla/xla_data.proto PrimitiveType; hlo-text.md §11).
ELEMENT_BITS: dict[str, int] = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f8e5m2": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3fnuz": 8,
    "f8e4m3": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4, "token": 0,
}
POINTER_BYTES = 8  # ShapeUtil tuple pointer table entry (hlo-text.md §5)

HBM_MEMORY_SPACE = 0  # Layout::kDefaultMemorySpace (xla/layout.h); TPU S(1) = VMEM, S(5) = host

# Limits on what a parsed module may hold; beyond them the input is garbage, not a program (HloParseError).
# XLA's own check (ShapeUtil::ValidateShape) is that a shape's byte size fits in int64; no device or host holds
# an array of more than 2**48 bytes (256 TiB; the largest accelerator memories are below 2**39), so a larger one
# is a corrupted dimension that would turn into absurd FLOPs and bytes.
MAX_ARRAY_BYTES = 2**48
MAX_TUPLE_DEPTH = 64  # nesting of tuple shapes (real programs nest a few levels)
MAX_CALL_DEPTH = 64  # nesting of calls (fusion, while, conditional, to_apply ...) below the entry computation


@dataclass(frozen=True)
class Layout:
    """An array layout: ``{minor_to_major:T(..)(..)E(bits)S(space)...}``.

    ``tiles`` holds each ``T(...)`` group in order (``None`` for a ``*`` combined dim); ``memory_space`` is the
    ``S(n)`` value (0 when absent); ``extra`` keeps every other item as written.
    """

    minor_to_major: tuple[int, ...]
    tiles: tuple[tuple[int | None, ...], ...] = ()
    element_size_bits: int | None = None
    memory_space: int = 0
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shape:
    """An HLO shape: an array ``type[dims]{layout}``, a tuple ``(s0, s1, ...)`` or ``token[]``.

    ``dims`` are element counts (for a bounded dynamic dim ``<=N`` the bound N; ``-1`` for unbounded ``?``);
    ``dynamic`` marks dynamic dims. ``tuple_shapes`` is set for tuples only.
    """

    element_type: str
    dims: tuple[int, ...] = ()
    dynamic: tuple[bool, ...] = ()
    layout: Layout | None = None
    tuple_shapes: tuple["Shape", ...] | None = None

    @property
    def is_tuple(self) -> bool:
        """True for a tuple shape."""
        return self.tuple_shapes is not None

    @property
    def elements(self) -> int:
        """Number of elements of an array shape (0 for a tuple, 1 for a scalar)."""
        if self.tuple_shapes is not None:
            return 0
        dims = self.dims
        return math.prod(dims) if not dims or min(dims) >= 0 else 0  # an unbounded dim (-1) holds none

    def leaves(self) -> list["Shape"]:
        """Array (and token) leaves, depth first."""
        if self.tuple_shapes is None:
            return [self]
        return [leaf for s in self.tuple_shapes for leaf in s.leaves()]

    @property
    def bits_per_element(self) -> int:
        """Storage bits of one element: the layout's ``E(bits)`` when set, else the type's width."""
        if self.layout is not None and self.layout.element_size_bits:
            return self.layout.element_size_bits
        return ELEMENT_BITS.get(self.element_type, 0)

    def byte_size(self) -> int:
        """Logical bytes, as ``ShapeUtil::ByteSizeOf(shape, pointer_size=8)``: tuple = 8 B per element (the
        pointer table), token 0, sub-byte types packed only when the layout says ``E(bits)``. Worked out once per
        shape (the cost model asks for each operand's size at every use)."""
        size = self.__dict__.get("_byte_size")
        if size is None:
            size = self._byte_size()
            self.__dict__["_byte_size"] = size  # not a field: equality, hash and repr ignore it
        return size

    def _byte_size(self) -> int:
        if self.tuple_shapes is not None:
            return POINTER_BYTES * len(self.tuple_shapes)
        bits = ELEMENT_BITS.get(self.element_type, 0)
        if self.layout is not None and self.layout.element_size_bits:
            return math.ceil(self.elements * self.layout.element_size_bits / 8)
        return self.elements * max(bits, 8 if bits else 0) // 8

    def padded_byte_size(self, pred_bytes: int = 4) -> int:
        """Bytes including tile padding (TPU storage, ``docs/tiled_layout.md``; hlo-text.md §6.2).

        Physical dims (major to minor, from ``minor_to_major``) are rounded up to multiples of the first tile's
        dims over the most-minor dims; later tiles subdivide a tile and add no padding when they divide it.
        With no tiles this equals :meth:`byte_size`. ``pred`` is stored in ``pred_bytes`` bytes on tiled layouts.
        """
        if self.tuple_shapes is not None or self.layout is None or not self.layout.tiles:
            return self.byte_size()
        m2m = self.layout.minor_to_major or tuple(reversed(range(len(self.dims))))
        physical = [max(self.dims[d], 0) for d in reversed(m2m)] or [1]
        tile = self.layout.tiles[0]
        if len(tile) > len(physical):
            physical = [1] * (len(tile) - len(physical)) + physical
        for i, t in enumerate(tile):
            j = len(physical) - len(tile) + i
            if t:
                physical[j] = -(-physical[j] // t) * t
        elements = math.prod(physical)
        if self.element_type == "pred":
            return elements * pred_bytes
        return math.ceil(elements * self.bits_per_element / 8)

    def __str__(self) -> str:
        if self.tuple_shapes is not None:
            return "(" + ", ".join(str(s) for s in self.tuple_shapes) + ")"
        dims = ",".join(("<=" if dyn and d >= 0 else "") + (str(d) if d >= 0 else "?")
                        for d, dyn in zip(self.dims, self.dynamic or (False,) * len(self.dims)))
        return f"{self.element_type}[{dims}]"


def shape_problem(shape: Shape, depth: int = 0) -> str:
    """Why ``shape`` cannot be a real HLO shape, or ``""``: a negative dimension (other than ``-1``, an unbounded
    dynamic one), more than :data:`MAX_ARRAY_BYTES` bytes in one array, tuples nested deeper than
    :data:`MAX_TUPLE_DEPTH`, or a layout whose ``minor_to_major`` is not a permutation of the dimensions, whose
    tiles are not positive or whose ``E(bits)`` is not in 1..128."""
    if depth > MAX_TUPLE_DEPTH:
        return f"tuple shapes nested deeper than {MAX_TUPLE_DEPTH} levels"
    if shape.tuple_shapes is not None:
        for s in shape.tuple_shapes:
            why = shape_problem(s, depth + 1)
            if why:
                return why
        return ""
    if any(d < -1 for d in shape.dims):
        return f"negative dimension in {shape}"
    n = math.prod(max(d, 1) for d in shape.dims)
    if n * max(ELEMENT_BITS.get(shape.element_type, 8), 8) // 8 > MAX_ARRAY_BYTES:
        return f"{shape} holds more than {MAX_ARRAY_BYTES:.3g} bytes: not a real array"
    lay = shape.layout
    if lay is not None:
        if lay.minor_to_major and sorted(lay.minor_to_major) != list(range(len(shape.dims))):
            return f"layout {{{','.join(map(str, lay.minor_to_major))}}} is not a permutation of the dims of {shape}"
        if any(t is not None and t <= 0 for tile in lay.tiles for t in tile):
            return f"layout tile of {shape} is not positive"
        if lay.element_size_bits is not None and not 0 <= lay.element_size_bits <= 128:
            return f"layout E({lay.element_size_bits}) of {shape} is not 0..128 bits"
        if lay.memory_space < 0:
            return f"layout S({lay.memory_space}) of {shape} is negative"
    return ""


# attributes whose value is a list of integers (``{0,1}`` or ``0``); anything else there is a parse error
INT_LIST_ATTRS = ("dimensions", "lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims", "rhs_batch_dims",
                  "feature_group_count", "batch_group_count", "index", "channel_id")


def attr_problem(attrs: dict[str, str]) -> str:
    """Why the integer attributes of an instruction (:data:`INT_LIST_ATTRS`) are not lists of non-negative
    integers, or ``""``."""
    for key in INT_LIST_ATTRS:
        raw = attrs.get(key)
        if raw is None:
            continue
        body = raw.strip()
        if body.startswith("{") and body.endswith("}"):
            body = body[1:-1]
        items = [x.strip() for x in body.split(",")] if body.strip() else []
        if not all(x.isdigit() and x.isascii() for x in items):
            return f"{key}={raw!r} is not a list of non-negative integers"
        if key in ("feature_group_count", "batch_group_count") and (len(items) != 1 or int(items[0]) < 1):
            return f"{key}={raw!r} is not a positive integer"
    return ""


def parameter_problem(computations: dict[str, "Computation"]) -> tuple[str, str]:
    """(computation, why) when a computation's parameter numbers are not 0..n-1, each once (XLA's HloVerifier
    requires it: xla/service/hlo_verifier.cc), else ``("", "")``. Later stages index by parameter number (bit masks
    of parameters), so an absurd number must not get that far."""
    for name, comp in computations.items():
        numbers = sorted(i.parameter_number for i in comp.instructions if i.opcode == "parameter")
        if numbers != list(range(len(numbers))):
            bad = next((n for k, n in enumerate(numbers) if n != k), numbers[-1] if numbers else -1)
            return name, (f"computation {name}: parameter numbers {numbers[:4]}{'...' if len(numbers) > 4 else ''} "
                          f"are not 0..{len(numbers) - 1}, each once (parameter({bad}))")
    return "", ""


def call_graph_problem(computations: dict[str, "Computation"]) -> tuple[str, str]:
    """(computation, why) when the calls between computations cannot be a program, else ``("", "")``: a
    computation that calls itself (directly or through others: fusion ``calls``, while ``body``/``condition``,
    ``to_apply``, branches ...), or calls nested deeper than :data:`MAX_CALL_DEPTH`. Calls to computations the
    module lacks are ignored (the cost model reports them). Iterative: no recursion proportional to the input."""
    callees = {name: [c for inst in comp.instructions for c in inst.called if c in computations]
               for name, comp in computations.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    height: dict[str, int] = {}  # longest call chain below a computation
    for root in computations:
        if root in state:
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[str] = [root]
        state[root] = 1
        while stack:
            name, i = stack[-1]
            calls = callees[name]
            if i < len(calls):
                stack[-1] = (name, i + 1)
                nxt = calls[i]
                if state.get(nxt) == 1:
                    cycle = path[path.index(nxt):] + [nxt]
                    via = " -> ".join(cycle[1:-1])
                    return nxt, (f"computation {nxt} calls itself through {via}" if via else
                                 f"computation {nxt} calls itself")
                if nxt not in state:
                    state[nxt] = 1
                    stack.append((nxt, 0))
                    path.append(nxt)
                continue
            stack.pop()
            path.pop()
            state[name] = 2
            height[name] = 1 + max((height[c] for c in calls), default=-1)
            if height[name] > MAX_CALL_DEPTH:
                return name, f"calls below computation {name} nest deeper than {MAX_CALL_DEPTH} levels"
    return "", ""


@dataclass(frozen=True)
class Metadata:
    """``metadata={...}`` of an instruction (OpMetadata). ``op_name`` is the JAX scope path."""

    op_type: str = ""
    op_name: str = ""
    source_file: str = ""
    source_line: int = 0
    stack_frame_id: int = 0
    deduplicated_name: str = ""
    scheduling_name: str = ""
    extra: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, eq=False)
class Instruction:
    """One HLO instruction.

    ``operands`` are instruction names (without ``%``); ``operand_shapes`` the printed operand shapes (``None``
    where the text omits them). ``attrs`` keeps every attribute's text as written (values unparsed), so unknown
    attributes survive; ``called`` lists the called computation names in attribute order; ``backend_config`` is
    the parsed JSON (dict) when it parses, else the raw string, else ``None``. ``literal`` is the text inside
    ``constant(...)`` / ``parameter(...)``.
    """

    name: str
    opcode: str
    shape: Shape
    operands: tuple[str, ...] = ()
    operand_shapes: tuple[Shape | None, ...] = ()
    attrs: dict[str, str] = field(default_factory=dict)
    called: tuple[str, ...] = ()
    metadata: Metadata = Metadata()
    backend_config: Any = None
    literal: str = ""
    is_root: bool = False

    def attr_ints(self, key: str) -> tuple[int, ...]:
        """An attribute like ``dimensions={0,2}`` or ``lhs_contracting_dims={1}`` as ints (empty if absent or,
        for a value that is not a list of integers, empty too: the parsers check :data:`INT_LIST_ATTRS`)."""
        raw = self.attrs.get(key, "").strip().strip("{}").replace(" ", "")
        try:
            return tuple(int(x) for x in raw.split(",") if x)
        except ValueError:
            return ()

    @property
    def parameter_number(self) -> int:
        """The ``i`` of ``parameter(i)``; -1 for other opcodes."""
        text = self.literal.strip()
        return int(text) if self.opcode == "parameter" and text.isdigit() and text.isascii() else -1

    @property
    def tuple_index(self) -> int:
        """The element a ``get-tuple-element`` reads (its ``index``); -1 when absent or not one integer (the
        parsers check it: :data:`INT_LIST_ATTRS`)."""
        index = self.attr_ints("index")
        return index[0] if len(index) == 1 else -1

    @property
    def fusion_kind(self) -> str:
        """``kLoop`` / ``kInput`` / ``kOutput`` / ``kCustom`` of a fusion ('' otherwise)."""
        return self.attrs.get("kind", "")


@dataclass(eq=False)
class Computation:
    """A computation: its instructions in text order (operands before users) and its root."""

    name: str
    instructions: list[Instruction]
    is_entry: bool = False
    execution_thread: str = ""

    def __post_init__(self) -> None:
        self.by_name: dict[str, Instruction] = {i.name: i for i in self.instructions}
        roots = [i for i in self.instructions if i.is_root]
        self.root: Instruction | None = roots[-1] if roots else (self.instructions[-1] if self.instructions else None)
        self._users: dict[str, list[Instruction]] | None = None

    def users(self) -> dict[str, list[Instruction]]:
        """Instruction name -> the instructions of this computation that read it (each user once, in text order);
        built on first use."""
        if self._users is None:
            users: dict[str, list[Instruction]] = {}
            for inst in self.instructions:
                ops = inst.operands
                for op in dict.fromkeys(ops) if len(ops) > 1 else ops:
                    got = users.get(op)
                    if got is None:
                        users[op] = [inst]
                    else:
                        got.append(inst)
            self._users = users
        return self._users

    def parameters(self) -> dict[int, Instruction]:
        """The computation's ``parameter`` instructions by parameter number."""
        return {i.parameter_number: i for i in self.instructions if i.opcode == "parameter"}

    def results(self) -> list[str]:
        """The names of the values the computation returns, by output index: a tuple root's operands, else the
        root alone (none without a root)."""
        if self.root is None:
            return []
        return list(self.root.operands) if self.root.opcode == "tuple" else [self.root.name]


@dataclass(frozen=True)
class StackFrame:
    """One resolved frame of the module's stack-frame tables; ``column`` of the call on its line (0: not
    written), which tells apart two calls on one line (``self.down(relu(self.up(x)))``)."""

    file_name: str
    function_name: str
    line: int
    parent_frame_id: int
    column: int = 0


_INSTRUCTIONS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()  # HloModule.instruction


@dataclass(eq=False)
class HloModule:
    """An HLO module.

    ``program_id`` is the dump number (``module_0028.*`` -> 28) or the profile's program id, ``None`` when
    unknown. ``computations`` keeps text order; ``entry`` is the ``ENTRY`` computation (the last one when
    none is marked). ``unknown_opcodes`` lists opcodes outside XLA's set, kept and reported, never fatal.
    """

    name: str
    computations: dict[str, Computation]
    entry_name: str
    attrs: dict[str, str] = field(default_factory=dict)
    stack_frames: dict[int, StackFrame] = field(default_factory=dict)
    program_id: int | None = None
    source: str = ""

    @property
    def entry(self) -> Computation:
        """The entry computation."""
        return self.computations[self.entry_name]

    def instruction(self, name: str) -> Instruction | None:
        """Find an instruction by name in any computation (names are unique within a module; the first
        computation's when not). By an index of the module built at the first call: a large program has
        thousands of computations to look through."""
        index = _INSTRUCTIONS.get(self)
        if index is None:
            index = _INSTRUCTIONS[self] = {n: i for comp in reversed(self.computations.values())
                                           for n, i in comp.by_name.items()}
        return index.get(name)

    def called_closure(self, names: Iterable[str], fused: bool) -> list[str]:
        """The computations ``names`` and, transitively, those their instructions call: through fusions only
        (``fused``: the instructions a fusion runs) or through every other caller only (loops, calls,
        conditionals: what a computation runs, not fused). Each once, in depth-first order (the last name
        first); names of no computation left out."""
        out: list[str] = []
        seen: set[str] = set()
        todo = list(names)
        while todo:
            name = todo.pop()
            comp = self.computations.get(name)
            if comp is None or name in seen:
                continue
            seen.add(name)
            out.append(name)
            todo += [c for i in comp.instructions if (i.opcode == "fusion") == fused for c in i.called]
        return out

    def source_line(self, inst: Instruction) -> str:
        """``file:line`` of an instruction from its metadata or the stack-frame table ('' when unknown)."""
        if inst.metadata.source_file:
            return f"{inst.metadata.source_file}:{inst.metadata.source_line}"
        frame = self.stack_frames.get(inst.metadata.stack_frame_id)
        return f"{frame.file_name}:{frame.line}" if frame else ""


def is_retiling(inst: Instruction, operand: Shape | None) -> bool:
    """Whether ``inst`` is a copy whose result has the operand's dims but another layout (minor-to-major order or
    tiling): a retiling, which moves bytes for no math (How to Scale Your Model §9.2.2)."""
    if inst.opcode != "copy" or operand is None or operand.is_tuple or inst.shape.is_tuple:
        return False
    a, b = operand.layout, inst.shape.layout
    if a is None or b is None or operand.dims != inst.shape.dims:
        return False
    return (a.minor_to_major, a.tiles) != (b.minor_to_major, b.tiles)
