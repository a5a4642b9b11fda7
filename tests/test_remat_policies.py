"""The remat-cost finding's advice on real jobs under three jax.checkpoint policies: it names a policy that keeps
what the one in use recomputes, never the one in use. JAX's policies (jax/_src/ad_checkpoint.py):
``nothing_saveable`` recomputes every matmul, ``dots_with_no_batch_dims_saveable`` keeps the outputs of matmuls
without batch dimensions (so the attention scores and context, batched over the batch axis, are recomputed),
``checkpoint_dots`` keeps every matmul output. The model: 2 attention blocks, each with 4 projections (no batch
dims) and 2 batched einsums (scores, context); a user of the s29 trial was told to switch to the policy they had."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("jax")

from traceroof import analyze  # noqa: E402

HOST_CHIP = Path(__file__).resolve().parents[1] / "fixtures" / "fixture_host.toml"
POLICIES = ("nothing_saveable", "dots_with_no_batch_dims_saveable", "checkpoint_dots")
LAYERS = 2

JOB = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    out, layers = sys.argv[1], int(sys.argv[2])
    B, T, D = 8, 64, 64

    def block(w, x):
        q, k, v = x @ w[0], x @ w[1], x @ w[2]
        a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / 8.0, axis=-1)
        return x + jnp.tanh(jnp.einsum("bts,bsd->btd", a, v) @ w[3])

    for policy in sys.argv[3:]:
        remat = jax.checkpoint(block, policy=getattr(jax.checkpoint_policies, policy))

        @jax.jit
        def train_step(ws, x):
            def loss(ws):
                h = x
                for w in ws:
                    h = remat(w, h)
                return jnp.mean(h ** 2)
            g = jax.grad(loss)(ws)
            return [[a - 0.01 * b for a, b in zip(w, gw)] for w, gw in zip(ws, g)]

        key = jax.random.PRNGKey(0)
        ws = [[jax.random.normal(jax.random.fold_in(key, 4 * i + j), (D, D)) / 8 for j in range(4)]
              for i in range(layers)]
        x = jax.random.normal(key, (B, T, D))
        jax.profiler.start_trace(f"{out}/{policy}")  # the README's loop
        for i in range(4):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                ws = train_step(ws, x)
        jax.block_until_ready(ws)
        jax.profiler.stop_trace()
        with open(f"{out}/{policy}.hlo.txt", "w") as f:  # the program that ran, as XLA prints it
            f.write(train_step.lower(ws, x).compile().as_text())
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("remat")
    subprocess.run([sys.executable, "-c", JOB, str(out), str(LAYERS), *POLICIES], check=True, capture_output=True,
                   timeout=300)
    return out


def _remat(runs: Path, policy: str):
    a = analyze(runs / policy, chip=HOST_CHIP, warmup_steps=1)
    return [f for f in a.findings if f.code == "remat-cost"]


def _recomputed_dots(runs: Path, policy: str) -> tuple[int, int]:
    """(with batch dims, without): the dot instructions of XLA's compiled text that JAX's remat made (op_name
    under ``rematted_computation``), counted with a regular expression, not with traceroof's parser."""
    dots = re.findall(r"^\s*(?:ROOT )?%?(\S+) = \S+ dot\((.*)$", (runs / f"{policy}.hlo.txt").read_text(), re.M)
    remat = {name: "lhs_batch_dims=" in rest for name, rest in dots if "rematted_computation" in rest}
    return sum(remat.values()), len(remat) - sum(remat.values())


def test_advice_follows_what_the_policy_recomputes(runs):
    batched, unbatched = _recomputed_dots(runs, "nothing_saveable")  # every matmul of both blocks
    assert batched >= LAYERS and unbatched >= 3 * LAYERS
    (nothing,) = _remat(runs, "nothing_saveable")
    assert f"{batched} of the {batched + unbatched} recomputed matmuls have batch dimensions" in nothing.advice
    assert "checkpoint_policies.checkpoint_dots" in nothing.advice
    batched, unbatched = _recomputed_dots(runs, "dots_with_no_batch_dims_saveable")  # the scores einsums
    assert batched >= LAYERS and unbatched == 0
    (no_batch,) = _remat(runs, "dots_with_no_batch_dims_saveable")
    assert f"{batched} of the {batched} recomputed matmuls have batch dimensions" in no_batch.advice
    assert "checkpoint_policies.checkpoint_dots" in no_batch.advice
    assert "policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable" not in no_batch.advice
    assert _recomputed_dots(runs, "checkpoint_dots") == (0, 0)
    for f in _remat(runs, "checkpoint_dots"):  # (the softmax and tanh recomputed: small, may not be flagged)
        assert f.advice.startswith("no matmul is recomputed") and "policy=" not in f.advice
