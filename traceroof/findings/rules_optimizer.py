"""Rules on the update of the training state: gradient accumulation with ``optax.MultiSteps``, whose inner
optimizer update runs on every micro-step and is kept on every k-th only (``discarded-update``), and XLA's copies
of donated state before it is updated in place (``donation-copy``)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from parsers.hlo import HloModule, Instruction
from traceroof.findings.hlo_graph import ModuleIndex
from traceroof.findings.record import Finding, FindingInputs, descending, fmt_s, make, total
from traceroof.findings.rules_memory import _layout_only
from traceroof.scopes import _Frames, _alias_outputs
from traceroof.units import fmt_bytes

ACCUMULATION_FILE = re.compile(r"optax/transforms/_accumulation\.py$")  # optax.MultiSteps (optax >= 0.2)
OPTAX_FILE = re.compile(r"/optax/")
MULTISTEPS_SOURCE = ("optax source, transforms/_accumulation.py (MultiSteps.update: the inner update runs on every "
                     "call and jnp.where(emit, new, old) keeps its state every k-th micro-step; emit = mini_step "
                     "== k_steps - 1)")
DONATION_SOURCE = ("XLA copy insertion (xla/service/copy_insertion.cc, AddCopiesForAliasedInputOutputs: a copy of each "
                   "parameter an output aliases, which RemoveUnnecessaryCopies keeps when the parameter's value may "
                   "still be read after that output is written); JAX docs, buffer donation (donate_argnums)")
DONATION_SHARE_MIN = 0.005  # donation-copy fires when the copies take this share of the step
_COPY_FUSION = frozenset({"parameter", "copy", "bitcast"})  # a fusion of these with one copy is a copy
_MAX_BITCASTS = 8  # bitcasts followed from a copy back to its parameter (a cycle in a corrupt module ends there)


def discarded_update(x: FindingInputs) -> list[Finding]:
    """``optax.MultiSteps`` runs the inner optimizer's update (Adam's moments, the parameter update) on every
    micro-step and keeps the result on every ``k``-th, where ``k`` is read from the program's ``mini_step ==
    k - 1`` test: on the other micro-steps the update is computed and thrown away. Its ops are those whose
    stack frames pass through MultiSteps (``optax/transforms/_accumulation.py``) into another optax file (the
    inner optimizer); the accumulation itself (``acc + g``) is MultiSteps' own and needed, but XLA fuses it with
    the update, so those ops' time is an upper bound. Lost: that time x (k - 1) / k, the share of micro-steps that
    discard it (k = 2 when the program does not say)."""
    c = x.cols
    module, program, op = c.value("module"), c.value("program_id"), c.value("hlo_op")
    frames: dict[int, _Frames] = {}
    inner = []
    for i in np.flatnonzero((c.text("phase") == "optimizer") & (c.num("measured_s") > 0)):  # (frames: optax)
        got = x.programs.instruction(module[i], program[i], op[i])
        if got is None:
            continue
        ix, inst = got
        chains = _frames_of(ix.module, frames)
        if any(_inner_update(chains, d) for d in [inst] + (ix.fused(inst) if inst.opcode == "fusion" else [])):
            inner.append(i)
    if not inner:
        return []
    rows = np.array(inner, np.int64)
    t = total(c.num("measured_s")[rows]) / x.per
    ks = {k for m in x.modules for k in [_k_steps(m, _frames_of(m, frames))] if k}
    k = ks.pop() if len(ks) == 1 else 0
    every = f"every {_ordinal(k)}" if k else "every k-th"
    wasted = t * (k - 1) / k if k else t / 2
    flops = total(c.num("flops")[rows]) / x.per
    evidence = [f"{len(rows)} op(s) holding the inner optimizer's update inside optax.MultiSteps (with the "
                f"accumulation and selects XLA fused into them): {flops:.3g} FLOPs and {fmt_s(t)} per step",
                f"MultiSteps keeps the update on {every} micro-step" + (f" (k = {k}, from the program's mini_step "
                                                                        f"== {k - 1} test)" if k else "")]
    title = (f"optax.MultiSteps computes the optimizer update on every micro-step and keeps it on {every}: "
             f"up to {fmt_s(wasted)} per step thrown away")
    advice = ("accumulate the micro-batches' gradients inside one step instead (a jax.lax.scan or fori_loop over "
              "the micro-batches, summing the gradients, then one optimizer update): the update then runs once per "
              "real step, and every profiled step is a real step")
    return [make(x, "discarded-update", title, wasted, advice, MULTISTEPS_SOURCE, evidence, rows)]


def _frames_of(module: HloModule, frames: dict[int, _Frames]) -> _Frames:
    """``module``'s stack-frame chains, built once per module (``frames``: by ``id(module)``)."""
    if id(module) not in frames:
        frames[id(module)] = _Frames(module.stack_frames)
    return frames[id(module)]


def _ordinal(k: int) -> str:
    """``2nd``, ``3rd``, ``4th``, ``11th``, ``21st``."""
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def _inner_update(frames: _Frames, inst: Instruction) -> bool:
    """Whether ``inst``'s frames pass through MultiSteps into another optax file: the inner optimizer's code."""
    optax = [f for f in frames.chain(inst.metadata.stack_frame_id) if OPTAX_FILE.search(f.file_name)] \
        if inst.metadata.stack_frame_id else []
    return bool(optax) and not ACCUMULATION_FILE.search(optax[0].file_name) and \
        any(ACCUMULATION_FILE.search(f.file_name) for f in optax)


