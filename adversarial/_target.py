"""The attacker's suite: jobs written to get out, run through the real ``readie pool`` under gVisor.

Its fixtures, which each test module imports (a conftest.py here would
shadow the root one that other packages' tests import). Every case must end
in a typed error or a harmless success, and after every case (checked by
the ``unharmed`` fixture, not in the tests):

* the host's canary files, outside every grant, are byte for byte what they were;
* the pool still serves a plain job;
* no sandbox outlives its job: the pool's run dir and runsc state dir settle
  back to the warm sandboxes it keeps.

At the end of each module the pool is closed with EOF, must exit 0, and
must leave no runsc container, no sandbox dir and no state dir behind.
The threat model these cases attack is docs/security.md.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from readie_pool.testing import PoolProcess
from readie_worker.paths import remove_tree
from readie_worker.state_dir import RUN
from readie_worker.testing import runsc_in, wait_until

WORKERS = 2
# The ceiling every module's pool runs under: a job reads data/ and writes
# out/, nothing else of the host; memory, time, output and files bounded.
CONFIG = """
[pool]
workers = 2

[pool.limits]
allow_read = ["data"]
allow_write = ["out"]
allow_network = false
timeout = "20s"
memory = "512m"
max_output = 1048576
max_file_size = "16m"
"""
# The error types of the pool spec, and the exceptions a refused attack raises in Python.
TYPED = {
    "RequestError",
    "TimeoutError",
    "SandboxSetupError",
    "PoolWorkerError",
    "MemoryError",
    "PermissionError",
    "OSError",
    "FileNotFoundError",
    "NotADirectoryError",
    "RuntimeError",
    "ConnectionRefusedError",
    "ConnectionError",
    "BlockingIOError",
    "HostError",
}
SETTLE_S = 20.0


class Target:
    """One ``readie pool`` in a project dir, with host canaries beside it (outside its ceiling)."""

    def __init__(self, base: Path, checkpoints: Path) -> None:
        self.base = base
        self.project = base / "project"
        self.data = self.project / "data"
        self.out = self.project / "out"
        self.host = base / "host"
        for directory in (self.data, self.out, self.host / "canary-dir"):
            directory.mkdir(parents=True)
        (self.project / "readie.toml").write_text(CONFIG)
        (self.data / "orders.csv").write_text("product,amount\ntea,3\ncake,5\n")
        (self.data / "other.txt").write_text("not granted when a single file is\n")
        self.canary = "canary-" + os.urandom(8).hex()
        (self.host / "canary.txt").write_text(self.canary + "\n")
        (self.host / "canary-dir" / "canary.txt").write_text(self.canary + "\n")
        self.state = base / "state"
        self.pool = PoolProcess(
            ["--config", "readie.toml", "--checkpoints", str(checkpoints), "--state-dir", str(self.state)],
            cwd=self.project,
            stderr_path=base / "pool.log",
        )
        self.ready = self.pool.ready()
        self.scratch = self.state  # all the pool keeps on the host (readie_worker.state_dir)
        self.run_dir = self.state / RUN
        self._ids = 0

    # -- jobs

    def request_id(self) -> str:
        self._ids += 1
        return f"a{self._ids}"

    def run(self, wait: float = 60, **request: Any) -> dict[str, Any]:
        """Send one request (an id is added) and return its answer within ``wait`` seconds;
        nothing else may be in flight."""
        request.setdefault("id", self.request_id())
        answer = self.pool.run(request, wait)
        assert answer.get("id") == request["id"], answer
        return answer

    def attack(self, code: str, wait: float = 60, **fields: Any) -> dict[str, Any]:
        """Run attack code; its answer must be a harmless success or a typed error."""
        result = self.run(wait, code=code, **fields)
        assert_contained(result)
        assert self.canary not in result["stdout"] + result["stderr"] + str(result["error"])
        return result

    # -- what must hold after every attack

    def host_digest(self) -> str:
        digest = hashlib.sha256()
        for root in (self.host, self.data):
            for path in sorted(root.rglob("*")):
                info = path.lstat()
                digest.update(f"{path}:{info.st_mode}:{info.st_size}\n".encode())
                if path.is_file() and not path.is_symlink():
                    digest.update(path.read_bytes())
        return digest.hexdigest()

    def sandbox_dirs(self) -> list[str]:
        return sorted(os.listdir(self.run_dir)) if self.run_dir.exists() else []

    def containers(self) -> list[str]:
        return runsc_in(self.state).list_ids()

    def settled(self) -> bool:
        """Only the warm sandboxes remain (used ones are destroyed after their answer)."""
        return len(self.sandbox_dirs()) <= WORKERS and len(self.containers()) <= WORKERS

    def serving(self) -> None:
        result = self.run(code="print('still serving')")
        assert (result["exit"], result["stdout"]) == (0, "still serving\n"), result

    def close(self) -> None:
        status = self.pool.close(timeout=60)
        leftovers = self.containers()
        runsc_processes = _processes_naming(str(self.state))
        runsc_in(self.state).sweep()
        assert status == 0, self.pool.stderr_text()[-3000:]
        assert leftovers == [], f"runsc containers left: {leftovers}"
        assert not self.scratch.exists(), f"the pool left its state dir: {os.listdir(self.scratch)}"
        assert runsc_processes == [], runsc_processes


def assert_contained(result: dict[str, Any]) -> None:
    """A harmless success (the job ran and answered) or a typed error; never an untyped failure."""
    error = result.get("error")
    if error is None:
        return
    assert error["type"] in TYPED, result
    if error["type"] == "PoolWorkerError" and "internal error" in error["message"]:
        raise AssertionError(f"a bug, not a refusal: {result}")


def _processes_naming(text: str) -> list[str]:
    listing = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in listing.splitlines() if text in line and "ps -eo" not in line]


@pytest.fixture(scope="module")
def target(checkpoints, checkpoint_dir: Path) -> Iterator[Target]:  # checkpoints: fails loudly when stale
    base = Path(tempfile.mkdtemp(prefix="rav-", dir="/tmp"))
    made = Target(base, checkpoint_dir)
    try:
        yield made
        made.close()
    finally:
        made.pool.stop()
        remove_tree(base)


@pytest.fixture(autouse=True)
def unharmed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Around every test that attacks the module's pool: canaries, service and clean-up hold."""
    if "target" not in request.fixturenames:
        yield
        return
    target: Target = request.getfixturevalue("target")
    before = target.host_digest()
    yield
    assert target.host_digest() == before, "a host file outside every grant changed"
    target.serving()
    assert wait_until(target.settled, SETTLE_S), (
        f"sandboxes outlived their jobs: dirs {target.sandbox_dirs()}, containers {target.containers()}"
    )
    for path in target.out.iterdir():  # each attack starts from an empty write grant
        assert remove_tree(path)
