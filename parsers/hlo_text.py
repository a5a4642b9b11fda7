"""HLO text parser: ``*.after_optimizations.txt`` dumps, ``compiled.as_text()``, XLA test modules.

Accepts the grammar of openxla/xla ``xla/hlo/parser/hlo_parser.cc`` as summarised in
``docs/reference/hlo-text.md``: optional ``%``, optional computation signatures, operand shapes and result
shapes, tuples, layouts with ``T(...)`` tiles / ``E(n)`` / ``S(n)``, dynamic dims, ``/*index=N*/`` and ``//``
comments, stack-frame tables, raw-JSON or quoted ``backend_config``, attributes wrapped over lines, ``ENTRY``
optional (the last computation is then the entry). Unknown opcodes and attributes are kept, never fatal.
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from pathlib import Path

from parsers.errors import HloParseError
from parsers.hlo import (MAX_TUPLE_DEPTH, Computation, HloModule, Instruction, Layout, Metadata, Shape, StackFrame,
                         attr_problem, call_graph_problem, parameter_problem, shape_problem)

_COMMENT_OR_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|/\*.*?\*/|//[^\n]*', re.S)
_WS = re.compile(r"[ \t\r\n]*")
_HWS = re.compile(r"[ \t\r]*")
_NAME = re.compile(r"%?([A-Za-z_][A-Za-z0-9_.\-]*)")
_WORD = re.compile(r"[A-Za-z0-9_.\-]+")
_DIM = re.compile(r"\s*(<=)?\s*([0-9]{1,18}|\?)\s*")
_DQ = re.compile(r'"(?:[^"\\]|\\.)*"')
_SQ = re.compile(r"'(?:[^'\\]|\\.)*'")
_OPEN = {"{": "}", "(": ")", "[": "]"}
_ROOT = re.compile(r"ROOT\b")
_BRACKET = re.compile(r"[{}()\[\]\"']")
_ATTR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_CALLED = re.compile(r"%?[A-Za-z_][A-Za-z0-9_.\-]*")
_SPECIAL = re.compile(r"[{}()\[\]\"',\n]")
# an array shape whose text alone decides its parse (no newline, quote or nested brace in it): cached by that text
_ARRAY_SHAPE = re.compile(r"[A-Za-z0-9_.\-]+\[[^\]\n]*\](?:\{[^{}\n\"']*\})?")
# an instruction's head as the walk in _Parser.instruction reads it, when its shape is an array shape (or none) and
# its operands hold no bracket or quote: ROOT (then never a name), name, "=", shape, opcode, "(operands)"
_HEAD = re.compile(r"(ROOT\b)?+[ \t\r\n]*%?([A-Za-z_][A-Za-z0-9_.\-]*)[ \t\r\n]*=[ \t\r\n]*(?:("
                   + _ARRAY_SHAPE.pattern + r")[ \t\r\n]*)?([A-Za-z0-9_.\-]+)[ \t\r\n]*\(([^(){}\[\]\"']*)\)")
# operands that are names only, as optimized dumps print them (``%a, %b``)
_PLAIN_OPERAND = r"[ \t\r\n]*%?[A-Za-z_][A-Za-z0-9_.\-]*[ \t\r\n]*"
_PLAIN_OPERANDS = re.compile(f"{_PLAIN_OPERAND}(?:,{_PLAIN_OPERAND})*")
# ", key=value" whose value :meth:`_Parser.value` reads without surprises: plain text, double-quoted strings and
# {...} groups of plain text and strings (no other bracket, no newline outside a string), ended by ',', a newline
# or a closing bracket before the module's end (a "metadata={op_name=... stack_frame_id=3}" or "kind=kLoop")
_DQ_TEXT = r'"(?:[^"\\]++|\\.)*+"'  # (possessive: no backtracking into a run when the value does not end well)
_PLAIN_ATTR = re.compile(
    r"[ \t\r\n]*,[ \t\r\n]*([A-Za-z_][A-Za-z0-9_\-]*)[ \t\r\n]*=[ \t\r\n]*("
    rf"(?:[^{{}}()\[\]\"',\n]++|{_DQ_TEXT}|\{{(?:[^{{}}()\[\]\"'\n]++|{_DQ_TEXT})*+\}})*+)(?=[,\n)\]}}])")
_META_ITEM = re.compile(r'([A-Za-z_]+)=("(?:[^"\\]|\\.)*"|\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}|[^\s}]+)')
_TABLE_NAMES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_CALL_ATTRS = ("calls", "to_apply", "condition", "body", "true_computation", "false_computation",
               "branch_computations", "select", "scatter", "called_computations", "comparator")

# Opcodes of xla/hlo/ir/hlo_opcode.h (hlo-text.md §10) plus the async sugar forms.
KNOWN_OPCODES = frozenset("""
abs add add-dependency after-all all-gather all-gather-done all-gather-start all-reduce all-reduce-done
all-reduce-start all-to-all and async-done async-start async-update atan2 batch-norm-grad batch-norm-inference
batch-norm-training bitcast bitcast-convert broadcast call cbrt ceil cholesky clamp collective-broadcast
collective-permute collective-permute-done collective-permute-start collective-reduce compare complex
concatenate conditional constant convert convolution copy copy-done copy-start cosine count-leading-zeros
custom-call divide domain dot dynamic-reshape dynamic-slice dynamic-update-slice erf exponential
exponential-minus-one fft floor fusion gather get-dimension-size get-tuple-element imag infeed iota is-finite
log log-plus-one logistic map maximum minimum multiply negate not opt-barrier optimization-barrier or outfeed
pad parameter partition-id popcnt power ragged-all-to-all ragged-dot real recv recv-done reduce
reduce-precision reduce-scatter reduce-window remainder replica-id reshape reverse rng rng-bit-generator
rng-get-and-update-state round-nearest-afz round-nearest-even rsqrt scaled-dot scan scatter select
select-and-scatter send send-done set-dimension-size shift-left shift-right-arithmetic shift-right-logical
shuffle sign sine slice sort sqrt stochastic-convert subtract tan tanh topk transpose triangular-solve tuple
while xor acos acosh asin asinh atan atanh cosh sinh mulhi
""".split())
_ASYNC_SUFFIXES = ("-start", "-update", "-done")


def is_known_opcode(opcode: str) -> bool:
    """True for XLA opcodes, including ``<op>-start/-update/-done`` async sugar of any wrapped op."""
    if opcode in KNOWN_OPCODES:
        return True
    return any(opcode.endswith(s) and opcode[: -len(s)] in KNOWN_OPCODES for s in _ASYNC_SUFFIXES)


def parse_hlo_file(path: str | Path) -> list[HloModule]:
    """Parse an HLO text file (one or more modules).

    The program id is taken from a dump name ``module_NNNN.<name>...`` when present.

    :raises HloParseError: unreadable file or text that is not HLO (message names file and line).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise HloParseError(f"cannot read HLO file {p}: {e.strerror}") from None
    modules = parse_hlo_text(text, source=str(p))
    m = re.match(r"module_(\d+)\.", p.name)
    if m and len(modules) == 1:
        modules[0].program_id = int(m.group(1))
    return modules


