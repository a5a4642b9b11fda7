"""Scopes, phases and layers of real framework programs (flax linen + optax, flax NNX, Equinox, transformers
FlaxGPT2, Keras on JAX, nn.scan + nn.remat), compiled here with jax on CPU; plus the rules on small programs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from collections import Counter

import numpy as np
import pandas as pd
import pytest

from parsers.hlo import HloModule, StackFrame
from parsers.hlo_text import parse_hlo_text
from traceroof.cost import CostModel
from traceroof.layers import NO_SCOPE, TOP_LEVEL, LayerNamer, parse_scope, rollup, worst_op
from traceroof.scopes import (OPTIMIZER_SCOPE, ModuleScopes, ScopeInfo, _Frames, _model_path, _split_instances,
                              assign_scopes)

jax = pytest.importorskip("jax")
jnp = jax.numpy
optax = pytest.importorskip("optax")


def _module(compiled_text: str) -> tuple[HloModule, ModuleScopes]:
    m = parse_hlo_text(compiled_text)[0]
    assert m.stack_frames, "jax 0.10 prints the stack-frame tables"
    return m, assign_scopes(m)


def _weights(m: HloModule, ms: ModuleScopes, key) -> Counter:
    """FLOPs + bytes of the executed instructions (parameters aside: they never run) by ``key(ScopeInfo)``."""
    cm = CostModel(m)
    out: Counter = Counter()
    for _, inst, k in cm.executed_instructions():
        if inst.opcode != "parameter":
            c = cm.cost(inst)
            out[key(ms.get(inst.name))] += (c.flops + c.bytes_accessed) * k
    return out


def _share(m, ms, pred) -> float:
    w = _weights(m, ms, pred)
    return w[True] / (w[True] + w[False])


def _layers(ms: ModuleScopes, depth: int = 2) -> set[str]:
    scopes = Counter(i.scope for i in ms.infos.values())
    namer = LayerNamer.build(scopes, ms.repeats)
    return {namer.layer(s, depth) for s in scopes}


def _optimizer_opcodes(m: HloModule, ms: ModuleScopes) -> set[str]:
    """Opcodes inside the optimizer ops (fusion bodies included)."""
    out = set()
    for inst in m.entry.instructions:
        if ms.get(inst.name).phase == "optimizer":
            out.add(inst.opcode)
            for c in inst.called:
                out |= {i.opcode for i in m.computations[c].instructions}
    return out


def _check_common(m: HloModule, ms: ModuleScopes) -> None:
    assert _share(m, ms, lambda i: i.scope == NO_SCOPE) < 0.05
    phases = set(_weights(m, ms, lambda i: i.phase))
    assert {"forward", "backward", "optimizer"} <= phases
    assert not any(i.scope.startswith("jit(") or "gradient_tape" in i.scope for i in ms.infos.values())


# -- real programs -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def linen_cnn():
    nn = pytest.importorskip("flax.linen")
    from flax.training import train_state

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(8, (3, 3))(x))
            x = nn.relu(nn.Conv(16, (3, 3))(x))
            x = nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1))))
            return nn.Dense(10)(x)

    m = CNN()
    x, y = jnp.ones((4, 8, 8, 3)), jnp.zeros((4,), jnp.int32)
    st = train_state.TrainState.create(apply_fn=m.apply, params=m.init(jax.random.PRNGKey(0), x)["params"],
                                       tx=optax.adam(1e-3))

    def step(st, x, y):
        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(st.apply_fn({"params": p}, x), y).mean()
        l, g = jax.value_and_grad(loss)(st.params)
        return st.apply_gradients(grads=g), l

    return _module(jax.jit(step).lower(st, x, y).compile().as_text())


def test_linen_cnn(linen_cnn):
    m, ms = linen_cnn
    _check_common(m, ms)
    assert {"Conv_0", "Conv_1", "Dense_0", "Dense_1", OPTIMIZER_SCOPE} <= _layers(ms)
    assert {"sqrt", "divide"} <= _optimizer_opcodes(m, ms)  # adam's update
    # the metadata-less layout copies feeding the weight-gradient convolutions join that convolution's layer
    for inst in m.entry.instructions:
        if inst.opcode == "fusion" and not inst.metadata.op_name and "copy" in inst.name:
            assert ms.get(inst.name).how in ("fused", "user") and ms.get(inst.name).scope.startswith("CNN")
    # optax's loss (optax/losses) is the model's, not the optimizer's
    assert all(i.phase != "optimizer" for i in ms.infos.values() if i.in_grad)


@pytest.fixture(scope="module")
def nnx_mlp():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1, self.fc2 = nnx.Linear(64, 64, rngs=rngs), nnx.Linear(64, 4, rngs=rngs)

        def __call__(self, x):
            return self.fc2(nnx.relu(self.fc1(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed, self.head = nnx.Linear(16, 64, rngs=rngs), MLP(rngs)

        def __call__(self, x):
            return self.head(nnx.relu(self.embed(x)))

    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        l, g = nnx.value_and_grad(lambda mdl: ((mdl(x) - y) ** 2).mean())(model)
        opt.update(model, g)
        return l

    return _module(step.lower(model, opt, jnp.ones((8, 16)), jnp.zeros((8, 4))).compile().as_text())


def test_nnx_layers_from_stack_frames(nnx_mlp):
    m, ms = nnx_mlp
    _check_common(m, ms)
    # 65 % before (NNX writes no scopes); what stays at the top level is the loss (a lambda, no model class)
    assert _share(m, ms, lambda i: i.scope == TOP_LEVEL) < 0.05
    # MLP's two Linears are called on one line (fc2(relu(fc1(x)))): two layers by their columns, fc1 first
    assert {"Linear", "MLP", "MLP/Linear_0", "MLP/Linear_1", OPTIMIZER_SCOPE} <= _layers(ms)
    assert {"sqrt", "divide"} <= _optimizer_opcodes(m, ms)


@pytest.fixture(scope="module")
def eqx_blocks():
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        mlp: eqx.nn.MLP
        norm: eqx.nn.LayerNorm

        def __init__(self, key):
            self.mlp, self.norm = eqx.nn.MLP(16, 16, 32, 1, key=key), eqx.nn.LayerNorm(16)

        def __call__(self, x):
            return x + self.mlp(self.norm(x))

    class Model(eqx.Module):
        blocks: list

        def __init__(self, key):
            self.blocks = [Block(k) for k in jax.random.split(key, 2)]

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    model, opt = Model(jax.random.PRNGKey(0)), optax.adam(1e-3)
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state, x, y):
        l, g = eqx.filter_value_and_grad(lambda mdl: ((jax.vmap(mdl)(x) - y) ** 2).mean())(model)
        upd, state = opt.update(g, state, model)
        return eqx.apply_updates(model, upd), state, l

    return _module(step.lower(model, state, jnp.ones((8, 16)), jnp.zeros((8, 16))).compile().compiled.as_text())


def test_equinox_rows_are_the_users_block(eqx_blocks):
    m, ms = eqx_blocks
    _check_common(m, ms)
    layers = _layers(ms)
    assert {"Block", "Block/MLP", "Block/LayerNorm"} <= layers or {"Block_*/MLP", "Block_*/LayerNorm"} <= layers
    assert not any("LayerNorm_" in l for l in layers)  # no lone numbered parts that cannot collapse
    assert not any(l.startswith("eqx.") for l in layers)  # op_name's library class paths are replaced
    assert {"sqrt", "divide"} <= _optimizer_opcodes(m, ms)


@pytest.fixture(scope="module")
def gpt2():
    tf = pytest.importorskip("transformers")
    cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32)
    model = tf.FlaxGPT2LMHeadModel(cfg, seed=0)
    tx = optax.adamw(1e-3)
    ids = jnp.zeros((2, 8), jnp.int32)

    def step(params, st, ids):
        def loss(p):
            logits = model(ids, params=p, train=False).logits
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()
        l, g = jax.value_and_grad(loss)(params)
        u, st = tx.update(g, st, params)
        return optax.apply_updates(params, u), st, l

    return _module(jax.jit(step).lower(model.params, tx.init(model.params), ids).compile().as_text())


def test_gpt2_blocks_collapse_and_show_their_parts(gpt2):
    m, ms = gpt2
    _check_common(m, ms)
    assert set(ms.repeats.values()) == {"FlaxGPT2LMHeadModule/transformer/h/*"}
    layers = _layers(ms)
    assert {"transformer/h/*/attn", "transformer/h/*/mlp", "transformer/wte", "lm_head"} <= layers
    assert not any(l.startswith("transformer/h/0") or "jit(" in l for l in layers)
    namer = LayerNamer.build(Counter(i.scope for i in ms.infos.values()), ms.repeats)
    scope = "FlaxGPT2LMHeadModule/transformer/h/1/attn/c_attn"
    assert namer.layer(scope, 2, expand=True) == "transformer/h/1/attn"
    assert namer.instance(scope, 2) == "transformer/h/1/attn"
    assert namer.layer(scope, 1) == "transformer/h/*"
    assert {"sqrt", "divide"} <= _optimizer_opcodes(m, ms)


@pytest.fixture(scope="module")
def scan_remat():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(16, name="down")(nn.gelu(nn.Dense(32, name="up")(x))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
            x, _ = stack(name="layers")(nn.Dense(16, name="embed")(x), None)
            return nn.Dense(4, name="head")(x)

    m, x, y = Model(), jnp.ones((8, 16)), jnp.zeros((8, 4))
    params = m.init(jax.random.PRNGKey(0), x)["params"]
    tx = optax.sgd(1e-2, momentum=0.9)

    def step(params, st, x, y):
        l, g = jax.value_and_grad(lambda p: ((m.apply({"params": p}, x) - y) ** 2).mean())(params)
        u, st = tx.update(g, st, params)
        return optax.apply_updates(params, u), st, l

    step = jax.jit(step, donate_argnums=(0, 1))  # donated: input_output_alias marks the updates
    return _module(step.lower(params, tx.init(params), x, y).compile().as_text())


def test_scan_remat(scan_remat):
    m, ms = scan_remat
    assert "input_output_alias" in m.attrs
    _check_common(m, ms)
    assert "remat" in set(_weights(m, ms, lambda i: i.phase))
    assert {"layers/up", "layers/down", "embed", "head"} <= _layers(ms)


KERAS_STEP = textwrap.dedent("""
    import os, sys
    os.environ["KERAS_BACKEND"] = "jax"
    import jax, jax.numpy as jnp, keras
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(4)])
    opt = keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)
    mse = keras.losses.MeanSquaredError()
    def step(tv, ntv, ov, x, y):
        def loss(tv):
            pred, ntv2 = model.stateless_call(tv, ntv, x)
            return mse(y, pred), ntv2
        (l, ntv2), g = jax.value_and_grad(loss, has_aux=True)(tv)
        tv, ov = opt.stateless_apply(ov, g, tv)
        return tv, ntv2, ov, l
    args = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
            [v.value for v in opt.variables], jnp.ones((8, 16)), jnp.zeros((8, 4)))
    sys.stdout.write(jax.jit(step).lower(*args).compile().as_text())
