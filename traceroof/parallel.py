"""Run one function over many hosts' inputs: in this process, in a local process pool, or on a Dask cluster.

A TPU pod profile has one file per host; each host is decoded and aggregated on its own and only small tables
come back, so :func:`map_hosts` maps a module-level function over the items and returns the results in the
items' order. ``fn``, the items and the results must pickle (module-level functions, ``functools.partial`` of
them, paths, strings, dataclasses, DataFrames).

Start method of the local pool (measured on Linux, Python 3.11, a parent that has imported traceroof as
``traceroof analyze`` has, 2 cores): ``fork`` starts a worker in about 5 ms (8 workers: 0.04 s); ``spawn`` and
``forkserver`` re-import traceroof and pandas in every worker, about 0.4 s of CPU each (8 workers: 2.0 s and
2.9 s). ``fork`` is unsafe only when another thread may hold a lock at the moment of the fork; the parent of
``traceroof analyze`` has no JAX and no Python threads (the progress bar has no refresh thread), so
:func:`start_method` uses ``fork`` on Linux in that case, and ``spawn`` otherwise (or off Linux: macOS
frameworks are not fork-safe). ``forkserver`` is not used: it measured slower than ``spawn`` here.

How results come back from the local pool: a pool sends each result pickled through a pipe, copied three times
(pickled, read from the pipe in 64 kB pieces, unpickled) by the parent, whose result thread competes with the
workers for the cores. A worker here writes its result to a file in a folder of shared memory (``/dev/shm``)
instead, pickle protocol 5 with its arrays written out of band, and the parent reads it with one read and unpickles
its arrays without a copy (:func:`_spill`, :func:`_unspill`). Measured (4 hosts x 2 M events, 32 MB of op rows and
timeline per host, 2 workers, 2 cores): the parent's CPU while the hosts are read 0.24-0.27 -> 0.16-0.19 s. Where the
folder is full (a container's 64 MB ``/dev/shm``) the result goes through the pipe as before.
"""

from __future__ import annotations

import gc
import mmap
import multiprocessing
import os
import pickle
import queue
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TypeVar

from parsers.errors import InputError
from traceroof.progress import progress, silence
from traceroof.units import fmt_list

T = TypeVar("T")
R = TypeVar("R")

DASK_CONNECT_TIMEOUT_S = 10.0
"""Seconds to wait for a Dask scheduler to answer, and then for it to have at least one worker."""

_FORK_UNSAFE_MODULES = ("jax", "jaxlib", "tensorflow", "torch")  # once imported, they run native threads
_POLL_S = 0.5  # seconds between progress redraws while waiting for results
_state: Any = None  # in a pool worker: one byte per item, 1 while it runs, 2 once it ended (see _run)
_spill_dir: str | None = None  # in a pool worker: where results are written (_spill); None: through the pipe
_SHARED_MEMORY_DIR = "/dev/shm"


def cpu_count() -> int:
    """The cores this process may run on (its CPU affinity, which containers and ``taskset`` narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def start_method() -> str:
    """The multiprocessing start method for the local pool: ``fork`` when safe and available, else ``spawn``
    (the module docstring has the measurements). Not safe: another Python thread, or a library that runs
    native threads and warns against fork (JAX, which ``--chip host`` calibration may load; TensorFlow, torch).
    numpy's OpenBLAS thread pool is fork-safe (it re-creates its threads in the child)."""
    if (sys.platform == "linux" and threading.active_count() == 1
            and not any(name in sys.modules for name in _FORK_UNSAFE_MODULES)):
        return "fork"
    return "spawn"


