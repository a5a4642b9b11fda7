"""Bounded gzip decompression for every compressed input (``.xplane.pb.gz``, trace JSON, XProf exports).

A small gzip file can hold gigabytes (100 MB of zero bytes compress to 100 kB), so output is limited to
:func:`inflate_limit` bytes: 100 times the compressed size, at least 64 MiB, or the byte count in the
``TRACEROOF_MAX_INFLATE_BYTES`` environment variable when it is set. Real profiles and exports inflate 5-30x.
"""

from __future__ import annotations

import os
import zlib

from parsers.errors import FormatError, SizeLimitError

INFLATE_RATIO = 100
INFLATE_FLOOR_BYTES = 64 << 20
LIMIT_VARIABLE = "TRACEROOF_MAX_INFLATE_BYTES"
_CHUNK_BYTES = 16 << 20


def inflate_limit(compressed_bytes: int) -> int:
    """Most bytes a gzip input of this size may inflate to (see the module docstring).

    :raises FormatError: ``TRACEROOF_MAX_INFLATE_BYTES`` is set to something that is not a positive integer.
    """
    raw = os.environ.get(LIMIT_VARIABLE, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value <= 0:
            raise FormatError(f"{LIMIT_VARIABLE}={raw!r} is not a positive byte count; set it to e.g. 4000000000")
        return value
    return max(INFLATE_RATIO * compressed_bytes, INFLATE_FLOOR_BYTES)


def inflate(data: bytes, source: str, redo: str = "capture it again") -> bytearray:
    """The decompressed bytes of gzip ``data`` (one or more members), read from ``source``.

    :raises SizeLimitError: the output would exceed :func:`inflate_limit`.
    :raises FormatError: the gzip data is corrupt or truncated (``redo`` says what to do).
    """
    limit = inflate_limit(len(data))
    out = bytearray()
    rest = memoryview(data)
    try:
        while True:
            d = zlib.decompressobj(31)
            pending = rest
            while pending and not d.eof:
                chunk = d.decompress(pending, min(limit - len(out) + 1, _CHUNK_BYTES))
                out += chunk
                if len(out) > limit:
                    raise SizeLimitError(
                        f"{source}: gzip data inflates to more than {limit:,} bytes ({len(data):,} compressed): "
                        f"a decompression bomb or not a profile; to read it anyway set {LIMIT_VARIABLE} to a larger "
                        "byte count")
                pending = d.unconsumed_tail
            if not d.eof:
                raise FormatError(f"{source}: gzip data is truncated (the stream ends early); {redo}")
            rest = memoryview(d.unused_data)
            if not rest or not bytes(rest[:2]) == b"\x1f\x8b":
                if any(rest):
                    raise FormatError(f"{source}: bytes after the end of the gzip data; the file is corrupt - {redo}")
                return out
    except zlib.error as e:
        raise FormatError(f"{source}: gzip data is corrupt ({e}); {redo}") from None
