"""The README's snippets are tests: every code block that profiles, attaches or captures runs as written (small
shapes, tmp paths), and its report's FLOPs per step equal XLA's own ``cost_analysis()`` of the step (±1 %).

Each ``python`` block is found by its content, prefixed with :data:`PRELUDE` (a jitted MLP + SGD
``train_step`` with no blocking inside, ``state``, ``batch``, ``data``) and :data:`FACTS` (XLA's
``cost_analysis()`` FLOPs of the step into a JSON file) and run in a subprocess with the README's
``XLA_FLAGS`` dump; only the ``/tmp/tb``, ``/tmp/hlo`` and ``traceroof_reports`` paths are rewritten. The host
calibration cache is seeded with ``fixtures/fixture_host.toml`` so that nothing calibrates (FLOPs do not depend
on the chip)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.conftest import HOST_CHIP, ROOT

pytest.importorskip("jax", reason="JAX (dev extra) runs the README's snippets")

README = (ROOT / "README.md").read_text(encoding="utf-8")

PRELUDE = '''
import json, sys
import jax
import jax.numpy as jnp


def loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


@jax.jit
def train_step(state, batch):  # SGD on a 2-layer MLP; nothing blocks inside, as in a real loop
    grads = jax.grad(loss)(state, batch)
    return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, state, grads)


k = jax.random.split(jax.random.PRNGKey(0), 4)
state = {"w1": 0.1 * jax.random.normal(k[0], (128, 256)), "b1": jnp.zeros(256),
         "w2": 0.1 * jax.random.normal(k[1], (256, 64)), "b2": jnp.zeros(64)}
batch = (jax.random.normal(k[2], (64, 128)), jax.random.normal(k[3], (64, 64)))
data = [batch] * 20
'''

# XLA's own FLOPs of one step, written to FACTS_PATH for the test to compare with the report
FACTS = '''
cost = jax.jit(train_step).lower(state, batch).compile().cost_analysis()
cost = cost[0] if isinstance(cost, (list, tuple)) else cost
with open(FACTS_PATH, "w") as f:
    json.dump({"flops": float(cost["flops"])}, f)
'''


def python_block(marker: str) -> str:
    """The README's ```python block that contains ``marker`` (exactly one)."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if marker in b]
    assert len(blocks) == 1, f"README has {len(blocks)} python blocks with {marker!r}"
    return blocks[0]


def sh_commands() -> list[str]:
    """Every command of the README's ```sh blocks (lines, and parts joined by ``&&``), comments removed."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", README, re.S):
        for line in block.splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                if part.strip():
                    out.append(part.strip())
    return out


def seeded_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The subprocess environment: JAX on CPU, this checkout importable, a host calibration cache holding the
    fixture host's chip file (so no snippet calibrates)."""
    cache = tmp / "cache"
    (cache / "traceroof").mkdir(parents=True, exist_ok=True)
    shutil.copy(HOST_CHIP, cache / "traceroof" / "host.toml")
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(cache), **extra)


def rewrite(text: str, tmp: Path) -> str:
    """The README's paths as tmp paths: ``/tmp/tb``, ``/tmp/hlo``, ``traceroof_reports``."""
    return (text.replace("/tmp/tb", str(tmp / "tb")).replace("/tmp/hlo", str(tmp / "hlo"))
            .replace('"traceroof_reports"', repr(str(tmp / "traceroof_reports"))))


def run_snippet(block: str, tmp: Path, timeout_s: float = 120) -> float:
    """Run PRELUDE + ``block`` with the README's XLA_FLAGS (paths rewritten); returns XLA's FLOPs of one step."""
    flags = re.search(r"`XLA_FLAGS=(--xla_dump_to=\S+ --xla_dump_hlo_as_text)`", README)
    assert flags, "the README names the XLA_FLAGS that dump HLO"
    facts = tmp / "facts.json"
    script = f"FACTS_PATH = {str(facts)!r}\n" + PRELUDE + FACTS + "\n" + rewrite(block, tmp)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp, timeout=timeout_s,
                       env=seeded_env(tmp, XLA_FLAGS=rewrite(flags.group(1), tmp)))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(facts.read_text())["flops"]


def test_profiling_loop_as_written(tmp_path):
    from traceroof.cli import main

    xla_flops = run_snippet(python_block("jax.profiler.start_trace"), tmp_path)
    m = re.search(r"`(traceroof analyze /tmp/tb --hlo /tmp/hlo)`", README)
    assert m, "the README says how to analyze the profile"
    args = shlex.split(rewrite(m.group(1), tmp_path))[1:] + ["--format", "json", "--chip", HOST_CHIP]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)["summary"]
    assert s["flops_per_step"] > 0 and s["flops_per_step"] == pytest.approx(xla_flops, rel=0.01)
    assert s["steps_used"] == [1, 2, 3, 4] and s["join"]["events_joined"] == s["join"]["events_total"]


def test_attach_as_written(tmp_path):
    xla_flops = run_snippet(python_block("traceroof.attach"), tmp_path)
    doc = json.loads((tmp_path / "traceroof_reports" / "window_0" / "traceroof_report.json").read_text())
    s = doc["summary"]
    assert s["steps_used"] == [12, 13, 14, 15, 16]  # wait 10, warm-up 2 (steps 10, 11), active 5
    assert s["flops_per_step"] > 0 and s["flops_per_step"] == pytest.approx(xla_flops, rel=0.01)


def test_analyze_commands_on_fixtures_run():
    commands = [c for c in sh_commands() if c.startswith("traceroof analyze fixtures/")]
    assert commands, "the README shows traceroof analyze on a bundled fixture"
    for command in commands:
        r = subprocess.run([sys.executable, "-m", "traceroof.cli", *shlex.split(command)[1:]], capture_output=True,
                           text=True, cwd=ROOT, timeout=120, env=seeded_env(Path(os.environ["XDG_CACHE_HOME"])))
        assert r.returncode == 0, (command, r.stderr)
        assert r.stdout.startswith(("traceroof: per-layer roofline report", "# traceroof summary")), command


def test_capture_command_retries_while_the_job_compiles(tmp_path):
    m = re.search(r"^(traceroof capture HOST:PORT --duration \S+)", README, re.M)
    assert m, "the README shows the capture command line"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the job starts its profiler server, then is busy for seconds before its first step (as a long compile is)
    job = PRELUDE + f"""
jax.profiler.start_server({port})
print("ready", flush=True)
import time
time.sleep(4)  # compiling
t0, i = time.time(), 0
while time.time() - t0 < 60:
    with jax.profiler.StepTraceAnnotation("train", step_num=i):
        state = jax.block_until_ready(train_step(state, batch))
    i += 1
"""
    env = seeded_env(tmp_path)
    p = subprocess.Popen([sys.executable, "-c", job], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path)
    try:
        assert p.stdout.readline().strip() == "ready"
        started = time.monotonic()
        args = shlex.split(m.group(1).replace("HOST:PORT", f"127.0.0.1:{port}"))[1:]
        r = subprocess.run([sys.executable, "-m", "traceroof.cli", *args, "--logdir", str(tmp_path / "ld"),
                            "--format", "json"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=90)
        first_step_s = 4.0
    finally:
        p.kill()
        p.wait(timeout=30)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - started > first_step_s  # started before the first step, so it had to wait
    assert "held no op events (the job may still be compiling): capturing again" in r.stderr
    s = json.loads(r.stdout)["summary"]
    assert s["flops_per_step"] > 0 and s["join"]["events_joined"] > 0
    assert len(list((tmp_path / "ld" / "plugins" / "profile").glob("*"))) == 1  # only the capture with op events
