"""``xla.HloProto`` decoder: the modules a profile embeds in its ``/host:metadata`` plane (and the
``<module>(<id>).hlo_proto.pb`` files some tools write beside it), turned into the same module objects the HLO
text parser makes.

The schema subset (field numbers) is openxla/xla ``xla/service/hlo.proto`` and ``xla/xla_data.proto`` as listed
in ``docs/reference/xplane-format.md`` §7.1, built at runtime (no ``protoc``). Unknown fields are skipped; ids
are int64 (instruction ids exceed 2**32 in jax 0.10 protos). Attributes the cost model reads are rendered in
HLO text syntax (``lhs_contracting_dims={1}``, ``dim_labels=b01f_01io->b01f``, ``window={size=3x3 ...}``,
``calls=``, ``body=``/``condition=``...), so both sources feed one code path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from parsers.errors import HloParseError, InputError
from parsers.hlo import (INT_LIST_ATTRS, MAX_TUPLE_DEPTH, Computation, HloModule, Instruction, Layout, Metadata,
                         Shape, StackFrame, call_graph_problem, parameter_problem, shape_problem)

# xla/xla_data.proto PrimitiveType
PRIMITIVE_TYPES = {
    1: "pred", 2: "s8", 3: "s16", 4: "s32", 5: "s64", 6: "u8", 7: "u16", 8: "u32", 9: "u64", 10: "f16",
    11: "f32", 12: "f64", 13: "tuple", 14: "opaque", 15: "c64", 16: "bf16", 17: "token", 18: "c128",
    19: "f8e5m2", 20: "f8e4m3fn", 21: "s4", 22: "u4", 23: "f8e4m3b11fnuz", 24: "f8e5m2fnuz", 25: "f8e4m3fnuz",
    26: "s2", 27: "u2", 28: "f8e4m3", 29: "f8e3m4", 30: "s1", 31: "u1", 32: "f4e2m1fn", 33: "f8e8m0fnu",
}

_F = descriptor_pb2.FieldDescriptorProto
_SPEC: dict[str, list[tuple]] = {
    # message: (name, number, type, repeated, message type)
    "HloProto": [("hlo_module", 1, "M", False, "HloModuleProto")],
    "HloModuleProto": [("name", 1, "s", False), ("entry_computation_name", 2, "s", False),
                       ("computations", 3, "M", True, "HloComputationProto"), ("id", 5, "i", False),
                       ("entry_computation_id", 6, "i", False),
                       ("schedule", 7, "M", False, "HloScheduleProto"),
                       ("input_output_alias", 8, "M", False, "HloInputOutputAliasProto"),
                       ("stack_frame_index", 17, "M", False, "StackFrameIndexProto")],
    "HloComputationProto": [("name", 1, "s", False), ("instructions", 2, "M", True, "HloInstructionProto"),
                            ("id", 5, "i", False), ("root_id", 6, "i", False),
                            ("is_fusion_computation", 7, "b", False), ("execution_thread", 8, "s", False)],
    "HloInstructionProto": [
        ("name", 1, "s", False), ("opcode", 2, "s", False), ("shape", 3, "M", False, "ShapeProto"),
        ("metadata", 7, "M", False, "OpMetadata"), ("literal", 8, "M", False, "LiteralProto"),
        ("parameter_number", 9, "i", False), ("fusion_kind", 11, "s", False), ("tuple_index", 13, "i", False),
        ("dimensions", 14, "i", True), ("window", 15, "M", False, "Window"),
        ("convolution_dimension_numbers", 16, "M", False, "ConvolutionDimensionNumbers"),
        ("channel_id", 26, "i", False), ("custom_call_target", 28, "s", False),
        ("dot_dimension_numbers", 30, "M", False, "DotDimensionNumbers"), ("id", 35, "i", False),
        ("operand_ids", 36, "i", True), ("called_computation_ids", 38, "i", True),
        ("sharding", 40, "M", False, "OpSharding"),
        ("backend_config", 43, "y", False), ("replica_groups", 49, "M", True, "ReplicaGroup"),
        ("feature_group_count", 50, "i", False), ("source_target_pairs", 52, "M", True, "SourceTarget"),
        ("batch_group_count", 58, "i", False), ("comparison_direction", 63, "s", False),
        ("use_global_device_ids", 71, "b", False),
        ("collective_device_list", 87, "M", False, "CollectiveDeviceListProto"),
        ("iota_collective_device_list", 92, "M", False, "IotaReplicaGroupListProto"),
        ("mesh_axes_replica_group_list", 93, "M", False, "MeshAxesReplicaGroupListProto"),
    ],
    "ShapeProto": [("element_type", 2, "i", False), ("dimensions", 3, "i", True),
                   ("tuple_shapes", 4, "M", True, "ShapeProto"), ("layout", 5, "M", False, "LayoutProto"),
                   ("is_dynamic_dimension", 6, "b", True)],
    "LayoutProto": [("minor_to_major", 1, "i", True), ("tiles", 6, "M", True, "TileProto"),
                    ("element_size_in_bits", 7, "i", False), ("memory_space", 8, "i", False)],
    "TileProto": [("dimensions", 1, "i", True)],
    "OpMetadata": [("op_type", 1, "s", False), ("op_name", 2, "s", False), ("source_file", 3, "s", False),
                   ("source_line", 4, "i", False), ("deduplicated_name", 12, "s", False),
                   ("stack_frame_id", 15, "i", False), ("scheduling_name", 16, "s", False)],
    "LiteralProto": [("s32s", 4, "i32", True), ("s64s", 5, "i", True), ("u32s", 6, "u32", True),
                     ("u64s", 7, "u", True)],
    "Window": [("dimensions", 1, "M", True, "WindowDimension")],
    "WindowDimension": [("size", 1, "i", False), ("stride", 2, "i", False), ("padding_low", 3, "i", False),
                        ("padding_high", 4, "i", False), ("window_dilation", 5, "i", False),
                        ("base_dilation", 6, "i", False), ("window_reversal", 7, "b", False)],
    "ConvolutionDimensionNumbers": [
        ("kernel_input_feature_dimension", 3, "i", False), ("kernel_output_feature_dimension", 4, "i", False),
        ("kernel_spatial_dimensions", 6, "i", True), ("input_batch_dimension", 7, "i", False),
        ("input_feature_dimension", 8, "i", False), ("output_batch_dimension", 9, "i", False),
        ("output_feature_dimension", 10, "i", False), ("input_spatial_dimensions", 11, "i", True),
        ("output_spatial_dimensions", 12, "i", True)],
    "DotDimensionNumbers": [("lhs_contracting_dimensions", 1, "i", True), ("rhs_contracting_dimensions", 2, "i", True),
                            ("lhs_batch_dimensions", 3, "i", True), ("rhs_batch_dimensions", 4, "i", True)],
    "ReplicaGroup": [("replica_ids", 1, "i", True)],
    "SourceTarget": [("source", 1, "i", False), ("target", 2, "i", False)],
    "IotaReplicaGroupListProto": [("num_replica_groups", 1, "i", False), ("num_devices_per_group", 2, "i", False),
                                  ("iota_reshape_dims", 3, "i", True), ("iota_transpose_perm", 4, "i32", True)],
    # hlo.proto: the schedule (map<computation id, InstructionSequence> as entries) and donated buffers
    "HloScheduleProto": [("sequences", 1, "M", True, "ScheduleEntry")],
    "ScheduleEntry": [("key", 1, "i", False), ("value", 2, "M", False, "InstructionSequence")],
    "InstructionSequence": [("instruction_ids", 1, "i", True)],
    "HloInputOutputAliasProto": [("entries", 1, "M", True, "AliasEntryProto")],
    "AliasEntryProto": [("output_shape_index", 1, "i", True), ("parameter_number", 2, "i", False),
                        ("parameter_shape_index", 3, "i", True), ("kind", 4, "i", False)],
    # xla_data.proto: the mesh-axes form of replica groups (XLA text: mesh['a'=4,'b'=2] {'a'})
    "MeshAxesReplicaGroupListProto": [("mesh", 1, "M", False, "MeshProto"), ("axes", 2, "M", True, "AxisRefProto")],
    "MeshProto": [("axes", 1, "M", True, "MeshAxis"), ("device_ids", 2, "i", True),
                  ("iota_device_ids", 3, "M", False, "MeshIotaProto")],
    # the mesh's devices as an iota (XLA text ``device_ids=([4,2]T(1,0))``): field numbers as jaxlib 0.10 writes
    # them (a 4 x 2 data x fsdp mesh: reshape dims [4, 2], transpose [1, 0]); the names are ours
    "MeshIotaProto": [("reshape_dims", 1, "i", True), ("transpose_perm", 2, "i", True)],
    "MeshAxis": [("name", 1, "s", False), ("size", 2, "i", False)],
    "AxisRefProto": [("mesh_axis_index", 1, "i", False), ("sub_axis_info", 2, "M", False, "SubAxis")],
    "SubAxis": [("pre_size", 1, "i", False), ("size", 2, "i", False)],
    "CollectiveDeviceListProto": [("replica_groups", 1, "M", True, "ReplicaGroup"),
                                  ("iota_replica_group_list", 2, "M", False, "IotaReplicaGroupListProto")],
    # xla_data.proto OpSharding: an entry parameter's sharding gives its global shape (traceroof.parallelism)
    "OpSharding": [("type", 1, "i", False), ("tile_assignment_dimensions", 3, "i", True),
                   ("tile_assignment_devices", 4, "i", True), ("tuple_shardings", 5, "M", True, "OpSharding"),
                   ("replicate_on_last_tile_dim", 6, "b", False), ("last_tile_dims", 8, "i", True),
                   ("iota_reshape_dims", 9, "i", True), ("iota_transpose_perm", 10, "i32", True)],
    "StackFrameIndexProto": [("file_names", 1, "s", True), ("function_names", 2, "s", True),
                             ("file_locations", 3, "M", True, "FileLocation"),
                             ("stack_frames", 4, "M", True, "StackFrame")],
    "FileLocation": [("file_name_id", 1, "i32", False), ("function_name_id", 2, "i32", False),
                     ("line", 3, "i32", False), ("column", 4, "i32", False)],
    "StackFrame": [("file_location_id", 1, "i32", False), ("parent_frame_id", 2, "i32", False)],
}
_TYPES = {"s": _F.TYPE_STRING, "i": _F.TYPE_INT64, "i32": _F.TYPE_INT32, "u": _F.TYPE_UINT64,
          "u32": _F.TYPE_UINT32, "b": _F.TYPE_BOOL, "y": _F.TYPE_BYTES, "M": _F.TYPE_MESSAGE}


def _build() -> Any:
    fd = descriptor_pb2.FileDescriptorProto(name="traceroof_hlo.proto", package="xla", syntax="proto3")
    for msg, fields in _SPEC.items():
        m = fd.message_type.add(name=msg)
        for spec in fields:
            name, num, t, repeated = spec[:4]
            f = m.field.add(name=name, number=num, type=_TYPES[t],
                            label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
            if t == "M":
                f.type_name = ".xla." + spec[4]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName("xla." + n))
            for n in ("HloProto", "HloModuleProto")}


_CLASSES = _build()
HloProtoMessage = _CLASSES["HloProto"]


UNBOUNDED_DIM = -(2**63)  # Shape::kUnboundedSize (xla/shape.h): a dynamic dimension without a bound


def _shape(p: Any, depth: int = 0) -> Shape:
    """A :class:`Shape` from a ShapeProto; tuples nest at most :data:`MAX_TUPLE_DEPTH` levels.

    :raises ValueError: deeper nesting."""
    etype = PRIMITIVE_TYPES.get(p.element_type, f"type{p.element_type}")
    if etype == "tuple":
        if depth >= MAX_TUPLE_DEPTH:
            raise ValueError(f"tuple shapes nested deeper than {MAX_TUPLE_DEPTH} levels")
        return Shape("tuple", tuple_shapes=tuple(_shape(s, depth + 1) for s in p.tuple_shapes))
    layout = None
    if p.HasField("layout"):
        lp = p.layout
        layout = Layout(tuple(lp.minor_to_major), tuple(tuple(t.dimensions) for t in lp.tiles),
                        lp.element_size_in_bits or None, lp.memory_space)
    dims = tuple(-1 if d == UNBOUNDED_DIM else d for d in p.dimensions)
    dyn = tuple(p.is_dynamic_dimension) or (False,) * len(dims)
    return Shape(etype, dims, dyn, layout)


def _ints(values: Any) -> str:
    return "{" + ",".join(str(v) for v in values) + "}"


def _dim_labels(d: Any) -> str:
    def labels(batch: int, feature: int, spatial: Any, b: str, f: str) -> str:
        out = ["?"] * (2 + len(spatial))
        if not all(0 <= x < len(out) for x in (batch, feature, *spatial)):
            raise ValueError(f"convolution dimension numbers out of range ({batch}, {feature}, {list(spatial)})")
        out[batch], out[feature] = b, f
        for i, s in enumerate(spatial):
            out[s] = str(i)
        return "".join(out)

    return (labels(d.input_batch_dimension, d.input_feature_dimension, d.input_spatial_dimensions, "b", "f") + "_"
            + labels(d.kernel_input_feature_dimension, d.kernel_output_feature_dimension, d.kernel_spatial_dimensions,
                     "i", "o") + "->"
            + labels(d.output_batch_dimension, d.output_feature_dimension, d.output_spatial_dimensions, "b", "f"))


def _window(w: Any) -> str:
    dims = list(w.dimensions)
    parts = [f"size={'x'.join(str(d.size) for d in dims)}"]
    if any(d.stride != 1 for d in dims):
        parts.append(f"stride={'x'.join(str(d.stride or 1) for d in dims)}")
    if any(d.padding_low or d.padding_high for d in dims):
        parts.append(f"pad={'x'.join(f'{d.padding_low}_{d.padding_high}' for d in dims)}")
    if any(d.base_dilation > 1 for d in dims):
        parts.append(f"lhs_dilate={'x'.join(str(d.base_dilation or 1) for d in dims)}")
    if any(d.window_dilation > 1 for d in dims):
        parts.append(f"rhs_dilate={'x'.join(str(d.window_dilation or 1) for d in dims)}")
    return "{" + " ".join(parts) + "}"


def _replica_groups(p: Any) -> str | None:
    """The instruction's replica groups as XLA prints them (explicit, iota or mesh-axes form), None when none."""
    if p.HasField("mesh_axes_replica_group_list"):
        return _mesh_axes_groups(p.mesh_axes_replica_group_list)
    iota = p.iota_collective_device_list if p.HasField("iota_collective_device_list") else (
        p.collective_device_list.iota_replica_group_list
        if p.HasField("collective_device_list") and p.collective_device_list.HasField("iota_replica_group_list")
        else None)
    if iota is not None:
        text = f"[{iota.num_replica_groups},{iota.num_devices_per_group}]<={list(iota.iota_reshape_dims)}"
        text = text.replace(" ", "")
        if iota.iota_transpose_perm:
            text += "T(" + ",".join(str(x) for x in iota.iota_transpose_perm) + ")"
        return text
    groups = list(p.replica_groups) or (list(p.collective_device_list.replica_groups)
                                        if p.HasField("collective_device_list") else [])
    if groups:
        return "{" + ",".join(_ints(g.replica_ids) for g in groups) + "}"
    return None


