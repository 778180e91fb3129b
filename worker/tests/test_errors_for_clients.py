"""What a client reads of a failure carries no host facts (issue 27): no host path, command line
or host pid. They go to the worker's log next to the session's or job's id, which the client's
error names. Here with a runsc stand-in; tests/test_hibernate_runsc.py has the real thing."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from readie_worker.errors import (
    ExecutorTimeout, PoolWorkerError, SandboxSetupError, bound_ids, for_client, host_failure, internal_error, mapped_errors,
)
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


def test_a_host_failure_names_what_failed_and_of_a_file_only_the_reason(tmp_path):
    missing = tmp_path / "host-only" / "file"
    with pytest.raises(SandboxSetupError) as failed, host_failure(SandboxSetupError, "cannot read the grant"):
        missing.read_text()
    assert str(failed.value) == "cannot read the grant: No such file or directory"
    assert failed.value.__cause__ is None and failed.value.__suppress_context__  # the path stays out


def test_a_host_failure_keeps_a_socket_errors_text_and_leaves_other_errors_alone():
    with pytest.raises(PoolWorkerError, match=r"^cannot connect: \[Errno 111\] Connection refused$"):
        with host_failure(PoolWorkerError, "cannot connect"):
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    with pytest.raises(KeyError), host_failure(PoolWorkerError, "cannot connect"):
        raise KeyError("not the host's")


def test_a_command_that_timed_out_is_told_without_its_command_line():
    with pytest.raises(SandboxSetupError, match=r"^cannot run runsc: timed out after 10 s$"):
        with host_failure(SandboxSetupError, "cannot run runsc", caught=(OSError, subprocess.TimeoutExpired)):
            raise subprocess.TimeoutExpired(["/opt/host-only/runsc", "flags"], 10)


def test_mapped_errors_takes_the_first_entry_that_matches():
    table = {TimeoutError: lambda _: ExecutorTimeout("late"), OSError: lambda exc: PoolWorkerError(f"broken: {exc}")}
    with pytest.raises(ExecutorTimeout, match="^late$"), mapped_errors(table):
        raise TimeoutError  # an OSError too: the more specific entry is first
    with pytest.raises(PoolWorkerError, match="^broken: gone$"), mapped_errors(table):
        raise OSError("gone")
