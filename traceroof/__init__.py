"""traceroof: roofline and per-layer efficiency reports for profiled XLA programs.

``traceroof.analyze(path)`` returns an :class:`Analysis` whose ``ops`` (one row per op execution), ``layers``
and ``top_ops`` are pandas DataFrames.

The names below are imported on first use (PEP 562), so that ``import traceroof.cli`` has not loaded numpy
before the command line sets numpy's environment (:func:`traceroof.cli._numpy_settings`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parsers.errors import FormatError, HloParseError, InputError, TraceroofError
    from traceroof.analysis import Analysis, Summary, analyze
    from traceroof.attach import Attachment, attach
    from traceroof.chips import Chip, ChipError, all_chips, get_chip

_HOMES = {"FormatError": "parsers.errors", "HloParseError": "parsers.errors", "InputError": "parsers.errors",
          "TraceroofError": "parsers.errors", "Analysis": "traceroof.analysis", "Summary": "traceroof.analysis",
          "analyze": "traceroof.analysis", "Attachment": "traceroof.attach", "attach": "traceroof.attach",
          "Chip": "traceroof.chips", "ChipError": "traceroof.chips", "all_chips": "traceroof.chips",
          "get_chip": "traceroof.chips"}

__all__ = ["Analysis", "Attachment", "Chip", "ChipError", "FormatError", "HloParseError", "InputError", "Summary",
           "TraceroofError", "all_chips", "analyze", "attach", "get_chip"]


def __getattr__(name: str) -> Any:
    """``traceroof.<name>`` for the public names above, imported from their module on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'traceroof' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
