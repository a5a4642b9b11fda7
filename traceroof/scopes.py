"""Every instruction's (scope, phase, source) for one HLO module, computed once per module.

``op_name`` alone (:func:`traceroof.layers.parse_scope`) leaves gaps on real programs; these rules close them,
each from evidence in jax 0.10 HLO of real framework code (flax linen + optax, flax NNX, Equinox,
transformers FlaxGPT2, Keras on JAX):

1. **Names from the fusion body.** A fusion without ``op_name`` (XLA CPU's ``transpose_copy_fusion`` feeding a
   weight-gradient convolution) takes the name of a named instruction in its fused computation: a dot /
   convolution / custom-call first, else the named instruction nearest the root. A bare compiler name
   (``op_name="reduce_sum"``, a parameter's ``"st.step"``) counts as no name, and so does a bitcast / reshape of
   a fused parameter named after the fusion's operand (the producer's name, which XLA copies onto its views).
   A named fusion that holds a named dot / convolution / custom-call takes that one's name too: XLA names a
   fusion after its root, and a matmul with its epilogue fused in (the head's dot and the loss's max) is the
   matmul's work.
2. **Names from neighbours.** Ops still unnamed inherit scope and phase from their users (in rounds, each
   reading only the previous round's labels, until nothing changes), then from their operands (one round, then
   users again), then from the instruction that calls their computation. An unnamed weight-gradient dot /
   convolution takes the layer that reads the parameter it differentiates (:func:`_weight_gradients`). An
   unnamed dot / convolution takes a collective's label (an all-to-all, the slices XLA CPU cuts for it) only
   when no other neighbour has one (:func:`_collective_parts`).
3. **Scopes from stack frames.** Where the named scopes are missing (Flax NNX writes none: its ops are
   ``jit(step)/jvp()/dot_general``) or generic library names (Equinox writes ``eqx.nn.MLP/eqx.nn.Linear``
   for the user's ``Block``), the scope comes from the metadata's ``stack_frame_id`` chain: model class methods
   (``Block.__call__`` in the user's files, ``Linear.__call__`` in a layer library such as ``flax/nnx/nn`` or
   ``equinox/nn``), outermost first, rendered as their class names (``Model/Block/MLP/Linear``). Frames are
   read from the innermost outwards: library frames that are not model classes are skipped; after the first
   model class, the first user frame that is not a method (the loss closure, ``step``) ends the path.
4. **Optimizer phase.** An op outside the differentiated function (no ``jvp(``/``transpose(`` in its name) is
   ``optimizer`` when (a) one of its stack frames lies in an optimizer library (``optax/`` except
   ``optax/losses``, ``flax/training/``, ``flax/nnx/training/``, ``keras/src/optimizers/``,
   ``equinox/_update``), or (b) it feeds only parameter updates: in a module with backward ops, an entry output
   aliased to a parameter by ``input_output_alias`` — or, with no aliasing, an output with the shape of an entry
   parameter it is computed from — that depends on a backward op is an update (new weights, Adam's ``mu`` /
   ``nu``); walking back from the updates through ops outside the differentiated function (stopping at the
   gradient) finds the optimizer ops, keeping those whose every user is an optimizer op or an update output.
   The ``optimizer_pattern`` scope regex still wins. Optimizer ops without a model scope get
   ``(optimizer)``.
5. **Backward from the data flow.** Ops outside the differentiated function that compute only from gradients
   (the data-parallel gradient all-reduce after ``value_and_grad``) are ``backward``
   (:func:`_gradient_results`).
6. **Random numbers outside the model.** jax.random work outside any layer (the step's key folding, a batch
   generated inside the step annotation) is layer ``(rng)``, phase ``other``: neither forward nor backward work
   of the model. A dropout's own bits stay in its layer's forward.

Repeated blocks (``h/0``…``h/11``, ``Block_3``, ``layers_2``) are found here too, since telling a block stack
from ``Conv_0``/``Conv_1`` needs the HLO: instances (a numbered scope with child scopes, or a stack of 3 or more
without) collapse when their dot / convolution ops — relative scope, phase (remat counted as forward: XLA may
CSE a recomputation away), opcode and shape — are the same. Frame scopes have no instance names: a class called
from several call sites is numbered per call site (:func:`_number_call_sites`), a list of blocks called in a
loop is split by the data flow (:func:`_frame_instances`).

Labels inherited from a neighbour carry no source line: the ``source`` of an op is its own metadata's or empty.
"""

from __future__ import annotations

import re
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from parsers.hlo import Computation, HloModule, Instruction, StackFrame
from traceroof.layers import (COMBINED_SCOPE, DEFAULT_OPTIMIZER_PATTERN, NO_SCOPE, OTHER_PHASE, TOP_LEVEL, is_combined,
                              is_rng, parse_scope, phase_of)

OPTIMIZER_SCOPE = "(optimizer)"
RNG_SCOPE = "(rng)"
# files whose frames mark optimizer code (outside the differentiated function)
OPTIMIZER_FILES = re.compile(r"(^|/)(optax/(?!losses/)|flax/training/|flax/nnx/training/|keras/src/optimizers/|"
                             r"keras/src/backend/\w+/optimizer|equinox/_update)")
# files of layer libraries whose ``Class.method`` frames are model classes
MODEL_LIBRARY_FILES = re.compile(r"(^|/)(flax/linen|flax/nnx/nn|flax/nnx/bridge|equinox/nn|keras/src/layers|"
                                 r"keras/src/models|transformers/models|haiku/_src|praxis/layers)/")
# wrapper machinery inside those libraries (module base classes, transforms)
NOT_MODEL_FILES = re.compile(r"(^|/)(flax/linen/(module|transforms|scan|partitioning|summary)\.py|"
                             r"keras/src/layers/layer\.py|keras/src/models/(functional|model|sequential)\.py|"
                             r"haiku/_src/(module|transform|stateful)\.py)$")
# third-party or interpreter files: not the user's code
LIBRARY_FILES = re.compile(r"(site-packages|dist-packages)/|/lib/python3[.\d]*/|(^|/)(jax|jaxlib)/_src/|^<")
_METHOD = re.compile(r"([A-Za-z_]\w*)\.([A-Za-z_]\w*)")  # ``Block.__call__`` (not ``f.<locals>.g``)
# a scope segment that is a library's dotted class path (``eqx.nn.MLP``), not a user-given name
_GENERIC_SEGMENT = re.compile(r"[a-z_]\w*(\.[a-z_]\w*)*\.[A-Z]\w*")
_PRIORITY_OPCODES = ("convolution", "dot", "custom-call")
_GRAD_WRAPPERS = ("jvp(", "transpose(")
_NUMBERED = re.compile(r"(.*[A-Za-z])_(\d+)")  # ``Block_3``, ``layers_2``
_STRUCTURAL = frozenset({"tuple", "get-tuple-element", "parameter", "constant"})


@dataclass(frozen=True)
class ScopeInfo:
    """Scope path, phase and source line of one instruction, and how the scope was found: ``op_name``,
    ``fused`` (a fused instruction's name), ``user`` / ``operand`` / ``caller`` (a neighbour's), ``frames``
    (stack frames), or ``none``."""

    scope: str
    phase: str
    source: str = ""
    how: str = "op_name"
    in_grad: bool = False  # inside the differentiated function (``jvp(`` / ``transpose(`` in the name)


@dataclass(frozen=True)
class ModuleScopes:
    """Scopes of one module: ``infos`` by instruction name; ``repeats`` maps each repeated-block instance scope
    (``M/transformer/h/0``) to its collapsed form (``M/transformer/h/*``)."""

    infos: Mapping[str, ScopeInfo]
    repeats: Mapping[str, str] = field(default_factory=dict)

    def get(self, name: str) -> ScopeInfo:
        """The instruction's scope info (``(no scope)`` for an unknown name)."""
        return self.infos.get(name) or ScopeInfo(NO_SCOPE, "forward", how="none")


def _named(inst: Instruction) -> bool:
    """True when the instruction carries a framework path (not a bare compiler or parameter name)."""
    name = inst.metadata.op_name
    return "/" in name and "/" in name.partition(";")[0]


