"""Where input files live: local disk (pathlib) or object storage and other fsspec URLs (``gs://bucket/logdir``,
``s3://bucket/run``, ``memory://...``). The one module that knows about URLs.

A *location* is a :class:`~pathlib.Path` for a local file or folder (``file://`` URLs become one) and the URL
string for anything else; a str URL pickles, so a worker process can read it. Local locations go straight to
pathlib (the same calls as before URLs were accepted); URLs go through fsspec, imported only when a URL is used
(extras ``gcs`` = fsspec + gcsfs, ``s3`` = fsspec + s3fs). Nothing here writes, to the user's storage or anywhere.

Errors: every failure is an :class:`~parsers.errors.InputError` of one line naming the URL: fsspec or the
protocol's package missing (which extra to install), a file not found, permission denied (check credentials),
and any other storage or network error (its type and message; check the network and credentials). A file
larger than the read bound is a :class:`~parsers.errors.SizeLimitError`.
"""

from __future__ import annotations

import importlib
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Union
from urllib.parse import unquote

from parsers.errors import InputError, SizeLimitError, TraceroofError

Location = Union[Path, str]  # a local path, or a URL string
READ_LIMIT_BYTES = 16 << 30  # most bytes read into memory from one URL (local files are memory-mapped instead)
_CHUNK_BYTES = 16 << 20
_URL = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*::)*([A-Za-z][A-Za-z0-9+.-]+)://")
_EXTRAS = {"gs": ("gcs", "gcsfs"), "gcs": ("gcs", "gcsfs"), "s3": ("s3", "s3fs"), "s3a": ("s3", "s3fs")}


def is_url(x: object) -> bool:
    """True for a string of the form ``<protocol>://...`` (also fsspec chains ``simplecache::gs://...``)."""
    return isinstance(x, str) and _URL.match(x) is not None


def location(x: str | Path) -> Location:
    """The location of a user path: a :class:`Path` for a local path or a ``file://`` URL, else the URL string
    (without a trailing ``/``)."""
    if not is_url(x):
        return Path(x)
    url = str(x)
    if url.lower().startswith("file://"):
        rest = unquote(url[len("file://"):])
        return Path(rest[len("localhost"):] if rest.startswith("localhost/") else rest)
    return url.rstrip("/") if not url.endswith("://") else url


def process_local(loc: Location) -> bool:
    """True for a location only this process can read (fsspec's ``memory://`` filesystem lives in its memory):
    it must not be handed to worker processes or a cluster."""
    return isinstance(loc, str) and loc.startswith("memory://")


def name(loc: Location) -> str:
    """The last component of a location (``h0.xplane.pb`` of ``gs://b/run/h0.xplane.pb``)."""
    return loc.name if isinstance(loc, Path) else loc.rstrip("/").rsplit("/", 1)[-1]


def join(loc: Location, *parts: str) -> Location:
    """``loc`` with ``parts`` appended (``/`` for URLs)."""
    if isinstance(loc, Path):
        return loc.joinpath(*parts)
    return "/".join([loc.rstrip("/"), *parts])


def parent(loc: Location) -> Location:
    """The folder holding ``loc``."""
    if isinstance(loc, Path):
        return loc.parent
    head, _, _ = loc.rstrip("/").rpartition("/")
    return head if not head.endswith(":/") else loc


def _protocol(url: str) -> str:
    m = _URL.match(url)
    return m.group(1).lower() if m else "file"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _missing_package(url: str, e: BaseException | None = None) -> InputError:
    """The error for a URL whose filesystem is not installed: which extra (gs, s3) or package to install;
    ``e`` is fsspec's ImportError for another protocol's package (its message names the package)."""
    proto = _protocol(url)
    extra, _ = _EXTRAS.get(proto, ("", ""))
    if extra:
        return InputError(f"{url}: {proto}:// paths need the {extra} extra: pip install 'traceroof[{extra}]'")
    if e is None:
        return InputError(f"{url}: {proto}:// paths need fsspec: pip install fsspec")
    return InputError(f"{url}: {proto}:// paths need a package fsspec does not find ({_one_line(e)}); install it")


@contextmanager
def _remote(url: str) -> Iterator[None]:
    """Turn what fsspec and its filesystems raise into one-line :class:`InputError`. Catches every exception of
    the storage calls inside (filesystems raise their own network and auth errors), never a TraceroofError."""
    try:
        yield
    except TraceroofError:
        raise
    except ImportError as e:
        raise _missing_package(url, e) from None
    except FileNotFoundError:
        raise InputError(f"{url} does not exist; check the bucket and the path") from None
    except PermissionError as e:
        raise InputError(f"{url}: permission denied ({_one_line(e)}); check your credentials (gcloud auth "
                         "application-default login, AWS_PROFILE...) and that they may read it") from None
    except Exception as e:
        raise InputError(f"cannot read {url}: {type(e).__name__}: {_one_line(e)}; check the URL, the network and "
                         "your credentials, then try again") from None