""")


@pytest.fixture(scope="module")
def keras_mlp():
    if importlib.util.find_spec("keras") is None:  # not imported here: its backend is chosen at import
        pytest.skip("keras is not installed")
    r = subprocess.run([sys.executable, "-c", KERAS_STEP], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.skip(f"keras on jax did not compile: {r.stderr[-300:]}")
    return _module(r.stdout)


def test_keras(keras_mlp):
    m, ms = keras_mlp
    _check_common(m, ms)
    assert {"dense", "dense_1"} <= _layers(ms)
    assert {"sqrt", "divide"} <= _optimizer_opcodes(m, ms)
    # Keras names its optimizer's scope ``adam``: the row is ``(optimizer)`` as with optax
    assert {i.scope for i in ms.infos.values() if i.phase == "optimizer"} == {OPTIMIZER_SCOPE}


# -- the rules on small programs -------------------------------------------------------------------------
def test_plain_sgd_found_by_dataflow_alone():
    """No optimizer library, no scope: the update params - lr * grad is found from the outputs."""
    def step(w, x):
        g = jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
        return w - 0.1 * g, (x @ w).sum()

    m, ms = _module(jax.jit(step).lower(jnp.ones((8, 8)), jnp.ones((4, 8))).compile().as_text())
    phases = {inst.name: ms.get(inst.name).phase for inst in m.entry.instructions
              if inst.opcode not in ("parameter", "tuple", "constant")}
    assert "optimizer" in phases.values() and "backward" in phases.values()
    root = m.entry.root
    assert ms.get(root.operands[0]).phase == "optimizer"  # the new weights
    assert ms.get(root.operands[1]).phase != "optimizer"  # the metric output is not an update


def test_inference_has_no_optimizer():
    m, ms = _module(jax.jit(lambda w, x: jnp.tanh(x @ w) + w[0]).lower(jnp.ones((8, 8)), jnp.ones((8, 8)))
                    .compile().as_text())
    assert all(i.phase == "forward" for i in ms.infos.values())


@pytest.mark.parametrize("op_name, scope, phase", [
    ("jit(step)/transpose(jvp(jit(_take)))/scatter-add", TOP_LEVEL, "backward"),
    ("jit(step)/jvp(Model)/wpe/jit(_take)/broadcast_in_dim", "Model/wpe", "forward"),
    ("gradient_tape/model/dense/MatMul", "model/dense", "backward"),
    ("jit(f)/jvp(M)/h/0/attn/attn._split_heads/reshape", "M/h/0/attn", "forward"),
    ("jit(f)/jvp(M)/h/0/attn.setup/mul", "M/h/0/attn", "forward"),
])
def test_parse_scope_folds_helpers(op_name, scope, phase):
    assert parse_scope(op_name) == (scope, phase)


def test_stack_frame_parent_offset_and_model_path():
    user, lib = "/home/u/train.py", "/venv/lib/python3.11/site-packages/"
    frames = {1: StackFrame(user, "<module>", 1, 1), 2: StackFrame(user, "step.<locals>.loss", 5, 2),
              3: StackFrame(user, "Block.__call__", 9, 3), 4: StackFrame(lib + "flax/nnx/nn/linear.py",
                                                                          "Linear.__call__", 400, 4),
              5: StackFrame(lib + "jax/_src/numpy/ufuncs.py", "relu", 3, 4)}
    f = _Frames(frames)  # printed parents are proto + 1 (frame 1 names itself): offset 1
    assert f.offset == 1
    assert [x.function_name for x in f.chain(4)] == ["Linear.__call__", "Block.__call__", "step.<locals>.loss",
                                                     "<module>"]
    # each class below the outermost with its call site: the first model or user frame outside its methods
    assert _model_path(f.chain(4)) == [("Block", None), ("Linear", (user, 9, 0))]  # (no column written)
    assert _model_path(f.chain(5)) == [("Block", None)]  # jax's own frame skipped
    assert _model_path(f.chain(2)) == []  # the loss closure is not a model
    assert f.resolve(4) == ("Block/Linear@0", False)


def test_model_path_goes_through_a_scan_body_defined_in_a_models_call():
    """A closure in a model's ``__call__`` (the body it hands to ``lax.scan``) is the model's code: the path goes
    on to ``Transformer``; a closure in a trainer's method still ends it."""
    user, lib = "/home/u/train.py", "/venv/lib/python3.11/site-packages/jax/_src/lax/control_flow/loops.py"
    for owner, path in (("Transformer.__call__", [("Transformer", None), ("Block", (user, 30, 0))]),
                        ("Trainer.train", [("Block", None)])):
        frames = {1: StackFrame(user, owner, 40, 1), 2: StackFrame(lib, "scan", 200, 2),
                  3: StackFrame(user, f"{owner}.<locals>.body", 30, 3), 4: StackFrame(user, "Block.__call__", 9, 4)}
        assert _model_path(_Frames(frames).chain(4)) == path, owner


