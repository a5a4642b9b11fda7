"""traceroof: roofline and per-layer efficiency reports for profiled XLA programs.

``traceroof.analyze(path)`` returns an :class:`Analysis` whose ``ops`` (one row per op execution), ``layers``
and ``top_ops`` are pandas DataFrames.
"""

from parsers.errors import FormatError, HloParseError, InputError, TraceroofError
from traceroof.analysis import Analysis, Summary, analyze
from traceroof.attach import Attachment, attach
from traceroof.chips import Chip, ChipError, all_chips, get_chip

__all__ = ["Analysis", "Attachment", "Chip", "ChipError", "FormatError", "HloParseError", "InputError", "Summary",
           "TraceroofError", "all_chips", "analyze", "attach", "get_chip"]
