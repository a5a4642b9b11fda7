"""Labels on training-step patterns a new user's models brought (compiled here with jax on CPU, tiny shapes):
gradient accumulation in a fori_loop, Python lists of blocks in Flax NNX, a scan over stacked layers, dropout's
RNG, and one optimizer row whatever the optimizer library."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.conftest import compiled_scopes as _module, executed_ops as _executed
from traceroof.layers import TOP_LEVEL, LayerNamer
from traceroof.scopes import OPTIMIZER_SCOPE, RNG_SCOPE, ModuleScopes

jax = pytest.importorskip("jax")
jnp = jax.numpy
optax = pytest.importorskip("optax")




def _layers(ms: ModuleScopes, expand: bool = False) -> set[tuple[str, str]]:
    namer = LayerNamer.build(Counter(i.scope for i in ms.infos.values()), ms.repeats)
    return {(namer.layer(i.scope, 2, expand), i.phase) for i in ms.infos.values()}


def _optimizer_scopes(ms: ModuleScopes) -> set[str]:
    return {i.scope for i in ms.infos.values() if i.phase == "optimizer"}


def test_gradient_accumulation_in_fori_loop_is_backward():
    def loss(params, batch):
        x, y = batch
        return ((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2).mean()

    params = {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 4))}
    tx = optax.adam(1e-3)

    def train_step(params, opt_state, xs, ys):
        def body(i, acc):
            return jax.tree_util.tree_map(jnp.add, acc, jax.grad(loss)(params, (xs[i], ys[i])))
        grads = jax.lax.fori_loop(0, xs.shape[0], body, jax.tree_util.tree_map(jnp.zeros_like, params))
        updates, opt_state = tx.update(jax.tree_util.tree_map(lambda g: g / xs.shape[0], grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    m, ms = _module(jax.jit(train_step).lower(params, tx.init(params), jnp.ones((4, 2, 8)), jnp.zeros((4, 2, 4)))
                    .compile().as_text())
    ops = _executed(m)
    adds = [i for c, i in ops if c is not m.entry and i.metadata.op_name.endswith("closed_call/add")]
    assert len(adds) == 2  # one accumulator per parameter
    assert all(ms.get(i.name).phase == "backward" for i in adds)
    zeros = [i for c, i in ops if c is m.entry and i.metadata.op_name.endswith("/broadcast_in_dim")]
    assert zeros and all(ms.get(i.name).phase == "backward" for i in zeros)  # the accumulator's zeros
    # adam's update is the optimizer; nothing of the loop is
    phases = {ms.get(i.name).phase for c, i in ops if c is not m.entry}
    assert "optimizer" not in phases
    updates = [i for c, i in ops if c is m.entry and "sqrt" in {x.opcode for n in i.called
                                                                  for x in m.computations[n].instructions}]
    assert updates and all(ms.get(i.name).phase == "optimizer" for i in updates)


@pytest.mark.parametrize("momentum", [False, True])
def test_training_steps_in_a_fori_loop_update_parameters(momentum):
    """Several SGD steps in one program (``fori_loop`` over batches, the update written by hand, as RL and
    small-model loops do): the slot's new value ``p - lr * g`` looks like an accumulator's ``acc + g``, but the
    forward reads the slot, so it is a parameter and the update is the optimizer's (it was labelled a backward
    gradient accumulation). A momentum slot, read only by its own update, is the optimizer's too: its new value
    feeds the parameters' update in the same iteration."""
    def loss(params, batch):
        x, y = batch
        return ((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2).mean()

    params = {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 4))}
    tree_map = jax.tree_util.tree_map

    def train(params, xs, ys):
        def body(i, carry):
            p, m = carry
            g = jax.grad(loss)(p, (xs[i], ys[i]))
            if momentum:
                m = tree_map(lambda a, b: 0.9 * a + b, m, g)
                g = m
            return tree_map(lambda a, b: a - 0.1 * b, p, g), m
        return jax.lax.fori_loop(0, xs.shape[0], body, (params, tree_map(jnp.zeros_like, params)))

    m, ms = _module(jax.jit(train).lower(params, jnp.ones((4, 2, 8)), jnp.zeros((4, 2, 4))).compile().as_text())
    loop = next(c for c, _ in _executed(m) if c is not m.entry and c.root.opcode == "tuple")  # the body
    body, root = [(i, ms.get(i.name)) for i in loop.instructions], loop.root
    new_values = {n: ms.get(n) for n in root.operands}
    subs = [i for i, _ in body if i.metadata.op_name.endswith("closed_call/sub")]
    assert len(subs) == 2 and all(n.name in new_values for n in subs)  # p - lr * g, one per parameter
    assert all(new_values[n.name].phase == "optimizer" and new_values[n.name].scope == OPTIMIZER_SCOPE for n in subs)
    adds = [i for i, _ in body if i.metadata.op_name.endswith("closed_call/add")]
    assert len(adds) == (2 if momentum else 0)  # 0.9 * m + g
    assert all(ms.get(i.name).phase == "optimizer" for i in adds)
    assert not any(info.how == "accumulate" for _, info in body)
    # the forward still reads the parameters and the gradient is still the backward's
    phases = Counter(info.phase for i, info in body if i.metadata.op_name)
    assert phases["forward"] >= 2 and phases["backward"] >= 2


