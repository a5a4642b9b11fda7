"""HLO module objects: modules -> computations -> instructions, with shapes and layouts.

The HLO text parser (:mod:`parsers.hlo_text`) produces these objects. Field meanings follow
openxla/xla ``xla/service/hlo.proto`` and ``xla/xla_data.proto``; byte sizes follow ``ShapeUtil::ByteSizeOf``
(``xla/shape_util.cc``) and TPU tile padding follows ``docs/tiled_layout.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

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
        return math.prod(max(d, 0) for d in self.dims)

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
        pointer table), token 0, sub-byte types packed only when the layout says ``E(bits)``."""
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
        """An attribute like ``dimensions={0,2}`` or ``lhs_contracting_dims={1}`` as ints (empty if absent)."""
        raw = self.attrs.get(key, "").strip().strip("{}")
        return tuple(int(x) for x in raw.replace(" ", "").split(",") if x)

    @property
    def parameter_number(self) -> int:
        """The ``i`` of ``parameter(i)``; -1 for other opcodes."""
        return int(self.literal) if self.opcode == "parameter" and self.literal.strip().isdigit() else -1

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

    def parameters(self) -> dict[int, Instruction]:
        """The computation's ``parameter`` instructions by parameter number."""
        return {i.parameter_number: i for i in self.instructions if i.opcode == "parameter"}


@dataclass(frozen=True)
class StackFrame:
    """One resolved frame of the module's stack-frame tables."""

    file_name: str
    function_name: str
    line: int
    parent_frame_id: int


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
        """Find an instruction by name in any computation (names are unique within a module)."""
        for comp in self.computations.values():
            inst = comp.by_name.get(name)
            if inst is not None:
                return inst
        return None

    def source_line(self, inst: Instruction) -> str:
        """``file:line`` of an instruction from its metadata or the stack-frame table ('' when unknown)."""
        if inst.metadata.source_file:
            return f"{inst.metadata.source_file}:{inst.metadata.source_line}"
        frame = self.stack_frames.get(inst.metadata.stack_frame_id)
        return f"{frame.file_name}:{frame.line}" if frame else ""