def _fused_carrier(module: HloModule, comp_name: str, inherited: frozenset[str] = frozenset(),
                   depth: int = 0) -> Instruction | None:
    """The instruction of a fused computation whose metadata names the fusion: a named dot / convolution /
    custom-call first, else the named instruction nearest the root (breadth first over operands).

    ``inherited``: the ``op_name`` of the fusion's operands. A bitcast or reshape of a fused parameter bearing
    one of them carries its producer's name, not this fusion's: XLA copies an operand's metadata onto the view it
    makes of it. Such a view does not name the fusion (XLA CPU's unnamed ``transpose_copy_fusion`` feeding a
    backward convolution has only a bitcast named after the forward op that made its operand; it is the
    backward's, by its users)."""
    comp = module.computations.get(comp_name)
    if comp is None or comp.root is None or depth > 8:
        return None
    matmul = _fused_matmul(module, comp_name)
    if matmul is not None:
        return matmul
    seen, queue = {comp.root.name}, [comp.root]
    while queue:
        inst = queue.pop(0)
        if _named(inst) and not (inst.metadata.op_name in inherited and inst.opcode in ("bitcast", "reshape")
                                 and all(getattr(comp.by_name.get(o), "opcode", "") == "parameter"
                                         for o in inst.operands)):
            return inst
        if inst.opcode == "fusion":
            for c in inst.called:
                found = _fused_carrier(module, c, depth=depth + 1)
                if found is not None:
                    return found
        for op in inst.operands:
            src = comp.by_name.get(op)
            if src is not None and src.name not in seen:
                seen.add(src.name)
                queue.append(src)
    return None


def _fused_matmul(module: HloModule, comp_name: str) -> Instruction | None:
    """The named dot / convolution / custom-call of a fused computation (:data:`_PRIORITY_OPCODES` order), which
    names a fusion that is named after its epilogue: XLA CPU fused the head's dot (``jvp(head)/dot_general``) and
    the loss's log-softmax max into one fusion named ``jvp(loss)/.../reduce_max``, so the head's 33 MFLOP went to
    the loss (s35 trial). Only a fusion's own computation is read (no nested fusions)."""
    comp = module.computations.get(comp_name)
    for opcode in _PRIORITY_OPCODES if comp is not None else ():
        for inst in comp.instructions:
            if inst.opcode == opcode and _named(inst):
                return inst
    return None


def _spanned(module: HloModule, fusion: Instruction, info: ScopeInfo, frames: _Frames, optimizer_pattern: str,
             seen: dict[tuple, tuple[ScopeInfo, bool]]) -> ScopeInfo:
    """``info`` of a fusion, or, where its fused computation holds named dots / convolutions of several layers
    (XLA:CPU's XNNPACK fusion of a whole inference forward: a Keras CNN's evaluation step, convolutions and dense
    layers of 13 scopes in one fusion, s42 trial), the layers' common scope or :data:`COMBINED_SCOPE`: its time
    cannot be split between them, and the first layer's name charged all of it to that layer."""
    scopes = set()
    for n in fusion.called:
        comp = module.computations.get(n)
        for inst in comp.instructions if comp is not None else ():
            if inst.opcode in ("convolution", "dot") and _named(inst):
                md = inst.metadata
                key = (md.op_name, md.stack_frame_id, md.source_file, md.source_line, "fused")
                got = seen.get(key)
                if got is None:
                    got = seen[key] = _info(module, inst, frames, "fused", optimizer_pattern)
                scopes.add(got[0].scope)
    if len(scopes) < 2:
        return info
    return ScopeInfo(_common_prefix(sorted(scopes)) or COMBINED_SCOPE, info.phase, "", "fused", info.in_grad)


class _Frames:
    """Stack-frame chains of a module. The printed ``parent_frame_id`` of jax 0.10 HLO text is the proto's
    value + 1 (frame 1 prints parent 1 where the proto says 0 = root); frames are created parents first, so the
    reading (offset 0 or 1) under which parents precede their children is the one used."""

    def __init__(self, frames: Mapping[int, StackFrame]) -> None:
        self.frames = frames
        fits = {d: sum(1 for i, f in frames.items() if 0 <= f.parent_frame_id - d < i) for d in (0, 1)}
        self.offset = 1 if fits[1] > fits[0] else 0
        self._paths: dict[int, tuple[str, bool]] = {}
        self.sites: dict[tuple[str, int, int], int] = {}  # call site (file, line, column) -> the paths' ``@<id>``

    def chain(self, fid: int) -> list[StackFrame]:
        """Frames from the innermost (``fid``) outwards."""
        out, seen = [], set()
        while fid and fid in self.frames and fid not in seen:
            seen.add(fid)
            f = self.frames[fid]
            out.append(f)
            fid = f.parent_frame_id - self.offset
        return out

    def resolve(self, fid: int) -> tuple[str, bool]:
        """(model path from the frames, whether a frame lies in an optimizer library). Each class below the
        outermost carries its call site as ``@<id>`` (see :func:`_number_call_sites`)."""
        if fid not in self._paths:
            chain = self.chain(fid)
            path = "/".join(c if site is None else f"{c}@{self.sites.setdefault(site, len(self.sites))}"
                            for c, site in _model_path(chain))
            self._paths[fid] = (path, any(OPTIMIZER_FILES.search(f.file_name) for f in chain))
        return self._paths[fid]


def _model_path(chain: list[StackFrame]) -> list[tuple[str, tuple[str, int, int] | None]]:
    """(class name, call site) of the model-class frames of a chain (innermost first), outermost first. The call
    site (file, line, column) is the first model or user frame outside the class's methods (``self.stem(x)`` in
    ``Net.__call__``); None for the outermost class."""
    classes: list[list] = []  # [class, site]
    for f in chain:
        parts = f.function_name.split(".")  # qualified: ``make.<locals>.Block.__call__`` is a method of Block
        m = _METHOD.fullmatch(".".join(parts[-2:])) if len(parts) >= 2 and parts[-2] != "<locals>" else None
        library = bool(LIBRARY_FILES.search(f.file_name))
        model = m is not None and (not library or (bool(MODEL_LIBRARY_FILES.search(f.file_name))
                                                   and not NOT_MODEL_FILES.search(f.file_name)))
        if classes and classes[-1][1] is None and (model or not library) \
                and not (model and classes[-1][0] == m.group(1)):
            classes[-1][1] = (f.file_name, f.line, f.column)
        if model:
            if not classes or classes[-1][0] != m.group(1):
                classes.append([m.group(1), None])
        elif classes and not library and not _in_model_method(parts):
            break  # the first user frame outside the model (loss closure, train step) ends the path
    if classes:
        classes[-1][1] = None
    return [(c, site) for c, site in reversed(classes)]


_MODEL_CALLS = frozenset({"__call__", "call", "forward"})  # a model's forward method (Flax / Equinox, Keras, torch)


def _in_model_method(qualname_parts: list[str]) -> bool:
    """Whether a frame's function is a closure defined in a model's forward method
    (``Transformer.__call__.<locals>.body``, the body a model passes to ``lax.scan``): part of that model's code,
    so the path goes on to the method's class (``Transformer/Block``, as a Python loop over the blocks gives, not
    ``Block``). A closure in another method (``Trainer.train.<locals>.loss_fn``) still ends the path."""
    if "<locals>" not in qualname_parts:
        return False
    owner = qualname_parts[:qualname_parts.index("<locals>")]
    return len(owner) >= 2 and owner[-1] in _MODEL_CALLS and _METHOD.fullmatch(".".join(owner[-2:])) is not None


_SITE = re.compile(r"(.+)@(\d+)")


def _number_call_sites(infos: dict[str, ScopeInfo], sites: Mapping[tuple[str, int, int], int],
                       schedule: Sequence[str] = ()) -> None:
    """Distinct instances of one class called from distinct places: a class called at two or more call sites
    under the same parent (``self.stem(x)`` and ``self.stage2(x)``, both ``ConvBNBlock``, in
    ``SmallConvNet.__call__``) becomes ``ConvBNBlock_0``, ``ConvBNBlock_1``, numbered in call-site order (file,
    then line: the order of the calls in the caller's code; two calls on one line, ``self.down(relu(self.up(x)))``,
    told apart by their columns, in the order their first ops run in ``schedule``, the entry computation's
    op names without its parameters); a class called from one place keeps its name.

    Why this naming: the metadata carries no attribute names (NNX / Equinox write no scopes) and the user's source
    is not read, so ``stem`` cannot be recovered; ``ConvBNBlock@net.py:24`` puts a line number where a reader
    looks for a layer; ``ConvBNBlock_0`` / ``_1`` is Flax linen's own naming of unnamed submodules
    (``Conv_0``, ``Conv_1``), which readers know. Numbered instances of the same shapes with parts of their own
    are repeated blocks and collapse into ``ConvBNBlock_*`` with the spread across instances (``_repeats``);
    instances of different shapes stay separate rows, so two different layers are never summed into one row
    that looks like one layer. A block list called in a loop has one call site: ``_frame_instances`` splits it."""
    first_run: dict[int, int] = {}  # site id -> position in the schedule of the first op under it
    for k, name in enumerate(schedule):
        info = infos.get(name)
        for seg in info.scope.split("/") if info is not None and "@" in info.scope else ():
            m = _SITE.fullmatch(seg)
            if m:
                first_run.setdefault(int(m.group(2)), k)
    order = {i: (site[0], site[1], first_run.get(i, len(schedule)), i) for site, i in sites.items()}
    parsed: dict[str, list[tuple[str, int | None]]] = {}
    for scope in {i.scope for i in infos.values() if "@" in i.scope}:
        segs = []
        for seg in scope.split("/"):
            m = _SITE.fullmatch(seg)
            segs.append((m.group(1), int(m.group(2))) if m else (seg, None))
        parsed[scope] = segs
    # number outermost first, so that a parent's name is final before its children are grouped under it
    depth = max((len(v) for v in parsed.values()), default=0)
    names = {scope: [c for c, _ in segs] for scope, segs in parsed.items()}
    for d in range(depth):
        by_parent: dict[tuple[str, str], set[int]] = {}
        for scope, segs in parsed.items():
            if d < len(segs) and segs[d][1] is not None:
                by_parent.setdefault(("/".join(names[scope][:d]), segs[d][0]), set()).add(segs[d][1])
        for scope, segs in parsed.items():
            if d < len(segs) and segs[d][1] is not None:
                ids = by_parent[("/".join(names[scope][:d]), segs[d][0])]
                if len(ids) > 1:
                    k = sorted(ids, key=lambda i: order[i]).index(segs[d][1])
                    names[scope][d] = f"{segs[d][0]}_{k}"
    renamed = {scope: "/".join(n) for scope, n in names.items()}
    for name, i in infos.items():
        if i.scope in renamed:
            infos[name] = ScopeInfo(renamed[i.scope], i.phase, i.source, i.how, i.in_grad)


