"""Proto <-> readie values, and readie errors -> gRPC status: pure, no server, no sandbox."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from readie_rpc import _client_wire, _convert
from readie_rpc._convert import ANSWER_MARGIN_MS, call_payload, capacity_response, code_job, run_job_response, timeout_ms
from readie_protocol.events import ErrorInfo
from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._status import DeadlineExpired, ResponseTooLarge, WorkerLost, grpc_errors, readie_errors, status_for
from readie_worker.core import Worker, WorkerConfig
from readie_policy.egress import Egress, parse_destinations
from readie_policy.jobs import Capacity
from readie_worker.errors import CheckpointUnusable, ManifestError, PoolWorkerError, ReadieError, RequestError, SandboxSetupError
from readie_worker.jobs import CodeJob, JobOutcome
from readie_policy.config import NETWORK_MAX_TIMEOUT_MS, Config
from readie_policy.policy import DEFAULT_MAX_OUTPUT, DEFAULT_TIMEOUT_MS, Limits
from readie_protocol.requests import MAX_TIMEOUT_MS
from readie_worker.runsc import RunscError
from readie_protocol.errors import ExecutorTimeout

MiB = 1024 * 1024


def test_every_field_of_a_request_reaches_the_job():
    request = pb.RunJobRequest(
        checkpoint="pandas",
        code="print(1)",
        name="step.py",
        args=["--fast", "x"],
        env={"KEY": "value", "EMPTY": ""},
        cwd="/data",
        allow_read=["/srv/in"],
        allow_write=["/srv/out"],
        package_dirs=["/opt/pkgs"],
        packages=["six==1.16.0"],
        network=True,
        timeout_ms=5000,
        memory_bytes=256 * MiB,
        max_output=4096,
        max_file_size=MiB,
    )
    assert code_job(request, None) == CodeJob(
        checkpoint="pandas",
        code="print(1)",
        name="step.py",
        args=("--fast", "x"),
        env={"KEY": "value", "EMPTY": ""},
        cwd="/data",
        allow_read=("/srv/in",),
        allow_write=("/srv/out",),
        package_dirs=("/opt/pkgs",),
        packages=("six==1.16.0",),
        network=True,
        egress=Egress(public=True),
        timeout_ms=5000,
        memory_bytes=256 * MiB,
        max_output=4096,
        max_file_size=MiB,
    )


def test_network_destinations_reach_the_job_and_go_back_on_the_wire():
    request = pb.RunJobRequest(checkpoint="base", code="pass", network=True,
                               network_destinations=["API.example.com:443", "[2001:db8::1]:443"])
    job = code_job(request, None)
    assert job.network and job.egress is not None and not job.egress.public
    sent = _client_wire.run_job_request(job)
    assert (sent.network, list(sent.network_destinations)) == (True, ["api.example.com:443", "[2001:db8::1]:443"])
    assert code_job(sent, None) == job
    older = code_job(pb.RunJobRequest(checkpoint="base", code="pass", network=True), None)
    assert older.egress == Egress(public=True) and list(_client_wire.run_job_request(older).network_destinations) == []


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"network_destinations": ["api.example.com"]}, "network_destinations", "destinations without network = true"),
    ({"network": True, "network_destinations": ["10.0.0.1/8"]}, "allow_network", "has host bits set"),
    ({"network": True, "network_destinations": ["a.example.com"] * 65}, "allow_network", "at most 64"),
])
def test_bad_network_destinations_are_refused(fields, field, message):
    with pytest.raises(RequestError, match=message) as refused:
        code_job(pb.RunJobRequest(checkpoint="base", code="pass", **fields), None)
    assert refused.value.field == field


def test_a_worker_ceiling_list_bounds_the_destinations():
    limits = Limits(allow_network=parse_destinations(["*.example.com:443"]))
    ok = pb.RunJobRequest(checkpoint="base", code="pass", network=True, network_destinations=["a.example.com:443"])
    assert code_job(ok, None, limits).egress is not None
    older = code_job(pb.RunJobRequest(checkpoint="base", code="pass", network=True), None, limits)
    assert older.egress is not None and older.egress.destinations == limits.allow_network
    wide = pb.RunJobRequest(checkpoint="base", code="pass", network=True, network_destinations=["a.example.com"])
    with pytest.raises(RequestError, match="not within"):
        code_job(wide, None, limits)


def test_unset_fields_take_the_job_defaults():
    job = code_job(pb.RunJobRequest(checkpoint="base", code="pass"), None)
    assert job == CodeJob(checkpoint="base", code="pass")
    assert (job.name, job.cwd, job.timeout_ms, job.max_output) == ("<string>", "/tmp", DEFAULT_TIMEOUT_MS, DEFAULT_MAX_OUTPUT)
    assert (job.memory_bytes, job.max_file_size) == (None, None)


def test_zero_max_output_is_kept_not_taken_for_unset():
    assert code_job(pb.RunJobRequest(checkpoint="base", code="pass", max_output=0), None).max_output == 0


# (what to set, the field the refusal must name)
BAD_REQUESTS = [
    ({"checkpoint": ""}, "checkpoint"),
    ({"checkpoint": "x" * (_convert.MAX_CHECKPOINT_NAME + 1)}, "checkpoint"),
    ({"checkpoint": "ba\0se"}, "checkpoint"),
    ({"code": "print(1)\0"}, "code"),
    ({"code": "#" * (_convert.MAX_CODE_CHARS + 1)}, "code"),
    ({"name": "step\0.py"}, "name"),
    ({"args": ["ok", "b\0d"]}, "args[1]"),
    ({"args": ["x"] * (_convert.MAX_ARGS + 1)}, "args"),
    ({"args": ["x" * (_convert.MAX_ARG_CHARS + 1)]}, "args[0]"),
    ({"args": ["x" * _convert.MAX_ARG_CHARS] * 17}, "args"),
    ({"env": {"": "v"}}, "env"),
    ({"env": {"A=B": "v"}}, "env"),
    ({"env": {"A\0": "v"}}, "env"),
    ({"env": {"A": "v\0"}}, "env['A']"),
    ({"env": {f"K{i}": "v" for i in range(_convert.MAX_ENV_VARS + 1)}}, "env"),
    ({"env": {f"K{i}": "x" * _convert.MAX_ARG_CHARS for i in range(17)}}, "env"),
    ({"cwd": "relative/dir"}, "cwd"),
    ({"cwd": ""}, "cwd"),
    ({"cwd": "/tmp\0"}, "cwd"),
    ({"allow_read": ["/srv\0/in"]}, "allow_read"),
    ({"allow_write": ["/" + "x" * _convert.MAX_PATH_CHARS]}, "allow_write"),
    ({"package_dirs": ["/p"] * (_convert.MAX_GRANTS + 1)}, "package_dirs"),
    ({"packages": ["https://example.invalid/evil.whl"]}, "packages"),
    ({"timeout_ms": -1}, "timeout_ms"),
    ({"timeout_ms": 0}, "timeout_ms"),
    ({"timeout_ms": MAX_TIMEOUT_MS + 1}, "timeout_ms"),
    ({"memory_bytes": -5}, "memory_bytes"),
    ({"memory_bytes": 0}, "memory_bytes"),
    ({"memory_bytes": 2**62}, "memory_bytes"),
    ({"max_output": -1}, "max_output"),
    ({"max_output": 16 * MiB + 1}, "max_output"),
    ({"max_file_size": 0}, "max_file_size"),
    ({"max_file_size": 2**63 - 1}, "max_file_size"),
]


@pytest.mark.parametrize(("fields", "field"), BAD_REQUESTS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_REQUESTS)])
def test_a_bad_value_is_a_request_error_naming_its_field(fields, field):
    request = pb.RunJobRequest(**{"checkpoint": "base", "code": "pass", **fields})
    with pytest.raises(RequestError) as refused:
        code_job(request, None)
    assert refused.value.field == field
    assert str(refused.value).startswith(f"{field}: ")
    assert len(str(refused.value)) < 400, "a refusal must not echo a huge value back"


@pytest.mark.parametrize(
    ("requested", "remaining_s", "expected"),
    [
        (None, None, DEFAULT_TIMEOUT_MS),
        (5000, None, 5000),
        # The caller's deadline is sooner: it wins, less the time kept for the answer.
        (60_000, 2.5, 2500 - ANSWER_MARGIN_MS),
        (1000, 10.0, 1000),  # the job's own timeout is sooner
        (None, 3.0, 3000 - ANSWER_MARGIN_MS),
    ],
)
def test_the_timeout_is_the_shorter_of_the_request_and_the_deadline(requested, remaining_s, expected):
    request = pb.ExecuteRequest(checkpoint="base", payload=b"x")
    if requested is not None:
        request.timeout_ms = requested
    assert timeout_ms(request, remaining_s) == expected


def test_a_timeout_is_bounded_as_on_the_pool_protocol_and_held_to_the_network_ceiling():
    """One bound for every timeout (MAX_TIMEOUT_MS, the JSONL parser's too); the network's hour
    is the ceiling's, which an operator's [pool.limits] timeout replaces."""
    network, operator = Config().network_limits, Limits(allow_read=(), allow_write=(), timeout_ms=2 * NETWORK_MAX_TIMEOUT_MS)
    over_an_hour = pb.RunJobRequest(checkpoint="base", code="pass", timeout_ms=NETWORK_MAX_TIMEOUT_MS + 1)
    with pytest.raises(RequestError, match="exceeds the pool's") as refused:
        code_job(over_an_hour, None, network)
    assert refused.value.field == "timeout"  # timeout_ms on the wire (_status)
    assert code_job(over_an_hour, None, operator).timeout_ms == NETWORK_MAX_TIMEOUT_MS + 1
    # A remote call has no policy to refuse against: its timeout is cut to the ceiling, as a
    # deadline cuts it, so a client's default 30 s still runs on a worker whose ceiling is 10 s.
    call = pb.ExecuteRequest(checkpoint="base", payload=b"x", timeout_ms=NETWORK_MAX_TIMEOUT_MS + 1)
    assert timeout_ms(call, None, network) == NETWORK_MAX_TIMEOUT_MS
    assert timeout_ms(call, None, operator) == NETWORK_MAX_TIMEOUT_MS + 1
    assert timeout_ms(pb.ExecuteRequest(checkpoint="base", payload=b"x"), None, Limits(timeout_ms=1000)) == 1000
    assert timeout_ms(pb.ExecuteRequest(checkpoint="base", payload=b"x", timeout_ms=30_000), None, Limits(timeout_ms=10_000)) == 10_000
    with pytest.raises(RequestError, match="too large|between"):
        timeout_ms(pb.ExecuteRequest(checkpoint="base", payload=b"x", timeout_ms=MAX_TIMEOUT_MS + 1), None)


@pytest.mark.parametrize("remaining_s", [0.0004, ANSWER_MARGIN_MS / 1000])
def test_a_deadline_that_leaves_no_time_to_answer_is_deadline_expired(remaining_s):
    with pytest.raises(DeadlineExpired):
        timeout_ms(pb.ExecuteRequest(checkpoint="base", payload=b"x"), remaining_s)


def test_a_call_payload_must_be_present_and_within_the_limit(monkeypatch):
    assert call_payload(pb.ExecuteRequest(payload=b"pickled")) == b"pickled"
    with pytest.raises(RequestError) as empty:
        call_payload(pb.ExecuteRequest())
    assert empty.value.field == "payload"
    monkeypatch.setattr(_convert, "MAX_CALL_PAYLOAD_BYTES", 8)
    with pytest.raises(RequestError) as large:
        call_payload(pb.ExecuteRequest(payload=b"123456789"))
    assert large.value.field == "payload" and "at most 8" in str(large.value)


def test_a_finished_job_becomes_a_response_with_every_field():
    outcome = JobOutcome(0, "out\n", "err\n", True, False, None, 1234, "3.11.2", ("pandas", "numpy"), "rd-abc", "gvisor:runsc-restore")
    response = run_job_response(outcome)
    assert response == pb.RunJobResponse(
        exit=0,
        stdout="out\n",
        stderr="err\n",
        stdout_truncated=True,
        stderr_truncated=False,
        duration_us=1234,
        python="3.11.2",
        preloaded_modules=["pandas", "numpy"],
        sandbox_id="rd-abc",
        backend="gvisor:runsc-restore",
    )
    assert response.HasField("exit") and not response.HasField("error")


def test_a_job_that_did_not_end_on_its_own_has_no_exit_and_its_error():
    outcome = JobOutcome.failure("TimeoutError", "job exceeded its timeout of 10 ms", 99, "gvisor:runsc-restore", "rd-x")
    response = run_job_response(outcome)
    assert not response.HasField("exit")
    assert response.error == pb.JobError(type="TimeoutError", message="job exceeded its timeout of 10 ms")
    assert not (response.error.HasField("file") or response.error.HasField("line") or response.error.HasField("hint"))
    no_sandbox = run_job_response(JobOutcome.failure("SandboxSetupError", "restore failed", 5, "gvisor"))
    assert not no_sandbox.HasField("sandbox_id")


def test_a_job_error_keeps_file_line_and_hint():
    error = ErrorInfo("PermissionError", "denied", "step.py", 3, "granted: /srv/out")
    outcome = JobOutcome(1, "", "tb", False, False, error, 7, "3.11.2", (), "rd-y", "gvisor:runsc-restore")
    assert run_job_response(outcome).error == pb.JobError(type="PermissionError", message="denied", file="step.py", line=3, hint="granted: /srv/out")


@pytest.mark.parametrize(
    "answer",
    [
        {"stdout": "x" * (16 * 1024 * 1024 + 1)},
        {"stderr": "\x01" * (16 * 1024 * 1024 + 1)},
        {"error": pb.JobError(type="E", message="m" * 4097)},
        {"error": pb.JobError(type="T" * 101, message="m")},
        {"preloaded_modules": ["m"] * 257},
    ],
    ids=["stdout", "stderr", "error-message", "error-type", "modules"],
)
def test_a_worker_answer_past_what_a_sandbox_writes_is_a_worker_error(answer):
    """A broken or hostile worker behind a router: nothing past the sandbox's bounds is passed on."""
    with pytest.raises(PoolWorkerError, match="the worker answered"):
        _client_wire.job_outcome(pb.RunJobResponse(exit=0, **answer), CodeJob("base", "x"))
    honest = {key: value[:1] if isinstance(value, (str, list)) else pb.JobError(type="E", message="m") for key, value in answer.items()}
    assert _client_wire.job_outcome(pb.RunJobResponse(exit=0, **honest), CodeJob("base", "x")).exit == 0


def test_capacity_becomes_a_response_with_pools_and_protocol():
    capacity = Capacity(slots=2, busy=1, draining=False, warm={"base": {"ready": 1, "target": 2}}, isolated=True)
    assert capacity_response(capacity, "w1", 7) == pb.CapacityResponse(
        slots=2, busy=1, draining=False, isolated=True, pools={"base": pb.PoolState(ready=1, target=2)}, worker_name="w1", protocol=7
    )


# (error, status code)
STATUS_CASES = [
    (RequestError("no checkpoint named 'x'", field="checkpoint"), grpc.StatusCode.INVALID_ARGUMENT),
    (RequestError("bad request"), grpc.StatusCode.INVALID_ARGUMENT),
    (DeadlineExpired("too late"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (ExecutorTimeout("no response within 1 s"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (SandboxSetupError("the worker is draining and takes no new work"), grpc.StatusCode.UNAVAILABLE),
    (RunscError(["restore"], 1, "boom"), grpc.StatusCode.UNAVAILABLE),
    (ManifestError("bad manifest"), grpc.StatusCode.UNAVAILABLE),
    (CheckpointUnusable("image missing"), grpc.StatusCode.UNAVAILABLE),
    (ResponseTooLarge("envelope too large"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PoolWorkerError("sandbox closed the connection"), grpc.StatusCode.INTERNAL),
    (ReadieError("something of readie's own"), grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize(("error", "code"), STATUS_CASES, ids=[type(e).__name__ + str(i) for i, (e, _) in enumerate(STATUS_CASES)])
def test_each_readie_error_has_one_status(error, code):
    status = status_for(error)
    assert status.code == code
    assert status.details == str(error)
    assert ("readie-error", type(error).__name__) in status.metadata


def test_a_request_error_names_its_field_in_details_and_metadata():
    status = status_for(RequestError("3 paths asked for, but sandboxes have 2 such slots", field="allow_read"))
    assert status.details.startswith("allow_read: ")
    assert ("readie-field", "allow_read") in status.metadata
    assert not any(key == "readie-field" for key, _ in status_for(RequestError("no field")).metadata)


def test_a_field_named_by_the_request_s_own_text_reaches_the_metadata_as_printable_ascii():
    """gRPC metadata is printable ASCII: a raw env name there ended the call INTERNAL (fuzzing found it)."""
    status = status_for(RequestError("contains a NUL character", field="env['¡\x7f%']"))
    field = dict(status.metadata)["readie-field"]
    assert field == "env['%C2%A1%7F%25']" and all(" " <= char <= "~" for char in field)
    assert status.details == "env['¡\x7f%']: contains a NUL character"  # details are not metadata


def test_only_a_call_refused_before_it_started_carries_the_unstarted_mark():
    from readie_rpc._status import NotStarted

    status = status_for(NotStarted("the router is draining"))
    assert status.code == grpc.StatusCode.UNAVAILABLE
    assert ("readie-unstarted", "1") in status.metadata
    assert not any(key == "readie-unstarted" for key, _ in status_for(SandboxSetupError("no sandbox")).metadata)


def test_a_worker_lost_under_a_routers_call_is_a_pool_worker_error_to_the_routers_client():
    from readie_rpc._interact_stream import SessionLost

    for lost in (WorkerLost("worker call failed (UNAVAILABLE): reset"), SessionLost("the session's worker was lost")):
        status = status_for(lost)  # the documented set of readie-error values, not how the router knew
        assert status.code == grpc.StatusCode.INTERNAL and ("readie-error", "PoolWorkerError") in status.metadata


def test_an_unexpected_error_is_internal_and_does_not_leak_its_message():
    status = status_for(KeyError("secret-value"))
    assert status.code == grpc.StatusCode.INTERNAL
    assert "secret-value" not in status.details and "KeyError" in status.details


def test_a_draining_worker_refuses_work_with_unavailable(tmp_path: Path):
    worker = Worker(WorkerConfig(manifest=tmp_path / "none.json", state_dir=tmp_path / "state"))
    worker.drain(grace_s=0)  # never started: nothing runs, nothing to destroy
    with pytest.raises(SandboxSetupError) as refused:
        worker.run_job(CodeJob(checkpoint="base", code="pass"))
    assert status_for(refused.value).code == grpc.StatusCode.UNAVAILABLE


class _Aborted(Exception):
    pass


class _Context:
    """The two ServicerContext methods grpc_errors uses; abort raises, as grpc's does."""

    def __init__(self) -> None:
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def set_trailing_metadata(self, metadata):
        self.metadata = metadata

    def abort(self, code, details):
        self.aborted = (code, details)
        raise _Aborted


def test_grpc_errors_ends_the_call_with_the_mapped_status():
    context = _Context()
    with pytest.raises(_Aborted):
        with grpc_errors(context):
            raise RequestError("must be between 1 and 3600000, got -1", field="timeout_ms")
    assert context.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "timeout_ms: must be between 1 and 3600000, got -1")
    assert context.metadata == (("readie-error", "RequestError"), ("readie-field", "timeout_ms"))


def test_grpc_errors_lets_a_successful_body_through():
    context = _Context()
    with grpc_errors(context):
        result = 42
    assert result == 42 and context.aborted is None


class _Failed(grpc.RpcError):
    """A failed call as grpc raises it: a status, details and trailing metadata."""

    def __init__(self, code, details, metadata=()):
        self._code, self._details, self._metadata = code, details, metadata

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._metadata


@pytest.mark.parametrize(
    ("failed", "raised", "message"),
    [
        (
            _Failed(grpc.StatusCode.INVALID_ARGUMENT, "timeout_ms: too long",
                    (("readie-error", "RequestError"), ("readie-field", "timeout_ms"))),
            RequestError,
            "timeout_ms: too long",
        ),
        (_Failed(grpc.StatusCode.UNAVAILABLE, "draining", (("readie-error", "SandboxSetupError"),)), SandboxSetupError, "draining"),
        (_Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), ExecutorTimeout, "Deadline Exceeded"),
        # No readie status: the worker's code never answered (a connection reset, the worker gone).
        (_Failed(grpc.StatusCode.UNAVAILABLE, "reset"), WorkerLost, "worker call failed (UNAVAILABLE): reset"),
        # The worker's own word that a job's sandbox failed: it says nothing against the worker.
        (_Failed(grpc.StatusCode.INTERNAL, "sandbox crashed", (("readie-error", "PoolWorkerError"),)), PoolWorkerError,
         "worker call failed (INTERNAL): sandbox crashed"),
    ],
)
def test_readie_errors_raises_a_failed_call_as_the_error_its_status_stands_for(failed, raised, message):
    with pytest.raises(raised) as caught, readie_errors():
        raise failed
    assert type(caught.value) is raised and str(caught.value) == message


def test_readie_errors_hands_a_call_no_worker_answered_to_its_caller():
    def broken(error):
        return PoolWorkerError(f"broke: {error.code().name}")

    with pytest.raises(PoolWorkerError, match="^broke: UNAVAILABLE$"), readie_errors(broken):
        raise _Failed(grpc.StatusCode.UNAVAILABLE, "reset")
    with pytest.raises(SandboxSetupError, match="^draining$"), readie_errors(broken):  # answered: the status decides
        raise _Failed(grpc.StatusCode.UNAVAILABLE, "draining", (("readie-error", "SandboxSetupError"),))
