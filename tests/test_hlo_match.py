"""Which dump describes the profiled program, on real JAX jobs run here: same-named modules and another run's dumps.

One job trains at batch 32, a second one at batch 256 (the same script: the same module names and program ids,
other shapes), each with ``--xla_dump_to``. Besides the train step, each runs two jitted functions compiled twice
with other shapes before the profile: ``jit_prep`` whose compilations differ in their ops (a sine for a vector, a
matmul for the batch) and ``jit_scale`` whose compilations share their op names. Figures are checked against XLA's
own ``compiled.memory_analysis()`` and ``cost_analysis()``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("jax")

from parsers.hlo import HloModule  # noqa: E402
from parsers.hlo_text import parse_hlo_text  # noqa: E402
from traceroof import analyze  # noqa: E402
from traceroof.hlo_source import HloMismatchError, check_dumps  # noqa: E402
from traceroof.report import render  # noqa: E402

from tests.conftest import HOST_CHIP  # noqa: E402

JOB = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    out, batch = sys.argv[1], int(sys.argv[2])

    @jax.jit
    def train_step(w, x):
        def loss(w):
            return jnp.mean((jnp.tanh(x @ w[0]) @ w[1]) ** 2)
        g = jax.grad(loss)(w)
        return [a - 0.1 * b for a, b in zip(w, g)]

    @jax.jit
    def scale(x):  # one op name (broadcast_multiply_fusion) whatever the shape
        return x * 2

    @jax.jit
    def prep(x):  # a sine for a vector, a matmul for the batch: the same name, other ops
        return x.T @ x if x.ndim == 2 else jnp.sin(x)

    key = jax.random.PRNGKey(0)
    w = [jax.random.normal(key, (64, 256)) / 8, jax.random.normal(key, (256, 64)) / 8]
    x = jnp.ones((batch, 64))
    scale(jnp.ones(3)), prep(jnp.ones(5))  # compiled before the profile, never run in it
    w = jax.block_until_ready(train_step(w, scale(x)))
    jax.profiler.start_trace(f"{out}/tb")
    for i in range(3):
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
            x2 = scale(x)
            w = jax.block_until_ready(train_step(w, x2) + [prep(x2)])[:2]
    jax.profiler.stop_trace()
    ma = train_step.lower(w, x).compile().memory_analysis()
    prep_cost = prep.lower(x).compile().cost_analysis()
    prep_cost = prep_cost[0] if isinstance(prep_cost, list) else prep_cost
    json.dump({"allocated_bytes": ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
               - ma.alias_size_in_bytes, "prep_flops": prep_cost["flops"]}, open(f"{out}/facts.json", "w"))
""")


