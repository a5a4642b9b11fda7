"""Profiles and HLO dumps in object storage: fsspec URLs work wherever a local path does (``memory://`` stands in
for gs:// and s3://: same code path, no network), and every storage failure is one line with exit status 2."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from parsers import storage
from parsers.errors import InputError, SizeLimitError
from parsers.xspace import read_xspace
from traceroof.analysis import analyze
from traceroof.cli import main
from tests.conftest import FIXTURES, HOST_CHIP, fixture_trace_json, fixture_xplane

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def memfs():
    """fsspec's in-process ``memory://`` filesystem, emptied after the test."""
    fs = fsspec.filesystem("memory")
    yield fs
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]


def upload(fs, local: Path, root: str) -> str:
    """Copy a local folder to ``memory://<root>``; its URL."""
    for f in local.rglob("*"):
        if f.is_file():
            fs.pipe(f"/{root}/{f.relative_to(local).as_posix()}", f.read_bytes())
    return f"memory://{root}"


def figures(a) -> dict:
    s = a.summary
    return {"flops_per_step": s.flops_per_step, "step_times_s": s.step_times_s, "steps_used": s.steps_used,
            "joined": (s.join.events_total, s.join.events_joined, s.join.time_joined_ps),
            "hlo_sources": s.hlo_sources, "devices": s.devices, "notes": s.notes}


def test_logdir_and_hlo_urls_give_the_local_report(memfs):
    url = upload(memfs, FIXTURES / "transformer", "fx")
    local = analyze(FIXTURES / "transformer" / "logdir", hlo=FIXTURES / "transformer" / "hlo", chip=HOST_CHIP)
    remote = analyze(f"{url}/logdir", hlo=f"{url}/hlo", chip=HOST_CHIP)
    assert figures(remote) == figures(local)
    assert remote.summary.hlo_sources["HLO text dumps equal to the profile's HLO"] >= 1  # dumps were read
    pd.testing.assert_frame_equal(remote.layers, local.layers)
    assert remote.summary.input == f"{url}/logdir/plugins/profile/2026_11_23_00_03_13"
    beside = analyze(url, chip=HOST_CHIP)  # HLO dumps found beside the profile in the bucket
    assert figures(beside) == figures(local)


def test_trace_json_url_joins_to_dumps_read_from_storage(memfs):
    url = upload(memfs, FIXTURES / "diff_base", "fx")
    tj = fixture_trace_json("diff_base")
    local = analyze(tj, hlo=FIXTURES / "diff_base" / "hlo", chip=HOST_CHIP)
    remote = analyze(f"{url}/{tj.relative_to(FIXTURES / 'diff_base').as_posix()}", hlo=f"{url}/hlo/", chip=HOST_CHIP)
    assert figures(remote) == figures(local) and remote.summary.hlo_sources == local.summary.hlo_sources
    (source,) = remote.summary.hlo_sources.items()
    assert source[0].startswith("HLO text dumps matched by op name only") and source[1] == 1
    assert remote.summary.join.matched_sources == (
        f"{url}/hlo/module_0020.jit_train_step.cpu_after_optimizations.txt",)


def test_run_directory_url_reads_every_host_file(memfs):
    src = fixture_xplane("scan_mlp")
    run = "memory://pod/logdir/plugins/profile/2026_01_01_00_00_00"
    for host in ("host_a", "host_b"):
        memfs.pipe(f"{run}/{host}.xplane.pb", src.read_bytes())
    one = analyze(src, chip=HOST_CHIP)
    two = analyze(run + "/", chip=HOST_CHIP)
    assert set(two.ops["host"].astype(str)) == {"host_a", "host_b"} and two.ops["device"].nunique() == 2
    assert two.summary.join.events_total == 2 * one.summary.join.events_total
    assert two.summary.flops_per_step == pytest.approx(one.summary.flops_per_step)
    single = analyze(f"{run}/host_a.xplane.pb", chip=HOST_CHIP)
    assert figures(single) == figures(one)


def test_cli_analyzes_a_url_like_the_local_path(memfs):
    url = upload(memfs, FIXTURES / "scan_mlp", "fx")
    runner = CliRunner()
    local = runner.invoke(main, ["analyze", str(FIXTURES / "scan_mlp"), "--chip", HOST_CHIP, "--format", "json"])
    remote = runner.invoke(main, ["analyze", url, "--chip", HOST_CHIP, "--format", "json"])
    assert remote.exit_code == 0, remote.output
    a, b = json.loads(local.output), json.loads(remote.output)
    assert b["summary"]["input"].startswith(f"{url}/logdir/plugins/profile/")
    for doc in (a, b):
        del doc["summary"]["input"]
        doc["summary"].pop("join", None)
    assert b["summary"] == a["summary"] and b["layers"] == a["layers"]


