"""Exceptions raised by the parsers. ``TraceroofError`` is the project's one exception root."""

from __future__ import annotations


class TraceroofError(Exception):
    """Root of every error traceroof raises on bad input; its message is one line that says what to do."""


class InputError(TraceroofError):
    """A path that does not exist or holds nothing traceroof can read."""


class FormatError(TraceroofError):
    """A file whose format is unknown, corrupt or truncated."""


class HloParseError(FormatError):
    """HLO text (or an HloProto) that cannot be parsed."""


class SizeLimitError(FormatError):
    """An input that would grow past a resource limit when decoded (a decompression bomb, millions of empty
    records); the message names the limit and how to raise it."""
