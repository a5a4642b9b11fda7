"""The files XLA writes into an ``--xla_dump_to`` folder, recognised by name.

With ``--xla_dump_hlo_as_text`` XLA (openxla/xla ``xla/service/dump.cc``) writes, per module
``module_NNNN.<name>``: ``.before_optimizations.txt`` and ``.<backend>_after_optimizations.txt`` (HLO text), the
buffer assignment (``...after_optimizations-buffer-assignment.txt`` and ``-buffer-assignment-values.txt``), the
memory-usage report (``-memory-usage-report.txt``), buffer live ranges (``-live-range.txt``), ``.debug_options``,
and backend artefacts (LLVM IR ``.ll``, object files ``.o``, PTX, thunk sequences, autotuning results, subfolders).
Only after-optimization HLO text describes what ran; the rest is skipped here (the memory reports have their own
readers).
"""

from __future__ import annotations

import re
from pathlib import Path

# module_0006.jit_step.cpu_after_optimizations.txt, module_0012.jit_f.sm_9.0_gpu_after_optimizations.txt,
# module_0003.jit_g.tpu_after_optimizations.txt (no suffix after "after_optimizations")
_AFTER = re.compile(r"module_\d+\..+[._]after_optimizations\.txt$")
_REPORT = re.compile(r"after_optimizations-(buffer-assignment|buffer-assignment-values|memory-usage-report|"
                     r"live-range)\w*\.txt$")
_BEFORE = re.compile(r"\.before_optimizations\.txt$")
HLO_TEXT_SUFFIXES = (".txt", ".hlo", ".hlo.txt")
_SNIFF_BYTES = 4096


def dump_file_kind(path: Path) -> str:
    """What an XLA dump file is, from its name: ``hlo_after`` (after-optimization HLO text), ``hlo_before``,
    ``buffer-assignment``, ``buffer-assignment-values``, ``memory-usage-report``, ``live-range``, or ``other``
    (IR, objects, debug options, autotuning, anything else)."""
    name = path.name
    report = _REPORT.search(name)
    if report:
        return report.group(1)
    if _AFTER.search(name):
        return "hlo_after"
    if _BEFORE.search(name):
        return "hlo_before"
    return "other"


def looks_like_hlo(path: Path) -> bool:
    """True when the file's first bytes hold an ``HloModule`` header (HLO text written by XLA or a user)."""
    try:
        with path.open("rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError:
        return False
    return re.search(rb"(?m)^[ \t]*HloModule\s", head) is not None


def hlo_text_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(after-optimization HLO text files, other files that look like HLO text) under ``folder``, recursively,
    skipping TensorBoard ``plugins/`` folders. The second list holds hand-written or renamed HLO (``.txt`` /
    ``.hlo`` files with an ``HloModule`` header that are not XLA's before-optimization dumps or reports)."""
    after, other = [], []
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or "plugins" in p.relative_to(folder).parts:
            continue
        kind = dump_file_kind(p)
        if kind == "hlo_after":
            after.append(p)
        elif kind == "other" and p.name.endswith(HLO_TEXT_SUFFIXES) and looks_like_hlo(p):
            other.append(p)
    return after, other