def _run(out: Path, batch: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={out}/hlo --xla_dump_hlo_as_text")
    subprocess.run([sys.executable, "-c", JOB, str(out), str(batch)], check=True, env=env, capture_output=True,
                   timeout=300)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hlo_match")
    _run(root / "b32", 32)
    _run(root / "b256", 256)
    return root


def _facts(job: Path, run: str) -> dict:
    return json.loads((job / run / "facts.json").read_text())


def _trace_json(job: Path, run: str) -> Path:
    return next((job / run / "tb").rglob("*.trace.json.gz"))


def _train_step_dump(folder: Path) -> Path:
    return next(folder.glob("module_*.jit_train_step.cpu_after_optimizations.txt"))


def _other_runs_dump(job: Path, tmp_path: Path) -> Path:
    """The batch-256 run's train-step dump and XLA's reports beside it, under the program id and name of the
    batch-32 run's train step (the same script compiles in the same order: the user's case)."""
    ours = _train_step_dump(job / "b32" / "hlo").name.split(".")[0]
    theirs = _train_step_dump(job / "b256" / "hlo").name.split(".")[0]
    folder = tmp_path / "other"
    folder.mkdir()
    for f in (job / "b256" / "hlo").glob(f"{theirs}.jit_train_step.*"):
        shutil.copy(f, folder / f.name.replace(theirs, ours, 1))
    return folder


def test_memory_comes_from_the_dump_of_the_program_that_ran(job):
    allocated = _facts(job, "b32")["allocated_bytes"]
    assert _facts(job, "b256")["allocated_bytes"] > 2 * allocated  # the other run's figure is another one
    a = analyze(job / "b32" / "tb", hlo=[job / "b32" / "hlo"], chip=HOST_CHIP)
    peak = a.memory.peak
    assert peak.program == "jit_train_step" and peak.source == "xla_buffer_assignment"
    assert peak.peak_bytes == peak.xla_report_total_bytes == allocated


def test_another_runs_buffer_assignment_is_never_used(job, tmp_path):
    """The profile carries its own HLO, so the join drops the other run's dump; the memory view must too: the
    peak is traceroof's live-range estimate of the profiled program, with a note naming the dump."""
    other = _other_runs_dump(job, tmp_path)
    own = analyze(job / "b32" / "tb", chip=HOST_CHIP)
    a = analyze(job / "b32" / "tb", hlo=[other], chip=HOST_CHIP)
    assert any("is not the HLO that ran" in n and str(other) in n for n in a.summary.notes)
    peak = a.memory.peak
    assert peak.source == "traceroof_live_ranges" and peak.xla_report_total_bytes is None and not peak.files
    assert peak.peak_bytes == own.memory.peak.peak_bytes
    allocated = _facts(job, "b32")["allocated_bytes"]
    assert 0.5 * allocated < peak.peak_bytes < 1.5 * allocated  # an estimate of this run, not of batch 256's
    assert any(str(_train_step_dump(other)) in n and "not used" in n for n in a.memory.notes), a.memory.notes
    assert any("describes none of the profiled programs" in n for n in a.summary.notes)


def test_trace_json_picks_the_same_named_dump_whose_ops_ran(job):
    """Trace JSON has no program ids: of jit_prep's two dumps the one holding the op that ran joins; jit_scale's
    two dumps both hold it, so neither is used and a note says so; the train step's XLA figures are used."""
    facts = _facts(job, "b32")
    a = analyze(_trace_json(job, "b32"), hlo=[job / "b32" / "hlo"], chip=HOST_CHIP)
    ops = a.ops.assign(module=a.ops["module"].astype(str))
    prep = ops[ops["module"] == "jit_prep"]
    assert len(prep) and prep["attributed"].all()
    assert prep.groupby("step")["flops"].sum().to_numpy() == pytest.approx(facts["prep_flops"], rel=1e-6)
    assert "jit_scale" in a.summary.join.unmatched_modules
    assert any("2 dumps of jit_scale (2 different programs) hold every op its events ran" in n
               for n in a.summary.notes), a.summary.notes
    unjoined = a.summary.join.events_total - a.summary.join.events_joined
    assert unjoined == ops.loc[ops["module"] == "jit_scale", "events"].sum() > 0
    peak = a.memory.peak
    assert peak.source == "xla_buffer_assignment" and peak.peak_bytes == facts["allocated_bytes"]
    assert {p.program for p in a.memory.programs} == {"jit_train_step", "jit_prep"}


def test_trace_json_with_another_programs_dumps_is_still_refused(job, tmp_path):
    """A folder whose only dump of a profiled name lacks the op that ran is another program's: exit 2."""
    folder = tmp_path / "prep"
    folder.mkdir()
    vector = next(f for f in (job / "b32" / "hlo").glob("module_*.jit_prep.cpu_after_optimizations.txt")
                  if "sine" in f.read_text())
    shutil.copy(vector, folder / vector.name)
    with pytest.raises(HloMismatchError, match=r"is not the HLO of the profiled jit_prep: the profile ran 'dot_gen"):
        analyze(_trace_json(job, "b32"), hlo=[folder], chip=HOST_CHIP)


# -- check_dumps on small modules: events without program ids, several dumps of one name -----------------------

def _dump(pid: int, ops: str, dims: str = "4") -> HloModule:
    body = "".join(f"  %{op} = f32[{dims}] negate(%p)\n" for op in ops.split())
    (m,) = parse_hlo_text(f"HloModule jit_f\n\nENTRY %main (p: f32[{dims}]) -> f32[{dims}] {{\n"
                          f"  %p = f32[{dims}] parameter(0)\n{body}  ROOT %r = f32[{dims}] negate(%p)\n}}\n",
                          source=f"module_{pid:04d}.jit_f.cpu_after_optimizations.txt")
    m.program_id = pid
    return m


def _events(*ops: str, pid: int | None = None) -> pd.DataFrame:
    return pd.DataFrame({"program_id": pd.array([pid] * len(ops), "Int64"), "module": ["jit_f"] * len(ops),
                         "hlo_op": list(ops)})


def test_check_dumps_tells_same_named_dumps_apart_by_the_ops_that_ran():
    a, b, c = _dump(1, "a"), _dump(2, "b"), _dump(3, "b", "8")
    notes: list[str] = []
    assert check_dumps([a, b], _events("b"), notes) == [b] and not notes  # the one holding the op
    assert check_dumps([b, _dump(5, "b")], _events("b"), notes)[0].program_id == 2 and not notes  # equal: first
    assert check_dumps([a, b, c], _events("b"), notes) == [] and notes  # 2 differ: none of the name
    assert "2 dumps of jit_f (2 different programs) hold every op" in notes[-1]
    assert check_dumps([a, b], _events("a", "b"), notes) == [] and "only between them" in notes[-1]  # mixed
    with pytest.raises(HloMismatchError, match=r"none of the 2 dumps of jit_f .* it ran 'z'"):
        check_dumps([a, b], _events("a", "z"), [])
    with pytest.raises(HloMismatchError, match=r"is not the HLO of the profiled jit_f: the profile ran 'a'"):
        check_dumps([b], _events("a"), [])
    # with program ids the dump of that id is checked, the others of the name kept (they did not run)
    assert check_dumps([a, b], _events("b", pid=2), notes) == [a, b]
    with pytest.raises(HloMismatchError, match=r"profiled jit_f\(1\): the profile ran 'b'"):
        check_dumps([a, b], _events("b", pid=1), [])


def test_a_trace_json_with_dumps_points_to_the_xplane_beside_it(tmp_path):
    """JAX writes <host>.trace.json.gz beside <host>.xplane.pb. A trace JSON carries no HLO, so another
    compilation's dump with the same op names (the wider model of diff_wide) is taken for the program: 2x the
    FLOPs. The report says the dumps were unchecked and names the xplane, which drops that dump."""
    from tests.conftest import FIXTURES

    trace = next((FIXTURES / "diff_base" / "logdir").rglob("*.trace.json.gz"))
    a = analyze(str(trace), hlo=[str(FIXTURES / "diff_wide" / "hlo")], chip=HOST_CHIP)
    assert any("unchecked against the program that ran" in n and "analyze vm.xplane.pb beside it instead" in n
               for n in a.summary.notes), a.summary.notes
    shutil.copy(trace, tmp_path / trace.name)  # copied alone (s34 trial): no xplane beside it, the same note
    alone = analyze(str(tmp_path / trace.name), hlo=[str(FIXTURES / "diff_wide" / "hlo")], chip=HOST_CHIP)
    assert any("unchecked against the program that ran" in n and "analyze the .xplane.pb of the same capture" in n
               for n in alone.summary.notes), alone.summary.notes
    # and in the report's header, beside the FLOPs it drives (the s30 trial saw only a note at the bottom)
    assert list(a.summary.hlo_sources) == ["HLO text dumps matched by op name only, unchecked (a trace JSON carries "
                                           "no HLO: analyze the .xplane.pb)"]
    assert "matched by op name only, unchecked" in render(a, "terminal").split("Top findings")[0]
    b = analyze(str(trace.parent / "vm.xplane.pb"), hlo=[str(FIXTURES / "diff_wide" / "hlo")], chip=HOST_CHIP)
    xla = json.loads((FIXTURES / "diff_base" / "facts.json").read_text())["xla_cost_analysis"]["flops"]
    assert b.summary.flops_per_step == xla == 747_311_104  # XLA's cost_analysis of the program that ran
    assert any("is not the HLO that ran" in n and "dropped" in n for n in b.summary.notes)
    alone = analyze(str(trace), chip=HOST_CHIP)  # no dumps given: nothing to check, no note
    assert not any("unchecked" in n for n in alone.summary.notes)
    assert list(b.summary.hlo_sources)[0] == "HloProtos embedded in the profile"
