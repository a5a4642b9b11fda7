"""The real-framework fixtures (fixtures/fw_*, made by fixtures/generate_frameworks.py) are complete and their
facts.json agrees with the files: the train step's program ids name dump files, and every profile holds XLA op
events of the train step. (Checks the fixtures, not the analyzer.)"""

from __future__ import annotations

import json

import pytest

from parsers.xspace import read_xspace
from tests.conftest import FIXTURES

FW = ["flax_cnn", "nnx_transformer", "equinox_transformer", "gpt2", "keras_cnn", "scan_remat"]


def _facts(name: str) -> dict:
    return json.loads((FIXTURES / f"fw_{name}" / "facts.json").read_text())


@pytest.mark.parametrize("name", FW)
def test_dump_files_match_facts(name: str) -> None:
    f = _facts(name)
    hlo = FIXTURES / f"fw_{name}" / "hlo"
    assert f["train_step_program_ids"]
    for pid in f["train_step_program_ids"]:
        stem = f"module_{pid:04d}.{f['train_step_module_name']}"
        assert (hlo / f"{stem}.cpu_after_optimizations.txt").is_file()
        assert (hlo / f"{stem}.before_optimizations.txt").is_file()
        assert (hlo / f"{stem}.cpu_after_optimizations-buffer-assignment.txt").is_file()
    assert not list(hlo.rglob("*.o")) and not list(hlo.rglob("*.ll"))
    assert f["xla_cost_analysis"]["flops"] > 0


@pytest.mark.parametrize("name", FW)
def test_profiles_hold_train_step_ops(name: str) -> None:
    f = _facts(name)
    train = f["train_step_module_name"]
    for variant, steps in f["steps_recorded"].items():
        xplanes = list((FIXTURES / f"fw_{name}" / variant / "logdir" / "plugins" / "profile").glob("*/*.xplane.pb"))
        assert len(xplanes) == 1, variant
        xs = read_xspace(xplanes[0])
        ev = xs.plane("/host:CPU").events(stats=["hlo_module", "program_id", "step_num"])
        ops = ev[ev["hlo_module"].astype(str) == train]
        assert len(ops) > 0, variant
        assert set(ops["program_id"].astype(int)) <= set(f["train_step_program_ids"])
        counts = f["modules_with_op_events"][variant]
        assert sum(n for k, n in counts.items() if k.startswith(train + "(")) == len(ops)
        if not (name == "keras_cnn" and variant == "readme"):  # Keras's fit writes no step annotation
            assert ev["step_num"].notna().sum() == steps, variant
        meta = {m.name for m in xs.plane("/host:metadata").event_metadata.values()}
        assert {f"{train}({p})" for p in f["train_step_program_ids"]} <= meta