SHARDING_TYPES = {0: "replicated", 1: "maximal", 4: "manual", 5: "unknown", 6: "unreduced"}  # OpSharding.Type
MAX_SHARDING_DEPTH = 8  # tuple shardings nest as deep as tuple shapes; deeper ones are left out


def _sharding(s: Any, depth: int = 0) -> str:
    """An OpSharding as XLA prints it: ``{replicated}``, ``{maximal device=3}``, ``{devices=[4,1,2]<=[8]
    last_tile_dim_replicate}``, ``{devices=[2,2]0,2,1,3 last_tile_dims={manual}}``, a tuple's ``{{...}, {...}}``."""
    if s.type == 2:  # TUPLE
        if depth >= MAX_SHARDING_DEPTH:
            return "{}"
        return "{" + ", ".join(_sharding(t, depth + 1) for t in s.tuple_shardings) + "}"
    if s.type != 3:  # OTHER: tiled; the rest are named
        name = SHARDING_TYPES.get(s.type, "unknown")
        if s.type == 1 and s.tile_assignment_devices:
            name += f" device={s.tile_assignment_devices[0]}"
        return "{" + name + "}"
    text = "devices=[" + ",".join(str(d) for d in s.tile_assignment_dimensions) + "]"
    if s.iota_reshape_dims:
        text += "<=[" + ",".join(str(d) for d in s.iota_reshape_dims) + "]"
        if list(s.iota_transpose_perm) != list(range(len(s.iota_transpose_perm))):  # XLA omits the identity
            text += "T(" + ",".join(str(d) for d in s.iota_transpose_perm) + ")"
    else:
        text += ",".join(str(d) for d in s.tile_assignment_devices)
    if s.replicate_on_last_tile_dim:
        text += " last_tile_dim_replicate"
    elif s.last_tile_dims:
        text += " last_tile_dims={" + ",".join(SHARDING_TYPES.get(t, "unknown") for t in s.last_tile_dims) + "}"
    return "{" + text + "}"


