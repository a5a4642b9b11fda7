"""Rules on memory traffic: tile padding (``tile-padding``), copies that only change a layout
(``layout-copy``), unfused memory-bound chains (``memory-bound-chain``) and recomputation (``remat-cost``).

TPU layouts store arrays in tiles (``T(8,128)(2,1)`` ...), so a tiled dimension is rounded up to the tile size
(``docs/reference/hlo-text.md`` §6.2; How to Scale Your Model §9.2.2): small or odd dims pay for padding, and
copies that only change the layout ("retiling") move bytes for no math (§9.2.2 fn 5).
"""

from __future__ import annotations

import re

import numpy as np

from parsers.hlo import Instruction, is_retiling
from traceroof.findings.hlo_graph import LAYOUT_ONLY, ModuleIndex
from traceroof.findings.record import (BOOK, MAX_OPS, Finding, FindingInputs, descending, fmt_s, make,
                                       total)
from traceroof.units import fmt_bytes

PADDING_SOURCE = f"{BOOK} §9.2.2 (tiled layouts); docs/reference/hlo-text.md §6.2 (TPU tile padding)"
LAYOUT_SOURCE = (f"{BOOK} §9.2.2 (layouts and retiling copies); XProf static HLO detectors (layout-changing "
                 "copies)")
CHAIN_SOURCE = (f"{BOOK} §9 (reading XLA's fusions in the HLO); XProf HLO op stats (unfused element-wise work)")
REMAT_SOURCE = (f"{BOOK} §4.3.2 (block remat costs about one extra forward pass); JAX docs, gradient "
                "checkpointing (jax.checkpoint policies)")
# Equinox's checkpointed while loop (equinox/internal/_loop/checkpointed.py names its loops checkpointed-fwd,
# -bwd and -no-vjp), which diffrax's RecursiveCheckpointAdjoint runs the solver in: its backward re-runs the
# forward from the states it saved
CHECKPOINTED_LOOP = re.compile(r"(?:^|/)checkpointed-(?:fwd|bwd|no-vjp)(?:/|$)")
CHECKPOINTED_LOOP_ADVICE = (
    "an Equinox checkpointed while loop (diffrax's default RecursiveCheckpointAdjoint) recomputes its forward from "
    "the states it saved: if memory allows, save more and recompute less: diffrax.RecursiveCheckpointAdjoint("
    "checkpoints=n), n up to the number of solver steps (the default is about log(max_steps)); "
    "eqx.internal.while_loop(..., kind='checkpointed', checkpoints=n) for a loop of your own")
CHECKPOINTED_LOOP_SOURCE = ("diffrax docs, RecursiveCheckpointAdjoint (memory ~ checkpoints x the state; more "
                            "checkpoints speed up backpropagation); Stumm & Walther 2010, online checkpointing")

PADDING_THRESHOLD = 0.25  # flag ops whose padded bytes exceed logical bytes by more than this fraction
LAYOUT_SHARE_MIN = 0.005  # layout-copy fires when those copies take this share of the step
CHAIN_SHARE_MIN = 0.02  # memory-bound-chain fires when the intermediates' round trips cost this share of the step
REMAT_SHARE_MIN = 0.01  # remat-cost fires when recomputation takes this share of the step
MEMORY_BOUND_CATEGORIES = ("elementwise", "reduction", "data movement")


def _bandwidth(x: FindingInputs) -> float:
    bw = x.chip.hbm_bandwidth_bytes_per_s if x.chip is not None else x.analysis.summary.hbm_bandwidth_bytes_per_s
    return float(bw) if bw else float("nan")