def _generic(scope: str) -> bool:
    """A scope made only of library class paths (``eqx.nn.MLP/eqx.nn.Linear``) or no scope at all."""
    if scope in (NO_SCOPE, TOP_LEVEL):
        return True
    return all(_GENERIC_SEGMENT.fullmatch(s) for s in scope.split("/"))


def _info(module: HloModule, carrier: Instruction, frames: _Frames, how: str, optimizer_pattern: str
          ) -> tuple[ScopeInfo, bool]:
    """Scope info from the carrier's metadata, and whether its frames touch an optimizer library."""
    op_name = carrier.metadata.op_name
    scope, phase = parse_scope(op_name, optimizer_pattern)
    path, in_opt_lib = frames.resolve(carrier.metadata.stack_frame_id) if carrier.metadata.stack_frame_id \
        else ("", False)
    if path and _generic(scope):
        # an op XLA's combiner made of unnamed parts carries the first part's frame only: its operands decide
        scope, how = (scope, "combined") if is_combined(op_name) else (path, "frames")
    if scope in (NO_SCOPE, TOP_LEVEL) and is_rng(op_name):
        scope = RNG_SCOPE
    in_grad = any(w in op_name for w in _GRAD_WRAPPERS)
    return ScopeInfo(scope, phase, module.source_line(carrier), how, in_grad), in_opt_lib


def _contractions(module: HloModule) -> set[str]:
    """Names of the dots and convolutions of ``module`` and of the fusions whose fused computation holds one."""
    holds = {name for name, comp in module.computations.items()
             if any(i.opcode in ("dot", "convolution") for i in comp.instructions)}
    return {i.name for comp in module.computations.values() for i in comp.instructions
            if i.opcode in ("dot", "convolution") or (i.opcode == "fusion" and holds.intersection(i.called))}


_CONTRACTION_PRIMITIVES = ("dot_general", "conv_general_dilated")


def _names_contraction(inst: Instruction) -> bool:
    """Whether ``inst`` carries a JAX contraction's own ``op_name`` (``.../conv_in/conv_general_dilated``): XLA's
    copy or transpose of an unnamed dot / convolution's result keeps the metadata its producer lost."""
    return inst.metadata.op_name.rsplit("/", 1)[-1] in _CONTRACTION_PRIMITIVES


def _inherit(comp: Computation, infos: dict[str, ScopeInfo], users: dict[str, list[Instruction]],
             contractions: set[str] = frozenset(), weight_grads: Mapping[str, ScopeInfo] | None = None,
             parts: set[str] = frozenset(), data_grads: Mapping[str, ScopeInfo] | None = None) -> bool:
    """Label unlabelled instructions from labelled users until none changes, then from operands (one round, then
    users again); True if any changed. Users come first because an op XLA made without metadata serves its
    users (the argmax ``reduce-window`` of a max pool's ``select_and_scatter`` is that backward op's, though it
    reads the forward activations). An unnamed weight-gradient dot / convolution takes the label of
    ``weight_grads`` (the layer reading the parameter it differentiates, see :func:`_weight_gradients`); one fed
    by the backward pass takes that of ``data_grads`` where it multiplies a layer's weight (the gradient of the
    layer's input), else of an operand from the backward pass: it computes a gradient (a weight-gradient
    convolution whose user is the optimizer's gradient clipping is not optimizer). An unnamed dot / convolution
    takes the label of a collective (``parts``, see :func:`_collective_parts`) only where no other neighbour has
    one. Inherited labels carry no source line (the op has none)."""
    changed = False
    wait = True  # contractions wait for all their operands' labels before taking a user's
    operands = False  # whether this round may read operands
    todo = comp.instructions  # the unlabelled ones, in order (labels are only added)
    while True:
        todo = [inst for inst in todo if inst.name not in infos]
        if not todo:  # every round would change nothing
            return changed
        new: dict[str, ScopeInfo] = {}
        deferred = False
        for inst in todo:
            if weight_grads and inst.name in weight_grads:
                new[inst.name] = weight_grads[inst.name]
                continue
            weak = parts if inst.name in contractions else frozenset()  # witnesses of last resort
            last: tuple[ScopeInfo, str] | None = None  # the first of them, taken when no other neighbour has one
            src = None
            how = "operand"
            if inst.name in contractions:  # its result's layout copy, named after it, knows its layer; else,
                src = next((infos[u.name] for u in users.get(inst.name, ()) if u.name in infos
                            and infos[u.name].phase == "backward" and _names_contraction(u)), None)
                how = "user" if src is not None else "operand"
            if inst.name in contractions and src is None:  # an unnamed matmul fed by the backward pass: a gradient
                grads = [o for o in inst.operands if o in infos and infos[o].in_grad and infos[o].phase == "backward"]
                src = data_grads.get(inst.name) if grads and data_grads else None
                how = "weight" if src is not None else how
                src = src or next((infos[o] for o in grads if o not in weak), None)
                last = (infos[grads[0]], "operand") if grads else None
                if src is None and wait and any(o not in infos for o in inst.operands):
                    deferred = True
                    continue
            if src is None:
                near = [u.name for u in users.get(inst.name, ()) if u.name in infos]
                src = next((infos[u] for u in near if u not in weak), None)
                last = last or ((infos[near[0]], "user") if near else None)
                how = "user"
            if src is None and operands:
                near = [o for o in inst.operands if o in infos]
                src = next((infos[o] for o in near if o not in weak), None)
                how = "operand"
                last = last or ((infos[near[0]], "operand") if near else None)
                if src is None and last is not None:
                    src, how = last
            if src is not None:
                new[inst.name] = ScopeInfo(src.scope, src.phase, "", how, src.in_grad)
        if new:
            infos.update(new)
            changed = True
            operands = False
        elif not operands:
            operands = True
        elif deferred and wait:
            wait, operands = False, False
        else:
            return changed


def _forward(info: ScopeInfo | None) -> bool:
    return info is not None and info.phase == "forward" and info.in_grad


def _fused_forward_reader(module: HloModule, fusion: Instruction, operand: str, infos: Mapping[str, ScopeInfo],
                          users_of: Mapping[str, dict[str, list[Instruction]]]) -> ScopeInfo | None:
    """The label of a forward op of the differentiated function inside ``fusion``'s fused computation that reads
    ``operand`` (through unlabelled fused ops), if any: XLA fuses a forward bias-add and ReLU into the backward
    fusion that also computes the ReLU's gradient, and that fusion is then the forward convolution's only user.
    ``users_of``: each computation's :meth:`~parsers.hlo.Computation.users`, by name."""
    numbers = {k for k, o in enumerate(fusion.operands) if o == operand}
    for name in fusion.called:
        comp = module.computations.get(name)
        if comp is None:
            continue
        users = users_of.get(name, {})
        todo = [i.name for i in comp.instructions if i.parameter_number in numbers]
        seen = set(todo)
        while todo:
            for u in users.get(todo.pop(), ()):
                info = infos.get(u.name)
                if _forward(info):
                    return info
                if info is None and u.name not in seen:
                    seen.add(u.name)
                    todo.append(u.name)
    return None


