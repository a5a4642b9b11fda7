"""The book on your mesh: for the profiled step, every mesh axis with its strategy (:mod:`traceroof.parallelism`),
the book's per-layer arithmetic on the target chip and topology (:mod:`traceroof.book_math`), the measured
communication beside it, what-if meshes for the same chips, and a finding per communication-bound axis.

Model sizes come from the program: D and F from the weight matrices (the most common pair of their last two
global dimensions by elements, among the pairs of two matrices or more when there are such, D the smaller), L =
weight matrices of that pair / 2 (W_in, W_out), the tokens of the global and per-device batch from the non-state
entry parameters (token ids: all dims; rows ``[..., K]`` of a width K some weight matrix has: all but the last),
global shapes from each parameter's ``sharding``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from parsers.errors import TraceroofError
from parsers.hlo import HloModule
from parsers.hlo_text import parse_hlo_file
from traceroof.book_math import (Link, axis_link, critical_batch_data, expert_parallel_limit, fsdp_tp_critical_batch,
                                 layer_times, optimal_fsdp, tensor_parallel_limit, training_memory)
from traceroof.chips import Chip
from traceroof.collectives import Topology, default_topology, expected_time
from traceroof.cost import trip_count
from traceroof.mesh import Mesh, axis_group, mesh_size, recover_mesh
from traceroof.parallelism import (GRADIENT_KINDS, AxisStrategy, StateParam, classify_axes, collect_evidence,
                                   sharding_tiles, squeeze, state_params)
from traceroof.scopes import while_body

BATCH_STRATEGIES = ("data", "fsdp", "sequence", "expert")  # axes that split the batch (In[B_X, ...])
WEIGHT_STRATEGIES = ("fsdp", "tensor", "pipeline", "expert")  # axes that split the weights
MAX_TENSOR_WAYS = 64  # what-if meshes try tensor parallelism up to this many ways


@dataclass(frozen=True)
class ModelSizes:
    """What the program says of the model: ``d_model`` (D), ``d_ff`` (F), ``layers`` (L), ``tokens`` of the
    global batch (B) and per device, the matmul ``dtype`` and its bytes, the weights' global elements (P) and the
    local bytes of weights and optimizer state."""

    d_model: int
    d_ff: int
    layers: float  # 1.5 for 3 matrices of the pair
    tokens: float
    tokens_per_device: float
    dtype: str
    bytes_per_element: int
    weight_elements: int
    weight_bytes_local: int
    optimizer_bytes_local: int


def model_sizes(module: HloModule, params: list[StateParam], experts: bool = False) -> ModelSizes | None:
    """The model sizes (module docstring), or ``None`` without a weight matrix. A weight's leading dimensions are
    stacked layers (a scan's ``[L, D, F]``); with ``experts`` the innermost of them is the experts (``[E, D, F]``
    one layer, a scan of MoE layers' ``[L, E, D, F]`` L layers)."""
    weights = [p for p in params if p.weight and len(squeeze(p.global_dims)) >= 2]
    if not weights:
        return None
    elements: Counter = Counter()
    count: Counter = Counter()
    for p in weights:
        g = squeeze(p.global_dims)
        pair = (min(g[-2:]), max(g[-2:]))
        elements[pair] += math.prod(g)
        count[pair] += math.prod(g[:-3 if experts else -2])
    # a pair of one matrix (an input projection or embedding, an output head) is a layer's only where no pair
    # repeats: the s43 trial's MLP 784-256-256-256-256-8 read "D = 256, F = 784, L = 1" from its first layer alone
    repeated = [pair for pair, n in count.items() if n >= 2] or list(count)
    d, f = max(repeated, key=elements.__getitem__)  # ties: the first pair seen (max keeps the first)
    matrices = count[(d, f)]
    widths = {x for p in weights for x in squeeze(p.global_dims)[-2:]}
    state = {p.number for p in params}
    tokens, local = math.nan, math.nan
    for number, p in module.entry.parameters().items():
        if number in state or p.shape.is_tuple or not p.shape.dims:
            continue
        tiles = sharding_tiles(p.attrs.get("sharding", ""), len(p.shape.dims))
        g = tuple(x * t for x, t in zip(p.shape.dims, tiles))
        if p.shape.element_type.startswith("u") and len(g) == 1 and g[0] <= 4:
            continue  # a PRNG key (u32[2], u32[4]), not tokens
        if p.shape.element_type.startswith(("s", "u")):
            t, t_local = math.prod(g), math.prod(p.shape.dims)
        elif g[-1] in widths and len(g) >= 2:
            t, t_local = math.prod(g[:-1]), math.prod(p.shape.dims[:-1])
        else:
            continue
        if not t <= tokens:  # NaN or larger
            tokens, local = float(t), float(t_local)
    dtype = Counter({p.dtype: p.bytes_local for p in weights}).most_common(1)[0][0]
    from parsers.hlo import ELEMENT_BITS

    return ModelSizes(d, f, max(matrices / 2, 1), tokens, local, dtype, max(ELEMENT_BITS.get(dtype, 16) // 8, 1),
                      sum(math.prod(p.global_dims) for p in weights), sum(p.bytes_local for p in weights),
                      sum(p.bytes_local for p in params if not p.weight))


@dataclass(frozen=True)
class AxisRow:
    """One mesh axis: strategy and evidence; ``batch_per_device`` (tokens, B/X); the book's
    ``critical_batch_per_device`` (data/FSDP/sequence axes) or ``max_ways`` (tensor/expert limit); per layer,
    in ``book_pass`` (``backward`` for data and sequence axes, ``forward`` for the others: the pass where §5
    compares them, :func:`~traceroof.book_math.layer_times`), ``t_math_s`` and ``t_comm_s`` with ``bound``; the
    ``link`` (W's name) and ``link_axes`` (M); per step the ``expected_comm_s`` of the axis' own collectives on
    the chip and topology (:func:`expected_time`), the ``measured_comm_s`` and ``measured_exposed_s`` from the
    profile (a collective over several axes counts on each); ``formula`` the book's T_math vs T_comms.

    ``expected_comm_s`` is not L x ``t_comm_s``: it counts every pass and the program's own bytes, and prices each
    collective with a ring's (N−1)/N on a line without wraparound and a per-hop latency floor, where the book
    drops (N−1)/N. A data axis of N ways on a line whose gradients are the only traffic: expected = L x
    ``t_comm_s`` x (N−1)/N (4 ways: 3/4 of L x ``t_comm_s``)."""

    axis: str
    size: int
    strategy: str
    evidence: str
    batch_per_device: float
    critical_batch_per_device: float
    max_ways: float
    t_math_s: float
    t_comm_s: float
    bound: str
    link: str
    link_axes: int
    expected_comm_s: float
    measured_comm_s: float
    measured_exposed_s: float
    formula: str
    book_pass: str = ""


@dataclass(frozen=True)
class WhatIf:
    """A mesh of the same chips: ``data`` x ``fsdp`` x ``tensor`` ways, the projected ``step_s`` (L layers of
    max(T_math, T_comms), fwd + bwd), its parts per step, ``memory_bytes`` per device, ``fits`` in HBM,
    ``current`` (the profiled split), ``best`` and ``reason``."""

    name: str
    data: int
    fsdp: int
    tensor: int
    step_s: float
    t_math_s: float
    t_comm_s: float
    bound: str
    memory_bytes: float
    fits: bool
    current: bool = False
    best: bool = False
    reason: str = ""


@dataclass(frozen=True)
class ParallelismReport:
    """The section: ``module`` analysed, ``mesh`` (``axis0=4 x axis1=2``), ``chip`` and ``topology`` used,
    ``sizes``, per-axis ``rows``, ``what_if`` meshes, ``notes`` (mesh-level figures, limits), ``findings`` and
    ``gradient_ops``: the module's collectives its evidence reads as weight-gradient reductions (for the
    ``gradients-in-loop`` finding)."""

    module: str
    mesh: str
    chip: str
    topology: str
    sizes: ModelSizes | None
    rows: tuple[AxisRow, ...]
    what_if: tuple[WhatIf, ...] = ()
    notes: tuple[str, ...] = ()
    findings: tuple[tuple[str, str, str], ...] = field(default_factory=tuple)  # (axis, seen, remedy) per bound axis
    gradient_ops: frozenset[str] = frozenset()  # the module's collectives read as weight-gradient reductions


def _pick_module(modules: list[HloModule], coll_table: pd.DataFrame) -> tuple[HloModule, Mesh] | None:
    """The module whose collectives took most measured time (else the one with most collectives) and its mesh."""
    best = None
    for m in modules:
        mesh = recover_mesh(m)
        if not mesh.axes:
            continue
        t = 0.0
        if len(coll_table) and "module" in coll_table:
            t = float(coll_table.loc[coll_table["module"].astype(str) == m.name, "time_per_step_s"].sum())
        key = (t, len(mesh.collectives))
        if best is None or key > best[0]:
            best = (key, m, mesh)
    return (best[1], best[2]) if best else None


def _with_dump(module: HloModule, mesh: Mesh, dumps: frozenset[str] | set[str]) -> tuple[HloModule, Mesh]:
    """The module's own after-optimization dump when the profile's HloProto superseded it: the text keeps the
    header (``num_partitions``) and the parameters' ``sharding`` that the proto lacks."""
    if module.attrs.get("num_partitions"):
        return module, mesh
    tag = f"module_{module.program_id:04d}.{module.name}." if module.program_id is not None else f".{module.name}."
    for path in sorted(dumps):
        if tag in Path(path).name:
            try:
                (dumped,) = [m for m in parse_hlo_file(path) if m.name == module.name][:1]
            except (TraceroofError, ValueError):
                continue
            return dumped, recover_mesh(dumped)
    return module, mesh


def book_on_mesh(modules: list[HloModule], chip: Chip, topo: Topology, coll_table: pd.DataFrame | None = None,
                 dumps: frozenset[str] | set[str] = frozenset()) -> ParallelismReport | None:
    """The parallelism section of a profile (``None`` when no module has a collective over 2+ devices).
    ``dumps``: HLO text files the profile's own HLO superseded (``Profile.dump_sources``), read for the module
    analysed when its HLO came without sharding annotations."""
    coll_table = coll_table if coll_table is not None else pd.DataFrame()
    picked = _pick_module(modules, coll_table)
    if picked is None:
        return None
    module, mesh = _with_dump(*picked, dumps)
    params = state_params(module)
    evidence = collect_evidence(module, mesh, params)
    strategies = classify_axes(mesh, evidence)
    gradient_ops = frozenset(op for ev in evidence.values() for k in GRADIENT_KINDS for op in ev.ops.get(k, ()))
    sizes = model_sizes(module, params, any(s.strategy == "expert" for s in strategies))
    notes = [mesh.note] if mesh.note else []
    ops = Counter(i.opcode for c in module.computations.values() for i in c.instructions)
    if sizes and ops["convolution"] > ops["dot"]:  # the book's layer is In[B, D]·W_in[D, F]·W_out[F, D]
        notes.append(f"{ops['convolution']} convolutions to {ops['dot']} dots: the book's per-layer arithmetic "
                     "(T_math, T_comm, critical batch, other meshes) models MLP layers, and a convolution's work "
                     "also grows with its positions and taps, so it is left out; the strategies stand")
        sizes = None
    if topo.devices < mesh.devices:
        topo = default_topology(chip, mesh.devices)
    c_flops = chip.peak_for(sizes.dtype if sizes else "bf16")[0] or math.nan
    rows = [_row(s, mesh, module, sizes, strategies, chip, topo, c_flops, coll_table) for s in strategies]
    links = {s.axis: axis_link(chip, topo, axis_group(mesh, (s.axis,))) for s in strategies}
    if sizes:
        notes += _mesh_notes(sizes, strategies, links, c_flops, mesh.devices)
    notes += [n for s in strategies if s.strategy == "pipeline" for n in [_pipeline_bubble(module, mesh, s)] if n]
    shared = sorted({pc.name for pc in mesh.collectives if len(set(pc.axes) & {s.axis for s in strategies}) > 1})
    if shared and len(coll_table):
        notes.append(f"{len(shared)} collective(s) run over more than one axis ({', '.join(shared[:3])}"
                     f"{' ...' if len(shared) > 3 else ''}): each is in every one of its axes' rows (expected and "
                     "measured comm/step), so the rows add up to more than the step's communication")
    if not any(links.values()):
        notes.append(f"{chip.name} has no interconnect figures for this topology ({topo.describe()}): strategies "
                     "only; pass --chip (e.g. v5p, h100) and --topology for the book's communication arithmetic")
    what_if = what_if_meshes(sizes, chip, topo, mesh.devices, c_flops, strategies) if sizes else ()
    findings = tuple(_finding(r, sizes, chip) for r in rows
                     if r.bound == "communication" and sizes and r.strategy != "pipeline")
    return ParallelismReport(module.name, mesh.describe(), chip.name, topo.describe(), sizes, tuple(rows),
                             tuple(what_if), tuple(notes), findings, gradient_ops)


def _row(s: AxisStrategy, mesh: Mesh, module: HloModule, sizes: ModelSizes | None, strategies: list[AxisStrategy],
         chip: Chip, topo: Topology, c_flops: float, coll_table: pd.DataFrame) -> AxisRow:
    link = axis_link(chip, topo, axis_group(mesh, (s.axis,)))
    names = {pc.name for pc in mesh.collectives if s.axis in pc.axes}
    expected = sum((est.time_s if est else 0.0) * pc.executions for pc in mesh.collectives if s.axis in pc.axes
                   for est in [expected_time(pc.collective, chip, topo)]) if link else math.nan
    measured = exposed = math.nan
    if len(coll_table):
        mine = coll_table[(coll_table["module"].astype(str) == module.name) & coll_table["hlo_op"].isin(names)]
        if len(mine):
            measured = float(mine["time_per_step_s"].sum())
            exposed = float(mine["exposed_per_step_s"].sum(min_count=1))
    nan = math.nan
    if sizes is None:
        return AxisRow(s.axis, s.size, s.strategy, s.evidence, nan, nan, nan, nan, nan, "-", link.name if link else "",
                       link.axes if link else 0, expected, measured, exposed, "")
    tensor = mesh_size(mesh, [x.axis for x in strategies if x.strategy == "tensor"])
    fsdp = mesh_size(mesh, [x.axis for x in strategies if x.strategy == "fsdp"])
    b = sizes.bytes_per_element
    times = layer_times(s.strategy, sizes.tokens_per_device, sizes.d_model, sizes.d_ff, tensor, c_flops, link, b,
                        s.size if s.strategy == "expert" else fsdp)
    crit = critical_batch_data(c_flops, link, b) if link and s.strategy in ("data", "fsdp", "sequence") else nan
    ways = nan
    if link and s.strategy == "tensor":
        ways = tensor_parallel_limit(c_flops, link, sizes.d_ff, b)
    elif link and s.strategy == "expert":
        ways = expert_parallel_limit(c_flops, link, sizes.d_ff, b)
    bound = "-"  # without the tokens per device (so T_math) there is no verdict
    if times and math.isfinite(times.t_comm_s) and math.isfinite(times.t_math_s):
        bound = "communication" if times.t_comm_s > times.t_math_s else "compute"
    return AxisRow(s.axis, s.size, s.strategy, s.evidence, sizes.tokens_per_device, crit, ways,
                   times.t_math_s if times else nan, times.t_comm_s if times else nan, bound,
                   link.name if link else "", link.axes if link else 0, expected, measured, exposed,
                   times.formula if times else "", times.book_pass if times else "")


def _mesh_notes(sizes: ModelSizes, strategies: list[AxisStrategy], links: dict[str, Link | None], c_flops: float,
                devices: int) -> list[str]:
    tokens = (f"{sizes.tokens:,.0f} tokens per step ({sizes.tokens_per_device:,.0f} per device)"
              if math.isfinite(sizes.tokens) else
              "tokens per step unknown (no input of the step is token ids or rows of a weight matrix's width)")
    out = [f"model read from the HLO: D = {sizes.d_model}, F = {sizes.d_ff}, L = {sizes.layers:g} MLP layer(s), "
           f"{tokens}, {sizes.dtype} (How to Scale Your Model §5 models each layer as "
           "In[B, D]·W_in[D, F]·W_out[F, D])",
           "T_math/layer and T_comm/layer: one layer in the pass named in column 'pass', where §5 compares them "
           "(backward for data and sequence axes, where gradients are all-reduced: 8BDF; forward for the others: "
           "4BDF), each "
           "collective at the book's large-N cost; expected comm/step: the axis' own collectives, all layers and "
           "passes, on this topology with a ring's (N−1)/N on a line and a per-hop latency floor (a data axis of N "
           "ways on a line: L x T_comm/layer x (N−1)/N)"]
    fsdp = [s for s in strategies if s.strategy == "fsdp" and links.get(s.axis)]
    tensor = [s for s in strategies if s.strategy == "tensor" and links.get(s.axis)]
    if fsdp and tensor:
        lf, lt = links[fsdp[0].axis], links[tensor[0].axis]
        crit = fsdp_tp_critical_batch(c_flops, lf, lt, sizes.d_ff, sizes.bytes_per_element)
        head = f"FSDP + tensor parallelism at its best split needs B/N > 4α²/(M_X·M_Y·F) = {crit:,.0f} tokens per chip"
        book = "(How to Scale Your Model §5, mixed FSDP and tensor parallelism)"
        if math.isfinite(sizes.tokens):
            x_opt = optimal_fsdp(sizes.tokens, sizes.d_ff, devices, lf.axes, lt.axes)
            per_chip = sizes.tokens / devices
            verdict = "compute-bound" if per_chip > crit else "communication-bound"
            out.append(f"{head}; this step has {per_chip:,.0f}: {verdict}; the best FSDP ways X_opt = "
                       f"√(B/F·M_X/M_Y·N) = {x_opt:,.1f} of {devices} {book}")
        else:
            out.append(f"{head} {book}; this step's tokens are unknown, so neither the verdict nor the best FSDP ways")
    if any(s.strategy == "pipeline" for s in strategies):
        out.append("pipeline axes: the book counts their communication negligible (one hop of activations); "
                   "their cost is the bubble, (stages − 1)/(microbatches + stages − 1) of the step (§5 Pipelining)")
    return out


def _pipeline_bubble(module: HloModule, mesh: Mesh, axis: AxisStrategy) -> str:
    """The bubble of a pipeline axis whose transfers (collective-permutes) run in a ``while`` body: a loop of T
    iterations over S stages is, fill and drain (GPipe), M = T − S + 1 micro-batches, whose bubble is
    (S − 1)/(M + S − 1) of the loop (How to Scale Your Model §5, pipelining). '' when no such loop is found or it
    has fewer iterations than stages (another schedule)."""
    bodies = {pc.computation for pc in mesh.collectives
              if axis.axis in pc.axes and pc.collective.kind == "collective-permute"}
    trips = [trip_count(module, w)[0] for c in module.computations.values() for w in c.instructions
             if (body := while_body(module, w)) is not None and body.name in bodies]
    stages = axis.size
    if not trips or max(trips) < stages or stages < 2:
        return ""
    t = max(trips)
    return (f"pipeline axis {axis.axis} ({stages} stages): its transfers run in a loop of {t} iterations, fill and "
            f"drain of M = {t} − {stages} + 1 = {t - stages + 1} micro-batches, whose bubble is (S − 1)/(M + S − 1) = "
            f"{stages - 1}/{t} = {(stages - 1) / t:.0%} of the loop's time (How to Scale Your Model §5); where the "
            "stages compute through it (one jitted loop over every iteration), the executed FLOPs and so MFU count "
            "that work: pass --model-flops-per-step for the model's")


def _layout_links(chip: Chip, topo: Topology, data: int, fsdp: int, tensor: int) -> dict[str, Link | None]:
    """Links of a what-if mesh laid out tensor innermost (stride 1), FSDP next, data outermost."""
    out = {}
    for name, size, stride in (("tensor", tensor, 1), ("fsdp", fsdp, tensor), ("data", data, tensor * fsdp)):
        out[name] = axis_link(chip, topo, tuple(k * stride for k in range(size))) if size > 1 else None
    return out


def what_if_meshes(sizes: ModelSizes, chip: Chip, topo: Topology, devices: int, c_flops: float,
                   strategies: list[AxisStrategy]) -> list[WhatIf]:
    """Other splits of the same chips (dp, fsdp, tp, fsdp x tp with tensor ways 2, 4 ... 64) at the same global
    batch and model: per layer, fwd + bwd, the §5 takeaway table: T_math = 12·B·D·F/(N·C); communication bytes
    DP 8DF·b/2 per layer over W·M_X (after FSDP's share), FSDP 12DF·b/2 / Y, tensor 8·(B/X)·D·b/2 (the MP row);
    the axes' communication adds (§5 mixed: X and Y not overlapped), and the step is L·max(T_math, T_comms).
    Memory per device: :func:`training_memory` with the program's optimizer bytes per parameter. The best fits
    in HBM and has the least step time (then the least memory). Empty without link figures."""
    b, B, D, F, L, N = sizes.bytes_per_element, sizes.tokens, sizes.d_model, sizes.d_ff, sizes.layers, devices
    if not math.isfinite(B) or not math.isfinite(c_flops):
        return []
    topo = topo if topo.devices == N else default_topology(chip, N)
    shape = {s.strategy: s.size for s in strategies}
    current = (shape.get("data", 1), shape.get("fsdp", 1), shape.get("tensor", 1)) \
        if {s.strategy for s in strategies} <= {"data", "fsdp", "tensor"} else None
    splits = [(N, 1, 1), (1, N, 1)] + [(1, N // y, y) for y in _divisors(N) if 1 < y <= MAX_TENSOR_WAYS]
    if current and current not in splits:
        splits.append(current)
    opt_per_param = sizes.optimizer_bytes_local / max(sizes.weight_bytes_local / b, 1)
    hbm = float(chip.value("memory.hbm_bytes", 0) or 0) or math.inf
    out = []
    for data, fsdp, tensor in splits:
        links = _layout_links(chip, topo, data, fsdp, tensor)
        if any(links[k] is None for k, n in (("data", data), ("fsdp", fsdp), ("tensor", tensor)) if n > 1):
            return []
        x = data * fsdp
        t_math = 12 * B * D * F / (N * c_flops)
        comm = 0.0
        if data > 1:
            comm += 4 * b * D * F / (tensor * fsdp * _wm(links["data"]))
        if fsdp > 1:
            comm += 6 * b * D * F / (tensor * _wm(links["fsdp"]))
        if tensor > 1:
            comm += 4 * b * (B / x) * D / _wm(links["tensor"])
        mem = training_memory(sizes.weight_elements, B, D, L, fsdp * tensor, N, b, opt_per_param, 1, b).total_bytes
        name = " x ".join(f"{k}{n}" for k, n in (("dp", data), ("fsdp", fsdp), ("tp", tensor)) if n > 1) or "1"
        out.append(WhatIf(name, data, fsdp, tensor, L * max(t_math, comm), L * t_math, L * comm,
                          "communication" if comm > t_math else "compute", mem, mem <= hbm,
                          (data, fsdp, tensor) == current))
    fitting = [w for w in out if w.fits] or out
    best = min(fitting, key=lambda w: (round(w.step_s, 15), round(w.memory_bytes), w.t_comm_s))
    why = (f"compute-bound (T_comms = {best.t_comm_s / best.t_math_s:.0%} of T_math per layer)"
           if best.bound == "compute" else "least communication per layer of the splits tried")
    if any(not w.fits for w in out):
        why += "; fits in HBM"
    same = [w for w in fitting if w.step_s <= best.step_s * 1.0001 and w is not best]
    if same:
        why += f"; as fast as {', '.join(w.name for w in same[:3])} with the least memory, then communication"
    return [WhatIf(**{**w.__dict__, "best": w is best, "reason": why if w is best else ""}) for w in out]


def _wm(link: Link | None) -> float:
    return link.bandwidth_bytes_per_s * link.axes if link else math.nan


def _divisors(n: int) -> list[int]:
    if n <= 1 << 16:
        return [d for d in range(1, n + 1) if n % d == 0]
    return [1 << k for k in range(17) if n % (1 << k) == 0]


def _finding(r: AxisRow, sizes: ModelSizes, chip: Chip) -> tuple[str, str, str]:
    """(axis, what was seen, the book's remedy) for a communication-bound axis (the ``comm-bound-axis``
    finding of :mod:`traceroof.findings`)."""
    head = (f"mesh axis {r.axis} ({r.strategy}, {r.size}-way) is communication-bound on {chip.name} by the book's "
            f"arithmetic: T_comms {r.t_comm_s * 1e6:.3g} µs > T_math {r.t_math_s * 1e6:.3g} µs per layer "
            f"({r.book_pass} pass)")
    if r.strategy in ("data", "fsdp", "sequence"):
        return (r.axis, f"{head}; {r.batch_per_device:,.0f} tokens per device are below the critical "
                f"{r.critical_batch_per_device:,.0f} (C/W over {r.link_axes} {r.link} axis(es), How to Scale Your "
                "Model §5)", f"raise the per-device batch, use fewer {r.strategy} ways and add tensor parallelism "
                "(FSDP + TP needs only B/N > 4α²/(M_X·M_Y·F)), or spread the axis over more ICI axes")
    if r.strategy == "tensor":
        return (r.axis, f"{head}; {r.size}-way tensor parallelism exceeds M·F/α = {r.max_ways:.3g} ways for F = "
                f"{sizes.d_ff} (§5 Tensor Parallelism)", "use fewer tensor ways and more FSDP, keep the tensor axis "
                "inside a node / on more ICI axes, or it pays off only with a larger d_ff")
    if r.strategy == "expert":
        return (r.axis, f"{head}; {r.size}-way expert parallelism exceeds ≈ 4·M·F/α = {r.max_ways:.3g} ways "
                "(derived from §3's all-to-all cost)", "fewer expert ways per all-to-all, or overlap dispatch with "
                "expert compute")
    return r.axis, head, "overlap the transfers with compute or move the axis to a faster link"
