"""The benchmark's replicating tool makes a valid, bigger profile that analyzes like the original."""

from __future__ import annotations

import importlib.util

import pytest

from parsers.xspace import read_xspace
from traceroof import analyze
from tests.conftest import FIXTURES, HOST_CHIP, ROOT, fixture_xplane


def test_replicated_profile_is_valid_and_joins(tmp_path):
    spec = importlib.util.spec_from_file_location("replicate", ROOT / "benchmarks" / "replicate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "plugins" / "profile" / "run" / "host.xplane.pb"
    src = fixture_xplane("scan_mlp")
    per_copy = sum(l.event_count for l in read_xspace(src).plane("/host:CPU").lines if l.name != "python")
    written, copies = mod.replicate(src, out, 3 * per_copy)
    assert copies == 3 and written == 3 * per_copy
    a = analyze(tmp_path, hlo=[FIXTURES / "scan_mlp" / "hlo"], chip=HOST_CHIP, warmup_steps=0)
    base = analyze(FIXTURES / "scan_mlp", chip=HOST_CHIP, warmup_steps=0)
    assert a.summary.steps_total == 3 * base.summary.steps_total
    assert a.summary.join.events_total == 3 * base.summary.join.events_total
    assert a.summary.flops_per_step == pytest.approx(base.summary.flops_per_step)