def tile_padding(x: FindingInputs) -> list[Finding]:
    """Ops moving more than ``PADDING_THRESHOLD`` more bytes than their logical size because tiled dims are
    rounded up. Lost: the extra bytes at HBM bandwidth, at most the ops' time."""
    c = x.counted
    if "padded_bytes" not in c or c.empty:
        return []
    logical, padded = x.cols.num("logical_bytes"), x.cols.num("padded_bytes")
    if not (padded[logical > 0] > logical[logical > 0]).any():  # no row padded: no op over the threshold
        return []
    d = c[c["logical_bytes"] > 0]
    g = d.groupby(["module", "hlo_op"], observed=True)[["padded_bytes", "logical_bytes", "measured_s"]].sum()
    inflated = g[g["padded_bytes"] > (1 + PADDING_THRESHOLD) * g["logical_bytes"]]
    if inflated.empty:
        return []
    extra = (inflated["padded_bytes"] - inflated["logical_bytes"]).sort_values(ascending=False)
    lost = float((extra / _bandwidth(x)).clip(upper=inflated["measured_s"]).sum()) / x.per
    worst = [f"{op}: +{inflated.loc[(m, op), 'padded_bytes'] / inflated.loc[(m, op), 'logical_bytes'] - 1:.0%} bytes"
             for m, op in extra.index[:3]]
    rows = np.flatnonzero((logical > 0) & x.cols.isin("hlo_op", {str(op) for _, op in inflated.index}))
    title = (f"{len(inflated)} op(s) move over {PADDING_THRESHOLD:.0%} more bytes because of tile padding "
             f"({fmt_bytes(extra.sum() / x.per)} extra per step)")
    advice = "pad or reshape those dims to tile multiples (8 x 128; 256 on v6e), or fold small dims into larger ones"
    return [make(x, "tile-padding", title, lost if lost == lost else float("nan"), advice, PADDING_SOURCE, worst,
                 rows)]


def _layout_only(ix: ModuleIndex, inst: Instruction) -> bool:
    """A transpose, a copy that changes the layout, or a fusion of only such data movement."""
    if inst.opcode == "transpose":
        return True
    if inst.opcode == "copy":
        src = ix.operand_shape(inst, 0)
        return is_retiling(inst, src) or (src is not None and src.layout is not None and inst.shape.layout is not None
                                          and src.layout.minor_to_major != inst.shape.layout.minor_to_major)
    if inst.opcode == "fusion":
        inner = ix.fused(inst)
        return bool(inner) and all(i.opcode in LAYOUT_ONLY for i in inner) and any(
            i.opcode == "transpose" or (i.opcode == "copy" and _layout_only(ix, i)) for i in inner)
    return False


def layout_copy(x: FindingInputs) -> list[Finding]:
    """Transposes and copies that only change a layout (no math). Lost: their whole time."""
    c = x.cols
    measured = c.num("measured_s")
    run = np.flatnonzero(c.flag("joined") & (measured > 0))
    keep = c.flag("retiling")[run] if "retiling" in c else np.zeros(len(run), bool)  # a copy
    moves = c.text("category")[run] == "data movement"
    module, program, op, opcode = (c.value(k) for k in ("module", "program_id", "hlo_op", "opcode"))
    for n in np.flatnonzero(moves & ~keep):
        i = run[n]
        got = x.programs.instruction(module[i], program[i], op[i])
        keep[n] = _layout_only(*got) if got else str(opcode[i]) == "transpose"
    rows = run[keep]
    lost = total(measured[rows]) / x.per
    if not len(rows) or not (lost >= LAYOUT_SHARE_MIN * x.step_s):
        return []
    retiling = int(c.flag("retiling")[rows].sum()) if "retiling" in c else 0
    names = {n for n in c.text("hlo_op")[rows] if n is not None}
    feeds = {key: _feeds_convolution(x.programs.instruction(*key))  # each op once, not once per row
             for key in dict.fromkeys((module[i], program[i], op[i]) for i in rows)}
    conv = np.array([feeds[(module[i], program[i], op[i])] for i in rows], bool)
    conv_s = total(measured[rows[conv]]) / x.per
    conv_names = {n for n in c.text("hlo_op")[rows[conv]] if n is not None}
    title = (f"{len(names)} transpose/copy op(s) only change layouts"
             + (f" ({retiling} retiling copies)" if retiling else "")
             + (f"; {len(conv_names)} of them ({fmt_s(conv_s)} per step) feed convolutions" if conv_names else ""))
    operands, shape = c.value("operand_shapes"), c.value("shape")
    evidence = [f"{op[i]}: {operands[i]} -> {shape[i]}" for i in rows[descending(measured[rows])[:3]]]
    einsum = ("order einsum/reshape dims the way the next op reads them (e.g. keep the heads axis where the "
              "attention matmul wants it instead of transposing q/k/v), and let jit pick argument layouts "
              "(jax.jit(..., in_shardings/out_shardings with Layout AUTO)) so XLA can drop the copies")
    convolutions = ("the copies that feed convolutions are the backend's convolution lowering (XLA CPU transposes "
                    "activations to batch-minor for weight gradients), not dims your code ordered: einsum order "
                    "does not drop them; keep the layout the backend's convolutions read (NHWC, the flax/keras "
                    "default, not NCHW dimension_numbers) and count them in the convolutions' cost")
    advice = (convolutions + ("; for the others, " + einsum if conv_s < lost else "") if conv_s >= lost / 2
              else einsum + ("; " + convolutions if conv_names else ""))
    return [make(x, "layout-copy", title, lost, advice, LAYOUT_SOURCE, evidence, rows)]


