"""The development transport: refused unless enabled, and labelled wherever it shows."""

from __future__ import annotations

import pytest

from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import SandboxSetupError
from readie_worker.jobs import CodeJob


def test_a_worker_without_checkpoints_refuses_to_run_unisolated(tmp_path):
    with pytest.raises(SandboxSetupError, match="cannot start an isolated worker"):
        Worker(WorkerConfig.in_temp(tmp_path / "no-manifest.json")).start()


def test_unisolated_jobs_are_labelled_as_such(tmp_path):
    worker = Worker(WorkerConfig.in_temp(tmp_path / "no-manifest.json", allow_unisolated=True)).start()
    try:
        outcome = worker.run_job(CodeJob(checkpoint="base", code="print('on the host')"))
        assert (outcome.exit, outcome.stdout) == (0, "on the host\n"), outcome
        assert outcome.backend == "local-unisolated"
        assert worker.capacity().isolated is False
    finally:
        worker.close()