def map_hosts(fn: Callable[[T], R], items: Sequence[T], *, jobs: int | None = None,
              dask_address: str | None = None, label: str = "hosts") -> list[R]:
    """``[fn(item) for item in items]``, run in parallel, with a progress bar named ``label`` on a terminal.

    ``jobs``: worker processes (None: :func:`cpu_count`); the pool never has more processes than items, and one
    job or one item runs in this process with no pool and no pickling. ``dask_address`` (``tcp://host:8786``)
    runs the map on that Dask cluster instead, which then decides the parallelism.

    Raises: InputError for ``jobs`` < 1 or given with ``dask_address``, for a worker process that died (the
    message names the items it was running and says to run with fewer ``--jobs``) and for Dask trouble (extra
    not installed, scheduler not answering within :data:`DASK_CONNECT_TIMEOUT_S`, no workers, workers that cannot
    import traceroof, a worker killed). The first error ``fn`` raises is re-raised as is (a TraceroofError keeps
    its class and one-line message); the items not yet started are cancelled (those running finish first).
    """
    if jobs is not None and jobs < 1:
        raise InputError(f"--jobs {jobs}: must be 1 or more (leave --jobs out to use every core)")
    if jobs is not None and dask_address is not None:
        raise InputError(f"--jobs {jobs} with --dask: the Dask cluster's workers decide the parallelism; "
                         "drop --jobs")
    items = list(items)
    if dask_address is not None:
        return _map_dask(fn, items, dask_address, label)
    workers = min(jobs or cpu_count(), len(items))
    if len(items) <= 1:
        return [fn(item) for item in items]
    if workers == 1:
        results = []
        with progress(len(items), label) as bar:
            for item in items:
                results.append(fn(item))
                bar.advance()
        return results
    return _map_pool(fn, items, workers, label)


def _init_worker(state: Any, spill_dir: str | None) -> None:
    """In a new pool worker: keep the shared item state and the folder results are written to, and never draw a
    progress bar."""
    global _state, _spill_dir
    _state, _spill_dir = state, spill_dir
    silence()


def _run(fn: Callable[[T], R], index: int, item: T) -> R | _Spilled:
    """In a pool worker: ``fn(item)``, marking item ``index`` running, then ended, in the shared state; the
    result written to a file when the pool has a folder for them (:func:`_spill`)."""
    _state[index] = 1
    try:
        result = fn(item)
    finally:
        _state[index] = 2
    return _spill(result, _spill_dir) if _spill_dir is not None else result


@dataclass(frozen=True)
class _Spilled:
    """A result a pool worker wrote to ``path``: its pickle (protocol 5) of ``head_bytes``, then its out-of-band
    buffers of ``sizes_bytes`` each, one after another (:func:`_spill`)."""

    path: str
    head_bytes: int
    sizes_bytes: tuple[int, ...]