def parse_hlo_text(text: str, source: str = "<text>") -> list[HloModule]:
    """Parse HLO text holding one or more ``HloModule`` blocks (text without a header is one module).

    :raises HloParseError: the text is not HLO; the message gives the source and line.
    """
    clean = _COMMENT_OR_STRING.sub(lambda m: m.group(0) if m.group(0)[0] == '"' else " ", text)
    starts = [m.start() for m in re.finditer(r"(?m)^[ \t]*HloModule\b", clean)]
    if not starts:
        if "{" not in clean:
            raise HloParseError(f"{source}: no HloModule header and no computation: not HLO text")
        starts = [0]
    modules = []
    for i, s in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(clean)
        modules.append(_Parser(clean, s, end, source, shapes={}).module())
    return modules


class _Parser:
    def __init__(self, text: str, pos: int, end: int, source: str, first_line: int = 1,
                 shapes: dict[str, Shape] | None = None) -> None:
        self.t = text
        self.pos = pos
        self.end = end
        self.source = source
        self.first_line = first_line  # line number of ``text[0]`` in the source (operand sub-parsers)
        self._counted = (0, first_line)  # (position, its line number): newlines counted so far, once each
        # array shapes parsed so far, by their text (:data:`_ARRAY_SHAPE`): a module repeats a few shapes thousands
        # of times, and a shape is immutable
        self.shapes: dict[str, Shape] = {} if shapes is None else shapes

    # -- low level -------------------------------------------------------------------------------------
    def line_at(self, pos: int) -> int:
        """The source line number of ``text[pos]``, counting newlines on from the last position asked (each
        instruction asks for its own: counting from the start every time made parsing quadratic)."""
        at, line = self._counted if pos >= self._counted[0] else (0, self.first_line)
        line += self.t.count("\n", at, pos)
        self._counted = (pos, line)
        return line

    def error(self, what: str) -> HloParseError:
        line = self.line_at(self.pos)
        snippet = self.t[self.pos: self.pos + 40].split("\n")[0]
        return HloParseError(f"{self.source}:{line}: {what} near {snippet!r}")

    def ws(self) -> None:
        self.pos = _WS.match(self.t, self.pos).end()

    def hws(self) -> None:
        self.pos = _HWS.match(self.t, self.pos).end()

    def peek(self) -> str:
        return self.t[self.pos] if self.pos < self.end else ""

    def expect(self, ch: str) -> None:
        self.ws()
        if not self.t.startswith(ch, self.pos):
            raise self.error(f"expected {ch!r}")
        self.pos += len(ch)

    def name(self) -> str:
        self.ws()
        m = _NAME.match(self.t, self.pos)
        if not m:
            raise self.error("expected a name")
        self.pos = m.end()
        return m.group(1)

    def skip_balanced(self, pos: int) -> int:
        """Index just after the bracket group or quoted string starting at ``pos``."""
        t, stack = self.t, []
        while pos < self.end:
            c = t[pos]
            if c == '"' or c == "'":
                m = (_DQ if c == '"' else _SQ).match(t, pos)
                if not m:
                    raise self.error("unterminated string")
                pos = m.end()
                if not stack:
                    return pos
            else:
                if c in _OPEN:
                    stack.append(_OPEN[c])
                elif c in ")]}":
                    if not stack or stack.pop() != c:
                        raise self.error(f"unbalanced {c!r}")
                    if not stack:
                        return pos + 1
                pos += 1
            m = _BRACKET.search(t, pos, self.end)  # jump to the next bracket or quote
            if m is None:
                break
            pos = m.start()
        raise self.error("unterminated bracket")

    def value(self) -> str:
        """Raw attribute value: up to a depth-0 ',' or end of line (brackets and strings may span lines)."""
        t, start, pos = self.t, self.pos, self.pos
        while pos < self.end:
            m = _SPECIAL.search(t, pos, self.end)
            if not m:
                pos = self.end
                break
            c = m.group(0)
            pos = m.start()
            if c in ",\n" or c in ")]}":
                break
            pos = self.skip_balanced(pos)
        self.pos = pos
        return t[start:pos].strip()

    # -- shapes ----------------------------------------------------------------------------------------
    def shape(self, depth: int = 0) -> Shape:
        """A shape at ``pos``; tuples nest at most :data:`MAX_TUPLE_DEPTH` levels (bounded recursion)."""
        self.ws()
        if self.peek() == "(":
            if depth >= MAX_TUPLE_DEPTH:
                raise self.error(f"tuple shapes nested deeper than {MAX_TUPLE_DEPTH} levels")
            self.pos += 1
            parts: list[Shape] = []
            self.ws()
            if self.peek() == ")":
                self.pos += 1
                return Shape("tuple", tuple_shapes=())
            while True:
                parts.append(self.shape(depth + 1))
                self.ws()
                c = self.peek()
                self.pos += 1
                if c == ")":
                    return Shape("tuple", tuple_shapes=tuple(parts))
                if c != ",":
                    raise self.error("expected ',' or ')' in tuple shape")
        known = _ARRAY_SHAPE.match(self.t, self.pos)
        if known:
            shape = self.shapes.get(known.group(0))
            # the text ends with its layout, or no layout follows it: the same parse as when it was cached
            if shape is not None and (known.group(0)[-1] == "}" or self.t[known.end(): known.end() + 1] != "{"):
                self.pos = known.end()
                return shape
        m = _WORD.match(self.t, self.pos)
        if not m or self.t[m.end(): m.end() + 1] != "[":
            raise self.error("expected a shape")
        etype = m.group(0)
        close = self.t.find("]", m.end(), self.end)
        if close < 0 or "\n" in self.t[m.end(): close]:
            raise self.error("unterminated dimensions")
        dims, dyn = [], []
        body = self.t[m.end() + 1: close]
        if body.strip():
            for d in body.split(","):
                dm = _DIM.fullmatch(d)
                if not dm:
                    raise self.error(f"bad dimension {d!r}")
                dims.append(-1 if dm.group(2) == "?" else int(dm.group(2)))
                dyn.append(bool(dm.group(1)) or dm.group(2) == "?")
        start, self.pos = self.pos, close + 1
        layout = None
        if self.peek() == "{":
            end = self.skip_balanced(self.pos)
            try:
                layout = _parse_layout(self.t[self.pos + 1: end - 1])
            except ValueError:
                self.pos = close + 1
                raise self.error("bad layout") from None
            self.pos = end
        shape = Shape(etype, tuple(dims), tuple(dyn), layout)
        why = shape_problem(shape)
        if why:
            self.pos = start
            raise self.error(why)
        if known and self.pos == known.end():
            self.shapes[known.group(0)] = shape
        return shape

    # -- module ----------------------------------------------------------------------------------------
    def module(self) -> HloModule:
        self.ws()
        name, attrs = "", {}
        if self.t.startswith("HloModule", self.pos):
            self.pos += len("HloModule")
            name = self.name()
            while True:
                self.hws()
                if self.peek() != ",":
                    break
                self.pos += 1
                self.ws()
                key = self.name()
                self.expect("=")
                self.hws()
                attrs[key] = self.value()
        for key in ("num_partitions", "replica_count"):
            if key in attrs and not (attrs[key].isascii() and attrs[key].isdigit() and 0 < int(attrs[key]) <= 2**24):
                raise self.error(f"{key}={attrs[key]!r} is not a device count (1..{2**24})")
        if int(attrs.get("num_partitions", 1)) * int(attrs.get("replica_count", 1)) > 2**24:
            raise self.error(f"num_partitions x replica_count is more than {2**24} devices")
        frames = self.tables()
        comps: dict[str, Computation] = {}
        where: dict[str, int] = {}
        entry = ""
        while True:
            self.ws()
            if self.pos >= self.end:
                break
            at = self.pos
            comp = self.computation()
            if comp.name in comps:
                self.pos = at
                raise self.error(f"computation {comp.name} is defined twice")
            comps[comp.name] = comp
            where[comp.name] = at
            if comp.is_entry:
                entry = comp.name
        if not comps:
            raise self.error("module has no computation")
        if not entry:
            entry = list(comps)[-1]
            comps[entry].is_entry = True
        culprit, why = call_graph_problem(comps)
        if not why:
            culprit, why = parameter_problem(comps)
        if why:
            self.pos = where[culprit]
            raise self.error(why)
        return HloModule(name or entry, comps, entry, attrs, frames, source=self.source)

    def tables(self) -> dict[int, StackFrame]:
        """The stack frames of the tables after the module's header (``FileNames`` ... ``StackFrames``), by their
        1-based id, with the HloProto's parent id (0: none). XLA's text (jaxlib 0.10) writes each frame's parent
        id plus one, so no frame reads 0 (a root reads 1); checked against the ``StackFrameIndexProto`` of the same
        program embedded in its profile: every frame of the fw_* fixtures' train steps is one more in the text. A
        table where some frame's parent is 0 is read as it is."""
        raw: dict[str, dict[int, str]] = {}
        while True:
            self.ws()
            m = re.compile(r"(FileNames|FunctionNames|FileLocations|StackFrames)\b").match(self.t, self.pos)
            if not m:
                break
            self.pos = m.end()
            table: dict[int, str] = {}
            while True:
                self.ws()
                em = re.compile(r"(\d+)[ \t]+").match(self.t, self.pos)
                if not em:
                    break
                self.pos = em.end()
                end = self.skip_balanced(self.pos)
                table[int(em.group(1))] = self.t[self.pos: end]
                self.pos = end
            raw[m.group(1)] = table
        if not raw:
            return {}
        files = {k: _unquote(v) for k, v in raw.get("FileNames", {}).items()}
        funcs = {k: _unquote(v) for k, v in raw.get("FunctionNames", {}).items()}
        locs = {k: _kv_ints(v) for k, v in raw.get("FileLocations", {}).items()}
        table = {fid: _kv_ints(v) for fid, v in raw.get("StackFrames", {}).items()}
        shift = int(all(kv.get("parent_frame_id", 0) > 0 for kv in table.values()))  # no root written as 0
        frames = {}
        for fid, kv in table.items():
            loc = locs.get(kv.get("file_location_id", 0), {})
            frames[fid] = StackFrame(files.get(loc.get("file_name_id", 0), ""),
                                     funcs.get(loc.get("function_name_id", 0), ""),
                                     loc.get("line", 0), max(kv.get("parent_frame_id", 0) - shift, 0),
                                     loc.get("column", 0))
        return frames

    def computation(self) -> Computation:
        self.ws()
        is_entry = False
        if re.compile(r"ENTRY\b").match(self.t, self.pos):
            is_entry = True
            self.pos += 5
        name = self.name()
        self.ws()
        if self.peek() == "(":
            self.pos = self.skip_balanced(self.pos)
            self.ws()
        if self.t.startswith("->", self.pos):
            self.pos += 2
            self.shape()
        self.expect("{")
        insts = []
        while True:
            self.ws()
            if self.peek() == "}":
                self.pos += 1
                break
            if self.pos >= self.end:
                raise self.error(f"computation {name} is not closed")
            insts.append(self.instruction())
        thread = ""
        self.hws()
        if self.peek() == ",":
            self.pos += 1
            self.ws()
            key = self.name()
            self.expect("=")
            val = self.value()
            if key == "execution_thread":
                thread = _unquote(val)
        return Computation(name, insts, is_entry, thread)

    def instruction(self) -> Instruction:
        # whitespace skipped inline (``_WS``, as :meth:`ws`): thousands of instructions, a dozen skips each
        t, end = self.t, self.end
        self.pos = start = _WS.match(t, self.pos).end()
        head = _HEAD.match(t, start, end)
        shape = None
        if head:  # "[ROOT] name = shape opcode(operands)" with a shape parsed before, or none, and no bracket inside
            shape = Shape("tuple", tuple_shapes=()) if head.group(3) is None else self.shapes.get(head.group(3))
        if shape is not None:
            is_root, name, opcode, inner = head.group(1) is not None, head.group(2), head.group(4), head.group(5)
            self.pos = head.end()
        else:
            is_root = False
            if _ROOT.match(t, start):
                is_root = True
                self.pos += 4
            name = self.name()
            self.expect("=")
            self.pos = pos = _WS.match(t, self.pos).end()
            if pos < end and t[pos] == "(":
                shape = self.shape()
            else:
                m = _WORD.match(t, pos)
                shape = self.shape() if m and t[m.end(): m.end() + 1] == "[" else Shape("tuple", tuple_shapes=())
            self.pos = _WS.match(t, self.pos).end()
            m = _WORD.match(t, self.pos)
            if not m:
                raise self.error("expected an opcode")
            opcode = m.group(0)
            self.pos = _WS.match(t, m.end()).end()
            if self.pos >= end or t[self.pos] != "(":
                raise self.error(f"expected '(' after opcode {opcode}")
            close = self.skip_balanced(self.pos)
            inner = t[self.pos + 1: close - 1]
            self.pos = close
        operands: list[str] = []
        operand_shapes: list[Shape | None] = []
        literal = ""
        if opcode in ("constant", "parameter") or (opcode == "iota" and not inner.strip()):
            literal = inner.strip()
        elif _PLAIN_OPERANDS.fullmatch(inner):  # names only (what the loop below makes of them)
            operands = _NAME.findall(inner)
            operand_shapes = [None] * len(operands)
        elif inner.strip():
            line = self.line_at(start)
            for part in _split_top(inner):
                sub = _Parser(part, 0, len(part), self.source, line, self.shapes)
                sub.ws()
                op_shape = None
                wm = _WORD.match(part, sub.pos)
                if sub.peek() == "(" or (wm and part[wm.end(): wm.end() + 1] == "["):
                    op_shape = sub.shape()
                operands.append(sub.name())
                operand_shapes.append(op_shape)
        attrs: dict[str, str] = {}
        pos = self.pos
        while True:  # ", key=value" or ", key" (the position before each comma kept when none follows)
            fast = _PLAIN_ATTR.match(t, pos, end)
            if fast:  # what the walk below makes of it
                attrs[fast.group(1)] = fast.group(2).strip()
                pos = fast.end()
                continue
            p = _WS.match(t, pos).end()
            if p >= end or t[p] != ",":
                break
            p = _WS.match(t, p + 1).end()
            km = _ATTR_NAME.match(t, p)
            if not km:
                self.pos = p
                raise self.error("expected an attribute name")
            p = _WS.match(t, km.end()).end()
            if p >= end or t[p] != "=":
                attrs[km.group(0)] = ""
                pos = p
                continue
            self.pos = _WS.match(t, p + 1).end()
            attrs[km.group(0)] = self.value()
            pos = self.pos
        self.pos = pos
        if "device_ids" in attrs and attrs.get("replica_groups", "").startswith("mesh["):
            # ``mesh[...], device_ids=(...) {axes}`` is one value (Mesh::ToString then the axes) that the comma
            # split in two: joined again as XLA printed it
            attrs["replica_groups"] += ", device_ids=" + attrs.pop("device_ids")
        why = attr_problem(attrs)
        if why:
            self.pos = start
            raise self.error(f"{name}: {why}")
        called = []
        for key in _CALL_ATTRS:
            if key in attrs:
                called += [c.lstrip("%") for c in _CALLED.findall(attrs[key])]
        return Instruction(
            name=name, opcode=opcode, shape=shape, operands=tuple(operands),
            operand_shapes=tuple(operand_shapes), attrs=attrs, called=tuple(called),
            metadata=_parse_metadata(attrs.get("metadata", "")),
            backend_config=_parse_backend_config(attrs.get("backend_config")),
            literal=literal, is_root=is_root,
        )


