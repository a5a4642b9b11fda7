"""Profile a running job and analyze what it captures: in-process hook, remote capture, watched logdir.

* :func:`attach` profiles a window of steps of the calling JAX program (schedule: ``wait_steps``,
  ``warmup_steps``, ``active_steps``, ``repeat`` times) with ``jax.profiler``. When a window closes, the training
  process only waits for the steps dispatched so far to run (JAX dispatches asynchronously), stops the trace and
  hands the run directory to a **separate analysis process** (a fresh interpreter started with
  ``subprocess``, in its own session, at lower priority, with one BLAS/OpenMP thread): the analysis never holds
  the training process's GIL, and a Ctrl-C of the job does not reach it. ``multiprocessing``'s ``spawn`` and
  ``forkserver`` would re-run the job's main script in the child (``__mp_main__``) unless it is guarded by
  ``if __name__ == "__main__"``, and ``fork`` copies a process with JAX threads running: neither is safe for a
  hook dropped into any training script. The child writes the reports and sends one JSON line back; a thread of
  the job waits for it (blocked in ``communicate``, GIL released), logs the one-line summary and calls
  ``on_report`` with a :class:`WindowReport` (paths and the summary figures, not the analysis itself).
* **No calibration inside the job.** The report is judged against ``chip`` when given; a CPU job without it uses
  the cached host calibration (``traceroof calibrate`` writes it) and, when there is none, is analyzed without
  a roofline (an uncalibrated host chip with no peaks; the report says so and how to calibrate): measuring the
  host while the job runs would both slow the job and measure a loaded machine. Device jobs use the chip
  detected from the profile.
* **An interrupted window reports complete steps only.** An exception inside a traced step (Ctrl-C's
  ``KeyboardInterrupt``, an error) stops the trace while that step's annotation is still open, so the step is
  not marked: its work is left out of the per-step figures (with a note) and the window is analyzed from the
  complete steps before it. The job is not kept waiting for that report.
* It never raises into the training loop: every error is logged and the job goes on.
* :func:`capture` asks a job that called ``jax.profiler.start_server(PORT)`` for a profile over gRPC (the
  profiler client that tensorboard-plugin-profile ships, ``xprof.convert._pywrap_profiler_plugin.trace``).
* :func:`watch` analyzes every new run directory that appears under a TensorBoard logdir, and a reported run
  again when another host's file lands in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from parsers.errors import TraceroofError

log = logging.getLogger("traceroof")
REPORT_FORMATS = {"txt": "terminal", "md": "markdown", "json": "json"}
PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # where the analysis process imports traceroof from
NO_CALIBRATION_NOTE = ("no host calibration is cached and attach never calibrates inside a job: no roofline "
                       "(expected times and efficiencies are not computed); run `traceroof calibrate` once on an "
                       "idle machine, or pass chip=")


class CaptureError(TraceroofError):
    """A remote capture failed: no profiler server at the address, or nothing was captured."""


def write_reports(analysis: object, directory: Path, stem: str = "traceroof_report") -> list[Path]:
    """Write the terminal, Markdown and JSON reports of an analysis into ``directory`` (each atomically: a
    reader never sees half a report); returns the paths."""
    from traceroof.report import render
    from traceroof.report.output import write_atomic

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext, fmt in REPORT_FORMATS.items():
        p = directory / f"{stem}.{ext}"
        write_atomic(p, render(analysis, fmt))  # type: ignore[arg-type]
        paths.append(p)
    return paths


def one_line(analysis: object) -> str:
    """A one-line summary: step time, MFU, roofline efficiency, exposed communication, worst layer (control
    characters of input names escaped)."""
    from traceroof.report.safe import printable

    s = analysis.summary  # type: ignore[attr-defined]
    layers = analysis.layers  # type: ignore[attr-defined]
    worst = ""
    if len(layers):
        layer, phase = layers.iloc[0]["layer"], layers.iloc[0]["phase"]
        worst = f"; worst layer {layer}" + ("" if layer == f"({phase})" else f" ({phase})")
    def pct(x: float) -> str:
        return f"{x:.1%}" if x == x else "n/a"  # NaN: no peak figures for the chip

    return printable(f"step {s.step_time_mean_s * 1e3:.3f} ms over {len(s.steps_used)} steps, MFU {pct(s.mfu)}, "
                     f"roofline efficiency {pct(s.roofline_efficiency)}, exposed comm "
                     f"{s.exposed_comm_per_step_s * 1e3:.3f} ms{worst}")


def wait_for_dispatched_work() -> None:
    """Block until the JAX work dispatched so far has run, by waiting on every live array (the last step's
    outputs among them). JAX dispatches steps asynchronously: a trace stopped before they run holds their
    launches but none of their op events. Arrays deleted meanwhile (donated buffers) are skipped."""
    import jax

    arrays = jax.live_arrays()
    try:
        jax.block_until_ready(arrays)
    except Exception:  # noqa: BLE001 - one deleted array fails the batch: wait on the others one by one
        for a in arrays:
            try:
                a.block_until_ready()
            except Exception:  # noqa: BLE001
                pass


@dataclass(frozen=True)
class WindowReport:
    """What ``on_report`` receives when a window's reports are written: the window index, the report files,
    the one-line summary, and the report's ``summary`` figures as in its JSON (``step_time_mean_s``, ``mfu``,
    ``steps_used``, ``notes``...; units in the key names)."""

    window: int
    reports: tuple[Path, ...]
    line: str
    summary: dict[str, Any]


# -- the analysis process ------------------------------------------------------------------------------------------

def _analysis_chip(chip: str | None, platform: str) -> tuple[object, str]:
    """The chip argument for the analysis and a note: ``chip`` when given; for a CPU job the cached host
    calibration as it is (read here: the analysis would measure one that is corrupt, or was taken on a loaded
    machine, and the job never calibrates) or, when none can be read, a host chip with no figures."""
    from traceroof.chips import Chip, ChipError, host_cache_path, load_chip_file

    if chip is not None or platform != "cpu":
        return chip, ""
    if host_cache_path().is_file():
        try:
            return load_chip_file(host_cache_path()), ""
        except ChipError:
            pass
    return Chip(id="uncalibrated-host", name="this host (not calibrated)", vendor="host", kind="cpu", aliases=(),
                note="not calibrated: no roofline"), NO_CALIBRATION_NOTE


def analyze_window(request: dict[str, Any]) -> dict[str, Any]:
    """The analysis process's work: analyze ``request["logdir"]`` and write the reports of window
    ``request["window"]`` under ``request["out_dir"]``; returns what is sent back to the job (report paths,
    one-line summary, summary figures) or ``{"error": one line}``. Never raises."""
    try:
        from traceroof.analysis import analyze
        from traceroof.report.data import clean_value

        chip, note = _analysis_chip(request.get("chip"), request.get("platform", ""))
        a = analyze(request["logdir"], chip=chip, warmup_steps=int(request["warmup_steps"]))
        notes = tuple(x for x in (note, request.get("interrupted", "")) if x)
        if notes:
            a = dataclasses.replace(a, summary=dataclasses.replace(a.summary, notes=a.summary.notes + notes))
        paths = write_reports(a, Path(request["out_dir"]) / f"window_{request['window']}")
        return {"reports": [str(p) for p in paths], "line": one_line(a),
                "summary": clean_value(dataclasses.asdict(a.summary))}
    except Exception as e:  # noqa: BLE001 - reported to the job as one line
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        return {"error": text}


def _analysis_process_main() -> None:
    """Entry point of the analysis process: the request is ``sys.argv[1]`` (JSON); the answer one JSON line on
    stdout."""
    with contextlib.suppress(OSError, AttributeError):
        os.nice(10)  # the job comes first
    answer = analyze_window(json.loads(sys.argv[1]))
    with contextlib.suppress(OSError, ValueError):  # the job may be gone (a pipe closed): the reports are written
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


_CHILD_CODE = "from traceroof.attach import _analysis_process_main; _analysis_process_main()"


def _start_analysis_process(request: dict[str, Any]) -> subprocess.Popen:
    """Start the analysis process for ``request`` (see :func:`analyze_window`)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.Popen([sys.executable, "-c", _CHILD_CODE, json.dumps(request)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
                            close_fds=True)


# -- the hook --------------------------------------------------------------------------------------------------------

@dataclass
class Attachment:
    """The in-process profiler: call :meth:`step` around (or after) every training step.

    Steps are counted from 0; window ``k`` (``k < repeat``) starts tracing at step
    ``wait_steps + k*(warmup_steps+active_steps)``, marks steps with ``jax.profiler.StepTraceAnnotation`` and stops
    after ``warmup_steps + active_steps`` steps; the report then excludes the warm-up steps. Reports go to
    ``out_dir/window_<k>/``, written by a separate process (see the module docstring).
    """

    out_dir: Path
    wait_steps: int = 1
    warmup_steps: int = 1
    active_steps: int = 3
    repeat: int = 1
    chip: str | None = None
    on_report: Callable[[WindowReport], None] | None = None
    logdir: Path | None = None
    step_name: str = "train"
    reports: list[Path] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _step: int = 0
    _tracing: bool = False
    _window: int = 0
    _platform: str = ""
    _threads: list[threading.Thread] = field(default_factory=list)

    def _window_bounds(self) -> tuple[int, int] | None:
        if self._window >= self.repeat:
            return None
        start = self.wait_steps + self._window * (self.warmup_steps + self.active_steps)
        return start, start + self.warmup_steps + self.active_steps

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Context manager around one training step; outside a window it costs a couple of comparisons. An
        exception inside a traced step (Ctrl-C) closes the window without that step and goes on up."""
        bounds = self._window_bounds()
        annotate = None
        if bounds is not None and bounds[0] <= self._step < bounds[1]:
            if not self._tracing:
                self._start()
            if self._tracing:
                try:
                    import jax

                    annotate = jax.profiler.StepTraceAnnotation(self.step_name, step_num=self._step)
                    annotate.__enter__()
                except Exception as e:  # noqa: BLE001 - never break the job
                    self._error(f"step annotation failed: {e}")
                    annotate = None
        try:
            yield
        except BaseException as e:
            if self._tracing:  # stop with this step's annotation still open: the step is not marked
                self._stop_and_analyze(interrupted=f"window {self._window} was interrupted in step {self._step} "
                                                   f"({type(e).__name__}): that step is left out, the report "
                                                   "covers the complete steps before it")
            raise
        finally:
            if annotate is not None:
                with contextlib.suppress(Exception):
                    annotate.__exit__(None, None, None)
            self._step += 1
            if bounds is not None and self._tracing and self._step >= bounds[1]:
                self._stop_and_analyze()

    def next_step(self) -> None:
        """Callback form: call once after every training step (no step annotation)."""
        with self.step():
            pass

    def _error(self, message: str) -> None:
        self.errors.append(message)
        log.warning("traceroof: %s (the job goes on)", message)

    def _start(self) -> None:
        try:
            import jax

            self._run_logdir = (self.logdir or self.out_dir / "profiles") / f"window_{self._window}"
            if not self._platform:
                self._platform = jax.devices()[0].platform
            jax.profiler.start_trace(str(self._run_logdir))
            self._tracing = True
        except Exception as e:  # noqa: BLE001
            self._error(f"could not start the profiler: {e}")
            self._window = self.repeat  # give up profiling, keep training

    def _stop_and_analyze(self, interrupted: str = "") -> None:
        """Stop the trace and hand the run directory to an analysis process; the job goes on at once."""
        window = self._window
        self._window += 1
        self._tracing = False
        try:
            import jax

            wait_for_dispatched_work()
            jax.profiler.stop_trace()
        except Exception as e:  # noqa: BLE001
            self._error(f"could not stop the profiler: {e}")
            return
        request = {"logdir": str(self._run_logdir), "out_dir": str(self.out_dir), "window": window,
                   "chip": self.chip, "warmup_steps": self.warmup_steps, "platform": self._platform,
                   "interrupted": interrupted}
        try:
            proc = _start_analysis_process(request)
        except Exception as e:  # noqa: BLE001
            self._error(f"could not start the analysis of window {window}: {e}")
            return
        t = threading.Thread(target=self._collect, args=(proc, window), daemon=True,
                             name=f"traceroof-window-{window}")
        t.start()
        self._threads.append(t)

    def _collect(self, proc: subprocess.Popen, window: int) -> None:
        """Wait (GIL released) for the analysis process of ``window`` and take its answer."""
        try:
            out, err = proc.communicate()
            lines = out.decode("utf-8", "replace").strip().splitlines()
            answer = json.loads(lines[-1]) if lines else {}
            if "error" in answer or "reports" not in answer:
                why = answer.get("error") or (f"the analysis process exited with status {proc.returncode}: "
                                              + (err.decode("utf-8", "replace").strip().splitlines() or [""])[-1])
                self._error(f"analysis of window {window} failed: {why}")
                return
            paths = tuple(Path(p) for p in answer["reports"])
            self.reports += paths
            log.info("traceroof: %s", answer["line"])
            if self.on_report is not None:
                self.on_report(WindowReport(window, paths, answer["line"], answer["summary"]))
        except Exception as e:  # noqa: BLE001 - a report failure must not reach the job
            self._error(f"analysis of window {window} failed: {e}")

    def close(self, timeout_s: float = 120.0) -> None:
        """Stop a window still open and wait (at most ``timeout_s``) for the reports being written."""
        if self._tracing:
            self._stop_and_analyze()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0.0))

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # leaving on an exception (Ctrl-C): the analysis process writes the reports on its own, the job exits now
        self.close(timeout_s=0.0 if exc_type is not None else 120.0)


def attach(out_dir: str | Path = "traceroof_reports", wait_steps: int = 1, warmup_steps: int = 1,
           active_steps: int = 3, repeat: int = 1, chip: str | None = None,
           on_report: Callable[[WindowReport], None] | None = None,
           logdir: str | Path | None = None) -> Attachment:
    """Profile steps of this process and write traceroof reports when each window closes.

    Use as a context manager around the training loop, calling ``with hook.step(): ...`` for each step (or
    ``hook.next_step()`` after it). Reports (``.txt``, ``.md``, ``.json``) go to ``out_dir/window_<k>/``,
    written by a separate analysis process; the raw profiles to ``logdir`` (default ``out_dir/profiles``).
    ``chip``: the target chip (id, name or chip file); default: detected (device jobs) or the cached host
    calibration (CPU jobs; without one, no roofline: attach never calibrates). ``on_report`` is called in a
    thread of the job with a :class:`WindowReport`. Errors are logged, never raised.
    """
    return Attachment(Path(out_dir), wait_steps, warmup_steps, active_steps, repeat, chip, on_report,
                      Path(logdir) if logdir else None)


# -- remote capture ------------------------------------------------------------------------------------------------

CAPTURE_RETRY_FOR_S = 60.0  # default: how long capture keeps trying when a capture holds no op events
CAPTURE_RETRY_PAUSE_S = 0.5  # pause between two captures of a job that ran nothing


def op_events_problem(run: Path) -> str:
    """Why the capture in ``run`` cannot be analyzed for want of op events (the profile reader's one-line
    reason), or ``""`` when it holds op events of some whole step or execution. Reads the capture as
    :func:`traceroof.analysis.analyze` does. A capture started while the job compiled may hold one execution, cut
    short by the trace's stop: no step holds it (:func:`traceroof.steps.left_out_executions`)."""
    from parsers.errors import InputError
    from traceroof.discovery import discover
    from traceroof.profile import load_profile

    try:
        profile = load_profile(discover([run]))
    except InputError as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    if not profile.rows["step"].notna().any():
        return "it holds no whole execution (the trace's start or stop cut the ones it holds)"
    return ""


def capture(address: str, duration_s: float, logdir: str | Path, retry_for_s: float = CAPTURE_RETRY_FOR_S,
            on_retry: Callable[[int, str], None] | None = None) -> Path:
    """Capture a profile from a job's profiler server (``jax.profiler.start_server(PORT)``) into ``logdir``;
    returns the new run directory.

    A job still starting (nothing listens at ``address`` yet) or compiling (or idle, or waiting for input:
    it answers with no trace, or with a capture that holds no op events; such a capture is removed) is tried
    again, for up to ``retry_for_s`` seconds after the first try (``on_retry(attempt, reason)`` is called before
    each new try).

    :raises CaptureError: nothing listened at ``address`` within ``retry_for_s``, the job has no profiler
        server, or no capture held op events within ``retry_for_s``.
    """
    try:
        from xprof.convert import _pywrap_profiler_plugin as plugin
    except ImportError as e:
        raise CaptureError(f"the profiler client is missing ({e}); pip install tensorboard-plugin-profile") from None
    root = Path(logdir)
    addr = address.removeprefix("grpc://")
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise CaptureError(f"{address!r} is not HOST:PORT (e.g. 127.0.0.1:9999)")
    started = time.monotonic()
    attempt = 0
    while True:  # until something listens: a job starts its profiler server after its imports and setup
        attempt += 1
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                break
        except OSError as e:
            waited_s = time.monotonic() - started
            if waited_s >= retry_for_s:
                raise CaptureError(f"nothing listens at {addr} ({e.strerror or e}) after {waited_s:.0f} s; start "
                                   f"the job with jax.profiler.start_server({port}), check the address, or wait "
                                   "longer with --retry-for") from None
            if on_retry is not None:
                on_retry(attempt, f"nothing listens at {addr} yet")
            time.sleep(CAPTURE_RETRY_PAUSE_S)
    attempt = 0
    while True:
        attempt += 1
        run, problem = _capture_once(plugin, addr, address, duration_s, root)
        if not problem:
            return run  # type: ignore[return-value]
        if run is not None:
            shutil.rmtree(run, ignore_errors=True)  # this call's own capture, without op events
        waited_s = time.monotonic() - started
        if waited_s >= retry_for_s:
            raise CaptureError(f"no op events in {attempt} capture(s) of {duration_s:g} s from {address} over "
                               f"{waited_s:.0f} s (last: {problem}): the job ran no XLA program while traced "
                               "(still compiling, idle or waiting for input), or the port is no "
                               "jax.profiler.start_server port; capture again once the job runs steps, or wait "
                               "longer with --retry-for")
        if on_retry is not None:
            on_retry(attempt, problem)
        time.sleep(CAPTURE_RETRY_PAUSE_S)


CAPTURE_OPTIONS = {"host_tracer_level": 2, "device_tracer_level": 1, "python_tracer_level": 1, "delay_ms": 0}
"""The tracers a capture asks the job's profiler server for: XProf's own capture defaults (xprof
profile_plugin.py, capture_route) with the Python tracer on, as ``jax.profiler.trace`` has it: without Python
events a slow data loader reads as an idle device 'with no host work in the way' (a user's capture of a loop that
sleeps 30 ms per batch), where the same loop traced in-process reads host-bound."""


def _capture_once(plugin: object, addr: str, address: str, duration_s: float, root: Path
                  ) -> tuple[Path | None, str]:
    """One capture into ``root``: (its new run directory or None, why it has no op events or "")."""
    profiles = root / "plugins" / "profile"
    before = set(profiles.glob("*")) if profiles.exists() else set()
    try:
        with _quiet_native_output():
            plugin.trace(addr, str(root), "", True, max(int(duration_s * 1000), 1), 1,  # type: ignore[attr-defined]
                         CAPTURE_OPTIONS)
    except Exception as e:  # noqa: BLE001 - the client raises RuntimeError with gRPC status text
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "No trace event was collected" in text or "no responses" in text:
            # what a profiler server that traced nothing answers (a job compiling or idle), and also what any
            # other server at the port makes the client say: the two cannot be told apart from here
            for run in (set(profiles.glob("*")) - before) if profiles.exists() else ():
                shutil.rmtree(run, ignore_errors=True)  # the client's own empty run directory
            return None, f"{addr} answered but sent no profile"
        if "UNAVAILABLE" in text:
            raise CaptureError(f"{addr} answered but sent no profile ({text[:120]}); is it a "
                               "jax.profiler.start_server port of a running job?") from None
        raise CaptureError(f"capture from {address} failed: {text}") from None
    runs = sorted(set(profiles.glob("*")) - before) if profiles.exists() else []
    if not runs:
        return None, "nothing was written"
    if not any(p.stat().st_size > 0 for p in runs[-1].glob("*.xplane.pb")):
        return runs[-1], "the capture is empty"
    return runs[-1], op_events_problem(runs[-1])


@contextlib.contextmanager
def _quiet_native_output() -> Iterator[None]:
    """Send what the native profiler client prints to fds 1 and 2 to a temporary file, not to the user."""
    with tempfile.TemporaryFile() as sink:
        saved = [os.dup(1), os.dup(2)]
        try:
            for fd in (1, 2):
                os.dup2(sink.fileno(), fd)
            yield
        finally:
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)


