"""A seeded mutation fuzzer for traceroof's inputs: seed corpus, mutators, runner, outcome classification.

Seven input classes (:data:`CLASSES`), each mutated from the tiny real seeds in ``fixtures/fuzz/`` (written by
``fixtures/fuzz/generate.py``) and run in-process through the library entry that the CLI calls:

=================  ===================================================  =========================================
class              what is mutated                                      run through
=================  ===================================================  =========================================
``xplane``         ``tiny[_sharded].xplane.pb`` (bytes, protobuf fields) ``analyze(file, chip=seed chip)``
``trace_json``     ``tiny.trace.json`` (plain or gzipped; JSON, bytes)   ``analyze(file, chip=seed chip)``
``hlo_text``       ``tiny.hlo.txt`` (tokens, shapes, layouts, calls)     ``analyze(trace JSON, hlo=[file])``
``hlo_proto``      ``jit_step(N).hlo_proto.pb`` (protobuf fields)        ``analyze(trace JSON + sidecar file)``
``xprof_export``   ``tiny_hlo_stats.json`` / ``.csv``, overview page     ``analyze(export file)``
``chip_toml``      ``tiny_chip.toml`` and two bundled chip files         ``get_chip(file)``, ``analyze`` (xplane/export)
``json_report``    ``tiny_report.json`` (``analyze --format json``)      ``diff.load_side`` + ``diff`` + ``gate``
=================  ===================================================  =========================================

Input ``(class, seed)`` is deterministic (``random.Random``). Each is run in a worker process (a fork, 2 by
default) with an address-space cap (``RLIMIT_AS``) and a time limit, so a memory blow-up, a hang or a crash of
the C scanner is an outcome, not a dead run. Outcomes (:class:`Result`): ``report`` (a result whose figures are
in range), ``error`` (a :class:`~parsers.errors.TraceroofError`: the input contract), and the findings:
``bug`` (any other exception, with its innermost project frame ``file:line ExceptionType``), ``range`` (a
figure out of range without a note saying so: :func:`check_analysis`), ``memory`` (``MemoryError`` under the
cap), ``timeout`` and ``crash`` (the worker died: a signal).

Reproduce one input: ``python -m tests.fuzzing CLASS SEED [-o DIR]`` writes it (and the seed files it runs
with) and prints its outcome.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import multiprocessing as mp
import random
import re
import shutil
import struct
import sys
import tempfile
import time
import tomllib
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

ROOT = Path(__file__).resolve().parent.parent
SEEDS = ROOT / "fixtures" / "fuzz"
PROJECT_DIRS = (ROOT / "traceroof", ROOT / "parsers")
CLASSES = ("xplane", "trace_json", "hlo_text", "hlo_proto", "xprof_export", "chip_toml", "json_report")
FINDINGS = ("bug", "range", "memory", "timeout", "crash")
MAX_INPUT_BYTES = 4 << 20  # mutations that grow an input stop here (a gzip bomb is its own mutator)
EFFICIENCY_MAX = 1.5  # MFU, HFU, roofline efficiency above this need a note (a 1.5x faster-than-roof finding)
OP_TIME_MAX_S = 86_400.0  # one op execution lasting more than a day is garbage unless a note says so
# phrases of a note that explains a figure out of range (matched case-insensitively in notes and findings)
STEP_NOTES = ("not a positive", "no step time")
VALUE_NOTES = ("negative", "not finite", "non-finite", "overflow")
INTERESTING_VARINTS = (0, 1, 0x7F, 0x80, 0xFFFFFFFF, 1 << 31, 1 << 32, 1 << 40, (1 << 63) - 1, 1 << 63,
                       (1 << 64) - 1, (1 << 64) - 2)
INTERESTING_NUMBERS: tuple[Any, ...] = (0, -1, -1.5, 1e308, -1e308, 2**63, 2**64, -(2**63), 10**30, 1e-320,
                                        float("nan"), float("inf"), float("-inf"), 4.1e18, 0.0, -0.0, 2**31)
WRONG_TYPES: tuple[Any, ...] = ("x", "", "12abc", [], [1, 2], {}, {"a": 1}, None, True, False, "1e999", "NaN",
                                "\x1b]0;pwned\x07", "<b>", "=1+1")


# -- seeds ---------------------------------------------------------------------------------------------------

def seed_files() -> dict[str, Path]:
    """The seed files by role (see ``fixtures/fuzz/generate.py``)."""
    proto = next(SEEDS.glob("*.hlo_proto.pb"))
    return {"xplane": SEEDS / "tiny.xplane.pb", "xplane_sharded": SEEDS / "tiny_sharded.xplane.pb",
            "trace_json": SEEDS / "tiny.trace.json",
            "hlo_text": SEEDS / "tiny.hlo.txt", "hlo_proto": proto, "export_json": SEEDS / "tiny_hlo_stats.json",
            "export_csv": SEEDS / "tiny_hlo_stats.csv", "overview": SEEDS / "tiny_overview_page.json",
            "chip": SEEDS / "tiny_chip.toml", "report": SEEDS / "tiny_report.json",
            "chip_gpu": ROOT / "traceroof" / "chips" / "h100.toml",
            "chip_tpu": ROOT / "traceroof" / "chips" / "tpu_v5p.toml"}


_SEED_BYTES: dict[str, bytes] = {}


def seed_bytes(role: str) -> bytes:
    if role not in _SEED_BYTES:
        _SEED_BYTES[role] = seed_files()[role].read_bytes()
    return _SEED_BYTES[role]


# -- byte mutators -------------------------------------------------------------------------------------------

def _cap(b: bytes) -> bytes:
    return b[:MAX_INPUT_BYTES]


def mutate_bytes(rng: random.Random, data: bytes, others: Iterable[bytes] = ()) -> tuple[bytes, str]:
    """One to four byte-level mutations: bit flips, byte sets, inserts, deletes, truncation, duplication of a
    range, splices from another seed."""
    b = bytearray(data)
    done = []
    for _ in range(rng.choice((1, 1, 1, 2, 3, 4))):
        n = len(b)
        op = rng.choice(("flip", "set", "insert", "delete", "truncate", "dup", "splice", "interesting"))
        if n == 0:
            op = "insert"
        if op == "flip":
            i = rng.randrange(n)
            b[i] ^= 1 << rng.randrange(8)
        elif op == "set":
            b[rng.randrange(n)] = rng.randrange(256)
        elif op == "insert":
            i = rng.randrange(n + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.choice((1, 2, 4, 8, 64))))
        elif op == "delete":
            i = rng.randrange(n)
            del b[i:i + rng.choice((1, 2, 8, 64, 512))]
        elif op == "truncate":
            del b[rng.randrange(n):]
        elif op == "dup":
            i = rng.randrange(n)
            chunk = b[i:i + rng.choice((1, 8, 64, 1024))]
            j = rng.randrange(n + 1)
            b[j:j] = chunk * rng.choice((1, 2, 16))
        elif op == "splice":
            pool = [o for o in others if o]
            if pool:
                o = rng.choice(pool)
                i = rng.randrange(len(o))
                j = rng.randrange(n + 1)
                b[j:j + rng.choice((0, 16, 256))] = o[i:i + rng.choice((16, 256, 4096))]
        else:
            i = rng.randrange(n)
            b[i:i + 1] = rng.choice((b"\x00", b"\xff", b"\x7f", b"\x80", b"\xff\xff\xff\xff\x0f",
                                     b"\xff" * 10, b"\x00" * 8))
        done.append(op)
    return _cap(bytes(b)), "bytes:" + "+".join(done)


# -- protobuf wire format ------------------------------------------------------------------------------------

@dataclass
class Field:
    """One protobuf field: number, wire type, and its value (int for varints, bytes for fixed and strings, a
    list of fields for a length-delimited field that parses as a message)."""

    number: int
    wire: int
    value: Any


@dataclass
class Raw:
    """Bytes emitted as they are (a mutation that breaks the wire format on purpose)."""

    data: bytes


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = v & 0x7F
        v >>= 7
        if v:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(b: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if i >= len(b) or shift > 63:
            raise ValueError("bad varint")
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return v, i


def parse_message(b: bytes, depth: int = 0) -> list[Field]:
    """Decode wire-format bytes into fields, recursing into length-delimited fields that decode cleanly as a
    message (a guess: a string may happen to decode too). :raises ValueError: not a message."""
    out: list[Field] = []
    i = 0
    while i < len(b):
        key, i = _read_varint(b, i)
        num, wire = key >> 3, key & 7
        if num == 0:
            raise ValueError("field 0")
        if wire == 0:
            v, i = _read_varint(b, i)
        elif wire == 1:
            v, i = b[i:i + 8], i + 8
        elif wire == 5:
            v, i = b[i:i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(b, i)
            if i + n > len(b):
                raise ValueError("length beyond buffer")
            v, i = b[i:i + n], i + n
            if depth < 12 and v and not _looks_text(v):
                try:
                    v = parse_message(v, depth + 1)
                except ValueError:
                    pass
        else:
            raise ValueError("wire type")
        if i > len(b):
            raise ValueError("truncated")
        out.append(Field(num, wire, v))
    return out


def _looks_text(v: bytes) -> bool:
    return all(32 <= c < 127 for c in v[:64])


# serialized bytes of the (never modified) parsed seed trees' messages, by id of their field list: a mutation
# re-serializes only the path it changed
_SERIALIZED: dict[int, bytes] = {}


def serialize(fields: list[Field | Raw]) -> bytes:
    cached = _SERIALIZED.get(id(fields))
    if cached is not None:
        return cached
    out = bytearray()
    for f in fields:
        if isinstance(f, Raw):
            out += f.data
            continue
        out += _varint(f.number << 3 | f.wire)
        if f.wire == 0:
            out += _varint(f.value)
        elif f.wire == 2:
            body = serialize(f.value) if isinstance(f.value, list) else f.value
            out += _varint(len(body)) + body
        else:
            out += f.value
    return bytes(out)


def _nodes(fields: list, path: tuple = ()) -> Iterator[tuple[int, ...]]:
    for k, f in enumerate(fields):
        if isinstance(f, Raw):
            continue
        yield path + (k,)
        if isinstance(f.value, list):
            yield from _nodes(f.value, path + (k,))


def _at(fields: list, path: tuple[int, ...]) -> tuple[list, int]:
    for k in path[:-1]:
        fields = fields[k].value
    return fields, path[-1]


def _copy_path(tree: list, path: tuple[int, ...]) -> list:
    """A copy of ``tree`` in which the field lists along ``path`` and the field at its end are new objects (the
    rest is shared with ``tree``, which is never modified)."""
    root = cur = list(tree)
    for k in path[:-1]:
        f = cur[k]
        cur[k] = Field(f.number, f.wire, list(f.value))
        cur = cur[k].value
    f = cur[path[-1]]
    cur[path[-1]] = Field(f.number, f.wire, f.value)
    return root


def _cache_serialized(fields: list) -> bytes:
    for f in fields:
        if isinstance(f.value, list):
            _cache_serialized(f.value)
    _SERIALIZED[id(fields)] = serialize(fields)
    return _SERIALIZED[id(fields)]


_PROTO_TREES: dict[bytes, tuple[list, list]] = {}


def mutate_protobuf(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A field-level mutation of a protobuf message: a varint set to 0 / -1 / 2^63 / 2^64-1 ..., a length beyond
    the buffer, field number 0, an impossible wire type, a field repeated many times, a message nested inside
    itself, a field dropped or duplicated, a double set to NaN / inf / negative; ancestors' lengths are rewritten
    so the change reaches where it is."""
    if data not in _PROTO_TREES:
        tree = parse_message(data)
        _cache_serialized(tree)
        _PROTO_TREES[data] = (tree, list(_nodes(tree)))
    tree, paths = _PROTO_TREES[data]
    path = rng.choice(paths)
    fields = _copy_path(tree, path)
    parent, k = _at(fields, path)
    f = parent[k]
    choices = ["drop", "dup", "field0", "wiretype", "repeat"]
    if f.wire == 0:
        choices += ["varint"] * 6
    elif f.wire == 1:
        choices += ["double"] * 3
    elif f.wire == 2:
        choices += ["length", "length", "bytes"]
        if isinstance(f.value, list):
            choices += ["nest", "nest"]
    op = rng.choice(choices)
    if op == "varint":
        f.value = rng.choice(INTERESTING_VARINTS + (rng.randrange(1 << 64), f.value + 1, f.value * 1000))
    elif op == "double":
        f.value = struct.pack("<d", rng.choice((float("nan"), float("inf"), -1.0, 1e300, -1e300, 0.0)))
    elif op == "length":
        body = serialize(f.value) if isinstance(f.value, list) else f.value
        extra = rng.choice((1, 100, 1 << 20, 1 << 31, (1 << 64) - 1))
        parent[k] = Raw(_varint(f.number << 3 | 2) + _varint(len(body) + extra) + body)
    elif op == "bytes":
        body = serialize(f.value) if isinstance(f.value, list) else f.value
        f.value, _ = mutate_bytes(rng, body)
    elif op == "drop":
        del parent[k]
    elif op == "dup":
        parent.insert(k, Field(f.number, f.wire, f.value))
    elif op == "field0":
        parent.insert(k, Raw(_varint(0 << 3 | rng.choice((0, 2))) + b"\x01" + (b"\x00" if rng.random() < .5 else b"")))
    elif op == "wiretype":
        parent.insert(k, Raw(_varint(f.number << 3 | rng.choice((3, 4, 6, 7))) + b"\x01\x02\x03"))
    elif op == "repeat":
        copies = rng.choice((2, 10, 1000))
        parent[k:k + 1] = [Field(f.number, f.wire, f.value) for _ in range(copies)]
    elif op == "nest":
        inner = f.value
        for _ in range(rng.choice((1, 3, 50))):
            inner = [Field(f.number, 2, inner)] + [g for g in inner if isinstance(g, Field) and g.wire != 2][:2]
        f.value = inner
    return _cap(serialize(fields)), f"protobuf:{op}@{'/'.join(map(str, path))}"


