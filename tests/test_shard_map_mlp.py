"""The JAX shard_map tutorial's MLP ("Manual parallelism with shard_map": data parallelism, FSDP with all_gather,
FSDP + tensor parallelism with psum_scatter), compiled for 8 virtual CPU devices as the s43 trial wrote it, read
back from XLA's own dump folder. Layers 128 -> 32 -> 32 -> 32 -> 32 -> 8, batch 64: the first layer's weight has
more elements than the three 32 x 32 ones together, as the trial's 784 -> 256 x 3 did."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from parsers.hlo_text import parse_hlo_file
from traceroof.chips import get_chip
from traceroof.collectives import default_topology
from traceroof.memory import parameter_categories, program_memory, value_categories
from traceroof.mesh_book import book_on_mesh
from traceroof.scopes import assign_scopes

BATCH, WIDTHS = 64, [128, 32, 32, 32, 32, 8]

_JOB = f"""
import os, sys
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 --xla_dump_to=" + sys.argv[2]
                           + " --xla_dump_hlo_as_text")
os.environ["JAX_PLATFORMS"] = "cpu"
from functools import partial
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

variant, sizes, batch_size = sys.argv[1], {WIDTHS}, {BATCH}
keys = jax.random.split(jax.random.key(0), len(sizes) + 1)
params = [(jax.random.normal(k, (m, n)) / m ** 0.5, jnp.zeros(n)) for k, m, n in zip(keys, sizes[:-1], sizes[1:])]
batch = (jax.random.normal(keys[-1], (batch_size, sizes[0])), jnp.zeros((batch_size, sizes[-1])))

def layer(i, W, b, x):
    with jax.named_scope(f"layer{{i}}"):
        return jnp.dot(x, W) + b

if variant == "dp":
    mesh, pspec, bspec = jax.make_mesh((8,), ("batch",)), P(), P("batch")

    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P())
    def loss_fn(params, local_batch):
        x, y = local_batch
        for i, (W, b) in enumerate(params):
            x = jax.nn.relu(out := layer(i, W, b, x))
        return jax.lax.pmean(jnp.mean(jnp.sum((out - y) ** 2, axis=-1)), "batch")
elif variant == "fsdp":
    mesh, pspec, bspec = jax.make_mesh((8,), ("batch",)), P("batch"), P("batch")

    @partial(jax.shard_map, mesh=mesh, in_specs=P("batch"), out_specs=P())
    def loss_fn(local_params, local_batch):
        x, y = local_batch
        for i, (W, b) in enumerate(local_params):
            W, b = (jax.lax.all_gather(t, "batch", tiled=True) for t in (W, b))
            x = jax.nn.relu(out := layer(i, W, b, x))
        return jax.lax.pmean(jnp.mean(jnp.sum((out - y) ** 2, axis=-1)), "batch")
else:  # FSDP over 4 ways x tensor parallelism over 2
    mesh = jax.make_mesh((4, 2), ("batch", "feats"))
    pspec, bspec = P(("feats", "batch")), P("batch", "feats")

    @partial(jax.shard_map, mesh=mesh, in_specs=(pspec, bspec), out_specs=P())
    def loss_fn(local_params, local_batch):
        x, y = local_batch
        for i, (W, b) in enumerate(local_params):
            W, b = (jax.lax.all_gather(t, "batch", tiled=True) for t in (W, b))
            out = jax.lax.psum_scatter(jnp.dot(x, W), "feats", scatter_dimension=1, tiled=True) + b
            x = jax.nn.relu(out)
        return jax.lax.pmean(jnp.mean(jax.lax.psum(jnp.sum((out - y) ** 2, axis=-1), "feats")), "batch")

@jax.jit
def train_step(params, batch):  # SGD, as the tutorial
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), loss

train_step.lower(jax.device_put(params, NamedSharding(mesh, pspec)),
                 jax.device_put(batch, NamedSharding(mesh, bspec))).compile()
"""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """Each variant's after-optimization dump of the train step (its buffer assignment beside it)."""
    out = {}
    for variant in ("dp", "fsdp", "fsdp_tp"):
        folder = tmp_path_factory.mktemp(variant)
        subprocess.run([sys.executable, "-c", _JOB, variant, str(folder)], check=True, timeout=300,
                       capture_output=True)
        out[variant] = next(folder.glob("*jit_train_step.cpu_after_optimizations.txt"))
    return out