def test_a_convolutions_input_gradient_is_its_layers_backward():
    """s41 trial (an Equinox UNet on XLA:CPU): the convolution computing a conv layer's input gradient has no
    metadata; it reads the layer's kernel (reversed, transposed) and the gradient of the layer's output, and took
    the label of the latter, the next layer's (GroupNorm) backward: 209 of 882 MFLOP per step outside the conv
    rows. By the chain rule each conv's backward is a weight gradient and an input gradient, each with the
    forward's FLOPs; the first layer needs no input gradient. So a conv row's backward FLOPs are twice its
    forward's (once for the first), and no other row has convolution FLOPs."""
    eqx = pytest.importorskip("equinox")
    from collections import defaultdict

    from traceroof.cost import CostModel

    class Net(eqx.Module):
        c1: eqx.nn.Conv2d
        n1: eqx.nn.GroupNorm
        c2: eqx.nn.Conv2d
        n2: eqx.nn.GroupNorm
        c3: eqx.nn.Conv2d

        def __init__(self, key):
            k = jax.random.split(key, 3)
            self.c1, self.n1 = eqx.nn.Conv2d(4, 16, 3, padding=1, key=k[0]), eqx.nn.GroupNorm(4, 16)
            self.c2, self.n2 = eqx.nn.Conv2d(16, 16, 3, padding=1, key=k[1]), eqx.nn.GroupNorm(4, 16)
            self.c3 = eqx.nn.Conv2d(16, 4, 3, padding=1, key=k[2])

        def __call__(self, x):
            x = jax.nn.relu(self.n1(self.c1(x)))
            return self.c3(jax.nn.relu(self.n2(self.c2(x))))

    tx = optax.adam(1e-3)

    def step(m, o, x):
        g = eqx.filter_grad(lambda m: jnp.mean((jax.vmap(m)(x) - x) ** 2))(m)
        u, o = tx.update(g, o, m)
        return eqx.apply_updates(m, u), o

    model = Net(jax.random.PRNGKey(0))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    m, ms = _module(jax.jit(step).lower(model, opt_state, jnp.ones((8, 4, 16, 16))).compile().as_text())
    cost = CostModel(m)
    flops: dict[tuple[str, str], float] = defaultdict(float)
    unnamed = 0
    for c, i in _executed(m):
        fused = [x.opcode for n in i.called for x in m.computations[n].instructions] if i.opcode == "fusion" else []
        if "convolution" in [i.opcode, *fused]:
            info = ms.get(i.name)
            flops[info.scope.rsplit("/", 1)[-1], info.phase] += cost.cost(i).flops
            unnamed += not i.metadata.op_name
    assert unnamed >= 2  # the input gradients XLA made without metadata (the case)
    assert set(flops) == {(f"Conv_{k}", p) for k in range(3) for p in ("forward", "backward")}
    assert flops["Conv_0", "backward"] == flops["Conv_0", "forward"] > 0
    assert flops["Conv_1", "backward"] == 2 * flops["Conv_1", "forward"] > 0
    assert flops["Conv_2", "backward"] == 2 * flops["Conv_2", "forward"] > 0


