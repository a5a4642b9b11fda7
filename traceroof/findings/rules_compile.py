"""Compilation inside the profiled steps (``recompile``): steps in which the device waited while the host traced
and compiled a program, the programs that first ran there, and whether one of them is a program compiled again
under a name that ran before (a jit cache miss: new shapes, dtypes, shardings or static arguments).

Reads the step breakdown (``Analysis.step_breakdown``: ``step``, ``step_time_s``, ``host_bound_s`` and
``host_bound_compile_share``, the share of the host-bound time during which the host's compiler threads ran,
lines named ``compil``/``codegen``: :mod:`traceroof.hostactivity`, :mod:`traceroof.breakdown`) and the op
table's ``module``, ``program_id``, ``step`` and ``start_ps``. The whole host-bound time of such a step is
the compilation's: tracing the function again runs on the Python thread before the compiler threads start (s37
trial, a Flax ResNet under ``jax.pmap``: step 1 waited 2.48 s, the compiler threads ran 84 % of it, Python
tracing the rest), so ``host-bound`` leaves these steps to this rule (:func:`compiling_steps`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from traceroof.breakdown import device_hosts, step_windows
from traceroof.findings.record import Finding, FindingInputs, fmt_s, make
from traceroof.units import fmt_list

COMPILE_SHARE_MIN = 0.1  # a step compiled when the device waited on compilation for this share of it
COMPILE_SOURCE = ("JAX docs: jit caching and recompilation (a new shape, dtype, sharding or static argument "
                  "compiles a function again; jax_explain_cache_misses logs which argument changed); traceroof step "
                  "breakdown (host-bound time while the host compiled)")


def compiling_steps(b: pd.DataFrame) -> pd.DataFrame:
    """The steps of step breakdown ``b`` in which the device waited on compilation: one row per such step
    (index ``step``) with ``step_time_s``, ``host_bound_s`` and ``compile_s`` (the host-bound time while the host
    compiled), each the mean over the step's devices; a step is one when ``compile_s`` is at least
    :data:`COMPILE_SHARE_MIN` of its time. Empty without a ``host_bound_compile_share`` column."""
    cols = ["step_time_s", "host_bound_s", "compile_s"]
    if b is None or not {"step", "step_time_s", "host_bound_s", "host_bound_compile_share"} <= set(b.columns):
        return pd.DataFrame(columns=cols)
    hb = b["host_bound_s"].to_numpy(np.float64)
    share = np.nan_to_num(b["host_bound_compile_share"].to_numpy(np.float64), nan=0.0)
    per = pd.DataFrame({"step": b["step"].to_numpy(), "step_time_s": b["step_time_s"].to_numpy(np.float64),
                        "host_bound_s": hb, "compile_s": hb * share}).groupby("step", sort=True).mean()
    return per[(per["compile_s"] > 0) & (per["compile_s"] >= COMPILE_SHARE_MIN * per["step_time_s"])]


EAGER_OPS_MAX = 2  # a program of at most this many ops is an operation run eagerly (jit_equal, jit__where)


def _first_runs(ops: pd.DataFrame, steps: list[int], periods: pd.DataFrame | None = None
                ) -> list[tuple[str, int, int, list[int], int]]:
    """The programs (``module``, ``program_id``) whose first op event in the profile lies in one of the used
    ``steps``, as ``(module, program id, step, ids of the programs of the same name that started earlier, number
    of distinct HLO ops that ran)``: a program with earlier namesakes was compiled again. A program launched
    outside the steps (an evaluation between marked steps, a validation at an epoch's end) is in the step whose
    period holds its first event (``periods``: the steps table, ``host``, ``step``, ``start_ps``, ``end_ps``):
    its compile held that step up (s42 trial, Keras ``fit``: the validation program compiled in step 6's period,
    read as "no program of the profile first ran there")."""
    need = ("module", "program_id", "step", "start_ps", "hlo_op")
    if not all(c in ops for c in need) or ops.empty:
        return []
    o = pd.DataFrame({"module": ops["module"].astype(object).to_numpy(),
                      "program_id": ops["program_id"].to_numpy(dtype="float64", na_value=np.nan),
                      "step": ops["step"].to_numpy(dtype="float64", na_value=np.nan),
                      "start_ps": ops["start_ps"].to_numpy(np.float64), "hlo_op": ops["hlo_op"].astype(object)})
    if periods is not None and not periods.empty and {"host", "device"} <= set(ops) and o["step"].isna().any():
        outside = o["step"].isna() & ~o["module"].isin(o.loc[o["step"].notna(), "module"].unique())
        held = _period_of(ops, periods)[outside.to_numpy()]
        # dispatch is asynchronous: launched (and compiled) in a step, a program may start in the next one's period
        o.loc[outside, "step"] = np.where(np.isin(held - 1, steps) & ~np.isin(held, steps), held - 1, held)
    o = o[o["module"].notna() & o["program_id"].notna()]
    g = o.groupby(["module", "program_id"], sort=True)
    first = pd.DataFrame({"start_ps": g["start_ps"].min(),
                          "used_start_ps": o[o["step"].notna()].groupby(["module", "program_id"])["start_ps"].min(),
                          "step": g["step"].min(), "ops": g["hlo_op"].nunique()}).reset_index()
    # compiled in a used step as far as the profile shows: its first event is in that step (not before it, in a
    # warm-up step or outside the steps)
    new = first[first["step"].isin(steps) & (first["start_ps"] == first["used_start_ps"])]
    out = []
    for r in new.itertuples(index=False):
        earlier = first[(first["module"] == r.module) & (first["start_ps"] < r.start_ps)].sort_values("start_ps")
        out.append((str(r.module), int(r.program_id), int(r.step), [int(p) for p in earlier["program_id"]],
                    int(r.ops)))
    return out


def _period_of(ops: pd.DataFrame, periods: pd.DataFrame) -> np.ndarray:
    """Per op row, the step (float, NaN: none) whose period on the row's device holds the row's first start: the
    step breakdown's window (:func:`traceroof.breakdown.step_windows`, from the previous step's end to its own)."""
    out = np.full(len(ops), np.nan)
    start = ops["start_ps"].to_numpy(np.float64)
    device = ops["device"].astype(str).to_numpy()
    for d, w in step_windows(periods, device_hosts(ops)).groupby("device", sort=False):
        w = w.sort_values("start_ps")
        on = np.flatnonzero(device == d)
        at = np.searchsorted(w["start_ps"].to_numpy(np.float64), start[on], side="right") - 1
        ok = (at >= 0) & (start[on] < w["end_ps"].to_numpy(np.float64)[np.maximum(at, 0)])
        out[on[ok]] = w["step"].to_numpy(np.float64)[at[ok]]
    return out


def _warmup_advice(analysis: object, b: pd.DataFrame, steps: list[int]) -> str:
    """``--warmup-steps N`` that leaves the compiling ``steps`` out when they are the first used steps of step
    breakdown ``b`` and steps remain after them ('' otherwise: a compile in a later step cannot be skipped so).
    N counts the profile's steps from its first (``analysis.steps``, warm-up steps included), not step numbers."""
    used = sorted(int(s) for s in b["step"].unique())
    if used[:len(steps)] != steps or len(steps) >= len(used):
        return ""
    table = getattr(analysis, "steps", None)
    every = sorted({int(s) for s in table["step"].dropna()} | set(used)) if isinstance(table, pd.DataFrame) and \
        "step" in table else used
    return f"--warmup-steps {every.index(steps[-1]) + 1}"