def _report(dump: Path):
    v5e = get_chip("v5e")
    return book_on_mesh(parse_hlo_file(dump), v5e, default_topology(v5e, 8))


@pytest.mark.parametrize("variant, per_device", [("dp", BATCH // 8), ("fsdp", BATCH // 8), ("fsdp_tp", BATCH // 4)])
def test_the_model_and_its_tokens_are_read_from_the_hidden_layers_and_the_batch(dumps, variant, per_device):
    """s43 trial: "D = 256, F = 784, L = 1 MLP layer(s), tokens per step unknown" for 784 -> 256 x 3 -> 8 at batch
    256: the input layer alone (the pair with most elements) gave D and F, and the rows of width 784 were not
    taken for tokens. By hand: three 32 x 32 hidden matrices (1.5 of the book's W_in, W_out layers), 64 rows."""
    sizes = _report(dumps[variant]).sizes
    assert (sizes.d_model, sizes.d_ff, sizes.layers) == (32, 32, 1.5)
    assert (sizes.tokens, sizes.tokens_per_device) == (BATCH, per_device)


@pytest.mark.parametrize("variant", ["dp", "fsdp", "fsdp_tp"])
def test_a_batch_axis_far_below_the_critical_batch_is_communication_bound(dumps, variant):
    """s43 trial: with the tokens unknown, T_math was NaN and every axis read "bound: compute" (NaN > x is false),
    and no comm-bound-axis finding came. 8 or 16 rows per device against the book's C/W of thousands on v5e: the
    batch axes are communication-bound, with a finding each."""
    rep = _report(dumps[variant])
    batch_axes = [r for r in rep.rows if r.strategy in ("data", "fsdp")]
    assert batch_axes
    for r in batch_axes:
        assert r.batch_per_device < r.critical_batch_per_device
        assert math.isfinite(r.t_math_s) and r.t_comm_s > r.t_math_s and r.bound == "communication", r
    assert {r.axis for r in batch_axes} <= {axis for axis, _, _ in rep.findings}


def test_the_fsdp_and_tensor_note_has_the_tokens_per_chip(dumps):
    """s43 trial: "this step has nan: communication-bound; ... X_opt = nan of 8". 64 tokens over 8 chips."""
    rep = _report(dumps["fsdp_tp"])
    (note,) = [n for n in rep.notes if n.startswith("FSDP + tensor parallelism")]
    assert "nan" not in note and f"this step has {BATCH // 8}: communication-bound" in note and "X_opt" in note


def test_fsdp_weights_gathered_for_the_backward_are_weight_copies(dumps):
    """s43 trial: the FSDP MLP keeps the all-gathered weights of layers 1-4 from the forward pass into the
    backward (the backward gathers nothing), and the memory view called them activations and the excess
    "backward scratch". Here: the forward all-gathers that backward ops read (XLA's own op_name metadata:
    transpose(...) is the backward) are the weights of layers 1-4 and, as XLA fuses the ReLU's mask into the
    backward, the five biases: (3 x 32 x 32 + 32 x 8 + 4 x 32 + 8) x 4 = 13,856 B by hand, each a weight copy;
    data parallelism gathers nothing.""" 
    module = parse_hlo_file(dumps["fsdp"])[0]
    entry = module.entry
    users = entry.users()
    held = [i for i in entry.instructions if i.opcode == "all-gather" and "transpose(" not in i.metadata.op_name
            and any("transpose(" in u.metadata.op_name for u in users.get(i.name, ()))]
    assert sum(i.shape.byte_size() for i in held) == (3 * 32 * 32 + 32 * 8 + 4 * 32 + 8) * 4
    scopes = assign_scopes(module)
    category_of = value_categories(module, scopes, parameter_categories(module, scopes))
    assert {category_of(i.name) for i in held} == {"weight_copies"}
    pm = program_memory(module, dumps["fsdp"])
    assert pm.categories["weight_copies"] > 0
    assert {b.category for b in pm.largest if b.name in {i.name for i in held}} == {"weight_copies"}
    assert any(line.startswith("weight copies at the peak") for line in pm.book.explanation)
    dp = program_memory(parse_hlo_file(dumps["dp"])[0], dumps["dp"])
    assert dp.categories["weight_copies"] == 0
