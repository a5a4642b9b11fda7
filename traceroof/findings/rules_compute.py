"""Rules on matrix work: up-cast matmuls (``dtype-upcast``), dims that waste the MXU / Tensor Core tiles
(``mxu-alignment``), matmuls under the ridge point (``small-matmul``), kernels with no cost model
(``opaque-custom-call``) and ops faster than their roofline (``faster-than-roofline``)."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from parsers.hlo import ELEMENT_BITS, Instruction
from traceroof.findings.hlo_graph import is_narrow, dot_dims
from traceroof.findings.record import (BOOK, Finding, FindingInputs, descending, fmt_s, make, share,
                                       total)
from traceroof.units import fmt_bytes, fmt_list
from traceroof.utilization import FASTER_THAN_ROOF_RATIO

UPCAST_SOURCE = (f"{BOOK} §2 (the MXU multiplies bf16 inputs and accumulates in f32) and §1 (peak FLOP/s per "
                 "dtype); JAX docs, jax.lax.dot_general preferred_element_type")
MXU_SOURCE = {"tpu": f"{BOOK} §2 (MXU 128x128 on v4/v5e/v5p, 256x256 on v6e: pad weight dims to multiples)",
              "gpu": "NVIDIA Deep Learning Performance Guide, Matrix Multiplication Background: Tensor Core "
                     "requirements (dims multiples of 16 bytes: 8 bf16/fp16, 16 fp8/int8, 4 tf32)"}
SMALL_SOURCE = (f"{BOOK} §1 (arithmetic intensity against the ridge point; a matmul's intensity is about its "
                "batch rows when those are much smaller than its other dims)")
OPAQUE_SOURCE = "traceroof cost model (docs/reference/cost-model.md): custom-calls carry no FLOP or byte count"
ROOF_SOURCE = f"{BOOK} §1 (roofline: time >= max(FLOPs/peak, bytes/bandwidth))"
ASYNC_OPCODE = re.compile(r"-start$|-done$|^async")  # the halves of async pairs: their windows are not work

MXU_WASTE_MIN = 0.10  # an op wasting this share of its MXU work on padding is named
SMALL_MATMUL_SHARE_MIN = 0.01  # small-matmul fires when those matmuls take this share of the step
TPU_WIDE_MXU = ("tpu_v6e",)  # 256x256 MXU (the book §2); other TPUs 128x128
TPU_ROW_TILE = 8  # rows (sublanes) per MXU step (§2: bf16[8,128] @ bf16[128,128] every 8 cycles)


def _pad(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def dtype_upcast(x: FindingInputs) -> list[Finding]:
    """Matmuls whose operands arrive in a narrow float (bf16, f16, fp8) and are converted up to f32 for the dot
    (``convert -> dot``; XLA:CPU does it for every bf16 dot). Lost: the converts' time, plus the matmuls' time
    x (1 - f32 peak / narrow peak) where the chip has a faster narrow peak."""
    mm = x.matmuls
    if not len(mm) or not x.modules:
        return []
    c = x.cols
    module, program, op, operands = (c.value(k) for k in ("module", "program_id", "hlo_op", "operand_shapes"))
    hits, converters, narrow, shapes = [], set(), set(), []
    for i in mm:
        got = x.programs.instruction(module[i], program[i], op[i])
        dot = got[0].dot_of(got[1]) if got else None
        lhs = got[0].operand_shape(dot, 0) if dot is not None and dot.operands else None
        if dot is None or lhs is None or is_narrow(lhs.element_type):
            continue
        outside: list[str] = []
        types = {got[0].upcast_source(dot, j, outside) for j in range(min(2, len(dot.operands)))} - {""}
        if types:
            hits.append(i)
            narrow |= types
            converters |= {(str(module[i]), o) for o in outside}
            if len(shapes) < 3:
                shapes.append(f"{op[i]}: {'/'.join(sorted(types))} operands computed as {operands[i]}")
    if not hits:
        return []
    rows = np.array(hits)
    conv = np.flatnonzero([(str(m), str(o)) in converters for m, o in zip(module, op)])
    measured = c.num("measured_s")
    conv_s = total(measured[conv]) / x.per
    mm_s = total(measured[rows]) / x.per
    kind = sorted(narrow)[0]
    fast = x.chip.peak_for(kind)[0] if x.chip is not None else None
    peaks = c.num("peak_flops_per_s")[rows]
    slow = float(np.nanmax(peaks)) if (~np.isnan(peaks)).any() else float("nan")
    gain = 1 - slow / fast if fast and slow > 0 and fast > slow else 0.0
    lost = conv_s + mm_s * gain
    # XLA:CPU converts bf16 dots itself: the profile's backend, whatever chip it is projected onto
    cpu = (x.chip is not None and x.chip.kind == "cpu") or "XLA:CPU" in str(x.analysis.summary.device)
    evidence = [f"{len(rows)} matmul op(s) run in f32 on {kind} data: {fmt_s(mm_s)} per step",
                f"{len(conv)} convert-only op(s) feeding them: {fmt_s(conv_s)} per step",
                f"peaks: f32 {slow:.3g} FLOP/s, {kind} {fast:.3g} FLOP/s" if fast else "", *shapes]
    if cpu:
        advice = (f"XLA:CPU has no {kind} matrix unit and computes {kind} dots in f32 (the converts are its own); "
                  f"judge {kind} speed on the accelerator you target; on CPU, compute in f32 (the module's compute "
                  f"dtype, e.g. Flax's dtype=jnp.float32, and f32 parameters) to drop the converts")
    else:
        advice = (f"keep the operands in {kind} and ask for an f32 result: jnp.dot(x, w, preferred_element_type="
                  "jnp.float32) (or lax.dot_general(..., preferred_element_type=...)) instead of casting the "
                  f"inputs with .astype(jnp.float32); check the mixed-precision policy (e.g. a module's dtype/"
                  f"param_dtype) that casts {kind} weights up before the matmul")
    title = f"{len(rows)} matmul(s) taking {fmt_s(mm_s)} per step convert {kind} inputs up to f32 before the dot"
    return [make(x, "dtype-upcast", title, lost, advice, UPCAST_SOURCE, evidence, np.concatenate([rows, conv]))]


def _mxu_tiles(x: FindingInputs, dtype: str) -> tuple[int, int] | None:
    """(row tile, column tile) the chip's matrix unit computes in, or None (CPU, unknown)."""
    if x.chip is None:
        return None
    if x.chip.kind == "tpu":
        return TPU_ROW_TILE, 256 if x.chip.id in TPU_WIDE_MXU else 128
    if x.chip.kind == "gpu" and x.chip.vendor.lower().startswith("nvidia"):
        bits = ELEMENT_BITS.get(dtype, 16) or 16
        n = max(128 // bits, 1)  # 16 bytes of elements
        return n, n
    return None


def _contracts_rows(dot: Instruction) -> bool:
    """Whether a dot contracts both operands over their leading dims, with no batch dims: x^T·g, a weight's
    gradient summed over the rows of the batch (a forward x·W or an input gradient g·W^T contracts features)."""
    if dot.opcode != "dot" or dot.attr_ints("lhs_batch_dims") or dot.attr_ints("rhs_batch_dims"):
        return False
    lc, rc = dot.attr_ints("lhs_contracting_dims"), dot.attr_ints("rhs_contracting_dims")
    return bool(lc) and set(lc) == set(range(len(lc))) and set(rc) == set(range(len(rc)))


def mxu_alignment(x: FindingInputs) -> list[Finding]:
    """Dots whose M, K or N are not multiples of the matrix unit's tile: the padded part of each tile is
    computed and discarded. Lost: the wasted share of the op's compute time at peak (``compute_s`` x
    waste / (1 - waste)), at most its measured time."""
    mm = x.matmuls
    if not len(mm) or not x.modules or x.chip is None or x.chip.kind not in MXU_SOURCE:
        return []
    hits, lost, wasted_flops, evidence = [], 0.0, 0.0, []
    rows_k: set[int] = set()  # K of weight gradients short of the tile: the rows per device
    model_dims = False  # some hit is short in a model dim
    c = x.cols
    module, program, op, dtype, phase = (c.value(k) for k in ("module", "program_id", "hlo_op", "dtype", "phase"))
    compute_s, measured, flops = c.num("compute_s"), c.num("measured_s"), c.num("flops")
    for i in mm:
        tiles = _mxu_tiles(x, str(dtype[i]))
        got = x.programs.instruction(module[i], program[i], op[i])
        dot = got[0].dot_of(got[1]) if got else None
        dims = dot_dims(got[0], dot) if dot is not None and tiles else None
        if not dims or min(dims) <= 0:
            continue
        m, k, n = dims
        padded = (_pad(m, tiles[0]), _pad(k, tiles[1]), _pad(n, tiles[1]))
        waste = 1 - m * k * n / math.prod(padded)
        if waste < MXU_WASTE_MIN:
            continue
        hits.append(i)
        gradient = str(phase[i]) == "backward" and _contracts_rows(dot)
        if gradient and padded[1] != k:
            rows_k.add(k)
        model_dims |= padded[0] != m or padded[2] != n or (padded[1] != k and not gradient)
        compute = float(compute_s[i]) if np.isfinite(compute_s[i]) else 0.0
        lost += min(compute * waste / (1 - waste), float(measured[i])) / x.per
        wasted_flops += float(flops[i]) * waste / (1 - waste) / x.per
        if len(evidence) < 4:
            evidence.append(f"{op[i]}: M x K x N = {m} x {k} x {n} computed as {padded[0]} x {padded[1]} x "
                            f"{padded[2]} ({waste:.0%} of the work is padding)"
                            + (" (a weight gradient: K is the rows per device)" if gradient else ""))
    if not hits:
        return []
    tile = _mxu_tiles(x, "bf16")[1] if x.chip.kind == "tpu" else None
    unit = f"{tile}x{tile} MXU" if tile else "Tensor Core tiles"
    evidence.append(f"{wasted_flops:.3g} padded FLOPs per step")
    advice = []
    if model_dims:
        advice.append(f"make the model dims these matmuls contract and produce multiples of {tile or 'the tile'} "
                      "(hidden, FFN, head and vocabulary sizes; e.g. 100 -> 128), or pad the weights; the batch rows "
                      f"in multiples of {TPU_ROW_TILE if tile else 'the tile'}")
    if rows_k:  # s43 trial: K = 32 rows per device of x^T.g, and the advice named the model dims (already 256)
        advice.append(f"the weight gradients (x^T·g) contract over the rows each device holds (K = "
                      f"{fmt_list(sorted(rows_k))}): only more rows per device fill the tile, a per-device batch "
                      f"(x sequence) of a multiple of {tile or 'the tile'} (a larger batch or fewer data-parallel ways)")
    advice = "; ".join(advice)
    title = f"{len(hits)} matmul(s) have dims that do not fill the {unit} of {x.chip.name}"
    return [make(x, "mxu-alignment", title, lost, advice, MXU_SOURCE[x.chip.kind], evidence, np.array(hits))]


def small_matmul(x: FindingInputs) -> list[Finding]:
    """Memory-bound matmuls: arithmetic intensity under the chip's ridge point (peak ÷ HBM bandwidth), named when
    they take ``SMALL_MATMUL_SHARE_MIN`` of the step. Lost: their memory time above their compute floor (what
    batching them up to the ridge would save), at most their measured time."""
    mm = x.matmuls
    bw = x.chip.hbm_bandwidth_bytes_per_s if x.chip is not None else None
    if not len(mm) or not bw:
        return []
    c = x.cols
    peak, intensity = c.num("peak_flops_per_s"), c.num("arithmetic_intensity_flops_per_byte")
    low = mm[(intensity[mm] < peak[mm] / bw) & (c.text("bound")[mm] == "memory")]
    if not len(low):
        return []
    measured = c.num("measured_s")[low]
    over = np.minimum(measured, c.num("memory_s")[low]) - c.num("compute_s")[low]
    lost = total(np.where(over < 0, 0.0, over)) / x.per
    t = total(measured) / x.per
    if not x.step_s > 0 or t < SMALL_MATMUL_SHARE_MIN * x.step_s:
        return []
    op, operands = c.value("hlo_op"), c.value("operand_shapes")
    evidence = [f"{op[i]}: {intensity[i]:.3g} FLOP/B under the ridge {peak[i] / bw:.3g} FLOP/B ({operands[i]})"
                for i in low[descending(over)[:3]]]
    advice = ("raise the rows each matmul sees (a larger batch per device, or several small matmuls that share "
              "an operand stacked into one: one einsum for Q/K/V, jax.vmap over heads or experts instead of a "
              "Python loop); otherwise fuse the small product into its neighbours")
    title = (f"{len(low)} matmul(s) taking {fmt_s(t)} per step ({share(t, x.step_s)}) are memory-bound, under the "
             f"ridge point of {x.chip.name}")
    return [make(x, "small-matmul", title, lost, advice, SMALL_SOURCE, evidence, low)]


def opaque_custom_call(x: FindingInputs) -> list[Finding]:
    """Time in custom-calls traceroof has no cost model for: measured only (no lost time can be put on it)."""
    c = x.cols
    if "opaque" not in c:
        return []
    opaque = np.flatnonzero(c.flag("opaque") & (c.num("measured_s") > 0))
    if not len(opaque):
        return []
    t = total(c.num("measured_s")[opaque]) / x.per
    title = f"{fmt_s(t)} per step in opaque custom-calls ({share(t, x.step_s)}): measured, no expectation"
    advice = ("check these kernels against their own figures (library benchmarks; a Pallas kernel's "
              "pl.CostEstimate); where a plain jnp/lax expression exists, compare it: XLA can cost and fuse that")
    shape = c.value("shape")
    targets = sorted({str(shape[i]) for i in opaque})[:3]
    return [make(x, "opaque-custom-call", title, float("nan"), advice, OPAQUE_SOURCE,
                 [f"{len(opaque)} op(s); output shapes {', '.join(targets)}"], opaque)]


def faster_than_roofline(x: FindingInputs) -> list[Finding]:
    """Ops measured more than ``FASTER_THAN_ROOF_RATIO`` x faster than their roofline (async windows excepted):
    the chip figures or the cost model overstate their work, so their lost time reads negative."""
    c = x.cols
    is_async = np.array([o is not None and ASYNC_OPCODE.search(o) is not None for o in c.text("opcode")], bool) | \
        np.array([n is not None and n.startswith("async") for n in c.text("hlo_op")], bool)
    expected, measured = c.num("expected_s"), c.num("measured_s")
    fast = np.flatnonzero(c.flag("joined") & ~np.isnan(expected) & ~is_async
                          & (expected > FASTER_THAN_ROOF_RATIO * measured))
    if not len(fast):
        return []
    executions = c.num("executions")[fast]
    per_exec = pd.Series(c.num("hbm_bytes")[fast] / np.where(executions < 1, 1.0, executions))
    compute = int(sum(b == "compute" for b in c.text("bound")[fast])) if "bound" in c else 0
    if x.chip is not None and x.chip.kind == "cpu" and compute * 2 > len(fast):
        # compute-bound: caches do not explain them; the calibrated FLOP/s peak is below what they reached
        why = (f"{compute} of them compute-bound, so the calibrated FLOP/s peak is below what they reached"
               + (" (it was measured on a loaded machine: run `traceroof calibrate` on an idle one)"
                  if x.chip.load_note else " (`traceroof calibrate` on an idle machine re-measures it)"))
    elif x.chip is not None and x.chip.kind == "cpu":
        why = (f"their bytes per run (median {fmt_bytes(float(per_exec.median()))}) come from CPU caches, "
               "faster than the calibrated DRAM roof"
               + (f"; {compute} compute-bound one(s) ran above the calibrated FLOP/s peak" if compute else ""))
    else:
        why = "the cost model or the chip figures overstate these ops' work"
    title = f"{len(fast)} op(s) ran more than {FASTER_THAN_ROOF_RATIO:g}x faster than their roofline: {why}"
    advice = ("read their efficiency as an artefact, not a target; if they matter, check their FLOP and byte "
              "counts in the HLO (and the chip file's peaks)")
    return [make(x, "faster-than-roofline", title, float("nan"), advice, ROOF_SOURCE, [], fast)]