_SPLIT = re.compile(r'[(){}\[\]",]')


def _split_top(s: str) -> list[str]:
    """Split on depth-0 commas (brackets and quoted strings respected)."""
    parts, depth, start, i = [], 0, 0, 0
    while True:
        m = _SPLIT.search(s, i)
        if m is None:
            break
        c, i = m.group(0), m.start()
        if c == '"':
            q = _DQ.match(s, i)
            i = q.end() if q else len(s)
            continue
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif depth == 0:
            parts.append(s[start:i].strip())
            start = i + 1
        i += 1
    tail = s[start:].strip()
    if tail:
        parts.append(tail)
    return [p for p in parts if p]


def _parse_layout(text: str) -> Layout:
    m2m_text, _, rest = text.partition(":")
    m2m = tuple(int(x) for x in m2m_text.replace(" ", "").split(",") if x)
    tiles: list[tuple[int | None, ...]] = []
    ebits, space, extra = None, 0, []
    kind = ""
    for m in re.finditer(r"(SC|[A-Z#*])?\(([^()]*)\)", rest):
        kind, arg = m.group(1) or kind, m.group(2)  # "T(8,128)(2,1)": a bare group continues the tiles
        if kind == "T":
            tiles.append(tuple(None if x.strip() == "*" else int(x) for x in arg.split(",") if x.strip()))
        elif kind == "E":
            ebits = int(arg)
        elif kind == "S":
            space = int(arg)
        else:
            extra.append(m.group(0))
    return Layout(m2m, tuple(tiles), ebits, space, tuple(extra))