def test_cli_writes_a_report_of_a_url_to_a_local_file(memfs, tmp_path):
    url = upload(memfs, FIXTURES / "scan_mlp", "fx")
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["analyze", url, "--chip", HOST_CHIP, "--format", "json", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["summary"]["flops_per_step"] > 0


def _one_line_error(args: list[str]) -> str:
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1 and "Traceback" not in r.output
    return r.output


def test_missing_url_is_one_line_exit_2(memfs):
    out = _one_line_error(["analyze", "memory://nowhere/logdir"])
    assert "memory://nowhere/logdir does not exist" in out
    url = upload(memfs, FIXTURES / "diff_base", "fx")
    out = _one_line_error(["analyze", url, "--hlo", "memory://nowhere/hlo"])
    assert "--hlo memory://nowhere/hlo does not exist" in out


def test_gs_and_s3_without_their_package_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed, whatever this venv holds
    monkeypatch.setitem(sys.modules, "s3fs", None)
    out = _one_line_error(["analyze", "gs://bucket/logdir"])
    assert "gs://bucket/logdir" in out and "gs:// paths need the gcs extra: pip install 'traceroof[gcs]'" in out
    out = _one_line_error(["analyze", "s3://bucket/run", "--chip", HOST_CHIP])
    assert "s3:// paths need the s3 extra: pip install 'traceroof[s3]'" in out
    monkeypatch.setitem(sys.modules, "fsspec", None)
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    out = _one_line_error(["analyze", "memory://x/logdir"])
    assert "memory:// paths need fsspec: pip install fsspec" in out
    out = _one_line_error(["analyze", "gs://bucket/logdir"])
    assert "pip install 'traceroof[gcs]'" in out


def test_storage_errors_name_the_url_and_what_to_do():
    class Denied(fsspec.AbstractFileSystem):
        protocol = "traceroofdenied"

        def info(self, path, **kwargs):
            raise PermissionError(403, "Forbidden")

        def ls(self, path, detail=True, **kwargs):
            raise ConnectionError("Connection reset by peer")

    fsspec.register_implementation("traceroofdenied", Denied, clobber=True)
    with pytest.raises(InputError, match=r"traceroofdenied://b/x: permission denied .*credentials"):
        storage.exists("traceroofdenied://b/x")
    with pytest.raises(InputError, match=r"cannot read traceroofdenied://b: ConnectionError: Connection reset .*"
                                         r"network"):
        storage.listing("traceroofdenied://b")
    with pytest.raises(InputError, match="Protocol not known: nosuchproto"):
        storage.exists("nosuchproto://b/x")


def test_file_url_is_the_local_path():
    path = (FIXTURES / "scan_mlp").resolve()
    assert storage.location(path.as_uri()) == path and storage.location("file://localhost" + str(path)) == path
    local = analyze(path, chip=HOST_CHIP)
    via_url = analyze(path.as_uri(), chip=HOST_CHIP)
    assert figures(via_url) == figures(local) and via_url.summary.input == local.summary.input


def test_gzip_url_keeps_the_inflate_bound(memfs, monkeypatch):
    src = fixture_xplane("scan_mlp")
    url = "memory://gz/h.xplane.pb.gz"
    memfs.pipe(url, gzip.compress(src.read_bytes()))
    xs = read_xspace(url)
    assert xs.path == url and len(xs.planes) == len(read_xspace(src).planes)
    monkeypatch.setenv("TRACEROOF_MAX_INFLATE_BYTES", "1000")
    with pytest.raises(SizeLimitError, match="memory://gz/h.xplane.pb.gz: gzip data inflates to more than 1,000"):
        read_xspace(url)
    with pytest.raises(SizeLimitError, match="memory://gz/h.xplane.pb.gz: more than the 10 bytes .* copy it to a "
                                             "local disk"):
        storage.read_bytes(url, limit_bytes=10)


def test_sidecar_hloproto_url_is_read(memfs):
    from parsers.hlo_proto import module_from_proto
    from traceroof.hlo_source import embedded_hlo, profile_hlo
    from traceroof.profile import load_profile
    from traceroof.discovery import discover

    src = fixture_xplane("scan_mlp")
    pid, name, data, _ = next(e for e in embedded_hlo(read_xspace(src)) if "train_step" in e[1])
    run = "memory://side/plugins/profile/r"
    memfs.pipe(f"{run}/h.xplane.pb", src.read_bytes())
    memfs.pipe(f"{run}/{name}({pid}).hlo_proto.pb", data)
    inputs = discover([run])
    assert inputs.hlo_proto_files == (f"{run}/{name}({pid}).hlo_proto.pb",)
    events = load_profile(inputs).rows
    ((module, how),) = [(m, h) for m, h in profile_hlo(events, [], inputs.hlo_proto_files) if m.name == name]
    assert how == "sidecar" and module.program_id == pid and module.source == inputs.hlo_proto_files[0]
    assert len(module.computations) == len(module_from_proto(data).computations)


def test_local_inputs_stay_paths(tmp_path):
    from traceroof.discovery import discover

    shutil.copytree(FIXTURES / "diff_base", tmp_path / "fx")
    found = discover([str(tmp_path / "fx")])
    assert found.profiles and found.hlo_files
    assert all(isinstance(p, Path) for p in (*found.profiles, *found.hlo_files))


def test_readme_object_storage_command_as_written(memfs):
    """The README's gs:// command, its bucket replaced by an in-process memory:// one holding a fixture."""
    import re
    import shlex

    readme = (FIXTURES.parent / "README.md").read_text(encoding="utf-8")
    (cmd,) = [c.strip() for c in re.findall(r"&& (traceroof analyze gs://\S+ --hlo gs://\S+)", readme)]
    root = upload(memfs, FIXTURES / "transformer", "my-bucket")
    args = shlex.split(cmd.replace("gs://my-bucket", root))[1:]
    r = CliRunner().invoke(main, [*args, "--chip", str(HOST_CHIP), "--format", "json"])
    local = CliRunner().invoke(main, ["analyze", str(FIXTURES / "transformer" / "logdir"), "--hlo",
                                      str(FIXTURES / "transformer" / "hlo"), "--chip", str(HOST_CHIP), "--format", "json"])
    assert r.exit_code == 0 and local.exit_code == 0, r.output
    ours, theirs = json.loads(r.output), json.loads(local.output)
    for doc in (ours, theirs):
        for k in ("input", "hlo_sources"):
            doc["summary"].pop(k)
        doc["summary"]["join"].pop("matched_sources")
    assert ours == theirs
