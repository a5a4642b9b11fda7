"""Rules on the optimizer update: gradient accumulation with ``optax.MultiSteps``, whose inner optimizer update
runs on every micro-step and is kept on every k-th only (``discarded-update``)."""

from __future__ import annotations

import re

import numpy as np

from parsers.hlo import HloModule, Instruction
from traceroof.findings.record import Finding, FindingInputs, fmt_s, make, total
from traceroof.scopes import _Frames

ACCUMULATION_FILE = re.compile(r"optax/transforms/_accumulation\.py$")  # optax.MultiSteps (optax >= 0.2)
OPTAX_FILE = re.compile(r"/optax/")
MULTISTEPS_SOURCE = ("optax source, transforms/_accumulation.py (MultiSteps.update: the inner update runs on every "
                     "call and jnp.where(emit, new, old) keeps its state every k-th micro-step; emit = mini_step "
                     "== k_steps - 1)")


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