def _mesh_axes_groups(m: Any) -> str | None:
    """A ``MeshAxesReplicaGroupListProto`` as XLA's text ``mesh['a'=4,'b'=2] {'a'}`` (a sub-axis as
    ``'a':(pre)size``; openxla/xla ``xla/hlo/ir/replica_group.cc`` ``MeshAxesReplicaGroupList::ToString``), with
    ``, device_ids=(...)`` after the axes when the mesh's devices are not 0..n-1 in order: listed, or an iota
    ``[4,2]T(1,0)`` (``xla/hlo/ir/mesh_and_axis.cc`` ``Mesh::ToString``). None when malformed."""
    from parsers.errors import HloParseError
    from parsers.hlo_text import parse_replica_groups

    axes = list(m.mesh.axes)
    if not axes or any("'" in a.name or a.size <= 0 for a in axes):
        return None
    chosen = []
    for ref in m.axes:
        if not 0 <= ref.mesh_axis_index < len(axes):
            return None
        name = axes[ref.mesh_axis_index].name
        sub = ref.sub_axis_info
        chosen.append(f"'{name}':({sub.pre_size}){sub.size}" if ref.HasField("sub_axis_info") else f"'{name}'")
    ids = list(m.mesh.device_ids)
    iota = m.mesh.iota_device_ids
    devices = ""
    if m.mesh.HasField("iota_device_ids") and len(iota.reshape_dims) > 1:
        devices = f", device_ids=([{_ints_csv(iota.reshape_dims)}]" + (
            f"T({_ints_csv(iota.transpose_perm)})" if iota.transpose_perm else "") + ")"
    elif ids and ids != list(range(len(ids))):
        devices = f", device_ids=({_ints_csv(ids)})"
    text = "mesh[" + ",".join(f"'{a.name}'={a.size}" for a in axes) + "]" + devices + " {" + ",".join(chosen) + "}"
    try:
        parse_replica_groups(text)
    except HloParseError:
        return None
    return text