def _forward_feeders(module: HloModule, comp: Computation, infos: dict[str, ScopeInfo],
                     users_of: Mapping[str, dict[str, list[Instruction]]], skip: Mapping[str, ScopeInfo],
                     parts: set[str] = frozenset(), contractions: set[str] = frozenset()) -> None:
    """Label forward every unlabelled instruction whose result reaches a labelled forward op of the
    differentiated function (``jvp(`` in its name) through unlabelled ops only, inside fusions too
    (:func:`_fused_forward_reader`): data flows forward -> backward -> update, never back, so such an op is
    forward whatever else reads it (an input's layout copy is read by the forward convolution and by the
    weight-gradient one; without this rule the first labelled user, often the backward one, won). Its scope is
    that forward op's; for a dot / convolution (``contractions``) whose forward users are all collectives
    (``parts``, see :func:`_collective_parts`), the scope of a forward operand that is not one, else the
    collective's.
    ``users_of``: each computation's users, by name; ``skip``: instructions labelled otherwise (weight
    gradients)."""
    users = users_of[comp.name]
    found: dict[str, ScopeInfo] = {}
    for inst in reversed(comp.instructions):  # users come after their operands
        if inst.name in infos or inst.name in skip:
            continue
        weak = parts if inst.name in contractions else frozenset()
        last = None  # a collective's label
        for u in users.get(inst.name, ()):
            i = infos.get(u.name) or found.get(u.name)
            if not _forward(i) and u.opcode == "fusion":
                i = _fused_forward_reader(module, u, inst.name, infos, users_of)
            if _forward(i) and u.name in weak:
                last = last or i
            elif _forward(i):
                found[inst.name] = ScopeInfo(i.scope, "forward", "", "user", True)
                break
        else:
            if last is not None:
                i, how = next(((infos[o], "operand") for o in inst.operands
                               if o not in weak and _forward(infos.get(o))), (last, "user"))
                found[inst.name] = ScopeInfo(i.scope, "forward", "", how, True)
    infos.update(found)


def _collective_parts(module: HloModule) -> set[str]:
    """Names of the collectives of ``module`` and of the ops that carry a collective's ``op_name`` in its
    computation (XLA CPU cuts an all-to-all's operand into per-peer slices before it and concatenates the
    pieces after it, all named after it).

    Why a dot / convolution that lost its metadata does not take their label: a pass that drops metadata
    rebuilds an op as ops of its own kind (jax 0.10 XLA CPU: an einsum's batched ``dot_general`` becomes a plain
    dot inside a ``ynn_fusion``, both unnamed), and a collective only moves data, so no matmul was made from
    one. Where a collective is a neighbour, the matmul sits at a scope boundary, and the
    neighbour on its other side is the witness: in an MoE block, ``y = h @ w2`` ends ``expert_ffn`` and
    ``all_to_all(y)`` in ``combine`` follows (the producer ``h`` is ``expert_ffn``'s); ``xin @ w1`` begins
    ``expert_ffn`` after ``dispatch``'s all-to-all (the user, ``gelu``, is ``expert_ffn``'s); the backward
    pass meets them in reverse order."""
    out: set[str] = set()
    for comp in module.computations.values():
        names = {i.metadata.op_name for i in comp.instructions if _collective(i.opcode) and _named(i)}
        out |= {i.name for i in comp.instructions if _collective(i.opcode) or _named(i) and i.metadata.op_name in names}
    return out


def _params_read(entry: Computation, inst: Instruction) -> set[str]:
    """The entry parameters ``inst`` reads through single-operand ops (copies, transposes of the weights)."""
    out = set()
    for o in inst.operands:
        x, depth = entry.by_name.get(o), 0
        while x is not None and depth < 4:
            if x.opcode == "parameter":
                out.add(x.name)
                break
            ops = [y for y in x.operands if y in entry.by_name and entry.by_name[y].opcode != "constant"]
            if len(ops) != 1:
                break
            x, depth = entry.by_name[ops[0]], depth + 1
    return out


def _weight_gradients(entry: Computation, infos: Mapping[str, ScopeInfo], contractions: set[str]
                      ) -> tuple[dict[str, ScopeInfo], dict[str, ScopeInfo]]:
    """Labels of the unnamed dots / convolutions of the entry computation that are weight gradients, and of those
    that may be input gradients. A weight gradient: one whose users (up to 3 ops on, the nearest that do: the
    optimizer's update) read an entry parameter with as many elements as it has, read in the differentiated
    forward pass by ops of one scope only, is that scope's backward (XLA CPU's weight-gradient convolution of a
    conv kernel has no metadata; its operands are the layer's input and the gradient of its output, which the
    neighbours would give to the next layer's backward). An input gradient: one that reads such a parameter
    itself (through copies, transposes, reverses of the kernel) is that scope's backward where the backward pass
    feeds it (:func:`_inherit` checks; the s41 trial's Equinox UNet: the convolution computing a conv's input
    gradient was labelled by its other operand, the next GroupNorm's gradient: 209 of 882 MFLOP per step in
    GroupNorm and UNet rows)."""
    owners: dict[str, set[str]] = {}  # parameter -> scopes of the forward ops that read it
    for inst in entry.instructions:
        i = infos.get(inst.name)
        if i is None or not i.in_grad or i.phase != "forward" or i.scope.startswith("(") or \
                inst.opcode in _STRUCTURAL:
            continue
        for p in _params_read(entry, inst):
            owners.setdefault(p, set()).add(i.scope)
    if not owners:
        return {}, {}
    users = entry.users()
    out: dict[str, ScopeInfo] = {}
    data: dict[str, ScopeInfo] = {}
    for inst in entry.instructions:
        if inst.name in infos or inst.name not in contractions or inst.shape.is_tuple:
            continue
        read = {s for p in _params_read(entry, inst) for s in owners.get(p, ())}
        if len(read) == 1:
            data[inst.name] = ScopeInfo(read.pop(), "backward", "", "weight", True)
        scopes: set[str] = set()
        frontier, seen = [inst.name], {inst.name}
        for _ in range(3):
            frontier = [u.name for f in frontier for u in users.get(f, ()) if u.name not in seen
                        and not seen.add(u.name)]
            for f in frontier:
                for p in _params_read(entry, entry.by_name[f]):
                    if entry.by_name[p].shape.elements == inst.shape.elements:
                        scopes |= owners.get(p, set())
            if scopes:  # the nearest update: farther on, a global-norm clip links every parameter's update
                break
        if len(scopes) == 1:
            out[inst.name] = ScopeInfo(scopes.pop(), "backward", "", "weight", True)
            data.pop(inst.name, None)
    return out, data


_COLLECTIVES = frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                          "collective-broadcast", "ragged-all-to-all"})
_MOVES = frozenset({"get-tuple-element", "bitcast", "copy", "reshape", "transpose", "convert", "tuple"})


def _collective(opcode: str) -> bool:
    return opcode.removesuffix("-start").removesuffix("-done") in _COLLECTIVES


def _moves(module: HloModule, inst: Instruction, depth: int = 0) -> bool:
    """A collective, or an op that only moves or reshapes data (a fusion by its root)."""
    if inst.opcode == "fusion":
        comps = [module.computations.get(c) for c in inst.called]
        return depth < 4 and all(c is not None and c.root is not None and _moves(module, c.root, depth + 1)
                                 for c in comps)
    return _collective(inst.opcode) or inst.opcode in _MOVES


def _gradient_results(module: HloModule, infos: dict[str, ScopeInfo], moves_only: bool) -> None:
    """Ops outside the differentiated function that compute only from gradients are backward: a ``forward``
    op (not in the differentiated function, so labelled ``forward`` by default) whose data operands (constants
    aside) are all ``backward`` results; a variadic collective (one all-reduce of several arrays, as XLA's
    combiner makes) when its backward operands carry most of its bytes (the loss riding along with the
    gradients), and a ``get-tuple-element`` of one by the operand it selects. This is the data-parallel
    gradient all-reduce after ``value_and_grad`` (``jax.lax.pmean(grads, "batch")``: no ``transpose(`` in its
    name), which belongs to the backward pass. A forward op never reads a backward result within one step, so
    no forward work moves. Run twice: with ``moves_only`` (collectives and data movement) before the optimizer
    is found, so that the optimizer's data flow stops at the synchronised gradient, then for every op left
    ``forward`` (a gradient norm logged as a metric)."""
    fused = {c for comp in module.computations.values() for i in comp.instructions if i.opcode == "fusion"
             for c in i.called}
    for comp in module.computations.values():
        if comp.name in fused:
            continue
        for inst in comp.instructions:  # text order: operands first, so chains follow
            i = infos.get(inst.name)
            if i is None or i.phase != "forward" or i.in_grad or inst.opcode in ("parameter", "constant") \
                    or (moves_only and not _moves(module, inst)):
                continue
            data = [comp.by_name[o] for o in inst.operands
                    if o in comp.by_name and comp.by_name[o].opcode not in ("constant", "iota")]
            if inst.opcode == "get-tuple-element" and data and _collective(data[0].opcode) \
                    and len(data[0].operands) > 1:
                k = inst.tuple_index
                src = data[0]
                data = [comp.by_name[src.operands[k]]] if 0 <= k < len(src.operands) \
                    and src.operands[k] in comp.by_name else []
            if not data:
                continue
            back = [infos.get(d.name) is not None and infos[d.name].phase == "backward" for d in data]
            if _collective(inst.opcode) and len(data) > 1:
                sizes = [d.shape.byte_size() for d in data]
                grad = 2 * sum(b for b, f in zip(sizes, back) if f) > sum(sizes)
            else:
                grad = all(back)
            if grad:
                infos[inst.name] = ScopeInfo(i.scope, "backward", i.source, "gradient", False)


