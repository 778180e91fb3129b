"""The capture pipeline end to end under real runsc (base checkpoint: seconds, not minutes)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from readie_executor.framing import PROTOCOL_VERSION
from readie_pipeline.capture import CaptureError, CaptureOptions, capture
from readie_pipeline.plan import CheckpointPlan, load_plan
from readie_worker.core import Worker, WorkerConfig
from readie_worker.jobs import CodeJob
from readie_worker.manifest import MANIFEST_NAME, file_sha256
from readie_worker.runsc import Runsc, features

pytestmark = pytest.mark.runsc


@pytest.fixture(scope="module")
def plan():
    return load_plan()


def test_capture_writes_a_complete_manifest_and_leaves_no_container(plan, tmp_path):
    lines: list[str] = []
    manifest = capture(plan, CaptureOptions(tmp_path, runs=1, only=("base",)), lines.append)

    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert raw["executor_protocol"] == PROTOCOL_VERSION
    assert raw["runsc_version"].startswith("runsc version")
    # What this host's runsc supports best: systrap and uncompressed images on runsc 2024.
    supported = features()
    assert raw["runsc_version"] == supported.version
    assert raw["runsc_flags"] == [*supported.sandbox_flags, *supported.checkpoint_flags]
    assert f"--platform={supported.platform}" in raw["runsc_flags"] and "--network=none" in raw["runsc_flags"]
    assert raw["spec_fingerprint"].startswith("sha256:")
    assert raw["rootfs_fingerprint"].startswith("sha256:")
    assert raw["python"].startswith("3.11")
    assert raw["executor_argv"] == ["/usr/bin/python3", "-u", "-m", "readie_executor"]
    assert raw["created_at"]
    [entry] = raw["checkpoints"]
    assert entry["name"] == "base" and entry["preimport"] == [] and entry["image_path"] == "base"
    # Every file of the image directory, sized and hashed (three when uncompressed).
    image_dir = tmp_path / "base"
    assert [f["name"] for f in entry["files"]] == sorted(p.name for p in image_dir.iterdir())
    assert "checkpoint.img" in [f["name"] for f in entry["files"]]
    for file in entry["files"]:
        assert file["size_bytes"] == (image_dir / file["name"]).stat().st_size > 0
        assert file["sha256"] == file_sha256(image_dir / file["name"])
    for timing in ("restore_p50_ms", "restore_to_socket_p50_ms", "cold_start_p50_ms"):
        assert entry[timing] > 0
    assert [f.sha256 for f in manifest.checkpoints["base"].files] == [f["sha256"] for f in entry["files"]]

    # Progress names the checkpoint, the step and how long it took.
    assert any(line.startswith("[base] checkpoint:") and line.endswith(" s") for line in lines)
    assert any(line.startswith("[base] restore x1 (measure mode):") for line in lines)
    assert Runsc(root=tmp_path / ".runsc-state").list_ids() == []
    assert not list(tmp_path.glob(".*.new"))


def test_an_up_to_date_checkpoint_is_not_captured_again(plan, tmp_path):
    capture(plan, CaptureOptions(tmp_path, runs=1, only=("base",)), lambda line: None)
    before = (tmp_path / "base" / "checkpoint.img").stat().st_mtime_ns
    lines: list[str] = []
    capture(plan, CaptureOptions(tmp_path, runs=1, only=("base",)), lines.append)
    assert any("[base] up to date" in line for line in lines)
    assert (tmp_path / "base" / "checkpoint.img").stat().st_mtime_ns == before


def test_a_failing_preimport_is_a_capture_error_naming_the_package(plan, tmp_path):
    broken = dataclasses.replace(plan, checkpoints=(CheckpointPlan("broken", ("no_such_package_xyz",)),))
    with pytest.raises(CaptureError, match="no_such_package_xyz"):
        capture(broken, CaptureOptions(tmp_path, runs=1), lambda line: None)
    assert Runsc(root=tmp_path / ".runsc-state").list_ids() == []
    assert not (tmp_path / MANIFEST_NAME).exists()


def test_an_after_restore_hook_runs_in_every_sandbox_and_is_part_of_the_checkpoint(plan, tmp_path):
    # faulthandler is off in the template: a sandbox that has it on ran the hook after it woke up.
    hooked = dataclasses.replace(plan, checkpoints=(CheckpointPlan("base", (), "faulthandler:enable"),))
    capture(hooked, CaptureOptions(tmp_path, runs=1), lambda line: None)
    [entry] = json.loads((tmp_path / MANIFEST_NAME).read_text())["checkpoints"]
    assert entry["after_restore"] == "faulthandler:enable"
    worker = Worker(WorkerConfig.in_temp(tmp_path / MANIFEST_NAME, warm={"base": 0})).start()
    try:
        outcome = worker.run_job(CodeJob(checkpoint="base", code="import faulthandler\nprint(faulthandler.is_enabled())"))
    finally:
        worker.close()
    assert (outcome.exit, outcome.stdout) == (0, "True\n"), outcome.error

    lines: list[str] = []
    capture(plan, CaptureOptions(tmp_path, runs=1, only=("base",)), lines.append)
    assert not any("up to date" in line for line in lines)  # another hook is another checkpoint


def test_a_hook_that_fails_at_every_wake_up_fails_the_capture(plan, tmp_path):
    failing = dataclasses.replace(plan, checkpoints=(CheckpointPlan("base", (), "sys:exit"),))
    with pytest.raises(CaptureError, match="checkpoint 'base': a sandbox made from it does not serve"):
        capture(failing, CaptureOptions(tmp_path, runs=1), lambda line: None)
    assert Runsc(root=tmp_path / ".runsc-state").list_ids() == []
    assert not (tmp_path / MANIFEST_NAME).exists() and not list(tmp_path.glob(".*.new"))