# -- JSON ----------------------------------------------------------------------------------------------------

_JSON_PATHS: dict[bytes, tuple[Any, list]] = {}


def _json_paths(doc: Any, path: tuple = (), out: list | None = None) -> list:
    out = [] if out is None else out
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append(path + (k,))
            _json_paths(v, path + (k,), out)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append(path + (i,))
            _json_paths(v, path + (i,), out)
    return out


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def mutate_json(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A structure-aware JSON mutation: a value of the wrong type, a huge / negative / NaN / infinite number, a
    key removed, a list element repeated, an object emptied, or deep nesting (up to 100k ``[``)."""
    if data not in _JSON_PATHS:
        doc = json.loads(data)
        _JSON_PATHS[data] = (doc, _json_paths(doc))
    doc, paths = _JSON_PATHS[data]
    doc = json.loads(data)  # a fresh copy to change
    path = rng.choice(paths)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    k = path[-1]
    old = parent[k]
    op = rng.choice(("type", "type", "number", "number", "number", "drop", "drop", "repeat", "empty", "deep",
                     "string"))
    marker = "\u0000DEEP\u0000"
    if op == "type":
        parent[k] = rng.choice(WRONG_TYPES)
    elif op == "number":
        parent[k] = rng.choice(INTERESTING_NUMBERS) if not isinstance(old, (int, float)) or rng.random() < .7 \
            else old * rng.choice((-1, 1000, 1e12, -1e12))
    elif op == "drop":
        del parent[k]
    elif op == "repeat":
        if isinstance(parent, list):
            parent[k:k + 1] = [old] * rng.choice((2, 100, 2000))
        else:
            parent[k] = [old] * rng.choice((2, 100))
    elif op == "empty":
        parent[k] = {} if isinstance(old, dict) else [] if isinstance(old, list) else ""
    elif op == "string":
        parent[k] = str(old)[:rng.randrange(0, 12)] + rng.choice(("", "\x1b[2J", "\ufffd", "💥", "%s%n", "\\"))
    else:
        parent[k] = marker
    text = json.dumps(doc, separators=(",", ":"), allow_nan=True)
    if op == "deep":
        n = rng.choice((100, 1000, 10_000, 100_000))
        text = text.replace(json.dumps(marker), _deep(n) if rng.random() < .7 else '{"a":' * n + "1" + "}" * n)
    return _cap(text.encode()), f"json:{op}@{'/'.join(map(str, path))[-80:]}"


# -- HLO text ------------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"%?[A-Za-z_][\w.\-]*|-?\d+(?:\.\d+)?(?:e-?\d+)?|\s+|.", re.S)
_CALL_ATTR = re.compile(r"(calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)")
_COMP_HEADER = re.compile(r"(?m)^(?:ENTRY )?%?([\w.\-]+) (?:\(|\{)")
_SHAPE = re.compile(r"\b(f32|f16|bf16|s32|s8|u8|pred|s64|u32)\[([\d,]*)\]")
_LAYOUT = re.compile(r"\{(\d+(?:,\d+)*)\}")


def mutate_hlo(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A token-level HLO text mutation: a token dropped, repeated or swapped, a number made huge / negative,
    ``(((`` inserted, a shape with huge or negative dims, a layout like ``{1<0}``, an element type changed, a
    fusion (or reduce, while...) calling the computation it is in, a line dropped or repeated."""
    text = data.decode("utf-8", "replace")
    op = rng.choice(("token", "token", "number", "parens", "shape", "shape", "layout", "selfcall", "selfcall",
                     "line", "dtype", "bytes"))
    if op == "token":
        toks = _TOKEN.findall(text)
        i = rng.randrange(len(toks))
        how = rng.choice(("drop", "dup", "swap"))
        if how == "drop":
            del toks[i]
        elif how == "dup":
            toks.insert(i, toks[i] * rng.choice((1, 2, 50)))
        else:
            toks[i] = rng.choice(toks)
        text = "".join(toks)
        op += ":" + how
    elif op == "number":
        nums = list(re.finditer(r"(?<![\w.])\d+", text))
        m = rng.choice(nums)
        new = str(rng.choice((0, -1, 2**31, 2**63, 2**64, 10**30, 99999999999, -2**63)))
        text = text[:m.start()] + new + text[m.end():]
    elif op == "parens":
        i = rng.randrange(len(text))
        text = text[:i] + rng.choice(("(((", "(" * 5000, "{{{", "[[[", ")))", "{" * 5000)) + text[i:]
    elif op == "shape":
        shapes = list(_SHAPE.finditer(text))
        m = rng.choice(shapes)
        dims = rng.choice(("-1", "99999999999", "4294967296,4294967296,4294967296", "0", "1,-8", "9223372036854775807",
                           "", "8,8,8,8,8,8,8,8,8,8,8,8,8,8,8,8", "1e9", "?"))
        text = text[:m.start(2)] + dims + text[m.end(2):]
    elif op == "layout":
        lays = list(_LAYOUT.finditer(text))
        m = rng.choice(lays)
        text = text[:m.start()] + rng.choice(("{1<0}", "{0,0}", "{5,4}", "{-1}", "{1,0:T(8,128)(2,1)}", "{}",
                                              "{1,0:T(0,0)}", "{99999999999999999999}", "{1,0:E(99)}")) + text[m.end():]
    elif op == "selfcall":
        calls = list(_CALL_ATTR.finditer(text))
        if calls:
            m = rng.choice(calls)
            headers = [h for h in _COMP_HEADER.finditer(text) if h.start() < m.start()]
            own = headers[-1].group(1) if headers else m.group(2)
            target = own if rng.random() < .7 else rng.choice([h.group(1) for h in _COMP_HEADER.finditer(text)]
                                                              or [own])
            text = text[:m.start(2)] + target + text[m.end(2):]
    elif op == "line":
        lines = text.splitlines(keepends=True)
        i = rng.randrange(len(lines))
        if rng.random() < .5:
            del lines[i]
        else:
            lines.insert(i, lines[i] * rng.choice((1, 2, 100)))
        text = "".join(lines)
    elif op == "dtype":
        shapes = list(_SHAPE.finditer(text))
        m = rng.choice(shapes)
        text = text[:m.start(1)] + rng.choice(("s4", "token", "f8e4m3fn", "c128", "u64", "pred", "xyz", "tuple",
                                               "f32[]", "")) + text[m.end(1):]
    else:
        b, how = mutate_bytes(rng, data)
        return b, "hlo:" + how
    return _cap(text.encode("utf-8", "surrogateescape")), "hlo:" + op


# -- TOML ----------------------------------------------------------------------------------------------------

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v))


