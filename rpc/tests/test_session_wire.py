"""What a worker's answers to hibernate and fork may carry: checked at the boundary (decision 0022).

A router or pool trusts none of it: a time must be a time, a refusal's text
is cut, and a refusal of a type no worker makes is a PoolWorkerError.
"""

from __future__ import annotations

import math

import pytest

from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._session_wire import MAX_REFUSAL_CHARS, forked_message, hibernated_message, milliseconds, refusal
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
