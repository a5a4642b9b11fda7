"""Named-scope paths, phases and the per-layer rollup.

JAX writes each op's framework path into HLO metadata ``op_name``
(``jit(train_step)/transpose(jvp(layer_0))/mlp/btd,df->btf/dot_general``; ``docs/reference/hlo-text.md`` §7.1):
``jit(...)`` wrappers, named scopes, and the primitive last. Backward ops are wrapped in ``transpose(...)``.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

NO_SCOPE = "(no scope)"
TOP_LEVEL = "(top level)"
# a scope segment that names an optimizer update (whole segment, case-insensitive)
DEFAULT_OPTIMIZER_PATTERN = (r"optimizer|optim|optax(_\w+)?|opt_update|apply_updates|apply_gradients|adam\w*|sgd|"
                             r"momentum|lamb|lion|adafactor|rmsprop|shampoo")
# segments JAX's transformations add to the name stack (loops, calls, remat), not user scopes
STRUCTURAL_SEGMENTS = frozenset({"while", "body", "cond", "closed_call", "core_call", "remat", "checkpoint",
                                 "rematted_computation", "custom_jvp_call", "custom_vjp_call", "pjit", "scan"})
# jnp.einsum pushes its spec ("btd,df->btf") onto the name stack: not a user scope
_EINSUM_SPEC = re.compile(r"[A-Za-z.,\s]*->[A-Za-z.\s]*")


def _split_path(op_name: str) -> list[str]:
    """Split on '/' outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in op_name:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "/" and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _unwrap(segment: str) -> tuple[str, bool]:
    """Strip ``jvp(...)`` / ``transpose(...)`` / ``vmap(...)`` wrappers; True if a transpose was seen."""
    backward = False
    while True:
        m = re.fullmatch(r"(jvp|transpose|vmap|pjit|remat|checkpoint|custom_jvp_call|custom_vjp_call)\((.*)\)",
                         segment)
        if not m:
            return segment, backward
        backward = backward or m.group(1) == "transpose"
        segment = m.group(2)


def parse_scope(op_name: str, optimizer_pattern: str = DEFAULT_OPTIMIZER_PATTERN) -> tuple[str, str]:
    """(scope path, phase) of an ``op_name``.

    The scope path joins the named scopes with '/' after dropping ``jit(...)`` segments, unwrapping
    ``jvp``/``transpose`` wrappers, dropping structural segments (``while``, ``body``, ``closed_call``,
    ``checkpoint``...) and einsum specs, and removing the last segment (the primitive). Phase: ``backward`` when a
    ``transpose(`` wraps any segment, ``optimizer`` when a scope matches ``optimizer_pattern``, else
    ``forward``; ``remat`` for the forward recomputed in a backward pass (``checkpoint/rematted_computation``).
    ``optimizer_pattern`` must match a whole scope segment. Ops without an ``op_name`` get ``(no scope)``; unscoped ops ``(top level)``.
    Merged names (``a;b``) use the first.
    """
    if not op_name:
        return NO_SCOPE, "forward"
    first = op_name.split(";")[0]
    segs = _split_path(first)
    if len(segs) == 1:  # a bare compiler-made name ("broadcast.11") or a parameter name
        return NO_SCOPE, "forward"
    backward = "transpose(" in first
    scopes = []
    for s in segs[:-1]:
        if re.fullmatch(r"jit\(.*\)", s):
            continue
        inner, _ = _unwrap(s)
        if inner and not _EINSUM_SPEC.fullmatch(inner) and inner not in STRUCTURAL_SEGMENTS:
            scopes.append(inner)
    path = "/".join(scopes) or TOP_LEVEL
    phase = phase_of(scopes, backward, optimizer_pattern)
    if phase == "backward" and "rematted_computation" in segs:
        return path, "remat"  # forward recomputed inside the backward pass (jax.checkpoint)
    return path, phase


