"""Named-scope paths, phases and the per-layer rollup.

JAX writes each op's framework path into HLO metadata ``op_name``
(``jit(train_step)/transpose(jvp(layer_0))/mlp/btd,df->btf/dot_general``; ``docs/reference/hlo-text.md`` §7.1):
``jit(...)`` wrappers, named scopes, and the primitive last. Backward ops are wrapped in ``transpose(...)``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np
import pandas as pd

from traceroof.codes import as_text, first_rows, group_codes, group_median, group_sum, positions

NO_SCOPE = "(no scope)"
TOP_LEVEL = "(top level)"
# an op XLA's combiner made from several layers' ops (one tuple all-reduce of their gradients)
COMBINED_SCOPE = "(combined)"
# phase of work that is neither the model's forward, backward nor optimizer: jax.random outside any layer (the
# step's key handling, a batch generated inside the step annotation); see traceroof.scopes
OTHER_PHASE = "other"
# a scope segment that names an optimizer update (whole segment, case-insensitive)
DEFAULT_OPTIMIZER_PATTERN = (r"optimizer|optim|optax(_\w+)?|opt_update|apply_updates|apply_gradients|adam\w*|sgd|"
                             r"momentum|lamb|lion|adafactor|rmsprop|shampoo")
# segments JAX's transformations add to the name stack (loops, calls, remat), not user scopes
STRUCTURAL_SEGMENTS = frozenset({"while", "closed_call", "core_call", "remat", "checkpoint",
                                 "rematted_computation", "custom_jvp_call", "custom_vjp_call", "pjit", "scan",
                                 "shard_map"})
# the parts of a loop (``while/body``, ``while/cond``): structural only right after ``while`` (a user module may
# be called ``body``)
LOOP_PARTS = frozenset({"body", "cond"})
# segments that only mark gradient code (TensorFlow/Keras ``gradient_tape/``): dropped so backward rows line up
# with their forward rows (the phase still says backward)
GRADIENT_SEGMENTS = frozenset({"gradient_tape"})
# a Flax linen method scope (``attn._split_heads``, ``attn.setup``): the module's name, then the method's
_METHOD_SEGMENT = re.compile(r"([A-Za-z_]\w*)\.(_*[a-z]\w*)")
# jax.random's jitted internals (``jit(_threefry_fold_in)``, ``jit(_bernoulli)``): the name stack under them is
# JAX's own; the threefry hash even pushes the name of the function that called it (``train_step``,
# ``RngStream.__call__``), which is no scope of the user's
RNG_JIT = re.compile(r"jit\((_threefry\w*|_uniform|_bernoulli|_normal\w*|_truncated_normal|_randint|_random_bits|"
                     r"_split|_fold_in|_gamma\w*|_beta|_dirichlet|_exponential|_categorical|_permutation|_choice|"
                     r"_gumbel|_random_\w+)\)")
# jnp.einsum pushes its spec ("btd,df->btf") onto the name stack: not a user scope
_EINSUM_SPEC = re.compile(r"[A-Za-z.,\s]*->[A-Za-z.\s]*")
_WRAPPER = re.compile(r"(jvp|transpose|vmap|pjit|remat|checkpoint|custom_jvp_call|custom_vjp_call)\((.*)\)")
_JIT = re.compile(r"jit\(.*\)")


@functools.lru_cache(maxsize=16)  # an analysis uses one pattern (the default or the user's): 16 bounds a loop over many
def _optimizer_re(optimizer_pattern: str) -> re.Pattern:
    """The compiled ``optimizer_pattern`` (case-insensitive): ``re``'s own cache look-up costs a microsecond a
    call, and the pattern is tested on every scope segment."""
    return re.compile(optimizer_pattern, re.I)


def _split_path(op_name: str) -> list[str]:
    """Split on '/' outside parentheses and brackets (a '/' where the opened ``(`` and ``[`` minus the closed
    ones before it are not 0 is part of a segment)."""
    parts = op_name.split("/")
    if "(" not in op_name and ")" not in op_name and "[" not in op_name and "]" not in op_name:
        return parts
    out: list[str] = []
    depth, start = 0, 0
    for i, part in enumerate(parts):
        depth += part.count("(") + part.count("[") - part.count(")") - part.count("]")
        if depth == 0:
            out.append("/".join(parts[start:i + 1]))
            start = i + 1
    if start < len(parts):
        out.append("/".join(parts[start:]))
    return out


def _unwrap(segment: str) -> tuple[str, bool]:
    """Strip ``jvp(...)`` / ``transpose(...)`` / ``vmap(...)`` wrappers; True if a transpose was seen."""
    backward = False
    while True:
        m = _WRAPPER.fullmatch(segment)
        if not m:
            return segment, backward
        backward = backward or m.group(1) == "transpose"
        segment = m.group(2)


# 16384 (op name, pattern) pairs: the op names of dozens of programs (one has hundreds: ~400 in the largest fixture
# module), so one analysis never evicts; bounded because one process (`traceroof watch`, a notebook) may analyze
# program after program, whose names seldom repeat across programs
@functools.lru_cache(maxsize=1 << 14)
def parse_scope(op_name: str, optimizer_pattern: str = DEFAULT_OPTIMIZER_PATTERN) -> tuple[str, str]:
    """(scope path, phase) of an ``op_name``. Cached: a program's instructions share a few hundred names.

    The scope path joins the named scopes with '/' after dropping ``jit(...)`` segments, unwrapping
    ``jvp``/``transpose`` wrappers, dropping ``jit(...)`` segments also where a wrapper held them
    (``transpose(jvp(jit(_take)))``: helper jits fold into the caller's scope), structural segments (``while``,
    ``body``, ``closed_call``, ``checkpoint``...), ``gradient_tape`` and einsum specs, folding Flax method
    scopes (``attn._split_heads``) into their module, dropping everything under a jax.random internal
    (:data:`RNG_JIT`: ``Dropout_0/jit(_threefry_fold_in)/train_step/add`` -> ``Dropout_0``), and removing the last
    segment (the primitive). Phase: ``backward`` when a
    ``transpose(`` wraps any segment, ``optimizer`` when a scope matches ``optimizer_pattern``, else
    ``forward``; ``remat`` for the forward recomputed in a backward pass (``checkpoint/rematted_computation``).
    ``optimizer_pattern`` must match a whole scope segment. Ops without an ``op_name`` get ``(no scope)``;
    unscoped ops ``(top level)``. Merged names (``a;b``) use the first; a combiner's ``prefix/(a:b:c)`` the
    parts' common scope (:func:`_combined_scope`)."""
    if not op_name:
        return NO_SCOPE, "forward"
    first = op_name.split(";")[0]
    segs = _split_path(first)
    if len(segs) == 1:  # a bare compiler-made name ("broadcast.11") or a parameter name
        return NO_SCOPE, "forward"
    if segs[-1].startswith("(") and segs[-1].endswith(")") and ":" in segs[-1]:
        return _combined_scope(segs, optimizer_pattern)
    backward = "transpose(" in first or any(s in GRADIENT_SEGMENTS for s in segs)
    scopes: list[str] = []
    prev = ""
    prev_wrapped = False
    for s in segs[:-1]:
        inner, _ = _unwrap(s)
        if RNG_JIT.fullmatch(inner):
            break
        after_while, prev = prev == "while", inner
        # the backward of a jax.checkpoint-ed scope repeats it: ``transpose(jvp(block_0))/jvp(block_0)/...``
        repeated = prev_wrapped and inner != s and bool(scopes) and scopes[-1] == inner
        prev_wrapped = inner != s
        if not inner or _JIT.fullmatch(inner) or _EINSUM_SPEC.fullmatch(inner) or repeated \
                or inner in STRUCTURAL_SEGMENTS or inner in GRADIENT_SEGMENTS or (after_while and inner in LOOP_PARTS):
            continue
        m = _METHOD_SEGMENT.fullmatch(inner)
        if m is not None:  # a Flax method scope: ``attn.setup`` -> ``attn``; ``attn/attn._split_heads`` -> ``attn``
            if scopes and scopes[-1] == m.group(1):
                continue
            inner = m.group(1)
        scopes.append(inner)
    path = "/".join(scopes) or TOP_LEVEL
    phase = phase_of(scopes, backward, optimizer_pattern)
    if phase == "backward" and ("rematted_computation" in segs or _linearized_in_backward(segs[:-1])):
        return path, "remat"  # forward recomputed inside the backward pass (jax.checkpoint)
    return path, phase


def _linearized_in_backward(segs: list[str]) -> bool:
    """Whether a ``jvp(...)`` scope lies under the innermost ``transpose(...)`` one: forward work linearized again
    inside a backward pass, i.e. recomputed there. A checkpointed loop whose backward re-runs its forward from
    saved states names its ops so (diffrax's RecursiveCheckpointAdjoint: ``transpose(jvp(diffeqsolve))/
    outer-loop/checkpointed-bwd/while/body/jvp(checkpointed-fwd)/.../eqx.nn.MLP/...`` recomputes the states and
    ``.../transpose(jvp(checkpointed-bwd))/while/body/jvp(eqx.nn.MLP)/...`` linearizes the vector field again;
    s38 trial: two of its four matmuls per evaluation counted as model FLOPs, MFU x2); the backward proper is
    ``transpose(jvp(eqx.nn.MLP))/...``. A jax.checkpoint-ed scope's backward repeats its own scope,
    ``transpose(jvp(layer_0))/jvp(layer_0)/checkpoint/...``: that is the backward (its recompute is
    ``rematted_computation``). ``segs``: the scope segments, the primitive left out."""
    last = max((i for i, s in enumerate(segs) if s.startswith("transpose(")), default=-1)
    if last < 0:
        return False
    own = _unwrap(segs[last])[0]
    return any(s.startswith("jvp(") and _unwrap(s)[0] != own for s in segs[last + 1:])


def is_combined(op_name: str) -> bool:
    """Whether ``op_name`` is one XLA's combiner wrote for an op made from several (``prefix/(a:b:c)``)."""
    segs = _split_path(op_name.split(";")[0]) if op_name else []
    return len(segs) > 1 and segs[-1].startswith("(") and segs[-1].endswith(")") and ":" in segs[-1]


def _combined_scope(segs: list[str], optimizer_pattern: str) -> tuple[str, str]:
    """Scope and phase of an op XLA's combiner made from several (``jit(step)/(a/dot:b/dot:jvp()/reduce_sum)``:
    one tuple all-reduce of many layers' gradients): the scope the parts share (their common leading segments),
    else :data:`COMBINED_SCOPE`; parts without a scope (a loss reduction's ``jvp()/reduce_sum``) are left out
    while they are fewer than half the parts, else the op is :data:`COMBINED_SCOPE` too (s37 trial: a pmap step's
    ``pmean`` of 20 gradients at top level combined with one BatchNorm psum read as that BatchNorm's backward);
    the phase of the parts when they agree, else the latest of them in a step."""
    prefix = "/".join(segs[:-1])
    parts, depth, cur = [], 0, []
    for ch in segs[-1][1:-1]:  # split on ':' outside parentheses
        depth += (ch == "(") - (ch == ")")
        if ch == ":" and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parsed = [parse_scope(f"{prefix}/{p}", optimizer_pattern) for p in parts + ["".join(cur)]]
    scoped = [sc.split("/") for sc, _ in parsed if sc not in (TOP_LEVEL, NO_SCOPE)]
    common: list[str] = []
    for level in zip(*scoped) if scoped else ():
        if len(set(level)) > 1:
            break
        common.append(level[0])
    phase = max((ph for _, ph in parsed), key=lambda ph: PHASE_ORDER.get(ph, 0))
    if 2 * len(scoped) >= len(parsed) and (len(scoped) == 1 or common):
        return "/".join(common) if len(scoped) > 1 else "/".join(scoped[0]), phase
    return (COMBINED_SCOPE if scoped else TOP_LEVEL), phase


def is_rng(op_name: str) -> bool:
    """True when ``op_name`` lies inside a jax.random internal (:data:`RNG_JIT`): key splitting, folding, the
    threefry hash, uniform / bernoulli bits."""
    return any(RNG_JIT.fullmatch(_unwrap(s)[0]) for s in _split_path(op_name.split(";")[0])[:-1])


def phase_of(scopes: list[str], backward: bool, optimizer_pattern: str = DEFAULT_OPTIMIZER_PATTERN) -> str:
    """``optimizer`` when a scope matches ``optimizer_pattern``, else ``backward`` when ``backward`` or a scope
    is TensorFlow's ``gradient_tape``, else ``forward``."""
    match = _optimizer_re(optimizer_pattern).fullmatch
    if any(match(s) for s in scopes):
        return "optimizer"
    return "backward" if backward or "gradient_tape" in scopes else "forward"


def layer_of(scope: str, depth: int) -> str:
    """The first ``depth`` scope segments (the whole path when shorter)."""
    if scope in (NO_SCOPE, TOP_LEVEL) or depth <= 0:
        return scope
    return "/".join(scope.split("/")[:depth])


WRAPPER_SHARE = 0.9  # traceroof's heuristic: a first scope unit over this share of named ops is the model wrapper


@dataclass(frozen=True)
class LayerNamer:
    """Layer names of scope paths: the model wrapper dropped, repeated blocks collapsed, depth counted in units.

    Rule, for depth ``d``: a scope is cut into *units* (segments; a repeated block instance ``h/3`` is one unit
    ``h/*``, ``Block_3`` is ``Block_*``); the first unit, when nearly all named ops share it (the model wrapper:
    ``FlaxGPT2LMHeadModule``, ``CNN``; see :meth:`build`), is dropped; the layer is the first
    ``d`` units, where units above the first repeated block do not count, so the default ``d = 2`` shows a
    block stack's parts (GPT-2: ``transformer/h/*/attn``; a CNN: ``Conv_0``). A scope that is the wrapper
    itself keeps its full name. With ``expand`` each instance keeps its index (``transformer/h/0/attn``).
    Names in parentheses (``(no scope)``, ``(optimizer)``) are layers as they are.

    :param repeats: repeated-block instance scope -> its collapsed scope (``M/h/0`` -> ``M/h/*``).
    :param wrapper: the units dropped from the front (see :meth:`build`).
    """

    repeats: Mapping[str, str] = field(default_factory=dict)
    wrapper: tuple[str, ...] = ()

    @classmethod
    def build(cls, scopes: Mapping[str, float] | Iterable[str], repeats: Mapping[str, str] | None = None
              ) -> "LayerNamer":
        """A namer whose wrapper is the first unit of the scopes holding at least ``WRAPPER_SHARE`` of the named
        scopes' weight (``scopes``: scope -> op count; a plain iterable weighs each scope 1), when it is a class
        name (capitalised: Flax's top module, a stack-frame class; a user's ``jax.named_scope("layers")`` stays)
        and some scope goes deeper than it; else none. A stray op scoped outside the model (GPT-2's
        ``FlaxGPT2PreTrainedModel`` position ids) does not hide the wrapper."""
        base = cls(dict(repeats or {}))
        weights = scopes if isinstance(scopes, Mapping) else {s: 1.0 for s in scopes}
        first: dict[str, float] = {}
        deeper: set[str] = set()
        for sc, w in weights.items():
            if not sc or sc.startswith("("):
                continue
            units = base.units(sc)
            if not units[0][1]:
                first[units[0][0]] = first.get(units[0][0], 0.0) + float(w)
                if len(units) > 1:
                    deeper.add(units[0][0])
        total = sum(first.values())
        best = max(sorted(first), key=lambda u: first[u], default=None)
        if best is None or best not in deeper or first[best] < WRAPPER_SHARE * total or not best[:1].isupper():
            return base
        return cls(base.repeats, (best,))

    def units(self, scope: str, expand: bool = False) -> list[tuple[str, bool]]:
        """(unit, is a repeated block) of a scope, the wrapper included."""
        segs = scope.split("/")
        out: list[tuple[str, bool]] = []
        for i, seg in enumerate(segs):
            collapsed = self.repeats.get("/".join(segs[: i + 1]))
            if collapsed is None:
                out.append((seg, False))
            elif collapsed.endswith("/*") and out:  # ``h/3``: the container and the index are one unit
                out[-1] = (out[-1][0] + "/" + (seg if expand else "*"), True)
            else:
                out.append((seg if expand else collapsed.rsplit("/", 1)[-1], True))
        return out

    def layer(self, scope: str, depth: int, expand: bool = False) -> str:
        """The layer of a scope at ``depth`` (see the class docstring)."""
        if not scope or scope.startswith("(") or depth <= 0:
            return scope
        units = self.units(scope, expand)
        w = len(self.wrapper) if tuple(u for u, _ in units[: len(self.wrapper)]) == self.wrapper else 0
        if len(units) <= w:
            return "/".join(u for u, _ in units)
        rest = units[w:]
        first_repeat = next((i for i, (_, rep) in enumerate(rest) if rep), None)
        n = depth + (first_repeat or 0)
        return "/".join(u for u, _ in rest[:n])

    def instance(self, scope: str, depth: int) -> str:
        """The expanded layer (``transformer/h/3/attn``) when the scope lies in a collapsed block, else ''."""
        expanded = self.layer(scope, depth, expand=True)
        return expanded if expanded != self.layer(scope, depth) else ""


PHASE_ORDER = {"forward": 0, "remat": 1, "backward": 2, "optimizer": 3, OTHER_PHASE: 4}


def rollup(ops: pd.DataFrame, per_step_divisor: float, step_time_s: float, stats: pd.DataFrame | None = None
           ) -> pd.DataFrame:
    """Per (layer, phase) rollup of the op table's counted rows in marked steps; totals are divided by
    ``per_step_divisor`` (steps used x devices) to give per-step, per-device figures.

    Columns: ``layer``, ``phase``, ``ops`` (distinct HLO ops), ``time_per_step_s``, ``share_of_step`` (of the
    mean step time), ``flops_per_step``, ``hbm_bytes_per_step``, ``expected_per_step_s``, ``efficiency``
    (expected ÷ measured over ops with an expectation), ``bound`` (the bound holding most expected time),
    ``lost_per_step_s``, ``exposed_comm_per_step_s`` (collective time no other op covered), ``worst_op`` (see
    :func:`worst_op`; ``stats``: :func:`traceroof.opstats.execution_stats` of the rows, for the medians of
    single executions), and for a collapsed repeated block (``h/*``; op-table column ``instance``) ``instances``
    with the ``instance_min_s`` / ``instance_median_s`` / ``instance_max_s`` time per step across them (NaN and
    1 instance elsewhere). Sorted by time, largest first.
    """
    cols = ["layer", "phase", "ops", "time_per_step_s", "share_of_step", "flops_per_step", "hbm_bytes_per_step",
            "expected_per_step_s", "efficiency", "bound", "lost_per_step_s", "exposed_comm_per_step_s", "worst_op",
            "instances", "instance_min_s", "instance_median_s", "instance_max_s"]
    layer, phase = as_text(ops["layer"]), as_text(ops["phase"])
    used = ops["counted"].to_numpy(bool) & ops["step"].notna().to_numpy() & pd.notna(layer) & pd.notna(phase)
    if not used.any() or per_step_divisor <= 0:
        return pd.DataFrame(columns=cols)
    d, layer, phase = (ops, layer, phase) if used.all() else (ops[used], layer[used], phase[used])
    k = 1.0 / per_step_divisor
    group = group_codes([layer, phase])  # (layer, phase) in order of first appearance
    first = first_rows(group)
    n = len(first)
    measured = d["measured_s"].to_numpy(np.float64)
    expected = d["expected_s"].to_numpy(np.float64)
    has_exp = ~np.isnan(expected)
    exp = group_sum(group, np.where(has_exp, expected, 0.0), n) * k
    meas_exp = group_sum(group, np.where(has_exp, measured, 0.0), n) * k
    exposed = group_sum(group, np.nan_to_num(d["comm_exposed_s"].to_numpy(np.float64)), n) * k \
        if "comm_exposed_s" in d else np.zeros(n)
    op_codes = pd.factorize(d["hlo_op"])[0]  # -1: no op name, not counted
    named = np.flatnonzero(op_codes >= 0)
    distinct = first_rows(group_codes([group[named], op_codes[named]]))
    opaque = np.bincount(group, weights=d["opaque"].to_numpy(bool), minlength=n) > 0
    bound = np.where(opaque, "opaque", "unknown").astype(object)  # where no row has an expectation
    if has_exp.any():
        bound = _bounds(d, group, has_exp, expected, bound)
    time = group_sum(group, measured, n) * k
    with np.errstate(divide="ignore", invalid="ignore"):
        efficiency = np.where(meas_exp > 0, exp / meas_exp, np.nan)
    out = {
        "layer": layer[first], "phase": phase[first],
        "ops": np.bincount(group[named][distinct], minlength=n).astype(np.int64), "time_per_step_s": time,
        "share_of_step": time / step_time_s if step_time_s > 0 else np.full(n, np.nan),
        "flops_per_step": group_sum(group, d["flops"].to_numpy(np.float64), n) * k,
        "hbm_bytes_per_step": group_sum(group, d["hbm_bytes"].to_numpy(np.float64), n) * k,
        "expected_per_step_s": exp, "efficiency": efficiency, "bound": bound,
        "lost_per_step_s": group_sum(group, np.nan_to_num(d["lost_s"].to_numpy(np.float64)), n) * k,
        "exposed_comm_per_step_s": exposed, "worst_op": _worst_ops(d, group, n, k, stats),
        **_instance_spreads(d, group, n, k)}
    phase_rank = [PHASE_ORDER.get(p, 9) for p in phase[first]]
    layer_rank = np.unique(layer[first], return_inverse=True)[1]
    order = np.lexsort((phase_rank, layer_rank, -time))  # time, largest first; ties keep their order
    return pd.DataFrame({c: out[c][order] for c in cols})


def _bounds(d: pd.DataFrame, group: np.ndarray, has_exp: np.ndarray, expected: np.ndarray, default: np.ndarray
            ) -> np.ndarray:
    """Per group of the rows ``d``: the bound holding most expected time (ties: the first in the bound column's
    order); ``default`` for groups whose rows have no expectation."""
    bounds = pd.Categorical(d["bound"].array[has_exp])
    g, b = group[has_exp], bounds.codes.astype(np.int64)
    pair = group_codes([g, b])
    first = first_rows(pair)
    x = np.bincount(pair, weights=expected[has_exp])
    order = np.lexsort((b[first], -x, g[first]))  # per group: most time first, then the first bound
    best = order[np.flatnonzero(np.diff(g[first][order], prepend=-1))]
    out = default.copy()
    out[g[first][best]] = np.asarray(bounds.categories)[b[first][best]]
    return out


def _worst_ops(d: pd.DataFrame, group: np.ndarray, n: int, k: float, stats: pd.DataFrame | None) -> np.ndarray:
    """Per group id (0..n-1) of the rows ``d``: the op losing most time per step judged on its MEDIAN execution:
    (median measured per execution − expected per execution) x executions per step (``k`` = 1 / per-step
    divisor), so one slow outlier run does not make an op the worst; '' for a group without candidates. The median
    of single executions comes from ``stats`` (index module, program id (-1 for none), HLO op; column
    ``midpoint_median_s``) where given, else the median of the rows' means. Ops without an expectation (or a
    name) are not candidates; ties go to the first op name in order."""
    out = np.full(n, "", dtype=object)
    op_col = d["hlo_op"]
    named = op_col.array.codes >= 0 if isinstance(op_col.dtype, pd.CategoricalDtype) else op_col.notna().to_numpy()
    e = np.flatnonzero(~np.isnan(d["expected_s"].to_numpy(np.float64)) & named)
    if not len(e):
        return out
    execs = d["executions"].to_numpy(np.float64)[e] if "executions" in d else np.ones(len(e))
    execs = np.where(execs > 0, execs, 1.0)
    m = d["measured_s"].to_numpy(np.float64)[e] / execs
    op = as_text(op_col)[e]
    if stats is not None and len(stats):
        pid = d["program_id"].to_numpy(dtype="int64", na_value=-1)[e]
        at = positions(stats.index, zip(as_text(d["module"])[e], pid, op))
        median = np.where(at >= 0, stats["midpoint_median_s"].to_numpy(np.float64)[at], np.nan)
        m = np.where(np.isnan(median), m, median)
    names, op_rank = np.unique(op, return_inverse=True)  # sorted names: ties go to the first
    per = group_codes([group[e], op_rank])  # one candidate per (group, op)
    first = first_rows(per)
    lost = (group_median(per, m, len(first)) - group_median(per, d["expected_s"].to_numpy(np.float64)[e] / execs,
                                                                 len(first))) * np.bincount(per, weights=execs) * k
    g = group[e][first]
    order = np.lexsort((op_rank[first], -lost, g))  # per group: most lost first (NaN last), then the first name
    best = order[np.flatnonzero(np.diff(g[order], prepend=-1))]
    out[g[best]] = names[op_rank[first][best]]
    return out


def worst_op(g: pd.DataFrame, k: float, stats: pd.DataFrame | None = None) -> str:
    """:func:`_worst_ops` of rows that are one layer and phase: the op name, '' when none has an expectation."""
    return str(_worst_ops(g, np.zeros(len(g), np.int64), 1, k, stats)[0])


def _instance_spreads(d: pd.DataFrame, group: np.ndarray, n: int, k: float) -> dict[str, np.ndarray]:
    """Per group id (0..n-1) of the rows ``d``: ``instances`` (repeated-block instances among the rows; column
    ``instance``; 1 without) and the ``instance_min_s`` / ``instance_median_s`` / ``instance_max_s`` of their time
    per step (NaN without)."""
    none = np.full(n, np.nan)
    inst = as_text(d["instance"]) if "instance" in d else np.zeros(0, object)
    on = np.flatnonzero((inst != "") & pd.notna(inst))
    if not len(on):
        return {"instances": np.ones(n, np.int64), "instance_min_s": none, "instance_median_s": none,
                "instance_max_s": none}
    per = group_codes([group[on], inst[on]])  # one per (group, instance)
    first = first_rows(per)
    s = group_sum(per, d["measured_s"].to_numpy(np.float64)[on], len(first)) * k
    g = group[on][first]
    lo, hi = np.full(n, np.inf), np.full(n, -np.inf)
    np.minimum.at(lo, g, s)
    np.maximum.at(hi, g, s)
    count = np.bincount(g, minlength=n)
    return {"instances": np.where(count > 0, count, 1).astype(np.int64),
            "instance_min_s": np.where(count > 0, lo, np.nan), "instance_median_s": group_median(g, s, n),
            "instance_max_s": np.where(count > 0, hi, np.nan)}
