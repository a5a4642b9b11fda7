"""Collectives: classification, replica groups on a physical topology, and expected time.

Classification and group modes follow ``docs/reference/hlo-text.md`` §9 (``GetCollectiveOpGroupMode`` in
openxla/xla ``xla/xla_data.proto``); the time formulas are ``docs/reference/hardware-and-rooflines.md`` §3
(How to Scale Your Model §3, §12): on a TPU torus axis with wraparound a bidirectional ring moves the full
array V in V / W_bidi (all-gather, reduce-scatter), twice that for all-reduce and a quarter for all-to-all, over
k axes V / (W_bidi·k); an axis without wraparound is a line: V·(N−1)/N / W_one-way; with a latency floor of
T_min = 1 µs per hop, N/2 hops per axis. On GPUs the ring costs V·(N−1)/(N·W) per level (NVLink inside a node,
the node's InfiniBand egress across nodes), all-reduce twice (no SHARP), all-to-all V·(N−1)/(N²·W).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from parsers.errors import InputError
from parsers.hlo import HloModule, Instruction, Shape
from parsers.hlo_text import parse_replica_groups
from traceroof.chips import Chip
from traceroof.cost import CostModel, collective_output_payload

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute",
         "collective-broadcast", "send", "recv")
TPU_HOP_LATENCY_S = 1e-6  # per ICI hop (How to Scale Your Model §3; hardware-and-rooflines.md §2.1)
GPU_LAUNCH_LATENCY_S = 5e-6  # kernel launch floor (Stratos, Compute-Bound Training §A.1.3 fn 10)
NCCL_BUS_FACTOR = {  # busbw = algbw x factor (NVIDIA/nccl-tests doc/PERFORMANCE.md; src/*.cu, *GetBw)
    "all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,  # sendrecv_perf: busbw = algbw
}


@dataclass(frozen=True)
class Collective:
    """One collective instruction.

    ``kind`` is the collective (``all-gather`` ...); ``form`` ``sync``, ``start`` or ``done`` (async pairs and
    ``async-start`` wrappers), ``fusion`` for a collective inside a fusion (TPU ``kCustom``), ``custom-call``
    for a recognised library call. ``bytes_in`` / ``bytes_out`` are the payload per device (async context
    scalars excluded); ``groups`` the expanded replica groups (device ids in ``mode``'s id space).
    """

    kind: str
    form: str
    element_type: str
    bytes_in: int
    bytes_out: int
    group_size: int
    num_groups: int
    mode: str
    groups: tuple[tuple[int, ...], ...]
    source_target_pairs: tuple[tuple[int, int], ...] = ()

    @property
    def full_bytes(self) -> int:
        """V: bytes of the whole (gathered / unsharded) array of one group (hardware-and-rooflines.md §6)."""
        if self.kind == "all-gather":
            return self.bytes_out
        if self.kind == "all-to-all":
            return self.bytes_in * self.group_size
        return self.bytes_in


def _is_context(leaf: Shape) -> bool:
    return leaf.element_type == "token" or (leaf.dims == () and leaf.element_type in ("u32", "s32"))


def _payload(shape: Shape) -> list[Shape]:
    """Array leaves of an async op's output, without its ``u32[]``/``s32[]`` context scalars and tokens."""
    return [s for s in shape.leaves() if not _is_context(s)]


def _base_kind(opcode: str) -> tuple[str, str]:
    for suffix, form in (("-start", "start"), ("-done", "done"), ("-update", "update")):
        if opcode.endswith(suffix):
            base = opcode[: -len(suffix)]
            return base, form
    return opcode, "sync"


def classify(model: CostModel, inst: Instruction, num_devices: int | None = None) -> Collective | None:
    """The collective an instruction performs, or ``None``.

    Recognises collective opcodes, their ``-start``/``-done`` forms, ``async-start`` wrappers (by the wrapped
    computation's root), fusions whose called computation holds a collective (recursively; by name when the
    body is missing: ``all-reduce-scatter``, ``all-gather`` ...), and send/recv.
    """
    base, form = _base_kind(inst.opcode)
    target = inst
    if inst.opcode in ("async-start", "async-update", "async-done"):
        wrapped = model.module.computations.get(inst.called[0]) if inst.called else None
        if wrapped is None or wrapped.root is None:
            return None
        target, base = wrapped.root, _base_kind(wrapped.root.opcode)[0]
        form = inst.opcode.split("-")[1]
    elif inst.opcode == "fusion":
        # TPU names collective fusions after what they do (an all-gather may be built from
        # dynamic-update-slice into zeros + all-reduce): the called computation's name wins over its ops
        inner = _find_collective(model, inst)
        name = next((c for c in inst.called if c.startswith(("all-reduce-scatter", "all-gather", "all-reduce",
                                                                "reduce-scatter", "all-to-all",
                                                                "collective-permute"))), None)
        if name is not None:
            base = "reduce-scatter" if name.startswith("all-reduce-scatter") else re.sub(r"\.\d+.*$", "", name)
            target = inner if inner is not None else inst
        elif inner is not None:
            target, base = inner, _base_kind(inner.opcode)[0]
        else:
            return None
        form = "fusion"
    if inst.opcode == "custom-call":
        target_name = inst.attrs.get("custom_call_target", "").strip('"')
        lib = _library_kind(target_name)
        if lib is None:
            return None
        ins = [model.operand_shape(inst, i) for i in range(len(inst.operands))]
        b_in = sum(leaf.byte_size() for s in ins if s is not None for leaf in _payload(s))
        b_out = sum(leaf.byte_size() for leaf in _payload(inst.shape))
        return Collective(lib, "custom-call", inst.shape.leaves()[0].element_type if inst.shape.leaves() else "",
                          b_in, b_out, 0, 0, f"library call {target_name}", ())
    if base not in KINDS:
        return None
    if form == "done":
        return Collective(base, "done", inst.shape.leaves()[0].element_type if inst.shape.leaves() else "", 0, 0,
                          0, 0, "", ())
    ins = [model.operand_shape(inst, i) for i in range(len(inst.operands))]
    # every operand array is payload (a variadic collective moves the sum of its arrays)
    in_leaves = [leaf for s in ins if s is not None for leaf in s.leaves() if leaf.element_type != "token"]
    if inst.opcode in ("async-start", "async-update", "async-done") and inst.shape.is_tuple \
            and len(inst.shape.tuple_shapes) > 1:
        # ((operands...), outputs, contexts...)
        out_leaves = _payload(inst.shape.tuple_shapes[1])
    elif form == "start":
        # all-gather-start (in, out), collective-permute-start (in, out, u32 contexts); all-reduce-start's shape
        # is its outputs (one array or a tuple of arrays)
        out_leaves = [leaf for leaf in collective_output_payload(inst) if not _is_context(leaf)]
    else:
        out_leaves = [leaf for leaf in inst.shape.leaves() if leaf.element_type != "token"]
    bytes_in = sum(s.byte_size() for s in in_leaves)
    bytes_out = sum(s.byte_size() for s in out_leaves)
    etype = (out_leaves or in_leaves)[0].element_type if (out_leaves or in_leaves) else ""
    attrs = target.attrs if target is not inst else inst.attrs
    if "replica_groups" not in attrs and "replica_groups" in inst.attrs:
        attrs = inst.attrs
    mode = group_mode(attrs, base)
    n_dev = num_devices or module_devices(model.module)
    try:
        groups = tuple(tuple(g) for g in parse_replica_groups(attrs.get("replica_groups", "{}"), n_dev))
    except Exception:  # noqa: BLE001 - an unparsable group is reported as unknown, never fatal
        groups = ()
    pairs = tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", attrs.get("source_target_pairs", "")))
    size = len(groups[0]) if groups else (2 if pairs else 0)
    if mode == "cross-replica-and-partition":
        size *= _count_attr(model.module, "num_partitions")
    return Collective(base, form, etype, bytes_in, bytes_out, size, len(groups), mode, groups, pairs)


LIBRARY_COLLECTIVES = (  # custom-call targets of communication libraries (hlo-text.md §9.5), by name
    (re.compile(r"all.?reduce", re.I), "all-reduce"), (re.compile(r"all.?gather", re.I), "all-gather"),
    (re.compile(r"reduce.?scatter", re.I), "reduce-scatter"), (re.compile(r"all.?to.?all", re.I), "all-to-all"),
    (re.compile(r"collective.?permute|send.?recv", re.I), "collective-permute"),
    (re.compile(r"TransferWithStaticRing|nccl|rccl|nvshmem|pfft", re.I), "library collective"),
)


def _library_kind(target: str) -> str | None:
    for pattern, kind in LIBRARY_COLLECTIVES:
        if pattern.search(target):
            return kind
    return None


def _count_attr(module: HloModule, key: str) -> int:
    """A device count of the module header (``num_partitions``, ``replica_count``): 1 when absent or not a
    positive integer (the HLO text parser refuses those)."""
    raw = str(module.attrs.get(key, "1")).strip()
    return max(int(raw), 1) if raw.isascii() and raw.isdigit() and len(raw) < 10 else 1


def module_devices(module: HloModule) -> int:
    """Devices a module runs on: ``num_partitions`` x ``replica_count`` of its header (1 when absent)."""
    return _count_attr(module, "num_partitions") * _count_attr(module, "replica_count")


def _find_collective(model: CostModel, inst: Instruction, depth: int = 0) -> Instruction | None:
    for name in inst.called:
        comp = model.module.computations.get(name)
        if comp is None or depth > 4:
            continue
        for i in comp.instructions:
            if _base_kind(i.opcode)[0] in KINDS:
                return i
            if i.opcode == "fusion":
                found = _find_collective(model, i, depth + 1)
                if found is not None:
                    return found
    return None


def group_mode(attrs: dict[str, str], kind: str) -> str:
    """``cross-replica``, ``cross-partition``, ``cross-replica-and-partition`` or ``global ids``
    (``GetCollectiveOpGroupMode``; hlo-text.md §9.2)."""
    channel = "channel_id" in attrs
    global_ids = attrs.get("use_global_device_ids", "false") == "true"
    if global_ids:
        return "global ids"
    if not channel:
        return "cross-replica"
    if kind in ("all-to-all", "collective-permute", "collective-broadcast", "ragged-all-to-all"):
        return "cross-partition"
    return "cross-replica-and-partition"


# -- topology -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Topology:
    """Where devices sit.

    ``kind``: ``tpu`` (``shape`` = slice dims, device ids in slice order with the first dim fastest;
    ``slices`` slices joined by DCN), ``gpu`` (``shape`` = (GPUs per node, nodes)), ``host`` (virtual CPU devices
    on ``hosts`` machines, one process each). ``wraparound`` per TPU axis.
    """

    kind: str
    shape: tuple[int, ...]
    wraparound: tuple[bool, ...] = ()
    slices: int = 1
    source: str = ""
    hosts: int = 1

    @property
    def devices(self) -> int:
        """Number of devices the topology holds."""
        return math.prod(self.shape) * self.slices

    def coords(self, device: int) -> tuple[int, ...]:
        """TPU: (slice, x, y[, z]); GPU: (node, local index); host: (0, device)."""
        if self.kind == "gpu":
            return device // self.shape[0], device % self.shape[0]
        if self.kind == "host":
            return 0, device
        per = math.prod(self.shape)
        out = [device // per]
        rest = device % per
        for d in self.shape:
            out.append(rest % d)
            rest //= d
        return tuple(out)

    def describe(self) -> str:
        """One line for reports: slice dims and wraparound, or nodes x GPUs."""
        if self.kind == "gpu":
            return f"{self.shape[1]} node(s) x {self.shape[0]} GPUs"
        if self.kind == "host":
            return f"{self.shape[0]} device(s) on " + (f"{self.hosts} hosts" if self.hosts > 1 else "one host")
        dims = "x".join(str(d) for d in self.shape)
        wrap = ",".join("wrap" if w else "line" for w in self.wraparound)
        return f"{self.slices} x " * (self.slices > 1) + f"{dims} slice ({wrap})"


def topology_for(text: str | None, chip: Chip, devices: int, hosts: int = 1) -> tuple[Topology, str]:
    """The topology collectives are placed on, and a note ('' when none): ``--topology`` (``text``) checked
    against the ``devices`` the program runs on, else :func:`default_topology` (on ``hosts`` CPU hosts). A
    topology larger than the program takes its devices as the program's first ones (a note says so); on a
    CPU-host target it is not used (a note says to pass ``--chip``).

    :raises InputError: a ``--topology`` that is malformed (:func:`parse_topology`) or holds fewer devices
        than the program runs on (its collectives would reach devices the topology lacks).
    """
    like = default_topology(chip, devices, hosts)
    if not text:
        return like, ""
    topo = parse_topology(text, chip)
    if topo.kind == "host":
        return like, (f"--topology {text} not used: the target {chip.name} is a CPU host; pass --chip (e.g. v5p, "
                      "h100) to place the collectives on a TPU slice or GPU nodes")
    dims = f"{like.shape[0]}x{like.shape[1]}" if like.kind == "gpu" else "x".join(str(d) for d in like.shape)
    if topo.devices < devices:
        raise InputError(f"--topology {text} holds {topo.devices:,} devices but the program runs on {devices:,}: "
                         f"pass a topology of {devices:,} devices (e.g. {dims})")
    if topo.devices > devices:
        return topo, (f"--topology {text} holds {topo.devices:,} devices, the program runs on {devices:,}: its "
                      f"devices are taken as the topology's first {devices:,} (a {dims} topology holds exactly "
                      "them)")
    return topo, ""


def _tpu_wraparound(chip: Chip, shape: tuple[int, ...]) -> tuple[bool, ...]:
    """2D-torus chips (v5e, v6e: 16 x 16 pods) wrap an axis only at size 16; 3D chips (v4, v5p, v7) built from
    4 x 4 x 4 cubes wrap every axis when all axes are multiples of 4 (hardware-and-rooflines.md §2.1)."""
    topo = str(chip.value("interconnect.ici_topology", "")).lower()
    if "3d" in topo:
        full = all(d % 4 == 0 for d in shape)
        return tuple(full and d > 2 for d in shape)
    return tuple(d == 16 for d in shape)


def default_topology(chip: Chip, devices: int, hosts: int = 1) -> Topology:
    """The topology a device count implies on a chip: TPU 2D chips a near-square slice, 3D chips a near-cube;
    GPUs fill nodes of ``interconnect.gpus_per_node``; CPU devices are on ``hosts`` machines (one by default)."""
    if chip.kind == "tpu":
        dims3 = "3d" in str(chip.value("interconnect.ici_topology", "")).lower()
        shape = _factor(devices, 3 if dims3 else 2)
        return Topology("tpu", shape, _tpu_wraparound(chip, shape), 1, "default for the device count")
    if chip.kind == "gpu":
        # 8 GPUs per node (one HGX/DGX board, hardware-and-rooflines.md §2.3) when the chip file has no figure
        per = int(chip.value("interconnect.gpus_per_node", 8) or 8)
        per = min(per, devices) if devices else per
        return Topology("gpu", (per, max(math.ceil(devices / per), 1)), (), 1, "nodes of gpus_per_node")
    hosts = max(hosts, 1)
    return Topology("host", (max(devices, 1),), (), 1, "one host" if hosts == 1 else f"{hosts} hosts", hosts)


def _factor(n: int, k: int) -> tuple[int, ...]:
    dims = [1] * k
    i = 0
    for p in _prime_factors(n)[::-1]:
        j = min(range(k), key=lambda a: dims[a])
        dims[j] *= p
        i += 1
    return tuple(sorted(dims))


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1 and p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return sorted(out)


MAX_TOPOLOGY_DEVICES = 2**20  # devices a --topology may hold (the largest pods hold ~10^4 chips)


def parse_topology(text: str, chip: Chip) -> Topology:
    """``--topology``: TPU ``4x4x4`` (or ``2x4x4x4`` for slices joined by DCN: slices first when there is one
    more dim than the chip's torus), GPU ``8x2`` (GPUs per node x nodes), host: any dims (their product).

    :raises InputError: not of that form: dims that are not positive integers, more dims than the chip's kind
        takes (GPU 2; TPU its torus rank + 1), or more than :data:`MAX_TOPOLOGY_DEVICES` devices.
    """
    usage = "expected positive dims like 4x4x4 (TPU slice), 2x4x4x4 (2 slices over DCN) or 8x2 (GPUs per node x nodes)"
    if not re.fullmatch(r"\s*[0-9]{1,9}(\s*x\s*[0-9]{1,9})*\s*", text or ""):
        raise InputError(f"--topology {text!r}: {usage}")
    dims = tuple(int(x) for x in re.findall(r"[0-9]+", text))
    if min(dims) < 1:
        raise InputError(f"--topology {text!r}: a dimension of 0 holds no device; {usage}")
    if math.prod(dims) > MAX_TOPOLOGY_DEVICES:
        raise InputError(f"--topology {text!r}: {math.prod(dims):,} devices, more than {MAX_TOPOLOGY_DEVICES:,}; "
                         f"{usage}")
    if chip.kind == "gpu":
        if len(dims) > 2:
            raise InputError(f"--topology {text!r}: a GPU topology is GPUs per node x nodes (like 8x2)")
        return Topology("gpu", (dims[0], dims[1] if len(dims) > 1 else 1), (), 1, "--topology")
    if chip.kind == "tpu":
        rank = 3 if "3d" in str(chip.value("interconnect.ici_topology", "")).lower() else 2
        if len(dims) > rank + 1:
            raise InputError(f"--topology {text!r}: {chip.name} slices have at most {rank} dims (plus one for the "
                             f"number of slices over DCN); {usage}")
        slices = dims[0] if len(dims) == rank + 1 else 1
        shape = dims[1:] if len(dims) == rank + 1 else dims
        return Topology("tpu", shape, _tpu_wraparound(chip, shape), slices, "--topology")
    return Topology("host", (math.prod(dims),), (), 1, "--topology")


# -- expected time ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CommEstimate:
    """Expected time of one collective on a topology: ``time_s`` = max(bandwidth term, latency floor);
    ``link`` names what carries it (``ICI``, ``DCN``, ``NVLink``, ``InfiniBand``, ``host memory``); ``axes`` the
    physical axes a group spans; ``link_peak_bytes_per_s`` the bandwidth the bus-bandwidth figure compares to."""

    time_s: float
    bandwidth_s: float
    latency_s: float
    link: str
    axes: str
    link_peak_bytes_per_s: float

    @property
    def latency_bound(self) -> bool:
        """True when the per-hop latency floor, not the bytes over the link, sets the time (How to Scale Your
        Model §3: latency-bound below ~W_one-way x T_min per hop, 45 kB on v5e)."""
        return self.latency_s > self.bandwidth_s

    @property
    def bound(self) -> str:
        """``latency`` or ``communication`` (bandwidth)."""
        return "latency" if self.latency_bound else "communication"


def _spanned(topo: Topology, group: tuple[int, ...]) -> list[tuple[int, int]]:
    """(axis, extent) of every coordinate axis along which the group's devices differ."""
    if not group:
        return []
    cs = [topo.coords(d) for d in group]
    out = []
    for axis in range(len(cs[0])):
        vals = {c[axis] for c in cs}
        if len(vals) > 1:
            out.append((axis, len(vals)))
    return out


def expected_time(c: Collective, chip: Chip, topo: Topology) -> CommEstimate | None:
    """Expected time of a collective, or ``None`` when it cannot be modelled (done halves, unknown groups,
    missing link figures). TPU: How to Scale Your Model §3 (Table 3.1, latency rule); GPU: §12.3."""
    if c.form == "done" or c.group_size <= 1 and not c.source_target_pairs:
        return None
    group = c.groups[0] if c.groups else tuple(p for pair in c.source_target_pairs[:1] for p in pair)
    spans = _spanned(topo, group)
    V = float(c.full_bytes)
    n = max(c.group_size, 2)
    if topo.kind == "tpu":
        w_uni = chip.value("interconnect.ici_link_bandwidth_bytes_per_s")
        if not w_uni:
            return None
        w_uni = float(w_uni)
        dcn = [s for s in spans if s[0] == 0]
        ici = [s for s in spans if s[0] != 0]
        if dcn:
            w_dcn = float(chip.value("interconnect.dcn_bandwidth_bytes_per_s", 0) or 0)
            if not w_dcn:
                return None
            per_slice = math.prod(topo.shape)
            m = dcn[0][1]
            bw = V * (m - 1) / m / (w_dcn * per_slice)  # §5.1.6: ring over slices, egress grows with slice size
            bw *= 2 if c.kind == "all-reduce" else 1
            return CommEstimate(bw, bw, 0.0, "DCN", f"{m} slices", w_dcn * per_slice)
        wrap = all(topo.wraparound[a - 1] for a, _ in ici) if ici else True
        k = max(len(ici), 1)
        if c.kind == "collective-permute":
            bw = c.bytes_in / w_uni
            lat = TPU_HOP_LATENCY_S
        else:
            if wrap:
                bw = V / (2 * w_uni * k)
            else:
                bw = V * (n - 1) / n / (w_uni * k)
            bw *= {"all-reduce": 2.0, "all-to-all": 0.25 if wrap else 0.5}.get(c.kind, 1.0)
            hops = sum(e / 2 if topo.wraparound[a - 1] else e - 1 for a, e in ici) or n / 2
            lat = TPU_HOP_LATENCY_S * hops * (2 if c.kind == "all-reduce" else 1)
        axes = ",".join(f"{'xyz'[a - 1]}{e}" for a, e in ici) or "-"
        peak = (2 if wrap else 1) * w_uni * k
        return CommEstimate(max(bw, lat), bw, lat, "ICI" + ("" if wrap else " (no wraparound)"), axes, peak)
    if topo.kind == "gpu":
        w_gpu = chip.value("interconnect.nvlink_bandwidth_bytes_per_s")
        if not w_gpu:
            return None
        w_gpu = float(w_gpu)
        nodes = {topo.coords(d)[0] for d in group}
        per_node = max(len(group) // max(len(nodes), 1), 1)
        if c.kind == "collective-permute":
            cross = len(nodes) > 1
            w = float(chip.value("interconnect.infiniband_bandwidth_bytes_per_s", 0) or 0) if cross else w_gpu
            if not w:
                return None
            bw = c.bytes_in / w
            return CommEstimate(max(bw, GPU_LAUNCH_LATENCY_S), bw, GPU_LAUNCH_LATENCY_S,
                                "InfiniBand" if cross else "NVLink", "pairs", w)
        if len(nodes) <= 1:
            if c.kind == "all-to-all":
                bw = V * (n - 1) / (n * n * w_gpu)
            else:
                bw = V * (n - 1) / (n * w_gpu) * (2 if c.kind == "all-reduce" else 1)
            return CommEstimate(max(bw, GPU_LAUNCH_LATENCY_S), bw, GPU_LAUNCH_LATENCY_S, "NVLink",
                                f"{n} GPUs in a node", w_gpu)
        w_ib = chip.value("interconnect.infiniband_bandwidth_bytes_per_s")
        if not w_ib:
            return None
        m = len(nodes)
        w_node = float(w_ib) * per_node  # node egress: one NIC per GPU
        if c.kind == "all-to-all":
            bw = V * (m - 1) / (m * m * w_node)
        else:
            levels = [(per_node - 1) / (per_node * w_gpu) if per_node > 1 else 0.0, (m - 1) / (m * w_node)]
            bw = V * max(levels) * (2 if c.kind == "all-reduce" else 1)
        return CommEstimate(max(bw, GPU_LAUNCH_LATENCY_S), bw, GPU_LAUNCH_LATENCY_S, "InfiniBand",
                            f"{m} nodes x {per_node} GPUs", w_node)
    return None


def bus_bandwidth(c: Collective, measured_s: float) -> float | None:
    """Achieved bus bandwidth (B/s) as nccl-tests reports it: S / t x factor, S the size its ``*GetBw`` counts
    (src/all_reduce.cu, all_gather.cu, reduce_scatter.cu, alltoall.cu, sendrecv.cu): the whole array for an
    all-reduce, all-gather (its output) and reduce-scatter (its input); one device's buffer for an all-to-all
    (``count * nranks`` with ``count`` the per-peer part) and for a collective-permute (what one device
    sends). None for other kinds, a group of one, or no time."""
    f = NCCL_BUS_FACTOR.get(c.kind)
    if f is None or measured_s <= 0 or c.group_size < 2:
        return None
    size_bytes = c.bytes_in if c.kind in ("all-to-all", "collective-permute") else c.full_bytes
    return size_bytes / measured_s * f(c.group_size)
