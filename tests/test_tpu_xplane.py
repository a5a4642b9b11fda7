"""TPU XPlane layout (XLA Ops / XLA Modules / Steps lines, libtpu per-op cost stats), on a profile this test
builds: no intact public TPU .xplane.pb exists (xplane-format.md §6.1), so the planes follow XProf's reader
(openxla/xprof xplane_to_op_stats.cc) around a real HLO module taken from a project fixture."""

from __future__ import annotations

import pytest

from parsers.hlo_proto import module_from_proto
from parsers.xspace import SCHEMA, read_xspace
from traceroof import analyze
from traceroof.cost import CostModel
from tests.conftest import fixture_xplane


def _build(path, doubled: str) -> tuple[float, int]:
    src = read_xspace(fixture_xplane("scan_mlp"))
    meta = src.plane("/host:metadata")
    em = next(m for m in meta.event_metadata.values() if m.name.startswith("jit_train_step"))
    pid = int(em.stats["program_id"])
    module = module_from_proto(em.stats["Hlo Proto"], em.name, pid)
    model = CostModel(module)
    ops = [i for i in module.entry.instructions if i.opcode not in ("parameter", "constant", "tuple",
                                                                    "get-tuple-element", "bitcast", "while")]
    xs = SCHEMA["XSpace"]()
    mp = xs.planes.add(id=1, name="/host:metadata")
    mp.stat_metadata[1].id, mp.stat_metadata[1].name = 1, "Hlo Proto"
    mp.stat_metadata[2].id, mp.stat_metadata[2].name = 2, "program_id"
    e = mp.event_metadata[pid]
    e.id, e.name = pid, em.name
    e.stats.add(metadata_id=1, bytes_value=em.stats["Hlo Proto"])
    e.stats.add(metadata_id=2, int64_value=pid)
    tp = xs.planes.add(id=2, name="/device:TPU:0")
    names = ["program_id", "flops", "bytes_accessed", "device_type_string", "peak_teraflops_per_second"]
    for i, n in enumerate(names, start=1):
        tp.stat_metadata[i].id, tp.stat_metadata[i].name = i, n
    tp.stats.add(metadata_id=4, str_value="TPU v5 lite")
    tp.stats.add(metadata_id=5, double_value=197.0)
    tp.event_metadata[1].id, tp.event_metadata[1].name = 1, f"jit_train_step({pid})"
    for j, inst in enumerate(ops, start=10):
        m = tp.event_metadata[j]
        m.id, m.name, m.display_name = j, f"%{inst.name} = ...", inst.name
        m.stats.add(metadata_id=1, int64_value=pid)
        flops = model.cost(inst).flops * (2 if inst.name == doubled else 1)
        m.stats.add(metadata_id=2, uint64_value=int(flops))
        m.stats.add(metadata_id=3, uint64_value=int(model.cost(inst).hbm_bytes))
    for j in range(2):
        tp.event_metadata[100 + j].id, tp.event_metadata[100 + j].name = 100 + j, str(j)
    modules = tp.lines.add(id=1, name="XLA Modules", timestamp_ns=1000)
    xla_ops = tp.lines.add(id=2, name="XLA Ops", timestamp_ns=1000)
    steps = tp.lines.add(id=3, name="Steps", timestamp_ns=1000)
    t, total = 0, 0.0
    for step in range(2):
        steps.events.add(metadata_id=100 + step, offset_ps=t, duration_ps=10_000_000)
        modules.events.add(metadata_id=1, offset_ps=t, duration_ps=9_000_000)
        for j, inst in enumerate(ops, start=10):
            xla_ops.events.add(metadata_id=j, offset_ps=t + 1000 * (j - 9), duration_ps=900)
            total += model.cost(inst).flops * (2 if inst.name == doubled else 1)
        t += 10_000_000
    path.write_bytes(xs.SerializeToString())
    return total / 2, len(ops)


def test_tpu_xla_ops_join_and_libtpu_costs(tmp_path):
    f = tmp_path / "tpu.xplane.pb"
    flops_per_step, n_ops = _build(f, doubled="ynn_fusion.3")
    a = analyze(f, warmup_steps=0)
    s = a.summary
    assert s.chip_id == "tpu_v5e" and "detected from the profile" in s.chip_note
    assert "peak 197 TFLOP/s" not in s.chip_note  # the profile's claim equals the database: no note
    assert s.join.events_joined == s.join.events_total == 2 * n_ops
    assert s.steps_used == (0, 1) and s.step_time_mean_s == pytest.approx(10e-6)
    assert s.flops_per_step == pytest.approx(flops_per_step)  # libtpu's numbers are used
    assert any("differ from traceroof's count" in n and "ynn_fusion.3" in n for n in s.notes)