@pytest.fixture(scope="module")
def nnx_block_list():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1, self.fc2 = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, x):
            return self.fc2(nnx.relu(self.fc1(x)))

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm, self.mlp = nnx.LayerNorm(16, rngs=rngs), MLP(rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return x + self.drop(self.mlp(self.norm(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed, self.head = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(4)])

        def __call__(self, x):
            x = self.embed(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda mdl: ((mdl(x) - y) ** 2).mean())(model)
        opt.update(model, grads)
        return loss

    return _module(train_step.lower(model, opt, jnp.ones((4, 8)), jnp.zeros((4, 4))).compile().as_text())


def test_nnx_list_of_blocks_collapses_with_instances(nnx_block_list):
    m, ms = nnx_block_list
    assert ms.repeats == {f"Model/Block_{k}": "Model/Block_*" for k in range(4)}
    layers = _layers(ms)
    for part in ("Block_*/MLP", "Block_*/LayerNorm", "Block_*/Dropout"):
        assert (part, "forward") in layers and (part, "backward") in layers or part.endswith("Dropout")
    assert ("Block_*/Dropout", "forward") in layers
    assert ("Block_2/MLP", "backward") in _layers(ms, expand=True)
    # every executed op of the blocks is placed in an instance, and the instances hold the same matmuls
    per_instance: dict[str, Counter] = {}
    for _, i in _executed(m):
        scope = ms.get(i.name).scope
        if i.is_root or not scope.startswith("Model/Block"):
            continue
        assert scope.startswith("Model/Block_"), (i.name, scope)
        if i.opcode == "fusion" and any(x.opcode == "dot" for n in i.called for x in m.computations[n].instructions):
            per_instance.setdefault(scope.split("/")[1], Counter())[ms.get(i.name).phase] += 1
    assert len(per_instance) == 4 and len({tuple(sorted(c.items())) for c in per_instance.values()}) == 1
    # NNX's RNG stream is no row of its own: its ops are the dropout's
    assert not any("RngStream" in i.scope or "train_step" in i.scope for i in ms.infos.values())
    assert _optimizer_scopes(ms) == {OPTIMIZER_SCOPE}


def test_scan_over_stacked_layers_plumbing_takes_the_body_layer():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(16, name="down")(nn.gelu(nn.Dense(32, name="up")(x))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
            x, _ = stack(name="layers")(nn.Dense(16, name="embed")(x), None)
            return nn.Dense(4, name="head")(x)

    model, x, y = Model(), jnp.ones((8, 16)), jnp.zeros((8, 4))
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    tx = optax.adam(1e-2)

    def train_step(params, st, x, y):
        loss, g = jax.value_and_grad(lambda p: ((model.apply({"params": p}, x) - y) ** 2).mean())(params)
        u, st = tx.update(g, st, params)
        return optax.apply_updates(params, u), st, loss

    m, ms = _module(jax.jit(train_step).lower(params, tx.init(params), x, y).compile().as_text())
    bodies = {w.attrs["body"].lstrip("%") for comp in m.computations.values() for w in comp.instructions
              if w.opcode == "while"}
    plumbing = [i for c, i in _executed(m) if c.name in bodies
                and ("dynamic_slice" in i.metadata.op_name or "dynamic_update_slice" in i.metadata.op_name)]
    assert len(plumbing) >= 6  # slices of the stacked weights in, stacked activations / gradients out
    assert all(ms.get(i.name).scope.startswith("Model/layers") for i in plumbing), \
        {ms.get(i.name).scope for i in plumbing}
    assert {ms.get(i.name).phase for i in plumbing} == {"forward", "backward"}


def test_dropout_rng_belongs_to_the_dropout_and_key_handling_to_rng():
    """``fold_in`` in the train step (all layers' key) is ``(rng)``; the dropout's own bits are its layer's; no
    row is named after the jitted function; TrainState's optax update is ``(optimizer)``."""
    nn = pytest.importorskip("flax.linen")
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.Dropout(0.1, deterministic=not train)(nn.relu(nn.Dense(32)(x)))
            return nn.Dense(4)(x)

    model, x, y = MLP(), jnp.ones((8, 16)), jnp.zeros((8, 4))
    st = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.PRNGKey(0), x, False)
                                       ["params"], tx=optax.adam(1e-3))

    def train_step(st, x, y, key):
        key = jax.random.fold_in(key, st.step)
        loss, g = jax.value_and_grad(lambda p: ((st.apply_fn({"params": p}, x, True, rngs={"dropout": key}) - y)
                                                ** 2).mean())(st.params)
        return st.apply_gradients(grads=g), loss

    jax.clear_caches()  # inner jits (fold_in) keep the stack frames of their first trace: another test's model
    m, ms = _module(jax.jit(train_step).lower(st, x, y, jax.random.PRNGKey(1)).compile().as_text())
    scopes = {ms.get(i.name).scope for _, i in _executed(m)}
    assert not any("train_step" in s for s in scopes)
    folds = [i for _, i in _executed(m) if "_threefry_fold_in" in i.metadata.op_name]
    assert {ms.get(i.name).scope for i in folds} == {RNG_SCOPE, "MLP/Dropout_0"}
    bits = [i for _, i in _executed(m) if "jit(_bernoulli)" in i.metadata.op_name]
    assert bits and {ms.get(i.name).scope for i in bits} == {"MLP/Dropout_0"}
    assert _optimizer_scopes(ms) == {OPTIMIZER_SCOPE}
    assert TOP_LEVEL not in {ms.get(i.name).scope for i in folds}
