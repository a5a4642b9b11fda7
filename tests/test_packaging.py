"""The wheel ``pip install .`` builds holds the whole program: ``traceroof analyze`` runs from it alone (not from
this checkout), with the C scanner when a compiler is there and with the pure-Python decoder when none is."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, ROOT

OFFLINE = ("Could not find a version that satisfies", "No matching distribution", "Failed to establish",
           "Temporary failure in name resolution")


def _wheel(tmp: Path, env: dict[str, str]) -> Path:
    """Build the project's wheel as ``pip install .`` does (build isolation: the build backend that pyproject.toml
    asks for, not this environment's), from a copy of the tracked files (what a clone or an sdist holds: no
    scanner built in place by an editable install)."""
    src, out = tmp / "src", tmp / "dist"
    for f in _git_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode and any(s in r.stdout + r.stderr for s in OFFLINE):
        pytest.skip("pip cannot reach a package index to fetch the build backend (setuptools)")
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = out.glob("traceroof-*.whl")
    return wheel


# run with this environment's dependencies but without its editable install of traceroof (an import hook that
# would still find parsers._wirescan and other modules in this checkout)
_ALONE = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path "
          "if not getattr(f, '__module__', '').startswith('__editable__')]; ")


def _analyze_from(wheel: Path, tmp: Path) -> subprocess.CompletedProcess:
    site = tmp / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("TRACEROOF_DECODER", None)
    where = subprocess.run([sys.executable, "-c", _ALONE + "import parsers.xspace as x, traceroof; "
                            "print(traceroof.__file__, x.__file__, *(m.__file__ for m in [x._wirescan_c] if m))"],
                           capture_output=True, text=True, env=env, cwd=tmp, timeout=60)
    assert where.returncode == 0, where.stderr
    assert all(p.startswith(str(site)) for p in where.stdout.split()), where.stdout
    return subprocess.run([sys.executable, "-c", _ALONE + "sys.argv[1:] = sys.argv[2:]; "
                           "runpy.run_module('traceroof.cli', run_name='__main__')", "--", "analyze",
                           str(FIXTURES / "transformer"), "--format", "json"],
                          capture_output=True, text=True, env=env, cwd=tmp, timeout=300)


def _sources(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if not n.startswith("traceroof-")}


def _git_files(*paths: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *paths], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    return [f for f in out.stdout.splitlines() if (ROOT / f).is_file()]


def _tracked() -> set[str]:
    """The program's tracked modules and data files."""
    return {f for f in _git_files("traceroof", "parsers") if f.endswith((".py", ".toml"))}


def test_the_wheel_holds_every_module_and_runs_alone(tmp_path):
    wheel = _wheel(tmp_path, dict(os.environ))
    names = _sources(wheel)
    assert _tracked() <= names, sorted(_tracked() - names)
    assert [n for n in names if n.startswith("parsers/_wirescan.") and n.endswith(".so")]
    r = _analyze_from(wheel, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"decoder": "c"' in r.stdout


def test_without_a_compiler_the_wheel_decodes_in_python(tmp_path):
    env = dict(os.environ, CC="/bin/false", LDSHARED="/bin/false")  # the compiler fails: the C scanner is optional
    wheel = _wheel(tmp_path, env)
    names = _sources(wheel)
    assert not [n for n in names if n.startswith("parsers/_wirescan.") and not n.endswith((".py", ".c"))]
    assert _tracked() <= names
    r = _analyze_from(wheel, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"decoder": "python"' in r.stdout