def _k_steps(module: HloModule, frames: _Frames) -> int:
    """MultiSteps' ``k`` from ``module``: the integer constant ``c`` of its ``mini_step == c`` comparisons (an
    equality test written in MultiSteps' own code, with an integer scalar constant operand), + 1; 0 when none,
    or when they disagree."""
    seen: set[int] = set()
    for comp in module.computations.values():
        for inst in comp.instructions:
            if inst.opcode != "compare" or inst.attrs.get("direction") != "EQ" or not inst.metadata.stack_frame_id:
                continue
            optax = [f for f in frames.chain(inst.metadata.stack_frame_id) if OPTAX_FILE.search(f.file_name)]
            if not optax or not ACCUMULATION_FILE.search(optax[0].file_name):
                continue
            for o in inst.operands:
                const = comp.by_name.get(o)
                text = const.literal.strip() if const is not None and const.opcode == "constant" else ""
                if const is not None and not const.shape.dims and const.shape.element_type.startswith(("s", "u")) \
                        and text.lstrip("-").isdigit():
                    seen.add(int(text) + 1)
    return seen.pop() if len(seen) == 1 else 0


def donation_copy(x: FindingInputs) -> list[Finding]:
    """Copies XLA inserts of donated entry parameters (``input_output_alias``: the state a jitted step updates in
    place, ``donate_argnums``) when a parameter's old value is still read after its new value would be written into
    its buffer: each one reads and writes the whole buffer every step, for no math. optax.MultiSteps does this to
    all of its state (``jnp.where(emit, new, old)`` reads the old state after the update). Same-layout copies only:
    a copy that changes the layout is ``layout-copy``'s. Lost: their whole time (without the copy, the update
    writes the buffer in place; without donation, into a new buffer)."""
    c = x.cols
    module, program, op = c.value("module"), c.value("program_id"), c.value("hlo_op")
    copies: dict[tuple[Any, Any, Any], tuple[Instruction, Instruction] | None] = {}
    aliased: dict[int, set[int]] = {}  # id(module) -> its donated parameters' numbers
    found = []
    for i in np.flatnonzero(c.flag("joined") & (c.num("measured_s") > 0) & (c.text("category") == "data movement")):
        key = (module[i], program[i], op[i])
        if key not in copies:
            got = x.programs.instruction(*key)
            copies[key] = _donated_copy(*got, aliased) if got is not None else None
        if copies[key] is not None:
            found.append(i)
    rows = np.array(found, np.int64)
    measured = c.num("measured_s")[rows]
    lost = total(measured) / x.per
    if not len(rows) or not lost >= DONATION_SHARE_MIN * x.step_s:
        return []
    pairs = [copies[(module[i], program[i], op[i])] for i in rows]
    size = np.array([copy.shape.byte_size() for copy, _ in pairs], np.float64)
    moved = total(2 * size * c.num("executions")[rows]) / x.per  # each copy reads and writes its buffer
    names = list(dict.fromkeys(f"{op[rows[n]]} ({pairs[n][1].metadata.op_name or pairs[n][1].name})"
                               for n in descending(measured)))
    n_copies = len({(module[i], program[i], op[i]) for i in rows})
    title = (f"XLA copies {n_copies} donated buffer(s) before updating them in place: {fmt_s(lost)} and "
             f"{fmt_bytes(moved)} moved per step for no math")
    evidence = [f"copies of entry parameters the program updates in place (input_output_alias), largest time "
                f"first: {', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''}"]
    frames: dict[int, _Frames] = {}
    if any(_k_steps(m, _frames_of(m, frames)) for m in x.modules):
        advice = ("optax.MultiSteps reads its whole state (moments, accumulated gradients, counters) in "
                  "jnp.where(emit, new, old) after computing the update, so XLA copies every donated buffer first: "
                  "accumulate the micro-batches' gradients inside one step instead (a jax.lax.scan over them, then "
                  "one optimizer update), which needs neither the copies nor the discarded update; or drop "
                  "donate_argnums, if memory holds the state twice")
    else:
        advice = ("XLA keeps the copy of a donated argument when an op may read its old value after its new value "
                  "is written into the buffer (the copy's users in the HLO dump are those reads): drop "
                  "donate_argnums for those arguments if memory holds them twice (the new value then goes to a "
                  "fresh buffer, with no copy), or weigh the copies against the memory donation saves")
    return [make(x, "donation-copy", title, lost, advice, DONATION_SOURCE, evidence, rows)]


def _donated_copy(ix: ModuleIndex, inst: Instruction, aliased: dict[int, set[int]]
                  ) -> tuple[Instruction, Instruction] | None:
    """(the copy, the parameter) when ``inst`` is a same-layout copy, or a fusion of only that copy, of an entry
    parameter that an output aliases (``input_output_alias``); else None. ``aliased`` caches each module's
    aliased parameter numbers."""
    entry = ix.module.entry
    if ix.computation_of(inst.name) is not entry or len(inst.operands) != 1 or _layout_only(ix, inst):
        return None
    if inst.opcode == "fusion":
        inner = ix.fused(inst)
        if sum(i.opcode == "copy" for i in inner) != 1 or any(i.opcode not in _COPY_FUSION for i in inner):
            return None
    elif inst.opcode != "copy":
        return None
    param = entry.by_name.get(inst.operands[0])
    for _ in range(_MAX_BITCASTS):
        if param is None or param.opcode != "bitcast" or not param.operands:
            break
        param = entry.by_name.get(param.operands[0])
    if param is None or param.opcode != "parameter":
        return None
    if id(ix.module) not in aliased:
        aliased[id(ix.module)] = set(_alias_outputs(ix.module).values())
    return (inst, param) if param.parameter_number in aliased[id(ix.module)] else None
