"""The real-framework corpus (fixtures/fw_*: Flax linen, Flax NNX, Equinox, transformers' Flax GPT-2, Keras 3 on
JAX, nn.scan + nn.remat), each profiled the README's way (non-blocking, compiling inside the first step) and
blocking, with the dump folder as XLA writes it. Figures are checked against XLA's own cost_analysis() in each
fixture's facts.json and against the blocking profile of the same job."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from traceroof import analyze
from traceroof.analysis import Analysis

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HOST_CHIP = str(FIXTURES / "fixture_host.toml")
# layers a reader expects to see, named after the model's own modules (fixtures/generate_frameworks.py)
LAYERS = {
    "fw_flax_cnn": {"Conv_0", "Conv_1", "Dense_0"},
    "fw_nnx_transformer": {"Block_*/MLP", "Block_*/Attention"},
    "fw_equinox_transformer": {"Block_*/MLP", "Block_*/MultiheadAttention"},
    "fw_gpt2": {"transformer/h/*/attn", "transformer/h/*/mlp", "lm_head"},
    "fw_keras_cnn": {"conv_1", "conv_2", "dense"},
    "fw_scan_remat": {"layers/Dense_0", "layers/Dense_1"},
}
NAMES = sorted(LAYERS)


@lru_cache(maxsize=None)
def run(name: str, variant: str) -> Analysis:
    return analyze(FIXTURES / name / variant / "logdir", hlo=[FIXTURES / name / "hlo"], chip=HOST_CHIP)


def facts(name: str) -> dict:
    return json.loads((FIXTURES / name / "facts.json").read_text())


def train_flops_per_step(a: Analysis) -> float:
    ops = a.ops[a.ops["counted"] & a.ops["step"].notna() & (a.ops["module"].astype(str) == "jit_train_step")]
    return float(ops["flops"].sum()) / len(a.summary.steps_used)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("variant", ["readme", "blocking"])
def test_every_op_joins_and_steps_are_found(name, variant):
    s = run(name, variant).summary
    assert s.join.events_joined == s.join.events_total > 100
    assert len(s.steps_used) >= 3 and s.flops_per_step > 0


@pytest.mark.parametrize("name", NAMES)
def test_readme_loop_flops_equal_blocking_and_xla(name):
    readme, blocking = run(name, "readme"), run(name, "blocking")
    assert train_flops_per_step(readme) == pytest.approx(train_flops_per_step(blocking), rel=0.01)
    xla = facts(name)["xla_cost_analysis"]["flops"]
    if name == "fw_scan_remat":  # XLA counts each while body once; traceroof x trip count (4 layers)
        assert train_flops_per_step(readme) > 3 * xla
    else:
        assert train_flops_per_step(readme) == pytest.approx(xla, rel=0.01)


@pytest.mark.parametrize("name", NAMES)
def test_scopes_phases_and_layers(name):
    a = run(name, "readme")
    counted = a.ops[a.ops["counted"] & a.ops["step"].notna()]
    total = counted["measured_s"].sum()
    no_scope = counted.loc[counted["scope"].astype(str) == "(no scope)", "measured_s"].sum()
    assert no_scope < 0.05 * total
    assert set(counted["phase"].astype(str)) >= {"forward", "backward", "optimizer"}
    layers = set(a.layers["layer"].astype(str))
    assert LAYERS[name] <= layers, sorted(layers)
    assert not any(layer.startswith(("jit(", "gradient_tape")) for layer in layers)


def test_remat_is_its_own_phase():
    a = run("fw_scan_remat", "readme")
    remat = a.layers[a.layers["phase"] == "remat"]
    assert len(remat) and remat["flops_per_step"].sum() > 0
    assert a.summary.hfu > a.summary.mfu  # MFU leaves the recomputed forward out


def test_model_flops_leave_out_the_optimizer_update():
    """MFU's model FLOPs are the model's matmul work (6·N·T + attention): the adam update is executed (HFU) but left
    out. Its FLOPs are checked against XLA's cost_analysis of optax.adam's update on as many parameters as the
    model has (fixtures/generate_frameworks.py: embed and head Dense(D) on D inputs, 4 blocks of LayerNorm,
    Dense(F), Dense(D)); the model FLOPs against a hand count of the matmuls: 3 x the forward's, less the first
    layer's input gradient (the data needs none). Before, they were every executed FLOP less remat and optimizer
    (LayerNorm, GELU, adds: 4 % more here, 7 % in a user's ViT)."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    a = run("fw_scan_remat", "readme")
    layers = a.layers.groupby("phase", observed=True)["flops_per_step"].sum()
    cfg = facts("fw_scan_remat")["config"]
    D, F, L = cfg["d_model"], cfg["d_ff"], cfg["layers"]
    params = jax.numpy.zeros(2 * (D * D + D) + L * (2 * D + D * F + F + F * D + D))
    tx = optax.adam(cfg["lr"])

    def update(g, state, p):
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state

    xla_adam_flops = jax.jit(update).lower(params, tx.init(params), params).compile().cost_analysis()["flops"]
    assert layers["optimizer"] == pytest.approx(xla_adam_flops, rel=1e-3)
    s = a.summary
    tokens = cfg["batch"] * cfg["seq"]
    forward = 2 * tokens * (2 * D * D + L * 2 * D * F)
    assert s.model_flops_per_step == 3 * forward - 2 * tokens * D * D == 211_812_352
    assert "rematerialised forward" in s.model_flops_source and s.hfu > s.mfu


def test_profile_stopped_mid_step_drops_the_partial_step():
    a = analyze(FIXTURES / "fw_flax_cnn" / "midstep" / "logdir", hlo=[FIXTURES / "fw_flax_cnn" / "hlo"],
                chip=HOST_CHIP)
    s = a.summary
    assert s.steps_total == 5  # the sixth annotation never closed
    # its execution, cut off by the stop (fewer ops than the others), is in no step, and a note says so
    assert any("were still running when the trace stopped" in n and "left out of per-step figures" in n
               for n in s.notes), s.notes
    assert train_flops_per_step(a) == pytest.approx(facts("fw_flax_cnn")["xla_cost_analysis"]["flops"], rel=0.01)


def test_no_efficiency_above_100_percent_without_a_note():
    for name in NAMES:
        a = run(name, "readme")
        over = a.top_ops[a.top_ops["efficiency"] > 1.0]
        if len(over):
            assert any(f.code == "faster-than-roofline" for f in a.findings), name
