"""Command line: every command is one library call and a renderer.

Exit status: 0 ok, 1 a measured regression (``diff --fail-above``, ``capture --every``), 2 bad input (one line,
from any :class:`TraceroofError`), 3 an internal error (a bug: one line asking for a report; ``TRACEROOF_DEBUG=1``
shows the traceback).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Callable, Sequence

import click

from parsers.errors import TraceroofError

FORMATS = ("terminal", "markdown", "json", "csv", "html", "summary")
RETRY_LINE_EVERY_S = 10.0  # capture: while it keeps trying for one reason, a line on stderr this often at most


def _fail(message: str) -> None:
    from traceroof.report.safe import printable

    click.echo(f"traceroof: error: {printable(message)}", err=True)
    sys.exit(2)


# storage and cluster libraries log their retries with tracebacks; the CLI's one line says what failed
QUIET_LOGGERS = ("gcsfs", "s3fs", "fsspec", "aiobotocore", "botocore", "google.auth", "distributed")


def _guarded(fn: Callable[..., None]) -> Callable[..., None]:
    def wrapper(*args: object, **kwargs: object) -> None:
        if not os.environ.get("TRACEROOF_DEBUG"):
            for name in QUIET_LOGGERS:
                logging.getLogger(name).setLevel(logging.CRITICAL)
        try:
            fn(*args, **kwargs)
        except TraceroofError as e:
            _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
        except MemoryError:
            _fail("out of memory while reading the input; analyze fewer hosts or a shorter capture")
        except OSError as e:
            _fail(f"{e.filename or ''}: {e.strerror}" if e.strerror else str(e))
        except (SystemExit, KeyboardInterrupt, click.exceptions.ClickException, click.exceptions.Exit,
                click.exceptions.Abort):
            raise
        except Exception as e:  # a bug, never "bad input" nor "regression"
            if os.environ.get("TRACEROOF_DEBUG"):
                raise
            from traceroof.report.safe import printable

            where = e.__traceback__
            while where is not None and where.tb_next is not None:
                where = where.tb_next
            place = f" at {Path(where.tb_frame.f_code.co_filename).name}:{where.tb_lineno}" if where else ""
            detail = printable(" ".join(str(e).split())[:200])
            click.echo(f"traceroof: internal error: {type(e).__name__}{place}: {detail} -- this is a bug in "
                       "traceroof; please report it with the command line (TRACEROOF_DEBUG=1 shows the traceback)",
                       err=True)
            sys.exit(3)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


def _inputs(paths: Sequence[str], hlo: Sequence[str] = (), chip: str | None = None) -> list[Path]:
    """The files a command reads, which ``-o`` must never name: the paths given (files), the profile, HLO and
    HloProto files found from them, every file of a run directory given as a directory, and a chip file."""
    from traceroof.discovery import discover

    from parsers.storage import is_url

    given = [Path(p) for p in (*paths, *hlo, *([chip] if chip else [])) if p and not is_url(p)]
    files = [p for p in given if p.is_file()]
    try:
        found = discover(paths, hlo)
    except TraceroofError:
        return files  # a saved JSON report (a diff baseline), or bad input that the analysis reports
    files += [f for f in (*found.profiles, *found.hlo_files, *found.hlo_proto_files) if isinstance(f, Path)]
    dirs = [p.resolve() for p in given if p.is_dir()]
    for run in {f.parent for f in found.profiles if isinstance(f, Path)}:
        if any(run.resolve() == d or d in run.resolve().parents for d in dirs):
            files += [f for f in run.iterdir() if f.is_file()]
    return files


def _local_output(output: str) -> None:
    """Refuse an object-storage URL as ``-o``: reports are written atomically to local files."""
    from parsers.storage import is_url

    if is_url(output):
        raise TraceroofError(f"-o {output}: reports are written to a local file; write it here and copy it "
                             "(gsutil cp, aws s3 cp)")


def _protected(output: str | None, *sides: tuple[Sequence[str], Sequence[str], str | None]) -> list[Path]:
    """The input files of ``sides`` (paths, HLO paths, chip) that ``-o`` must not name; none without ``-o``.
    Refuses at once, before the analysis runs."""
    if not output:
        return []
    from traceroof.report.output import refuse_inputs

    _local_output(output)

    files = [f for side in sides for f in _inputs(*side)]
    refuse_inputs(output, files)
    return files


def _write(text: str, output: str | None, inputs: Sequence[Path] = ()) -> None:
    """Print ``text``, or write it to ``output`` atomically, never over one of ``inputs``."""
    from traceroof.report.output import refuse_inputs, write_atomic

    if output:
        _local_output(output)
        refuse_inputs(output, inputs)
        try:
            write_atomic(output, text)
        except OSError as e:
            raise TraceroofError(f"cannot write {output}: {e.strerror or e}") from None
    else:
        click.echo(text, nl=False)


def _parallel_options(f: Callable) -> Callable:
    """``--jobs`` and ``--dask``: where the hosts of a run directory are read (:func:`traceroof.parallel.map_hosts`)."""
    f = click.option("--dask", metavar="ADDRESS",
                     help="Read the hosts on this Dask cluster (tcp://host:8786; needs traceroof[dask] there and "
                          "paths the workers can read: shared disk or gs:// / s3://).")(f)
    return click.option("--jobs", "-j", type=click.IntRange(1), default=None,
                        help="Hosts read in parallel processes  [default: the cores this process may use]")(f)


def _numpy_settings() -> None:
    """Settings numpy reads when it is imported, made before any import of it, for this process and the worker
    processes it starts; a variable the user set is left as it is.

    * ``OPENBLAS_NUM_THREADS=1``: traceroof calls no BLAS routine, but numpy's OpenBLAS starts one thread per core
      when it loads, and they spin: measured here (2 cores, 3 runs each), importing ``traceroof.cli`` took
      0.47-0.49 CPU s with the pool and 0.36-0.37 s without it, the same wall time.
    * ``NUMPY_MADVISE_HUGEPAGE=0`` (numpy's own switch): with the kernel's transparent huge pages in ``madvise``
      mode (the common default), every first touch of an advised array may compact memory for a huge page;
      traceroof writes each array once, in order, and gains nothing from huge pages. Measured here (20 M-event
      profile, 3 alternating runs each): 1.6-1.9 system CPU s without the advice, 2.7-3.1 s with it; the same
      user time (the decode alone: 0.5-0.6 s against 1.9-2.0 s)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return
    os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"  # workers started by spawn, and their numpy
    import numpy as np

    core = getattr(np, "_core", None) or getattr(np, "core", None)
    switch = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if switch is not None:
        switch(False)


class _Main(click.Group):
    """The command group, with usage errors (an unknown option, a value out of range) as one line and exit 2
    like every other bad input, instead of click's usage block."""

    def main(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        kwargs["standalone_mode"] = False
        _numpy_settings()
        try:
            rc = super().main(*args, **kwargs)  # type: ignore[arg-type]
        except click.exceptions.NoArgsIsHelpError as e:  # a bare `traceroof`: its help, as click does
            click.echo(e.format_message())
            sys.exit(2)
        except click.UsageError as e:
            where = f"; see '{e.ctx.command_path} --help'" if e.ctx is not None else ""
            _fail(f"{e.format_message().rstrip('.')}{where}")
        except click.ClickException as e:
            _fail(e.format_message())
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        else:
            sys.exit(rc if isinstance(rc, int) else 0)


@click.group(cls=_Main)
@click.version_option(package_name="traceroof")
def main() -> None:
    """Roofline and per-layer efficiency reports for profiled XLA programs."""


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--hlo", "hlo", multiple=True, help="HLO text file or --xla_dump_to folder (repeatable).")
@click.option("--chip", help="Target chip id/name (see `traceroof chips`) or a chip .toml file.")
@click.option("--depth", default=2, show_default=True, type=click.IntRange(1, 32),
              help="Scope units per layer (model wrapper dropped; a repeated block h/* is one unit and the "
                   "units above it do not count).")
@click.option("--expand", is_flag=True, help="One layer per repeated-block instance (h/0, h/1...) instead of h/*.")
@click.option("--warmup-steps", default=1, show_default=True, type=click.IntRange(0),
              help="Marked steps excluded at the start (the first compiles when traced from the first call, and is "
                   "timed from its marker: no previous step ends where it starts).")
@click.option("--top", default=10, show_default=True, type=click.IntRange(0), help="Ops listed by lost time.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="terminal", show_default=True)
@click.option("--table", type=click.Choice(("layers", "top-ops", "collectives", "op-stats", "ops")), default="layers",
              show_default=True, help="Table written by --format csv.")
@click.option("--topology", help="TPU slice like 4x4x4 (2x16x16 for 2 slices over DCN), or GPUs per node x "
                                 "nodes like 8x2; default from the chip and the device count.")
@click.option("--model-flops-per-step", type=click.FloatRange(min=0, min_open=True),
              help="Model FLOPs of one step over all devices (e.g. 6·params·tokens) for the MFU; default: the "
                   "executed FLOPs without the rematerialised forward and the optimizer update.")
@click.option("-o", "--output", help="Write the report to this file instead of stdout.")
@click.option("--wide", is_flag=True, help="Terminal report: every column and cell in full (default: fits 120 "
                                           "columns, wide cells shortened with … and wide tables folded).")
@_parallel_options
@_guarded
def analyze(paths: Sequence[str], hlo: Sequence[str], chip: str | None, depth: int, expand: bool,
            warmup_steps: int, top: int, fmt: str, table: str, topology: str | None,
            model_flops_per_step: float | None, output: str | None, jobs: int | None, dask: str | None,
            wide: bool = False) -> None:
    """Per-layer roofline report of a profile (.xplane.pb, run directory, logdir or trace JSON)."""
    from traceroof.analysis import analyze as run
    from traceroof.report import render

    inputs = _protected(output, (paths, hlo, chip))
    a = run(list(paths), hlo=hlo, chip=chip, depth=depth, warmup_steps=warmup_steps, top=top, topology=topology,
            model_flops_per_step=model_flops_per_step, expand=expand, jobs=jobs, dask_address=dask)
    _write(render(a, fmt, table, wide), output, inputs)


@main.command()
@click.argument("base")
@click.argument("new")
@click.option("--hlo-base", multiple=True, help="HLO dumps of the base profile (repeatable).")
@click.option("--hlo-new", multiple=True, help="HLO dumps of the new profile (repeatable).")
@click.option("--chip", help="Target chip for both sides.")
@click.option("--depth", default=2, show_default=True, type=click.IntRange(1, 32))
@click.option("--warmup-steps", default=1, show_default=True, type=click.IntRange(0))
@click.option("--fail-above", "fail_above", type=click.FloatRange(min=0),
              help="Exit 1 when step time regresses by more than this percent, beyond noise (--layer: by more than "
                   "this percent; a layer's time has no noise estimate).")
@click.option("--layer", help="Gate on this layer's time (all phases) instead of the step time.")
@click.option("--format", "fmt", type=click.Choice(("terminal", "markdown", "json", "html")), default="terminal",
              show_default=True)
@click.option("-o", "--output", help="Write the comparison to this file instead of stdout.")
@click.option("--wide", is_flag=True, help="Terminal tables: every column and cell in full (default: fits 120 "
                                           "columns).")
@_parallel_options
@_guarded
def diff(base: str, new: str, hlo_base: Sequence[str], hlo_new: Sequence[str], chip: str | None, depth: int,
         warmup_steps: int, fail_above: float | None, layer: str | None, fmt: str, output: str | None,
         wide: bool, jobs: int | None, dask: str | None) -> None:
    """Compare two profiles (or a saved JSON report and a profile); exit 1 on a regression beyond --fail-above."""
    from traceroof.diff import diff as compare, gate, load_side
    from traceroof.report.diff import render_diff_html, render_diff_json, render_diff_text

    inputs = _protected(output, ([base], hlo_base, chip), ([new], hlo_new, None))
    b = load_side(base, hlo_base, chip, depth, warmup_steps, label=base, jobs=jobs, dask_address=dask,
                  hlo_option="--hlo-base")
    n = load_side(new, hlo_new, chip, depth, warmup_steps, label=new, jobs=jobs, dask_address=dask,
                  hlo_option="--hlo-new")
    result = compare(b, n)
    failed, why = gate(result, fail_above, layer)
    shown = why if fail_above is not None else ""
    if fmt == "json":
        text = render_diff_json(result, failed, why)
    elif fmt == "html":
        text = render_diff_html(result, shown)
    else:
        text = render_diff_text(result, shown, markdown=fmt == "markdown", wide=wide)
    _write(text, output, inputs)
    if failed:
        click.echo(f"traceroof: regression: {why}", err=True)
        sys.exit(1)


def _duration(text: str) -> float:
    m = re.fullmatch(r"\s*([\d.]+)\s*(ms|s|m|h)?\s*", text or "")
    if not m:
        raise click.BadParameter(f"{text!r}: expected a duration like 500ms, 2s, 10m")
    return float(m.group(1)) * {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}[m.group(2) or "s"]


@main.command()
@click.argument("address")
@click.option("--duration", default="2s", show_default=True, help="How long to trace (500ms, 2s, 1m).")
@click.option("--logdir", default=None, help="Where captures go (default: a new temporary folder).")
@click.option("--every", default=None, help="Keep capturing at this interval (10m) and compare with the first; "
              "each capture's reports are written beside its run.")
@click.option("--count", type=click.IntRange(1), default=None, help="With --every: stop after this many captures.")
@click.option("--baseline", default=None, help="With --every: compare with this profile or JSON report instead.")
@click.option("--fail-above", "fail_above", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="With --every: flag a regression above this percent, beyond noise.")
@click.option("--chip", help="Target chip (default: detected; CPU jobs: the calibrated host).")
@click.option("--format", "fmt", type=click.Choice(FORMATS[:3] + ("html",)), default="terminal", show_default=True,
              help="The report of a single capture (not with --every, whose reports go beside each run).")
@click.option("--retry-for", "retry_for", default="60s", show_default=True,
              help="Keep trying this long while nothing listens at ADDRESS (the job is still starting) or captures "
                   "hold no op events (it is still compiling).")
@_guarded
def capture(address: str, duration: str, logdir: str | None, every: str | None, count: int | None,
            baseline: str | None, fail_above: float, chip: str | None, fmt: str, retry_for: str) -> None:
    """Capture a profile from a job that called jax.profiler.start_server(PORT), and analyze it."""
    import tempfile
    import time

    from traceroof.analysis import analyze as run
    from traceroof.attach import capture as grab, one_line, write_reports
    from traceroof.diff import diff as compare, gate, load_side, side_from_analysis
    from traceroof.report import render

    if every and click.get_current_context().get_parameter_source("fmt") == click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--format with --every: each capture prints one line and writes its reports "
                         "(traceroof_report.txt, .md, .json) beside its run; drop --format")
    root = Path(logdir) if logdir else Path(tempfile.mkdtemp(prefix="traceroof_capture_"))
    seconds = _duration(duration)
    interval = _duration(every) if every else None
    base = load_side(baseline, chip=chip) if baseline else None
    retry_s = _duration(retry_for)
    n = 0
    regressed = False

    said_starting: bool | None = None  # the kind of reason of the last line said, and when
    said_at_s = 0.0

    def retrying(attempt: int, reason: str) -> None:  # a line when the reason changes, then one per 10 s at most
        nonlocal said_starting, said_at_s
        starting = reason.startswith("nothing listens")
        if said_starting == starting and time.monotonic() - said_at_s < RETRY_LINE_EVERY_S:
            return
        said_starting, said_at_s = starting, time.monotonic()
        if starting:
            click.echo(f"traceroof: {reason} (the job may still be starting): trying again", err=True)
        else:
            click.echo(f"traceroof: capture {attempt} from {address} held no op events (the job may still be "
                       "compiling): capturing again", err=True)

    while True:
        run_dir = grab(address, seconds, root, retry_s, retrying)
        a = run(run_dir, chip=chip)
        n += 1
        if interval is None:
            click.echo(render(a, fmt), nl=False)
            return
        write_reports(a, run_dir)  # each capture's full reports beside it; one line each on stdout
        side = side_from_analysis(a, str(run_dir))
        if base is None:
            base = side
            click.echo(f"capture {n}: {run_dir}: {one_line(a)} (baseline)")
        else:
            failed, why = gate(compare(base, side), fail_above)
            regressed |= failed
            click.echo(f"capture {n}: {run_dir}: {one_line(a)}; vs baseline: {why}"
                       + (" REGRESSION" if failed else ""))
        if count is not None and n >= count:
            break
        time.sleep(interval)
    if regressed:
        sys.exit(1)


@main.command()
@click.argument("logdir")
@click.option("--interval", default="2s", show_default=True, help="How often to look for new runs.")
@click.option("--timeout", default=None, help="Stop after this long (default: run until interrupted).")
@click.option("--max-reports", type=click.IntRange(1), default=None, help="Stop after this many reports.")
@click.option("--existing", is_flag=True, help="Also analyze the runs already there.")
@click.option("--chip", help="Target chip (default: detected; CPU profiles: the calibrated host).")
@_guarded
def watch(logdir: str, interval: str, timeout: str | None, max_reports: int | None, existing: bool,
          chip: str | None) -> None:
    """Analyze every new profile run under LOGDIR and write traceroof_report.* beside it.

    A run that gets another host's file (or whose file changes) after its report is analyzed again and its
    reports are replaced; --max-reports counts runs, not analyses again."""
    from traceroof.attach import one_line, watch as follow
    from traceroof.report.safe import printable

    if Path(logdir).exists() and not Path(logdir).is_dir():
        raise TraceroofError(f"{logdir} is not a directory; pass the TensorBoard logdir the job writes to")

    def report(run_dir: Path, analysis: object | None, error: str, hosts: int, hosts_before: int) -> None:
        again = f" again with {hosts} host(s) now ({hosts_before} before)" if hosts_before else ""
        if analysis is None:
            kept = f"; its reports still cover the {hosts_before} host(s) analyzed before" if hosts_before else ""
            click.echo(f"{printable(run_dir)}: not analyzed{again}: {printable(error)}{kept}", err=True)
        else:
            click.echo(f"{printable(run_dir)}: " + (f"analyzed{again}, reports replaced: " if again else "")
                       + one_line(analysis))

    def start(profile_dir: Path, skipped: int) -> None:
        old = f" ({skipped} run(s) already there are skipped; --existing analyzes them)" if skipped else ""
        if not Path(logdir).exists():
            old = " (the logdir does not exist yet: the job creates it)"
        click.echo(f"traceroof: watching {printable(profile_dir)} for new runs{old}", err=True)

    try:
        follow(logdir, _duration(interval), _duration(timeout) if timeout else None, max_reports, chip, report,
               existing, start)
    except KeyboardInterrupt:
        pass


@main.command()
@click.option("--sources", is_flag=True, help="Print every figure with its source.")
@_guarded
def chips(sources: bool) -> None:
    """List the chip database (bundled and user chip files)."""
    from traceroof.chips import all_chips
    from traceroof.report.chips import render_chips

    from traceroof.report.safe import printable

    notes: list[str] = []
    click.echo(render_chips(all_chips(notes), sources), nl=False)
    for note in notes:
        click.echo(f"traceroof: note: {printable(note)}", err=True)


@main.command()
@click.option("-o", "--output", help="Chip file to write (default: the host cache used for CPU profiles).")
@click.option("--name", default="calibrated host", show_default=True)
@_guarded
def calibrate(output: str | None, name: str) -> None:
    """Measure this machine (matmul FLOP/s, vector FLOP/s, memory bandwidth) into a chip file."""
    from traceroof.chips import (ChipError, calibrate as measure, calibration_drift, calibration_toml, host_cache_path,
                                 load_chip_file)

    if output:
        _local_output(output)
    path = Path(output) if output else host_cache_path()
    try:
        previous = load_chip_file(path) if path.is_file() else None
    except ChipError:
        previous = None  # not a chip file: nothing to compare with (it is replaced, as before)
    cal = measure()
    text = calibration_toml(cal, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(text, str(path))  # atomic: an interrupted calibrate leaves the previous chip file whole
    click.echo(f"wrote {path}", err=True)
    for note in calibration_drift(previous, cal) if previous is not None and previous.calibrated_at else []:
        click.echo(f"traceroof: note: {note}", err=True)


if __name__ == "__main__":
    main(prog_name="traceroof")
