"""Real device profiles others recorded (../shared/fixtures/third_party): GPU kernels, HLO from the profile,
chip detection, library calls, XProf exports, a TensorFlow profile without XLA. Key figures are recomputed
here from the raw protobuf and JSON, not copied from traceroof's output."""

from __future__ import annotations

import gzip
import json
import re

import pytest

from parsers.hlo_proto import module_from_proto, read_hlo_proto_file
from parsers.xspace import parse_full, read_xspace
from traceroof import analyze
from traceroof.chips import ChipError, detect_chip
from traceroof.cost import CostModel
from tests.conftest import third_party

AMD = ["tracelens_mi300x/jax08_gemm.xplane.pb", "tracelens_mi300x/jax08_attention.xplane.pb",
       "tracelens_mi300x/jax08_conv.xplane.pb", "tracelens_mi300x/jax08_elementwise.xplane.pb",
       "tracelens_mi300x/jax_conv_minimal_legacy", "tracelens_gfx95x/te_fused_attn.xplane.pb"]


@pytest.mark.parametrize("rel", AMD)
def test_amd_profiles_analyze_with_embedded_hlo(rel):
    a = analyze(third_party(rel))
    s = a.summary
    assert s.chip_id == ("mi355x" if "gfx95x" in rel else "mi300x")
    assert s.join.events_joined > 0
    attributed = a.ops[a.ops["attributed"]]
    assert attributed["joined"].all(), "every kernel with an hlo_op finds its instruction by program id"
    assert "HloProtos embedded in the profile" in s.hlo_sources
    assert len(a.layers) and len(a.top_ops)


def _kernel_times_by_program(path) -> dict[tuple[int, str], list[int]]:
    """(program_id, hlo_op) -> kernel durations (ps), read with protobuf alone."""
    full = parse_full(path)
    out: dict[tuple[int, str], list[int]] = {}
    for plane in full.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for ev in line.events:
                st = {names[s.metadata_id]: s for s in ev.stats}
                if "hlo_op" in st and "program_id" in st:
                    op = names[st["hlo_op"].ref_value] if st["hlo_op"].WhichOneof("value") == "ref_value" \
                        else st["hlo_op"].str_value
                    pid = st["program_id"].int64_value or st["program_id"].uint64_value
                    out.setdefault((pid, op), []).append(ev.duration_ps)
    return out


def test_jax08_gemm_flops_and_efficiency_from_shapes():
    path = third_party("tracelens_mi300x/jax08_gemm.xplane.pb")
    times = _kernel_times_by_program(path)
    xs = read_xspace(path)
    meta = xs.plane("/host:metadata")
    a = analyze(path)
    top = a.top_ops.set_index(["program_id", "hlo_op"])
    checked = 0
    for em in meta.event_metadata.values():
        pid = int(re.search(r"\((\d+)\)", em.name).group(1))
        module = module_from_proto(em.stats["Hlo Proto"], em.name, pid)
        for comp in module.computations.values():
            for inst in comp.instructions:
                if inst.opcode != "custom-call" or "gemm" not in inst.attrs.get("custom_call_target", ""):
                    continue
                lhs, rhs = (comp.by_name[o].shape for o in inst.operands[:2])
                m, k = lhs.dims
                k2, n = rhs.dims
                assert k == k2
                flops = 2 * m * n * k  # per execution, from this module's own shapes
                assert CostModel(module).cost(inst).flops == flops
                kernels = times[(pid, inst.name)]
                rate = flops * len(kernels) / (sum(kernels) * 1e-12)
                if (m, k, n) == (8192, 4096, 8192):
                    assert sum(kernels) / len(kernels) == pytest.approx(611e6, rel=0.02)  # ~611 µs
                    assert rate / 1.3074e15 == pytest.approx(0.69, abs=0.03)  # MI300X bf16 dense peak
                    row = top.loc[(pid, inst.name)]
                    assert row["efficiency"] == pytest.approx(rate / 1.3074e15, rel=1e-6)
                checked += 1
    assert checked >= 5


def test_unattributed_kernel_time_is_visible():
    a = analyze(third_party("tracelens_mi300x/jax08_gemm.xplane.pb"))
    un = a.ops[~a.ops["attributed"]]
    assert len(un) > 0 and (un["category"] == "unattributed kernel").all()
    assert any("carry no hlo_op" in n for n in a.summary.notes)


