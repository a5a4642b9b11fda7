"""FLOPs, transcendentals and bytes accessed per HLO instruction, and per execution of a module.

The rules are XLA's ``HloCostAnalysis`` (openxla/xla ``xla/service/hlo_cost_analysis.cc``; summarised in
``docs/reference/cost-model.md`` §2-§4): 2 FLOPs per multiply-add, elementwise ops one FLOP (or one
transcendental) per output element, fusions costed from their fused computation with fusion-boundary bytes.
Where XLA is knowingly wrong we differ, and say so per op:

* a ``while`` body runs ``known_trip_count`` times (or the count inferred from its condition), not once;
* GEMM custom-calls (``__cublas$gemm``, ``__cublas$lt$matmul*``, hipBLASLt uses the same targets) get the dot
  FLOPs from their operands and ``gemm_backend_config``; other custom-calls are *opaque* (no invented cost);
* bytes with tile padding (``T(...)`` layouts) are kept beside logical bytes; HBM bytes exclude ``S(n != 0)``;
* a variadic (tuple-shaped) collective reads and writes the sum of its arrays, as XLA's ``HandleAllReduce`` counts
  them (``ForEachSubshape`` over the array leaves); we count every collective that way, and a ``-start`` by its
  operands and its output part (not the aliased operand copy or the context scalars of its tuple);
* ``-done`` halves of async pairs and ``async-update`` cost nothing: the ``-start`` carries the work (XLA's
  ``HandleAsyncDone`` / ``HandleAllReduceDone`` ... leave the default out + operand bytes, counting the transfer
  twice); ``copy-start`` reads and writes its operand;
* a fusion whose root (or root-tuple element) is a ``scatter`` into a fusion parameter updates that buffer in
  place, as XLA assumes for ``dynamic-update-slice`` roots (``HandleFusion``): it writes and read-modify-writes
  only the touched region, ``min(size(updates), size(operand))`` each, like the standalone ``HandleScatter``
  rule ``3 x size(updates) + size(indices)``, not the whole operand.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from parsers.errors import HloParseError
from parsers.hlo import Computation, HloModule, Instruction, Shape
from traceroof.routing import OneHotMasks

TRANSCENDENTAL_OPCODES = frozenset({
    "erf", "exponential", "log", "logistic", "power", "sqrt", "cbrt", "rsqrt", "tanh", "sine", "cosine",
    "exponential-minus-one", "log-plus-one", "atan2", "tan",
})
ELEMENTWISE_OPCODES = TRANSCENDENTAL_OPCODES | frozenset({
    "abs", "negate", "sign", "not", "ceil", "floor", "round-nearest-afz", "round-nearest-even", "convert",
    "bitcast-convert", "real", "imag", "is-finite", "count-leading-zeros", "popcnt", "reduce-precision", "add",
    "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "complex", "and", "or", "xor",
    "shift-left", "shift-right-arithmetic", "shift-right-logical", "compare", "select", "clamp",
    "stochastic-convert", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cosh", "sinh", "mulhi",
})
ZERO_COST_OPCODES = frozenset({"parameter", "constant", "get-tuple-element", "domain", "after-all",
                               "add-dependency", "bitcast", "opt-barrier", "optimization-barrier"})
# partition-id / replica-id keep the default bytes (their u32[] output): HandlePartitionId, HandleReplicaId
CONTROL_OPCODES = frozenset({"while", "call", "conditional"})
GEMM_CUSTOM_CALL = re.compile(r"^__cublas\$(gemm|lt\$matmul.*)$|^__hipblaslt\$|^__rocblas\$gemm")
CONV_CUSTOM_CALL = re.compile(r"^__cudnn\$conv")
FUSED_ATTENTION_CALL = re.compile(r"^te_fused_attn_(forward|backward)")
COLLECTIVE_OPCODES = frozenset({
    "all-reduce", "all-reduce-start", "all-gather", "all-gather-start", "reduce-scatter", "all-to-all",
    "ragged-all-to-all", "collective-permute", "collective-permute-start", "collective-broadcast",
    "send", "recv",
})
IMMEDIATE_CONSTANT_MAX_ELEMENTS = 1  # HloCostAnalysis base class (GPU: 8)
MAX_TRIP_COUNT = 2**40  # a while trip count above this is garbage (a real loop of 1e12 iterations never ends)
MAX_EXECUTIONS = 2.0**53  # executions of a computation per module run (nested trip counts multiplied)
# -start forms whose tuple shape is (operands, outputs[, context scalars]) rather than the output itself
START_WITH_OPERAND_COPY = frozenset({"all-gather-start", "collective-permute-start", "all-to-all-start"})
# the second halves of async pairs: the -start carries the cost
DONE_OPCODES = frozenset({"all-gather-done", "all-reduce-done", "collective-permute-done", "all-to-all-done",
                          "async-done", "async-update", "copy-done", "send-done", "recv-done"})
# sizes of a variadic collective (operands and outputs are the sum of their arrays)
VARIADIC_COLLECTIVES = frozenset({"all-reduce", "all-reduce-start", "all-gather", "all-gather-start",
                                  "reduce-scatter", "all-to-all", "all-to-all-start", "collective-permute",
                                  "collective-permute-start",
                                  "collective-broadcast"})


@dataclass(frozen=True)
class OpCost:
    """Cost of one execution of one instruction.

    ``flops`` and ``transcendentals`` are counts; ``bytes_accessed`` are logical bytes (XLA's
    ``bytes accessed``); ``padded_bytes`` include tile padding; ``hbm_bytes`` are padded bytes of buffers in the
    default memory space (what the memory roofline uses). ``opaque`` marks a custom-call we cannot cost;
    ``note`` says where the number comes from when it is not XLA's rule. ``matmul_flops``: the part of ``flops``
    done by matmuls (dot, convolution, and the GEMM, convolution and fused-attention custom calls; inside fusions
    too), the work that model FLOPs count (PaLM, Chowdhery et al. 2022, appendix B: 6·N per token plus
    attention; How to Scale Your Model §4). ``routing_flops``: the part of ``matmul_flops`` done by dots that
    move data by a one-hot mask (an MoE's dispatch and combine einsums, :mod:`traceroof.routing`), which model
    FLOPs leave out.
    """

    flops: float = 0.0
    transcendentals: float = 0.0
    bytes_accessed: float = 0.0
    padded_bytes: float = 0.0
    hbm_bytes: float = 0.0
    opaque: bool = False
    note: str = ""
    matmul_flops: float = 0.0
    routing_flops: float = 0.0

    def __add__(self, o: "OpCost") -> "OpCost":
        return OpCost(self.flops + o.flops, self.transcendentals + o.transcendentals,
                      self.bytes_accessed + o.bytes_accessed, self.padded_bytes + o.padded_bytes,
                      self.hbm_bytes + o.hbm_bytes, self.opaque or o.opaque, self.note or o.note,
                      self.matmul_flops + o.matmul_flops, self.routing_flops + o.routing_flops)

    def scaled(self, k: float) -> "OpCost":
        """This cost times ``k`` (executions)."""
        return OpCost(self.flops * k, self.transcendentals * k, self.bytes_accessed * k, self.padded_bytes * k,
                      self.hbm_bytes * k, self.opaque, self.note, self.matmul_flops * k, self.routing_flops * k)


_ZERO = OpCost()  # the cost of parameters, constants, bitcasts, control ops ... (frozen: one shared instance)
_NO_LEAF = Shape("tuple", tuple_shapes=())


def _first_leaf(shape: Shape) -> Shape:
    """The first array leaf of a shape (an empty tuple when it has none: zero elements, zero bytes)."""
    leaves = shape.leaves()
    return leaves[0] if leaves else _NO_LEAF


def _sizes(shape: Shape | None) -> tuple[int, int, int]:
    """(logical, padded, hbm) bytes of a shape: tuples as their pointer table (ShapeUtil::ByteSizeOf)."""
    if shape is None:
        return 0, 0, 0
    logical = shape.byte_size()
    layout = shape.layout
    if shape.tuple_shapes is not None or layout is None:
        return logical, logical, logical
    padded = shape.padded_byte_size() if layout.tiles else logical  # no tiles: no padding
    return logical, padded, padded if layout.memory_space == 0 else 0


def _leaf_sizes(shape: Shape) -> tuple[int, int, int]:
    """(logical, padded, hbm) bytes summed over the array leaves of a shape."""
    if shape.tuple_shapes is None:
        return _sizes(shape)
    totals = [0, 0, 0]
    for leaf in shape.leaves():
        for i, v in enumerate(_sizes(leaf)):
            totals[i] += v
    return totals[0], totals[1], totals[2]


def collective_output_payload(inst: Instruction) -> list[Shape]:
    """The arrays a collective writes: every array leaf of its shape; for ``all-gather-start``,
    ``all-to-all-start`` and ``collective-permute-start`` (shape ``(operands, outputs, context scalars...)``) the
    output part only."""
    shape = inst.shape
    if inst.opcode in START_WITH_OPERAND_COPY and shape.is_tuple and len(shape.tuple_shapes) > 1:
        shape = shape.tuple_shapes[1]
    return [leaf for leaf in shape.leaves() if leaf.element_type != "token"]


@dataclass
class CostModel:
    """Costs of every instruction of one module, and how many times each computation runs per execution.

    :param module: a parsed module (after optimizations: its shapes are per device).
    """

    module: HloModule
    _cache: dict[str, OpCost] = field(default_factory=dict)
    _comp_cache: dict[str, OpCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comp_of: dict[str, Computation] = {}
        self.caller: dict[str, Instruction] = {}  # fused computation -> its (first) fusion instruction
        for comp in self.module.computations.values():
            for inst in comp.instructions:
                self.comp_of[inst.name] = comp
                if inst.opcode == "fusion":
                    for c in inst.called:
                        self.caller.setdefault(c, inst)
        self.fused: set[str] = set(self.caller)
        self.executions = self._execution_counts()
        self._masks: OneHotMasks | None = None

    def _one_hot(self) -> OneHotMasks:
        """The module's one-hot masks (:mod:`traceroof.routing`), traced on the first dot costed."""
        if self._masks is None:
            self._masks = OneHotMasks(self.module, self.comp_of, self.caller)
        return self._masks

    # -- operand helpers -----------------------------------------------------------------------------
    def operand_shape(self, inst: Instruction, i: int) -> Shape | None:
        """Shape of operand ``i``: as printed beside the operand, else its defining instruction's."""
        if i < len(inst.operand_shapes) and inst.operand_shapes[i] is not None:
            return inst.operand_shapes[i]
        comp = self.comp_of.get(inst.name)
        if comp is None or i >= len(inst.operands):
            return None
        src = comp.by_name.get(inst.operands[i])
        return src.shape if src is not None else None

    # -- loops ------------------------------------------------------------------------------------------
    def trip_count(self, inst: Instruction) -> tuple[int, str]:
        """:func:`trip_count` of a ``while`` of this module."""
        return trip_count(self.module, inst)

    def _execution_counts(self) -> dict[str, float]:
        """Executions per module run of each non-fused computation (entry = 1, while bodies x trip count),
        summed over call sites in topological order of the call graph (acyclic: the parsers refuse cycles).

        :raises HloParseError: a computation would run more than :data:`MAX_EXECUTIONS` times (trip counts
            that multiply into garbage)."""
        def calls(name: str) -> list[tuple[str, float]]:
            comp = self.module.computations.get(name)
            out: list[tuple[str, float]] = []
            for inst in comp.instructions if comp is not None else ():
                if inst.opcode == "while":
                    n, _ = self.trip_count(inst)
                    out += [(inst.attrs.get("body", "").lstrip("%"), float(n)),
                            (inst.attrs.get("condition", "").lstrip("%"), float(n + 1))]
                elif inst.opcode in ("conditional", "call", "async-start") or \
                        inst.opcode.endswith("-start") and inst.called:
                    out += [(c, 1.0) for c in inst.called]  # conditional: each branch counted once
            return [(c, k) for c, k in out if c in self.module.computations and c not in self.fused]

        entry = self.module.entry_name
        if entry not in self.module.computations or entry in self.fused:
            return {}
        edges: dict[str, list[tuple[str, float]]] = {}
        order: list[str] = []  # post-order, iterative
        stack: list[tuple[str, int]] = [(entry, 0)]
        edges[entry] = calls(entry)
        while stack:
            name, i = stack[-1]
            if i < len(edges[name]):
                stack[-1] = (name, i + 1)
                callee = edges[name][i][0]
                if callee not in edges:
                    edges[callee] = calls(callee)
                    stack.append((callee, 0))
                continue
            stack.pop()
            order.append(name)
        counts: dict[str, float] = {entry: 1.0}
        for name in reversed(order):
            k = counts.get(name, 0.0)
            if not k <= MAX_EXECUTIONS:
                raise HloParseError(f"{self.module.source or self.module.name}: computation {name} would run {k:.3g} "
                                    "times per module execution: its loops' trip counts are not real")
            for callee, n in edges[name]:
                counts[callee] = counts.get(callee, 0.0) + k * n
        return {name: counts[name] for name in order[::-1] if name in counts}

    # -- costs ------------------------------------------------------------------------------------------
    def cost(self, inst: Instruction) -> OpCost:
        """Cost of one execution of ``inst`` itself. Control ops (while, call, conditional) cost 0 here: their
        bodies are costed per instruction and counted by :attr:`executions`."""
        c = self._cache.get(inst.name)  # by name, as :attr:`comp_of` finds an instruction's computation
        if c is None:
            c = _checked(self._cost(inst), inst)
            self._cache[inst.name] = c
        return c

    def computation_cost(self, name: str) -> OpCost:
        """Sum of the instruction costs of a computation (one execution; fused computations included)."""
        if name in self._comp_cache:
            return self._comp_cache[name]
        comp = self.module.computations.get(name)
        total = _ZERO
        for inst in comp.instructions if comp is not None else ():
            c = self.cost(inst)
            if c is not _ZERO:  # (adding nothing: most instructions of a fused computation)
                total = total + c
        self._comp_cache[name] = total
        return total

    def _default_bytes(self, inst: Instruction) -> tuple[float, float, float]:
        logical, padded, hbm = _sizes(inst.shape)
        for i in range(len(inst.operands)):
            s = _sizes(self.operand_shape(inst, i))
            logical, padded, hbm = logical + s[0], padded + s[1], hbm + s[2]
        return logical, padded, hbm

    def _cost(self, inst: Instruction) -> OpCost:
        op = inst.opcode
        if op in ZERO_COST_OPCODES or op in CONTROL_OPCODES:
            return _ZERO
        if op in DONE_OPCODES:
            return OpCost(note=f"{op}: the -start of the pair carries the cost")
        if op == "fusion":
            return self._fusion_cost(inst)
        b = self._default_bytes(inst)
        if op in VARIADIC_COLLECTIVES:
            b = self._collective_bytes(inst)
        elif op == "copy-start":  # (destination, source, context): reads and writes the operand
            src = _sizes(self.operand_shape(inst, 0))
            b = (2 * src[0], 2 * src[1], 2 * src[2])
        flops = trans = 0.0
        shape = inst.shape
        out_elems = shape.elements if shape.tuple_shapes is None else sum(leaf.elements for leaf in shape.leaves())
        if op in ELEMENTWISE_OPCODES:
            if op in TRANSCENDENTAL_OPCODES:
                trans = out_elems
            else:
                flops = out_elems
        elif op == "dot":
            flops = self._dot_flops(inst, inst.attr_ints("lhs_contracting_dims"))
        elif op == "convolution":
            flops = self._conv_flops(inst)
        elif op in ("reduce", "reduce-window", "map", "scatter", "select-and-scatter", "all-reduce",
                    "all-reduce-start", "reduce-scatter"):
            flops, trans = self._reduction_flops(inst, out_elems)
        elif op == "sort":
            n = self.operand_shape(inst, 0).elements if self.operand_shape(inst, 0) else 0
            flops = n * max(math.ceil(math.log2(n)), 0) if n > 1 else 0
        elif op in ("rng", "rng-bit-generator"):
            trans = out_elems
        elif op == "tuple":
            return OpCost(bytes_accessed=8 * len(inst.operands), padded_bytes=8 * len(inst.operands),
                          hbm_bytes=8 * len(inst.operands))
        elif op == "transpose" and self._transpose_is_bitcast(inst):
            return OpCost()
        elif op == "custom-call":
            return self._custom_call_cost(inst, b)
        elif op in ("slice",):
            o = _sizes(inst.shape)
            b = (2 * o[0], 2 * o[1], 2 * o[2])
        elif op == "dynamic-slice":
            o, idx = _sizes(inst.shape), _sizes(self.operand_shape(inst, 1))
            b = tuple(2 * o[j] + idx[j] for j in range(3))
        elif op == "dynamic-update-slice":
            u, idx = _sizes(self.operand_shape(inst, 1)), _sizes(self.operand_shape(inst, 2))
            b = tuple(2 * u[j] + idx[j] for j in range(3))
        elif op == "gather":
            o, idx = _sizes(inst.shape), _sizes(self.operand_shape(inst, 1))
            b = tuple(2 * o[j] + idx[j] for j in range(3))
        if op == "scatter":
            n = len(inst.operands) // 2
            upd = [_sizes(self.operand_shape(inst, i)) for i in range(n + 1, len(inst.operands))]
            idx = _sizes(self.operand_shape(inst, n))
            b = tuple(3 * sum(u[j] for u in upd) + idx[j] for j in range(3))
        if op in ("async-start",) or (op.endswith("-start") and inst.called and op not in VARIADIC_COLLECTIVES):
            # the wrapped computation's cost (HandleAsyncStart); its bytes are those of the wrapped op, not the
            # async tuple's pointer table
            sub = OpCost()
            for c in inst.called:
                sub = sub + self.computation_cost(c)
            return sub
        routing = flops if op == "dot" and self._one_hot().is_routing_dot(inst) else 0.0
        return OpCost(flops, trans, b[0], b[1], b[2], matmul_flops=flops if op in MATMUL_OPCODES else 0.0,
                      routing_flops=routing)

    def _collective_bytes(self, inst: Instruction) -> tuple[float, float, float]:
        """Operand arrays read + output arrays written (HandleAllReduce's ForEachSubshape sum, applied to
        every collective: jaxlib 0.10.2's ``cost_analysis()`` counts a tuple ``all-to-all`` the same way)."""
        tot = [0.0, 0.0, 0.0]
        shapes = [self.operand_shape(inst, i) for i in range(len(inst.operands))]
        leaves = [leaf for s in shapes if s is not None for leaf in s.leaves()] + collective_output_payload(inst)
        for leaf in leaves:
            for j, v in enumerate(_sizes(leaf)):
                tot[j] += v
        return tot[0], tot[1], tot[2]

    def _dot_flops(self, inst: Instruction, lhs_contracting: tuple[int, ...], lhs: Shape | None = None,
                   out: Shape | None = None) -> float:
        lhs = lhs or self.operand_shape(inst, 0)
        out = out or inst.shape
        if lhs is None:
            return 0.0
        # each contracting dimension once (XLA's verifier refuses repeats; a corrupt proto may carry them)
        width = math.prod(float(lhs.dims[d]) for d in set(lhs_contracting) if 0 <= d < len(lhs.dims))
        return 2.0 * float(out.elements) * width

    def _conv_flops(self, inst: Instruction, target: str = "") -> float:
        """Convolution FLOPs (HandleConvolution). For cuDNN custom-calls the operands depend on the direction:
        forward (input, filter) -> output; backward input (output grad, filter) -> input grad; backward filter
        (input, output grad) -> filter grad; the window and dim_labels are the forward convolution's, and the
        FLOPs equal the forward convolution's."""
        a, b = self.operand_shape(inst, 0), self.operand_shape(inst, 1)
        result = _first_leaf(inst.shape)
        if "BackwardInput" in target:
            lhs, rhs, out = result, b, a
        elif "BackwardFilter" in target:
            lhs, rhs, out = a, result, b
        else:
            lhs, rhs, out = a, b, result
        labels = inst.attrs.get("dim_labels", "")
        m = re.fullmatch(r"([0-9a-z?]+)_([0-9a-z?]+)->([0-9a-z?]+)", labels)
        if lhs is None or rhs is None or out is None or not m:
            return 0.0
        in_l, k_l, out_l = m.groups()
        if len(in_l) != len(lhs.dims) or len(k_l) != len(rhs.dims) or len(out_l) != len(out.dims):
            return 0.0
        if not (set(in_l) >= {"b", "f"} and set(k_l) >= {"i", "o"} and set(out_l) >= {"b", "f"}
                and {c for c in in_l if c.isdigit()} == {c for c in k_l if c.isdigit()}
                == {c for c in out_l if c.isdigit()}):
            return float("nan")  # dim_labels that name no batch/feature dims or mismatched spatial dims
        fgc = int(inst.attrs.get("feature_group_count", "1") or 1)
        bgc = int(inst.attrs.get("batch_group_count", "1") or 1)
        input_feature = lhs.dims[in_l.index("f")]
        output_feature = out.dims[out_l.index("f")]
        batch = lhs.dims[in_l.index("b")]
        spatial = sorted(c for c in in_l if c.isdigit())
        try:
            window = _parse_window(inst.attrs.get("window", ""), len(spatial))
        except ValueError:
            return float("nan")
        positions = 1
        for i, s in enumerate(spatial):
            valid = _valid_positions(lhs.dims[in_l.index(s)], rhs.dims[k_l.index(s)], out.dims[out_l.index(s)],
                                     window[i])
            if valid < 0:
                return float("nan")
            positions *= valid
        return 2.0 * (input_feature / fgc) * output_feature * (batch / bgc) * positions

    def _reduction_flops(self, inst: Instruction, out_elems: int) -> tuple[float, float]:
        sub = OpCost()
        for c in inst.called[:1]:
            sub = self.computation_cost(c)
        op = inst.opcode
        if op == "reduce":
            in_elems = self.operand_shape(inst, 0).elements if self.operand_shape(inst, 0) else 0
            first_out = _first_leaf(inst.shape).elements
            k = in_elems - first_out
        elif op == "reduce-window":
            try:
                window = _parse_window(inst.attrs.get("window", ""), len(_first_leaf(inst.shape).dims))
            except ValueError:
                return float("nan"), float("nan")
            k = (math.prod(w["size"] for w in window) - 1) * _first_leaf(inst.shape).elements
        elif op == "scatter":
            n = len(inst.operands) // 2
            upd = self.operand_shape(inst, n + 1)
            k = upd.elements if upd is not None else 0
        elif op in ("all-reduce", "all-reduce-start"):
            return float(out_elems), 0.0
        else:  # map, select-and-scatter, reduce-scatter
            k = out_elems
        return sub.flops * k, sub.transcendentals * k

    def _transpose_is_bitcast(self, inst: Instruction) -> bool:
        src = self.operand_shape(inst, 0)
        if src is None or src.layout is None or inst.shape.layout is None:
            return False
        dims = inst.attr_ints("dimensions")
        try:
            return tuple(dims[d] for d in inst.shape.layout.minor_to_major) == src.layout.minor_to_major
        except IndexError:
            return False

    def _custom_call_cost(self, inst: Instruction, b: tuple[float, float, float]) -> OpCost:
        target = inst.attrs.get("custom_call_target", "").strip('"')
        bc = inst.backend_config if isinstance(inst.backend_config, dict) else {}
        if GEMM_CUSTOM_CALL.search(target):
            cfg = _dict(bc.get("gemm_backend_config", bc))
            dims = _dict(cfg.get("dot_dimension_numbers")).get("lhs_contracting_dimensions", [])
            try:
                contracting = tuple(int(x) for x in dims) if isinstance(dims, list) else ()
            except (TypeError, ValueError):
                contracting = ()
            if any(c < 0 for c in contracting):
                contracting = ()
            out = _first_leaf(inst.shape)
            flops = self._dot_flops(inst, contracting, out=out)
            o_all, o_first = _sizes(inst.shape), _leaf_sizes(out)
            # output bytes exclude the workspace (tuple element 1)
            bb = tuple(b[j] - (o_all[j]) + o_first[j] for j in range(3))
            return OpCost(flops, 0.0, bb[0], bb[1], bb[2], note=f"GEMM {target}: 2*M*N*K from shapes",
                          matmul_flops=flops)
        if FUSED_ATTENTION_CALL.search(target):
            return self._fused_attention_cost(inst, target, b)
        if CONV_CUSTOM_CALL.search(target):
            flops = self._conv_flops(inst, target)
            o_all, o_first = _sizes(inst.shape), _leaf_sizes(_first_leaf(inst.shape))
            bb = tuple(b[j] - o_all[j] + o_first[j] for j in range(3))
            return OpCost(flops, 0.0, bb[0], bb[1], bb[2], opaque=flops == 0,
                          note=f"cuDNN/MIOpen convolution {target}: convolution rule on its window and dim_labels",
                          matmul_flops=flops)
        return OpCost(0.0, 0.0, b[0], b[1], b[2], opaque=True, note=f"opaque custom-call {target}")

    def _fused_attention_cost(self, inst: Instruction, target: str, b: tuple[float, float, float]) -> OpCost:
        """Transformer Engine fused attention (``te_fused_attn_{forward,backward}_ffi``), from the sizes in its
        backend_config: forward = 2·B·H·Sq·Skv·(Dqk + Dv) (QKᵀ and PV), halved for causal masks (TE
        NVTE_Mask_Type 2-5); backward = 2.5 x forward (five matmuls against two; FlashAttention-2, Dao 2023,
        §4 FLOP accounting). Opaque when the sizes are missing."""
        cfg = inst.backend_config if isinstance(inst.backend_config, str) else str(inst.backend_config or "")
        kv = {k: float(v) for k, v in re.findall(r"(\w+) = (-?[\d.]+(?:e[+-]?\d+)?)", cfg)}
        need = ("input_batch", "attn_heads", "q_max_seqlen", "kv_max_seqlen", "qk_head_dim")
        if not all(k in kv for k in need):
            return OpCost(0.0, 0.0, b[0], b[1], b[2], opaque=True, note=f"fused attention {target}: sizes unknown")
        dv = kv.get("v_head_dim", kv["qk_head_dim"])
        fwd = 2 * kv["input_batch"] * kv["attn_heads"] * kv["q_max_seqlen"] * kv["kv_max_seqlen"] * \
            (kv["qk_head_dim"] + dv)
        causal = kv.get("mask_type", 0.0) in (2.0, 3.0, 4.0, 5.0)
        if causal:
            fwd /= 2
        flops = fwd * (2.5 if "backward" in target else 1.0)
        return OpCost(flops, 0.0, b[0], b[1], b[2],
                      note=f"fused attention {target}: 2*B*H*Sq*Skv*(Dqk+Dv)" + (", causal /2" if causal else "")
                      + (", backward x2.5" if "backward" in target else ""), matmul_flops=flops)

    # -- fusions ----------------------------------------------------------------------------------------
    def _fusion_cost(self, inst: Instruction) -> OpCost:
        comp = self.module.computations.get(inst.called[0]) if inst.called else None
        if comp is None:
            b = self._default_bytes(inst)
            return OpCost(0, 0, b[0], b[1], b[2], opaque=True, note="fused computation missing")
        sub = self.computation_cost(comp.name)
        total = [0.0, 0.0, 0.0]
        root = comp.root
        leaves = inst.shape.tuple_shapes if inst.shape.is_tuple else (inst.shape,)
        in_place: set[str] = set()  # scatters writing into a fusion parameter's buffer
        for i, leaf in enumerate(leaves):
            r = root
            if inst.shape.is_tuple and root is not None and root.opcode == "tuple" and i < len(root.operands):
                r = comp.by_name.get(root.operands[i])
            if r is not None and r.opcode == "dynamic-update-slice":
                s = _sizes(self.operand_shape(r, 1))
            elif r is not None and self._scatter_in_place(r, comp):
                in_place.add(r.name)
                s = self._scatter_update_sizes(r)
            else:
                s = _leaf_sizes(leaf)
            for j in range(3):
                total[j] += s[j]
        users = comp.users()
        for c in comp.instructions:
            if c.opcode == "constant" and c.shape.elements > IMMEDIATE_CONSTANT_MAX_ELEMENTS:
                s = _sizes(c.shape)
                for j in range(3):
                    total[j] += s[j]
        params = comp.parameters()
        for num, p in params.items():
            outer = self.operand_shape(inst, num)
            for j, v in enumerate(self._param_read_bytes(p, users, outer, in_place)):
                total[j] += v
        return OpCost(sub.flops, sub.transcendentals, total[0], total[1], total[2], sub.opaque, sub.note,
                      sub.matmul_flops, sub.routing_flops)

    def _scatter_in_place(self, r: Instruction, comp: Computation) -> bool:
        """A scatter whose operands to update are the fusion's parameters: XLA writes into their buffers."""
        if r.opcode != "scatter" or not r.operands:
            return False
        n = len(r.operands) // 2
        srcs = [comp.by_name.get(o) for o in r.operands[:n]]
        return all(s is not None and s.opcode == "parameter" for s in srcs)

    def _scatter_update_sizes(self, r: Instruction) -> tuple[int, int, int]:
        """Bytes of the region a scatter touches in each array it updates: its updates (operands n+1..2n of a
        scatter over n arrays), at most the whole array (many updates may hit the same rows)."""
        n = len(r.operands) // 2
        tot = [0, 0, 0]
        for k in range(n):
            upd, whole = _sizes(self.operand_shape(r, n + 1 + k)), _sizes(self.operand_shape(r, k))
            for j in range(3):
                tot[j] += min(upd[j], whole[j])
        return tot[0], tot[1], tot[2]

    def _param_read_bytes(self, p: Instruction, users: dict[str, list[Instruction]],
                          outer: Shape | None, in_place: frozenset[str] | set[str] = frozenset()
                          ) -> tuple[float, float, float]:
        """``FusionParameterReadBytes``: bytes a fusion reads of one parameter, judged by its users; a
        parameter an in-place scatter root updates is read only where it is updated (read-modify-write of
        ``size(updates)``)."""
        shape = p.shape
        if shape.is_tuple:
            tot = [0.0, 0.0, 0.0]
            for u in users.get(p.name, []):
                if u.opcode == "get-tuple-element":
                    for j, v in enumerate(self._param_read_bytes(u, users, None, in_place)):
                        tot[j] += v
            return tot[0], tot[1], tot[2]
        # memory space and tiling of the buffer are those of the fusion operand as printed outside
        own = _sizes(outer if outer is not None and not outer.is_tuple else shape)
        size = [0.0, 0.0, 0.0]
        trivial = False
        for u in users.get(p.name, []):
            add = None
            if u.opcode == "slice":
                add = _sizes(u.shape)
            elif u.opcode == "dynamic-slice" and u.operands and u.operands[0] == p.name:
                add = _sizes(u.shape)
            elif u.opcode == "dynamic-update-slice" and u.operands and u.operands[0] == p.name:
                add = (0, 0, 0)
            elif u.name in in_place and p.name in u.operands[: len(u.operands) // 2]:
                add = self._scatter_update_sizes(u)
            elif u.opcode in ("broadcast", "reshape"):
                add = own
            elif not trivial:
                trivial = True
                add = own
            if add:
                for j in range(3):
                    size[j] += add[j]
        return size[0], size[1], size[2]

    # -- module totals ------------------------------------------------------------------------------------
    def executed_instructions(self) -> list[tuple[Computation, Instruction, float]]:
        """Every instruction of every executed (non-fused) computation, with executions per module run."""
        out = []
        for name, k in self.executions.items():
            comp = self.module.computations[name]
            for inst in comp.instructions:
                out.append((comp, inst, k))
        return out

    def module_cost(self, loops_once: bool = False) -> OpCost:
        """Cost of one module execution: Σ cost x executions. ``loops_once`` reproduces XLA's own accounting
        (while bodies counted once) for comparison with ``compiled.cost_analysis()``."""
        total = OpCost()
        for _, inst, k in self.executed_instructions():
            total = total + self.cost(inst).scaled(1.0 if loops_once and k > 0 else k)
        return total


def trip_count(module: HloModule, inst: Instruction) -> tuple[int, str]:
    """Trip count of a ``while`` and its source: ``known_trip_count`` in backend_config, else a
    ``compare(iv, constant(N)), direction=LT`` in the condition (init 0 assumed), else 1 ("unknown")."""
    bc = inst.backend_config
    known = bc.get("known_trip_count") if isinstance(bc, dict) else None
    if isinstance(known, dict) and known.get("n") is not None:
        n = _count(known["n"])
        if n is not None:
            return n, "known_trip_count"
    cond = module.computations.get(inst.attrs.get("condition", "").lstrip("%"))
    if cond is not None and cond.root is not None and cond.root.opcode == "compare":
        direction = cond.root.attrs.get("direction", "")
        for op in cond.root.operands:
            c = cond.by_name.get(op)
            if c is not None and c.opcode == "constant" and re.fullmatch(r"-?[0-9]{1,19}", c.literal.strip()):
                n = int(c.literal)
                if direction in ("LT", "GT") and n <= MAX_TRIP_COUNT:
                    return max(n, 0), "condition"
                if direction in ("LE", "GE") and n < MAX_TRIP_COUNT:
                    return max(n + 1, 0), "condition"
    return 1, "unknown"


def _count(value: object) -> int | None:
    """A trip count from a backend_config value (an int or a decimal string), or ``None`` when it is not an
    integer in 0..MAX_TRIP_COUNT."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,19}", value.strip()):
        value = int(value)
    return value if isinstance(value, int) and 0 <= value <= MAX_TRIP_COUNT else None


def _dict(value: object) -> dict:
    """``value`` when it is a dict (a backend_config part), else an empty dict."""
    return value if isinstance(value, dict) else {}


def _checked(cost: OpCost, inst: Instruction) -> OpCost:
    """``cost`` when every figure is finite and non-negative; else an opaque zero cost whose note says why (a
    figure derived from inconsistent shapes or attributes is dropped, never used)."""
    if cost is _ZERO or (0 <= cost.flops < math.inf and 0 <= cost.transcendentals < math.inf
                         and 0 <= cost.bytes_accessed < math.inf and 0 <= cost.padded_bytes < math.inf
                         and 0 <= cost.hbm_bytes < math.inf):  # NaN fails every comparison
        return cost
    figures = (cost.flops, cost.transcendentals, cost.bytes_accessed, cost.padded_bytes, cost.hbm_bytes)
    return OpCost(opaque=True, note=f"cost of {inst.opcode} {inst.name} dropped: its shapes or attributes give "
                                    f"non-finite or negative figures ({', '.join(f'{v:.3g}' for v in figures)})")


def _parse_window(text: str, rank: int) -> list[dict[str, int]]:
    """``window={size=3x3 stride=2x2 pad=1_1x1_1 lhs_dilate=1x1 rhs_dilate=1x1}`` -> one dict per dim.

    :raises ValueError: a value that is not an integer, or a size, stride or dilation below 1 (XLA's
        ``ShapeInference`` rule; padding may be negative)."""
    dims = [dict(size=1, stride=1, pad_lo=0, pad_hi=0, lhs_dilate=1, rhs_dilate=1) for _ in range(rank)]
    for key, val in re.findall(r"(\w+)=([\dx_\-]+)", text):
        parts = val.split("x")
        for i, p in enumerate(parts[:rank]):
            if key == "pad":
                lo, _, hi = p.partition("_")
                dims[i]["pad_lo"], dims[i]["pad_hi"] = int(lo), int(hi or 0)
            elif key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
                dims[i][key] = int(p)
                if dims[i][key] < 1:
                    raise ValueError(f"window {key}={p}")
    return dims


MAX_CONV_LOOP = 2**20  # positions walked per spatial dim when counting a convolution's valid positions


def _in_range_count(n: int, a: int, b: int, limit: int, mod: int) -> int:
    """Number of x in [0, n) with 0 <= a*x + b < limit and (a*x + b) % mod == 0 (a, mod >= 1), in closed form."""
    lo = max(0, -(b // a))  # ceil(-b / a)
    hi = min(n, -((b - limit) // a))  # ceil((limit - b) / a)
    if hi <= lo:
        return 0
    if mod == 1:
        return hi - lo
    g = math.gcd(a, mod)
    if b % g:
        return 0
    m = mod // g
    x0 = (-(b // g) * pow(a // g, -1, m)) % m if m > 1 else 0
    return (hi - 1 - x0) // m - (lo - 1 - x0) // m


def _valid_positions(in_size: int, k_size: int, out_size: int, w: dict[str, int]) -> int:
    """Number of (kernel position, output position) pairs that read a real (non-padding) input element, as
    XLA's convolution FLOP count (hlo_cost_analysis.cc, HandleConvolution): per kernel position, the output
    positions are counted in closed form; -1 when the kernel has more than :data:`MAX_CONV_LOOP` positions."""
    dilated_in = (in_size - 1) * w["lhs_dilate"] + 1 if in_size > 0 else 0
    if k_size > MAX_CONV_LOOP:
        return -1
    return sum(_in_range_count(out_size, w["stride"], k * w["rhs_dilate"] - w["pad_lo"], dilated_in,
                               w["lhs_dilate"]) for k in range(max(k_size, 0)))


MATMUL_OPCODES = frozenset({"dot", "convolution", "ragged-dot", "scaled-dot"})
DATA_MOVEMENT_OPCODES = frozenset({
    "copy", "transpose", "broadcast", "reshape", "dynamic-reshape", "slice", "dynamic-slice",
    "dynamic-update-slice", "gather", "scatter", "pad", "concatenate", "reverse", "iota", "copy-start",
    "copy-done", "tuple", "get-tuple-element", "bitcast", "parameter", "constant",
})
REDUCTION_OPCODES = frozenset({"reduce", "reduce-window", "select-and-scatter", "sort", "topk", "scan"})


def categorize(model: CostModel, inst: Instruction) -> tuple[str, str]:
    """(category, dtype) of an instruction.

    Categories: ``matmul`` (dot/convolution, a fusion containing one, a GEMM custom-call), ``collective``
    (collective opcodes, their async forms, fusions wrapping one), ``reduction``, ``elementwise``,
    ``data movement``, ``control`` (while/call/conditional), ``custom-call`` (opaque library call), ``other``.
    The dtype is the matmul operand type for matmuls (what picks the peak), else the output element type.
    """
    op = inst.opcode
    out_type = _first_leaf(inst.shape).element_type if inst.shape.leaves() else ""
    if op in CONTROL_OPCODES:
        return "control", out_type
    base = op[: -len("-start")] if op.endswith("-start") else op[: -len("-done")] if op.endswith("-done") else op
    if base in COLLECTIVE_OPCODES or base in ("all-reduce", "all-gather", "collective-permute", "send", "recv"):
        return "collective", out_type
    if op in MATMUL_OPCODES:
        lhs = model.operand_shape(inst, 0)
        return "matmul", lhs.element_type if lhs is not None else out_type
    if op == "custom-call":
        target = inst.attrs.get("custom_call_target", "").strip('"')
        if GEMM_CUSTOM_CALL.search(target) or CONV_CUSTOM_CALL.search(target) or FUSED_ATTENTION_CALL.search(target):
            lhs = model.operand_shape(inst, 0)
            return "matmul", lhs.element_type if lhs is not None else out_type
        return "custom-call", out_type
    if op == "fusion":
        inner = _fused_opcodes(model, inst)
        for i in inner:
            if i.opcode in MATMUL_OPCODES:
                comp = model.comp_of.get(i.name)
                lhs = comp.by_name.get(i.operands[0]) if comp and i.operands else None
                return "matmul", lhs.shape.element_type if lhs is not None else out_type
        if any(i.opcode in COLLECTIVE_OPCODES for i in inner) or any(
                c.startswith(("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"))
                for c in inst.called):
            return "collective", out_type
        if any(i.opcode in REDUCTION_OPCODES for i in inner):
            return "reduction", out_type
        if any(i.opcode in ELEMENTWISE_OPCODES for i in inner):
            return "elementwise", out_type
        return "data movement", out_type
    if op in REDUCTION_OPCODES or op in ("reduce-scatter",):
        return "reduction", out_type
    if op in ELEMENTWISE_OPCODES or op in ("rng", "rng-bit-generator"):
        return "elementwise", out_type
    if op in DATA_MOVEMENT_OPCODES:
        return "data movement", out_type
    return "other", out_type


PRECISION_RANK = {"default": 0, "high": 1, "highest": 2}  # xla_data.proto PrecisionConfig::Precision


def dot_precision(model: CostModel, inst: Instruction) -> str:
    """The precision an f32 (or c64) matmul asks for, from its HLO: ``""`` for other ops and dtypes;
    the algorithm when one is set (``dot_tf32_tf32_f32`` -> ``tf32``, ``dot_f32_f32_f32`` -> ``fp32``,
    ``dot_bf16_bf16_f32_x3`` -> ``bf16_x3`` ...); else ``highest`` when any ``operand_precision`` is HIGHEST,
    ``default`` otherwise (DEFAULT and HIGH, which XLA treats alike for GEMMs: ``compute_precision <= 1`` in
    openxla/xla ``xla/service/gpu/matmul_utils.cc`` ``GetBlasComputationType``). Looks at the op itself (dot,
    convolution), the first dot/convolution of a fusion, or a GEMM custom-call's
    ``gemm_backend_config.precision_config``. :meth:`traceroof.chips.Chip.f32_matmul_peak` turns it into a
    peak."""
    op = inst.opcode
    dot: Instruction | None = None
    if op in MATMUL_OPCODES:
        dot = inst
    elif op == "fusion":
        dot = next((i for i in _fused_opcodes(model, inst) if i.opcode in MATMUL_OPCODES), None)
    elif op == "custom-call" and GEMM_CUSTOM_CALL.search(inst.attrs.get("custom_call_target", "").strip('"')):
        dot = inst
    if dot is None:
        return ""
    lhs = model.operand_shape(dot, 0)
    if lhs is None and dot is not inst:
        comp = model.comp_of.get(dot.name)
        src = comp.by_name.get(dot.operands[0]) if comp is not None and dot.operands else None
        lhs = src.shape if src is not None else None
    if lhs is None or lhs.element_type not in ("f32", "c64"):
        return ""
    algorithm = dot.attrs.get("algorithm", "")
    precisions = [p.strip().lower() for p in dot.attrs.get("operand_precision", "").strip("{}").split(",") if p]
    bc = dot.backend_config if isinstance(dot.backend_config, dict) else {}
    pc = _dict(_dict(bc.get("gemm_backend_config", bc)).get("precision_config")) if dot.opcode == "custom-call" \
        else {}
    if pc:
        algorithm = str(pc.get("algorithm", "")).lower().removeprefix("alg_")
        given = pc.get("operand_precision", [])
        precisions = [str(p).lower() for p in given] if isinstance(given, list) else []
    if algorithm and algorithm != "unset":
        m = re.fullmatch(r"dot_([a-z0-9]+)_[a-z0-9]+_[a-z0-9]+(_x\d+)?", algorithm)
        if m:
            base = {"f32": "fp32"}.get(m.group(1), m.group(1))
            return base + (m.group(2) or "")
    rank = max((PRECISION_RANK.get(p, 0) for p in precisions), default=0)
    return "highest" if rank >= 2 else "default"


def _fused_opcodes(model: CostModel, inst: Instruction) -> list[Instruction]:
    """Instructions of the computations ``inst`` calls, each nested fusion's right after it (depth first,
    iteratively; each computation once)."""
    out: list[Instruction] = []
    seen: set[str] = set()
    stack = [iter(inst.called)]
    while stack:
        item = next(stack[-1], None)
        if item is None:
            stack.pop()
        elif isinstance(item, str):
            comp = model.module.computations.get(item)
            if comp is not None and item not in seen:
                seen.add(item)
                stack.append(iter(comp.instructions))
        else:
            out.append(item)
            if item.opcode == "fusion":
                stack.append(iter(item.called))
    return out