def test_layer_namer_rules():
    namer = LayerNamer.build({"CNN/Conv_0": 10, "CNN/Conv_1": 10, "CNN": 2, "(optimizer)": 5})
    assert namer.wrapper == ("CNN",)
    assert namer.layer("CNN/Conv_0/x", 2) == "Conv_0/x" and namer.layer("CNN", 2) == "CNN"
    assert LayerNamer.build({"layers/block": 10, "layers": 5}).wrapper == ()  # a user's lowercase scope stays
    assert LayerNamer.build({"Model/a": 5, "b": 5}).wrapper == ()  # not shared by nearly all
    blocks = LayerNamer.build({"T/Block_0/mlp": 1, "T/Block_1/mlp": 1, "T/emb": 1},
                              {"T/Block_0": "T/Block_*", "T/Block_1": "T/Block_*"})
    assert blocks.layer("T/Block_1/mlp/fc", 2) == "Block_*/mlp"
    assert blocks.layer("T/Block_1/mlp/fc", 2, expand=True) == "Block_1/mlp"
    assert blocks.instance("T/emb", 2) == ""


def test_worst_op_uses_the_median_execution():
    # op a: 10 executions of 1.0 s and one outlier of 100 s (expected 0.9); op b: always 2.0 s (expected 1.0)
    g = pd.DataFrame({"hlo_op": ["a"] * 11 + ["b"] * 3,
                      "measured_s": [1.0] * 10 + [100.0] + [2.0] * 3,
                      "expected_s": [0.9] * 11 + [1.0] * 3, "executions": [1.0] * 14})
    assert g.groupby("hlo_op")["measured_s"].sum().sub(g.groupby("hlo_op")["expected_s"].sum()).idxmax() == "a"
    assert worst_op(g, 1.0) == "b"