def test_chip_detection_and_profile_claims():
    chip, note = detect_chip({"device_vendor": "AMD", "compute_cap_major": 9, "compute_cap_minor": 4,
                              "memory_size": 206141652992, "memory_bandwidth": 2662400000000})
    assert chip.id == "mi300x" and "HBM 2.66 TB/s" in note and "database 5.3 TB/s" in note
    assert detect_chip({"compute_cap_major": 7, "compute_cap_minor": 0, "memory_size": 16945512448})[0].id == "v100"
    assert detect_chip({"device_vendor": "AMD", "compute_cap_major": 9, "compute_cap_minor": 5})[0].id == "mi355x"
    assert detect_chip({"device_vendor": "Nvidia", "compute_cap_major": 9, "compute_cap_minor": 0,
                        "memory_size": 80e9})[0].id == "h100"
    assert detect_chip({"device_vendor": "Nvidia", "compute_cap_major": 9, "compute_cap_minor": 0,
                        "memory_size": 141e9})[0].id == "h200"
    assert detect_chip({"device_type_string": "TPU v5 lite"})[0].id == "tpu_v5e"
    assert detect_chip({"device_type_string": "TPU v6 Lite"})[0].id == "tpu_v6e"
    assert detect_chip({"device_type_string": "TPU v5"})[0].id == "tpu_v5p"
    with pytest.raises(ChipError) as err:
        detect_chip({"device_vendor": "Nvidia", "compute_cap_major": 8, "compute_cap_minor": 9})
    assert "a100" in str(err.value) and "--chip" in str(err.value)


def test_sidecar_hloproto_equals_embedded():
    d = third_party("tracelens_mi300x/jax_conv_minimal_legacy")
    sidecar = read_hlo_proto_file(d / "jit_forward_3d_conv(15).hlo_proto.pb")
    assert sidecar.program_id == 15
    xs = read_xspace(next(d.glob("*.xplane.pb")))
    em = next(m for m in xs.plane("/host:metadata").event_metadata.values() if m.name.endswith("(15)"))
    embedded = module_from_proto(em.stats["Hlo Proto"], em.name, 15)
    a, b = CostModel(sidecar), CostModel(embedded)
    names = [i.name for c in sidecar.computations.values() for i in c.instructions]
    assert names == [i.name for c in embedded.computations.values() for i in c.instructions]
    for name in names:
        assert a.cost(sidecar.instruction(name)) == b.cost(embedded.instruction(name))


def test_cudnn_convolution_flops_from_its_window():
    path = third_party("tracelens_mi300x/jax08_conv.xplane.pb")
    a = analyze(path)
    conv = a.ops[a.ops["opcode"] == "custom-call"]
    assert len(conv) and not conv["opaque"].any() and (conv["category"] == "matmul").all()
    xs = read_xspace(path)
    (em,) = [m for m in xs.plane("/host:metadata").event_metadata.values()
             if m.name.endswith(f"({int(conv['program_id'].iloc[0])})")]
    module = module_from_proto(em.stats["Hlo Proto"], em.name)
    inst = module.instruction(str(conv["hlo_op"].iloc[0]))
    comp = next(c for c in module.computations.values() if inst.name in c.by_name)
    x, f = (comp.by_name[o].shape for o in inst.operands[:2])  # b f 0 1 2 / o i 0 1 2 (dim_labels)
    out = inst.shape.tuple_shapes[0]
    win = dict(re.findall(r"(\w+)=([\dx_]+)", inst.attrs["window"]))
    size = [int(v) for v in win["size"].split("x")]
    stride = [int(v) for v in win["stride"].split("x")]
    pad = [int(v.split("_")[0]) for v in win["pad"].split("x")]
    taps = 1
    for d in range(3):  # count (kernel tap, output position) pairs that read real input, by brute force
        taps *= sum(1 for k in range(size[d]) for o in range(out.dims[2 + d])
                    if 0 <= o * stride[d] + k - pad[d] < x.dims[2 + d])
    expected = 2 * x.dims[1] * f.dims[0] * x.dims[0] * taps
    per_execution = conv["flops"].iloc[0] / conv["executions"].iloc[0]
    assert per_execution == pytest.approx(expected)


