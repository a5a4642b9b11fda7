"""Scope paths, phases and the rollup arithmetic."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from traceroof import analyze
from traceroof.layers import NO_SCOPE, TOP_LEVEL, layer_of, parse_scope, rollup
from tests.conftest import FIXTURES, HOST_CHIP, ROOT


@pytest.mark.parametrize("op_name, scope, phase", [
    ("jit(sgd)/jvp(layer_0)/mlp/btd,df->btf/dot_general", "layer_0/mlp", "forward"),
    ("jit(sgd)/transpose(jvp(layer_0))/mlp/btd,df->btf/dot_general", "layer_0/mlp", "backward"),
    ("jit(sgd)/optimizer/sub", "optimizer", "optimizer"),
    ("jit(train_step)/jit(main)/transpose(jvp(Transformer))/decoder/while/body/dynamic_update_slice",
     "Transformer/decoder", "backward"),
    ("jit(f)/jvp(layers)/while/body/closed_call/block/tanh", "layers/block", "forward"),
    ("jit(f)/jvp()/reduce_sum", TOP_LEVEL, "forward"),
    ("jit(sgd)/transpose(jvp())/mul;jit(sgd)/transpose(jvp())/broadcast_in_dim", TOP_LEVEL, "backward"),
    ("broadcast.11", NO_SCOPE, "forward"),
    ("", NO_SCOPE, "forward"),
    ("jit(f)/model/checkpoint/rematted_computation/attn/dot_general", "model/attn", "forward"),
])
def test_parse_scope(op_name, scope, phase):
    assert parse_scope(op_name) == (scope, phase)


def test_layer_depth():
    assert layer_of("layer_0/mlp/dense", 1) == "layer_0"
    assert layer_of("layer_0/mlp/dense", 2) == "layer_0/mlp"
    assert layer_of("layer_0", 3) == "layer_0"
    assert layer_of(NO_SCOPE, 2) == NO_SCOPE


def test_rollup_arithmetic():
    ops = pd.DataFrame({
        "layer": ["a", "a", "a", "b"], "phase": ["forward"] * 4, "hlo_op": ["x", "y", "x", "z"],
        "device": ["d0"] * 4, "step": pd.array([1, 1, 2, 1], "Int64"), "counted": [True, True, True, True],
        "measured_s": [2.0, 1.0, 2.0, 4.0], "expected_s": [1.0, 1.0, 1.0, np.nan],
        "flops": [10.0, 0.0, 10.0, 0.0], "hbm_bytes": [0.0, 8.0, 0.0, 4.0],
        "bound": ["compute", "memory", "compute", "opaque"], "lost_s": [1.0, 0.0, 1.0, np.nan],
        "opaque": [False, False, False, True],
    })
    r = rollup(ops, per_step_divisor=2, step_time_s=5.0).set_index("layer")
    assert r.loc["a", "time_per_step_s"] == 2.5
    assert r.loc["a", "share_of_step"] == 0.5
    assert r.loc["a", "flops_per_step"] == 10.0
    assert r.loc["a", "expected_per_step_s"] == 1.5
    assert r.loc["a", "efficiency"] == pytest.approx(1.5 / 2.5)
    assert r.loc["a", "bound"] == "compute" and r.loc["a", "worst_op"] == "x"
    assert r.loc["a", "lost_per_step_s"] == 1.0
    assert r.loc["b", "bound"] == "opaque" and np.isnan(r.loc["b", "efficiency"])
    assert list(r.index) == ["a", "b"]


def test_a_module_named_body_keeps_its_name():
    # only the loop parts right after `while` are structural (JAX's while/body, while/cond)
    assert parse_scope("jit(f)/jvp(Net)/body/Conv_0/conv_general_dilated")[0] == "Net/body/Conv_0"
    assert parse_scope("jit(f)/jvp(Net)/while/body/layers/Dense_0/dot_general")[0] == "Net/layers/Dense_0"


def test_shard_map_is_no_scope():
    """JAX writes ``shard_map`` into the op names of a shard_map body: it took one of the default depth's two units
    (a s35 trial's MoE read ``shard_map/layer0`` instead of ``layer0/attn``), and where it was the only scope it
    named every op (a s36 trial's GNN under shard_map had three layers, ``shard_map`` backward and forward and the
    optimizer, where the same model under jit had its message-passing layers from the stack frames). It is no
    scope. The pipeline fixture's layers are the generator's own named scopes."""
    assert parse_scope("jit(step)/shard_map/jvp(layer0)/attn/dot_general")[0] == "layer0/attn"
    assert parse_scope("jit(step)/shard_map/transpose(jvp(vmap()))/while/body/closed_call/dot_general") == \
        (TOP_LEVEL, "backward")  # as under jit alone: the stack frames name it (scopes.py)
    a = analyze(FIXTURES / "par_pp2", chip=HOST_CHIP)
    source = (ROOT / "fixtures" / "generate_parallel.py").read_text()
    layers = set(a.layers["layer"].astype(str))
    assert {"stage_block", "send_activations"} <= layers and not any(x.startswith("shard_map/") for x in layers)
    assert all(f'named_scope("{x}")' in source for x in ("stage_block", "send_activations"))


def test_a_checkpointed_loop_re_linearized_in_its_backward_is_remat():
    """Equinox's checkpointed while loop (diffrax's default adjoint) linearizes its body again inside the
    backward (``transpose(jvp(checkpointed-bwd))/while/body/jvp(MLP)/...``): forward work recomputed there, not
    the backward; s38 trial (a diffrax Neural ODE) counted it as model FLOPs, MFU twice XLA's analytic figure.
    The gradient of a real loop compiled here: each of the MLP's 3 matmuls runs once forward, once recomputed and
    twice backward (input and weight gradients)."""
    jax = pytest.importorskip("jax")
    eqx = pytest.importorskip("equinox")
    from equinox.internal import while_loop

    from parsers.hlo_text import parse_hlo_text

    mlp = eqx.nn.MLP(4, 4, 32, 2, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(mlp, eqx.is_array)

    def loss(p, y):
        model = eqx.combine(p, static)
        body = lambda c: (c[0] + 1, c[1] + 0.1 * jax.vmap(model)(c[1]))  # noqa: E731
        _, y = while_loop(lambda c: c[0] < 8, body, (0, y), max_steps=8, kind="checkpointed", checkpoints=2)
        return (y ** 2).sum()

    text = jax.jit(jax.grad(loss)).lower(params, jax.numpy.ones((16, 4))).compile().as_text()
    (module,) = parse_hlo_text(text)
    phases = [parse_scope(i.metadata.op_name)[1] for c in module.computations.values() for i in c.instructions
              if i.opcode == "dot"]
    assert sorted(phases) == ["backward"] * 6 + ["forward"] * 3 + ["remat"] * 3
    assert parse_scope("jit(f)/transpose(jvp(Net))/Dense_0/dot_general")[1] == "backward"  # no jvp inside: as it was
    # a jax.checkpoint-ed scope's backward repeats its scope: the backward, not a recompute (test_numbers' MFU)
    assert parse_scope("jit(loss)/transpose(jvp(layer_0))/jvp(layer_0)/checkpoint/mlp/dot_general")[1] == "backward"
