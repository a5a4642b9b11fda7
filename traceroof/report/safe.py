"""Make strings that come from the input safe for each output format: the one place every renderer uses.

A profile, an HLO dump, a chip file or a file name is untrusted input: an op named ``"\\x1b]0;pwned\\x07"`` must not
retitle the terminal that shows the report, ``"<img src=x onerror=...>"`` must not become markup in a Markdown
viewer, ``"a|b"`` must not add a column to a Markdown table, and ``"=cmd|' /C calc'!A0"`` must not become a
formula in a spreadsheet.

* :func:`printable` (terminal; the base of the others): control characters (C0 including newline and tab, DEL,
  C1 such as the 8-bit CSI ``U+009B``, line and paragraph separators, bidirectional overrides) are written as
  visible escapes (``\\x1b``, ``\\n``, ``\\u202e``); printable Unicode is kept as it is.
* :func:`markdown` / :func:`markdown_cell`: :func:`printable`, then ``\\`` and HTML's ``&``, ``<``, ``>`` escaped
  (entities render as the characters); in a table cell ``|`` too.
* :func:`csv_cell`: OWASP's CSV-injection rule: a text cell that starts with ``=``, ``+``, ``-``, ``@``, tab or
  carriage return gets a leading ``'``. Numbers are not text: a negative number stays a number.
* :func:`json_text`: a JSON document with C1 controls, DEL and line separators written as ``\\uXXXX`` escapes (the
  decoded strings are unchanged: JSON keeps input strings exact).
"""

from __future__ import annotations

import re
from typing import Any

# C0 controls (newline and tab included: a cell or a list item is one line), DEL, C1 controls, line/paragraph
# separators, and the bidirectional embeddings, overrides and isolates that reorder what a reader sees
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_CSV_ACTIVE = ("=", "+", "-", "@", "\t", "\r")
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(m: re.Match[str]) -> str:
    c = m.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def printable(value: object) -> str:
    """``str(value)`` with every control character written as a visible escape (``\\x1b``); printable Unicode
    (``µ``, ``±``, CJK...) unchanged. For terminal text."""
    s = str(value)
    return _UNSAFE.sub(_visible, s) if _UNSAFE.search(s) else s


def markdown(value: object) -> str:
    """:func:`printable`, then ``\\`` backslash-escaped, ``&`` and ``<`` as HTML entities (no tag can open) and a
    leading ``>`` backslash-escaped (no block quote): the text shows as written and never becomes markup. Other
    ``>`` stay as they are (``a -> b`` reads the same in the file and on the page). For Markdown outside tables
    (headers, list items)."""
    s = printable(value).replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;")
    text = s.lstrip()
    return s[:len(s) - len(text)] + "\\" + text if text.startswith(">") else s


def md_item(label: str, text: str) -> str:
    """A labelled Markdown list item (``- **label**: text``); an empty label continues the item above as an
    indented sub-item (``**  **`` is no bold text in Markdown: it showed as ``** **:``). ``text`` is already
    escaped (:func:`markdown`)."""
    return f"- **{label}**: {text}" if label else f"  - {text}"


def markdown_cell(value: object) -> str:
    """:func:`markdown` with ``|`` escaped: the text stays in its table cell."""
    return markdown(value).replace("|", "\\|")


def csv_cell(value: Any) -> Any:
    """A text cell that a spreadsheet would read as a formula (starts with ``=``, ``+``, ``-``, ``@``, tab or
    carriage return) with a leading ``'``; anything else (numbers included, negative ones too) unchanged."""
    if isinstance(value, str) and value.startswith(_CSV_ACTIVE):
        return "'" + value
    return value


def json_text(text: str) -> str:
    """A JSON document (from ``json.dumps(..., ensure_ascii=False)``) with the control characters that JSON
    allows raw (DEL, C1, line separators, bidirectional controls) written as ``\\uXXXX``: they can only occur
    inside strings, whose decoded values stay exactly the same."""
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text) if _JSON_UNSAFE.search(text) else text
