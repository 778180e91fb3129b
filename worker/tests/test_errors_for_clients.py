"""What a client reads of a failure carries no host facts (issue 27): no host path, command line
or host pid. They go to the worker's log next to the session's or job's id, which the client's
error names. Here with a runsc stand-in; tests/test_hibernate_runsc.py has the real thing."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from readie_worker.errors import bound_ids, for_client, internal_error
from readie_worker.runsc import Runsc, RunscError

# What runsc's stderr holds when a checkpoint fails: host paths and a host pid.
RUNSC_SAYS = "W1203 12345 checkpoint.go:99] cannot write /var/lib/host-only/pages.img (sandbox pid 4242)"


def stand_in(tmp_path: Path) -> Runsc:
    """A runsc that fails every command the way runsc does, on stderr."""
    binary = tmp_path / "runsc"
    binary.write_text(f"#!/bin/sh\necho '{RUNSC_SAYS}' >&2\nexit 128\n")
    binary.chmod(0o755)
    return Runsc(root=tmp_path / "root", binary=str(binary), flags=("--platform=systrap",), checkpoint_flags=())


def test_a_failed_runsc_command_tells_the_client_where_and_the_log_what(tmp_path):
    runsc = stand_in(tmp_path)
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs, bound_ids(session="ws-1", job_id="j1"):
        with pytest.raises(RunscError) as failed:
            runsc.checkpoint("rd-0123", tmp_path / "images" / "0a1b")
    message = str(failed.value)
    assert message == "sandbox checkpoint exited 128; the worker's log has the details under session ws-1 and job j1"
    [line] = [line for line in logs if line["event"] == "runsc failed"]
    assert (line["session"], line["job_id"], line["exit"], line["stderr"]) == ("ws-1", "j1", 128, RUNSC_SAYS)
    assert f"--image-path={tmp_path / 'images' / '0a1b'}" in line["command"]
    assert failed.value.stderr.strip() == RUNSC_SAYS  # kept on the error, for the worker's own use


def test_a_failure_expected_by_its_caller_is_logged_quietly_and_without_ids_says_only_where(tmp_path):
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        with pytest.raises(RunscError) as failed:
            stand_in(tmp_path).run("kill", "rd-0123", "KILL", counted=False)
    assert str(failed.value) == "sandbox kill exited 128; the worker's log has the details"
    assert [line["log_level"] for line in logs if line["event"] == "runsc failed"] == ["debug"]


def test_an_os_error_shows_a_client_its_reason_and_logs_its_file(tmp_path):
    missing = tmp_path / "host-only" / "file"
    try:
        missing.read_text()
    except OSError as exc:
        error = exc
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs, bound_ids(session="ws-2"):
        text = for_client(error)
    assert text == "No such file or directory; the worker's log has the details under session ws-2"
    assert str(missing) in logs[0]["error"] and logs[0]["session"] == "ws-2"


def test_a_bug_shows_a_client_its_type_only():
    assert str(internal_error(KeyError("/etc/shadow"))) == "internal error (KeyError)"
