"""``cgroups.freeze`` on this host's kernel, a plain process standing in for a sandbox's.

The runsc tests pause real sandboxes through the v1 freezer these hosts give them
(``test_idle_pause_runsc``, ``test_warm``); here both freezers are driven directly: v1's
``freezer.state`` and, through the cgroup2 hierarchy every systemd host mounts, v2's
``cgroup.freeze``, which a host with only cgroup v2 gives runsc's sandboxes.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from readie_worker import cgroups
from readie_worker import testing as worker_testing
from readie_worker.testing import stopped, wait_until


def _cgroup2_root() -> Path:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount, kind, *_ = line.split()
        if kind == "cgroup2":
            return Path(mount)
    raise AssertionError("no cgroup2 hierarchy is mounted")


def _in_cgroup(parent: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A ``sleep`` alone in a new cgroup under ``parent``; both gone afterwards, frozen or not."""
    name = "readie-test-" + secrets.token_hex(4)
    path = parent / name
    path.mkdir()
    process = subprocess.Popen(["sleep", "60"])
    try:
        (path / "cgroup.procs").write_text(str(process.pid))
        yield name, process
    finally:
        process.kill()
        cgroups.freeze(name, False)  # frozen in v1, not even a SIGKILL ends it
        process.wait(timeout=10)
        deadline = time.monotonic() + 5
        while True:
            try:
                path.rmdir()
                break
            except OSError:  # the dead process leaves its cgroup a moment later
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@pytest.fixture
def v1() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    if not os.path.ismount(cgroups.CGROUP_V1_FREEZER):
        pytest.skip("a host with cgroup v2 alone has no v1 freezer: test_v2's case")
    yield from _in_cgroup(cgroups.CGROUP_V1_FREEZER)


@pytest.fixture
def v2(monkeypatch, tmp_path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    root = _cgroup2_root()  # /sys/fs/cgroup itself on such a host; beneath it on a hybrid one, as here
    monkeypatch.setattr(cgroups, "CGROUP_V1_FREEZER", tmp_path / "no-v1")
    monkeypatch.setattr(cgroups, "CGROUP_V2", root)
    monkeypatch.setattr(worker_testing, "CGROUP_V2", root)
    yield from _in_cgroup(root)


@pytest.mark.parametrize("hierarchy", ["v1", "v2"])
def test_a_frozen_container_stops_and_a_thawed_one_runs_again(hierarchy, request):
    name, process = request.getfixturevalue(hierarchy)
    assert cgroups.freeze(name, True) is True
    assert wait_until(lambda: stopped(process.pid), timeout=5)
    assert cgroups.freeze(name, False) is True
    assert wait_until(lambda: not stopped(process.pid), timeout=5)
    assert process.poll() is None


def test_a_v1_frozen_process_dies_of_sigkill_only_once_thawed(v1):
    # Why Runsc.destroy thaws after its kill.
    name, process = v1
    assert cgroups.freeze(name, True) and wait_until(lambda: stopped(process.pid), timeout=5)
    os.kill(process.pid, signal.SIGKILL)
    time.sleep(0.3)
    assert process.poll() is None
    cgroups.freeze(name, False)
    assert process.wait(timeout=5) == -signal.SIGKILL


def test_a_container_without_a_freezer_cgroup_is_told_apart():
    # None, not False: the launcher then pauses the sentry with SIGSTOP instead.
    assert cgroups.freeze("readie-test-" + secrets.token_hex(4), True) is None
