"""The operator's credential files are read as regular files only: a FIFO or a device named by
mistake (or planted) is refused at once instead of hanging the server's start (issue 27)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from readie_rpc.security import SecurityError, read_token


def test_a_token_file_is_read_and_stripped(tmp_path):
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    assert read_token(path) == "s3cret-token"


@pytest.mark.timeout(10)
def test_a_fifo_as_the_token_file_is_refused_without_waiting(tmp_path):
    path = tmp_path / "token"
    os.mkfifo(path)  # no writer: an open for reading would wait for ever
    with pytest.raises(SecurityError, match="not a regular file"):
        read_token(path)


def test_a_device_that_never_ends_is_refused(tmp_path):
    with pytest.raises(SecurityError, match="not a regular file"):
        read_token(Path("/dev/zero"))
