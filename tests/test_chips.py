"""Chip database: every figure sourced, lookups, user chips, calibration file format."""

from __future__ import annotations

import pytest

from traceroof.chips import BUNDLED_DIR, Calibration, ChipError, all_chips, calibration_toml, get_chip, load_chip_file

REQUIRED = {"tpu_v2", "tpu_v3", "tpu_v4", "tpu_v5e", "tpu_v5p", "tpu_v6e", "tpu_v7", "v100", "a100", "h100",
            "h200", "b200", "gb200", "mi300x", "mi325x", "mi355x"}


def test_all_required_chips_present_with_a_source_for_every_figure():
    chips = {c.id: c for c in all_chips()}
    assert REQUIRED <= set(chips)
    for c in chips.values():
        assert c.peak_flops_per_s, c.id
        assert c.hbm_bandwidth_bytes_per_s, c.id
        for key, fig in c.figures.items():
            assert fig.source.strip(), f"{c.id}: {key} has no source"


def test_units_are_in_every_figure_name():
    units = ("_per_s", "_bytes", "_count", "_per_chip", "_per_gpu", "_per_node", "topology")
    for c in all_chips():
        for key in c.figures:
            name = key.split(".", 1)[1]
            assert key.startswith("peak_flops_per_s.") or name.endswith(units), f"{c.id}: {key}"


def test_figures_are_consistent_with_the_reference_tables():
    # spot checks against docs/reference/hardware-and-rooflines.md (How to Scale Your Model §2, §12)
    assert get_chip("v5e").peak_flops_per_s["bf16"] == 1.97e14
    assert get_chip("H100").peak_flops_per_s["bf16"] == pytest.approx(9.89e14)
    assert get_chip("h200").hbm_bandwidth_bytes_per_s == 4.8e12
    assert get_chip("TPU v6 Lite").id == "tpu_v6e"
    assert get_chip("MI300X").value("memory.hbm_bytes") == 192e9
    ridge = get_chip("v5e").peak_flops_per_s["bf16"] / get_chip("v5e").hbm_bandwidth_bytes_per_s
    assert 230 < ridge < 250  # critical intensity ~240 FLOP/byte (§1)


def test_peak_for_dtype_and_vector_work():
    h100 = get_chip("h100")
    assert h100.peak_for("bf16") == (9.89e14, "bf16")
    assert h100.peak_for("f32")[1] == "f32"
    assert h100.peak_for("f32", vector=True) == (6.7e13, "vector_f32")
    assert h100.peak_for("f8e4m3fn")[1] == "fp8"
    assert get_chip("v5e").peak_for("f32")[1] == "bf16"  # TPU runs f32 dots as bf16 passes by default


def test_unknown_chip_names_the_closest():
    with pytest.raises(ChipError) as err:
        get_chip("h1000")
    assert "h100" in str(err.value) and "traceroof chips" in str(err.value)


def test_user_chip_file_and_dir(tmp_path, monkeypatch):
    f = tmp_path / "mychip.toml"
    f.write_text('name = "My Chip"\nvendor = "me"\nkind = "gpu"\n[peak_flops_per_s]\n'
                 'bf16 = { value = 1e15, source = "my datasheet" }\n[memory]\n'
                 'hbm_bandwidth_bytes_per_s = { value = 2e12, source = "my datasheet" }\n')
    assert get_chip(str(f)).name == "My Chip"
    monkeypatch.setenv("TRACEROOF_CHIPS_DIR", str(tmp_path))
    assert get_chip("mychip").peak_for("bf16") == (1e15, "bf16")


@pytest.mark.parametrize("text, msg", [("name = ", "not valid TOML"), ("vendor = 'x'", "has no 'name'"),
                                       ("name='x'\n[memory]\nhbm_bytes = { source = 'y' }", "has no 'value'")])
def test_bad_chip_files(tmp_path, text, msg):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ChipError, match=msg):
        load_chip_file(f)


def test_calibration_file_round_trips(tmp_path):
    cal = Calibration({"f32": 1.5e11, "bf16": 1.2e11}, 3e10, 2e10, "Test CPU", 2, "2026-01-01T00:00:00Z", "numpy")
    f = tmp_path / "host.toml"
    f.write_text(calibration_toml(cal))
    chip = load_chip_file(f)
    assert chip.kind == "cpu" and chip.peak_for("f32") == (1.5e11, "f32")
    assert chip.peak_for("f32", vector=True) == (3e10, "vector_f32")
    assert chip.hbm_bandwidth_bytes_per_s == 2e10
    assert all("traceroof calibrate" in fig.source for fig in chip.figures.values())


def test_bundled_dir_is_packaged_data():
    assert len(list(BUNDLED_DIR.glob("*.toml"))) >= 16
