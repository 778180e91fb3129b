"""The sync modules are what scripts/unasync.py makes from their async source, and the check catches drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATOR = REPO / "scripts" / "unasync.py"
PACKAGE = REPO / "client" / "src" / "readie"


def check(package: Path = PACKAGE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GENERATOR), "--check", "--package", str(package)],
        capture_output=True, text=True, timeout=60,
    )


def test_the_committed_sync_session_is_generated_from_the_async_one():
    completed = check()
    assert completed.returncode == 0, completed.stderr


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    for name in ("_async_session.py", "_session.py"):
        shutil.copy(PACKAGE / name, tmp_path / name)
    return tmp_path


def test_the_check_fails_on_a_hand_edit_of_the_generated_module(copy: Path):
    generated = copy / "_session.py"
    generated.write_text(generated.read_text().replace("self.last_step = 0", "self.last_step = 1"))
    completed = check(copy)
    assert completed.returncode == 1
    assert "-        self.last_step = 1" in completed.stderr and "+        self.last_step = 0" in completed.stderr


def test_the_check_fails_on_a_source_change_not_regenerated(copy: Path):
    source = copy / "_async_session.py"
    source.write_text(source.read_text().replace("async def hibernate(self)", "async def hibernate_now(self)"))
    completed = check(copy)
    assert completed.returncode == 1
    assert "+    def hibernate_now(self) -> int:" in completed.stderr