def _alias_outputs(module: HloModule) -> dict[int, int]:
    """``input_output_alias``: top-level output index -> parameter number."""
    out = {}
    for m in re.finditer(r"\{\s*(\d*)[^}]*\}\s*:\s*\(\s*(\d+)", module.attrs.get("input_output_alias", "")):
        out[int(m.group(1) or 0)] = int(m.group(2))
    return out


def _update_optimizer(module: HloModule, infos: dict[str, ScopeInfo]) -> set[str]:
    """Entry instructions that feed only parameter updates (rule 4b), by name."""
    entry = module.entry
    if entry.root is None or not any(i.phase == "backward" for i in infos.values()):
        return set()
    outputs = entry.results()
    params = entry.parameters()
    # forward pass in text order (operands first): which parameters (bit mask) and whether a backward op
    # each instruction depends on
    mask: dict[str, int] = {}
    grad: dict[str, bool] = {}
    for inst in entry.instructions:
        n = inst.parameter_number
        mask[inst.name] = (1 << n) if n >= 0 else 0
        info = infos.get(inst.name)
        grad[inst.name] = info is not None and info.phase == "backward"
        for op in inst.operands:
            mask[inst.name] |= mask.get(op, 0)
            grad[inst.name] = grad[inst.name] or grad.get(op, False)
    alias = _alias_outputs(module)
    by_name = entry.by_name
    updates: set[str] = set()
    for i, out in enumerate(outputs):
        inst = by_name.get(out)
        if inst is None or inst.opcode == "parameter" or not grad.get(out):
            continue
        if i in alias or any(mask[out] >> n & 1 and p.shape.element_type == inst.shape.element_type
                             and p.shape.dims == inst.shape.dims for n, p in params.items()):
            updates.add(out)
    if not updates:
        return set()
    cand: set[str] = set()
    stack = list(updates)
    while stack:  # walk back from the updates, stopping at the differentiated function (the gradient)
        n = stack.pop()
        inst = by_name.get(n)
        info = infos.get(n)
        if n in cand or inst is None or inst.opcode == "parameter" or info is None or info.in_grad \
                or info.phase in ("backward", "remat"):
            continue
        cand.add(n)
        stack.extend(inst.operands)
    users = entry.users()
    root = entry.root.name
    other_outputs = {o for o in outputs if o not in updates}
    work = list(cand)
    while work:  # keep ops whose every user is an optimizer op or the root (at update positions only)
        n = work.pop()
        if n in cand and (n in other_outputs
                          or any(u.name not in cand and u.name != root for u in users.get(n, ()))):
            cand.discard(n)
            work.extend(o for o in by_name[n].operands if o in cand)
    return cand


_ASSIGNED: weakref.WeakKeyDictionary[HloModule, dict[str, ModuleScopes]] = weakref.WeakKeyDictionary()


def assign_scopes(module: HloModule, optimizer_pattern: str = DEFAULT_OPTIMIZER_PATTERN) -> ModuleScopes:
    """(scope, phase, source) of every instruction of ``module`` by the rules of this module's docstring; worked
    out once per module and pattern (the op table, the memory view and the parallelism evidence all ask, and it
    walks the whole module several times)."""
    done = _ASSIGNED.setdefault(module, {})
    if optimizer_pattern not in done:
        done[optimizer_pattern] = _assign_scopes(module, optimizer_pattern)
    return done[optimizer_pattern]


def _assign_scopes(module: HloModule, optimizer_pattern: str) -> ModuleScopes:
    frames = _Frames(module.stack_frames)
    infos: dict[str, ScopeInfo] = {}
    opt_lib: set[str] = set()
    seen: dict[tuple, tuple[ScopeInfo, bool]] = {}  # _info of each metadata: far fewer than instructions
    for comp in module.computations.values():
        for inst in comp.instructions:
            carrier, how = (inst, "op_name") if _named(inst) else (None, "")
            if carrier is not None and inst.opcode == "fusion":  # a fused matmul names it: the work is the dot's
                carrier = next((c for c in (_fused_matmul(module, n) for n in inst.called) if c is not None), carrier)
            if carrier is None and inst.opcode == "fusion":
                inherited = frozenset(src.metadata.op_name for src in map(comp.by_name.get, inst.operands)
                                      if src is not None)
                carrier = next((c for c in (_fused_carrier(module, n, inherited) for n in inst.called)
                                if c is not None), None)
                how = "fused"
            if carrier is None:
                continue
            md = carrier.metadata  # what _info reads
            key = (md.op_name, md.stack_frame_id, md.source_file, md.source_line, how)
            got = seen.get(key)
            if got is None:
                got = seen[key] = _info(module, carrier, frames, how, optimizer_pattern)
            infos[inst.name], in_opt = got
            if in_opt:
                opt_lib.add(inst.name)
            if inst.opcode == "fusion":
                infos[inst.name] = _spanned(module, inst, infos[inst.name], frames, optimizer_pattern, seen)
    callers: dict[str, Instruction] = {}
    for comp in module.computations.values():
        for inst in comp.instructions:
            for c in inst.called:
                callers.setdefault(c, inst)
    users = {name: comp.users() for name, comp in module.computations.items()}
    contractions = _contractions(module)
    weight_grads, data_grads = _weight_gradients(module.entry, infos, contractions)
    parts = _collective_parts(module)
    for comp in module.computations.values():
        _forward_feeders(module, comp, infos, users, weight_grads, parts, contractions)
    for _ in range(len(module.computations) + 1):
        changed = False
        for name, comp in module.computations.items():
            changed |= _inherit(comp, infos, users[name], contractions, weight_grads, parts, data_grads)
            caller = callers.get(name)
            src = infos.get(caller.name) if caller is not None else None
            if src is not None:
                for inst in comp.instructions:
                    if inst.name not in infos:
                        infos[inst.name] = ScopeInfo(src.scope, src.phase, "", "caller", src.in_grad)
                        changed = True
        if not changed:
            break
    _number_call_sites(infos, frames.sites, [i.name for i in module.entry.instructions
                                             if i.opcode not in ("parameter", "constant")])
    _combined_ops(module, infos)
    _loop_plumbing(module, infos)
    _gradient_accumulators(module, infos, opt_lib)
    _gradient_results(module, infos, moves_only=True)
    optimizer = {n for n in opt_lib if not infos[n].in_grad} | _update_optimizer(module, infos)
    for n in optimizer:
        i = infos[n]
        infos[n] = ScopeInfo(i.scope, "optimizer", i.source, i.how, i.in_grad)
    _name_optimizer(infos, opt_lib, optimizer_pattern)
    _gradient_results(module, infos, moves_only=False)
    for n, i in infos.items():  # key handling and data generation outside any layer: not the model's forward
        if i.scope == RNG_SCOPE and i.phase == "forward":
            infos[n] = ScopeInfo(i.scope, OTHER_PHASE, i.source, i.how, i.in_grad)
    _frame_instances(module, infos)
    _combined_ops(module, infos)  # again: the instances of its parts are known now
    return ModuleScopes(infos, _repeats(module, infos))


def _combined_ops(module: HloModule, infos: dict[str, ScopeInfo]) -> None:
    """An op XLA's combiner made of parts without named scopes (Equinox's gradients, each labelled by its frames:
    ``while/body/closed_call/(reduce_sum:dot_general:...)`` with the first part's frame) takes the scope its
    operands share, else :data:`~traceroof.layers.COMBINED_SCOPE`, as a combined op of named parts does
    (:func:`traceroof.layers.parse_scope`); its phase stays the parts'. (The first part's frame gave the s31 trial's
    scanned Equinox transformer's all-reduce of every block gradient to ``Block/LayerNorm_0``: 35 % of the step.)
    So does a collective of several arrays whose scope was borrowed (:func:`_borrowed_variadic`)."""
    for comp in module.computations.values():
        for inst in comp.instructions:
            i = infos.get(inst.name)
            if i is None or i.how != "combined" and not _borrowed_variadic(inst, i):
                continue
            scopes = {infos[o].scope for o in inst.operands if o in infos} - {NO_SCOPE, TOP_LEVEL}
            scopes = {sc for sc in scopes if not sc.startswith("(")}
            if scopes:
                infos[inst.name] = ScopeInfo(_common_prefix(scopes) or COMBINED_SCOPE, i.phase, i.source, i.how,
                                             i.in_grad)


