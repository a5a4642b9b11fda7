"""The ``discarded-update`` finding on real training loops with optax.MultiSteps (s32 trial: a ViT with
``MultiSteps(adamw, every_k_schedule=2)`` showed its optimizer row doubled and nothing said that half of the
update's work is thrown away), and ``donation-copy`` on the same loop with its state donated (s35 trial: an MoE with
MultiSteps spent more time copying its donated state than in the discarded update, and no finding said so)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import HOST_CHIP
from traceroof import analyze

pytest.importorskip("optax")

JOB = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, optax
    out = sys.argv[1]
    params = {"w1": jnp.ones((64, 256)) / 16, "w2": jnp.ones((256, 8)) / 16}
    x, y = jnp.ones((32, 64)), jnp.ones((32, 8))
    for name, k, donate in (("adam", 1, ()), ("multisteps2", 2, ()), ("multisteps3", 3, ()),
                            ("multisteps2_donated", 2, (0, 1))):
        opt = optax.adam(1e-3) if k == 1 else optax.MultiSteps(optax.adam(1e-3), every_k_schedule=k)

        def step(p, s):
            g = jax.grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2))(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        step = jax.jit(step, donate_argnums=donate)
        p, s = params, opt.init(params)
        # the compiled program's text and its arguments' sizes in entry-parameter order, for the tests' own count
        open(f"{out}/{name}.hlo", "w").write(step.lower(p, s).compile().as_text())
        open(f"{out}/{name}.sizes", "w").write(" ".join(str(a.nbytes) for a in jax.tree.leaves((p, s))))
        if k == 1:  # XLA's own count of adam's update alone, for the test's lower bound
            cost = jax.jit(lambda g, s, p: opt.update(g, s, p)).lower(p, s, p).compile().cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            open(f"{out}/adam_update_flops", "w").write(str(cost["flops"]))
        for _ in range(2):  # warm-up outside the trace
            p, s = step(p, s)
        jax.block_until_ready(p)
        jax.profiler.start_trace(f"{out}/{name}")  # the README's loop
        for i in range(4):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                p, s = step(p, s)
        jax.block_until_ready(p)
        jax.profiler.stop_trace()
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("multisteps")
    subprocess.run([sys.executable, "-c", JOB, str(out)], check=True, capture_output=True, timeout=300)
    return out


@pytest.mark.parametrize("k", [2, 3])
def test_multisteps_update_is_found_with_its_k(runs, k):
    """k is the loop's own every_k_schedule; the ops found hold adam's whole update (their FLOPs: at least XLA's
    cost_analysis of adam's update alone, at most MultiSteps' optimizer row: XLA fuses the accumulation and selects
    into them); lost is their time x (k - 1) / k."""
    a = analyze(runs / f"multisteps{k}", chip=HOST_CHIP)
    (f,) = [f for f in a.findings if f.code == "discarded-update"]
    nth = {2: "2nd", 3: "3rd"}[k]
    assert f"keeps it on every {nth}" in f.title, f.title
    assert f"(k = {k}, from the program's mini_step == {k - 1} test)" in f.evidence[1], f.evidence
    flops, time, unit = re.search(r": (\S+) FLOPs and (\S+) (ms|µs) per step", f.evidence[0]).groups()
    assert f.lost_per_step_s == pytest.approx(float(time) * {"ms": 1e-3, "µs": 1e-6}[unit] * (k - 1) / k, rel=0.01)
    adam_update = float((runs / "adam_update_flops").read_text())  # XLA's cost_analysis of adam's update alone
    multisteps = a.layers.loc[a.layers["phase"] == "optimizer", "flops_per_step"].sum()
    assert adam_update <= float(flops) <= multisteps, (adam_update, flops, multisteps)


def test_plain_adam_has_no_discarded_update(runs):
    a = analyze(runs / "adam", chip=HOST_CHIP)
    assert not [f for f in a.findings if f.code == "discarded-update"]


def _copied_arguments(runs: Path, name: str) -> dict[str, int]:
    """Copy op name -> entry parameter number, of the copies of parameters aliased to an output in the compiled
    program, read with regular expressions from JAX's own compiled text (not traceroof's parser)."""
    text = (runs / f"{name}.hlo").read_text()
    header, entry = text.split("\n", 1)[0], text[text.index("ENTRY"):]
    aliased = {int(n) for n in re.findall(r"\}\s*:\s*\((\d+),", header)}
    params = {m.group(1): int(m.group(2)) for m in re.finditer(r"%(\S+) = \S+ parameter\((\d+)\)", entry)}
    copies = {m.group(1): params.get(m.group(2), -1) for m in re.finditer(r"%(\S+) = \S+ copy\(%(\S+?)\)", entry)}
    return {op: n for op, n in copies.items() if n in aliased}


def test_donated_multisteps_state_copies_are_found(runs):
    """Donated: every copy of a donated argument in the compiled program is in the finding, with the bytes JAX gives
    those arguments (read and written once per step), its lost time the copies' time in the op table, and advice
    that names MultiSteps."""
    copied = _copied_arguments(runs, "multisteps2_donated")
    assert len(copied) >= 4, copied  # XLA copies (at least) the moments and accumulated gradients of both weights
    a = analyze(runs / "multisteps2_donated", chip=HOST_CHIP)
    (f,) = [f for f in a.findings if f.code == "donation-copy"]
    assert f"XLA copies {len(copied)} donated buffer(s)" in f.title, (f.title, copied)
    sizes = [int(b) for b in (runs / "multisteps2_donated.sizes").read_text().split()]
    moved, unit = re.search(r"and (\S+) (kB|MB) moved per step", f.title).groups()
    assert float(moved) * {"kB": 1e3, "MB": 1e6}[unit] == pytest.approx(2 * sum(sizes[n] for n in copied.values()),
                                                                        rel=0.01)
    ops = a.ops
    mine = ops["hlo_op"].astype(str).isin(set(copied)) & ops["step"].isin(a.summary.steps_used)
    assert f.lost_per_step_s == pytest.approx(ops.loc[mine, "measured_s"].sum() / a.per_step_divisor, rel=1e-6)
    assert "optax.MultiSteps" in f.advice


def test_state_not_donated_has_no_copies_to_find(runs):
    assert not _copied_arguments(runs, "multisteps2")  # the compiled program copies no argument
    a = analyze(runs / "multisteps2", chip=HOST_CHIP)
    assert not [f for f in a.findings if f.code == "donation-copy"]