# -- watched logdir -----------------------------------------------------------------------------------------------

def _stable_files(run: Path, sizes: dict[Path, dict[Path, int]]) -> dict[Path, int] | None:
    """The run's .xplane.pb files (one per host) and their sizes in bytes when the same files with the same
    non-zero sizes were there at the last poll (``sizes``: each run's files at the last poll, updated here);
    ``None`` while there is none, or one is empty, new or growing."""
    now = {f: f.stat().st_size for f in sorted(run.glob("*.xplane.pb"))}
    before, sizes[run] = sizes.get(run), now
    return now if now and now == before and all(now.values()) else None


def watch(logdir: str | Path, interval_s: float = 2.0, timeout_s: float | None = None, max_reports: int | None = None,
          chip: str | None = None, on_report: Callable[[Path, object | None, str, int, int], None] | None = None,
          existing: bool = False, on_start: Callable[[Path, int], None] | None = None) -> list[Path]:
    """Analyze every new run under ``logdir/plugins/profile`` and write ``traceroof_report.*`` beside it.

    A run is analyzed once its ``.xplane.pb`` files (one per host) were the same, with the same sizes, at two
    polls ``interval_s`` apart. The hosts of a multi-host job (a TPU pod, a multi-process JAX job) write their
    files into one run directory and can finish seconds apart, so a reported run stays followed: when a host file
    appears in it or one changes size, it is analyzed again once stable, and its ``traceroof_report.*`` are
    replaced (no other file in the run directory is written). ``on_report(run_dir, analysis, error, hosts,
    hosts_before)`` is called after each analysis: ``analysis`` is ``None`` and ``error`` the one-line message
    when it failed; ``hosts`` is the number of host files analyzed, ``hosts_before`` the number the run's
    reports covered before (0: its first report; a failed analysis again leaves those reports in place).

    Runs present when watching starts are skipped unless ``existing``. Stops after ``timeout_s`` or once
    ``max_reports`` runs are reported: an analysis again does not count as a new report, and a host file that
    lands after watch returned is not seen (follow multi-host jobs with ``timeout_s``). A run that fails to
    analyze is skipped until its files change: a profile still being written (a writer that paused longer than
    a poll on a busy machine or a slow network disk) is analyzed again once it is whole.
    ``on_start(profile_dir, skipped)`` is called once the runs already there are listed: a run written after it
    is a new run. Returns the run directories reported, each once, in the order of their first reports.
    """
    root = Path(logdir) / "plugins" / "profile"
    skipped: set[Path] = set() if existing else (set(root.glob("*")) if root.exists() else set())
    if on_start:
        on_start(root, len(skipped))
    sizes: dict[Path, dict[Path, int]] = {}  # run -> its files' sizes (bytes) at the last poll
    reported: dict[Path, dict[Path, int]] = {}  # run -> its files' sizes when its reports were written
    failed: dict[Path, dict[Path, int]] = {}  # run -> its files' sizes when it failed
    done: list[Path] = []
    start = time.monotonic()
    while True:
        for run in sorted(root.glob("*")) if root.exists() else []:
            if run in skipped or not run.is_dir():
                continue
            files = _stable_files(run, sizes)
            if files is None or files == reported.get(run) or files == failed.get(run):
                continue
            hosts_before = len(reported.get(run, {}))
            try:
                from traceroof.analysis import analyze

                a = analyze(run, chip=chip)
                write_reports(a, run)
            except TraceroofError as e:
                failed[run] = files
                if on_report:
                    on_report(run, None, str(e), len(files), hosts_before)
                continue
            if run not in reported:
                done.append(run)
            reported[run] = files
            if on_report:
                on_report(run, a, "", len(files), hosts_before)
            if max_reports is not None and len(done) >= max_reports:
                return done
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            return done
        time.sleep(interval_s)