def _spill(result: Any, folder: str) -> Any:
    """``result`` written to a new file in ``folder`` (its large arrays out of band, not copied into the pickle), as
    a :class:`_Spilled`; ``result`` itself when the file cannot be written (the folder full or gone)."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(result, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    path = ""
    try:
        fd, path = tempfile.mkstemp(dir=folder)
        with os.fdopen(fd, "wb") as f:
            for part in (head, *views):
                f.write(part)
    except OSError:
        if path:
            os.unlink(path)
        return result
    return _Spilled(path, len(head), tuple(v.nbytes for v in views))


def _unspill(result: Any) -> Any:
    """In the parent: the result a worker wrote (:func:`_spill`), mapped copy-on-write and unpickled with its arrays
    in the mapping (writable, neither read nor copied: the file is in shared memory, and the pages stay the file's
    until written); the file removed (its pages freed when the last array goes). Any other result as it is.
    Reading it into a new buffer instead cost 0.21 of the 2.25 wall seconds of 4 hosts of 2 M events with
    ``--jobs 2``, in the parent, while no worker ran."""
    if not isinstance(result, _Spilled):
        return result
    with open(result.path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    os.unlink(result.path)
    view, at = memoryview(data), result.head_bytes
    buffers = []
    for size in result.sizes_bytes:
        buffers.append(view[at:at + size])
        at += size
    return pickle.loads(view[:result.head_bytes], buffers=buffers)


def _spill_folder() -> str | None:
    """A new folder in shared memory for the pool's results, or None (no ``/dev/shm``: results go through the
    pipe)."""
    try:
        return tempfile.mkdtemp(prefix="traceroof-", dir=_SHARED_MEMORY_DIR)
    except OSError:
        return None


def _line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _collect(futures: list[Any], wait_some: Callable[[set[Any]], tuple[set[Any], set[Any]]], label: str,
             take: Callable[[Any], Any] = lambda result: result) -> list[Any]:
    """The futures' results in their order, each passed through ``take`` as soon as it ended, advancing a
    progress bar; the first error (lowest index among those that ended together) raised as soon as it is known."""
    index = {future: i for i, future in enumerate(futures)}
    results: list[Any] = [None] * len(futures)
    pending = set(futures)
    with progress(len(futures), label) as bar:
        while pending:
            done, pending = wait_some(pending)
            bar.advance(len(done))
            for future in sorted(done, key=index.__getitem__):
                results[index[future]] = take(future.result())
    return results


def _map_pool(fn: Callable[[T], R], items: list[T], workers: int, label: str) -> list[R]:
    """The map in a local process pool. Forked workers share the parent's objects until they write them, and a
    garbage collection in a worker writes to every object it examines: the parent's objects are frozen out of
    collection while the workers fork (``gc.freeze``, as the gc docs advise before a fork), which made reading 4
    hosts with 2 workers 20 % faster (1.66 -> 1.35 s) by copying fewer pages."""
    method = start_method()
    context = multiprocessing.get_context(method)
    state = context.RawArray("b", len(items))
    folder = _spill_folder()
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(state, folder))
    if method == "fork":
        gc.freeze()
    try:
        futures = [pool.submit(_run, fn, i, item) for i, item in enumerate(items)]
        return _collect(futures, lambda pending: wait(pending, _POLL_S, FIRST_COMPLETED), label, _unspill)
    except BrokenProcessPool:
        running = [item for i, item in enumerate(items) if state[i] == 1]
        where = f" while analyzing {fmt_list(running)}" if running else ""
        raise InputError(f"a worker process died{where} (killed, often for lack of memory): "
                         f"run with fewer --jobs (now {workers})") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        if method == "fork":
            gc.unfreeze()


def _map_dask(fn: Callable[[T], R], items: list[T], address: str, label: str) -> list[R]:
    """The map on the Dask scheduler at ``address`` (https://distributed.dask.org/en/stable/client.html)."""
    try:
        import distributed
    except ImportError:
        raise InputError("--dask needs the dask extra: pip install 'traceroof[dask]'") from None
    try:  # a malformed address or unknown host first: a Client that fails on those hangs 2 timeouts in __del__
        distributed.comm.resolve_address(address)
        client = distributed.Client(address, timeout=DASK_CONNECT_TIMEOUT_S, set_as_default=False)
    except (OSError, ValueError) as error:  # a malformed address, no such host, nothing listening
        raise InputError(f"--dask {address}: cannot connect to a Dask scheduler there ({_line(error)}): start one "
                         f"with `dask scheduler` and workers with `dask worker ADDRESS`, or leave out --dask") from None
    with client:
        try:
            client.wait_for_workers(1, timeout=DASK_CONNECT_TIMEOUT_S)
        except TimeoutError:
            raise InputError(f"--dask {address}: the scheduler has no workers after {DASK_CONNECT_TIMEOUT_S:g} s: "
                             f"start some with `dask worker {address}`") from None
        # A task whose function the workers cannot unpickle hangs (the worker dies and is restarted, over and
        # over), so first import the modules it needs on every worker, which fails cleanly.
        module = getattr(getattr(fn, "func", fn), "__module__", None)
        try:
            client.run(exec, "import " + ", ".join(sorted({"traceroof", module or "traceroof"})))
        except ImportError as error:
            raise InputError(f"--dask {address}: the Dask workers cannot import {error.name or 'traceroof'} "
                             f"({_line(error)}): install the same traceroof on them") from None
        futures = client.map(fn, items, pure=False)
        try:
            return _collect(futures, _dask_waiter(futures), label)
        except distributed.KilledWorker:
            running = [items[i] for i, future in enumerate(futures) if future.status == "error"]
            raise InputError(f"--dask {address}: a Dask worker died while analyzing {fmt_list(running)} (killed, "
                             f"often for lack of memory): give the workers more memory") from None
        return client.gather(futures)


def _dask_waiter(futures: list[Any]) -> Callable[[set[Any]], tuple[set[Any], set[Any]]]:
    """A ``wait_some`` for :func:`_collect` over Dask futures: it returns what ended within ``_POLL_S``. (Not
    ``distributed.wait``, which only works with the default client, which we do not set.)"""
    ended: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for future in futures:
        future.add_done_callback(ended.put)

    def wait_some(pending: set[Any]) -> tuple[set[Any], set[Any]]:
        done = set()
        try:
            done.add(ended.get(timeout=_POLL_S))
            while True:
                done.add(ended.get_nowait())
        except queue.Empty:
            return done, pending - done
    return wait_some
