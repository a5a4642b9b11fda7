"""The logical device mesh of a program, recovered from its collectives' replica groups.

A mesh of shape (a_0, ..., a_k) over device ids laid out row-major (``jax.make_mesh``, ``Mesh(devices.reshape)``
on iota-ordered devices, and what XLA prints as ``[G,S]<=[dims]T(perm)`` or ``mesh['a'=4,'b'=2] {'a'}``) gives
each axis a device-id stride: a collective over a set of axes has groups ``base + Σ k_i·stride_i``. Each group
is decomposed into (stride, size) factors (:func:`group_factors`); the factors of all collectives cut the id
range [1, N] at ``stride`` and ``stride·size``; consecutive cuts are the mesh axes (the finest mesh every
collective agrees with). Replica-group forms are expanded by :func:`parsers.hlo_text.parse_replica_groups`
(``docs/reference/hlo-text.md`` §9.1); collective-permutes contribute the connected components of their
source-target pairs. When the groups do not fit one row-major mesh (devices permuted, e.g. a TPU ring order),
every distinct partition of the devices becomes its own axis (``regular`` is false) and the report says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parsers.hlo import Computation, HloModule, Instruction
from traceroof.collectives import Collective, classify, module_devices
from traceroof.cost import CostModel

MAX_MESH_DEVICES = 1 << 20  # beyond this a group decomposition is not attempted (no real program)


@dataclass(frozen=True)
class MeshAxis:
    """One logical mesh axis: ``name`` (``axis0`` is the major one), ``size`` devices along it, and its device-id
    ``stride`` (1 for the minor axis; 0 for an axis of an irregular mesh, which is a partition, not a stride)."""

    name: str
    size: int
    stride: int


@dataclass(frozen=True)
class PlacedCollective:
    """A collective of the program and the mesh axes it runs over.

    ``executions``: runs per program execution (while bodies x trip count); ``op_name``: the JAX scope path of
    the instruction (``transpose(jvp(...))`` marks the backward pass)."""

    name: str
    computation: str
    collective: Collective
    axes: tuple[str, ...]
    executions: float
    op_name: str


@dataclass(frozen=True)
class Mesh:
    """The recovered mesh: ``axes`` major to minor, ``devices`` the program's device count, ``regular`` when one
    row-major mesh explains every group, ``collectives`` each placed on its axes, ``note`` what could not be
    placed."""

    axes: tuple[MeshAxis, ...]
    devices: int
    regular: bool
    collectives: tuple[PlacedCollective, ...]
    note: str = ""

    def axis(self, name: str) -> MeshAxis:
        """The axis called ``name``.

        :raises KeyError: no such axis."""
        return next(a for a in self.axes if a.name == name)

    def describe(self) -> str:
        """``axis0=4 x axis1=2`` (or ``-`` for no axes)."""
        return " x ".join(f"{a.name}={a.size}" for a in self.axes) or "-"


def group_factors(group: tuple[int, ...] | list[int]) -> tuple[tuple[int, int], ...] | None:
    """(stride, size) factors, minor first, whose sums ``base + Σ k_i·stride_i`` are exactly the group; ``None``
    when the group is no such product (e.g. ``{0, 1, 3}``). ``{0,1,4,5}`` -> ``((1, 2), (4, 2))``."""
    if not group:
        return None
    base = min(group)
    offsets = {d - base for d in group}
    if len(offsets) != len(group) or max(offsets) > MAX_MESH_DEVICES:
        return None
    span = {0}
    factors = []
    while len(span) < len(offsets):
        stride = min(offsets - span)
        size = 1
        while all(a + size * stride in offsets for a in span):
            size += 1
        span = {a + k * stride for a in span for k in range(size)}
        if not span <= offsets or size < 2:
            return None
        factors.append((stride, size))
    return tuple(factors)


def _partition(c: Collective) -> tuple[tuple[int, ...], ...]:
    """The device groups a collective runs over: its replica groups, or the connected components of its
    source-target pairs (a permute between stages)."""
    if not c.source_target_pairs:
        return tuple(tuple(sorted(g)) for g in c.groups)
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in c.source_target_pairs:
        parent[find(a)] = find(b)
    comps: dict[int, list[int]] = {}
    for x in list(parent):
        comps.setdefault(find(x), []).append(x)
    return tuple(sorted(tuple(sorted(g)) for g in comps.values()))


def _factors_of(partition: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, int], ...] | None:
    """The factors shared by every group of a partition (``None`` when they differ or do not decompose)."""
    first = group_factors(partition[0]) if partition else None
    if first is None or any(group_factors(g) != first for g in partition[1:]):
        return None
    return first


def program_collectives(module: HloModule, devices: int | None = None) -> list[tuple[Computation, Instruction,
                                                                                      Collective, float]]:
    """Every collective of the executed (non-fused) computations with its runs per program execution; the
    ``-done`` halves of async pairs are left out (their ``-start`` carries the groups). ``devices`` expands
    ``replica_groups={}`` (default: the module header's count)."""
    model = CostModel(module)
    n = devices or module_devices(module)
    out = []
    for comp, inst, k in model.executed_instructions():
        c = classify(model, inst, n)
        if c is None or c.form == "done" or k <= 0:
            continue
        out.append((comp, inst, c, k))
    return out


def program_devices(module: HloModule, found: list) -> int:
    """The module header's device count, or (a module from a profile's HloProto has no header) one more than the
    largest device id its collectives name (at most :data:`MAX_MESH_DEVICES`)."""
    n = module_devices(module)
    if n > 1:
        return n
    ids = [d for *_, c, _ in found for g in c.groups for d in g] + \
        [d for *_, c, _ in found for pair in c.source_target_pairs for d in pair]
    return min(max(ids, default=0) + 1, MAX_MESH_DEVICES)


def recover_mesh(module: HloModule) -> Mesh:
    """The logical mesh of a module and the axes of each of its collectives (see the module docstring).

    Collectives over a single device (group size 1) are left out. A module without collectives has no axes."""
    collectives = program_collectives(module)
    n = program_devices(module, collectives)
    if n != module_devices(module):
        collectives = program_collectives(module, n)
    found = []
    for comp, inst, c, k in collectives:
        part = _partition(c)
        if not part or max(len(g) for g in part) < 2:
            continue
        found.append((comp, inst, c, k, part, _factors_of(part)))
    if not found:
        return Mesh((), n, True, ())
    cuts = {1, n}
    for *_, factors in found:
        for stride, size in factors or ():
            cuts |= {stride, stride * size}
    ordered = sorted(cuts)
    regular = all(f is not None for *_, f in found) and ordered[-1] == n \
        and all(b % a == 0 for a, b in zip(ordered, ordered[1:]))
    if regular:
        minor_first = [(a, b // a) for a, b in zip(ordered, ordered[1:])]
        axes = tuple(MeshAxis(f"axis{i}", size, stride) for i, (stride, size) in enumerate(reversed(minor_first)))
        placed = []
        for comp, inst, c, k, part, factors in found:
            names = tuple(a.name for a in axes if any(s <= a.stride < s * z for s, z in factors))
            placed.append(PlacedCollective(inst.name, comp.name, c, names, k, inst.metadata.op_name))
        return Mesh(axes, n, True, tuple(placed))
    # irregular: one axis per distinct device partition
    parts: dict[frozenset, str] = {}
    sizes: dict[str, int] = {}
    placed = []
    for comp, inst, c, k, part, _ in found:
        key = frozenset(frozenset(g) for g in part)
        if key not in parts:
            parts[key] = f"groups{len(parts)}"
            sizes[parts[key]] = max(len(g) for g in part)
        placed.append(PlacedCollective(inst.name, comp.name, c, (parts[key],), k, inst.metadata.op_name))
    axes = tuple(MeshAxis(name, size, 0) for name, size in sizes.items())
    note = (f"the replica groups fit no row-major mesh of {n} devices (devices permuted): each distinct device "
            f"partition is shown as its own axis ({len(axes)})")
    return Mesh(axes, n, False, tuple(placed), note)


def axis_group(mesh: Mesh, names: tuple[str, ...]) -> tuple[int, ...]:
    """Device ids of the group through device 0 along the named axes of a regular mesh (``()`` otherwise)."""
    if not mesh.regular:
        return ()
    ids = [0]
    for a in mesh.axes:
        if a.name in names:
            ids = [d + k * a.stride for d in ids for k in range(a.size)]
    return tuple(sorted(ids))


def mesh_size(mesh: Mesh, names: tuple[str, ...] | list[str]) -> int:
    """Product of the sizes of the named axes (1 for none)."""
    return math.prod(a.size for a in mesh.axes if a.name in names)
