"""Profile a running job and analyze what it captures: in-process hook, remote capture, watched logdir.

* :func:`attach` profiles a window of steps of the calling JAX program (schedule: ``wait_steps``,
  ``warmup_steps``, ``active_steps``, ``repeat`` times) with ``jax.profiler``; when a window closes it waits for
  the steps dispatched so far to run (JAX dispatches asynchronously), stops the trace, analyzes the capture
  in a background thread (the HLO comes from the profile itself) and writes the reports. It never raises into
  the training loop: every error is logged and the job goes on.
* :func:`capture` asks a job that called ``jax.profiler.start_server(PORT)`` for a profile over gRPC (the
  profiler client that tensorboard-plugin-profile ships, ``xprof.convert._pywrap_profiler_plugin.trace``).
* :func:`watch` analyzes every new run directory that appears under a TensorBoard logdir.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from parsers.errors import TraceroofError

log = logging.getLogger("traceroof")
REPORT_FORMATS = {"txt": "terminal", "md": "markdown", "json": "json"}


class CaptureError(TraceroofError):
    """A remote capture failed: no profiler server at the address, or nothing was captured."""


def write_reports(analysis: object, directory: Path, stem: str = "traceroof_report") -> list[Path]:
    """Write the terminal, Markdown and JSON reports of an analysis into ``directory``; returns the paths."""
    from traceroof.report import render

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext, fmt in REPORT_FORMATS.items():
        p = directory / f"{stem}.{ext}"
        p.write_text(render(analysis, fmt), encoding="utf-8")  # type: ignore[arg-type]
        paths.append(p)
    return paths


def one_line(analysis: object) -> str:
    """A one-line summary: step time, MFU, roofline efficiency, exposed communication, worst layer."""
    s = analysis.summary  # type: ignore[attr-defined]
    layers = analysis.layers  # type: ignore[attr-defined]
    worst = f"; worst layer {layers.iloc[0]['layer']} ({layers.iloc[0]['phase']})" if len(layers) else ""
    return (f"step {s.step_time_mean_s * 1e3:.3f} ms over {len(s.steps_used)} steps, MFU {s.mfu:.1%}, "
            f"roofline efficiency {s.roofline_efficiency:.1%}, exposed comm {s.exposed_comm_per_step_s * 1e3:.3f} "
            f"ms{worst}")


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


@dataclass
class Attachment:
    """The in-process profiler: call :meth:`step` around (or after) every training step.

    Steps are counted from 0; window ``k`` (``k < repeat``) starts tracing at step
    ``wait_steps + k*(warmup_steps+active_steps)``, marks steps with ``jax.profiler.StepTraceAnnotation`` and stops
    after ``warmup_steps + active_steps`` steps; the report then excludes the warm-up steps. Reports go to ``out_dir/window_<k>/``.
    """

    out_dir: Path
    wait_steps: int = 1
    warmup_steps: int = 1
    active_steps: int = 3
    repeat: int = 1
    chip: str | None = None
    on_report: Callable[[object], None] | None = None
    logdir: Path | None = None
    step_name: str = "train"
    reports: list[Path] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _step: int = 0
    _tracing: bool = False
    _window: int = 0
    _threads: list[threading.Thread] = field(default_factory=list)

    def _window_bounds(self) -> tuple[int, int] | None:
        if self._window >= self.repeat:
            return None
        start = self.wait_steps + self._window * (self.warmup_steps + self.active_steps)
        return start, start + self.warmup_steps + self.active_steps

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Context manager around one training step; outside a window it costs a couple of comparisons."""
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
            jax.profiler.start_trace(str(self._run_logdir))
            self._tracing = True
        except Exception as e:  # noqa: BLE001
            self._error(f"could not start the profiler: {e}")
            self._window = self.repeat  # give up profiling, keep training

    def _stop_and_analyze(self) -> None:
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
        t = threading.Thread(target=self._analyze, args=(self._run_logdir, window), daemon=True,
                             name=f"traceroof-window-{window}")
        t.start()
        self._threads.append(t)

    def _analyze(self, logdir: Path, window: int) -> None:
        try:
            from traceroof.analysis import analyze

            a = analyze(logdir, chip=self.chip, warmup_steps=self.warmup_steps)
            self.reports += write_reports(a, self.out_dir / f"window_{window}")
            log.warning("traceroof: %s", one_line(a))
            if self.on_report is not None:
                self.on_report(a)
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

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach(out_dir: str | Path = "traceroof_reports", wait_steps: int = 1, warmup_steps: int = 1,
           active_steps: int = 3, repeat: int = 1, chip: str | None = None, on_report: Callable[[object], None] | None = None,
           logdir: str | Path | None = None) -> Attachment:
    """Profile steps of this process and write traceroof reports when each window closes.

    Use as a context manager around the training loop, calling ``with hook.step(): ...`` for each step (or
    ``hook.next_step()`` after it). Reports (``.txt``, ``.md``, ``.json``) go to ``out_dir/window_<k>/``; the
    raw profiles to ``logdir`` (default ``out_dir/profiles``). Errors are logged, never raised.
    """
    return Attachment(Path(out_dir), wait_steps, warmup_steps, active_steps, repeat, chip, on_report,
                      Path(logdir) if logdir else None)


