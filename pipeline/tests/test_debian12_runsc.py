"""Debian 12's own runsc (2022: ptrace, compressed images) still works beside the default 2024 one.

Captured with it, a checkpoint restores under it; a checkpoint of one runsc is
refused by a worker on the other, naming both versions (cross-restores panic,
or worse: a systrap image under ptrace segfaults the job).
"""

from __future__ import annotations

import pytest

from conftest import CHECKPOINTS
from readie_pipeline.capture import CaptureOptions, capture
from readie_pipeline.plan import load_plan
from readie_worker.core import Worker, WorkerConfig
from readie_worker.jobs import CodeJob
from readie_worker.runsc import features
from readie_worker.testing import DEBIAN_12_RUNSC

pytestmark = pytest.mark.runsc

OLD = str(DEBIAN_12_RUNSC)


@pytest.fixture(scope="module")
def old_manifest(tmp_path_factory):
    assert DEBIAN_12_RUNSC.exists(), f"{DEBIAN_12_RUNSC} is missing: make setup installs it"
    out = tmp_path_factory.mktemp("debian12")
    capture(load_plan(), CaptureOptions(out, runs=1, only=("base",), runsc=OLD), lambda line: None)
    return out / "manifest.json"


def test_debian_12s_runsc_captures_under_ptrace_with_a_compressed_image(old_manifest):
    import json

    raw = json.loads(old_manifest.read_text())
    assert raw["runsc_version"] == "runsc version 0.0~20221219.0"
    assert "--platform=ptrace" in raw["runsc_flags"] and not any(f.startswith("--compression") for f in raw["runsc_flags"])
    assert [f["name"] for f in raw["checkpoints"][0]["files"]] == ["checkpoint.img"]


def test_a_worker_on_debian_12s_runsc_restores_its_checkpoints(old_manifest):
    worker = Worker(WorkerConfig.in_temp(old_manifest, warm={"base": 1}, runsc=OLD)).start()
    try:
        outcome = worker.run_job(CodeJob(checkpoint="base", code="import os\nprint(sum(1 for _ in range(10)), os.getpid())"))
        assert worker.checkpoints.problems == {}
        assert worker.runsc.flags[0] == "--platform=ptrace"
    finally:
        worker.close()
    assert (outcome.exit, outcome.backend, outcome.stdout.split()[0]) == (0, "gvisor:runsc-restore", "10"), outcome


@pytest.mark.parametrize("direction", ["old worker, new images", "new worker, old images"])
def test_a_checkpoint_of_the_other_runsc_is_refused_naming_both_versions(old_manifest, direction):
    manifest, binary = (CHECKPOINTS / "manifest.json", OLD) if direction.startswith("old") else (old_manifest, "runsc")
    worker = Worker(WorkerConfig.in_temp(manifest, warm={}, runsc=binary)).start()
    try:
        problem = worker.checkpoints.problems["*"]
        assert worker.checkpoints.usable == {}
    finally:
        worker.close()
    assert features(OLD).version in problem and features("runsc").version in problem, problem