def _unquote(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'":
        if "\\" not in s:  # no escape: the text as it is (JSON gives it back, or fails and the except does)
            return s[1:-1]
        try:
            return json.loads('"' + s[1:-1].replace("\\'", "'") + '"')
        except ValueError:
            return s[1:-1]
    return s


def _kv_ints(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"([A-Za-z_]+)=(-?\d+)", text)}


# 4096 texts: several times the distinct metadata of one module (the largest fixture module, GPT-2's train step, has
# 566 among 1941 instructions), so every repeat within a module hits; bounded because one process (`traceroof watch`,
# a notebook) may parse module after module, whose texts seldom repeat across modules
@lru_cache(maxsize=4096)
def _parse_metadata(text: str) -> Metadata:
    """``metadata={...}`` (immutable, so instructions of the same text share one: few distinct ones per module)."""
    if not text:
        return Metadata()
    items = {k: v for k, v in _META_ITEM.findall(text.strip()[1:-1] if text.startswith("{") else text)}

    def num(key: str) -> int:
        try:
            return int(items.get(key, "0"))
        except ValueError:
            return 0

    known = {"op_type", "op_name", "source_file", "source_line", "stack_frame_id", "deduplicated_name",
             "scheduling_name"}
    return Metadata(
        op_type=_unquote(items.get("op_type", "")), op_name=_unquote(items.get("op_name", "")),
        source_file=_unquote(items.get("source_file", "")), source_line=num("source_line"),
        stack_frame_id=num("stack_frame_id"), deduplicated_name=_unquote(items.get("deduplicated_name", "")),
        scheduling_name=_unquote(items.get("scheduling_name", "")),
        extra=tuple((k, v) for k, v in items.items() if k not in known),
    )