# -- remote capture ------------------------------------------------------------------------------------------------

CAPTURE_RETRY_FOR_S = 60.0  # default: how long capture keeps trying when a capture holds no op events
CAPTURE_RETRY_PAUSE_S = 0.5  # pause between two captures of a job that ran nothing


def op_events_problem(run: Path) -> str:
    """Why the capture in ``run`` cannot be analyzed for want of op events (the profile reader's one-line
    reason), or ``""`` when it holds op events. Reads the capture as :func:`traceroof.analysis.analyze` does."""
    from parsers.errors import InputError
    from traceroof.profile import discover, load_profile

    try:
        load_profile(discover([run]))
    except InputError as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return ""


def capture(address: str, duration_s: float, logdir: str | Path, retry_for_s: float = CAPTURE_RETRY_FOR_S,
            on_retry: Callable[[int, str], None] | None = None) -> Path:
    """Capture a profile from a job's profiler server (``jax.profiler.start_server(PORT)``) into ``logdir``;
    returns the new run directory.

    A job still compiling (or idle, or waiting for input) answers with no trace, or with a capture that holds no
    op events: such a capture is removed and another taken, for up to ``retry_for_s`` seconds after the first
    one started (``on_retry(attempt, reason)`` is called before each new try). A port where nothing listens
    fails at once.

    :raises CaptureError: nothing listens at ``address``, the job has no profiler server, or no capture held op
        events within ``retry_for_s``.
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
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            pass
    except OSError as e:
        raise CaptureError(f"nothing listens at {addr} ({e.strerror or e}); start the job with "
                           f"jax.profiler.start_server({port}) or check the address") from None
    started = time.monotonic()
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


def _capture_once(plugin: object, addr: str, address: str, duration_s: float, root: Path
                  ) -> tuple[Path | None, str]:
    """One capture into ``root``: (its new run directory or None, why it has no op events or "")."""
    profiles = root / "plugins" / "profile"
    before = set(profiles.glob("*")) if profiles.exists() else set()
    try:
        with _quiet_native_output():
            plugin.trace(addr, str(root), "", True, max(int(duration_s * 1000), 1), 1, {})  # type: ignore[attr-defined]
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

def _complete(run: Path, sizes: dict[Path, int]) -> bool:
    """A run directory is complete when it holds an .xplane.pb whose size did not change since the last poll."""
    files = sorted(run.glob("*.xplane.pb"))
    if not files:
        return False
    now = {f: f.stat().st_size for f in files}
    stable = all(sizes.get(f) == s and s > 0 for f, s in now.items())
    sizes.update(now)
    return stable


def watch(logdir: str | Path, interval_s: float = 2.0, timeout_s: float | None = None, max_reports: int | None = None,
          chip: str | None = None, on_report: Callable[[Path, object | None, str], None] | None = None,
          existing: bool = False) -> list[Path]:
    """Analyze every new run under ``logdir/plugins/profile`` and write ``traceroof_report.*`` beside it.

    Runs present when watching starts are skipped unless ``existing``. Stops after ``timeout_s`` or
    ``max_reports`` reports. A run that fails to analyze is reported through ``on_report`` with the error and
    skipped. Returns the run directories analyzed.
    """
    root = Path(logdir) / "plugins" / "profile"
    seen: set[Path] = set() if existing else (set(root.glob("*")) if root.exists() else set())
    sizes: dict[Path, int] = {}
    done: list[Path] = []
    start = time.monotonic()
    while True:
        for run in sorted(root.glob("*")) if root.exists() else []:
            if run in seen or not run.is_dir() or not _complete(run, sizes):
                continue
            seen.add(run)
            try:
                from traceroof.analysis import analyze

                a = analyze(run, chip=chip)
                write_reports(a, run)
                done.append(run)
                if on_report:
                    on_report(run, a, "")
            except TraceroofError as e:
                if on_report:
                    on_report(run, None, str(e))
            if max_reports is not None and len(done) >= max_reports:
                return done
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            return done
        time.sleep(interval_s)
