"""Fixtures shared by every package's tests.

gVisor tests (marker ``runsc``) need runsc, root and the checkpoints from
``make capture``. Outside CI they are skipped with the reason when those are
missing; in CI (``CI`` set) a missing prerequisite is an error, never a skip,
so a green CI always means the sandboxes really ran.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from readie_pipeline.plan import load_plan
from readie_pipeline.rootfs import rootfs_fingerprint
from readie_worker import enter_mount_namespace
from readie_worker import runsc as runsc_module
from readie_worker.manifest import MANIFEST_NAME, LoadedCheckpoints, checkpoints_for, read_manifest
from readie_worker.runsc import Runsc

REPO = Path(__file__).resolve().parent
CHECKPOINTS = Path(os.environ.get("READIE_CHECKPOINTS", REPO / "build" / "checkpoints"))
#: Multiplies every fuzz target's example count: 1 in `make test` (bounded
#: time), e.g. READIE_FUZZ_SCALE=100 for a long run on demand (docs/security.md).
FUZZ_SCALE_VARIABLE = "READIE_FUZZ_SCALE"


def fuzz_examples(base: int) -> int:
    """A fuzz target's example count: ``base`` times $READIE_FUZZ_SCALE (default 1)."""
    return base * max(1, int(os.environ.get(FUZZ_SCALE_VARIABLE) or 1))

# Workers made in this process keep their sandboxes' mounts in a namespace of
# its own, entered while it is still single-threaded (readie_worker._mounts).
enter_mount_namespace()


def _missing_prerequisite() -> str | None:
    if not runsc_module.available():
        return "runsc is not installed or we are not root"
    if not (CHECKPOINTS / MANIFEST_NAME).exists():
        return f"no checkpoints at {CHECKPOINTS} (run make capture)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = _missing_prerequisite()
    if missing is None:
        return
    gvisor_tests = [item for item in items if "runsc" in item.keywords]
    if gvisor_tests and os.environ.get("CI"):
        raise pytest.UsageError(f"{len(gvisor_tests)} gVisor tests cannot run in CI: {missing}")
    for item in gvisor_tests:
        item.add_marker(pytest.mark.skip(reason=f"gVisor test: {missing}"))


@pytest.fixture(scope="session")
def runsc() -> Iterator[Runsc]:
    """A runsc state dir of the test session's own; it must be empty at the end."""
    root = Path(tempfile.mkdtemp(prefix="readie-test-state-"))
    client = Runsc(root=root)
    yield client
    leftovers = client.list_ids()
    client.sweep()
    shutil.rmtree(root, ignore_errors=True)
    assert leftovers == [], f"tests leaked runsc containers: {leftovers}"


@pytest.fixture(scope="session")
def checkpoints(runsc: Runsc) -> LoadedCheckpoints:
    manifest = read_manifest(CHECKPOINTS / MANIFEST_NAME)
    current = rootfs_fingerprint(load_plan())
    if manifest.rootfs_fingerprint != current:
        pytest.fail(
            f"checkpoints in {CHECKPOINTS} were captured from another rootfs (the executor or the plan "
            "changed since): run make capture (make test does)"
        )
    loaded = checkpoints_for(runsc, CHECKPOINTS / MANIFEST_NAME, strict=True)
    assert not loaded.problems, loaded.problems
    return loaded


@pytest.fixture(scope="session")
def checkpoint_dir() -> Path:
    """Where ``make capture`` put the checkpoints (for fixtures, which cannot import this module)."""
    return CHECKPOINTS


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir short enough for Unix socket paths (107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def new_session_store(base: Path) -> tuple[Path, Path]:
    """A session store's directory (not made yet: a worker makes it) and its key file under
    ``base``, as an operator gives both to every worker sharing it (decision 32): a 0600 file of
    32 random bytes, made 0600 before a byte of the key is in it."""
    store, key = base / "store", base / "store.key"
    key.touch(mode=0o600)
    key.write_bytes(os.urandom(32))
    return store, key


def two_workers_of_one_store(start_one, start_two, store: Path) -> Iterator[tuple]:
    """Two started workers sharing ``store`` for a test module (each restore costs a second):
    closed after it, with no container left and, every session closed, no entry in the store."""
    one = start_one()
    try:
        two = start_two()
    except BaseException:
        one.close()
        raise
    yield one, two
    for worker in (one, two):
        worker.close()
        assert worker.runsc.list_ids() == []
    assert [name for name in os.listdir(store) if not name.startswith(".")] == [], "every session closed: no entry left"