def phase_of(scopes: list[str], backward: bool, optimizer_pattern: str = DEFAULT_OPTIMIZER_PATTERN) -> str:
    """``optimizer`` when a scope matches ``optimizer_pattern``, else ``backward`` when ``backward`` or a scope
    is TensorFlow's ``gradient_tape``, else ``forward``."""
    if any(re.fullmatch(optimizer_pattern, s, re.I) for s in scopes):
        return "optimizer"
    return "backward" if backward or "gradient_tape" in scopes else "forward"


def layer_of(scope: str, depth: int) -> str:
    """The first ``depth`` scope segments (the whole path when shorter)."""
    if scope in (NO_SCOPE, TOP_LEVEL) or depth <= 0:
        return scope
    return "/".join(scope.split("/")[:depth])


PHASE_ORDER = {"forward": 0, "remat": 1, "backward": 2, "optimizer": 3}


def rollup(ops: pd.DataFrame, per_step_divisor: float, step_time_s: float) -> pd.DataFrame:
    """Per (layer, phase) rollup of the op table's counted rows in marked steps; totals are divided by
    ``per_step_divisor`` (steps used x devices) to give per-step, per-device figures.

    Columns: ``layer``, ``phase``, ``ops`` (distinct HLO ops), ``time_per_step_s``, ``share_of_step`` (of the
    mean step time), ``flops_per_step``, ``hbm_bytes_per_step``, ``expected_per_step_s``, ``efficiency``
    (expected ÷ measured over ops with an expectation), ``bound`` (the bound holding most expected time),
    ``lost_per_step_s``, ``exposed_comm_per_step_s`` (collective time no other op covered), ``worst_op`` (the op
    losing most time). Sorted by time, largest first.
    """
    cols = ["layer", "phase", "ops", "time_per_step_s", "share_of_step", "flops_per_step", "hbm_bytes_per_step",
            "expected_per_step_s", "efficiency", "bound", "lost_per_step_s", "exposed_comm_per_step_s", "worst_op"]
    d = ops[ops["counted"] & ops["step"].notna()]
    if d.empty or per_step_divisor <= 0:
        return pd.DataFrame(columns=cols)
    k = 1.0 / per_step_divisor
    rows = []
    for (layer, phase), g in d.groupby(["layer", "phase"], observed=True, sort=False):
        has_exp = g["expected_s"].notna()
        measured = g["measured_s"].sum() * k
        exp_sum = g.loc[has_exp, "expected_s"].sum() * k
        meas_exp = g.loc[has_exp, "measured_s"].sum() * k
        by_bound = g[has_exp].groupby("bound", observed=True)["expected_s"].sum()
        per_op = g.groupby("hlo_op", observed=True)["lost_s"].sum(min_count=1)
        rows.append({
            "layer": layer, "phase": phase, "ops": g["hlo_op"].nunique(),
            "time_per_step_s": measured,
            "share_of_step": measured / step_time_s if step_time_s > 0 else np.nan,
            "flops_per_step": g["flops"].sum() * k,
            "hbm_bytes_per_step": g["hbm_bytes"].sum() * k,
            "expected_per_step_s": exp_sum,
            "efficiency": exp_sum / meas_exp if meas_exp > 0 else np.nan,
            "bound": str(by_bound.idxmax()) if len(by_bound) else ("opaque" if g["opaque"].any() else "unknown"),
            "lost_per_step_s": g["lost_s"].sum() * k,
            "exposed_comm_per_step_s": g["comm_exposed_s"].sum() * k if "comm_exposed_s" in g else 0.0,
            "worst_op": str(per_op.idxmax()) if per_op.notna().any() else "",
        })
    out = pd.DataFrame(rows, columns=cols)
    out["_p"] = out["phase"].map(PHASE_ORDER).fillna(9)
    out = out.sort_values(["time_per_step_s", "layer", "_p"], ascending=[False, True, True], kind="stable")
    return out.drop(columns="_p").reset_index(drop=True)
