"""What a worker's answers to hibernate and fork may carry: checked at the boundary (decision 0022).

A router or pool trusts none of it: a time must be a time, a refusal's text
is cut, and a refusal of a type no worker makes is a PoolWorkerError.
"""

from __future__ import annotations

import math

import pytest

from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._session_wire import (
    MAX_KEY_CHARS, MAX_REFUSAL_CHARS, attach_names, forked_message, hibernated_message, milliseconds, refusal, session_key,
)
from readie_worker.errors import PoolWorkerError, RequestError, SandboxSetupError


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, -1e300, 1e300, 3_600_001.0])
def test_a_time_no_worker_takes_is_a_pool_worker_error(value):
    with pytest.raises(PoolWorkerError, match="hibernate_ms"):
        milliseconds(value, "hibernate_ms")


@pytest.mark.parametrize("value", [0.0, 0.5, 231.7, 3_600_000.0])
def test_times_within_bounds_pass(value):
    assert milliseconds(value, "fork_ms") == value


def test_refusals_round_trip_with_their_type_and_a_cut_message():
    hibernated = hibernated_message(refused=RequestError("this session cannot hibernate", "session"))
    back = refusal(hibernated)
    assert isinstance(back, RequestError) and back.field == "session" and "cannot hibernate" in str(back)
    full = refusal(forked_message(refused=SandboxSetupError("x" * 10_000_000)))
    assert isinstance(full, SandboxSetupError) and len(str(full)) == MAX_REFUSAL_CHARS
    assert refusal(hibernated_message(12.5)) is None and refusal(forked_message(3.0, "token")) is None


def test_a_refusal_of_a_type_no_worker_makes_is_a_pool_worker_error():
    strange = refusal(pb.SessionHibernated(error_type="TimeoutError" * 100, error_message="m"))
    assert isinstance(strange, PoolWorkerError) and len(str(strange)) < 200


# --------------------------------------------------------------------------- durable sessions (decision 32)

KEY = "A" * 42 + "_"


@pytest.mark.parametrize(
    ("fields", "named"), [({"token": KEY}, ("token", KEY)), ({"key": KEY}, ("key", KEY)), ({"key": "-_09az"}, ("key", "-_09az"))]
)
def test_an_attach_names_a_token_or_a_key(fields, named):
    assert attach_names(pb.AttachSession(**fields)) == named


@pytest.mark.parametrize(
    "fields",
    [{}, {"token": KEY, "key": KEY}, {"key": "a" * (MAX_KEY_CHARS + 1)}, {"key": "a/b"}, {"key": "a\0"}, {"token": "é"}],
)
def test_an_attach_naming_neither_both_or_no_key_a_worker_makes_is_refused_naming_attach(fields):
    with pytest.raises(RequestError) as refused:
        attach_names(pb.AttachSession(**fields))
    assert refused.value.field == "attach"


def test_a_key_a_worker_answers_is_held_to_what_workers_make():
    assert session_key(pb.RunJobResponse(), "session_key") is None
    assert session_key(pb.RunJobResponse(session_key=KEY), "session_key") == KEY
    for forged in ("a" * (MAX_KEY_CHARS + 1), "key with spaces"):
        with pytest.raises(PoolWorkerError, match="session_key"):
            session_key(pb.RunJobResponse(session_key=forged), "session_key")


def test_a_step_said_to_resume_from_itself_or_later_is_refused():
    from readie_policy.jobs import CodeJob
    from readie_rpc._client_wire import step_outcome

    job = CodeJob("base", "x")
    assert step_outcome(pb.RunJobResponse(step=5, resumed_from_step=3), job).resumed_from_step == 3
    assert step_outcome(pb.RunJobResponse(step=5), job).resumed_from_step is None
    with pytest.raises(PoolWorkerError, match="resumed from step 5"):
        step_outcome(pb.RunJobResponse(step=5, resumed_from_step=5), job)


def test_a_lost_step_is_a_pool_worker_error_marked_lost_that_ends_nothing():
    from readie_protocol.errors import StepLost
    from readie_rpc._convert import lost_step_response

    response = lost_step_response(StepLost("the worker was lost"), 4, "s-1")
    assert (response.lost, response.session_ended, response.step, response.session_id) == (True, False, 4, "s-1")
    assert (response.error.type, response.error.message) == ("PoolWorkerError", "the worker was lost")


def test_an_attached_sessions_setup_is_its_job_without_code_or_files_and_checked_as_a_request():
    from readie_policy.jobs import CodeJob
    from readie_rpc._client_wire import attached_setup, setup_message

    opened = CodeJob(
        "pandas", "secret = 1", timeout_ms=45_000, max_output=4096, memory_bytes=1 << 30, functions=("lookup",),
        allow_read=("/data",), env={"A": "b"}, files=(("in.csv", b"x"),),
    )
    setup = attached_setup(pb.SessionAttached(session_id="s", step=3, setup=setup_message(opened)))
    assert setup == CodeJob(
        "pandas", "", timeout_ms=45_000, max_output=4096, memory_bytes=1 << 30, functions=("lookup",),
        allow_read=("/data",), env={"A": "b"},
    )
    with pytest.raises(PoolWorkerError, match="without saying its setup"):
        attached_setup(pb.SessionAttached(session_id="s", step=3))
    bad = pb.SessionAttached(session_id="s", step=3, setup=pb.RunJobRequest(checkpoint="base", functions=["not a name"]))
    with pytest.raises(PoolWorkerError, match="a setup no worker holds"):
        attached_setup(bad)
