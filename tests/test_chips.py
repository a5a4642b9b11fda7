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


def test_empty_or_relative_xdg_dirs_fall_back_to_home(monkeypatch, tmp_path):
    from traceroof.chips import _user_dirs, host_cache_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for value in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", value)
        monkeypatch.setenv("XDG_CONFIG_HOME", value)
        assert host_cache_path() == tmp_path / "home" / ".cache" / "traceroof" / "host.toml"
        assert _user_dirs() == [tmp_path / "home" / ".config" / "traceroof" / "chips"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert host_cache_path() == tmp_path / "xdg" / "traceroof" / "host.toml"


def test_host_chip_with_empty_xdg_cache_never_writes_the_working_directory(monkeypatch, tmp_path):
    import traceroof.chips as chips

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    cal = Calibration({"f32": 1e11}, 2e10, 1e10, "Test CPU", 2, "2026-01-02T03:04:05Z", "numpy")
    monkeypatch.setattr(chips, "calibrate", lambda: cal)
    chip = chips.host_chip()
    assert list(work.iterdir()) == []
    assert (tmp_path / "home" / ".cache" / "traceroof" / "host.toml").is_file()
    assert chip.calibrated_at == "2026-01-02T03:04:05Z"


def test_calibration_takes_the_best_of_several_runs_and_dates_the_file(monkeypatch, tmp_path):
    import traceroof.chips as chips

    busy = iter([0.02, 0.03])
    monkeypatch.setattr(chips, "cpu_busy_share", lambda window_s=0.0: next(busy))
    # other work while measuring: as sampled (a test run beside another process must not read "loaded")
    monkeypatch.setattr(chips, "OtherWork", lambda: type("Quiet", (), {"share": lambda self: 0.04})())
    cal = chips.calibrate(seconds_per_test=1e-4, matmul_n=32, copy_bytes=1 << 16)
    assert set(cal.runs_per_figure) == {*cal.matmul_flops_per_s, "vector_f32", "memory"}
    assert min(cal.runs_per_figure.values()) >= chips.CALIBRATION_MIN_RUNS == 3
    assert cal.busy_share_before == 0.02 and cal.busy_share_after == 0.03 and cal.busy_share_during == 0.04
    assert cal.load_note == ""
    assert all(v > 0 for v in (*cal.matmul_flops_per_s.values(), cal.vector_flops_per_s,
                               cal.memory_bandwidth_bytes_per_s))
    f = tmp_path / "host.toml"
    f.write_text(calibration_toml(cal))
    chip = load_chip_file(f)
    assert chip.calibrated_at == cal.measured_at and chip.load_note == "" and "loaded" not in chip.note
    assert f"best of {cal.runs_per_figure['memory']} runs" in chip.figure("memory.hbm_bandwidth_bytes_per_s").source


def test_a_loaded_machine_is_named_in_the_chip_note(monkeypatch, tmp_path):
    import traceroof.chips as chips

    note = chips.load_note(0.6, 0.1)
    assert "loaded while calibrating (60% of CPU busy with other work before, 10% after" in note
    assert chips.load_note(0.05, 0.1) == "" and chips.load_note(float("nan"), float("nan")) == ""
    cal = Calibration({"f32": 1e11}, 2e10, 1e10, 'CPU "quoted"', 2, "2026-01-02T03:04:05Z", "numpy",
                      {"f32": 3}, 0.6, 0.1, note)
    f = tmp_path / "host.toml"
    f.write_text(calibration_toml(cal))
    chip = load_chip_file(f)
    assert chip.load_note == note and note in chip.note and 'CPU "quoted"' in chip.note
    # a CPU profile judged against the cached calibration (kept: the machine is still loaded) carries the
    # warning and the date into its report
    monkeypatch.setattr(chips, "host_cache_path", lambda: f)
    monkeypatch.setattr(chips, "cpu_busy_share", lambda window_s=0.0: 0.6)
    import traceroof.analysis as analysis
    from traceroof import analyze
    from traceroof.report import render

    monkeypatch.setattr(analysis, "host_cache_path", lambda: f)
    a = analyze("fixtures/scan_mlp")
    assert note in a.summary.chip_note and a.summary.chip_calibrated_at == "2026-01-02T03:04:05Z"
    chip_line = next(line for line in render(a, "terminal").splitlines() if line.startswith("chip "))
    assert chip_line.endswith("; calibrated 2026-01-02T03:04:05Z")


def test_work_that_runs_only_while_calibrating_is_named(monkeypatch):
    """Other processes busy while the figures are measured load the calibration even when the samples before
    and after see an idle machine (s36 trial: a cached f32 figure a third low, no warning); the calibration's
    own threads are not other work."""
    import os
    import subprocess
    import sys
    import traceroof.chips as chips

    import time

    small = dict(seconds_per_test=0.3, matmul_n=256, copy_bytes=1 << 24)
    before = chips.OtherWork()
    time.sleep(0.5)
    if before.share() > 0.2:  # (the quiet half needs a quiet machine; the loaded half below makes its own load)
        pytest.skip(f"other processes use {before.share():.0%} of the CPU: no quiet calibration to compare")
    monkeypatch.setattr(chips, "cpu_busy_share", lambda window_s=0.0: 0.0)  # before and after: idle
    quiet = chips.calibrate(**small)
    assert quiet.busy_share_during < 0.5  # own XLA threads on every core: ~1.0 if they counted
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(len(os.sched_getaffinity(0)))]
    try:
        loaded = chips.calibrate(**small)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert loaded.busy_share_during > chips.LOADED_BUSY_SHARE
    assert "loaded while calibrating (0% of CPU busy with other work before, " in loaded.load_note
    assert f"{loaded.busy_share_during:.0%} while measuring, 0% after" in loaded.load_note