def _parse_backend_config(text: str | None) -> object:
    if not text:
        return None
    raw = _unquote(text) if text.startswith('"') else text
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the decoder recurses: kept as text
        return raw


def parse_replica_groups(text: str, num_devices: int | None = None) -> list[list[int]]:
    """Expand a ``replica_groups=`` value into explicit groups of device (or replica/partition) ids.

    Forms (openxla/xla ``xla/hlo/ir/replica_group.cc``; ``docs/reference/hlo-text.md`` §9.1):

    * explicit ``{{0,1,2,3},{4,5,6,7}}``; ``{}`` is one group of all ``num_devices`` (``[]`` when unknown);
    * iota ``[G,S]<=[d0,d1,...]T(perm)``: ``iota(Πd)`` reshaped to ``d``, transposed by ``perm``, cut into G
      groups of S;
    * mesh axes ``mesh['a'=4,'b'=2] {'a'}``: the mesh's devices (iota) reshaped to the axis sizes, the named
      axes moved last, cut into groups of their product; a sub-axis ``'a':(pre)size`` picks that factor.

    :raises HloParseError: text in none of these forms.
    """
    try:
        groups = _replica_groups(text.strip(), num_devices)
    except (ValueError, KeyError, IndexError, ZeroDivisionError) as e:
        raise HloParseError(f"replica_groups {text[:80]!r}: {e}") from None
    if groups is None:
        raise HloParseError(f"unknown replica_groups form {text[:80]!r}")
    return groups


