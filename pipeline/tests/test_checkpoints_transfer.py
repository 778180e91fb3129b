"""Checkpoints that travel (issue 16): the real set exported, imported into a fresh cache, and served.

One export of build/checkpoints (its three images and its ~340 MB rootfs)
and one import into a new cache, at another path than the capture's, serve
every test here: real ``readie`` processes, real runsc restores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from readie_pipeline.archive_format import DigestMismatch
from readie_pipeline.checkpoint_import import import_checkpoints
from readie_pipeline.checkpoint_verify import verify_manifest
from readie_rpc.stubs import worker_pb2 as pb
from readie_rpc.testing import start_worker, stop_worker
from readie_worker.core import Worker, WorkerConfig
from readie_worker.manifest import read_manifest
from readie_worker.runsc import features
from readie_worker.testing import readie_command

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc

# Export and import of ~0.4 GB take ~5-20 s each on a loaded two-core machine.
COMMAND_TIMEOUT_S = 180
JOB_TIMEOUT_S = 60


def readie(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*readie_command(), *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, cwd=cwd,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def archive(checkpoints) -> Iterator[Path]:
    # Not pytest's tmp_path: it keeps three runs, and these are 0.4 GB each.
    base = Path(tempfile.mkdtemp(prefix="readie-export-"))
    path = base / "checkpoints.tar"
    try:
        done = readie("checkpoints", "export", f"--checkpoints={CHECKPOINTS}", f"--output={path}")
        assert done.returncode == 0, done.stderr
        assert "exported" in done.stderr and path.is_file()
        yield path
    finally:
        shutil.rmtree(base)


@pytest.fixture(scope="module")
def cache(archive) -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="readie-import-"))
    cache = base / "cache"
    try:
        done = readie("checkpoints", "import", str(archive), f"--into={cache}")
        assert done.returncode == 0, done.stderr
        yield cache
    finally:
        shutil.rmtree(base)


def test_the_archive_is_a_plain_tar_with_its_digest_first(archive):
    listed = subprocess.run(["tar", "-tf", str(archive)], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=True)
    names = listed.stdout.splitlines()
    assert names[:3] == ["readie-checkpoints.json", "set/", "set/manifest.json"]
    assert "set/pandas/pages.img" in names and "rootfs/usr/bin/python3.11" in names
    assert "rootfs/dev/pts/" in names and "rootfs/dev/null" not in names  # device nodes stay behind


def test_the_import_lands_in_the_caches_default_at_its_own_path(cache):
    captured = read_manifest(CHECKPOINTS / "manifest.json")
    imported = read_manifest(cache / "checkpoints" / "manifest.json")
    # Under a name of its content, not the captured layer's: a capture here never takes it for its own build.
    assert imported.rootfs.parent.parent == (cache / "rootfs").resolve()
    assert imported.rootfs.parent.name.startswith("imported-") and imported.rootfs.name == "rootfs"
    assert imported.rootfs != captured.rootfs  # moved: the manifest was rewritten for this cache
    assert imported.spec_fingerprint == captured.spec_fingerprint  # the path is not part of the shape
    assert sorted(imported.checkpoints) == sorted(captured.checkpoints)
    # Every command reads the default: verify finds it with nothing named but the cache.
    done = readie("checkpoints", "verify", cwd=cache.parent,
                  env={"READIE_CACHE": str(cache), "READIE_CHECKPOINTS": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("all usable") and "pandas: would restore" in done.stdout


def test_a_worker_restores_from_the_imported_set(cache, short_tmp):
    # A file only the imported rootfs has: the job proves its sandbox runs on it.
    marker = (cache / "checkpoints" / "manifest.json").resolve()
    rootfs = read_manifest(marker).rootfs
    (rootfs / "etc" / "readie-imported").write_text("imported rootfs\n")
    workers = []
    try:
        # --manifest DIR (the default link), warm from the imported base image.
        workers.append(start_worker(short_tmp / "w1", "w1", cache / "checkpoints", warm="base=1"))
        code = "print(open('/etc/readie-imported').read().strip())\nimport pandas\nprint(pandas.__name__)"
        reply = workers[0].stub.RunJob(pb.RunJobRequest(checkpoint="pandas", code=code), timeout=JOB_TIMEOUT_S)
        assert (reply.exit, reply.stdout) == (0, "imported rootfs\npandas\n"), reply
        assert reply.backend == "gvisor:runsc-restore"
        # --checkpoints DIR names the set itself; the --manifest given first names nothing, so it must win.
        workers.append(start_worker(short_tmp / "w2", "w2", Path("/nonexistent"), warm="base=1",
                                    args=[f"--checkpoints={marker.parent}"]))
        reply = workers[1].stub.RunJob(pb.RunJobRequest(checkpoint="base", code="print(6 * 7)"), timeout=JOB_TIMEOUT_S)
        assert (reply.exit, reply.stdout, reply.backend) == (0, "42\n", "gvisor:runsc-restore"), reply
    finally:
        for worker in workers:
            assert stop_worker(worker) == 0
        (rootfs / "etc" / "readie-imported").unlink()


def test_a_second_import_reuses_the_installed_rootfs(archive, cache):
    before = os.path.realpath(cache / "checkpoints")
    again = import_checkpoints(archive, cache)
    assert again.rootfs_reused and str(again.set_dir) == before
    assert verify_manifest(again.set_dir / "manifest.json").usable


def test_a_tampered_image_byte_is_refused_and_nothing_is_installed(archive, tmp_path):
    with tarfile.open(archive) as tar:
        offset = tar.getmember("set/base/pages.img").offset_data + 4096
    with open(archive, "r+b") as file:
        file.seek(offset)
        original = file.read(1)
        file.seek(offset)
        file.write(bytes([original[0] ^ 0xFF]))
    try:
        fresh = tmp_path / "cache"
        with pytest.raises(DigestMismatch, match=r"set/base/pages.img' is corrupt: sha256"):
            import_checkpoints(archive, fresh)
        assert os.listdir(fresh) == []
        done = readie("checkpoints", "import", str(archive), f"--into={fresh}")
        assert done.returncode == 1 and "set/base/pages.img' is corrupt" in done.stderr, done.stderr
        assert os.listdir(fresh) == []
    finally:
        with open(archive, "r+b") as file:
            file.seek(offset)
            file.write(original)


def test_a_set_captured_under_another_platform_is_refused_naming_both(cache, short_tmp):
    ours = features().platform
    other = "ptrace" if ours != "ptrace" else "systrap"
    source = (cache / "checkpoints").resolve()
    raw = json.loads((source / "manifest.json").read_text())
    raw["runsc_flags"] = [f"--platform={other}" if flag.startswith("--platform") else flag for flag in raw["runsc_flags"]]
    for entry in raw["checkpoints"]:
        entry["image_path"] = str(source / entry["image_path"])
    moved = short_tmp / "other-platform"
    moved.mkdir()
    (moved / "manifest.json").write_text(json.dumps(raw))
    both = f"captured with platform {other}, this host runs {ours}"

    done = readie("checkpoints", "verify", f"--checkpoints={moved}")
    assert done.returncode == 1 and both in done.stdout and "NOT usable" in done.stdout, done.stdout + done.stderr

    worker = Worker(WorkerConfig.in_temp(moved / "manifest.json", warm={"base": 0})).start()
    try:
        assert worker.checkpoints.usable == {}
        assert both in worker.checkpoints.problems["*"]
    finally:
        worker.close()
    shutil.rmtree(moved)
