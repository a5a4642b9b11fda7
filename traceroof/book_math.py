"""The book's arithmetic on a program's own numbers: per-layer compute and communication time of each mesh axis,
the critical per-device batch below which an axis is communication-bound, the tensor-parallel limit, memory per
device, and what-if meshes.

Source: How to Scale Your Model (Austin et al., 2025), "How to Parallelize a Transformer for Training" (the
``training`` section, cited below as §5 with its subsection name) and "Training LLaMA 3 on TPUs" (§6); the GPU
figures of §12.4; ``docs/reference/hardware-and-rooflines.md`` §4.2 (its tables of the same formulas). The model
is the book's stack of MLP blocks ``In[B, D] · W_in[D, F] · W_out[F, D]`` with B the tokens of the global batch;
C is the chip's peak FLOP/s for the program's matmul dtype, b that dtype's bytes, W the bidirectional ICI
bandwidth of one torus axis (2 x the one-way link figure; one-way on an axis without wraparound), M the number of
physical axes a mesh axis spans. α = b·C/(2W) is the book's C/W_ici (2550 on v5p in bf16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from traceroof.chips import Chip
from traceroof.collectives import Topology

DCN_AXIS = 0  # Topology.coords: the slice index comes first


@dataclass(frozen=True)
class Link:
    """What carries one mesh axis: ``bandwidth_bytes_per_s`` (W, per the module docstring), ``axes`` (M) and a
    ``name`` (``ICI``, ``ICI (no wraparound)``, ``DCN``, ``NVLink``, ``InfiniBand``)."""

    bandwidth_bytes_per_s: float
    axes: int
    name: str


def axis_link(chip: Chip, topo: Topology, group: tuple[int, ...]) -> Link | None:
    """The link of a mesh axis whose devices are ``group`` (ids in slice order); ``None`` without link figures
    (a CPU host) or when the group holds devices the topology lacks.

    TPU: W = 2·one-way link (§5 "Data Parallelism": ``W=2 * 9e10`` on v5p), M = ICI axes spanned; one-way only
    when a spanned axis has no wraparound (§3: a line costs twice a ring); across slices the DCN figure per chip
    (§5 "Scaling Between Pods"). GPU: NVLink egress inside a node, the node's InfiniBand egress (per GPU x GPUs per
    node) across nodes (§12.4.1: 990e12 / 450e9 ≈ 2200, / 400e9 ≈ 2475).
    """
    if len(group) < 2 or max(group) >= topo.devices:
        return None
    coords = [topo.coords(d) for d in group]
    spanned = [i for i in range(len(coords[0])) if len({c[i] for c in coords}) > 1]
    if topo.kind == "tpu":
        if DCN_AXIS in spanned:
            w = float(chip.value("interconnect.dcn_bandwidth_bytes_per_s", 0) or 0)
            return Link(w, 1, "DCN") if w else None
        w_uni = float(chip.value("interconnect.ici_link_bandwidth_bytes_per_s", 0) or 0)
        if not w_uni:
            return None
        wrap = all(topo.wraparound[i - 1] for i in spanned)
        return Link(w_uni * (2 if wrap else 1), max(len(spanned), 1), "ICI" if wrap else "ICI (no wraparound)")
    if topo.kind == "gpu":
        if 0 in spanned:  # coords (node, local index): spans nodes
            per_node = topo.shape[0]
            w = float(chip.value("interconnect.infiniband_bandwidth_bytes_per_s", 0) or 0) * per_node
            return Link(w, 1, "InfiniBand") if w else None
        w = float(chip.value("interconnect.nvlink_bandwidth_bytes_per_s", 0) or 0)
        return Link(w, 1, "NVLink") if w else None
    return None


def alpha(chip_flops_per_s: float, link: Link, bytes_per_element: int = 2) -> float:
    """The network's arithmetic intensity α = b·C/(2·W) in tokens: C/W_ici for bf16 (§5 "Data Parallelism":
    ``C / W_ici = 4.59e14 / 1.8e11 = 2550`` on v5p)."""
    return bytes_per_element * chip_flops_per_s / (2 * link.bandwidth_bytes_per_s)


def critical_batch_data(chip_flops_per_s: float, link: Link, bytes_per_element: int = 2) -> float:
    """Tokens per device below which data parallelism or FSDP is communication-bound: B/X > α/M (§5 "Fully-
    Sharded Data Parallelism": "both FSDP and pure data parallelism become bandwidth bound ... when the batch
    size per device is less than 2550/n_axes"; over DCN the same with W_dcn, §5 "Scaling Between Pods")."""
    return alpha(chip_flops_per_s, link, bytes_per_element) / link.axes


def tensor_parallel_limit(chip_flops_per_s: float, link: Link, d_ff: int, bytes_per_element: int = 2) -> float:
    """Ways of tensor parallelism beyond which it is communication-bound: Y < M·F/α (§5 "Tensor Parallelism":
    "model parallelism becomes communication bound when Y > n_axes · F / 2550"; independent of the batch)."""
    return link.axes * d_ff / alpha(chip_flops_per_s, link, bytes_per_element)


def expert_parallel_limit(chip_flops_per_s: float, link: Link, d_ff: int, bytes_per_element: int = 2) -> float:
    """Ways of expert parallelism (top-1) beyond which the two all-to-alls outlast the expert matmuls: Z <
    4·M·F/α (4·F·W/C in bf16 on one axis). Not in the book (§5 leaves MoE out): derived in
    ``hardware-and-rooflines.md`` §4.2 from §3's all-to-all cost (V/(4W) on a bidirectional ring) and §12.4.3's
    FLOPs; a traceroof derivation, not the book's figure."""
    return 4 * link.axes * d_ff / alpha(chip_flops_per_s, link, bytes_per_element)


def fsdp_tp_critical_batch(chip_flops_per_s: float, fsdp: Link, tensor: Link, d_ff: int,
                           bytes_per_element: int = 2) -> float:
    """Tokens per chip (B/N) below which mixed FSDP + tensor parallelism at its best split is communication-
    bound: B/N > 4α²/(M_X·M_Y·F) (§5 "Mixed FSDP and Tensor Parallelism"; with M_X·M_Y = 2, 2·2550²/F: 453
    for LLaMA 3-70B's F = 28,672, §6 "How to shard LLaMA 3-70B for training"). α from the FSDP axis' link."""
    a = alpha(chip_flops_per_s, fsdp, bytes_per_element)
    return 4 * a * a / (fsdp.axes * tensor.axes * d_ff)


def optimal_fsdp(tokens: float, d_ff: int, chips: int, m_fsdp: int, m_tensor: int) -> float:
    """The FSDP ways that minimise communication with tensor parallelism on the rest: X_opt = √(B/F · M_X/M_Y
    · N) (§5 "Mixed FSDP and Tensor Parallelism"; LLaMA 3-70B, 4M tokens, 8960 chips: ≈1618, §6)."""
    return math.sqrt(tokens / d_ff * m_fsdp / m_tensor * chips)


@dataclass(frozen=True)
class LayerTimes:
    """Per layer, per device, in one pass: ``t_math_s`` and ``t_comm_s`` on the axis' link, for ``book_pass``
    (``backward`` or ``forward``: the pass where the book's §5 compares them, the one the axis' collectives are
    priced in); ``formula`` the book's T_math vs T_comms."""

    t_math_s: float
    t_comm_s: float
    formula: str
    book_pass: str = ""


def layer_times(strategy: str, tokens_per_device: float, d_model: int, d_ff: int, tensor_ways: int,
                chip_flops_per_s: float, link: Link | None, bytes_per_element: int = 2,
                fsdp_ways: int = 1) -> LayerTimes | None:
    """The book's T_math and T_comms of one MLP layer for an axis of ``strategy`` (§5), per device, with
    ``tokens_per_device`` = B/X and the weights already split ``tensor_ways`` (Y) by tensor parallelism, in the
    pass the book uses for each (``book_pass``): the backward pass for data parallelism (the gradient all-reduce
    happens there; 2 matmuls x 2 x 2BDF = 8BDF), the forward pass for the others (4BDF); so two axes of one
    layer can show T_math 2x apart. A collective is priced as the book does, at its large-N cost (an all-reduce of
    V bytes = 2V/(W·M)), without the (N−1)/N of a ring of N (:func:`traceroof.collectives.expected_time` keeps it
    on a line without wraparound):

    * data (backward, §5 "Data Parallelism"): T_math = 8·(B/X)·D·F/(Y·C), T_comms = 2 all-reduces of b·D·F/(Y·X_f)
      bytes = 4·b·D·F/(Y·X_f·W·M) (X_f: FSDP ways that already scattered them);
    * fsdp (forward, §5 FSDP, mixed): T_math = 4·(B/X)·D·F/(Y·C), T_comms = 2 all-gathers = 2·b·D·F/(Y·W·M);
    * tensor (forward, §5 Tensor / mixed): T_math = 4·(B/X)·D·F/(Y·C), T_comms = all-gather + reduce-scatter of
      b·(B/X)·D bytes = 2·b·(B/X)·D/(W·M);
    * sequence: as data (§5: "context parallelism ... another kind of data parallelism" for the MLP);
    * pipeline (§5 Pipelining): T_comms = one hop of the activations b·(B/X)·D over one link direction;
    * expert (top-1; hardware-and-rooflines.md §4.2): T_math = 4·(B/X)·D·F/C, T_comms = dispatch + combine
      all-to-alls of b·(B/X)·Z·D bytes each at V/(4W) = b·(B/X)·Z·D/(2·W·M) (Z = ``fsdp_ways`` here).

    ``None`` for ``unknown``; ``t_comm_s`` is NaN without a link model.
    """
    B, D, F, Y, C, b = tokens_per_device, d_model, d_ff, max(tensor_ways, 1), chip_flops_per_s, bytes_per_element
    wm = link.bandwidth_bytes_per_s * link.axes if link else math.nan
    if strategy in ("data", "sequence"):
        return LayerTimes(8 * B * D * F / (Y * C), 4 * b * D * F / (Y * max(fsdp_ways, 1) * wm),
                          "8BDF/(XYC) vs 4bDF/(Y·W·M)", "backward")
    if strategy == "fsdp":
        return LayerTimes(4 * B * D * F / (Y * C), 2 * b * D * F / (Y * wm), "4BDF/(XYC) vs 2bDF/(Y·W·M)", "forward")
    if strategy == "tensor":
        return LayerTimes(4 * B * D * F / (Y * C), 2 * b * B * D / wm, "4BDF/(XYC) vs 2b(B/X)D/(W·M)", "forward")
    if strategy == "pipeline":
        w_one = link.bandwidth_bytes_per_s / 2 if link and link.name == "ICI" else (
            link.bandwidth_bytes_per_s if link else math.nan)
        return LayerTimes(4 * B * D * F / (Y * C), b * B * D / w_one, "4BDF/(XYC) vs b(B/X)D/W_one-way", "forward")
    if strategy == "expert":
        Z = max(fsdp_ways, 1)
        return LayerTimes(4 * B * D * F / C, b * B * Z * D / (2 * wm), "4(B/X)DF/C vs b(B/X)ZD/(2W·M)", "forward")
    return None


@dataclass(frozen=True)
class Memory:
    """Bytes per device: ``params``, ``grads``, ``optimizer`` state and ``activations`` (checkpoints)."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float

    @property
    def total_bytes(self) -> float:
        """All four."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes


def training_memory(params: float, tokens: float, d_model: int, layers: float, weight_shards: int,
                    batch_shards: int, bytes_per_param: int = 2, optimizer_bytes_per_param: float = 8,
                    checkpoints_per_layer: float = 1, activation_bytes: int = 2) -> Memory:
    """Memory per device (§6 "Counting parameters and FLOPs": params b·P, optimizer state 8·P for Adam's fp32
    moments, gradient checkpoints 2·D·B·k·L in bf16 with k checkpoints per layer; §5 "Data Parallelism": pure
    DP holds all of it per chip, ≈ HBM/10 parameters). Weights, gradients and optimizer state are split
    ``weight_shards`` ways (FSDP x tensor x pipeline x expert; data parallelism replicates them), activations
    ``batch_shards`` ways (every axis that splits In[B_X, D_Y]). Gradients are counted like the weights (the book
    leaves them out of its totals: they live one layer at a time)."""
    w = params / max(weight_shards, 1)
    return Memory(w * bytes_per_param, w * bytes_per_param, w * optimizer_bytes_per_param,
                  activation_bytes * d_model * tokens * checkpoints_per_layer * layers / max(batch_shards, 1))
