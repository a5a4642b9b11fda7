"""Decode and join speed on a large replicated profile (issue target: >= 500,000 events/s on one core,
peak memory under 3x the file size).

Usage::

    python benchmarks/bench_decode.py [--events 5000000] [--repeat 3] [--decoder c|python]

Builds the input with ``benchmarks/replicate.py`` when missing, then runs each measurement in a fresh process
pinned to one CPU core:

* ``decode``: ``read_xspace`` + ``Plane.events`` of ``/host:CPU`` with the stats the join needs;
* ``decode+join``: ``load_profile`` (events, steps) + ``build_op_table`` (every event joined to its HLO
  instruction and cost; HLO text parsed from the fixture's dumps);
* ``ProfileData`` (reference, when JAX is installed): iterating every event and its stats through
  ``jax.profiler.ProfileData``.

``--decoder`` picks the wire scanner (``TRACEROOF_DECODER`` of the measured processes): the C one
(``parsers/_wirescan.c``, the default when built) or its pure-Python twin. Rates count every event in the file
(all are walked); the kept count is the op and step events the analysis keeps. Prints events/s (median and best of
``--repeat`` runs) and peak RSS (``ru_maxrss``, which includes the interpreter) as a multiple of the file size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child(mode: str, path: str, hlo: str) -> dict:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()
    if mode == "decode":
        from parsers.xspace import read_xspace
        from traceroof.events import OP_STATS

        xs = read_xspace(path)
        kept = 0
        for plane in xs.planes:
            if plane.name == "/host:CPU":
                kept += len(plane.events(stats=OP_STATS, require=("hlo_op", "step_num")))
        n = sum(line.event_count for plane in xs.planes for line in plane.lines)
    elif mode == "decode+join":
        from traceroof.optable import build_op_table
        from traceroof.discovery import Inputs
        from traceroof.profile import load_profile

        profile = load_profile(Inputs((Path(path),), "xplane", tuple(sorted(Path(hlo).glob("*.txt"))), path))
        ops, join, _ = build_op_table(profile)
        kept = n = join.events_total
        assert join.events_joined == join.events_total, join
    elif mode == "profiledata":
        from jax.profiler import ProfileData

        pd_ = ProfileData.from_file(path)
        n = 0
        for plane in pd_.planes:
            for line in plane.lines:
                for ev in line.events:
                    _ = (ev.name, ev.start_ns, ev.duration_ns, list(ev.stats))
                    n += 1
        kept = n
    else:
        raise SystemExit(f"unknown mode {mode}")
    dt = time.perf_counter() - t0  # the event count below is read after the clock stops
    return {"events": n, "op_events": kept, "seconds": dt,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv: list[str] | None = None) -> None:
    """Run every mode ``--repeat`` times in fresh pinned processes and print events/s and peak RSS."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="decode,decode+join,profiledata")
    ap.add_argument("--decoder", choices=("c", "python"), help="wire scanner (default: C when built)")
    args = ap.parse_args(argv)
    if args.decoder:
        os.environ["TRACEROOF_DECODER"] = args.decoder  # inherited by the measured processes
    path = ROOT / "benchmarks" / "data" / f"transformer_x{args.events}" / "plugins" / "profile" / "run" / \
        "host.xplane.pb"
    if not path.exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "replicate.py"), "--events", str(args.events),
                        "-o", str(path)], check=True)
    size = path.stat().st_size
    sys.path.insert(0, str(ROOT))
    from parsers.xspace import read_xspace

    total = sum(line.event_count for plane in read_xspace(path).planes for line in plane.lines)
    hlo = ROOT / "fixtures" / "transformer" / "hlo"
    print(f"input: {path.relative_to(ROOT)} ({size / 1e6:.1f} MB); decoder {read_xspace(path).decoder}")
    for mode in args.modes.split(","):
        runs = []
        for _ in range(args.repeat):
            r = subprocess.run([sys.executable, __file__, "--child", mode, str(path), str(hlo)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{mode}: failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
                break
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        if not runs:
            continue
        for x in runs:
            x["events"] = total
        rates = [x["events"] / x["seconds"] for x in runs]
        rss = max(x["peak_rss_bytes"] for x in runs)
        print(f"{mode:12s} {runs[0]['events']:>10,} events ({runs[0]['op_events']:,} op/step events kept)  "
              f"{statistics.median(rates):>10,.0f} events/s median, "
              f"{max(rates):>10,.0f} best  peak RSS {rss / 1e6:,.0f} MB = {rss / size:.2f}x file")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[3], sys.argv[4])))
    else:
        main()