def _fs(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, its path) of a URL. :raises InputError: fsspec or the protocol's package missing,
    or an unknown protocol."""
    with _remote(url):
        try:
            import fsspec.core

            importlib.import_module(_EXTRAS.get(_protocol(url), ("", "fsspec"))[1])
        except ImportError:
            raise _missing_package(url) from None
        try:
            return fsspec.core.url_to_fs(url)
        except ValueError as e:  # "Protocol not known: foo"
            raise InputError(f"{url}: {_one_line(e)}; pass a local path or a URL fsspec knows (gs://, s3://...)") \
                from None


def _kind(url: str) -> str | None:
    """``file``, ``directory`` or None (nothing there) from the filesystem's ``info``: unlike fsspec's
    ``exists``/``isfile``, which answer False on any error, a permission or network error is raised."""
    fs, path = _fs(url)
    with _remote(url):
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return None
    return "directory" if info.get("type") == "directory" else "file"


def exists(loc: Location) -> bool:
    """True when a file or folder is at ``loc``. :raises InputError: storage unreachable (URLs)."""
    return loc.exists() if isinstance(loc, Path) else _kind(loc) is not None


def is_file(loc: Location) -> bool:
    """True when ``loc`` is a file. :raises InputError: storage unreachable (URLs)."""
    return loc.is_file() if isinstance(loc, Path) else _kind(loc) == "file"


def is_dir(loc: Location) -> bool:
    """True when ``loc`` is a folder (an object-store prefix). :raises InputError: storage unreachable (URLs)."""
    return loc.is_dir() if isinstance(loc, Path) else _kind(loc) == "directory"


def listing(folder: Location) -> tuple[list[Location], list[Location]]:
    """(files, sub-folders) directly in ``folder``, each sorted; both empty when it is not a folder.

    :raises InputError: storage unreachable (URLs)."""
    if isinstance(folder, Path):
        local_files: list[Location] = []
        local_dirs: list[Location] = []
        for p in folder.iterdir() if folder.is_dir() else ():
            (local_files if p.is_file() else local_dirs if p.is_dir() else []).append(p)
        return sorted(local_files), sorted(local_dirs)
    fs, path = _fs(folder)
    with _remote(folder):
        try:
            entries = fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return [], []
    files, dirs = [], []
    for e in entries:
        child = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
        if child and str(e["name"]).rstrip("/") != path.rstrip("/"):
            (dirs if e.get("type") == "directory" else files).append(join(folder, child))
    return sorted(files), sorted(dirs)


def walk(folder: Location, pattern: str = "*") -> list[tuple[Location, tuple[str, ...]]]:
    """Every file under ``folder`` (recursively) whose name matches the glob ``pattern``, sorted, each with its
    path parts relative to ``folder`` (for skipping subfolders).

    :raises InputError: storage unreachable (URLs)."""
    if isinstance(folder, Path):
        return [(p, p.relative_to(folder).parts) for p in sorted(folder.rglob(pattern)) if p.is_file()]
    from fnmatch import fnmatchcase

    fs, path = _fs(folder)
    base = path.rstrip("/")
    with _remote(folder):
        found = fs.find(path)
    out = []
    for full in sorted(found):
        rel = str(full)[len(base) + 1:] if str(full).startswith(base + "/") else ""
        parts = tuple(rel.split("/"))
        if rel and fnmatchcase(parts[-1], pattern):
            out.append((join(folder, rel), parts))
    return out


def read_bytes(loc: Location, limit_bytes: int = READ_LIMIT_BYTES) -> bytes | bytearray:
    """The bytes of a file, at most ``limit_bytes`` of them (a gzip file's inflated size is bounded apart, by
    :mod:`parsers.inflate`). Read in one piece when the size is known, else in chunks.

    :raises InputError: the file cannot be opened or read. :raises SizeLimitError: it holds more than
        ``limit_bytes``."""
    if isinstance(loc, Path):
        try:
            if loc.stat().st_size > limit_bytes:
                raise _too_big(loc, limit_bytes)
            return loc.read_bytes()
        except OSError as e:
            raise InputError(f"cannot open {loc}: {e.strerror or e}") from None
    fs, path = _fs(loc)
    with _remote(loc):
        with fs.open(path, "rb") as f:
            size = getattr(f, "size", None)
            if isinstance(size, int) and size > limit_bytes:
                raise _too_big(loc, limit_bytes)
            if isinstance(size, int):
                return f.read()
            out = bytearray()
            while chunk := f.read(min(_CHUNK_BYTES, limit_bytes + 1 - len(out))):
                out += chunk
                if len(out) > limit_bytes:
                    raise _too_big(loc, limit_bytes)
            return out


def _too_big(loc: Location, limit_bytes: int) -> SizeLimitError:
    fix = ("copy it to a local disk (gsutil cp, aws s3 cp) and pass the local path" if isinstance(loc, str)
           else "no profile or HLO file is this large: check the path")
    return SizeLimitError(f"{loc}: more than the {limit_bytes:,} bytes traceroof reads into memory from one "
                          f"file; {fix}")


def read_head(loc: Location, n_bytes: int) -> bytes:
    """The first ``n_bytes`` bytes of a file (fewer when it is shorter); ``b""`` when a local file cannot be read.

    :raises InputError: a URL that cannot be read (a network error must not silently skip a file)."""
    if isinstance(loc, Path):
        try:
            with loc.open("rb") as f:
                return f.read(n_bytes)
        except OSError:
            return b""
    fs, path = _fs(loc)
    with _remote(loc):
        with fs.open(path, "rb") as f:
            return f.read(n_bytes)
