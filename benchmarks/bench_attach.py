"""What ``traceroof.attach`` costs a training job: per step outside its window, and the worst step stall while a
window's analysis runs.

Usage::

    python benchmarks/bench_attach.py [--steps 200000]          # the hook's own cost outside the window
    python benchmarks/bench_attach.py --stall [--layers 48]     # a real JAX loop (CPU) through one window

``--stall`` runs a jitted MLP training step (``--layers`` tanh layers of ``--width``; one step takes a few ms on
CPU) step after step, each timed to its end (``block_until_ready``), with a window of ``--active`` steps after
``--wait`` steps. It prints the median step before the window, the step that closes the window (it waits for
the dispatched work and stops the trace: that cost is the profiler's), and the worst and the 99th-percentile
step while the window's analysis runs (from the closing step until the analysis is over), each over the
median; the worst step before the window is the machine's own noise. ``--root`` measures another checkout
(e.g. the previous commit, for before/after figures).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def overhead(steps: int) -> None:
    """Measure and print the hook's cost per step outside its window."""
    import traceroof

    with tempfile.TemporaryDirectory() as tmp:
        hook = traceroof.attach(out_dir=tmp, wait_steps=10**9, warmup_steps=0, active_steps=1)  # the window never opens
        t0 = time.perf_counter()
        for _ in range(steps):
            with contextlib.nullcontext():
                pass
        bare = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(steps):
            with hook.step():
                pass
        hooked = time.perf_counter() - t0
    extra = (hooked - bare) / steps
    print(f"{steps:,} steps: bare {bare / steps * 1e6:.2f} µs/step, with hook.step() "
          f"{hooked / steps * 1e6:.2f} µs/step: {extra * 1e6:.2f} µs extra per step outside the window")


def stall(layers: int, width: int, wait: int, active: int, chip: str, max_s: float) -> dict[str, float]:
    """Run the loop through one window; returns the figures printed (times in seconds)."""
    import jax
    import jax.numpy as jnp

    import traceroof

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x * x)

    @jax.jit
    def train_step(ws, x):
        g = jax.grad(loss)(ws, x)
        return [w - 0.01 * gw for w, gw in zip(ws, g)]

    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (width, width)) / width ** 0.5 for i in range(layers)]
    x = jnp.ones((64, width))
    ws = jax.block_until_ready(train_step(ws, x))  # compile outside the measurement
    times: list[tuple[int, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        hook = traceroof.attach(out_dir=tmp, wait_steps=wait, warmup_steps=1, active_steps=active, chip=chip)
        close_step = wait + 1 + active - 1
        start = time.perf_counter()
        i = 0
        analysis_over = None
        while time.perf_counter() - start < max_s:
            t0 = time.perf_counter()
            with hook.step():
                ws = jax.block_until_ready(train_step(ws, x))
            times.append((i, time.perf_counter() - t0))
            if i > close_step and analysis_over is None and not any(t.is_alive() for t in hook._threads):
                analysis_over = i
            if analysis_over is not None and i >= analysis_over + 20:
                break
            i += 1
        hook.close()
        if hook.errors or not hook.reports:
            raise SystemExit(f"the window was not analyzed: {hook.errors}")
    before = [t for j, t in times if j < wait]
    during = [t for j, t in times if close_step < j <= (analysis_over or i)]
    median = statistics.median(before)
    closing = dict(times)[close_step]
    worst = max(during)
    worst_at = next(j for j, t in times if close_step < j and t == worst) - close_step
    p99 = sorted(during)[max(int(len(during) * 0.99) - 1, 0)]
    return {"median": median, "worst_before": max(before), "closing": closing, "worst": worst,
            "worst_at": worst_at, "p99": p99, "steps_during": len(during),
            "analysis_s": sum(during)}


def main(argv: list[str] | None = None) -> None:
    """Measure and print."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200_000, help="hook overhead: steps timed")
    ap.add_argument("--stall", action="store_true", help="measure step stalls through a window on a JAX loop")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--wait", type=int, default=200, help="steps before the window (the baseline median)")
    ap.add_argument("--active", type=int, default=20, help="steps traced")
    ap.add_argument("--repeat", type=int, default=1, help="windows measured (fresh loop each)")
    ap.add_argument("--chip", default=str(ROOT / "fixtures" / "fixture_host.toml"))
    ap.add_argument("--max-s", type=float, default=120.0)
    ap.add_argument("--root", default=str(ROOT), help="checkout whose traceroof is measured")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(args.root).resolve()))
    if not args.stall:
        overhead(args.steps)
        return
    for _ in range(args.repeat):
        r = stall(args.layers, args.width, args.wait, args.active, args.chip, args.max_s)
        print(f"median step {r['median'] * 1e3:.2f} ms, worst {r['worst_before'] * 1e3:.1f} ms before the window; "
              f"closing step {r['closing'] * 1e3:.1f} ms "
              f"(+{(r['closing'] - r['median']) * 1e3:.1f}); while analyzing ({r['steps_during']} steps, "
              f"{r['analysis_s']:.2f} s): worst step {r['worst'] * 1e3:.1f} ms "
              f"(+{(r['worst'] - r['median']) * 1e3:.1f} ms stall, {r['worst_at']} steps after the closing one), "
              f"p99 {r['p99'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
