"""XLA:CPU runs a sort as copies of its operands and then the sort, each traced as an event named after the op (s39
trial: jax.random.permutation's sort counted as two executions of 0.5 µs and 320 µs). A real job's sorts are counted
once per execution, their time is the sum of their events, checked against the raw events JAX's own profile reader
gives."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import HOST_CHIP
from traceroof import analyze

TRIPS, STEPS = 3, 4
_JOB = f"""
import os, sys
out = sys.argv[1]
os.environ["XLA_FLAGS"] = f"--xla_dump_to={{out}}/hlo --xla_dump_hlo_as_text"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp

@jax.jit
def step(key, x):  # {TRIPS} shuffles per step, as an RL learner shuffles its minibatches every epoch
    def body(i, c):
        k, y = c
        k, sub = jax.random.split(k)
        return k, jnp.tanh(y[jax.random.permutation(sub, y.shape[0])] * 1.01)
    return jax.lax.fori_loop(0, {TRIPS}, body, (key, x))

key, x = jax.random.PRNGKey(0), jnp.ones((8192, 16))
jax.block_until_ready(step(key, x))
with jax.profiler.trace(f"{{out}}/logdir"):
    for i in range({STEPS}):
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
            key, x = step(key, x)
    jax.block_until_ready(x)
"""


@pytest.fixture(scope="module")
def shuffle_job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shuffle")
    subprocess.run([sys.executable, "-c", _JOB, str(out)], check=True, timeout=300, capture_output=True)
    return out


def _raw_sort_events(job: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Per sort op, its (run id, start ns, duration ns) events, read by jax.profiler.ProfileData."""
    from jax.profiler import ProfileData
    (path,) = job.glob("logdir/plugins/profile/*/*.xplane.pb")
    plane = next(p for p in ProfileData.from_file(str(path)).planes if p.name == "/host:CPU")
    out: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for line in plane.lines:
        for e in line.events:
            stats = dict(e.stats)
            if str(stats.get("hlo_op", "")).startswith("sort"):
                out[stats["hlo_op"]].append((stats["run_id"], e.start_ns, e.duration_ns))
    return out


def test_a_sort_run_as_copy_and_sort_is_one_execution(shuffle_job):
    raw = _raw_sort_events(shuffle_job)
    runs = {r for events in raw.values() for r, _, _ in events}
    assert len(runs) == STEPS
    # the case at hand: some sort writes more events than it has executions (copy thunks named after it)
    assert any(len(events) > TRIPS * STEPS for events in raw.values())
    a = analyze(shuffle_job / "logdir", hlo=[shuffle_job / "hlo"], chip=HOST_CHIP)
    ops = a.ops[a.ops["hlo_op"].astype(str).str.startswith("sort") & a.ops["counted"]]
    assert set(ops["hlo_op"].astype(str)) == set(raw)
    for op, events in raw.items():
        rows = ops[ops["hlo_op"] == op]
        assert rows["executions"].sum() == TRIPS * STEPS  # one per loop trip, not one per event
        assert rows["measured_s"].sum() == pytest.approx(sum(d for _, _, d in events) * 1e-9, rel=1e-6)
    top = a.top_ops.set_index("hlo_op")
    for op, events in raw.items():
        assert top.loc[op, "executions_per_step"] == TRIPS
        if len(events) == TRIPS * STEPS:  # one event per execution: the median is one of them
            samples = [d * 1e-9 for _, _, d in events]
        else:  # copies and sort as one: a step's time of the op over its executions (as for GPU kernels)
            samples = [sum(d for r, _, d in events if r == run) * 1e-9 / TRIPS for run in runs]
        assert any(top.loc[op, "median_s"] == pytest.approx(t, rel=1e-6) for t in samples)
