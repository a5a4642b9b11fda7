"""The parallelism strategy of every mesh axis, read from what the program communicates over it and when.

Rules (How to Scale Your Model, "How to Parallelize a Transformer for Training": the algorithms of the data
parallelism, FSDP, tensor parallelism and pipelining sections; the MoE all-to-all of "Training LLaMA"'s GPU
chapter, §12.4.3):

* ``expert``: tokens exchanged by all-to-all over the axis in the forward pass (all-to-alls only in the backward
  pass or the update are XLA resharding values, which decide no strategy);
* ``pipeline``: activations sent by collective-permute between the axis' devices (one hop between stages);
  an expert or pipeline axis that also carries activations inside layers (an MoE whose attention is
  tensor-parallel over its expert axis) keeps that strategy for the book's arithmetic, and its evidence starts
  ``also tensor parallelism`` (or ``sequence``);
* ``tensor``: activations (arrays that are no weight's shape) all-reduced / all-gathered / reduce-scattered over
  the axis inside a layer (Megatron: ``In[B, D_Y]`` gathered, ``Out`` reduce-scattered or all-reduced), more bytes
  of them than of gradients (cross-replica BatchNorm's statistics beside a data axis' gradients are no tensor
  parallelism);
  ``sequence`` when the activations are gathered along a token dimension rather than the feature dimension;
* ``fsdp``: weights (entry parameters or their shards) all-gathered over the axis before a matmul uses them,
  gradients reduced over it;
* ``data``: weight gradients all-reduced over the axis (or reduce-scattered, which XLA:CPU lowers as all-reduce
  + dynamic-slice, and the updated weights all-gathered), weights never gathered before use;
* ``unknown``: anything else (e.g. only scalars reduced), with the evidence.

"Weights" are the step's state: entry parameters that are aliased to outputs (donated) or returned with the same
shape; a collective may carry weights (or their gradients) when one of its arrays has a weight's local, global or
partially gathered shape (size-1 dimensions dropped). The parts of a combined all-reduce or reduce-scatter (one
tuple of many: XLA's combiner) are judged one by one, each by what reads it. A shape can match by coincidence (an
MoE step's ``f32[4,32,64]`` activations are its ``[4,128,64]`` expert weights cut 4 ways on their rows), so the
data flow and the op's phase (:func:`traceroof.scopes.assign_scopes`) decide: an all-gather of an array computed
by a matmul in the forward or backward pass gathers activations (a weight, its shard or cast comes straight from
the parameters; updated weights are gathered in the optimizer phase); an all-reduce or reduce-scatter is of weight
gradients only outside the forward pass and when its result feeds no matmul (the optimizer is elementwise; an
activation's gradient flows on into the next matmul). The backward pass is what JAX names ``transpose(...)`` in
the op metadata.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from parsers.hlo import Computation, HloModule, Instruction, Shape
from traceroof.mesh import Mesh, PlacedCollective
from traceroof.scopes import ModuleScopes, assign_scopes

STRATEGIES = ("data", "fsdp", "tensor", "sequence", "pipeline", "expert", "unknown")
GRADIENT_KINDS = ("grads_all_reduced", "grads_reduce_scattered", "grads_all_reduce_sliced")  # evidence kinds
SCALAR_ELEMENTS = 64  # collectives of arrays this small (loss, norms, counters) say nothing about the strategy


def squeeze(dims: tuple[int, ...]) -> tuple[int, ...]:
    """Dimensions without the size-1 ones (a stage's ``[1, D, F]`` slice is a ``[D, F]`` weight)."""
    return tuple(d for d in dims if d != 1)


def sharding_tiles(text: str, rank: int) -> tuple[int, ...]:
    """Per-dimension tile counts of an HLO ``sharding={...}`` (``devices=[4,1,2]<=[8] last_tile_dim_replicate``
    -> (4, 1)); all ones for ``replicated``/``maximal`` or text of another form."""
    m = re.search(r"devices=\[([\d,]+)\]", text or "")
    if not m:
        return (1,) * rank
    tiles = [int(x) for x in m.group(1).split(",")]
    if "last_tile_dim_replicate" in text:
        tiles = tiles[:-1]
    extra = re.search(r"last_tile_dims=\{([^}]*)\}", text)
    if extra:
        tiles = tiles[: len(tiles) - len([x for x in extra.group(1).split(",") if x.strip()])]
    return tuple(tiles) if len(tiles) == rank else (1,) * rank


@dataclass(frozen=True)
class StateParam:
    """An entry parameter that is part of the step's state: ``local`` dims (per device), ``global_dims`` (from
    its sharding), ``dtype``, and ``weight`` when it reaches a matmul (else optimizer state)."""

    number: int
    name: str
    local: tuple[int, ...]
    global_dims: tuple[int, ...]
    dtype: str
    bytes_local: int
    weight: bool


def _calls_opcode(module: HloModule, inst: Instruction, opcodes: tuple[str, ...], depth: int = 0) -> bool:
    """``inst`` is one of ``opcodes`` or a fusion/call whose body holds one (nested up to 3 levels)."""
    if inst.opcode in opcodes:
        return True
    if depth > 3 or inst.opcode not in ("fusion", "call", "async-start"):
        return False
    for name in inst.called:
        comp = module.computations.get(name)
        if comp is not None and any(_calls_opcode(module, i, opcodes, depth + 1) for i in comp.instructions):
            return True
    return False


def _reaches(module: HloModule, comp: Computation, users: Mapping[str, list[Instruction]], start: Instruction,
             opcodes: tuple[str, ...], hops: int) -> bool:
    """A value reaches an instruction of ``opcodes`` (or a fusion holding one) within ``hops`` users; a
    get-tuple-element (picking one array of a combined collective's tuple) is no hop."""
    frontier, seen = [start], {start.name}
    for _ in range(hops):
        nxt = []
        while frontier:
            inst = frontier.pop()
            for u in users.get(inst.name, ()):
                if _calls_opcode(module, u, opcodes):
                    return True
                if u.name not in seen:
                    seen.add(u.name)
                    (frontier if u.opcode == "get-tuple-element" else nxt).append(u)
        frontier = nxt
    return False


MATMULS = ("dot", "convolution")
_PASS_THROUGH = ("bitcast", "convert", "copy", "reshape")


def _of_entry_parameter(module: HloModule, comp: Computation, inst: Instruction) -> bool:
    """``inst``'s operand is a parameter of the entry computation, directly or through bitcasts, converts, copies
    and reshapes (a value the step was given, not one it computed)."""
    if comp is not module.entry:
        return False
    seen: set[str] = set()
    at = comp.by_name.get(inst.operands[0]) if inst.operands else None
    while at is not None and at.name not in seen:
        seen.add(at.name)
        if at.opcode == "parameter":
            return True
        if at.opcode not in _PASS_THROUGH or len(at.operands) != 1:
            return False
        at = comp.by_name.get(at.operands[0])
    return False


def state_params(module: HloModule) -> list[StateParam]:
    """The entry parameters that are state: aliased to an output (``input_output_alias``) or returned with their
    shape; ``weight`` marks those that reach a matmul, or a loop (whose body may hold it: a scan's or a pipeline's
    stages), within 4 users (the rest: optimizer state, which only the update reads)."""
    entry = module.entry
    params = entry.parameters()
    aliased = {int(x) for x in re.findall(r"\}\s*:\s*\(\s*(\d+)\s*,", module.attrs.get("input_output_alias", ""))}
    out_shapes = {(leaf.element_type, leaf.dims) for leaf in entry.root.shape.leaves()} if entry.root else set()
    users = entry.users()
    out = []
    for number, p in sorted(params.items()):
        if p.shape.is_tuple or not p.shape.dims:
            continue
        if number not in aliased and (p.shape.element_type, p.shape.dims) not in out_shapes:
            continue
        tiles = sharding_tiles(p.attrs.get("sharding", ""), len(p.shape.dims))
        out.append(StateParam(number, p.metadata.op_name or p.name, p.shape.dims,
                              tuple(d * t for d, t in zip(p.shape.dims, tiles)), p.shape.element_type,
                              p.shape.byte_size(), _reaches(module, entry, users, p, MATMULS + ("while",), 4)))
    if out and not any(s.weight for s in out):  # no matmul found (e.g. inside loops): all state counts as weights
        out = [StateParam(s.number, s.name, s.local, s.global_dims, s.dtype, s.bytes_local, True) for s in out]
    return out


MAX_TILED_RANK = 4  # weights of more dimensions contribute their local and global shapes only


def weight_shapes(params: list[StateParam], devices: int = 1) -> set[tuple[int, ...]]:
    """Every shape a weight (or its gradient) can have on a device: each shard of its global shape over
    ``devices`` (dimension i cut in t_i equal parts, the t_i's product dividing ``devices``), which holds its local
    shape and each partial gather, and the shards XLA cuts along another dimension than the parameter's (a
    gradient of a weight sharded on its rows, resharded on its columns before a data-parallel all-reduce)."""
    shapes = set()
    for p in params:
        shapes |= {squeeze(p.local), squeeze(p.global_dims)}
        if len(p.global_dims) > MAX_TILED_RANK:
            continue
        cuts = [_divisors(math.gcd(g, devices)) for g in p.global_dims]
        for tiles in itertools.product(*cuts):
            if devices % math.prod(tiles) == 0:
                shapes.add(squeeze(tuple(g // t for g, t in zip(p.global_dims, tiles))))
    return shapes


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1 (trial division up to its square root: a pod's device count has few)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass
class AxisEvidence:
    """What runs over one axis: bytes per device per step and op names, by kind of evidence."""

    bytes: dict[str, float] = field(default_factory=dict)
    ops: dict[str, list[str]] = field(default_factory=dict)

    def add(self, kind: str, nbytes: float, op: str) -> None:
        """Count a collective under ``kind``."""
        self.bytes[kind] = self.bytes.get(kind, 0.0) + nbytes
        self.ops.setdefault(kind, []).append(op)


EVIDENCE_TEXT = {
    "weights_gathered": "weights all-gathered before use",
    "weights_gathered_after_update": "updated weights all-gathered",
    "grads_all_reduced": "gradients all-reduced",
    "grads_reduce_scattered": "gradients reduce-scattered",
    "grads_all_reduce_sliced": "gradients all-reduced + dynamic-slice (a reduce-scatter as XLA:CPU lowers it)",
    "activations": "activations all-reduced/gathered/scattered inside layers",
    "activations_tokens": "activations gathered along a token dimension",
    "permute": "activations sent by collective-permute (one hop)",
    "all_to_all": "tokens exchanged by all-to-all",
    "all_to_all_later": "all-to-all outside the forward pass (an MoE's token gradients, or XLA resharding)",
    "weights_other": "weights communicated otherwise",
    "scalars": "scalars reduced (loss, norms)",
    "loop_conditions": "while-loop conditions agreed every iteration (pred all-reduce: each iteration waits for "
                       "every device)",
}


def _leaves(inst: Instruction) -> list[Shape]:
    return [s for s in inst.shape.leaves() if s.element_type != "token" and s.dims]


def collect_evidence(module: HloModule, mesh: Mesh, params: list[StateParam]) -> dict[str, AxisEvidence]:
    """Evidence per axis name from every placed collective (a collective over several axes counts on each)."""
    shapes = weight_shapes(params, mesh.devices)
    out = {a.name: AxisEvidence() for a in mesh.axes}
    users_of: dict[str, dict[str, list[Instruction]]] = {}
    flow = _Flow(module)
    for pc in mesh.collectives:
        comp = module.computations[pc.computation]
        inst = comp.by_name[pc.name]
        users = users_of.setdefault(comp.name, comp.users())
        nbytes = max(pc.collective.bytes_in, pc.collective.bytes_out) * pc.executions
        for kind, share in _kinds(module, comp, users, inst, pc, shapes, flow):
            for axis in pc.axes:
                out[axis].add(kind, nbytes * share, pc.name)
    return out


def _kinds(module: HloModule, comp: Computation, users: dict[str, list[Instruction]], inst: Instruction,
           pc: PlacedCollective, shapes: set[tuple[int, ...]], flow: _Flow) -> list[tuple[str, float]]:
    """The evidence kinds of a collective with the share of its bytes each: one kind, or, for an all-reduce or
    reduce-scatter of a tuple whose parts are read by get-tuple-element (XLA's combiner joins many into one), a
    kind per part from that part's own data flow (s37 trial: a pmap step's 306 kB of weight gradients combined
    with BatchNorm's psums, one of which flows on into the backward convolutions, read as activations: a
    data-parallel ResNet called tensor-parallel)."""
    parts = inst.shape.tuple_shapes
    uses = users.get(inst.name, [])
    if pc.collective.kind not in ("all-reduce", "reduce-scatter") or not parts or len(parts) < 2 \
            or any(p.tuple_shapes is not None for p in parts) or not uses \
            or any(u.opcode != "get-tuple-element" for u in uses):
        return [(_evidence_kind(module, comp, users, inst, pc, shapes, flow), 1.0)]
    total = sum(p.byte_size() for p in parts) or 1
    out: dict[str, float] = {}
    largest = max(range(len(parts)), key=lambda k: parts[k].byte_size())
    for k, part in enumerate(parts):
        mine = ChainMap({inst.name: [u for u in uses if u.tuple_index == k]}, users)
        kind = _evidence_kind(module, comp, mine, inst, pc, shapes, flow, [part] if part.dims else [])
        out[kind] = out.get(kind, 0.0) + part.byte_size() / total
        if k == largest:
            main = kind
    for small in ("scalars", "loop_conditions"):  # a loss riding along a gradient reduction is counted with it
        if small in out and main != small:
            out[main] += out.pop(small)
    return list(out.items())


FLOW_HOPS = 8  # how far a collective's data flow is followed to a matmul (fusions, converts, reshapes between)


class _Flow:
    """The module's phases (computed on first use: only collectives of a weight's shape ask) and which
    instructions are matmuls or loops (a fusion holding one counts)."""

    def __init__(self, module: HloModule) -> None:
        self.module = module
        self._scopes: ModuleScopes | None = None
        self._matmul: dict[tuple[str, str], bool] = {}

    def phase(self, inst: Instruction) -> str:
        """``forward``, ``backward``, ``remat``, ``optimizer`` or ``other`` (module docstring of
        :mod:`traceroof.scopes`)."""
        if self._scopes is None:
            self._scopes = assign_scopes(self.module)
        return self._scopes.get(inst.name).phase

    def matmul_near(self, comp: Computation, start: Instruction, step: Callable[[Instruction], Iterable[Instruction]]
                    ) -> bool:
        """A matmul (or a ``while``, whose body may hold one) among the instructions of ``comp`` reached from
        ``start`` by up to :data:`FLOW_HOPS` repeated ``step`` (its operands: upstream; its users: downstream);
        bounded, as a gradient's way down through the optimizer would otherwise walk the rest of the step once per
        collective."""
        seen, frontier = {start.name}, [start]
        for _ in range(FLOW_HOPS):
            nxt = []
            for inst in frontier:
                for n in step(inst):
                    if n.name in seen:
                        continue
                    seen.add(n.name)
                    key = (comp.name, n.name)
                    if key not in self._matmul:
                        self._matmul[key] = _calls_opcode(self.module, n, MATMULS + ("while",))
                    if self._matmul[key]:
                        return True
                    nxt.append(n)
            frontier = nxt
        return False


def _evidence_kind(module: HloModule, comp: Computation, users: Mapping[str, list[Instruction]], inst: Instruction,
                   pc: PlacedCollective, shapes: set[tuple[int, ...]], flow: _Flow,
                   part: list[Shape] | None = None) -> str:
    """The evidence kind of a collective (module docstring rules), or of one ``part`` of its tuple (its shape;
    ``users`` then gives the collective only that part's readers)."""
    c = pc.collective
    leaves = part if part is not None else _leaves(inst) or [s for s in inst.operand_shapes if s is not None]
    arrays = [s for s in leaves if s.elements > SCALAR_ELEMENTS]
    if not arrays:
        # a predicate reduced inside a while loop: its condition made one over the devices (jnp.any over a sharded
        # batch, as an adaptive solver's "any trajectory not done"), a barrier in every iteration (s38 trial: 12
        # in a diffrax solve on 8 devices, read as "scalars reduced (loss, norms)")
        types = {s.element_type for s in (part if part is not None else inst.shape.leaves())} - {"token"}
        return "loop_conditions" if "/while/" in pc.op_name and types == {"pred"} else "scalars"
    if c.kind in ("all-to-all", "ragged-all-to-all"):
        # an MoE dispatches tokens in the forward pass (and returns their gradients in the backward); all-to-alls
        # in the backward or the update alone may be XLA resharding values (a user's FSDP step: 12 of them on
        # LayerNorm gradients, read as an expert axis): only forward ones make an expert axis
        return "all_to_all" if flow.phase(inst) in ("forward", "remat") else "all_to_all_later"
    weightlike = any(squeeze(s.dims) in shapes for s in arrays)
    if c.kind in ("collective-permute", "send", "recv"):
        return "weights_other" if weightlike else "permute"
    backward = "transpose(" in pc.op_name
    if weightlike and c.kind == "all-gather" and flow.phase(inst) in ("forward", "backward", "remat"):
        weightlike = not flow.matmul_near(comp, inst, lambda i: (comp.by_name[o] for o in i.operands
                                                                 if o in comp.by_name))
    elif c.kind in ("all-reduce", "reduce-scatter") and (weightlike or flow.phase(inst) == "backward"):
        # a weight's shape outside the forward pass, or any array of the backward pass (weight gradients that XLA
        # computes concatenated, as an LSTM cell's four gate kernels in one [4H, H] gradient): gradients when
        # the result feeds no matmul (an activation's gradient flows on into the next backward matmul)
        weightlike = flow.phase(inst) not in ("forward", "remat") and \
            not flow.matmul_near(comp, inst, lambda i: users.get(i.name, ()))
    if weightlike:
        if c.kind == "all-gather":
            # used by a matmul, or by a loop (the micro-batch scan's weights, gathered once before it); 4 users:
            # all-gather -> cast -> cast -> tuple -> while, as XLA:CPU wrote a user's FSDP step
            # or gathered from the step's own input (a norm's scale, read by elementwise ops): not yet updated
            return "weights_gathered" if _reaches(module, comp, users, inst, MATMULS + ("while",), 4) \
                or _of_entry_parameter(module, comp, inst) else "weights_gathered_after_update"
        if c.kind == "reduce-scatter":
            return "grads_reduce_scattered"
        if c.kind == "all-reduce":
            sliced = _reaches(module, comp, users, inst, ("dynamic-slice",), 2)
            return "grads_all_reduce_sliced" if sliced else "grads_all_reduced"
        return "weights_other"
    if c.kind == "all-gather" and not backward:
        dims = inst.attr_ints("dimensions")
        out = arrays[0]
        if dims and dims[0] != len(out.dims) - 1:
            return "activations_tokens"
    return "activations"


@dataclass(frozen=True)
class AxisStrategy:
    """One axis' strategy and the evidence (one line: what runs over it, bytes per device per step, ops)."""

    axis: str
    size: int
    strategy: str
    evidence: str


def classify_axes(mesh: Mesh, evidence: dict[str, AxisEvidence]) -> list[AxisStrategy]:
    """The strategy of every axis (module docstring rules, in that order of precedence)."""
    out = []
    for a in mesh.axes:
        ev = evidence.get(a.name, AxisEvidence())
        b = ev.bytes
        grads = sum(b.get(k, 0.0) for k in GRADIENT_KINDS)
        acts = b.get("activations", 0.0) + b.get("activations_tokens", 0.0)
        inside = "sequence" if b.get("activations_tokens", 0.0) > b.get("activations", 0.0) else "tensor"
        also = ""
        if b.get("all_to_all") or b.get("permute"):
            strategy = "expert" if b.get("all_to_all") else "pipeline"
            if acts > b.get("weights_gathered", 0.0):  # the axis splits layers too (an MoE's attention heads)
                also = f"also {inside} parallelism (activations inside layers); "
        elif acts > b.get("weights_gathered", 0.0) and acts > grads:  # (SyncBN's statistics beside DP gradients)
            strategy = inside
        elif b.get("weights_gathered"):
            strategy = "fsdp"
        elif grads:
            strategy = "data"
        else:
            strategy = "unknown"
        parts = [f"{EVIDENCE_TEXT[k]} ({_mb(v)}, {_names(ev.ops[k])})"
                 for k, v in sorted(b.items(), key=lambda kv: -kv[1])]
        out.append(AxisStrategy(a.name, a.size, strategy, also + "; ".join(parts) or "no collective runs over it"))
    return out


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3g} MB/step" if nbytes >= 1e5 else f"{nbytes / 1e3:.3g} kB/step"


def _names(ops: list[str]) -> str:
    return ", ".join(ops[:3]) + (f" +{len(ops) - 3}" if len(ops) > 3 else "")
