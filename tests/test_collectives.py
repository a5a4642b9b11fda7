"""Collectives: classification on real HLO, topology mapping, expected time against worked values computed here
from first principles (How to Scale Your Model §3, §12 via docs/reference/hardware-and-rooflines.md), exposed
communication and stragglers."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from parsers.hlo_text import parse_hlo_file, parse_hlo_text
from traceroof import analyze
from traceroof.chips import get_chip
from traceroof.collectives import (Collective, bus_bandwidth, classify, default_topology, expected_time,
                                   parse_topology)
from traceroof.cost import CostModel
from traceroof.aggregate import Timeline
from traceroof.overlap import arrival_skew, exposed_communication
from tests.conftest import FIXTURES, HOST_CHIP, third_party

US = 1e-6


def coll(kind, bytes_in, bytes_out, groups, form="sync"):
    return Collective(kind, form, "bf16", bytes_in, bytes_out, len(groups[0]), len(groups), "global ids",
                      tuple(tuple(g) for g in groups))


# -- expected time: worked values ----------------------------------------------------------------------------

def test_tpu_v5e_full_axis_wraps_bidirectional_ring():
    chip = get_chip("v5e")
    topo = parse_topology("16x16", chip)
    assert topo.wraparound == (True, True)
    local = 1 << 20
    c = coll("all-gather", local, 16 * local, [list(range(16))])  # one row of the torus: the x axis
    est = expected_time(c, chip, topo)
    v = 16 * local
    assert est.bandwidth_s == pytest.approx(v / (2 * 4.5e10))  # V / W_bidi, W_bidi = 2 x 45 GB/s
    assert est.latency_s == pytest.approx(16 / 2 * US)  # 1 us per hop, N/2 hops
    assert est.time_s == est.bandwidth_s and est.link == "ICI" and est.axes == "x16"


def test_tpu_v5e_partial_axis_is_a_line():
    chip = get_chip("v5e")
    topo = parse_topology("4x4", chip)
    assert topo.wraparound == (False, False)
    c = coll("all-gather", 1 << 20, 4 << 20, [[0, 1, 2, 3]])
    est = expected_time(c, chip, topo)
    assert est.bandwidth_s == pytest.approx((4 << 20) * 3 / 4 / 4.5e10)  # V (N-1)/N / W_one-way
    assert "no wraparound" in est.link


def test_latency_bound_small_message():
    chip = get_chip("v5e")
    topo = parse_topology("16x16", chip)
    c = coll("all-gather", 100, 1600, [list(range(16))])
    est = expected_time(c, chip, topo)
    assert est.bandwidth_s < 1e-7 and est.time_s == pytest.approx(8 * US)


def test_tpu_v5p_all_reduce_over_two_axes():
    chip = get_chip("v5p")
    topo = parse_topology("4x4x4", chip)
    assert topo.wraparound == (True, True, True)
    group = [x + 4 * y for y in range(4) for x in range(4)]  # the z = 0 plane: x and y axes
    v = 64 << 20
    c = coll("all-reduce", v, v, [group])
    est = expected_time(c, chip, topo)
    assert est.axes == "x4,y4"
    assert est.bandwidth_s == pytest.approx(2 * v / (2 * 9e10 * 2))  # 2V / (W_bidi x 2 axes)
    assert est.latency_s == pytest.approx(2 * (4 / 2 + 4 / 2) * US)


def test_tpu_v6e_all_to_all_quarter_of_all_gather():
    chip = get_chip("v6e")
    topo = parse_topology("16x16", chip)
    local = 8 << 20
    c = coll("all-to-all", local, local, [list(range(16))])
    est = expected_time(c, chip, topo)
    assert est.bandwidth_s == pytest.approx(16 * local / (4 * 2 * 9e10))  # V / (4 W_bidi), V = input x N


def test_tpu_dcn_between_slices():
    chip = get_chip("v5p")
    topo = parse_topology("2x4x4x4", chip)
    assert topo.slices == 2 and topo.devices == 128
    v = 256 << 20
    c = coll("all-reduce", v, v, [[0, 64]])
    est = expected_time(c, chip, topo)
    assert est.link == "DCN"
    assert est.time_s == pytest.approx(2 * v / 2 / (6.25e9 * 64))  # 2V/(M W_dcn) with M = 64 chips per slice


def test_h100_node_all_reduce_and_all_to_all():
    chip = get_chip("h100")
    topo = default_topology(chip, 8)
    assert topo.shape == (8, 1)
    v = 1 << 30
    ar = expected_time(coll("all-reduce", v, v, [list(range(8))]), chip, topo)
    assert ar.link == "NVLink" and ar.time_s == pytest.approx(2 * v * 7 / (8 * 4.5e11))
    a2a = expected_time(coll("all-to-all", v // 8, v // 8, [list(range(8))]), chip, topo)
    assert a2a.time_s == pytest.approx(v * 7 / (64 * 4.5e11))  # V (N-1) / (N^2 W)


def test_h100_two_nodes_all_gather_crosses_infiniband():
    chip = get_chip("h100")
    topo = parse_topology("8x2", chip)
    v = 1 << 30
    est = expected_time(coll("all-gather", v // 16, v, [list(range(16))]), chip, topo)
    assert est.link == "InfiniBand"
    node = 8 * 5e10  # 8 x 400 Gb/s NICs per node
    assert est.time_s == pytest.approx(v * max(7 / (8 * 4.5e11), 1 / (2 * node)))
    small = expected_time(coll("all-gather", 8, 128, [list(range(16))]), chip, topo)
    assert small.time_s == pytest.approx(5 * US)  # launch-latency floor


def test_bus_bandwidth_follows_nccl_tests():
    """nccl-tests' *GetBw: S / t x factor, S the whole array (all-reduce, all-gather's output, reduce-scatter's
    input) or one rank's buffer (alltoall.cu: count * nranks * typesize, count the per-peer part; sendrecv)."""
    g = 1 << 30
    assert bus_bandwidth(coll("all-reduce", g, g, [list(range(8))]), 1.0) == pytest.approx(g * 2 * 7 / 8)
    assert bus_bandwidth(coll("all-gather", g // 8, g, [list(range(8))]), 1.0) == pytest.approx(g * 7 / 8)
    assert bus_bandwidth(coll("reduce-scatter", g, g // 8, [list(range(8))]), 1.0) == pytest.approx(g * 7 / 8)
    # a user's MoE dispatch: 8,192 B per device over 4 experts in 384.5 us -> 16.0 MB/s (not 4x that)
    a2a = coll("all-to-all", 8192, 8192, [list(range(4))])
    assert bus_bandwidth(a2a, 384.5e-6) == pytest.approx(8192 / 384.5e-6 * 3 / 4)
    assert bus_bandwidth(coll("collective-permute", 8192, 8192, [list(range(4))]), 1e-3) == pytest.approx(8.192e6)


# -- classification on real HLO --------------------------------------------------------------------------------

def test_async_all_to_all_start_payload_excludes_context():
    (m,) = parse_hlo_file(third_party("xla_hlo_samples/async_all_to_all_start_context_u32.xla_test.hlo"))
    model = CostModel(m)
    start = next(i for i in m.entry.instructions if i.opcode == "all-to-all-start")
    c = classify(model, start)
    assert c.kind == "all-to-all" and c.form == "start"
    out = start.shape.tuple_shapes[1]
    assert c.bytes_out == out.byte_size()  # the output element only, not the u32[] context scalars
    done = next(i for i in m.entry.instructions if i.opcode == "all-to-all-done")
    assert classify(model, done).form == "done"


def test_tpu_collective_fusion_is_recognised():
    (m,) = parse_hlo_file(third_party("xla_hlo_samples/tpu_style_collective_fusion_kcustom_allgather.xla_test.hlo"))
    model = CostModel(m)
    found = [classify(model, i) for c in m.computations.values() for i in c.instructions if i.opcode == "fusion"]
    assert any(c is not None and c.kind == "all-gather" and c.form == "fusion" for c in found)


def test_group_modes_and_permute_pairs():
    (m,) = parse_hlo_text("""HloModule c, num_partitions=4
add { a = f32[] parameter(0)
      b = f32[] parameter(1)
      ROOT s = f32[] add(a, b) }
ENTRY e {
  x = f32[8]{0} parameter(0)
  ar = f32[8]{0} all-reduce(x), replica_groups={{0,1}}, to_apply=add
  arp = f32[8]{0} all-reduce(x), channel_id=1, replica_groups={{0,1}}, to_apply=add
  a2a = f32[8]{0} all-to-all(x), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  cp = f32[8]{0} collective-permute(x), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  rs = f32[4]{0} reduce-scatter(x), channel_id=4, replica_groups=[2,2]<=[4], use_global_device_ids=true, dimensions={0}, to_apply=add
  ROOT t = (f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[4]{0}) tuple(ar, arp, a2a, cp, rs)
}""")
    model = CostModel(m)
    got = {i.name: classify(model, i) for i in m.entry.instructions}
    assert got["ar"].mode == "cross-replica" and got["ar"].group_size == 2
    assert got["arp"].mode == "cross-replica-and-partition" and got["arp"].group_size == 2 * 4
    assert got["a2a"].mode == "cross-partition" and got["a2a"].group_size == 4
    assert got["cp"].kind == "collective-permute" and got["cp"].source_target_pairs[0] == (0, 1)
    assert got["rs"].mode == "global ids" and got["rs"].groups == ((0, 1), (2, 3)) and got["rs"].full_bytes == 32
    assert got["t"] is None and got["x"] is None


# -- the sharded fixture: 8 virtual devices, 4 x 2 mesh ----------------------------------------------------------

@pytest.fixture(scope="module")
def sharded():
    return analyze(FIXTURES / "sharded_mlp", chip=HOST_CHIP)


def test_sharded_fixture_collectives(sharded):
    t = sharded.collectives.set_index("hlo_op")
    assert set(t["kind"]) >= {"all-gather", "all-reduce", "all-to-all"}
    ag = t.loc["all-gather"]
    assert ag["group_size"] == 4 and ag["num_groups"] == 2 and ag["mode"] == "global ids"  # FSDP over "data"
    assert ag["bytes_out"] == 256 * 256 * 4 and ag["bytes_in"] == 64 * 256 * 4
    a2a = t.loc["all-to-all"]
    assert a2a["group_size"] == 2 and a2a["num_groups"] == 4 and a2a["mode"] == "cross-partition"  # "model"
    assert sharded.summary.devices == 8
    assert ((t["exposed_per_step_s"] >= 0) & (t["exposed_per_step_s"] <= t["time_per_step_s"] + 1e-12)).all()
    assert sharded.summary.exposed_comm_per_step_s == pytest.approx(t["exposed_per_step_s"].sum())
    assert "exposed_comm_per_step_s" in sharded.layers


def test_sharded_fixture_on_tpu_and_gpu_topologies():
    v5e = analyze(FIXTURES / "sharded_mlp", chip="v5e")
    t = v5e.collectives.set_index("hlo_op")
    # iota groups [2,4]<=[4,2]T(1,0) = {0,2,4,6},{1,3,5,7}: on a 2 x 4 slice (x fastest) that is the y axis
    assert v5e.topology.startswith("2x4") and t.loc["all-gather", "axes"] == "y4"
    assert t.loc["all-to-all", "axes"] == "x2"
    v = 256 * 256 * 4
    assert t.loc["all-gather", "expected_per_step_s"] == pytest.approx(max(v * 3 / 4 / 4.5e10, 3 * US))
    h100 = analyze(FIXTURES / "sharded_mlp", chip="h100")
    assert (h100.collectives["link"] == "NVLink").all()
    two_nodes = analyze(FIXTURES / "sharded_mlp", chip="h100", topology="4x2")
    t2 = two_nodes.collectives.set_index("hlo_op")
    assert t2.loc["all-gather", "link"] == "InfiniBand" and t2.loc["all-to-all", "link"] == "NVLink"


def test_mi300x_eight_gpu_profile_topology():
    a = analyze(third_party("tracelens_mi300x/jax08_conv.xplane.pb"))
    assert a.topology == "1 node(s) x 8 GPUs" and a.summary.devices == 8 and a.collectives.empty


# -- overlap and stragglers on timelines built here --------------------------------------------------------------

def _ops(rows):
    """An op table of one event per row, and the events' timeline."""
    df = pd.DataFrame(rows, columns=["device", "program_id", "hlo_op", "start_ps", "duration_ps", "category", "step"])
    df["counted"] = True
    df["program_id"] = pd.array(df["program_id"], "Int64")
    df["step"] = pd.array(df["step"], "Int64")
    timeline = Timeline(np.arange(len(df)), df["start_ps"].to_numpy(np.int64), df["duration_ps"].to_numpy(np.int64))
    return df, timeline


def test_exposed_communication_sync_and_async():
    ops = _ops([
        ("d0", 1, "fusion.1", 0, 400, "matmul", 0),
        ("d0", 1, "all-gather.1", 200, 600, "collective", 0),  # [200, 800): fusion covers [200, 400)
        ("d0", 1, "all-reduce-start", 1000, 10, "collective", 0),
        ("d0", 1, "fusion.2", 1010, 300, "matmul", 0),
        ("d0", 1, "all-reduce-done", 1400, 100, "collective", 0),  # window [1000, 1500): covered 300
    ])
    out = exposed_communication(*ops, {(1, "all-reduce-done"): "all-reduce-start"})
    r = out.set_index("hlo_op")
    assert r.loc["all-gather.1", "comm_window_s"] == pytest.approx(600e-12)
    assert r.loc["all-gather.1", "comm_exposed_s"] == pytest.approx(400e-12)
    assert r.loc["all-reduce-start", "comm_window_s"] == 0
    assert r.loc["all-reduce-done", "comm_window_s"] == pytest.approx(500e-12)
    assert r.loc["all-reduce-done", "comm_hidden_s"] == pytest.approx(300e-12)
    assert r.loc["fusion.1", "comm_exposed_s"] == 0


def test_async_windows_match_a_walk_over_each_device():
    """Each collective event's window start (from the latest earlier -start of its pair on its device) and which
    events are -start events, as one walk over every device's events by start finds them: several devices and
    programs, missing program ids, ties in start, -done events without a -start before them, an op both the
    -done of one pair and the -start of another, pairs whose -start never ran."""
    from traceroof.overlap import pair_windows

    rng = np.random.default_rng(3)
    names = np.array(["a-start", "a-done", "b-start", "b-done", "c", "d-start"], dtype=object)
    pairs = {(1, "a-done"): "a-start", (None, "a-done"): "a-start", (2, "b-done"): "b-start",
             (1, "b-start"): "a-start", (1, "x-done"): "x-start", (3, "d-done"): "d-start", (-4, "a-done"): "a-start"}
    for _ in range(300):
        n = int(rng.integers(1, 60))
        dev, pid, op = rng.integers(0, 3, n), rng.choice([-1.0, 1.0, 2.0], n), rng.integers(0, len(names), n)
        start = rng.integers(0, 30, n)
        is_start, lo = pair_windows(dev, pid, op, names, start, pairs)
        want_lo, want_start = start.copy(), np.zeros(n, bool)
        starts = {(p, st) for (p, _), st in pairs.items()}
        for d in range(3):
            last = {}
            for j in sorted(np.flatnonzero(dev == d).tolist(), key=lambda j: (start[j], j)):
                key = (int(pid[j]) if pid[j] >= 0 else None, names[op[j]])
                if key in starts:
                    last[key], want_start[j] = start[j], True
                elif key in pairs and (key[0], pairs[key]) in last:
                    want_lo[j] = last[(key[0], pairs[key])]
        assert is_start.tolist() == want_start.tolist() and lo.tolist() == want_lo.tolist()


def test_arrival_skew_names_the_late_device():
    rows = []
    for step in range(3):
        for occ in range(2):
            base = step * 10_000 + occ * 1000
            for d, delay in (("d0", 0), ("d1", 50), ("d2", 400)):
                rows.append((d, 1, "all-reduce", base + delay, 100, "collective", step))
    skew = arrival_skew(*_ops(rows))
    assert len(skew) == 6 and (skew["last_device"] == "d2").all()
    assert skew["skew_s"].iloc[0] == pytest.approx(400e-12)
    assert skew["wait_s"].iloc[0] == pytest.approx((400 + 350) * 1e-12)


def test_library_collective_custom_calls_are_classified_without_a_made_up_cost():
    (m,) = parse_hlo_file(third_party("xla_hlo_samples/neuron_llama_layer_tp8.pre_backend.hlo"))
    model = CostModel(m)
    calls = [i for c in m.computations.values() for i in c.instructions if i.opcode == "custom-call"]
    found = [classify(model, i) for i in calls]
    assert found and all(c is not None and c.form == "custom-call" for c in found)
    assert all(expected_time(c, get_chip("h100"), default_topology(get_chip("h100"), 8)) is None for c in found)
    ar = [classify(model, i) for c in m.computations.values() for i in c.instructions if i.opcode == "all-reduce"]
    assert ar and all(c.kind == "all-reduce" and c.group_size == 8 for c in ar)


def test_findings_name_the_straggler_and_the_exposed_collective():
    from dataclasses import replace
    from types import SimpleNamespace

    from traceroof.findings import FindingInputs
    from traceroof.findings.rules_system import collective_straggler, exposed_collective

    rows = []
    for step in range(2):
        for d, delay in (("host_a/gpu:0", 0), ("host_b/gpu:3", 300_000_000)):
            rows.append((d, 1, "all-reduce", step * 10**10 + delay, 1000, "collective", step))
    skew = arrival_skew(*_ops(rows))
    table = pd.DataFrame([{"hlo_op": "all-reduce.7", "kind": "all-reduce", "bytes_out": 4e6, "group_size": 8,
                           "exposed_per_step_s": 2e-3, "exposed_share": 0.9, "expected_per_step_s": 1e-3,
                           "link": "nvlink", "arrival_skew_s": 3e-4}])
    a = SimpleNamespace(summary=SimpleNamespace(step_time_mean_s=10e-3, hosts=2), collectives=table, per_step_divisor=2)
    x = FindingInputs(a, pd.DataFrame(columns=["hlo_op", "measured_s"]), get_chip("h100"), skew=skew, steps=2)
    (exposed,) = exposed_collective(x)
    assert exposed.ops == ("all-reduce.7",) and "reduce-scatter + all-gather" in exposed.advice
    assert "xla_gpu_enable_latency_hiding_scheduler" in exposed.advice and exposed.lost_per_step_s == 2e-3
    (late,) = collective_straggler(x)
    assert late.title.startswith("host_b/gpu:3 arrives last at 100%") and late.code == "collective-straggler"
    # a user's 4-byte loss psum, latency-bound on the links: splitting or sharding it cannot help
    loss = table.assign(hlo_op="all-reduce.16", bytes_out=4, bound="latency")
    (small,) = exposed_collective(replace(x, analysis=SimpleNamespace(**{**vars(a), "collectives": loss})))
    assert small.advice.startswith("a latency-bound all-reduce of 4 B: its cost on these links is the fixed latency")
    assert "reduce-scatter + all-gather" not in small.advice


def test_a_late_host_is_the_straggler_and_its_loss_is_per_device():
    """A user's 2-host job, one host 30 ms late at every all-reduce: the last device took turns among that host's
    4 devices (one named at 60 %), and the loss read was the waits summed over the 4 waiting devices (120 ms of a
    270 ms step). The host is named, and the loss is the per-device skew (30 ms), with the mean wait (latest less
    mean arrival) as evidence."""
    from types import SimpleNamespace

    from traceroof.findings import FindingInputs
    from traceroof.findings.rules_system import collective_straggler

    rows = []
    for step in range(3):
        late = f"host1/cpu:{step % 2}"  # host1's devices take turns arriving last
        for d in ("host0/cpu:0", "host0/cpu:1", "host1/cpu:0", "host1/cpu:1"):
            delay = 30_000_000_000 + (1_000_000_000 if d == late else 0) if d.startswith("host1") else 0
            rows.append((d, 1, "all-reduce", step * 10**12 + delay, 1000, "collective", step))
    ops, timeline = _ops(rows)
    skew = arrival_skew(ops, timeline)
    a = SimpleNamespace(summary=SimpleNamespace(step_time_mean_s=0.1, hosts=2), collectives=pd.DataFrame(),
                        per_step_divisor=4)
    (late,) = collective_straggler(FindingInputs(a, pd.DataFrame(columns=["hlo_op", "measured_s"]), get_chip("h100"),
                                                 skew=skew, steps=3))
    assert late.title.startswith("host1's devices (2 of them, in turn) arrive last at 100%"), late.title
    assert late.lost_per_step_s == pytest.approx(0.031)  # latest less earliest arrival, each step
    mean_wait = (2 * 31e-3 + 1e-3) / 4  # two host0 devices wait 31 ms, host1's early one 1 ms, the last none
    assert f"{mean_wait * 1e3:.3f} ms per step on average" in late.evidence[0]


def test_collectives_on_virtual_cpu_devices_get_no_interconnect_advice():
    from dataclasses import replace

    from traceroof.findings import FindingInputs
    from traceroof.findings.rules_system import exposed_collective

    a = analyze(FIXTURES / "sharded_mlp", chip=HOST_CHIP)
    comm = [f for f in a.findings if f.code == "exposed-collective"]
    assert {f.ops[0] for f in comm} == {"all-reduce.4", "all-to-all", "all-gather"}
    assert all("virtual CPU devices" in f.title and "arrival skew" in f.advice for f in comm), comm
    assert not any("reduce-scatter + all-gather" in str(f) or "prefetch" in str(f) for f in a.findings)
    real = exposed_collective(FindingInputs(replace(a, findings=()), a.ops.iloc[:0], get_chip("tpu_v5e")))
    assert any("split it into reduce-scatter + all-gather" in f.advice for f in real), real
    assert all("xla_tpu_enable_async_collective_fusion" in f.advice for f in real)


def _all_reduce_proto(mesh_ids: list[int] | None = None, iota: tuple[list[int], list[int]] | None = None) -> bytes:
    """An HloProto of p = f32[8] parameter; all-reduce(p) over axis 'b' of mesh['a'=4,'b'=2], in the
    ``mesh_axes_replica_group_list`` form jax 0.10's embedded HloProtos carry (field 93), not a group list."""
    from parsers.hlo_proto import _CLASSES

    proto = _CLASSES["HloProto"]()
    mod = proto.hlo_module
    mod.name, mod.entry_computation_name, mod.entry_computation_id = "jit_step", "main", 1
    comp = mod.computations.add(name="main", id=1, root_id=2)
    p = comp.instructions.add(name="p", opcode="parameter", id=1, parameter_number=0)
    p.shape.element_type, p.shape.dimensions[:] = 11, [8]
    ar = comp.instructions.add(name="all-reduce", opcode="all-reduce", id=2, operand_ids=[1], channel_id=1,
                               use_global_device_ids=True)
    ar.shape.element_type, ar.shape.dimensions[:] = 11, [8]
    groups = ar.mesh_axes_replica_group_list
    groups.mesh.axes.add(name="a", size=4)
    groups.mesh.axes.add(name="b", size=2)
    groups.mesh.device_ids[:] = mesh_ids or []
    if iota is not None:
        groups.mesh.iota_device_ids.reshape_dims[:], groups.mesh.iota_device_ids.transpose_perm[:] = iota
    groups.axes.add(mesh_axis_index=1)
    return proto.SerializeToString()


def test_mesh_axes_replica_groups_of_an_embedded_hlo_proto():
    """jit over a mesh: the profile's HloProto writes replica groups as mesh axes; they read as XLA prints
    them (the groups of devices along 'b'), and a permuted mesh as the explicit groups of its devices."""
    from parsers.hlo_proto import module_from_proto
    from parsers.hlo_text import parse_replica_groups

    m = module_from_proto(_all_reduce_proto())
    text = m.entry.by_name["all-reduce"].attrs["replica_groups"]
    assert text == "mesh['a'=4,'b'=2] {'b'}"
    assert parse_replica_groups(text) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    m = module_from_proto(_all_reduce_proto([7, 6, 5, 4, 3, 2, 1, 0]))
    text = m.entry.by_name["all-reduce"].attrs["replica_groups"]
    assert text == "mesh['a'=4,'b'=2], device_ids=(7,6,5,4,3,2,1,0) {'b'}"
    assert parse_replica_groups(text) == [[7, 6], [5, 4], [3, 2], [1, 0]]


def test_mesh_device_ids_as_an_iota_in_text_dumps_and_hlo_protos():
    """jax 0.10 on a ('data', 'fsdp') = (4, 2) mesh prints ``mesh[...], device_ids=([4,2]T(1,0)) {axes}`` (the mesh's
    devices are iota(8) as [4,2] transposed), and its HloProto writes the iota in MeshProto field 3 (bytes taken
    from a real profile). The comma inside split the value in two attributes, so every FSDP all-gather read as
    ungrouped and the mesh came out as one axis of 8 ('data'); the groups are the fsdp pairs {0,1}, {2,3}..."""
    from parsers.errors import HloParseError
    from parsers.hlo_proto import HloProtoMessage, module_from_proto
    from parsers.hlo_text import parse_replica_groups

    line = ("  ag = f32[8]{0} all-gather(p), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], "
            "device_ids=([4,2]T(1,0)) {'axis_0'}, dimensions={0}, use_global_device_ids=true\n")
    (m,) = parse_hlo_text("HloModule m\n\nENTRY e {\n  p = f32[4]{0} parameter(0)\n" + line + "}\n")
    ag = m.entry.by_name["ag"]
    assert "device_ids" not in ag.attrs and ag.attrs["dimensions"] == "{0}"
    assert parse_replica_groups(ag.attrs["replica_groups"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    data_axis = "mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_2'}"
    assert parse_replica_groups(data_axis) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # the same mesh from a profile's HloProto: MeshProto {axes..., 3: {1: [4, 2], 2: [1, 0]}}
    raw = bytes.fromhex("0a0a0a06617869735f3010020a0a0a06617869735f3110010a0a0a06617869735f3210041a080a02040212020100")
    mesh = HloProtoMessage().hlo_module.computations.add().instructions.add().mesh_axes_replica_group_list.mesh
    mesh.ParseFromString(raw)
    assert list(mesh.iota_device_ids.reshape_dims) == [4, 2] and list(mesh.iota_device_ids.transpose_perm) == [1, 0]
    for bad in ("([99999999,99999999]T(1,0))", "(99999999999999999999999,1,2,3,4,5,6,7)", "(0,0,0,0,0,0,0,0)",
                "([4,2]T(1,0,2))", "([3,2]T(1,0))", "(x)"):  # corrupt: one HloParseError, never another exception
        with pytest.raises(HloParseError):
            parse_replica_groups(f"mesh['a'=4,'b'=2], device_ids={bad} {{'a'}}")
    assert module_from_proto(_all_reduce_proto(iota=([1 << 40, 2], [1, 0]))).entry.by_name[
        "all-reduce"].attrs.get("replica_groups") is None  # a corrupt HloProto's groups: unknown, not a crash
    m = module_from_proto(_all_reduce_proto(iota=([4, 2], [1, 0])))
    text = m.entry.by_name["all-reduce"].attrs["replica_groups"]
    assert text == "mesh['a'=4,'b'=2], device_ids=([4,2]T(1,0)) {'b'}"
    assert parse_replica_groups(text) == [[0, 2], [4, 6], [1, 3], [5, 7]]  # devices 0,2,4,6,1,3,5,7 in pairs


def test_collectives_without_groups_span_the_devices_that_ran_the_program():
    """``replica_groups={}`` means every device; an HloProto has no num_partitions, so the count comes from the
    devices that ran the program (the op table passes it), not 1."""
    m = parse_hlo_text("HloModule m\n\nENTRY e {\n  p = f32[8]{0} parameter(0)\n"
                       "  ROOT ar = f32[8]{0} all-reduce(p), channel_id=1, replica_groups={}, to_apply=add\n}\n")[0]
    inst = m.entry.by_name["ar"]
    assert classify(CostModel(m), inst).group_size == 1
    assert classify(CostModel(m), inst, 8).group_size == 8


def test_jit_over_a_mesh_profile_has_its_collective_groups():
    """par_dp8 (jax.jit over an 8-device mesh): the HloProto in the profile writes groups as mesh axes; the
    collectives table had group 1 and no links before they were read."""
    a = analyze("fixtures/par_dp8", chip="v5p", topology="2x2x2")
    ar = a.collectives[a.collectives["kind"] == "all-reduce"]
    assert len(ar) and (ar["group_size"] == 8).all() and (ar["link"] != "").all()
    assert [(r.axis, r.size, r.strategy) for r in a.parallelism.rows] == [("axis0", 8, "data")]


def test_collectives_table_names_groups_and_their_size_in_words():
    """``8 x 1`` (size x count) read as 8 groups of 1 in a user's trial; the table now says ``1 group of 8``.
    Independent source: the dump's ``replica_groups=[2,4]<=...`` (iota form: 2 groups of 4) of all-reduce.4."""
    import re

    from traceroof.report.text import collectives_table

    dump = (FIXTURES / "sharded_mlp" / "hlo" / "module_0026.jit_train_step.cpu_after_optimizations.txt").read_text()
    count, size = re.search(r"%all-reduce\.4 = .*replica_groups=\[(\d+),(\d+)\]<=", dump).groups()
    table = collectives_table(analyze(FIXTURES / "sharded_mlp", chip=str(HOST_CHIP))).set_index("op")
    assert table.loc["all-reduce.4", "groups"] == f"{count} groups of {size}" == "2 groups of 4"


def test_the_headline_says_virtual_devices_mostly_wait():
    """A user's LSTM on 8 virtual CPU devices read "exposed communication 75 %" in the header with nothing beside
    it (only a finding said the devices were waiting on shared cores). The header and the digest now say it
    where the figure is. Checked against the data movement: the all-reduce's bytes at the host's calibrated
    memory bandwidth take a small part of the exposed time; a one-device profile gets no such words."""
    from traceroof.report import render
    from traceroof.report.text import VIRTUAL_COMM

    a = analyze(FIXTURES / "par_dp8", chip=HOST_CHIP)
    s = a.summary
    assert s.virtual_devices and s.devices == 8
    moved_s = float((a.collectives["bytes_out"] * a.collectives["executions_per_step"]).sum()) \
        / s.hbm_bandwidth_bytes_per_s
    assert s.exposed_comm_per_step_s > 10 * moved_s  # the wait is not data movement
    comm = next(line for line in render(a, "terminal", wide=True).splitlines() if line.startswith("comm"))
    assert f"of the step{VIRTUAL_COMM})" in comm
    assert VIRTUAL_COMM in render(a, "summary")
    assert json.loads(render(a, "json"))["summary"]["virtual_devices"] is True
    one = analyze(FIXTURES / "transformer", chip=HOST_CHIP)
    assert one.summary.devices == 1  # a CPU profile of one device: no other device to wait for
    assert VIRTUAL_COMM not in render(one, "terminal") + render(one, "summary")