def test_tensorflow_profile_without_xla_gives_a_framework_report():
    a = analyze(third_party("xprof_v100_tf2/bert_8xv100.xplane.pb"))
    assert a.summary.chip_id == "v100"
    assert any("no XLA ops" in n and "no HLO roofline" in n for n in a.summary.notes)
    assert a.layers["layer"].str.startswith("bert_span_labeler").any()
    assert set(a.layers["phase"]) >= {"forward", "backward"}
    assert a.ops["expected_s"].isna().all() and len(a.top_ops)
    # the step time is the devices' own Steps lines (each numbers its steps), read here from the file itself
    xs = read_xspace(third_party("xprof_v100_tf2/bert_8xv100.xplane.pb"))
    spans_s = [d * 1e-12 for p in xs.planes if p.name.startswith("/device:") for line in p.lines
               if line.name == "Steps" for d in p.events(lines=[line])["duration_ps"]]
    assert a.summary.step_time_mean_s == pytest.approx(sum(spans_s) / len(spans_s), rel=1e-9)


# -- XProf exports of a real TPU v5 training run -------------------------------------------------------------

def _datatable(name):
    d = json.load(gzip.open(third_party(f"xprof_tpu_v5_goldens/data_tpu-training_{name}_tpu_training.json.gz")))
    return d


def test_tpu_export_totals_match_xprof_program_row():
    a = analyze(third_party("xprof_tpu_v5_goldens"), depth=4)
    roof = _datatable("roofline_model")[0]
    ids = [c["id"] for c in roof["cols"]]
    program = next(dict(zip(ids, [(c or {}).get("v") for c in r["c"]])) for r in roof["rows"]
                   if r["c"][2]["v"] == "Program")
    total_flops = program["model_flop_rate"] * 1e9 * program["total_time"] * 1e-6
    ops = a.ops[a.ops["counted"]]
    assert ops["flops"].sum() == pytest.approx(total_flops, rel=1e-6)
    # step time: the full steps of the overview page (its tooltips)
    overview = _datatable("overview_page")[1]
    times = [float(re.search(r"Step time = ([\d.]+) ms", r["c"][8]["v"]).group(1)) for r in overview["rows"]]
    full = [t for t in times if t > 0.5 * max(times)]
    assert a.summary.step_time_mean_s == pytest.approx(sum(full) / len(full) * 1e-3)
    assert a.summary.chip_id == "tpu_v5p" and a.summary.devices == 8
    assert a.summary.peak_flops_per_s["bf16"] == pytest.approx(4.59e14 / 2)


def test_tpu_export_layers_make_sense():
    a = analyze(third_party("xprof_tpu_v5_goldens"), depth=4)
    got = set(zip(a.layers["layer"], a.layers["phase"]))
    for part in ("mlp", "self_attention"):
        for phase in ("forward", "backward", "remat"):
            assert (f"Transformer/decoder/layers/{part}", phase) in got
    mlp_bwd = a.layers.set_index(["layer", "phase"]).loc[("Transformer/decoder/layers/mlp", "backward")]
    assert mlp_bwd["flops_per_step"] > 1e12 and mlp_bwd["bound"] == "compute"
    codes = {f.code: f for f in a.findings}
    assert "tile padding" in codes["tile-padding"].title and "retiling" in codes["layout-copy"].title


def test_tpu_export_csv_equals_json(tmp_path):
    import csv

    d = _datatable("hlo_stats")
    labels = {c["id"]: c["label"] for c in d["cols"]}
    f = tmp_path / "hlo_stats.csv"
    with f.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow([labels[c["id"]] for c in d["cols"]])
        for r in d["rows"]:
            w.writerow([(c or {}).get("v", "") for c in r["c"]])
    a = analyze(f, chip="tpu_v5p")
    b = analyze(third_party("xprof_tpu_v5_goldens/data_tpu-training_hlo_stats_tpu_training.json.gz"), chip="tpu_v5p")
    assert a.ops["flops"].sum() == pytest.approx(b.ops["flops"].sum())
    assert a.ops["measured_s"].sum() == pytest.approx(b.ops["measured_s"].sum())


