"""The long fuzz campaign: N mutated inputs per input class through the library entries (``tests/fuzzing.py``).

Usage::

    python benchmarks/fuzz_campaign.py                     # 10,000 inputs per class, 2 workers
    python benchmarks/fuzz_campaign.py -n 2000 --classes xplane,trace_json -o fuzz.json

Prints a table of outcomes per class (``report``, ``error`` = a TraceroofError, and the findings ``bug``,
``range``, ``memory``, ``timeout``, ``crash``), then every distinct finding place (``file:line ExceptionType``
for bugs; the figure for out-of-range reports) with its count and one reproducer
(``python -m tests.fuzzing CLASS SEED``). ``-o`` writes the same as JSON (every 1,000 inputs, so a campaign
cut short leaves its figures). Exit status 0 when nothing was found,
1 otherwise. Seeds start at ``--start`` (default 1,000,000, so the campaign's inputs differ from the test
suite's, which start at 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import fuzzing  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=10_000, help="inputs per class (default 10,000)")
    ap.add_argument("--classes", default=",".join(fuzzing.CLASSES), help="comma-separated input classes")
    ap.add_argument("--start", type=int, default=1_000_000, help="first seed")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per input")
    ap.add_argument("--memory-gb", type=float, default=2.0, help="address space per worker above its start size")
    ap.add_argument("-o", "--output", help="write the summary as JSON here")
    args = ap.parse_args(argv)
    classes = [c for c in args.classes.split(",") if c]
    tasks = fuzzing.interleaved(classes, args.n, args.start)
    t0 = time.monotonic()
    results: list[fuzzing.Result] = []

    def save(complete: bool) -> dict:
        summary = fuzzing.summarize(results)
        if args.output:  # rewritten every 1,000 inputs: a long campaign cut short still leaves its figures
            Path(args.output).write_text(json.dumps({
                "inputs_per_class": args.n, "first_seed": args.start, "workers": args.workers,
                "inputs_done": len(results), "complete": complete, "wall_s": round(time.monotonic() - t0, 1),
                "per_class": summary["per_class"], "mean_s": summary["mean_s"], "findings": summary["findings"]},
                indent=1))
        return summary

    def progress(r: fuzzing.Result) -> None:
        results.append(r)
        if len(results) % 1000 == 0:
            save(False)
            print(f"  {len(results):,}/{len(tasks):,} inputs, {time.monotonic() - t0:.0f} s", file=sys.stderr,
                  flush=True)

    fuzzing.run_many(tasks, workers=args.workers, timeout_s=args.timeout,
                     memory_bytes=int(args.memory_gb * (1 << 30)), on_result=progress)
    wall = time.monotonic() - t0
    summary = save(True)
    outcomes = ["report", "error", *fuzzing.FINDINGS]
    print(f"{len(results):,} inputs ({args.n:,} per class, seeds {args.start}..{args.start + args.n - 1}) in "
          f"{wall:.0f} s with {args.workers} workers\n")
    print(f"{'class':14s}" + "".join(f"{o:>9s}" for o in outcomes) + f"{'mean ms':>9s}")
    for c in classes:
        row = summary["per_class"].get(c, {})
        print(f"{c:14s}" + "".join(f"{row.get(o, 0):>9,d}" for o in outcomes)
              + f"{summary['mean_s'].get(c, 0) * 1e3:>9.1f}")
    findings = summary["findings"]
    print(f"\n{len(findings)} distinct finding places")
    for f in findings:
        print(f"{f['count']:>6,d}  {f['outcome']:7s} {f['class']:13s} {f['place']}\n"
              f"        e.g. python -m tests.fuzzing {f['class']} {f['example_seed']}  ({f['example_mutation']}): "
              f"{f['detail'][:160]}")
    return 1 if findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