def recompile(x: FindingInputs) -> list[Finding]:
    """The used steps in which the device waited while the host traced and compiled (:func:`compiling_steps`),
    one finding for them all, naming the programs compiled again or first run there. Lost: their host-bound
    time, per step of the analysis."""
    b = x.table("step_breakdown")
    hit = compiling_steps(b)
    if b is None or hit.empty:
        return []
    n_steps = int(b["step"].nunique())
    lost = float(hit["host_bound_s"].sum()) / max(n_steps, 1)
    steps = [int(s) for s in hit.index]
    median = float(b.groupby("step")["step_time_s"].mean().median())
    runs = _first_runs(x.analysis.ops, steps, getattr(x.analysis, "steps", None))
    again = [f"{m} (step {st})" for m, _, st, before, _ in runs if before]
    fresh = [f"{m} (step {st})" for m, _, st, before, _ in runs if not before]
    eager = bool(fresh) and all(n <= EAGER_OPS_MAX for *_, before, n in runs if not before)
    if len(steps) == 1:
        r = hit.iloc[0]
        title = (f"step {steps[0]} waited {fmt_s(r['host_bound_s'])} on tracing and compiling (the host compiled "
                 f"{fmt_s(r['compile_s'])} of it; the step took {fmt_s(r['step_time_s'])}, the median step "
                 f"{fmt_s(median)})")
    else:
        title = (f"{len(steps)} of {n_steps} steps waited on tracing and compiling "
                 f"({fmt_s(float(hit['host_bound_s'].sum()))} in all, steps {fmt_list(steps, 6)}; the median step "
                 f"{fmt_s(median)})")
    if again:
        title += f"; compiled again: {fmt_list(again)}"
    elif fresh:
        title += f"; first run: {fmt_list(fresh)}"
    every = len(steps) > 1 and len(steps) >= n_steps / 2
    skip = _warmup_advice(x.analysis, b, steps)
    if again or every:
        advice = ("a jitted function was compiled again because an argument's shape, dtype, sharding or a static "
                  "argument changed between calls: run with JAX_EXPLAIN_CACHE_MISSES=1 (or jax.config.update("
                  "'jax_explain_cache_misses', True)) to log which one, then keep it fixed (pad to a few bucketed "
                  "shapes, pass Python numbers as arrays or as static arguments consistently, and put the state on "
                  "the shardings the step returns: e.g. state made with flax.jax_utils.replicate or device_put "
                  "differs from what jax.pmap / jit hands back after the first step)")
        if not every and skip:
            advice += f"; a compile that happens once can be left out of the figures with {skip}"
    elif eager:
        advice = ("these are operations run eagerly, outside jit: each compiles a small program of its own the first "
                  "time it meets a shape (e.g. metrics or callbacks computed at the end of an epoch): move them under "
                  "the step's jit" + (f", or leave the step out with {skip}" if skip else ""))
    elif fresh:
        advice = ("compile it before the measured steps (jax.jit(f).lower(*args).compile(), or one call outside "
                  "the trace)" + (f", or leave the step out with {skip}" if skip else ""))
    else:
        advice = ("no program of the profile first ran there: the host compiled something outside the traced "
                  "programs (an operation run eagerly outside jit compiles its own small program; a jit call "
                  "cached nowhere): move the work under the step's jit"
                  + (f", or leave the step out with {skip}" if skip else ""))
    evidence = [f"{m}: program {pid} first ran in step {st}, after program(s) {fmt_list(before)} of that name"
                if before else f"{m}: program {pid} first ran in step {st}" for m, pid, st, before, _ in runs[:3]]
    if len(steps) > 1:
        evidence += [f"step {s}: waited {fmt_s(hit.loc[s, 'host_bound_s'])} of {fmt_s(hit.loc[s, 'step_time_s'])}, "
                     f"the host compiling {fmt_s(hit.loc[s, 'compile_s'])}" for s in steps[:3]]
    return [make(x, "recompile", title, lost, advice, COMPILE_SOURCE, evidence, ops=())]
