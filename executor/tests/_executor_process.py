"""What the ``test_executor_process_*`` modules share: a real executor, and functions to send it.

``executor`` is one real executor (``python -u -m readie_executor``) per test
module, over a real Unix socket; ``assert_answers_fresh_connection`` proves
the same process still answers a fresh connection. The functions here are
sent to it by value, like the test modules' own. Each test module imports
the fixtures it uses.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest

from readie_executor.testing import ExecutorProcess, short_tempdir, start_executor

# The executor cannot import this module, so its functions must travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def executor() -> Iterator[ExecutorProcess]:
    with short_tempdir() as directory, start_executor(directory) as running:
        yield running


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with short_tempdir() as directory:
        yield directory


def assert_answers_fresh_connection(executor: ExecutorProcess) -> None:
    # The pid proves it is the same process, not merely a socket that still accepts.
    assert executor.process.poll() is None, executor.stderr_text()
    assert executor.call(os.getpid) == {"ok": True, "value": executor.pid, "output": []}


def add(a: int, b: int, *, c: int = 0) -> int:
    return a + b + c


def environ() -> dict[str, str]:
    return dict(os.environ)


def framed(payload: bytes) -> bytes:
    """One message in a single chunk, framed by hand rather than by the code under test."""
    return struct.pack(">Q", len(payload)) + payload + bytes(8)