def test_transformer_engine_fused_attention_flops():
    a = analyze(third_party("tracelens_gfx95x/te_fused_attn.xplane.pb"))
    assert a.summary.chip_id == "mi355x"
    fa = a.ops[a.ops["opcode"] == "custom-call"]
    fa = fa[fa["hlo_op"].astype(str).str.startswith("te_fused_attn")]
    assert len(fa) and not fa["opaque"].any()
    # B=2, H=16, Sq=Skv=2048, Dqk=Dv=128 (the op's backend_config), causal mask: half the score matrix
    fwd = 2 * 2 * 16 * 2048 * 2048 * (128 + 128) / 2
    per_exec = (fa["flops"] / fa["executions"]).groupby(fa["hlo_op"].astype(str)).first()
    for name, flops in per_exec.items():
        assert flops == pytest.approx(fwd * (2.5 if "backward" in name else 1.0)), name
    runs = a.top_ops.set_index("hlo_op")["executions_per_step"]
    assert all(runs[n] == 5 for n in per_exec.index if n in runs.index)  # helper kernels run twice: not counted


def test_tpu_op_profile_export_agrees_with_hlo_stats():
    stats = analyze(third_party("xprof_tpu_v5_goldens"), depth=4)
    tree = analyze(third_party("xprof_tpu_v5_goldens/data_tpu-training_op_profile_tpu_training.json.gz"), depth=4)
    assert tree.summary.flops_per_step == pytest.approx(stats.summary.flops_per_step, rel=1e-9)
    assert tree.summary.op_time_per_step_s == pytest.approx(stats.summary.op_time_per_step_s, rel=1e-9)
    a = tree.layers.set_index(["layer", "phase"])["time_per_step_s"]
    b = stats.layers.set_index(["layer", "phase"])["time_per_step_s"]
    assert a.sort_index().round(12).equals(b.sort_index().round(12))


def test_tpu_export_collectives_get_an_ici_expectation():
    a = analyze(third_party("xprof_tpu_v5_goldens"), depth=4)
    t = a.collectives
    assert set(t["kind"]) >= {"all-gather", "all-reduce", "all-to-all", "reduce-scatter"}
    ag = t[(t["kind"] == "all-gather") & (t["bytes_out"] == 8388608)].iloc[0]
    assert ag["group_size"] == 4 and ag["link"].startswith("ICI")
    # 4 v5p chips as 1 x 2 x 2 without wraparound: V (N-1)/N / (W_one-way x 2 axes), per execution
    v = 8388608
    per_exec = ag["expected_per_step_s"] / ag["executions_per_step"]
    assert per_exec == pytest.approx(max(v * 3 / 4 / (9e10 * 2), 2e-6))


@pytest.mark.parametrize("rel", AMD[:4])
def test_gpu_kernels_get_their_launch_by_correlation_id(rel):
    """Each kernel's launch is the host API event with its correlation_id, read here from the raw protobuf."""
    from traceroof.discovery import discover
    from traceroof.profile import load_profile

    path = third_party(rel)
    events = load_profile(discover([path])).events()
    xs = parse_full(path)
    api = {}
    for plane in xs.planes:
        if plane.name != "/host:CPU":
            continue
        names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for ev in line.events:
                for st in ev.stats:
                    if names.get(st.metadata_id) == "correlation_id":
                        api.setdefault(st.int64_value or st.uint64_value, line.timestamp_ns * 1000 + ev.offset_ps)
    assert api and events["launch_ps"].notna().all()
    assert (events["start_ps"] >= events["launch_ps"]).all()  # a kernel starts after its launch
    assert set(events["launch_ps"].astype("int64")) <= set(api.values())


def test_unattributed_kernels_are_counted_by_event_not_by_op_row():
    """Op rows aggregate events (one row per kernel and step): the note counts the 12 helper-copy kernel events,
    and no attributed event is reported as lacking HLO."""
    a = analyze(third_party("tracelens_mi300x/jax08_gemm.xplane.pb"))
    notes = " | ".join(a.summary.notes)
    assert "12 kernel events (1.7% of kernel time) carry no hlo_op" in notes
    assert "have no HLO" not in notes
    assert int(a.ops["events"].sum()) == a.summary.join.events_total
