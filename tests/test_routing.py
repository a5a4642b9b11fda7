"""One-hot routing matmuls (traceroof.routing): an MoE written as GShard / Switch einsums, compiled by XLA, has its
dispatch and combine dots found and counted as 5 x 2·T·(E·C)·D per layer (forward: dispatch and combine; backward:
both transposed, and the gate's gradient); the model FLOPs leave them out. A dense transformer block (causal mask
from iota, dropout) has none: only an equality with an iota makes a one-hot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

from parsers.hlo_text import parse_hlo_text
from traceroof.cost import CostModel
from traceroof.utilization import ROUTING, flop_utilization

T, D, F, E, C = 64, 32, 48, 4, 20  # tokens, model and hidden widths, experts, capacity (cf 1.25 of T / E)


def _moe_loss(p, x):
    logits = x @ p["router"]  # [T, E]
    probs = jax.nn.softmax(logits, -1)
    onehot = jax.nn.one_hot(jnp.argmax(probs, -1), E, dtype=jnp.float32)
    pos = (jnp.cumsum(onehot, 0) - 1.0) * onehot
    keep = onehot * (pos < C)
    dispatch = keep[:, :, None] * jax.nn.one_hot(pos.sum(-1).astype(jnp.int32), C)[:, None, :]  # [T, E, C]
    xin = jnp.einsum("tec,td->ecd", dispatch, x)
    y = jnp.einsum("ecf,efd->ecd", jax.nn.gelu(jnp.einsum("ecd,edf->ecf", xin, p["w1"])), p["w2"])
    out = jnp.einsum("tec,ecd->td", dispatch * jnp.max(probs, -1)[:, None, None], y)
    return ((x + out) ** 2).mean()


def _dense_loss(p, x, key):
    q, k = x @ p["q"], x @ p["k"]
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), q @ k.T, -1e9)  # causal mask: a compare of two iotas
    h = jax.nn.softmax(s, -1) @ x
    h = h * jax.random.bernoulli(key, 0.9, h.shape) / 0.9  # dropout: a compare of random bits
    return ((jax.nn.gelu(h @ p["w1"]) @ p["w2"]) ** 2).mean()


def _costs(fn, *args, argnums=0):
    compiled = jax.jit(jax.grad(fn, argnums)).lower(*args).compile()
    (m,) = parse_hlo_text(compiled.as_text())
    model = CostModel(m)
    rows = [(model.cost(i), model.executions.get(c.name, 0.0)) for c in m.computations.values()
            if c.name in model.executions for i in c.instructions]
    return {k: sum(getattr(cost, k) * n for cost, n in rows) for k in ("flops", "matmul_flops", "routing_flops")}


def _params(shapes: dict) -> dict:
    keys = iter(jax.random.split(jax.random.PRNGKey(0), len(shapes) + 1))
    return {k: jax.random.normal(next(keys), s) for k, s in shapes.items()}


def test_moe_dispatch_and_combine_are_routing_and_leave_the_model_flops():
    p = _params({"router": (D, E), "w1": (E, D, F), "w2": (E, F, D)})
    x = jax.random.normal(jax.random.PRNGKey(1), (T, D))
    got = _costs(_moe_loss, p, x, argnums=(0, 1))  # the gradient of x too, as a layer inside a model has
    one = 2 * T * (E * C) * D  # one dispatch or combine dot: [T, E·C] x [T, D] contracted over T (or E·C)
    assert got["routing_flops"] == 5 * one
    experts = 3 * 2 * (2 * E * C * D * F)  # forward + two backward matmuls each, of both expert matmuls
    router = 3 * 2 * T * D * E  # forward, the weight's and the input's gradients
    assert got["matmul_flops"] - got["routing_flops"] == pytest.approx(experts + router, rel=0.02)
    counted = pd.DataFrame({"flops": [got["flops"]], "matmul_flops": [got["matmul_flops"]],
                            "routing_flops": [got["routing_flops"]], "phase": ["forward"]})
    model, source, mfu, _ = flop_utilization(counted, 1.0, 1.0, 1e12, 1)
    assert model == got["matmul_flops"] - got["routing_flops"]
    assert f"of {ROUTING}" in source and "capacity slot" in source and mfu == pytest.approx(model / 1e12)


def test_dense_attention_with_causal_mask_and_dropout_has_no_routing():
    p = _params({"q": (D, D), "k": (D, D), "w1": (D, F), "w2": (F, D)})
    x = jax.random.normal(jax.random.PRNGKey(1), (T, D))
    got = _costs(_dense_loss, p, x, jax.random.PRNGKey(2))
    assert got["matmul_flops"] > 0 and got["routing_flops"] == 0


def test_one_hot_embedding_lookup_is_routing():
    """A one-hot matmul that looks tokens up in an embedding table (a gather on the matrix unit, common in TPU
    code) moves rows; the output projection that follows is model work."""
    V = 50

    def loss(p, tokens):
        h = jax.nn.one_hot(tokens, V) @ p["embed"]  # [T, D]
        return ((h @ p["w"]) ** 2).mean()

    p = _params({"embed": (V, D), "w": (D, D)})
    got = _costs(loss, p, jnp.asarray(np.arange(T) % V))
    lookup = 2 * T * V * D  # forward lookup and the table's gradient (one-hot transposed x dh), each
    assert got["routing_flops"] == 2 * lookup
    assert got["matmul_flops"] - got["routing_flops"] == 3 * 2 * T * D * D