def _borrowed_variadic(inst: Instruction, info: ScopeInfo) -> bool:
    """A collective of several arrays (``jax.lax.pmean(grads, "data")`` of a whole gradient tree: one all-reduce)
    whose scope is not its own (its op_name names none, so it took a neighbour's: the first gradient's layer). Its
    operands decide, as for a combiner's op (s39 trial: PPO's pmean of all 10 gradients, in a loop, read as the
    layer ``critic_out``'s backward, 115 ms)."""
    return _collective(inst.opcode) and len(inst.operands) > 1 and (
        info.how not in ("op_name", "fused", "frames") or info.scope in (NO_SCOPE, TOP_LEVEL))


def _name_optimizer(infos: dict[str, ScopeInfo], opt_lib: set[str], optimizer_pattern: str) -> None:
    """One row for the optimizer: every ``optimizer`` op's scope becomes ``(optimizer)``, whether it had none,
    inherited a model layer's from a neighbour (XLA fuses one update over many parameters, so a per-layer split
    would be arbitrary) or lies in a scope an optimizer library named (Keras's ``adam``). A scope the user named
    and that matches ``optimizer_pattern`` (``jax.named_scope("optimizer")`` in the user's own code) stays: it is
    the user's own name for the row."""
    lib_scopes = {infos[n].scope for n in opt_lib}
    for n, i in infos.items():
        if i.phase != "optimizer" or i.scope == OPTIMIZER_SCOPE:
            continue
        segs = i.scope.split("/")
        user_named = i.scope not in lib_scopes and not i.scope.startswith("(") \
            and phase_of(segs, False, optimizer_pattern) == "optimizer"
        if not user_named:
            infos[n] = ScopeInfo(OPTIMIZER_SCOPE, "optimizer", i.source, i.how, i.in_grad)


# loop plumbing: moving slices of a scanned stack in and out, counting iterations
_PLUMBING = frozenset({"dynamic-slice", "dynamic-update-slice", "get-tuple-element", "tuple", "copy", "bitcast",
                       "reshape", "transpose", "broadcast", "constant", "parameter", "slice", "concatenate",
                       "compare", "convert", "select", "gather", "scatter"})


def _is_plumbing(module: HloModule, inst: Instruction, depth: int = 0) -> bool:
    """Data movement or scalar integer index arithmetic (the loop counter, clamped slice starts), not the body's
    computation; a fusion by its root (its name came from the root)."""
    if inst.opcode == "fusion":  # its root moves data (a dynamic-update-slice with the body's add fused in)
        comps = [module.computations.get(c) for c in inst.called]
        return depth < 4 and all(c is not None and c.root is not None and _is_plumbing(module, c.root, depth + 1)
                                 for c in comps)
    if inst.opcode in _PLUMBING:
        return True
    return inst.shape.element_type.startswith(("s", "u", "pred")) and not inst.shape.dims  # index arithmetic


def _common_prefix(scopes: Iterable[str]) -> str:
    parts = [s.split("/") for s in scopes]
    if not parts:
        return ""
    out = []
    for segs in zip(*parts):
        if len(set(segs)) != 1:
            break
        out.append(segs[0])
    return "/".join(out)


def _loop_plumbing(module: HloModule, infos: dict[str, ScopeInfo]) -> None:
    """Scan / fori_loop plumbing takes the layer of the loop body it serves. In a while body whose own ops lie in
    scope ``C`` (the common prefix of the scopes of its computing ops, neither plumbing nor collectives, other than
    the loop's own scope: ``Model/layers`` of ``nn.scan``), the plumbing
    ops (dynamic-slice of the stacked weights, dynamic-update-slice of stacked activations or gradients, the
    iteration counter, the condition's compare) and the collectives (an FSDP weight all-gather) labelled less
    specifically (``(top level)``, ``Model``, the loop's own scope) take the scope of a body op they feed (users
    first), else of one they read, else ``C``; the phase stays theirs."""
    for comp in module.computations.values():
        for w in comp.instructions:
            if w.opcode != "while":
                continue
            body = while_body(module, w)
            cond = module.computations.get(w.attrs.get("condition", "").lstrip("%"))
            if body is None:
                continue
            # the loop's own scope (its call site: ``Transformer`` calling ``lax.scan`` over ``Block``) is vague
            # in the body too, where the frames of the slicing of the stacked weights (and of the FSDP gathers
            # XLA moved onto those slices) point at it
            site = infos[w.name].scope if w.name in infos and not infos[w.name].scope.startswith("(") else TOP_LEVEL
            moves = {i.name for part in (body, cond) if part is not None for i in part.instructions
                     if _is_plumbing(module, i) or _collective(i.opcode)}  # judged once, read twice
            scoped = {infos[i.name].scope for i in body.instructions if i.name in infos and i.name not in moves}
            scoped -= {NO_SCOPE, TOP_LEVEL, site}
            c = _common_prefix(s for s in scoped if not s.startswith("("))
            if not c:
                continue

            def vague(scope: str) -> bool:
                return scope in (NO_SCOPE, TOP_LEVEL, site) or c.startswith(scope + "/")

            for part in (body, cond):
                if part is None:
                    continue
                users = part.users()
                fixed: dict[str, ScopeInfo] = {}
                for inst in part.instructions:
                    i = infos.get(inst.name)
                    if i is None or i.phase == "optimizer" or not vague(i.scope) or inst.name not in moves:
                        continue
                    near = [infos.get(u.name) for u in users.get(inst.name, ())] + \
                        [infos.get(o) for o in inst.operands]
                    src = next((n.scope for n in near if n is not None and (n.scope == c
                                                                          or n.scope.startswith(c + "/"))), c)
                    fixed[inst.name] = ScopeInfo(src, i.phase, i.source, "loop", i.in_grad)
                infos.update(fixed)


def _gradient_accumulators(module: HloModule, infos: dict[str, ScopeInfo], opt_lib: set[str]) -> None:
    """Gradient accumulation over micro-batches (``fori_loop(0, n, lambda i, acc: tree_map(add, acc, grad(...)),
    zeros)``) is backward work: a loop-carried slot whose new value is computed outside the differentiated
    function from the slot's old value and a gradient (a backward op's result, or a value made from one) is an
    accumulator; that op, the slot's reads in the body, its zeros initialisation before the loop and its reads
    after it get phase ``backward`` and the scope of the gradient they accumulate (never ``forward`` or
    ``optimizer``).

    Training steps run in a loop (``fori_loop`` over steps of plain SGD, momentum written by hand) look alike but
    are updates: a slot the body also reads for other work (the forward reads the parameters) and whose new value
    is made from a gradient is a parameter, and its new value is the ``optimizer``'s; so is a slot's new value
    that feeds such an update within the iteration (a momentum), with its zeros. Optimizer libraries' updates are
    named so already."""
    for comp in module.computations.values():
        users = comp.users()
        for w in comp.instructions:
            body = while_body(module, w)
            if body is None or body.root is None or body.root.opcode != "tuple" or not w.operands:
                continue
            param = next(iter(body.parameters().values()), None)
            if param is None:
                continue
            slot_reads: dict[int, list[Instruction]] = {}
            for inst in body.instructions:
                if inst.opcode == "get-tuple-element" and inst.operands[:1] == (param.name,):
                    slot_reads.setdefault(inst.tuple_index, []).append(inst)
            init = comp.by_name.get(w.operands[0])
            body_users = body.users()
            grad_of: dict[str, ScopeInfo] = {}  # per op made from a gradient: the nearest backward op's info
            for inst in body.instructions:  # (operands come first in text order)
                info = infos.get(inst.name)
                src = info if info is not None and info.phase == "backward" else \
                    next((grad_of[o] for o in inst.operands if o in grad_of), None)
                if src is not None:
                    grad_of[inst.name] = src
            found: dict[int, tuple[str, ScopeInfo, set[str], bool]] = {}  # slot: new value, gradient, reads, read
            #                                                                   for other work
            for k, r_name in enumerate(body.root.operands):
                r = body.by_name.get(r_name)
                ri = infos.get(r_name)
                if r is None or ri is None or ri.in_grad or ri.phase != "forward" or r_name in opt_lib:
                    continue
                reads = {g.name for g in slot_reads.get(k, ())}
                reads |= {c.name for c in body.instructions if c.opcode == "copy" and set(c.operands) & reads}
                grad = grad_of.get(r_name)
                if grad is None or not reads & set(r.operands):
                    continue
                read_elsewhere = any(u.name not in reads and u.name != r_name
                                     for g in reads for u in body_users.get(g, ()))
                found[k] = (r_name, grad, reads, read_elsewhere)
            updates = {r_name for r_name, *_, elsewhere in found.values() if elsewhere}
            for k, (r_name, grad, reads, elsewhere) in found.items():
                optimizer = elsewhere or _feeds(body_users, r_name, updates, body.root.name)
                label = ScopeInfo(OPTIMIZER_SCOPE, "optimizer", "", "update", False) if optimizer else \
                    ScopeInfo(grad.scope, "backward", "", "accumulate", False)
                infos[r_name] = label
                if elsewhere:  # the parameter: its reads and the loop's result stay as they are
                    continue
                for n in reads:
                    infos[n] = label
                if init is not None and init.opcode == "tuple" and k < len(init.operands):
                    for n in _constant_chain(module, comp, init.operands[k]):
                        infos[n] = label
                for g in users.get(w.name, ()):
                    if g.opcode == "get-tuple-element" and g.tuple_index == k:
                        infos[g.name] = label