def _ints_csv(values: Any) -> str:
    return ",".join(str(int(v)) for v in values)


def _attrs(p: Any, comp_names: dict[int, str]) -> tuple[dict[str, str], tuple[str, ...]]:
    op = p.opcode
    called = [comp_names.get(i, str(i)) for i in p.called_computation_ids]
    a: dict[str, str] = {}
    if op == "fusion":
        a["kind"] = p.fusion_kind
        if called:
            a["calls"] = "%" + called[0]
    elif op == "while" and len(called) >= 2:
        a["body"], a["condition"] = "%" + called[0], "%" + called[1]  # XLA stores {body, condition}
    elif op == "conditional":
        a["branch_computations"] = "{" + ", ".join("%" + c for c in called) + "}"
    elif op == "select-and-scatter" and len(called) >= 2:
        a["select"], a["scatter"] = "%" + called[0], "%" + called[1]
    elif op == "custom-call":
        a["custom_call_target"] = json.dumps(p.custom_call_target)
        if called:
            a["called_computations"] = "{" + ", ".join("%" + c for c in called) + "}"
    elif op in ("async-start", "async-update", "async-done") or op.endswith("-start"):
        if called:
            a["calls"] = "%" + called[0]
    elif called:
        a["to_apply"] = "%" + called[0]
    if p.dimensions:
        a["dimensions"] = _ints(p.dimensions)
    if p.HasField("dot_dimension_numbers"):
        d = p.dot_dimension_numbers
        for key, vals in (("lhs_batch_dims", d.lhs_batch_dimensions), ("lhs_contracting_dims",
                                                                         d.lhs_contracting_dimensions),
                          ("rhs_batch_dims", d.rhs_batch_dimensions), ("rhs_contracting_dims",
                                                                       d.rhs_contracting_dimensions)):
            if vals or "contracting" in key:
                a[key] = _ints(vals)
    if p.HasField("window") and p.window.dimensions:
        a["window"] = _window(p.window)
    if p.HasField("convolution_dimension_numbers"):
        a["dim_labels"] = _dim_labels(p.convolution_dimension_numbers)
    if p.feature_group_count > 1:
        a["feature_group_count"] = str(p.feature_group_count)
    if p.batch_group_count > 1:
        a["batch_group_count"] = str(p.batch_group_count)
    if p.comparison_direction:
        a["direction"] = p.comparison_direction
    if op == "get-tuple-element":
        a["index"] = str(p.tuple_index)
    groups = _replica_groups(p)
    if groups is not None:
        a["replica_groups"] = groups
    if p.channel_id:
        a["channel_id"] = str(p.channel_id)
    if p.use_global_device_ids:
        a["use_global_device_ids"] = "true"
    if p.source_target_pairs:
        a["source_target_pairs"] = "{" + ",".join(f"{{{s.source},{s.target}}}" for s in p.source_target_pairs) + "}"
    if p.HasField("sharding"):
        a["sharding"] = _sharding(p.sharding)
    if p.backend_config:
        a["backend_config"] = p.backend_config.decode("utf-8", "replace")
    return a, tuple(called)


