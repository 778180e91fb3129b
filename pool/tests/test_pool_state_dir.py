"""``readie pool``'s state dir is its own (issue 27, holes 2 and 3; decision 0025), through the
real command: another local user's planted paths are refused or never used, and the default
leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from readie_pool.testing import PoolProcess
from readie_worker.state_dir import IMAGES, RUN, RUNSC, RUNTIME_ROOT, STORE
from readie_worker.testing import readie_command, runsc_in

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc

# Stands for another local user (the tests run as root, which may chown to it).
OTHER_UID = 4242
# A refused start reads the manifest and stops: seconds, on a loaded machine.
REFUSAL_TIMEOUT_S = 60
EXIT_USAGE = 2


@pytest.fixture
def base() -> Iterator[Path]:
    """A short dir (socket paths live beneath the state dir) holding a victim's files."""
    made = Path(tempfile.mkdtemp(prefix="rsd-", dir="/tmp"))
    (made / "victim" / RUNSC).mkdir(parents=True)
    (made / "victim" / "precious.txt").write_text("another user's\n")
    (made / "victim" / RUNSC / "also-precious").write_text("theirs too\n")
    yield made
    shutil.rmtree(made, ignore_errors=True)


def tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(path.relative_to(root)): path.read_bytes() if path.is_file() and not path.is_symlink() else None
        for path in sorted(root.rglob("*"))
    }


def pool(base: Path, *args: str) -> PoolProcess:
    return PoolProcess(
        ["--checkpoints", str(CHECKPOINTS), "--workers=1", "--log=json", *args],
        cwd=base, stderr_path=base / "stderr.log", env={"READIE_STATE_DIR": ""},
    )


def planted_link(state: Path) -> None:
    state.symlink_to(state.parent / "victim")


def group_writable(state: Path) -> None:
    state.mkdir()
    (state / "theirs").write_text("x")
    state.chmod(0o770)


def others_writable(state: Path) -> None:
    state.mkdir()
    (state / "theirs").write_text("x")
    state.chmod(0o703)


def another_users(state: Path) -> None:
    state.mkdir(mode=0o700)
    (state / "theirs").write_text("x")
    os.chown(state, OTHER_UID, -1)


@pytest.mark.parametrize(
    ("plant", "reason"),
    [
        (planted_link, "is a symbolic link"),
        (group_writable, "writable by its group or others"),
        (others_writable, "writable by its group or others"),
        (another_users, f"belongs to uid {OTHER_UID}"),
    ],
)
@pytest.mark.parametrize("command", ["pool", "worker"])
def test_a_state_dir_not_readie_s_own_is_refused_with_exit_2_and_left_as_it_was(
    base: Path, command: str, plant: Callable[[Path], None], reason: str, checkpoints
):
    state = base / "state"
    plant(state)
    before = tree(base)
    completed = subprocess.run(
        [*readie_command(), command, "--checkpoints", str(CHECKPOINTS), f"--state-dir={state}", "--log=json"],
        cwd=base, stdin=subprocess.DEVNULL, capture_output=True, timeout=REFUSAL_TIMEOUT_S,
        env={**os.environ, "READIE_STATE_DIR": ""},
    )
    stderr = completed.stderr.decode(errors="replace")
    assert completed.returncode == EXIT_USAGE, stderr
    assert f"{state}: " in stderr and reason in stderr, stderr
    assert completed.stdout == b""  # no ready event
    assert tree(base) == before  # the victim's files, and the planted dir's, untouched
    assert "Traceback" not in stderr


def test_a_planted_images_sibling_is_never_used(base: Path, checkpoints):
    """Hole 2: the pool used to keep its images in ``<state>-hibernated`` beside its state dir,
    and empty it at start and exit; a link planted there deleted through it. Now every image is
    beneath the state dir, and a sibling named after it is nobody's business."""
    state = base / "state"
    (base / "state-hibernated").symlink_to(base / "victim")
    before = tree(base / "victim")
    running = pool(base, f"--state-dir={state}")
    try:
        running.ready()
        opened = running.run({"id": "s1", "session": "a", "code": "x = 41"})
        assert opened["exit"] == 0, opened
        hibernated = running.run({"id": "h1", "session": "a", "hibernate": True})
        assert hibernated.get("hibernated") is True, hibernated
        assert len([name for name in os.listdir(state / STORE) if not name.startswith(".")]) == 1  # its image, beneath the state dir
        resumed = running.run({"id": "s2", "session": "a", "code": "print(x + 1)"})
        assert resumed["stdout"] == "42\n", resumed
        assert running.close() == 0, running.stderr_text()[-3000:]
    finally:
        running.stop()
        runsc_in(state).sweep()
    assert tree(base / "victim") == before
    assert sorted(os.listdir(base)) == ["state-hibernated", "stderr.log", "victim"]  # the state dir it made: gone


def test_the_default_state_dir_is_per_user_0700_and_gone_at_exit(base: Path, checkpoints):
    before = set(os.listdir(RUNTIME_ROOT)) if RUNTIME_ROOT.is_dir() else set()
    running = pool(base)
    try:
        running.ready()
        state = Path(next(line for line in _log_lines(running) if line["event"] == "pool ready")["state_dir"])
        assert state.parent == Path(os.path.realpath(RUNTIME_ROOT)), state
        assert sorted(os.listdir(state)) == sorted([IMAGES, RUN, RUNSC, STORE])
        assert all(stat.S_IMODE(path.stat().st_mode) == 0o700 for path in (state.parent, state, *state.iterdir()))
        assert running.run({"id": "j1", "code": "print(1)"})["stdout"] == "1\n"
        assert running.close() == 0, running.stderr_text()[-3000:]
    finally:
        running.stop()
    assert not state.exists()
    assert set(os.listdir(RUNTIME_ROOT)) <= before
    assert sorted(os.listdir(base)) == ["stderr.log", "victim"]


def _log_lines(running: PoolProcess) -> list[dict]:
    return [json.loads(text) for text in running.stderr_text().splitlines() if text.startswith("{")]
