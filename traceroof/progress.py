"""A progress bar on stderr for long runs, silent for short ones and when stderr is not a terminal.

``with progress(total, "hosts") as bar: ... bar.advance()`` draws a transient rich progress bar
(https://rich.readthedocs.io/en/stable/progress.html) on stderr, but only when stderr is a terminal and only
once the work has run longer than :data:`PROGRESS_DELAY_S`; when stderr is not a terminal it writes nothing at
all. The bar has no refresh thread (rich's ``auto_refresh=False``): it redraws on each ``advance`` call, and
``advance(0)`` redraws without counting, so a caller that waits can keep the elapsed time moving. Keeping the
process free of threads keeps ``fork`` safe for :func:`traceroof.parallel.map_hosts`. Nested ``progress``
blocks share one bar display, one line each.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

PROGRESS_DELAY_S = 2.0
"""Seconds of work before a bar appears: runs shorter than this print nothing."""

_shared: dict[str, Any] = {"bar": None, "users": 0, "off": False}  # the one rich display the open blocks share


def silence() -> None:
    """Never draw from this process (called in pool workers: only the parent draws). A bar inherited through
    ``fork`` is dropped, not stopped, since stopping it would write to the parent's terminal."""
    _shared.update(bar=None, off=True)


def _console() -> Console | None:
    """A rich Console on stderr when stderr is a terminal, else None (then nothing is ever drawn). Checks
    ``sys.stderr.isatty()`` itself, not rich's guess, which FORCE_COLOR turns on for pipes too."""
    try:
        if not sys.stderr.isatty():
            return None
    except (AttributeError, ValueError, OSError):  # no stderr, or a closed one
        return None
    from rich.console import Console
    return Console(stderr=True)


class Progress:
    """Counts finished work out of ``total`` and draws it on stderr once that is worth it (see the module)."""

    def __init__(self, total: int, label: str) -> None:
        self.total = total
        self.label = label
        self.done = 0
        self._start_s = time.monotonic()
        self._task: Any = None  # the rich task id once drawn
        self._off = False  # True once we know nothing will be drawn

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more finished units (0: only redraw) and draw the bar if the delay has passed."""
        self.done += n
        if self._off:
            return
        if self._task is None:
            if time.monotonic() - self._start_s <= PROGRESS_DELAY_S:
                return
            self._start()
            if self._off:
                return
        bar = _shared["bar"]
        bar.update(self._task, completed=self.done, elapsed_s=time.monotonic() - self._start_s)
        bar.refresh()

    def _start(self) -> None:
        if _shared["bar"] is None:
            console = None if _shared["off"] else _console()
            if console is None:
                self._off = True
                return
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
            from rich.progress import Progress as RichProgress
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[elapsed_s]:.0f} s"))
            _shared["bar"] = RichProgress(*columns, console=console, transient=True, auto_refresh=False)
            _shared["bar"].start()
        self._task = _shared["bar"].add_task(self.label, total=self.total, completed=self.done,
                                             elapsed_s=time.monotonic() - self._start_s)

    def _close(self) -> None:
        bar = _shared["bar"]
        if self._task is not None and bar is not None:
            bar.remove_task(self._task)
            self._task = None


@contextmanager
def progress(total: int, label: str) -> Iterator[Progress]:
    """A :class:`Progress` for ``total`` units of work named ``label`` (e.g. ``"hosts"``); the bar, if one was
    drawn, is erased when the block ends (transient)."""
    tracker = Progress(total, label)
    _shared["users"] += 1
    try:
        yield tracker
    finally:
        tracker._close()
        _shared["users"] -= 1
        if _shared["users"] == 0 and _shared["bar"] is not None:
            _shared["bar"].stop()
            _shared["bar"] = None
