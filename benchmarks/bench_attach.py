"""Overhead of ``traceroof.attach`` outside its profiled window (issue target: negligible).

Usage::

    python benchmarks/bench_attach.py [--steps 200000]

Times ``with hook.step(): pass`` for steps after the window (and before it, with a large ``wait``) against a bare
``with contextlib.nullcontext(): pass`` loop, and prints the extra cost per step. No JAX work runs, so this is
the hook's own cost; a real step takes milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> None:
    """Measure and print the hook's cost per step."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200_000)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import traceroof

    with tempfile.TemporaryDirectory() as tmp:
        hook = traceroof.attach(out_dir=tmp, wait_steps=10**9, warmup_steps=0, active_steps=1)  # the window never opens
        t0 = time.perf_counter()
        for _ in range(args.steps):
            with contextlib.nullcontext():
                pass
        bare = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            with hook.step():
                pass
        hooked = time.perf_counter() - t0
    extra = (hooked - bare) / args.steps
    print(f"{args.steps:,} steps: bare {bare / args.steps * 1e6:.2f} µs/step, with hook.step() "
          f"{hooked / args.steps * 1e6:.2f} µs/step: {extra * 1e6:.2f} µs extra per step outside the window")


if __name__ == "__main__":
    main()
