"""Steps by execution, dump folders as XLA writes them, and HLO identity, on real JAX jobs run here.

One subprocess runs a training loop three ways (the README's non-blocking loop with compilation inside the first
step, a blocking loop, and a loop without step markers) with ``--xla_dump_to`` set; a second run with another
width writes the dump folder of "another run". Numbers are checked against XLA's own ``cost_analysis()``.
"""

from __future__ import annotations

import json
import os
import shutil
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("jax")

from parsers.dump_folder import dump_file_kind  # noqa: E402
from traceroof import analyze  # noqa: E402
from traceroof.breakdown import COMPONENTS, other_programs_line  # noqa: E402
from traceroof.discovery import discover  # noqa: E402
from traceroof.profile import load_profile  # noqa: E402
from traceroof.hlo_source import HloMismatchError  # noqa: E402
from parsers.errors import InputError  # noqa: E402
from traceroof.steps import (_best_offset, _schedule_cut, _unwrapped, assign_steps,  # noqa: E402
                             dominant_program_steps, entry_schedule, launch_times, left_out_executions)

HOST_CHIP = Path(__file__).resolve().parents[1] / "fixtures" / "fixture_host.toml"

JOB = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    out, width, loops, act = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), getattr(jnp, sys.argv[4])

    @jax.jit
    def train_step(w, x):
        def loss(w):
            h = act(x @ w[0])
            return jnp.mean((h @ w[1]) ** 2)
        g = jax.grad(loss)(w)
        return [a - 0.1 * b for a, b in zip(w, g)]

    key = jax.random.PRNGKey(0)
    w = [jax.random.normal(key, (64, width)) / 8, jax.random.normal(key, (width, 64)) / 8]
    x = jnp.ones((32, 64))
    if "readme" in loops:  # the README's loop: no warm-up, nothing blocks inside a step
        jax.profiler.start_trace(f"{out}/readme")
        for i in range(5):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                w = train_step(w, x)
                w = [jnp.where(a > 10, 10.0, a) for a in w]  # a helper jit launched inside the step
        jax.block_until_ready(w)
        jax.profiler.stop_trace()
    if "blocking" in loops:
        jax.profiler.start_trace(f"{out}/blocking")
        for i in range(5):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                w = jax.block_until_ready(train_step(w, x))
        jax.profiler.stop_trace()
    if "generate" in loops:  # a generation: one prefill, then one decode execution per token; no step markers
        @jax.jit
        def prefill(a):
            return jnp.tanh(jnp.tanh(jnp.tanh(a @ a) @ a) @ a)

        @jax.jit
        def decode(a, t):
            return jnp.tanh(t @ a)

        a, t = jnp.ones((384, 384)) / 384, jnp.ones((1, 384))
        jax.block_until_ready((prefill(a), decode(a, t)))  # compiled before the trace
        jax.profiler.start_trace(f"{out}/generate")
        a = prefill(a)
        for i in range(6):
            t = decode(a, t)
        jax.block_until_ready(t)
        jax.profiler.stop_trace()
    if "unmarked" in loops:
        jax.profiler.start_trace(f"{out}/unmarked")
        for i in range(4):
            w = train_step(w, x)
        jax.block_until_ready(w)
        jax.profiler.stop_trace()
    if "midstep" in loops:  # the trace stopped inside the last step's annotation, right after its launch
        jax.profiler.start_trace(f"{out}/midstep")
        for i in range(5):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                w = train_step(w, x)
                if i < 4:
                    w = jax.block_until_ready(w)
                else:
                    jax.profiler.stop_trace()
        jax.block_until_ready(w)
    if "noblock" in loops:  # the README's loop without block_until_ready: steps may run after the trace stops
        jax.profiler.start_trace(f"{out}/noblock")
        for i in range(5):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                w = train_step(w, x)
        jax.profiler.stop_trace()
        jax.block_until_ready(w)
    if "cut" in loops:  # the trace stopped while the last step's execution ran, as a remote capture may stop it
        import threading
        from jax.experimental import io_callback

        held, reached, resume = [False], threading.Event(), threading.Event()

        def pause(x):  # halfway through an execution that is held: wait there until the trace has stopped
            if held[0]:
                reached.set()
                resume.wait(120)
            return x

        @jax.jit
        def long_step(a):
            for i in range(24):
                a = jnp.tanh(a @ a)
                if i == 8:  # the ops after it use its result: none runs before it returns
                    a = io_callback(pause, jax.ShapeDtypeStruct(a.shape, a.dtype), a)
            return a

        def held_step(a, step):  # step ``step``, its execution held halfway while the trace stops
            held[0] = True
            out = []
            with jax.profiler.StepTraceAnnotation("train", step_num=step):
                # XLA:CPU runs a program with a host callback in the calling thread: launched from another one
                runner = threading.Thread(target=lambda: out.append(long_step(a)))
                runner.start()
                reached.wait(120)
            jax.profiler.stop_trace()
            resume.set()
            runner.join()
            held[0] = False
            reached.clear()
            resume.clear()
            return jax.block_until_ready(out[0])

        a = jax.block_until_ready(long_step(jnp.ones((256, 256)) / 256))
        jax.profiler.start_trace(f"{out}/cut")
        for step in range(4):
            with jax.profiler.StepTraceAnnotation("train", step_num=step):
                a = jax.block_until_ready(long_step(a))
        a = held_step(a, 4)  # step 4's execution stopped after 9 of its 24 matmuls
        cost = long_step.lower(a).compile().cost_analysis()
        json.dump({"flops": (cost[0] if isinstance(cost, list) else cost)["flops"]}, open(f"{out}/cut/facts.json", "w"))
        jax.profiler.start_trace(f"{out}/cutsole")  # a capture of one execution only, the stop a third through
        a = held_step(a, 0)
    if "eval" in loops:  # the README's loop with an eval program launched between marked steps, every other step
        @jax.jit
        def eval_step(w, x):
            h = x
            for _ in range(8):
                h = jnp.tanh(h @ w[0] @ w[1])
            return jnp.mean(h)

        loss = jax.block_until_ready(eval_step(w, x))  # compiled before the trace
        jax.profiler.start_trace(f"{out}/eval")
        for i in range(6):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                w = train_step(w, x)
            if i % 2 == 1:
                loss = eval_step(w, x)
        jax.block_until_ready((w, loss))
        jax.profiler.stop_trace()
    if "evalunmarked" in loops:  # no step markers (Keras's TensorBoard callback marks none); an eval every other
        @jax.jit                 # step, compiled at its first call, inside the trace
        def validate(w, x):  # less op time than the train step's
            return jnp.mean(jnp.sin(x @ w[0]))

        @jax.jit
        def fit_step(w, x):  # the train step under a name of its own: its dump is not jit_train_step's
            return train_step(w, x)

        xb = jnp.ones((512, 64))  # a batch that keeps the train step the program with the most op time
        v = jax.block_until_ready(fit_step(w, xb))
        jax.profiler.start_trace(f"{out}/evalunmarked")
        for i in range(6):
            v = fit_step(v, xb)
            if i % 2 == 1:
                loss = validate(v, x)
        jax.block_until_ready((v, loss))
        jax.profiler.stop_trace()
        cost = fit_step.lower(v, xb).compile().cost_analysis()
        json.dump({"flops": (cost[0] if isinstance(cost, list) else cost)["flops"]},
                  open(f"{out}/evalunmarked/facts.json", "w"))
    if "lambdas" in loops:  # programs whose PjitFunction names are not their module names
        def scale_(a):
            return a * 0.5

        square = jax.jit(lambda a: jnp.tanh(a @ a))  # both jit__lambda: their launch events name the module only
        mix = jax.jit(lambda a: jnp.sin(a) + a @ a.T)
        shrink = jax.jit(scale_)  # jit_scale (the trailing _ dropped)
        a = jnp.ones((192, 192)) / 192
        jax.block_until_ready(shrink(mix(square(a))))
        jax.profiler.start_trace(f"{out}/lambdas")
        for i in range(5):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                a = shrink(mix(square(a)))
        jax.block_until_ready(a)
        jax.profiler.stop_trace()
        costs = [f.lower(a).compile().cost_analysis() for f in (square, mix, shrink)]
        json.dump({"flops": sum((c[0] if isinstance(c, list) else c)["flops"] for c in costs)},
                  open(f"{out}/lambdas/facts.json", "w"))
    cost = train_step.lower(w, x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    json.dump({"flops": cost["flops"]}, open(f"{out}/facts.json", "w"))
""")


def _run(out: Path, width: int, loops: str, act: str = "tanh") -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={out}/hlo --xla_dump_hlo_as_text")
    subprocess.run([sys.executable, "-c", JOB, str(out), str(width), loops, act], check=True, env=env,
                   capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("job")
    _run(root / "run", 128, "readme,blocking,unmarked,midstep,noblock,cut,generate,lambdas,eval,evalunmarked")
    _run(root / "other", 96, "readme", "sin")  # "another run": same module names, the model changed
    return root


def _flops(job: Path) -> float:
    return json.loads((job / "run" / "facts.json").read_text())["flops"]


def test_readme_loop_counts_every_step(job):
    """Async dispatch: the ops of step i run after its annotation closed; they still belong to step i."""
    a = analyze(job / "run" / "readme", hlo=[job / "run" / "hlo"], chip=str(HOST_CHIP))
    s = a.summary
    assert s.join.events_joined == s.join.events_total
    assert s.steps_used == (1, 2, 3, 4)
    train = a.ops[a.ops["module"].astype(str) == "jit_train_step"]
    per_step = train[train["counted"] & train["step"].notna()].groupby("step")["flops"].sum()
    assert list(per_step.index) == [1, 2, 3, 4]
    assert per_step.to_numpy() == pytest.approx(_flops(job), rel=1e-6)  # XLA's count, every step
    assert s.flops_per_step >= _flops(job)  # plus the helper jits launched in the step
    # each step's ops are those of the execution launched inside it: one execution per step
    ev = load_profile(discover([job / "run" / "readme"], [job / "run" / "hlo"])).events()  # op rows keep no run ids
    ev = ev[ev["module"].astype(str) == "jit_train_step"]
    runs = ev.dropna(subset=["step"]).groupby("step")["run_id"].nunique()
    assert (runs == 1).all()
    assert s.step_time_mean_s > 0 and s.host_step_time_mean_s > 0


def test_launches_of_lambdas_and_renamed_functions_are_tied_to_their_executions(job):
    """Two jax.jit(lambda ...) programs are both jit__lambda (their launch events name the module only, each
    program counts its own run ids) and a function ``scale_`` compiles to jit_scale, while its PjitFunction event
    says ``scale_``: 92.5 % of such a loop's op time was "not tied to its launch" and left out of the steps (a
    user's MFU counted one program of three). Each step holds one execution of each program; FLOPs per step are
    XLA's cost_analysis of the three."""
    run = job / "run" / "lambdas"
    a = analyze(run, chip=str(HOST_CHIP))
    s = a.summary
    assert not any("tied to its launch" in n or "launched outside the steps" in n for n in s.notes), s.notes
    assert s.steps_used == (1, 2, 3, 4)
    flops = json.loads((run / "facts.json").read_text())["flops"]
    assert s.flops_per_step == pytest.approx(flops, rel=1e-6)
    ev = load_profile(discover([run], [])).events().dropna(subset=["step"])
    per_step = ev.groupby(["step", "program_id"])["run_id"].nunique()
    assert len(ev["program_id"].unique()) == 3 and (per_step == 1).all() and len(per_step) == 3 * 5


PMAP_JOB = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp
    from flax.jax_utils import replicate

    def sgd(w, x):
        return w - 0.1 * jax.lax.pmean(x.T @ jnp.tanh(x @ w), "batch")

    step = jax.pmap(sgd, axis_name="batch")
    w = replicate(jnp.ones((128, 128)) / 128)  # its sharding is not pmap's output's: step 1 compiles again
    x = jnp.ones((2, 64, 128))
    jax.profiler.start_trace(sys.argv[1])
    for i in range(5):
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
            w = step(w, x)
    jax.block_until_ready(w)
    jax.profiler.stop_trace()
    cost = step.lower(w, x).compile().cost_analysis()
    json.dump({"flops": (cost[0] if isinstance(cost, list) else cost)["flops"]},
              open(f"{sys.argv[1]}/facts.json", "w"))
""")


@pytest.fixture(scope="module")
def pmap_run(tmp_path_factory) -> Path:
    pytest.importorskip("flax")
    run = tmp_path_factory.mktemp("pmap") / "pmap"
    subprocess.run([sys.executable, "-c", PMAP_JOB, str(run)], check=True, capture_output=True, timeout=300,
                   env=dict(os.environ, JAX_PLATFORMS="cpu"))
    return run


def test_a_pmap_that_compiles_twice_keeps_every_step(pmap_run):
    """The Flax ImageNet example's pattern (s37 trial): ``flax.jax_utils.replicate`` state into a ``jax.pmap``
    recompiles at step 1 (another input sharding), so the profile holds two programs named jit__fun. Their op
    time was "not tied to its launch", steps got 30 ms of a 240 ms execution, FLOPs per step were 40 % low. Each
    execution is tied to the Execute event of its run id: every step holds one execution, FLOPs per step are
    XLA's cost_analysis."""
    run = pmap_run
    a = analyze(run, chip=str(HOST_CHIP))
    s = a.summary
    assert not any("tied to its launch" in n or "outside the steps" in n for n in s.notes), s.notes
    assert s.steps_used == (1, 2, 3, 4)
    assert s.flops_per_step == pytest.approx(json.loads((run / "facts.json").read_text())["flops"], rel=1e-6)
    ev = load_profile(discover([run], [])).events()
    fun = ev[ev["module"].astype(str) == "jit__fun"]
    assert fun["program_id"].nunique() == 2  # compiled twice
    assert (fun.dropna(subset=["step"]).groupby("step")["run_id"].nunique() == 1).all()
    # each execution's launch is the Execute event of its run id, read here from the raw events
    import glob
    from parsers.xspace import read_xspace

    (cpu,) = [p for p in read_xspace(glob.glob(f"{run}/plugins/profile/*/*.xplane.pb")[0]).planes
              if p.name.startswith("/host:CPU")]
    raw = pd.DataFrame(cpu.columns(stats=("run_id",)))
    raw = raw[raw["name"].astype(str).str.startswith("CommonPjRtLoadedExecutable::Execute (jit__fun)")]
    launch_of = dict(zip(raw["run_id"].astype("int64"), raw["start_ps"]))
    assert len(launch_of) == 5
    got = fun.groupby("run_id")["launch_ps"].first()
    assert {int(r): int(t) for r, t in got.items()} == {r: int(launch_of[r]) for r in got.index.astype("int64")}


def test_the_step_that_compiled_again_is_named_not_blamed_on_the_host(pmap_run):
    """The same pmap loop: step 1 runs a second program named jit__fun (the replicated state's sharding is not
    pmap's output's) and waits while the host traces and compiles it. That step's wait was a host-bound finding
    with prefetch advice (s37 trial: 2.48 s of a 2.87 s step, 'feed the device ahead of time'); it is a
    recompile finding naming the step, the program compiled again and how to find the argument that changed."""
    a = analyze(pmap_run, chip=str(HOST_CHIP))
    found = {f.code: f for f in a.findings}
    f = found["recompile"]
    b = a.step_breakdown.groupby("step")[["step_time_s", "host_bound_s", "host_bound_compile_share"]].mean()
    assert b.loc[1, "host_bound_compile_share"] > 0.1 and b.loc[1, "host_bound_s"] > 0.5 * b.loc[1, "step_time_s"]
    assert f.title.startswith("step 1 waited ") and f.title.endswith("compiled again: jit__fun (step 1)")
    ids = sorted(int(p) for p in a.ops.loc[a.ops["module"].astype(str) == "jit__fun", "program_id"].unique())
    assert f.evidence == (f"jit__fun: program {ids[1]} first ran in step 1, after program(s) {ids[0]} of that name",)
    assert "JAX_EXPLAIN_CACHE_MISSES=1" in f.advice and "--warmup-steps 2" in f.advice
    assert f.lost_per_step_s == pytest.approx(b.loc[1, "host_bound_s"] / 4)  # step 1's wait, per used step
    # the profile's own compile events, read raw: XLA compiled twice, the second time inside step 1
    import glob
    from parsers.xspace import read_xspace

    (cpu,) = [p for p in read_xspace(glob.glob(f"{pmap_run}/plugins/profile/*/*.xplane.pb")[0]).planes
              if p.name.startswith("/host:CPU")]
    raw = pd.DataFrame(cpu.columns())
    compiles = raw.loc[raw["name"].astype(str) == "PjRtCpuClient::Compile", "start_ps"].to_numpy()
    during = {int(r.step): int(((compiles >= r.start_ps) & (compiles < r.end_ps)).sum())
              for r in a.steps.itertuples() if 1 <= r.step <= 4}
    assert during == {1: 1, 2: 0, 3: 0, 4: 0}, during
    # host-bound judges the other steps' waits alone (Python's per-call work in a 1 ms pmap step may be one)
    rows = a.step_breakdown
    rest = rows["host_bound_s"].where(rows["step"] != 1, 0.0).mean()
    assert ("host-bound" in found) == (rest >= 0.05 * rows["step_time_s"].mean())
    assert found["host-bound"].lost_per_step_s == pytest.approx(rest) if "host-bound" in found else True


def test_readme_loop_equals_blocking_loop(job):
    readme = analyze(job / "run" / "readme", hlo=[job / "run" / "hlo"], chip=str(HOST_CHIP))
    blocking = analyze(job / "run" / "blocking", hlo=[job / "run" / "hlo"], chip=str(HOST_CHIP))
    train = [a.ops[(a.ops["module"].astype(str) == "jit_train_step") & a.ops["counted"] & a.ops["step"].notna()]
             for a in (readme, blocking)]
    assert train[0]["flops"].sum() / 4 == pytest.approx(train[1]["flops"].sum() / 4, rel=0.01)
    assert blocking.summary.flops_per_step == pytest.approx(_flops(job), rel=1e-6)


def test_a_generation_without_markers_steps_on_its_decode_executions(job):
    """One prefill with the most op time, then a decode execution per token, no step markers: the prefill's one
    execution was the only step and the six decodes ran inside it ("1 used of 1", trial s29 P6). Now each decode
    execution is a step, and the prefill, launched before the first, is left out with a note."""
    s = analyze(job / "run" / "generate", chip=str(HOST_CHIP), warmup_steps=0).summary
    assert s.step_annotation == "executions of jit_decode"
    assert s.steps_total == 6 and len(s.steps_used) == 6
    assert any("of those run more than once, is a step" in n for n in s.notes), s.notes
    (outside,) = [n for n in s.notes if "launched outside the steps" in n]
    share = re.match(r"1 execution\(s\) \(([0-9.]+)% of op time\)", outside)
    assert share and float(share.group(1)) > 50, outside  # the prefill: most of the op time


def test_steps_of_an_unmarked_loop_name_their_program_when_others_share_its_name():
    """Two jax.jit(lambda ...) in an unmarked loop are both jit__lambda: "each execution of jit__lambda is a
    step" named neither; the program id tells them apart (a unique name stays as it is)."""
    ops = pd.DataFrame({"host": "h", "module": ["jit__lambda"] * 4 + ["jit_h"] * 2, "program_id": [6, 6, 9, 9, 3, 3],
                        "run_id": [1, 3, 2, 4, 5, 6], "start_ps": [0, 20, 10, 30, 40, 50],
                        "duration_ps": [9, 9, 5, 5, 1, 1]})
    steps, label = dominant_program_steps(ops, ops["start_ps"].to_numpy(np.int64))
    assert label == "jit__lambda (program 6)" and steps["start_ps"].tolist() == [0, 20]
    ops["module"] = ["jit__lambda"] * 2 + ["jit_g"] * 2 + ["jit_h"] * 2
    assert dominant_program_steps(ops, ops["start_ps"].to_numpy(np.int64))[1] == "jit__lambda"


def test_loop_that_never_blocks_gets_no_empty_steps(job):
    """Without ``block_until_ready`` before ``stop_trace`` the steps' device work may run after the trace stopped
    (a new user's profile: 5 steps of 0 FLOP, a host-bound finding, exit 0): steps without op events are left out
    with a note, or, when no step after the warm-up holds any, one line and exit 2."""
    r = subprocess.run([sys.executable, "-m", "traceroof.cli", "analyze", str(job / "run" / "noblock"), "--chip",
                        str(HOST_CHIP), "--format", "json"], capture_output=True, text=True, timeout=300)
    if r.returncode == 2:
        assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "no XLA op events" in r.stderr and "block_until_ready" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    s = report["summary"]
    assert s["flops_per_step"] > 0
    left_out = s["steps_total"] - s["warmup_steps"] - len(s["steps_used"])
    assert left_out == 0 or any("hold no op events" in n for n in s["notes"]), s["notes"]


def test_step_open_when_the_trace_stopped_is_left_out_with_a_note(job):
    """``stop_trace`` inside the last step's annotation: jax writes no unfinished annotation, and the step's
    launch is all that is left of it (its ops too, when cut off): 4 closed steps, a note for the fifth (which
    one depends on how far its execution got: none of its ops ran, or it was cut off, fewer ops than the others)."""
    a = analyze(job / "run" / "midstep", chip=str(HOST_CHIP))
    assert a.summary.steps_used == (1, 2, 3)
    assert any("a step still open when the trace stopped" in n or "were still running when the trace stopped" in n
               for n in a.summary.notes), a.summary.notes


def test_step_whose_execution_the_trace_stop_cut_is_left_out_with_a_note(job):
    """The trace stopped halfway through the last step's execution (its annotation closed at its launch): that
    step is left out with a note, not counted with part of its ops (a user's capture: 186 of 486 op events)."""
    from parsers.xspace import read_xspace

    (path,) = (job / "run" / "cut").rglob("*.xplane.pb")
    ev = read_xspace(path).plane("/host:CPU").events(stats=("run_id", "hlo_module", "hlo_op"))
    ev = ev[(ev["hlo_module"].astype(str) == "jit_long_step") & ev["hlo_op"].notna()]
    counts = ev.groupby("run_id").size().sort_index()
    assert len(counts) == 5 and 0 < counts.iloc[-1] < counts.iloc[:-1].min()  # the last one cut, counted here
    a = analyze(job / "run" / "cut", chip=str(HOST_CHIP))
    assert a.summary.steps_total == 5 and a.summary.steps_used == (1, 2, 3)
    flops = json.loads((job / "run" / "cut" / "facts.json").read_text())["flops"]
    assert a.summary.flops_per_step == pytest.approx(flops, rel=1e-9)
    assert any(n.startswith("1 execution(s)") and "still running when the trace stopped" in n
               and "with the 1 step(s) that launched them" in n for n in a.summary.notes), a.summary.notes


def test_a_capture_of_one_execution_that_the_stop_cut_holds_no_step(job):
    """A capture started while a job compiled held its first execution only, cut by the trace's stop (a user's:
    845 of 1,424 MFLOP per step reported as a whole step). With no other execution to compare it to, its HLO's
    entry schedule shows it ran only a beginning: no step is left, which the analysis says in one line, and a
    capture (:func:`op_events_problem`) tries again."""
    from traceroof.attach import op_events_problem

    (path,) = (job / "run" / "cutsole").rglob("*.xplane.pb")
    ev = load_profile(discover([path])).events()
    ev = ev[ev["module"].astype(str) == "jit_long_step"]
    whole = load_profile(discover([job / "run" / "cut"])).events()
    whole = whole[(whole["module"].astype(str) == "jit_long_step") & whole["step"].notna()]
    assert ev["run_id"].nunique() == 1 and 0 < len(ev) < whole.groupby("step").size().min()
    with pytest.raises(InputError, match="hold no XLA op events of a whole execution"):
        analyze(path, chip=str(HOST_CHIP))
    assert op_events_problem(path.parent).startswith("it holds no whole execution")
    # the same capture, its schedule complete (the ops it missed added back): a whole execution, kept
    order = entry_schedule(next(m for m in load_profile(discover([path])).modules if m.name == "jit_long_step"))
    ran = set(ev["hlo_op"].astype(str))
    assert _schedule_cut(order, ran) == "end" and _schedule_cut(order, ran | set(order)) == ""


def test_executions_too_few_to_compare_are_judged_by_their_entry_schedule():
    """A program with one or two executions in the profile: the first that ran only the end of its entry schedule
    (or none of it: only a loop body) began before the trace, the last that ran only its beginning was cut by the
    stop; a whole one, or one with gaps no cut explains, is kept. Without the HLO nothing is left out."""
    order = ("fusion.1", "dot.2", "fusion.3", "while.4", "copy.5")
    rows = [(1, 7, op) for op in ("fusion.1", "dot.2", "body.1")]  # program 1: run 7 only, cut after dot.2
    rows += [(2, 3, op) for op in ("fusion.3", "while.4", "copy.5")]  # program 2: run 3 began before the trace
    rows += [(2, 4, op) for op in order]  # then ran whole
    rows += [(3, 1, op) for op in ("fusion.1", "fusion.3", "copy.5")]  # program 3: gaps, no cut explains them
    rows += [(4, 9, "body.1")]  # program 4: only its loop body ran inside the trace
    ev = pd.DataFrame(rows, columns=["program_id", "run_id", "hlo_op"]).assign(module="jit_f")
    ev["run_id"] = ev["run_id"].astype("Int64")
    schedules = {(p, "jit_f"): order for p in (1, 2, 3, 4)}
    cut = left_out_executions(ev, np.zeros(len(ev), bool), schedules)
    assert sorted(set(zip(ev["program_id"][cut.after], ev["run_id"][cut.after]))) == [(1, 7), (4, 9)]
    assert sorted(set(zip(ev["program_id"][cut.before], ev["run_id"][cut.before]))) == [(2, 3)]
    assert (cut.executions_before, cut.executions_after) == (1, 2)
    none = left_out_executions(ev, np.zeros(len(ev), bool))
    assert not none.before.any() and not none.after.any()


def test_unmarked_profile_makes_each_execution_a_step(job):
    a = analyze(job / "run" / "unmarked", hlo=[job / "run" / "hlo"], chip=str(HOST_CHIP))
    assert a.summary.step_annotation == "executions of jit_train_step"
    assert a.summary.steps_total == 4 and a.summary.steps_used == (1, 2, 3)
    assert a.summary.flops_per_step == pytest.approx(_flops(job), rel=1e-6)
    assert any("each execution of jit_train_step" in n for n in a.summary.notes)


def test_dump_folder_as_xla_writes_it(job):
    kinds = {dump_file_kind(p) for p in (job / "run" / "hlo").iterdir() if p.is_file()}
    assert {"hlo_after", "hlo_before", "buffer-assignment", "memory-usage-report", "live-range"} <= kinds
    a = analyze(job / "run" / "blocking", hlo=[job / "run" / "hlo"], chip=str(HOST_CHIP))
    assert a.summary.join.events_joined == a.summary.join.events_total


def _stale_dump(job: Path, tmp_path: Path) -> Path:
    """The other run's train-step dump, renamed to the program id this run's profile carries."""
    ours = next((job / "run" / "hlo").glob("module_*.jit_train_step.cpu_after_optimizations.txt"))
    theirs = next((job / "other" / "hlo").glob("module_*.jit_train_step.cpu_after_optimizations.txt"))
    stale = tmp_path / "stale"
    stale.mkdir()
    shutil.copy(theirs, stale / ours.name)
    return stale


def test_stale_dump_never_overrides_the_profiles_hlo(job, tmp_path):
    stale = _stale_dump(job, tmp_path)
    a = analyze(job / "run" / "blocking", hlo=[stale], chip=str(HOST_CHIP))
    assert a.summary.flops_per_step == pytest.approx(_flops(job), rel=1e-6)
    note = next(n for n in a.summary.notes if "is not the HLO that ran" in n)
    assert str(stale) in note and "host:metadata" in note


def test_stale_dump_without_embedded_hlo_is_refused(job, tmp_path):
    stale = _stale_dump(job, tmp_path)
    trace = next((job / "run" / "blocking").rglob("*.trace.json.gz"))  # trace JSON carries no HLO
    with pytest.raises(HloMismatchError, match="is not the HLO of the profiled jit_train_step"):
        analyze(trace, hlo=[stale], chip=str(HOST_CHIP))
    ok = analyze(trace, hlo=[job / "run" / "hlo"], chip=str(HOST_CHIP))
    assert ok.summary.join.events_joined == ok.summary.join.events_total


def test_unparsable_extra_file_is_a_note(job, tmp_path):
    folder = tmp_path / "dump"
    shutil.copytree(job / "run" / "hlo", folder)
    (folder / "module_9999.jit_broken.cpu_after_optimizations.txt").write_text("HloModule jit_broken\n((( nope\n")
    a = analyze(job / "run" / "blocking", hlo=[folder], chip=str(HOST_CHIP))
    assert a.summary.join.events_joined == a.summary.join.events_total


def test_run_ids_wrap_and_alignment():
    assert list(_unwrapped(np.array([2**31 - 2, 2**31 - 1, -(2**31), -(2**31) + 1]))) == [
        2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1]
    # the profile started after launch 0 (its execution still ran) and stopped before the last one ran
    launches = np.array([10, 20, 30, 40, 50])
    first_op = np.array([15, 25, 60, 70])
    assert _best_offset(np.arange(4), first_op, launches) == (0, 4)
    # every launch precedes every op under either alignment: run 10 ran while the trace recorded, so it was not
    # launched after the last launch the trace holds; run 7, still queued when the trace started, has none
    ops = pd.DataFrame({"module": ["jit_f"] * 4, "run_id": pd.array([7, 8, 9, 10], "Int64"),
                        "start_ps": [35, 45, 55, 100]})
    lau = pd.DataFrame({"module": ["jit_f"] * 3, "start_ps": [30, 40, 50]})
    when, matched = launch_times(ops, lau)
    assert matched == 3 and np.isnan(when[0]) and list(when[1:]) == [30, 40, 50]
    # unless run 10 was still running when the trace stopped (fewer op events than the runs before it): its launch
    # event, still open, was not written; then the smallest shift
    ops = pd.DataFrame({"module": ["jit_f"] * 10, "run_id": pd.array([7] * 3 + [8] * 3 + [9] * 3 + [10], "Int64"),
                        "start_ps": [35, 36, 37, 45, 46, 47, 55, 56, 57, 100]})
    when, matched = launch_times(ops, lau)
    assert matched == 3 and list(when[:9]) == [30] * 3 + [40] * 3 + [50] * 3 and np.isnan(when[9])
    assert _best_offset(np.arange(4), np.array([35, 45, 55, 100]), lau["start_ps"].to_numpy(), last_cut=True) == (0, 3)


def test_launches_that_carry_run_ids_are_matched_by_them():
    """PjRt's Execute events of multi-device programs carry the run id of the execution they launch. Two programs
    under one name (a pmap recompiled after its first step: both jit__fun) on different devices, whose executions
    ran out of launch order (run 3 of program 1 before run 2 of program 2): order alone cannot tie program 1's
    runs 1 and 3 (not consecutive), the run ids can; a run no launch carries (launched before the trace) has none.
    """
    ops = pd.DataFrame({"module": ["jit__fun"] * 5, "program_id": [1, 1, 2, 2, 1],
                        "run_id": pd.array([1, 3, 2, 2, 0], "Int64"), "start_ps": [50, 60, 90, 95, 40]})
    lau = pd.DataFrame({"module": ["jit__fun"] * 3, "start_ps": [10, 20, 30], "run_id": [1.0, 2.0, 3.0]})
    when, matched = launch_times(ops, lau)
    assert matched == 3 and list(when[:4]) == [10, 30, 20, 20] and np.isnan(when[4])
    when, matched = launch_times(ops, lau.drop(columns="run_id"))  # the same by order: program 1 is untied
    assert matched == 0 and np.isnan(when).all()


def test_executions_partly_in_the_profile_are_left_out():
    """Run ids 5-9 of one program, 10-13 of another: 5 was launched before the trace (the first one tied to a
    launch is 6), 9 was cut by the stop (it lacks op c), 13 only ran its loop body fewer times (no op missing)."""
    rows = [(5, "abc"), (6, "abc"), (7, "abc"), (8, "abc"), (9, "a"), (10, "xyy"), (11, "xyyy"), (12, "xyy"),
            (13, "xy")]
    ev = pd.DataFrame([(1 if run < 10 else 2, "jit_f" if run < 10 else "jit_g", run, op)
                       for run, ops in rows for op in ops], columns=["program_id", "module", "run_id", "hlo_op"])
    ev["run_id"] = ev["run_id"].astype("Int64")
    tied = (ev["run_id"] >= 6).to_numpy()
    cut = left_out_executions(ev, tied)
    assert sorted(set(ev["run_id"][cut.before])) == [5] and sorted(set(ev["run_id"][cut.after])) == [9]
    assert (cut.executions_before, cut.executions_after) == (1, 1)
    cut = left_out_executions(ev, np.zeros(len(ev), bool))  # no launches: only the cut ones
    assert not cut.before.any() and sorted(set(ev["run_id"][cut.after])) == [9]
    assert (cut.executions_before, cut.executions_after) == (0, 1)
    ev = ev[(ev["run_id"] != 5) | (ev["hlo_op"] != "a")].reset_index(drop=True)  # 5 cut at the start: no a
    cut = left_out_executions(ev, np.zeros(len(ev), bool))
    assert sorted(set(ev["run_id"][cut.before])) == [5] and cut.executions_before == 1


def test_launch_times_by_module_codes_and_wrapped_run_ids():
    # a categorical module column (a category without events, an event without module) and as text; jit_f's run
    # ids wrap (their span is not a small table), jit_g's repeat
    module = ["jit_f", "jit_g", "jit_f", "jit_g", None, "jit_f", "jit_g"]
    run = pd.array([2**31 - 1, 5, -(2**31), 6, 9, -(2**31) + 1, 5], "Int64")
    start = np.array([35, 8, 45, 4, 50, 55, 2])
    lau = pd.DataFrame({"module": ["jit_g", "jit_f", "jit_g", "jit_f", "jit_f"], "start_ps": [1, 30, 3, 40, 50]})
    for col in (pd.Categorical(module, categories=["unused", "jit_g", "jit_f"]), np.array(module, dtype=object)):
        when, matched = launch_times({"module": col, "run_id": run, "start_ps": start}, lau)
        assert matched == 5 and when[[0, 2, 5, 1, 6, 3]].tolist() == [30, 40, 50, 1, 1, 3] and np.isnan(when[4])


def test_assign_steps_matches_a_scan_of_the_steps():
    # times in runs of equal values (an execution's events) and not, on one key and on two (one without steps),
    # at step starts and ends, before the first step and in gaps
    rng = np.random.default_rng(4)
    steps = pd.DataFrame({"host": ["a", "a", "b", "a"], "step": pd.array([3, 4, 7, 5], "Int64"),
                          "start_ps": [10, 20, 10, 40], "end_ps": [20, 30, 50, 45]})
    for times in (np.repeat(rng.integers(0, 60, 40), rng.integers(1, 5, 40)), rng.integers(0, 60, 200)):
        for keys in (np.full(len(times), "a"), rng.choice(["a", "b", "c"], len(times))):
            want = [next((int(s) for h, s, a, b in steps.itertuples(index=False) if h == k and a <= t < b), -1)
                    for t, k in zip(times, keys)]
            assert assign_steps(times, pd.Categorical(keys), steps).tolist() == want


def test_trace_json_with_garbage_ids_is_read_not_crashed(job, tmp_path):
    import gzip

    src = next((job / "run" / "blocking").rglob("*.trace.json.gz"))
    data = json.loads(gzip.decompress(src.read_bytes()))
    bad = ["x", 2**70, "1.5", "nan"]
    n = 0
    for e in data["traceEvents"]:
        if isinstance(e, dict) and isinstance(e.get("args"), dict) and "run_id" in e["args"]:
            e["args"]["run_id"] = bad[n % 4]
            e["args"]["program_id"] = bad[(n + 1) % 4]
            n += 1
    assert n > 10
    broken = tmp_path / "broken.trace.json.gz"
    broken.write_bytes(gzip.compress(json.dumps(data).encode()))
    a = analyze(broken, chip=str(HOST_CHIP))  # ids unusable: events still read, as NA ids, no exception
    assert a.summary.join.events_total > 0
    assert a.ops["program_id"].isna().all()
    assert load_profile(discover([broken])).events()["run_id"].isna().all()


def test_device_step_spans_are_never_negative_and_follow_every_earlier_step():
    from traceroof.steps import device_step_spans

    steps = pd.DataFrame({"host": ["h", "h", "h"], "step": pd.array([0, 1, 2], "Int64")})
    # step 0 runs 0-100 ps; step 1's only op (10-50 ps) ran inside it; step 2 starts at 60 ps and ends at 300 ps
    spans = device_step_spans(np.array([0, 1, 2]), np.array(["h", "h", "h"]), np.array([0, 10, 60]),
                              np.array([100, 50, 300]), steps)
    got = list(zip(spans["device_start_ps"].astype(int), spans["device_end_ps"].astype(int)))
    assert got == [(0, 100), (50, 50), (100, 300)]  # step 2 starts after step 0's end, not only step 1's


def test_step_markers_whose_name_is_missing_still_make_steps():  # fuzz: argmax of an empty sequence
    from traceroof.events import _steps_from_events

    ev = pd.DataFrame({"name": pd.Categorical([None, None, None], categories=[]), "step_num": [0, 1, 2],
                       "start_ps": [0, 10, 20], "duration_ps": [5, 5, 5]})
    steps, name = _steps_from_events(ev, "h")
    assert name == "" and steps["step"].tolist() == [0, 1, 2] and steps["end_ps"].tolist() == [5, 15, 25]


def test_launches_after_the_last_step_without_ops_are_counted():
    from traceroof.events import _launches_after_steps

    launches = pd.DataFrame({"start_ps": np.array([10, 110, 210, 400, 500], np.int64)})
    steps = {"start_ps": np.array([0, 100, 200]), "duration_ps": np.array([90, 90, 90])}
    # 400 ran (its execution matched), 500 is the launch of the step open at stop_trace
    assert _launches_after_steps(launches, np.array([10.0, 110.0, 210.0, 400.0]), steps) == 1
    assert _launches_after_steps(launches, np.array([10.0, 110.0, 210.0, 400.0, 500.0]), steps) == 0
    assert _launches_after_steps(launches, np.array([]), {"start_ps": np.array([]), "duration_ps": np.array([])}) == 0


def _raw_spans(logdir: Path) -> tuple[dict[str, list[tuple[float, float]]], list[tuple[int, float, float]]]:
    """Read by jax.profiler.ProfileData, not by traceroof: per program (module), each execution's (first op
    start, last op end) in ns, by run id, in order of start; and each StepTraceAnnotation (step, start, end)."""
    from jax.profiler import ProfileData

    (path,) = logdir.glob("plugins/profile/*/*.xplane.pb")
    runs: dict[tuple[str, int], list[float]] = {}
    marks = []
    for plane in ProfileData.from_file(str(path)).planes:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                if "hlo_module" in stats and "run_id" in stats and "hlo_op" in stats:
                    span = runs.setdefault((str(stats["hlo_module"]), int(stats["run_id"])), [np.inf, -np.inf])
                    span[0], span[1] = min(span[0], e.start_ns), max(span[1], e.start_ns + e.duration_ns)
                elif e.name == "train" and "step_num" in stats:
                    marks.append((int(stats["step_num"]), e.start_ns, e.start_ns + e.duration_ns))
    out: dict[str, list[tuple[float, float]]] = {}
    for (module, _), (a, b) in sorted(runs.items(), key=lambda kv: kv[1][0]):
        out.setdefault(module, []).append((a, b))
    return out, sorted(marks)


def test_an_eval_launched_between_steps_is_not_step_time(job):
    """An eval program launched between marked training steps runs on the device between them: it was counted in
    the next step's time (its period from the previous step's end), so the step time, MFU and the slowest step
    carried it (trial s40: 441.5 ms against 410.3 ms of training). Now each step's time leaves it out, and the
    breakdown names it (``other_programs_s`` / ``other_programs``). Checked against the raw events' execution spans
    and step markers."""
    logdir = job / "run" / "eval"
    spans, marks = _raw_spans(logdir)
    train, evals = spans["jit_train_step"], spans["jit_eval_step"]
    assert len(train) == 6 and len(evals) == 3 and [m[0] for m in marks] == list(range(6))
    # a step ends when its marker and its execution have both ended; a step's period runs from the previous end
    ends = [max(m[2], t[1]) for m, t in zip(marks, train)]
    a = analyze(logdir, hlo=[job / "run" / "hlo"], chip=str(HOST_CHIP))
    assert a.summary.steps_used == (1, 2, 3, 4, 5)
    b = a.step_breakdown.set_index("step")
    expected = []
    for i in range(1, 6):
        lo, hi = ends[i - 1], ends[i]
        # the evals inside the period, less where this step's own execution ran beside them
        other = sum(max(min(e1, hi) - max(e0, lo), 0) - max(min(e1, train[i][1]) - max(e0, train[i][0]), 0)
                    for e0, e1 in evals)
        assert b.loc[i, "other_programs_s"] == pytest.approx(other * 1e-9, abs=2e-9), i
        assert b.loc[i, "step_time_s"] + b.loc[i, "other_programs_s"] == pytest.approx((hi - lo) * 1e-9, abs=2e-9)
        assert (b.loc[i, "other_programs"] == "jit_eval_step") == (other > 0), i
        assert sum(b.loc[i, c] for c in COMPONENTS) == pytest.approx(b.loc[i, "step_time_s"], abs=1e-9)
        expected.append((hi - lo - other) * 1e-9)
    assert sum(b["other_programs_s"] > 0) == 2  # steps 2 and 4; the third eval ran after the last step
    assert a.summary.step_time_mean_s == pytest.approx(np.mean(expected), rel=1e-6)
    (note,) = [n for n in a.summary.notes if "launched outside the steps" in n]
    assert "of jit_eval_step were launched" in note, note
    line = other_programs_line(a.step_breakdown)
    assert line.startswith("programs launched outside the steps (jit_eval_step) ran in the periods of steps 2, 4")


def test_an_eval_between_executions_of_an_unmarked_loop_is_not_step_work(job):
    """Without step markers each execution of the dominant program is a step, from its launch to the next; an eval
    run every other step then fell inside a step and was counted as its work (s42 trial, Keras ``fit`` profiled
    as its TensorBoard callback does: 2.39 GFLOP per step, "the work varies from step to step", against
    cost_analysis's 1.95 of the train step). A program that runs in only some steps is not the step's: every step
    does XLA's count of the train step, the eval is named as a program launched outside the steps, and its first
    call's compile is named in the step whose period holds it (it was "no program of the profile first ran
    there")."""
    logdir = job / "run" / "evalunmarked"
    spans, marks = _raw_spans(logdir)
    assert not marks and len(spans["jit_fit_step"]) == 6 and len(spans["jit_validate"]) == 3
    a = analyze(logdir, hlo=[job / "run" / "hlo"], chip=str(HOST_CHIP))
    assert a.summary.step_annotation == "executions of jit_fit_step"
    assert a.summary.steps_used == (1, 2, 3, 4, 5)
    xla = json.loads((logdir / "facts.json").read_text())["flops"]
    flops = a.ops[a.ops["step"].notna() & a.ops["counted"]].groupby("step")["flops"].sum()
    assert flops.to_numpy() == pytest.approx(xla, rel=1e-6)  # XLA's count of the train step, every step
    assert a.summary.flops_per_step == pytest.approx(xla, rel=1e-6)
    assert a.ops.loc[a.ops["module"].astype(str) == "jit_validate", "step"].isna().all()
    b = a.step_breakdown.set_index("step")
    # launched after executions 1, 3 and 5; each runs in the period of the step that launched it or (async) of the
    # next: all of their time is left out of those steps, and only theirs
    assert len(set(b.index[b["other_programs"] == "jit_validate"])) >= 3
    assert b["other_programs_s"].sum() == pytest.approx(sum(e - s for s, e in spans["jit_validate"]) * 1e-9,
                                                        abs=3e-9)
    first = next(f for f in a.findings if f.code == "recompile")
    assert "first run: jit_validate (step 1)" in first.title, first.title  # compiled at its first call