def _feeds(users: dict[str, list[Instruction]], name: str, targets: set[str], root: str) -> bool:
    """Whether instruction ``name`` reaches one of ``targets`` through its users (not through ``root``)."""
    seen, stack = {name}, [name]
    while stack:
        for u in users.get(stack.pop(), ()):
            if u.name in targets:
                return True
            if u.name != root and u.name not in seen:
                seen.add(u.name)
                stack.append(u.name)
    return False


def while_body(module: HloModule, inst: Instruction) -> Computation | None:
    """The body computation of a ``while`` instruction (``None`` for other instructions or a missing body)."""
    return module.computations.get(inst.attrs.get("body", "").strip().lstrip("%")) if inst.opcode == "while" else None


def _constant_chain(module: HloModule, comp: Computation, name: str) -> list[str]:
    """``name`` and the ops it is made from when it is built from constants only (the zeros of an
    accumulator, through copies and broadcasts); empty otherwise."""
    out, stack = [], [name]
    while stack:
        inst = comp.by_name.get(stack.pop())
        if inst is None or inst.opcode == "parameter":
            return []
        if inst.opcode == "constant":
            continue
        if inst.opcode not in ("copy", "broadcast", "bitcast", "reshape", "convert", "fusion") or \
                (inst.opcode == "fusion" and not _is_plumbing(module, inst)):
            return []
        out.append(inst.name)
        stack.extend(inst.operands)
    return out


def _under(scope: str, prefix: str) -> bool:
    return scope == prefix or scope.startswith(prefix + "/")


def _frame_instances(module: HloModule, infos: dict[str, ScopeInfo]) -> None:
    """Numbers the instances of a model class called several times in a row (a Python list of blocks in Flax
    NNX or Equinox: ``for b in self.blocks: x = b(x)``), whose ops carry the same stack frames and no names, so
    that they collapse like named repeated blocks: ``Model/Block/MLP`` -> ``Model/Block_0/MLP`` ... ``Block_3``.

    The only signal the HLO keeps is the dataflow (frames are deduplicated per call site, NNX / Equinox write no
    scopes, and their parameters are flat positions, ``model.states[0][5]``): in the entry computation, the ops
    of a frame scope ``P`` that read an entry parameter (through copies / transposes: the weights) are grouped by
    (scope under ``P``, phase, opcode, shape). Within a group, instance ``k`` depends on the members of instances
    ``0..k-1`` (the forward runs block after block, the backward in reverse), so the number of same-group members
    an op depends on ranks it; ``n`` instances are ``n`` runs of consecutive ranks, and a cut never falls between
    equal ranks (parallel q / k / v projections share one). Each group votes, by its size, for the most runs it
    cuts into (4 blocks' groups cut into 4 and into 2); ``P`` is repeated when most ranked ops lie in groups voting
    for the same ``n >= 2`` (the best voted, the larger on a tie), at least two groups do, and, in each part of
    ``P``, at least a quarter of the weight-reading ops lie in groups of ``n`` members or more (a part called once,
    such as ``Model``'s embedding when ``P`` is ``Model``, has groups of one; XLA's fusions across instances make
    odd groups, such as Equinox's LayerNorm backward). The other ops of ``P`` take the instance
    of their nearest placed neighbour (operands first), then of the ops reading the same parameter (an RNG
    counter's update); the computations they call (dropout's threefry loop) follow them. Outermost classes first.
    A weight-shared block (one instance called twice) has groups of one and is not split; where no ``n`` is
    supported the class stays one row, and a class made of a single repeated part leaves the split to that part.
    """
    entry = module.entry
    framed = {i.scope for i in infos.values() if i.how == "frames"}
    cands = sorted({"/".join(sc.split("/")[:k]) for sc in framed for k in range(1, sc.count("/") + 2)},
                   key=lambda c: (c.count("/"), c))
    users = entry.users()
    contractions = _contractions(module)
    done: list[str] = []
    for p in cands:
        if any(_under(p, d) for d in done):
            continue
        assign = _split_instances(entry, infos, p, users, contractions)
        if not assign:
            continue
        if not all(any(infos[n].scope.startswith(p + "/") for n, k in assign.items() if k == j)
                   for j in set(assign.values())):
            continue  # instances without parts would not collapse into one row (a lone LayerNorm per block)
        done.append(p)
        owner: dict[str, int] = {}
        for name, k in assign.items():
            i = infos[name]
            infos[name] = ScopeInfo(f"{p}_{k}{i.scope[len(p):]}", i.phase, i.source, i.how, i.in_grad)
            stack = list(entry.by_name[name].called)
            while stack:
                c = stack.pop()
                if owner.setdefault(c, k) != k:
                    owner[c] = -1
                    continue
                comp = module.computations.get(c)
                for inst in comp.instructions if comp is not None else ():
                    stack.extend(inst.called)
        for c, k in owner.items():
            for inst in module.computations[c].instructions if k >= 0 and c in module.computations else ():
                i = infos.get(inst.name)
                if i is not None and _under(i.scope, p):
                    infos[inst.name] = ScopeInfo(f"{p}_{k}{i.scope[len(p):]}", i.phase, i.source, i.how, i.in_grad)




