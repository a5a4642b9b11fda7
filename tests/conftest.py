"""Shared fixtures: paths to the project's own fixtures and to the optional third-party data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
THIRD_PARTY = ROOT.parent / "shared" / "fixtures" / "third_party"
HOST_CHIP = str(FIXTURES / "fixture_host.toml")


def fixture_xplane(name: str) -> Path:
    return next((FIXTURES / name / "logdir").rglob("*.xplane.pb"))


def fixture_trace_json(name: str) -> Path:
    return next((FIXTURES / name / "logdir").rglob("*.trace.json.gz"))


def facts(name: str) -> dict:
    return json.loads((FIXTURES / name / "facts.json").read_text())


def third_party(rel: str) -> Path:
    """A file of ../shared/fixtures/third_party, or skip the test when that data is absent."""
    p = THIRD_PARTY / rel
    if not p.exists():
        pytest.skip(f"third-party data {rel} not present (../shared/fixtures/third_party is optional)")
    return p


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep tests away from the user's chip dir and host calibration cache."""
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(base / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(base / "cache"))
    monkeypatch.delenv("TRACEROOF_CHIPS_DIR", raising=False)
    monkeypatch.chdir(ROOT)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def compiled_scopes(compiled_text: str):
    """(module, scopes) of a compiled JAX program's HLO text (``jax.jit(f).lower(...).compile().as_text()``)."""
    from parsers.hlo_text import parse_hlo_text
    from traceroof.scopes import assign_scopes

    m = parse_hlo_text(compiled_text)[0]
    return m, assign_scopes(m)


def executed_ops(m):
    """(computation, instruction) of the ops that run as their own events (not inside fusions)."""
    fused = {c for comp in m.computations.values() for i in comp.instructions if i.opcode == "fusion"
             for c in i.called}
    return [(comp, i) for comp in m.computations.values() if comp.name not in fused for i in comp.instructions
            if i.opcode not in ("parameter", "constant")]
