"""The findings engine: small rules over the op, layer, collective (and, where the analysis has them, step
breakdown and parallelism) tables, each returning :class:`Finding` records with a stable ``code``, the time
they cost per step, evidence, advice, the source of the advice and the user's source lines.

:data:`RULES` maps each code to its rule (a function of :class:`FindingInputs`); :data:`CODES` describes them
(the README's table); :func:`run_rules` runs them all and ranks the findings by ``lost_per_step_s``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from traceroof.findings.record import Finding, FindingInputs, Rule, as_record
from traceroof.findings.rules_compile import recompile
from traceroof.findings.rules_compute import (dtype_upcast, faster_than_roofline, mxu_alignment, opaque_custom_call,
                                              small_matmul)
from traceroof.findings.rules_memory import layout_copy, memory_bound_chain, remat_cost, tile_padding
from traceroof.findings.rules_optimizer import discarded_update, donation_copy
from traceroof.findings.rules_system import (collective_straggler, comm_bound_axis, device_idle, exposed_collective,
                                             gradients_reduced_in_loop, host_bound, outlier_executions)

if TYPE_CHECKING:
    from traceroof.results import Analysis

RULES: dict[str, Rule] = {
    "dtype-upcast": dtype_upcast,
    "mxu-alignment": mxu_alignment,
    "tile-padding": tile_padding,
    "small-matmul": small_matmul,
    "memory-bound-chain": memory_bound_chain,
    "layout-copy": layout_copy,
    "exposed-collective": exposed_collective,
    "collective-straggler": collective_straggler,
    "gradients-in-loop": gradients_reduced_in_loop,
    "host-bound": host_bound,
    "device-idle": device_idle,
    "recompile": recompile,
    "remat-cost": remat_cost,
    "discarded-update": discarded_update,
    "donation-copy": donation_copy,
    "comm-bound-axis": comm_bound_axis,
    "opaque-custom-call": opaque_custom_call,
    "outlier-executions": outlier_executions,
    "faster-than-roofline": faster_than_roofline,
}

CODES: dict[str, str] = {
    "dtype-upcast": "matmuls fed bf16/f16/fp8 data converted up to f32 (convert -> dot; XLA:CPU's bf16 dots)",
    "mxu-alignment": "matmul dims that are not multiples of the MXU (TPU) or Tensor Core (NVIDIA) tile",
    "tile-padding": "ops moving > 25 % more bytes because tiled layouts round dims up",
    "small-matmul": "matmuls under the chip's ridge point (memory-bound): batch or stack them",
    "memory-bound-chain": "memory-bound ops feeding each other unfused: intermediates round-trip through memory",
    "layout-copy": "transposes and copies that only change a layout",
    "exposed-collective": "collectives not hidden under compute, with the async form or scheduler flag to try",
    "collective-straggler": "one device arriving last at most collectives while the others wait",
    "gradients-in-loop": "weight gradients reduced over a data / FSDP axis inside a loop, many times per step",
    "host-bound": "the device idle while the host works (step breakdown, else op coverage of the step)",
    "device-idle": "the device idle with no host work in the way: launch gaps and time between programs",
    "recompile": "steps spent tracing and compiling a program again (jit cache misses) or for the first time",
    "remat-cost": "time recomputing the forward pass, and the memory keeping it would take",
    "discarded-update": "an optimizer update computed on every micro-step and kept on every k-th (optax.MultiSteps)",
    "donation-copy": "donated state XLA copies every step before updating it in place (donate_argnums)",
    "comm-bound-axis": "a parallelism axis whose communication outlasts its math (parallelism analysis)",
    "opaque-custom-call": "time in kernels with no cost model (measured only)",
    "outlier-executions": "ops whose executions vary > 10x (noise, contention, first runs)",
    "faster-than-roofline": "ops faster than their roofline: the chip figures or cost counts overstate them",
}


def _rank(f: Finding) -> tuple[int, float, str, str]:
    lost = f.lost_per_step_s
    return (0 if math.isfinite(lost) else 1, -lost if math.isfinite(lost) else 0.0, f.code, f.title)


def run_rules(x: FindingInputs, codes: tuple[str, ...] | None = None) -> tuple[Finding, ...]:
    """Every rule (or those of ``codes``) on ``x``, most time lost per step first (findings with no time
    figure last)."""
    out: list[Finding] = []
    for code, rule in RULES.items():
        if codes is None or code in codes:
            out += rule(x)
    return tuple(sorted(out, key=_rank))


def with_findings(a: Analysis, x: FindingInputs) -> Analysis:
    """``a`` with the findings of every rule on ``x`` (built over ``a``)."""
    return replace(a, findings=run_rules(x))


__all__ = ["CODES", "Finding", "FindingInputs", "RULES", "as_record", "run_rules", "with_findings"]