def _feeds_convolution(got: tuple[ModuleIndex, Instruction] | None) -> bool:
    """True when every user of the op is a convolution or a fusion holding one (a backend's convolution
    lowering moves the operands it reads: XLA CPU's ``transpose_copy_fusion`` before a backward-filter conv)."""
    if got is None:
        return False
    ix, inst = got
    comp = ix.computation_of(inst.name)
    users = ix.users(comp).get(inst.name, []) if comp is not None else []
    return bool(users) and all(u.opcode == "convolution" or (u.opcode == "fusion" and any(
        i.opcode == "convolution" for i in ix.fused(u))) for u in users)


def memory_bound_chain(x: FindingInputs) -> list[Finding]:
    """Memory-bound ops (elementwise, reductions, data movement) that feed the next such op as its only use:
    XLA left them unfused, so the intermediate goes to memory and back. Lost per edge: 2 x the intermediate's
    bytes at HBM bandwidth, at most the producer's time."""
    bw = _bandwidth(x)
    c = x.cols
    cand = np.flatnonzero(c.flag("joined") & (c.text("bound") == "memory") & (c.num("measured_s") > 0)
                          & c.isin("category", MEMORY_BOUND_CATEGORIES))
    if not len(cand) or not x.modules or not bw == bw:
        return []
    module, program, op, start = (c.value(k) for k in ("module", "program_id", "hlo_op", "start_ps"))
    executions, measured = c.num("executions"), c.num("measured_s")
    by_name = {(str(module[i]), str(op[i])): n for n, i in enumerate(cand)}
    parent = list(range(len(cand)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    edge_lost = [0.0] * len(cand)
    for (mod, name), n in by_name.items():
        i = cand[n]
        got = x.programs.instruction(module[i], program[i], name)
        if got is None or _layout_only(*got):  # layout-only copies are layout-copy's
            continue
        ix, inst = got
        users = ix.users(ix.computation_of(name)).get(name, [])
        if len(users) != 1 or (mod, users[0].name) not in by_name or _layout_only(ix, users[0]):
            continue
        parent[root(n)] = root(by_name[(mod, users[0].name)])
        bytes_out = sum(s.byte_size() for s in inst.shape.leaves())
        edge_lost[n] = min(2 * bytes_out * float(executions[i]) / bw, float(measured[i])) / x.per
    groups: dict[int, list[int]] = {}
    for n in range(len(cand)):
        groups.setdefault(root(n), []).append(n)
    chains = sorted((g for g in groups.values() if len(g) > 1), key=lambda g: -sum(edge_lost[i] for i in g))
    lost = sum(edge_lost)
    if not chains or not (lost >= CHAIN_SHARE_MIN * x.step_s):
        return []
    evidence, shown = [], []
    for g in chains[:3]:
        names = [str(op[cand[n]]) for n in sorted(g, key=lambda n: int(start[cand[n]]))]
        shown += g
        evidence.append(f"{' -> '.join(names[:5])}{' ...' if len(names) > 5 else ''} ({len(names)} ops, "
                        f"{fmt_s(sum(edge_lost[i] for i in g))} per step in round trips)")
    title = (f"{len(chains)} chain(s) of memory-bound ops pass intermediates through memory "
             f"({sum(len(g) for g in chains)} ops)")
    advice = ("let XLA fuse each chain: keep it inside one jit with no reshape/transpose, sharding constraint or "
              "custom call between the steps, or write it as one kernel (Pallas on TPU/GPU); XLA:CPU fuses less "
              "than the accelerators, so confirm on the target")
    rows = cand[sorted({i for g in chains for i in g})]
    return [make(x, "memory-bound-chain", title, lost, advice, CHAIN_SOURCE, evidence, rows,
                 ops=tuple(str(op[cand[n]]) for n in shown)[:MAX_OPS])]


def remat_cost(x: FindingInputs) -> list[Finding]:
    """The forward recomputed in the backward pass (phase ``remat``; XProf's remat flag): its share of the step,
    and the activations that keeping instead of recomputing would hold: the recomputed values the backward
    reads, one micro-batch's and per device (:class:`traceroof.memory.BookModel`), from the memory view of the
    programs that ran them (absent for an XProf export). Lost: the recomputation's time."""
    c = x.cols
    mask = c.text("phase") == "remat"
    if "remat" in c:
        mask |= x.counted["remat"].fillna(False).astype(bool).to_numpy()
    rows = np.flatnonzero(mask & (c.num("measured_s") > 0))
    t = total(c.num("measured_s")[rows]) / x.per
    if not len(rows) or not (t >= REMAT_SHARE_MIN * x.step_s):
        return []
    memory = x.analysis.memory
    module, program = c.value("module"), c.value("program_id")
    ran = {(module[i], program[i]) for i in rows}
    held = max((q.book.recomputed_activations_bytes for q in (memory.programs if memory else ())
                if (q.program, q.program_id) in ran), default=0)
    flops = total(c.num("flops")[rows]) / x.per
    evidence = [f"{len(rows)} recomputed op(s), {flops:.3g} FLOPs per step",
                f"keeping them instead: about {fmt_bytes(held)} more activations per device (the recomputed values "
                "the backward reads; XLA may keep more where it fuses less)" if held else ""]
    title = f"recomputing the forward pass (remat) takes {fmt_s(t)} per step"
    if any(CHECKPOINTED_LOOP.search(str(sc)) for sc in set(c.text("scope")[rows]) if sc is not None):
        return [make(x, "remat-cost", title, t, CHECKPOINTED_LOOP_ADVICE, CHECKPOINTED_LOOP_SOURCE, evidence, rows)]
    return [make(x, "remat-cost", title, t, _remat_advice(_recomputed_dots(x, rows)), REMAT_SOURCE, evidence, rows)]


def _recomputed_dots(x: FindingInputs, rows: np.ndarray) -> tuple[int, int] | None:
    """(with batch dimensions, without): the distinct dot instructions the recomputed op rows ``rows`` run, alone
    or inside their fusions; ``None`` when none of those ops is in the HLO (an XProf export)."""
    c = x.cols
    module, program, op = c.value("module"), c.value("program_id"), c.value("hlo_op")
    batched, unbatched, found = set(), set(), False
    for key in dict.fromkeys((module[i], program[i], op[i]) for i in rows):  # each op once, not once per step
        got = x.programs.instruction(*key)
        if got is None:
            continue
        found = True
        ix, inst = got
        for d in [inst] + (ix.fused(inst) if inst.opcode == "fusion" else []):
            if d.opcode == "dot":
                (batched if d.attr_ints("lhs_batch_dims") else unbatched).add((*key[:2], d.name))
    return (len(batched), len(unbatched)) if found else None


def _remat_advice(dots: tuple[int, int] | None) -> str:
    """What to save instead of recomputing, given the recomputed dots (:func:`_recomputed_dots`): a policy that
    keeps what the one in use recomputes. JAX's policies: ``dots_with_no_batch_dims_saveable`` keeps the outputs
    of dots without batch dimensions, ``checkpoint_dots`` those of every dot (jax/_src/ad_checkpoint.py)."""
    rest = "save_only_these_names keeps what you tag with checkpoint_name; or remat fewer layers (nn.remat / nn.scan)"
    if dots is None:
        return ("if HBM has room, save more and recompute less: jax.checkpoint(f, policy=jax.checkpoint_policies."
                f"dots_with_no_batch_dims_saveable) keeps the matmul outputs, {rest}")
    batched, unbatched = dots
    if batched:
        return (f"if HBM has room, save more and recompute less: {batched} of the {batched + unbatched} recomputed "
                "matmuls have batch dimensions (attention scores and context, per-head or per-expert products), "
                "which dots_with_no_batch_dims_saveable does not keep: jax.checkpoint(f, policy=jax."
                f"checkpoint_policies.checkpoint_dots) keeps every matmul output; {rest}")
    if unbatched:
        return (f"if HBM has room, save more and recompute less: jax.checkpoint(f, policy=jax.checkpoint_policies."
                f"dots_with_no_batch_dims_saveable) keeps the output of the {unbatched} recomputed matmul(s) (none "
                f"has batch dimensions); {rest}")
    return ("no matmul is recomputed (the policy in use keeps them): a dot-saving policy changes nothing here; the "
            f"recomputed ops are element-wise work and reductions: {rest}")