_DECODED: OrderedDict[tuple[bytes, int | None], HloModule] = OrderedDict()  # module_from_proto's last few
DECODED_CACHE_SIZE = 4


def module_from_proto(data: bytes, source: str = "<HloProto>", program_id: int | None = None) -> HloModule:
    """Decode a serialized ``xla.HloProto`` (or a bare ``HloModuleProto``) into an :class:`HloModule`. The last
    few decoded are kept by a digest of their bytes: the same bytes again, from any ``source`` (every host of a
    pod embeds its program's HloProto: 0.05 s to decode each copy of the transformer fixture's 2,209
    instructions, seconds for a large program), give a new :class:`HloModule` of that ``source`` sharing their
    computations (which nothing modifies).

    :raises HloParseError: the bytes are not an HloProto.
    """
    key = (hashlib.sha1(data).digest(), program_id)
    if key in _DECODED:
        _DECODED.move_to_end(key)
        return dataclasses.replace(_DECODED[key], source=source)
    module = _decode(data, source, program_id)
    _DECODED[key] = dataclasses.replace(module)
    while len(_DECODED) > DECODED_CACHE_SIZE:
        _DECODED.popitem(last=False)
    return module


def _decode(data: bytes, source: str, program_id: int | None) -> HloModule:
    msg = HloProtoMessage()
    try:
        msg.ParseFromString(data)
    except Exception as e:  # protobuf DecodeError (and RecursionError beyond its nesting limit)
        raise HloParseError(f"{source}: not a valid xla.HloProto ({' '.join(str(e).split())[:200]})") from None
    mod = msg.hlo_module
    if not mod.computations:
        alt = _CLASSES["HloModuleProto"]()
        try:
            alt.ParseFromString(data)
        except Exception:
            alt = None
        if alt is None or not alt.computations:
            raise HloParseError(f"{source}: HloProto without computations")
        mod = alt
    try:
        return _module(mod, source, program_id)
    except ValueError as e:
        raise HloParseError(f"{source}: {e}") from None