MAX_GROUP_DEVICES = 2**24  # devices a replica_groups value may name (beyond: garbage, not a program)


def _devices(sizes: list[int]) -> int:
    """The device count of a mesh or iota of these dimension sizes. :raises ValueError: not 1..MAX_GROUP_DEVICES."""
    n = math.prod(sizes)
    if n > MAX_GROUP_DEVICES or any(x <= 0 for x in sizes):
        raise ValueError(f"{n} devices: expected 1..{MAX_GROUP_DEVICES}")
    return n


def _iota(dims: str, perm: str | None):
    """XLA's iota ``[d0,d1,...]T(perm)`` (``dims``, ``perm``: the comma-separated figures): ``iota(Πd)`` reshaped to
    ``d`` and transposed by ``perm`` (openxla/xla ``xla/hlo/ir/tile_assignment.cc``), flat (int64).

    :raises ValueError: more than MAX_GROUP_DEVICES devices, or a ``perm`` that is no permutation of the dims."""
    import numpy as np

    sizes = [int(x) for x in dims.split(",")]
    arr = np.arange(_devices(sizes)).reshape(sizes)
    if perm:
        arr = arr.transpose([int(x) for x in perm.split(",")])
    return arr.reshape(-1)


def _replica_groups(t: str, num_devices: int | None) -> list[list[int]] | None:
    import numpy as np

    m = re.fullmatch(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", t.replace(" ", ""))
    if m:
        return _iota(m.group(3), m.group(4)).reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.fullmatch(r"mesh\[(.*?)\]\s*(?:,\s*device_ids=\(([^()]*(?:\([\d,\s]*\))?)\))?\s*\{(.*)\}", t, re.S)
    if m:
        axes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))]
        sizes = dict(axes)
        shape: list[int] = []
        index: dict[tuple[str, int], int] = {}  # (axis, part) -> dim; part 0 = pre, 1 = selected, 2 = post
        selected: list[int] = []
        subs = {a: (int(p), int(sz)) for a, p, sz in re.findall(r"'([^']+)'\s*:\s*\((\d+)\)\s*(\d+)", m.group(3))}
        for a, n in axes:
            if a in subs:
                pre, sz = subs[a]
                for part, size in enumerate((pre, sz, n // (pre * sz))):
                    index[(a, part)] = len(shape)
                    shape.append(size)
            else:
                index[(a, 1)] = len(shape)
                shape.append(n)
        for a in re.findall(r"'([^']+)'", m.group(3)):
            if a not in sizes:
                raise ValueError(f"axis {a!r} is not in the mesh")
            selected.append(index[(a, 1)])
        rest = [d for d in range(len(shape)) if d not in selected]
        n = _devices(shape)
        arr = np.arange(n).reshape(shape).transpose(rest + selected)
        group = int(np.prod([shape[d] for d in selected])) if selected else 1
        if m.group(2) is not None:  # the mesh's devices in its order (positions above index them)
            arr = _mesh_device_ids(m.group(2), n)[arr]
        return arr.reshape(-1, group).tolist()
    if t.startswith("{"):
        inner = t[1:-1].strip()
        if not inner:
            return [list(range(min(num_devices, MAX_GROUP_DEVICES)))] if num_devices else []
        groups = re.findall(r"\{([^{}]*)\}", inner)
        if not groups and re.fullmatch(r"[\d,\s]+", inner):
            groups = [inner]
        return [[int(x) for x in g.replace(" ", "").split(",") if x] for g in groups]
    return None


def _mesh_device_ids(text: str, n: int):
    """The ``device_ids=(...)`` of a mesh of ``n`` devices (openxla/xla ``xla/hlo/ir/mesh_and_axis.cc``
    ``Mesh::ToString``: printed when the mesh's devices are not 0..n-1 in order): an iota ``[d0,d1,...]T(perm)``
    (:func:`_iota`) or the ids listed, as a flat array (int64).

    :raises ValueError: neither form, or not a permutation of 0..n-1 (``Mesh::ValidateMesh``)."""
    import numpy as np

    t = text.replace(" ", "")
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", t)
    if m:
        ids = _iota(m.group(1), m.group(2))
    elif re.fullmatch(r"\d+(?:,\d+)*", t):
        listed = [int(x) for x in t.split(",")]
        if sorted(listed) != list(range(n)):  # (checked in Python: a listed id may exceed int64)
            raise ValueError(f"device_ids ({text[:40]}) are not a permutation of 0..{n - 1}")
        ids = np.array(listed, np.int64)
    else:
        raise ValueError(f"device_ids ({text[:40]}) in no known form")
    if len(ids) != n:
        raise ValueError(f"device_ids name {len(ids)} devices, the mesh has {n}")
    return ids


def async_pairs(comp: Computation) -> dict[str, str]:
    """Map each ``*-done`` instruction to the ``*-start`` (or ``async-start``) whose result it consumes.

    Follows operands through ``async-update`` and ``get-tuple-element``/``bitcast`` links (``docs/async_ops.md``).
    """
    pairs: dict[str, str] = {}
    for inst in comp.instructions:
        if not (inst.opcode.endswith("-done") or inst.opcode in ("send-done", "recv-done")):
            continue
        cur = inst.operands[0] if inst.operands else None
        seen = 0
        while cur is not None and seen < 16:
            src = comp.by_name.get(cur)
            if src is None:
                break
            if src.opcode.endswith("-start") or src.opcode in ("send", "recv"):
                pairs[inst.name] = src.name
                break
            cur = src.operands[0] if src.operands else None
            seen += 1
    return pairs
