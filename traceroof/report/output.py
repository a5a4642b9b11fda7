"""Writing reports to files: never over an input, never half-written.

* :func:`refuse_inputs` raises when the output names one of the command's input files (same resolved path, or
  the same file through a hard link or a symbolic link).
* :func:`write_atomic` writes into a temporary file in the output's folder and renames it over the output
  (``os.replace``): a reader sees the old file or the whole new one, and an interrupted write (an error, Ctrl-C,
  a full disk) leaves no partial file behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path
from typing import Iterable

from parsers.errors import InputError


def _identity(p: Path) -> tuple[int, int] | None:
    try:
        st = p.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def refuse_inputs(output: str | Path, inputs: Iterable[str | Path], option: str = "-o") -> None:
    """Raise unless writing ``output`` leaves every file of ``inputs`` as it is.

    :raises InputError: ``output`` resolves to an input file, or is the same file (hard link, symbolic link).
    """
    out = Path(output)
    out_resolved = out.resolve()
    out_id = _identity(out)
    for raw in inputs:
        p = Path(raw)
        if p.resolve() == out_resolved or (out_id is not None and _identity(p) == out_id):
            link = "" if p.resolve() == out_resolved else " (the same file through a link)"
            raise InputError(f"{option} {output} would overwrite {p}{link}, an input of this command (a profile, "
                             "HLO, chip or baseline file, or a file of a run directory given); traceroof never "
                             "writes over its input: write the report to another file")


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: a temporary file in the same folder, flushed to disk, then
    renamed over ``path``. A symbolic link at ``path`` is kept and its target replaced; an existing file keeps
    its permission bits, a new one gets the umask's. On any error or interruption the temporary file is removed
    and ``path`` is left as it was.

    :raises OSError: the folder is not writable, the disk is full, ``path`` is a directory...
    """
    target = Path(os.path.realpath(path))
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open(path, "w")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