def _split_instances(entry: Computation, infos: Mapping[str, ScopeInfo], p: str,
                     users: Mapping[str, list[Instruction]], contractions: set[str]) -> dict[str, int]:
    """Instance number of each entry op in frame scope ``p`` (see :func:`_frame_instances`); empty when ``p``
    is not a repeated class. ``contractions``: the matmuls (:func:`_contractions`)."""
    members = [i for i in entry.instructions if i.name in infos and _under(infos[i.name].scope, p)
               and infos[i.name].phase != "optimizer" and i.opcode not in ("parameter", "constant") and not i.is_root]
    if len(members) < 4:
        return {}

    reads = {m.name: _params_read(entry, m) for m in members if m.opcode not in _STRUCTURAL}
    seeds = [m for m in members if reads.get(m.name)]
    ranked_ops = [m for m in members if m.name in reads]
    bit = {m.name: 1 << k for k, m in enumerate(ranked_ops)}
    anc: dict[str, int] = {}
    for inst in entry.instructions:  # text order: operands first
        a = bit.get(inst.name, 0)
        for o in inst.operands:
            a |= anc.get(o, 0)
        anc[inst.name] = a
    ranked, valid, groups = _rank(seeds, infos, p, bit, anc, contractions)
    # each group votes, by its size, for the most runs it can be cut into: a group of 4 blocks' q projections cuts
    # into 4 runs and into 2, and a vote for both let one group of 6 that XLA fused across blocks (valid for 2
    # only) make 2 instances of 4 NNX blocks (s32 trial ViT: Block_0 held blocks 0 and 1)
    votes = {key: max(ns) for key, ns in valid.items() if ns}
    score = Counter(v for key, v in votes.items() for _ in ranked[key])
    n = max(score, key=lambda c: (score[c], c), default=0)
    if n < 2 or 2 * score[n] < sum(len(o) for o in ranked.values()):
        return {}
    if list(votes.values()).count(n) < 2:
        return {}  # one group is no evidence (a final LayerNorm's scale then shift, one shape: "2 instances")
    fits: dict[str, list[int]] = {}  # per part of ``p`` (its first scope segment below ``p``): seeds that fit, all
    for key, g in groups.items():
        f = fits.setdefault(key[0].split("/")[1] if key[0] else "", [0, 0])
        f[0] += len(g) if len(g) >= n else 0  # every instance has one (a group XLA fused across them: 7 of 4)
        f[1] += len(g)
    if len(fits) == 1 and "" not in fits:
        return {}  # all of it is one part (``Model`` holding only its blocks): the part is what repeats
    if any(4 * ok < total for ok, total in fits.values()):
        return {}  # a part called once (``Model``'s embedding when ``p`` is ``Model``): ``p`` is not repeated
    assign: dict[str, int] = {}
    # the weight readers first, then every other op that ranks the same way (a LayerNorm's mean and variance
    # read the previous block's output, not a weight: their neighbours would give them the previous instance);
    # among those, equal ranks (a side branch: the normalised input kept for the backward pass) are ordered by
    # the latest run of weight readers of their phase they depend on (the previous block's, or none), then by
    # their place in the text (a scheduled module runs the instances one after the other)
    position = {inst.name: k for k, inst in enumerate(entry.instructions)}
    runs: dict[tuple[str, int], int] = {}  # (phase, run in execution order) -> bits of its weight readers
    for group_ops in (seeds, [m for m in ranked_ops if not reads[m.name]]):
        ranked, valid, _ = _rank(group_ops, infos, p, bit, anc, contractions)
        for key, order in ranked.items():
            levels = sorted({r for r, _ in order})
            if n not in valid[key] and group_ops is not seeds and len(order) % n == 0:
                def after(name: str, phase: str = key[1]) -> int:
                    return max((c for (ph, c), b in runs.items() if ph == phase and anc[name] & b), default=-1)
                order = sorted(order, key=lambda rn: (rn[0], after(rn[1]), position[rn[1]]))
                valid[key].add(n)
            for pos, (r, name) in enumerate(order):
                if n in valid[key]:
                    k = pos * n // len(order)
                elif len(levels) == n:  # n levels of unequal sizes (XLA fused across instances)
                    k = levels.index(r)
                else:
                    break
                assign[name] = n - 1 - k if key[1] == "backward" else k
                if group_ops is seeds:
                    runs[(key[1], k)] = runs.get((key[1], k), 0) | bit[name]
    member_names = {m.name for m in members}
    owner: dict[str, set[int]] = {}  # parameter -> instances of the placed ops reading it
    for name, k in assign.items():
        for w in reads[name]:
            owner.setdefault(w, set()).add(k)
    for m in members:  # a weight gradient: the instance of the parameter its update (up to 3 ops on) reads
        if m.name in assign or m.name in reads and reads[m.name]:
            continue
        ks: set[int] = set()
        frontier, seen = [m.name], {m.name}
        for _ in range(3):
            frontier = [u.name for f in frontier for u in users.get(f, ()) if u.name not in member_names
                        and u.name not in seen and not seen.add(u.name)]
            for f in frontier:
                for w in _params_read(entry, entry.by_name[f]):
                    ks |= owner.get(w, set())
        if len(ks) == 1:
            assign[m.name] = ks.pop()
    for by_param in (False, True):
        while True:  # the rest: nearest placed neighbour, operands first
            new = {}
            for m in members:
                if m.name in assign:
                    continue
                k = next((assign[o] for o in m.operands if o in assign), None)
                if k is None:
                    k = next((assign[u.name] for u in users.get(m.name, ()) if u.name in assign), None)
                if k is not None:
                    new[m.name] = k
            if not new:
                break
            assign.update(new)
        if not by_param:  # then state updates that only read their own parameter (an RNG counter + 1): the
            # instance of the other ops reading that parameter, when they agree
            owner = {}
            for name, k in assign.items():
                for w in reads.get(name, ()):
                    owner.setdefault(w, set()).add(k)
            for m in members:
                ks = set().union(*(owner.get(w, set()) for w in reads.get(m.name, ())))
                if m.name not in assign and len(ks) == 1:
                    assign[m.name] = ks.pop()
    return {name: k for name, k in assign.items() if name in member_names}


def _rank(ops: list[Instruction], infos: Mapping[str, ScopeInfo], p: str, bit: Mapping[str, int],
          anc: Mapping[str, int], contractions: set[str]
          ) -> tuple[dict[tuple, list[tuple[int, str]]], dict[tuple, set[int]], dict]:
    """``ops`` grouped by (scope under ``p``, phase, opcode, shape, whether it is a matmul: in ``contractions``);
    per group with an order among its members, the (same-group ancestors, name) sorted, and the instance counts
    ``n`` that cut it into ``n`` tie-free runs of equal size; and the groups. Two fusions of one shape in one scope
    may be different steps, a layout copy and the matmul that reads it (Equinox's transposed weight gradient:
    ``copy_bitcast_fusion`` f32[512,128] feeding ``ynn_fusion`` f32[512,128] when the tokens equal the width);
    in one group the matmul ranks above the copy and the cut into instances fell between the steps, not the
    blocks. (Finer kinds, such as the fused opcodes, split the groups that XLA's fusions across instances make
    uneven.)"""
    groups: dict[tuple, list[Instruction]] = {}
    for op in ops:
        i = infos[op.name]
        groups.setdefault((i.scope[len(p):], i.phase, op.opcode, str(op.shape), op.name in contractions),
                          []).append(op)
    ranked: dict[tuple, list[tuple[int, str]]] = {}
    valid: dict[tuple, set[int]] = {}
    for key, g in groups.items():
        mask = sum(bit[op.name] for op in g)
        order = sorted((bin(anc[op.name] & mask).count("1"), op.name) for op in g)
        if order[0][0] == order[-1][0]:
            continue  # no order among them (an RNG counter per instance): placed by their neighbours
        ranked[key] = order
        size = len(order)
        valid[key] = {n for n in range(2, size + 1) if size % n == 0  # n tie-free chunks of consecutive ranks
                      and all(order[j * size // n - 1][0] != order[j * size // n][0] for j in range(1, n))}
    return ranked, valid, groups


def _instances(scope: str) -> Iterable[tuple[str, str]]:
    """(instance prefix, collapsed prefix) of each numbered segment of a scope: ``a/h/0`` -> ``a/h/*``,
    ``a/Block_3`` -> ``a/Block_*``."""
    segs = scope.split("/")
    for i, s in enumerate(segs):
        head = "/".join(segs[:i])
        if s.isdigit() and i > 0:
            yield "/".join(segs[: i + 1]), "/".join(segs[:i] + ["*"])
        elif (m := _NUMBERED.fullmatch(s)) is not None:
            yield "/".join(segs[: i + 1]), (head + "/" if head else "") + m.group(1) + "_*"


def _repeats(module: HloModule, infos: Mapping[str, ScopeInfo]) -> dict[str, str]:
    """Instance scope -> collapsed scope for the repeated blocks of a module (see the module docstring)."""
    scopes = {i.scope for i in infos.values()} - {NO_SCOPE, TOP_LEVEL, OPTIMIZER_SCOPE, RNG_SCOPE}
    groups: dict[str, set[str]] = {}
    for sc in scopes:
        for inst, collapsed in _instances(sc):
            groups.setdefault(collapsed, set()).add(inst)
    groups = {c: members for c, members in groups.items() if len(members) > 1}
    if not groups:
        return {}
    sig: dict[str, Counter] = {}
    children: dict[str, set[str]] = {}
    members = {m: c for c, ms in groups.items() for m in ms}
    found: dict[str, list[tuple[str, str]]] = {}  # scope -> (instance prefix, the scope below it)
    for comp in module.computations.values():
        for inst in comp.instructions:
            info = infos.get(inst.name)
            if info is None:
                continue
            within = found.get(info.scope)
            if within is None:
                within = found[info.scope] = [(prefix, info.scope[len(prefix) + 1:])
                                              for prefix in _prefixes(info.scope, members)]
                for prefix, rel in within:
                    if rel:
                        children.setdefault(prefix, set()).add(rel.split("/")[0])
            if within and inst.opcode in ("dot", "convolution"):  # a rematerialised forward matmul may be CSE-d away
                phase = "forward" if info.phase == "remat" else info.phase
                for prefix, rel in within:
                    sig.setdefault(prefix, Counter())[(rel, phase, inst.opcode, str(inst.shape))] += 1
    out: dict[str, str] = {}
    for collapsed, ms in sorted(groups.items()):
        by_sig: dict[tuple, list[str]] = {}
        for m in sorted(ms):
            key = (tuple(sorted(sig.get(m, Counter()).items())), tuple(sorted(children.get(m, ()))))
            by_sig.setdefault(key, []).append(m)
        for (contractions, kids), same in by_sig.items():
            # leaf instances (no child scopes) only as a stack of 3 or more with matmuls: a block's Conv_0 and
            # Conv_1 stay apart; jax.named_scope(f"block_{i}") around 3 identical blocks collapses
            if len(same) > 1 and kids or len(same) > 2 and contractions:
                out.update({m: collapsed for m in same})
    return out


def _prefixes(scope: str, members: Mapping[str, str]) -> list[str]:
    """The instance prefixes (keys of ``members``) that ``scope`` lies in."""
    segs = scope.split("/")
    return [p for p in ("/".join(segs[: i + 1]) for i in range(len(segs))) if p in members]