def test_rollup_instance_spread():
    ops = pd.DataFrame({
        "layer": ["h/*"] * 3 + ["emb"], "phase": ["forward"] * 4, "hlo_op": ["x", "y", "z", "e"],
        "instance": ["h/0", "h/1", "h/1", ""], "device": ["d"] * 4, "step": pd.array([1] * 4, "Int64"),
        "counted": [True] * 4, "measured_s": [1.0, 2.0, 3.0, 1.0], "expected_s": [0.5] * 4,
        "flops": [0.0] * 4, "hbm_bytes": [0.0] * 4, "bound": ["memory"] * 4, "lost_s": [0.5, 1.5, 2.5, 0.5],
        "opaque": [False] * 4,
    })
    r = rollup(ops, per_step_divisor=1, step_time_s=10.0).set_index("layer")
    assert r.loc["h/*", "instances"] == 2
    assert (r.loc["h/*", "instance_min_s"], r.loc["h/*", "instance_max_s"]) == (1.0, 5.0)
    assert r.loc["h/*", "instance_median_s"] == 3.0
    assert r.loc["emb", "instances"] == 1 and np.isnan(r.loc["emb", "instance_median_s"])


def test_weight_gradient_convolution_behind_gradient_clipping_is_backward():
    """An unnamed weight-gradient convolution whose only user is optax's global-norm clipping computes a
    gradient: it is backward, not optimizer (a new user's linen model with optax.chain(clip, adamw))."""
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(16, (3, 3), name="stem")(x))
            return nn.Dense(10)(x.reshape((x.shape[0], -1)))

    net = Net()
    x, y = jnp.ones((4, 16, 16, 3)), jnp.zeros((4,), jnp.int32)
    params = net.init(jax.random.PRNGKey(0), x)["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def step(params, opt, x, y):
        g = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(net.apply({"params": p}, x), y)
                     .mean())(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt

    m, ms = _module(jax.jit(step).lower(params, tx.init(params), x, y).compile().as_text())
    convs = [i for c in m.computations.values() for i in c.instructions if i.opcode == "convolution"]
    assert len(convs) >= 2  # forward and the weight gradient
    assert all(ms.get(i.name).phase in ("forward", "backward") for i in convs)
    assert any(ms.get(i.name).phase == "backward" for i in convs)


_LAYER_NORM_ONCE = """HloModule ln

%scale (p0: f32[8,64], p1: f32[64]) -> f32[8,64] {
  %p0 = f32[8,64]{1,0} parameter(0)
  %p1 = f32[64]{0} parameter(1)
  %b = f32[8,64]{1,0} broadcast(%p1), dimensions={1}
  ROOT %m = f32[8,64]{1,0} multiply(%p0, %b)
}

%shift (q0: f32[8,64], q1: f32[64]) -> f32[8,64] {
  %q0 = f32[8,64]{1,0} parameter(0)
  %q1 = f32[64]{0} parameter(1)
  %c = f32[8,64]{1,0} broadcast(%q1), dimensions={1}
  ROOT %a = f32[8,64]{1,0} add(%q0, %c)
}

%sum (u: f32[], v: f32[]) -> f32[] {
  %u = f32[] parameter(0)
  %v = f32[] parameter(1)
  ROOT %w = f32[] add(%u, %v)
}

ENTRY %main (x: f32[8,64], g: f32[64], b: f32[64]) -> f32[8] {
  %x = f32[8,64]{1,0} parameter(0)
  %g = f32[64]{0} parameter(1)
  %b = f32[64]{0} parameter(2)
  %n = f32[8,64]{1,0} tanh(%x)
  %s = f32[8,64]{1,0} fusion(%n, %g), kind=kLoop, calls=%scale
  %t = f32[8,64]{1,0} fusion(%s, %b), kind=kLoop, calls=%shift
  %e = f32[8,64]{1,0} exponential(%t)
  %zero = f32[] constant(0)
  ROOT %r = f32[8]{0} reduce(%e, %zero), dimensions={1}, to_apply=%sum
}
"""


def test_one_chained_group_is_no_evidence_of_instances():
    """s32 trial (NNX ViT, f32): the final LayerNorm, called once, was split into 2 instances because its scale
    and its shift are two fusions of one shape, each reading a weight, one after the other: one group cut in 2."""
    (m,) = parse_hlo_text(_LAYER_NORM_ONCE)
    infos = {i.name: ScopeInfo("M/LayerNorm", "forward", "", "frames", False) for i in m.entry.instructions}
    assert _split_instances(m.entry, infos, "M/LayerNorm", m.entry.users(), set()) == {}