def dump_toml(doc: dict[str, Any]) -> str:
    """A minimal TOML writer: top-level values, then one table per dict (values as inline tables)."""
    head = [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    tables = [f"\n[{json.dumps(k)}]\n" + "\n".join(f"{json.dumps(kk)} = {_toml_value(vv)}" for kk, vv in v.items())
              for k, v in doc.items() if isinstance(v, dict)]
    return "\n".join(head) + "\n" + "\n".join(tables) + "\n"


def mutate_toml(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A chip-file mutation: a figure's value of the wrong type, zero, negative, NaN or infinite; a key or
    ``value`` removed; ``gpus_per_node = 0``; an unknown dtype or kind; non-UTF-8 bytes; raw byte changes."""
    op = rng.choice(("value", "value", "value", "type", "drop", "gpus", "kind", "dtype", "utf8", "bytes"))
    if op == "bytes":
        b, how = mutate_bytes(rng, data)
        return b, "toml:" + how
    if op == "utf8":
        b = bytearray(data)
        i = rng.randrange(len(b))
        b[i:i] = rng.choice((b"\xff\xfe", b"\xc3", b"\x80", b"\xed\xa0\x80"))
        return bytes(b), "toml:utf8"
    doc = tomllib.loads(data.decode())
    figures = [(s, k) for s, body in doc.items() if isinstance(body, dict) and s != "detect" for k in body]
    if op in ("value", "type") and figures:
        s, k = rng.choice(figures)
        new = rng.choice((0, 0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-300, 1e300, -5)) \
            if op == "value" else rng.choice(("fast", [1.0], {"x": 1}, True, "", "1e12"))
        fig = doc[s][k]
        if isinstance(fig, dict) and rng.random() < .8:
            fig["value"] = new
        else:
            doc[s][k] = new
    elif op == "drop":
        s = rng.choice(list(doc))
        if isinstance(doc[s], dict) and doc[s] and rng.random() < .7:
            k = rng.choice(list(doc[s]))
            if isinstance(doc[s][k], dict) and rng.random() < .5:
                doc[s][k].pop("value", None)
            else:
                del doc[s][k]
        else:
            del doc[s]
    elif op == "gpus":
        doc.setdefault("interconnect", {})["gpus_per_node"] = {"value": rng.choice((0, -1, 0.5, 10**20, "8"))}
        doc["kind"] = rng.choice(("gpu", doc.get("kind", "gpu")))
    elif op == "kind":
        doc["kind"] = rng.choice(("tpu", "gpu", "cpu", "", "quantum", 7))
    elif op == "dtype":
        doc.setdefault("peak_flops_per_s", {})[rng.choice(("f4", "int3", "bf16", "f32", "", "fp8"))] = \
            {"value": rng.choice((0, -1e12, 1e12, float("nan")))}
    return dump_toml(doc).encode(), "toml:" + op


# -- CSV -----------------------------------------------------------------------------------------------------

def mutate_csv(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A cell of the wrong type / huge / negative / NaN / empty, a header cell dropped, rows repeated or cut."""
    import csv

    rows = list(csv.reader(io.StringIO(data.decode())))
    op = rng.choice(("cell", "cell", "cell", "header", "rows", "columns", "bytes"))
    if op == "bytes":
        b, how = mutate_bytes(rng, data)
        return b, "csv:" + how
    if op == "cell" and len(rows) > 1:
        r = rng.randrange(1, len(rows))
        c = rng.randrange(len(rows[r]))
        rows[r][c] = str(rng.choice(INTERESTING_NUMBERS + WRONG_TYPES))
    elif op == "header":
        c = rng.randrange(len(rows[0]))
        rows[0][c] = rng.choice(("", "Total self time (us)", "x", rows[0][c].upper()))
    elif op == "rows":
        r = rng.randrange(len(rows))
        rows[r:r + 1] = [rows[r]] * rng.choice((0, 2, 500))
    else:
        r = rng.randrange(len(rows))
        rows[r] = rows[r][:rng.randrange(len(rows[r]) + 1)] + ["extra"] * rng.choice((0, 3))
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue().encode(), "csv:" + op


# -- compression ---------------------------------------------------------------------------------------------

_BOMB: bytes | None = None


def gzip_bomb() -> bytes:
    """A ~60 KB gzip of 64 MB of zero bytes (cached)."""
    global _BOMB
    if _BOMB is None:
        _BOMB = gzip.compress(b"\x00" * (64 << 20), compresslevel=9)
    return _BOMB


def maybe_gzip(rng: random.Random, data: bytes, how: str) -> tuple[bytes, str]:
    """Gzip the bytes; sometimes truncate or damage the gzip stream itself."""
    z = gzip.compress(data, compresslevel=1, mtime=0)
    r = rng.random()
    if r < .1:
        return z[:rng.randrange(len(z))], how + "+gzip-truncated"
    if r < .15:
        b, h = mutate_bytes(rng, z)
        return b, how + "+gzip-" + h
    return z, how + "+gzip"


# -- inputs --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FuzzInput:
    """One generated input: its class and seed, the mutation applied, and the files to write (name -> bytes)
    into an empty folder; ``main`` is the file the class's entry is given."""

    cls: str
    seed: int
    mutation: str
    files: dict[str, bytes]
    main: str


def _rng(cls: str, seed: int) -> random.Random:
    return random.Random(f"traceroof-fuzz:{cls}:{seed}")


def make_input(cls: str, seed: int) -> FuzzInput:
    """The deterministic input number ``seed`` of class ``cls``."""
    rng = _rng(cls, seed)
    if cls == "xplane":
        # collectives on 2 devices (4x the analysis time of the 1-device seed); a separate stream, so that the
        # other inputs stay those of the first campaigns
        sharded = _rng("xplane_sharded", seed).random() < .15
        data = seed_bytes("xplane_sharded" if sharded else "xplane")
        r = rng.random()
        if r < .5:
            b, how = mutate_protobuf(rng, data)
        elif r < .98:
            b, how = mutate_bytes(rng, data, [seed_bytes("hlo_proto")])
        else:
            b, how = rng.choice(((b"\x00" * (4 << 20), "zeros"), (b"", "empty"), (gzip_bomb(), "gzip-bomb")))
        return FuzzInput(cls, seed, ("sharded:" if sharded else "") + how, {"tiny.xplane.pb": b}, "tiny.xplane.pb")
    if cls == "trace_json":
        data = seed_bytes("trace_json")
        r = rng.random()
        if r < .75:
            b, how = mutate_json(rng, data)
        elif r < .99:
            b, how = mutate_bytes(rng, data)
        else:
            b, how = gzip_bomb(), "gzip-bomb"
            return FuzzInput(cls, seed, how, {"tiny.trace.json.gz": b}, "tiny.trace.json.gz")
        if rng.random() < .5:
            b, how = maybe_gzip(rng, b, how)
            return FuzzInput(cls, seed, how, {"tiny.trace.json.gz": b}, "tiny.trace.json.gz")
        return FuzzInput(cls, seed, how, {"tiny.trace.json": b}, "tiny.trace.json")
    if cls == "hlo_text":
        b, how = mutate_hlo(rng, seed_bytes("hlo_text"))
        return FuzzInput(cls, seed, how, {"tiny.trace.json": seed_bytes("trace_json"),
                                          "hlo/module_0008.jit_step.cpu_after_optimizations.txt": b},
                         "hlo/module_0008.jit_step.cpu_after_optimizations.txt")
    if cls == "hlo_proto":
        data = seed_bytes("hlo_proto")
        b, how = mutate_protobuf(rng, data) if rng.random() < .6 else mutate_bytes(rng, data)
        name = seed_files()["hlo_proto"].name
        return FuzzInput(cls, seed, how, {"run/tiny.trace.json": seed_bytes("trace_json"), f"run/{name}": b},
                         f"run/{name}")
    if cls == "xprof_export":
        files = {"tiny_overview_page.json": seed_bytes("overview")} if rng.random() < .8 else {}
        r = rng.random()
        if r < .15 and files:
            b, how = mutate_json(rng, seed_bytes("overview")) if rng.random() < .8 else \
                mutate_bytes(rng, seed_bytes("overview"))
            files["tiny_overview_page.json"] = b
            files["tiny_hlo_stats.json"] = seed_bytes("export_json")
            return FuzzInput(cls, seed, "overview:" + how, files, "tiny_hlo_stats.json")
        if r < .6:
            data = seed_bytes("export_json")
            b, how = mutate_json(rng, data) if rng.random() < .75 else mutate_bytes(rng, data)
            name = "tiny_hlo_stats.json"
        else:
            data = seed_bytes("export_csv")
            b, how = mutate_csv(rng, data) if rng.random() < .75 else mutate_bytes(rng, data)
            name = "tiny_hlo_stats.csv"
        if rng.random() < .2:
            b, how = maybe_gzip(rng, b, how)
            name += ".gz"
        files[name] = b
        return FuzzInput(cls, seed, how, files, name)
    if cls == "chip_toml":
        role = rng.choice(("chip", "chip", "chip_gpu", "chip_tpu"))
        b, how = mutate_toml(rng, seed_bytes(role))
        if rng.random() < .5:  # judged on the profile (device count, host topology) or on the export (cheaper)
            return FuzzInput(cls, seed, f"{role}:{how}", {"tiny.xplane.pb": seed_bytes("xplane"), "chip.toml": b},
                             "chip.toml")
        return FuzzInput(cls, seed, f"{role}:{how}+export", {"tiny_hlo_stats.json": seed_bytes("export_json"),
                                                               "tiny_overview_page.json": seed_bytes("overview"),
                                                               "chip.toml": b}, "chip.toml")
    if cls == "json_report":
        data = seed_bytes("report")
        b, how = mutate_json(rng, data) if rng.random() < .8 else mutate_bytes(rng, data)
        return FuzzInput(cls, seed, how, {"base.json": b}, "base.json")
    raise ValueError(f"unknown class {cls!r}; one of {', '.join(CLASSES)}")


def write_input(inp: FuzzInput, folder: Path) -> Path:
    """Write the input's files into ``folder``; returns the path of its main file."""
    for name, data in inp.files.items():
        p = folder / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return folder / inp.main


# -- running one input ---------------------------------------------------------------------------------------

def cli_args(inp: FuzzInput, folder: Path) -> list[str]:
    """The ``traceroof`` command line that runs this input (after :func:`write_input` into ``folder``)."""
    chip = str(seed_files()["chip"])
    main = str(folder / inp.main)
    if inp.cls == "hlo_text":
        return ["analyze", str(folder / "tiny.trace.json"), "--hlo", main, "--chip", chip]
    if inp.cls == "hlo_proto":
        return ["analyze", str(folder / "run" / "tiny.trace.json"), "--chip", chip]
    if inp.cls == "chip_toml":
        profile = "tiny.xplane.pb" if "tiny.xplane.pb" in inp.files else "tiny_hlo_stats.json"
        return ["analyze", str(folder / profile), "--chip", main]
    if inp.cls == "json_report":
        return ["diff", main, str(seed_files()["report"]), "--fail-above", "5"]
    return ["analyze", main, "--chip", chip]


def run_entry(inp: FuzzInput, folder: Path) -> Any:
    """Run the library entry of the input's class; returns what it returned (an Analysis, a Chip and an
    Analysis, or a diff result and the gate's verdict)."""
    import traceroof
    from traceroof import diff as diff_mod

    chip = str(seed_files()["chip"])
    main = folder / inp.main
    if inp.cls == "hlo_text":
        return traceroof.analyze(folder / "tiny.trace.json", hlo=[main], chip=chip)
    if inp.cls == "hlo_proto":
        return traceroof.analyze(folder / "run" / "tiny.trace.json", chip=chip)
    if inp.cls == "chip_toml":
        c = traceroof.get_chip(str(main))
        profile = "tiny.xplane.pb" if "tiny.xplane.pb" in inp.files else "tiny_hlo_stats.json"
        return c, traceroof.analyze(folder / profile, chip=c)
    if inp.cls == "json_report":
        base = diff_mod.load_side(main)
        new = diff_mod.load_side(seed_files()["report"])
        result = diff_mod.diff(base, new)
        return result, diff_mod.gate(result, 5.0)
    return traceroof.analyze(main, chip=chip)


def _bad(x: Any, allow_nan: bool = True, allow_negative: bool = False) -> bool:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return True
    if math.isnan(v):
        return not allow_nan
    return math.isinf(v) or (v < 0 and not allow_negative)


def _noted(notes: Iterable[str], *words: str) -> bool:
    text = " ".join(notes).lower()
    return any(w.lower() in text for w in words)


def _check_peaks(peaks: dict | None, bandwidth: Any, peak_label: str, bandwidth_label: str) -> list[str]:
    """Peaks (FLOP/s per dtype) and an HBM bandwidth (bytes/s) must be positive and finite."""
    out = [f"{peak_label}: {k} = {v!r}" for k, v in (peaks or {}).items()
           if _bad(v, allow_nan=False) or float(v) == 0]
    if bandwidth is not None and (_bad(bandwidth, allow_nan=False) or float(bandwidth) == 0):
        out.append(f"{bandwidth_label}: {bandwidth!r}")
    return out


def check_chip(c: Any) -> list[str]:
    """Chip figures used as peaks must be positive and finite."""
    return _check_peaks(c.peak_flops_per_s, c.hbm_bandwidth_bytes_per_s, "chip peak", "chip HBM bandwidth")


def check_analysis(a: Any) -> list[str]:
    """Figures of an Analysis that are out of range without a note (or finding) that says so: non-finite or
    negative times, FLOPs, bytes; a step time <= 0; MFU / HFU / roofline efficiency above
    ``EFFICIENCY_MAX`` or negative; an op execution longer than a day; chip peaks <= 0 or not finite."""
    import numpy as np

    s = a.summary
    notes = list(s.notes) + [str(f) for f in a.findings] + [s.chip_note]
    out = []
    if not (math.isfinite(s.step_time_mean_s) and s.step_time_mean_s > 0) and not _noted(notes, *STEP_NOTES):
        out.append(f"step_time_mean_s: {s.step_time_mean_s!r}")
    bad_steps = [t for t in s.step_times_s if not (math.isfinite(t) and t > 0)]
    if bad_steps and not _noted(notes, *STEP_NOTES):
        out.append(f"step_times_s: {bad_steps[:3]}")
    for name in ("flops_per_step", "hbm_bytes_per_step", "op_time_per_step_s", "expected_per_step_s",
                 "model_flops_per_step", "exposed_comm_per_step_s"):
        v = getattr(s, name)
        if _bad(v, allow_nan=name.startswith(("expected", "model", "exposed"))) and not _noted(notes, *VALUE_NOTES):
            out.append(f"{name}: {v!r}")
    for name, words in (("mfu", ("mfu",)), ("hfu", ("hfu",)),
                        ("roofline_efficiency", ("faster than their roofline", "roofline efficiency"))):
        v = getattr(s, name)
        if (_bad(v) or (not math.isnan(float(v)) and float(v) > EFFICIENCY_MAX)) and not _noted(notes, *words):
            out.append(f"{name}: {v!r}")
    out += [x for x in check_chip_summary(s)]
    ops = a.ops
    for col in ("measured_s", "flops", "hbm_bytes", "transcendentals"):
        if col in ops and len(ops):
            v = ops[col].to_numpy(np.float64)
            if (~np.isfinite(v) | (v < 0)).any() and not _noted(notes, *VALUE_NOTES):
                out.append(f"ops.{col}: {v[~np.isfinite(v) | (v < 0)][:3].tolist()}")
    if "measured_s" in ops and len(ops):
        v = ops["measured_s"].to_numpy(np.float64)
        if (v > OP_TIME_MAX_S).any() and not _noted(notes, "longer than", "implausibl"):
            out.append(f"op execution over a day: {float(v.max()):.3g} s")
    if "duration_ps" in ops and len(ops) and (ops["duration_ps"].to_numpy() < 0).any():
        out.append("ops.duration_ps: < 0")
    for col in ("time_per_step_s", "flops_per_step", "hbm_bytes_per_step"):
        if col in a.layers and len(a.layers):
            v = a.layers[col].to_numpy(np.float64)
            if (~np.isfinite(v) | (v < 0)).any() and not _noted(notes, *VALUE_NOTES):
                out.append(f"layers.{col}: {v[~np.isfinite(v) | (v < 0)][:3].tolist()}")
    return out


def check_chip_summary(s: Any) -> list[str]:
    """The peaks and bandwidth a report used must be positive and finite."""
    return _check_peaks(s.peak_flops_per_s, s.hbm_bandwidth_bytes_per_s, "peak used", "HBM bandwidth used")


def check_result(cls: str, value: Any) -> list[str]:
    """The out-of-range checks for what a class's entry returned."""
    if cls == "chip_toml":
        c, a = value
        return check_chip(c) + check_analysis(a)
    if cls == "json_report":
        result, (failed, why) = value
        b = result.base
        out = []
        if not (math.isfinite(b.step_time_mean_s) and b.step_time_mean_s > 0):
            out.append(f"baseline step time accepted: {b.step_time_mean_s!r} ({why})")
        if any(not (math.isfinite(t) and t > 0) for t in b.step_times_s):
            out.append(f"baseline step times accepted: {list(b.step_times_s)[:3]}")
        return out
    return check_analysis(value)


@dataclass(frozen=True)
class Result:
    """The outcome of one input: ``outcome`` is ``report``, ``error`` or a finding (:data:`FINDINGS`);
    ``place`` the innermost project frame ``path:line ExceptionType`` of a bug (or the check that failed for
    ``range``), ``detail`` one line."""

    cls: str
    seed: int
    mutation: str
    outcome: str
    place: str = ""
    detail: str = ""
    seconds: float = 0.0


def _place(e: BaseException) -> str:
    tb = e.__traceback__
    best = None
    while tb is not None:
        f = Path(tb.tb_frame.f_code.co_filename).resolve()
        if any(d in f.parents for d in PROJECT_DIRS):
            best = (f.relative_to(ROOT), tb.tb_lineno)
        tb = tb.tb_next
    where = f"{best[0]}:{best[1]}" if best else "(outside the project)"
    return f"{where} {type(e).__name__}"


def run_one(inp: FuzzInput, folder: Path) -> Result:
    """Write and run one input in this process; classify what happens."""
    from parsers.errors import TraceroofError

    t0 = time.perf_counter()
    write_input(inp, folder)
    try:
        value = run_entry(inp, folder)
    except TraceroofError as e:
        msg = str(e)
        if "\n" in msg.strip() or not msg.strip():
            lines = msg.count("\n") + 1
            return Result(inp.cls, inp.seed, inp.mutation, "bug", f"{_place(e)} (message of {lines} lines)",
                          msg[:200], time.perf_counter() - t0)
        return Result(inp.cls, inp.seed, inp.mutation, "error", type(e).__name__, msg[:200], time.perf_counter() - t0)
    except MemoryError as e:
        return Result(inp.cls, inp.seed, inp.mutation, "memory", _place(e), "MemoryError under the cap",
                      time.perf_counter() - t0)
    except RecursionError as e:
        return Result(inp.cls, inp.seed, inp.mutation, "bug", _place(e), str(e)[:200], time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - any other exception is the finding
        return Result(inp.cls, inp.seed, inp.mutation, "bug", _place(e), " ".join(str(e).split())[:200],
                      time.perf_counter() - t0)
    try:
        problems = check_result(inp.cls, value)
    except Exception as e:  # noqa: BLE001 - a report the checks cannot read is a finding too
        problems = [f"unreadable result ({type(e).__name__}): {e}"]
    if problems:
        return Result(inp.cls, inp.seed, inp.mutation, "range", problems[0].split(":")[0],
                      "; ".join(problems)[:300], time.perf_counter() - t0)
    return Result(inp.cls, inp.seed, inp.mutation, "report", "", "", time.perf_counter() - t0)


# -- the worker pool -----------------------------------------------------------------------------------------

def _vm_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _worker(conn: Any, memory_bytes: int) -> None:
    import resource
    import warnings

    warnings.simplefilter("ignore")
    if memory_bytes:
        limit = _vm_bytes() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    base = Path(tempfile.mkdtemp(prefix="traceroof-fuzz-"))
    try:
        while True:
            task = conn.recv()
            if task is None:
                return
            cls, seed = task
            folder = base / "in"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                inp = make_input(cls, seed)
            except MemoryError:
                conn.send(Result(cls, seed, "?", "memory", "(input generation)", ""))
                continue
            try:
                res = run_one(inp, folder)
            except MemoryError:
                res = Result(cls, seed, inp.mutation, "memory", "(outside the entry)", "")
            conn.send(res)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class _Slot:
    proc: Any = None
    conn: Any = None
    task: tuple[str, int] | None = None
    mutation: str = ""
    started: float = 0.0


def run_many(tasks: Iterable[tuple[str, int]], workers: int = 2, timeout_s: float = 20.0,
             memory_bytes: int = 2 << 30, on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Run ``(class, seed)`` inputs in ``workers`` forked processes, each under an address-space cap of
    ``memory_bytes`` above its size at start and ``timeout_s`` per input (a worker that overruns is killed and
    replaced: ``timeout``; one that dies: ``crash``). Results in completion order."""
    ctx = mp.get_context("fork")
    todo = iter(tasks)
    results: list[Result] = []
    slots = [_Slot() for _ in range(workers)]

    def spawn(slot: _Slot) -> None:
        parent, child = ctx.Pipe()
        slot.proc = ctx.Process(target=_worker, args=(child, memory_bytes), daemon=True)
        slot.proc.start()
        child.close()
        slot.conn, slot.task = parent, None

    def feed(slot: _Slot) -> bool:
        task = next(todo, None)
        if task is None:
            return False
        slot.task, slot.started = task, time.monotonic()
        slot.conn.send(task)
        return True

    def record(r: Result) -> None:
        results.append(r)
        if on_result:
            on_result(r)

    for slot in slots:
        spawn(slot)
        feed(slot)
    try:
        while any(s.task for s in slots):
            busy = [s for s in slots if s.task]
            ready = wait([s.conn for s in busy] + [s.proc.sentinel for s in busy], timeout=0.5)
            now = time.monotonic()
            for s in busy:
                if s.conn in ready or s.conn.poll():
                    try:
                        record(s.conn.recv())
                        s.task = None
                    except (EOFError, OSError):
                        pass
                if s.task and (s.proc.sentinel in ready or not s.proc.is_alive()):
                    code = s.proc.exitcode
                    record(Result(s.task[0], s.task[1], "", "crash", f"worker exit {code}",
                                  f"signal {-code}" if code and code < 0 else f"exit status {code}", now - s.started))
                    s.task = None
                    s.proc.join()
                    spawn(s)
                elif s.task and now - s.started > timeout_s:
                    s.proc.kill()
                    s.proc.join()
                    record(Result(s.task[0], s.task[1], "", "timeout", f"over {timeout_s:g} s", "", now - s.started))
                    s.task = None
                    spawn(s)
                if not s.task:
                    feed(s)
    finally:
        for s in slots:
            try:
                s.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            s.proc.join(timeout=5)
            if s.proc.is_alive():
                s.proc.kill()
                s.proc.join()
    return results


def interleaved(classes: Iterable[str], n: int, start: int = 0) -> list[tuple[str, int]]:
    """``n`` seeds of each class, interleaved (so the workers share the classes' costs)."""
    classes = list(classes)
    return [(c, s) for s in range(start, start + n) for c in classes]


def summarize(results: Iterable[Result]) -> dict[str, Any]:
    """Counts of outcomes per class and the distinct finding places, each with a count and an example."""
    per: dict[str, dict[str, int]] = {}
    places: dict[tuple[str, str, str], dict[str, Any]] = {}
    seconds: dict[str, float] = {}
    for r in results:
        seconds[r.cls] = seconds.get(r.cls, 0.0) + r.seconds
        per.setdefault(r.cls, {}).setdefault(r.outcome, 0)
        per[r.cls][r.outcome] += 1
        if r.outcome in FINDINGS:
            key = (r.outcome, r.place, r.cls)
            e = places.setdefault(key, {"outcome": r.outcome, "place": r.place, "class": r.cls, "count": 0,
                                        "example_seed": r.seed, "example_mutation": r.mutation,
                                        "detail": r.detail})
            e["count"] += 1
    return {"per_class": per, "mean_s": {c: round(t / max(sum(per[c].values()), 1), 4) for c, t in seconds.items()},
            "findings": sorted(places.values(), key=lambda e: (-e["count"], e["place"]))}


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="write and run one fuzz input")
    ap.add_argument("cls", choices=CLASSES)
    ap.add_argument("seed", type=int)
    ap.add_argument("-o", "--out", help="folder to write the input into (default: a temporary one)")
    args = ap.parse_args(argv)
    inp = make_input(args.cls, args.seed)
    folder = Path(args.out or tempfile.mkdtemp(prefix="traceroof-fuzz-"))
    folder.mkdir(parents=True, exist_ok=True)
    r = run_one(inp, folder)
    print(f"{r.cls} {r.seed}: {r.mutation}\n  -> {r.outcome} {r.place} {r.detail}\n  files in {folder}\n"
          f"  CLI: python -m traceroof.cli {' '.join(cli_args(inp, folder))}")
    if r.outcome == "bug":
        try:
            run_entry(inp, folder)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(_main(sys.argv[1:]))