def _module(mod: Any, source: str, program_id: int | None) -> HloModule:
    """The :class:`HloModule` of a decoded HloModuleProto.

    :raises ValueError: ids that name nothing (operands, called computations), computations or instructions
        named twice, impossible shapes or attributes, a cyclic or too deep call graph."""
    comp_names: dict[int, str] = {}
    for c in mod.computations:
        if not c.name:
            raise ValueError(f"computation id {c.id} has no name")
        if c.id in comp_names or c.name in comp_names.values():
            raise ValueError(f"computation {c.name} (id {c.id}) appears twice")
        comp_names[c.id] = c.name
    frames: dict[int, StackFrame] = {}
    sfi = mod.stack_frame_index
    for i, fr in enumerate(sfi.stack_frames, start=1):
        loc = sfi.file_locations[fr.file_location_id - 1] if 0 < fr.file_location_id <= len(sfi.file_locations) \
            else None
        frames[i] = StackFrame(
            sfi.file_names[loc.file_name_id - 1] if loc and 0 < loc.file_name_id <= len(sfi.file_names) else "",
            sfi.function_names[loc.function_name_id - 1]
            if loc and 0 < loc.function_name_id <= len(sfi.function_names) else "",
            loc.line if loc else 0, fr.parent_frame_id, loc.column if loc else 0)
    comps: dict[str, Computation] = {}
    entry = mod.entry_computation_name or comp_names.get(mod.entry_computation_id, "")
    schedule = {e.key: list(e.value.instruction_ids) for e in mod.schedule.sequences}
    # shapes and metadata by their serialized bytes: a module repeats a few dozen shapes and a few hundred metadata
    # thousands of times, and both are immutable
    shape_of: dict[bytes, tuple[Shape, str]] = {}
    metadata_of: dict[bytes, Metadata] = {}
    for c in mod.computations:
        names: dict[int, str] = {}
        protos = list(c.instructions)  # each field read once below where it is used more than once
        for i in protos:
            if not i.name or i.id in names:
                raise ValueError(f"computation {c.name}: instruction id {i.id} "
                                 + ("has no name" if not i.name else "appears twice"))
            names[i.id] = i.name
        shapes = {}
        for i in protos:
            key = i.shape.SerializeToString()
            got = shape_of.get(key)
            if got is None:
                shape = _shape(i.shape)
                got = shape_of[key] = (shape, shape_problem(shape))
            shapes[i.id], why = got
            if why:
                raise ValueError(f"instruction {i.name}: {why}")
        insts = []
        root_id = c.root_id
        for p in protos:
            operand_ids = list(p.operand_ids)
            missing = [o for o in operand_ids if o not in names]
            if missing:
                raise ValueError(f"instruction {p.name} in {c.name}: operand id {missing[0]} names no instruction "
                                 "of its computation")
            unknown = [i for i in p.called_computation_ids if i not in comp_names]
            if unknown:
                raise ValueError(f"instruction {p.name} in {c.name}: called computation id {unknown[0]} names no "
                                 "computation of the module")
            attrs, called = _attrs(p, comp_names)
            bad = [k for k in INT_LIST_ATTRS if k in attrs and any(v < 0 for v in _int_list(attrs[k]))] if attrs else []
            if bad or p.feature_group_count < 0 or p.batch_group_count < 0:
                raise ValueError(f"instruction {p.name}: negative {bad[0] if bad else 'group count'}")
            bc: Any = None
            if p.backend_config:
                try:
                    bc = json.loads(p.backend_config)
                except (ValueError, RecursionError):
                    bc = p.backend_config.decode("utf-8", "replace")
            key = p.metadata.SerializeToString()
            metadata = metadata_of.get(key)
            if metadata is None:
                md = p.metadata
                metadata = metadata_of[key] = Metadata(md.op_type, md.op_name, md.source_file, md.source_line,
                                                       md.stack_frame_id, md.deduplicated_name, md.scheduling_name)
            literal = ""
            opcode = p.opcode
            if opcode == "parameter":
                literal = str(p.parameter_number)
            elif opcode == "constant" and p.HasField("literal"):
                vals = list(p.literal.s32s) or list(p.literal.s64s) or list(p.literal.u32s) or list(p.literal.u64s)
                if len(vals) == 1:
                    literal = str(vals[0])
            pid = p.id
            insts.append(Instruction(
                name=p.name, opcode=opcode, shape=shapes[pid], operands=tuple([names[o] for o in operand_ids]),
                operand_shapes=tuple([shapes[o] for o in operand_ids]), attrs=attrs, called=called,
                metadata=metadata, backend_config=bc, literal=literal, is_root=pid == root_id,
            ))
        order = schedule.get(c.id)
        if order is not None and sorted(order) == sorted(names):  # XLA's schedule: the order the ops run in
            by_id = {i.id: inst for i, inst in zip(protos, insts)}
            insts = [by_id[i] for i in order]
        comps[c.name] = Computation(c.name, insts, c.name == entry, c.execution_thread)
    if entry not in comps:
        entry = list(comps)[-1]
        comps[entry].is_entry = True
    why = call_graph_problem(comps)[1] or parameter_problem(comps)[1]
    if why:
        raise ValueError(why)
    m = re.search(r"\((\d+)\)", Path(source).name)
    pid = program_id if program_id is not None else (int(m.group(1)) if m else (mod.id or None))
    attrs = {"input_output_alias": _aliases(mod.input_output_alias)} if mod.input_output_alias.entries else {}
    return HloModule(mod.name, comps, entry, attrs, frames, pid, source)


def _aliases(p: Any) -> str:
    """``input_output_alias`` as the HLO text header writes it: ``{ {0}: (0, {}, may-alias), ... }``."""
    kinds = {1: "may-alias", 2: "must-alias"}
    parts = [f"{{{','.join(str(i) for i in e.output_shape_index)}}}: ({e.parameter_number}, "
             f"{{{','.join(str(i) for i in e.parameter_shape_index)}}}, {kinds.get(e.kind, 'may-alias')})"
             for e in p.entries]
    return "{ " + ", ".join(parts) + " }"


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.strip("{}").split(",") if x.strip()]


def read_hlo_proto_file(path: str | Path) -> HloModule:
    """Read a ``<module>(<program_id>).hlo_proto.pb`` file.

    :raises InputError: unreadable file. :raises HloParseError: not an HloProto.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read {p}: {e.strerror}") from None
    return module_from_proto(data, str(p))