def test_a_loaded_cached_calibration_is_measured_again_on_an_idle_machine(monkeypatch, tmp_path):
    import traceroof.chips as chips

    cache = tmp_path / "host.toml"
    loaded = Calibration({"f32": 1.49e11}, 2e10, 1e10, "Test CPU", 2, "2026-01-02T03:04:05Z", "numpy", {}, 0.0,
                         0.0, chips.load_note(0.0, 0.0, 0.4), 0.4)
    fresh = Calibration({"f32": 2.22e11}, 2e10, 1e10, "Test CPU", 2, "2026-01-03T03:04:05Z", "numpy")
    cache.write_text(calibration_toml(loaded))
    monkeypatch.setattr(chips, "host_cache_path", lambda: cache)
    measured = []
    monkeypatch.setattr(chips, "calibrate", lambda: measured.append(1) or fresh)
    monkeypatch.setattr(chips, "cpu_busy_share", lambda window_s=0.0: 0.6)  # still busy: kept, with its note
    assert chips.host_chip().load_note and not measured
    monkeypatch.setattr(chips, "cpu_busy_share", lambda window_s=0.0: 0.02)  # idle now: measured again
    chip = chips.host_chip()
    assert measured and chip.load_note == "" and chip.calibrated_at == "2026-01-03T03:04:05Z"
    assert chip.value("peak_flops_per_s.f32") == 2.22e11 and load_chip_file(cache).calibrated_at == chip.calibrated_at
    measured.clear()
    assert chips.host_chip().calibrated_at == chip.calibrated_at and not measured  # an idle one is kept


def test_cpu_busy_share_measures_the_whole_machine():
    from traceroof.chips import cpu_busy_share

    share = cpu_busy_share(0.05)
    assert 0.0 <= share <= 1.0


def test_calibrate_names_figures_that_moved_since_the_previous_calibration(monkeypatch, tmp_path):
    import traceroof.chips as chips
    from click.testing import CliRunner

    from traceroof.cli import main

    out = tmp_path / "me.toml"
    measured = [Calibration({"f32": 95.2e9}, 2e10, 1e10, "Test CPU", 2, "2026-01-02T03:04:05Z", "numpy"),
                Calibration({"f32": 199.9e9}, 2.1e10, 1e10, "Test CPU", 2, "2026-01-03T03:04:05Z", "numpy"),
                Calibration({"f32": 210e9}, 2.2e10, 0.9e10, "Test CPU", 2, "2026-01-04T03:04:05Z", "numpy")]
    monkeypatch.setattr(chips, "calibrate", lambda: measured.pop(0))
    first = CliRunner().invoke(main, ["calibrate", "-o", str(out)])
    assert first.exit_code == 0 and "note" not in first.output  # nothing to compare with
    second = CliRunner().invoke(main, ["calibrate", "-o", str(out)])
    assert second.exit_code == 0
    notes = [line for line in second.output.splitlines() if line.startswith("traceroof: note: ")]
    assert len(notes) == 1 and notes[0].startswith("traceroof: note: f32: 199.9 GFLOP/s now, 2.10x the 95.2 GFLOP/s "
                                                   "of the previous calibration (2026-01-02T03:04:05Z)")
    assert "--chip FILE" in notes[0] and load_chip_file(out).calibrated_at == "2026-01-03T03:04:05Z"
    third = CliRunner().invoke(main, ["calibrate", "-o", str(out)])  # every figure within 25 %: no note
    assert third.exit_code == 0 and "note" not in third.output
