"""The C scanner (parsers/_wirescan.c) under AddressSanitizer and UndefinedBehaviorSanitizer: built with
``-fsanitize=address,undefined -fno-sanitize-recover=all`` and run (in a subprocess with libasan preloaded) on a
fixture and on mutated copies of it: byte flips, truncations, huge varints (times near 2^63, durations below
zero, lengths past the end). Any sanitizer report fails the test; skipped where gcc lacks the sanitizers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT, fixture_xplane

DRIVER = r'''
import importlib.util, random, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("parsers._wirescan", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
sys.modules["parsers._wirescan"] = mod
import parsers
parsers._wirescan = mod
from parsers.errors import TraceroofError
from parsers.xspace import SCHEMA, read_xspace

src, out = Path(sys.argv[2]), Path(sys.argv[3])
data = src.read_bytes()
rng = random.Random(11)

def varint(v):
    v &= (1 << 64) - 1
    b = bytearray()
    while True:
        b.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not b[-1] & 0x80:
            return bytes(b)

# an XLine whose events have times at the edges of int64
ev = b"".join(b"\x22" + varint(len(e)) + e for e in (
    b"\x08\x01\x10" + varint(2**63 - 10) + b"\x18\x05",        # offset near 2^63 (line_ps + offset overflows)
    b"\x08\x01\x10\x01\x18" + varint(-5),                        # negative duration
    b"\x08\x01\x28\x03\x18" + varint(2**63 - 1),                 # aggregate with a huge duration
    b"\x08\x01\x10" + varint(-2**63) + b"\x18" + varint(2**63 - 1)))
lines = b"".join(b"\x1a" + varint(len(x)) + x for x in (
    b"\x18" + varint(2**62) + ev,                                 # timestamp_ns * 1000 overflows
    b"\x18" + varint(1000) + ev))                                 # line_ps + offset_ps overflows
edge = b"\x0a" + varint(len(lines) + 2) + b"\x12\x00" + lines
inputs = [data, edge, data + edge, bytes(64), b"\x08\x00" * 1000, data[: len(data) // 2]]
for _ in range(int(sys.argv[4])):
    b = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0:
        for _ in range(rng.randrange(1, 20)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1:
        del b[rng.randrange(len(b)):]
    elif kind == 2:
        at = rng.randrange(len(b))
        b[at:at] = varint(rng.choice([2**63 - 1, 2**63, 2**64 - 1, -1, 2**62, 2**31]))
    else:
        at = rng.randrange(len(b))
        b[at:at + 10] = bytes([0xFF] * 9 + [0x01])
    inputs.append(bytes(b))
done = 0
for i, blob in enumerate(inputs):
    f = out / f"m{i}.xplane.pb"
    f.write_bytes(blob)
    try:
        xs = read_xspace(f)
        for p in xs.planes:
            p.events(stats=list(p.stat_names.values())[:8])
            p.events(stats=list(p.stat_names.values())[:4], require=list(p.stat_names.values())[4:6], names="end: ")
        done += 1
    except TraceroofError:
        pass
print("decoded", done, "of", len(inputs))
'''


def _sanitizer_lib(name: str) -> str | None:
    gcc = shutil.which("gcc")
    if not gcc:
        return None
    path = subprocess.run([gcc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and Path(path).exists() else None


def test_scanner_is_clean_under_asan_and_ubsan(tmp_path):
    asan = _sanitizer_lib("libasan.so")
    if asan is None or _sanitizer_lib("libubsan.so") is None:
        pytest.skip("gcc with libasan/libubsan is not installed: cannot build the scanner with sanitizers")
    so = tmp_path / "_wirescan_san.so"
    build = subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
         "-fno-sanitize-recover=all", f"-I{sysconfig.get_paths()['include']}", str(ROOT / "parsers" / "_wirescan.c"),
         "-o", str(so)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    env = dict(os.environ, LD_PRELOAD=asan, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", DRIVER, str(so), str(fixture_xplane("scan_mlp")), str(tmp_path),
                          "300"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    report = run.stderr + run.stdout
    assert "runtime error" not in report and "AddressSanitizer" not in report, report[-4000:]
    assert run.returncode == 0, report[-4000:]
    decoded, total = (int(x) for x in run.stdout.split()[1::2])
    assert total == 306 and 1 <= decoded < total  # the intact fixture decodes; most mutations are refused
