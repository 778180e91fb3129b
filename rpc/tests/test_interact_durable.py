"""Durable sessions over the Interact stream (decision 32), with fake runners behind the real ``serve()``.

No runsc: each server's runner is a :class:`DurableRunner` whose sessions have keys and go
into a :class:`FakeStore` shared by every runner of a test, as workers share a session store.
The streams, the servicer's drain, ``WorkerClient`` and ``RemoteSession`` are the real ones.

Serving side: the first result carries the key, later ones do not; ``attach`` with it answers
``attached`` (session id, last step) and steps continue the same session; a wrong key is
refused as INVALID_ARGUMENT naming ``attach``, like a malformed one; a stream that ends
without ``close`` (half-closed, cancelled) detaches the session, ``close`` closes it; a step
lost under a router (StepLost) is a result marked ``lost`` and the session goes on; a drain
refuses new calls UNAVAILABLE marked ``readie-unstarted`` and hands an open session over
(``handed_over``, its last step) after its running step.

Calling side: a session's key; a hand-over between steps is followed by the next step
re-attaching (without take_over) on the next address and running there; a stream broken
under a step is StepLost and the next step re-attaches with take_over; a call refused as not
started goes to the next address; ``close`` removes the session from the store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import pytest

from readie_policy.jobs import CodeJob, Step
from readie_protocol.errors import PoolWorkerError, StepLost
from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._status import NotStarted, UNSTARTED_METADATA_KEY, error_from_status
from readie_rpc.client import WorkerClient
from readie_rpc.grpc_service import serve
from rpc.tests._interact_fakes import DurableRunner, FakeStore, Served, open_message, step_message, wait_until

JOB = CodeJob("base", "open", timeout_ms=5000)


@pytest.fixture
def durable() -> Iterator[Callable[..., list[Served]]]:
    """``durable(n)``: n servers on loopback whose runners share one fake store."""
    started: list[Served] = []

    def start(count: int = 1) -> list[Served]:
        store = FakeStore()
        made = []
        for index in range(count):
            runner = DurableRunner(store, f"w{index}")
            made.append(Served(runner, serve(runner, "127.0.0.1:0")))  # type: ignore[arg-type]
        started.extend(made)
        return made

    yield start
    for served in started:
        served.stop()


def attach_message(key: str = "", token: str = "", take_over: bool = False) -> pb.InteractRequest:
    return pb.InteractRequest(attach=pb.AttachSession(key=key, token=token, take_over=take_over))


def drain_in_background(served: Served, grace_s: float = 10.0) -> threading.Thread:
    thread = threading.Thread(target=served.server.servicer.hand_over, args=(grace_s,), daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------- serving side


def test_the_first_result_carries_the_key_and_an_attach_continues_the_session(durable):
    (served,) = durable()
    stream = served.stream(open_message("open"))
    first = stream.next().result
    session = served.runner.sessions[0]
    assert first.session_key == session.key and first.step == 1
    stream.send(step_message("a"))
    assert stream.next().result.session_key == ""  # the key rides on the first result only
    stream.cancel()
    assert wait_until(lambda: session.detaches == 1)  # a cancel detaches: the session lives on
    assert session.key in served.runner.store.detached

    again = served.stream(attach_message(key=session.key))
    attached = again.next().attached
    assert (attached.session_id, attached.step) == (session.id, 2)
    again.send(step_message("b"))
    assert again.next().result.step == 3
    assert session.steps == ["a", "b"]  # the same session: its state went on


@pytest.mark.parametrize("key", ["k1-" + "y" * 40, "not a key!", "k" * 200])
def test_a_wrong_or_malformed_key_is_refused_as_an_unknown_one(durable, key):
    (served,) = durable()
    stream = served.stream(open_message("open"))
    stream.next()
    refused = served.stream(attach_message(key=key))
    with pytest.raises(grpc.RpcError) as ended:
        refused.next()
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(ended.value.trailing_metadata())["readie-field"] == "attach"
    assert served.runner.sessions[0].detaches == 0  # the session was never touched


def test_an_attach_naming_both_a_token_and_a_key_is_refused(durable):
    (served,) = durable()
    with pytest.raises(grpc.RpcError) as ended:
        served.stream(attach_message(key="a" * 43, token="b" * 43)).next()
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_half_close_detaches_and_close_closes_for_good(durable):
    (served,) = durable()
    kept = served.stream(open_message("open"))
    kept.next()
    kept.requests.put(None)  # half-close, no close: the session outlives the stream
    assert list(kept.call) == []
    assert wait_until(lambda: served.runner.sessions[0].detaches == 1)

    closed = served.stream(open_message("open"))
    closed.next()
    closed.send(pb.InteractRequest(close=pb.CloseSession()))
    assert list(closed.call) == [] and closed.call.code() == grpc.StatusCode.OK
    session = served.runner.sessions[1]
    assert session.closed.is_set() and session.detaches == 0
    assert session.key not in served.runner.store.detached


def test_a_step_lost_under_the_runner_is_a_lost_result_and_the_session_goes_on(durable):
    (served,) = durable()
    stream = served.stream(open_message("open"))
    stream.next()
    stream.send(step_message("lose"))
    lost = stream.next().result
    assert lost.lost and not lost.session_ended
    assert lost.error.type == "PoolWorkerError" and lost.step == 2
    stream.send(step_message("next"))
    assert stream.next().result.step == 2  # the fake numbers the steps it ran


def test_a_drain_refuses_new_calls_as_not_started_and_hands_sessions_over_after_their_step(durable):
    (served,) = durable()
    stream = served.stream(open_message("open"))
    stream.next()
    stream.send(step_message("block"))
    assert wait_until(lambda: served.runner.sessions[0].steps == ["block"])
    drain = drain_in_background(served)
    with pytest.raises(grpc.RpcError) as refused:
        served.stub.RunJob(pb.RunJobRequest(checkpoint="base", code="x"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(refused.value.trailing_metadata())[UNSTARTED_METADATA_KEY] == "1"
    assert isinstance(error_from_status(refused.value), NotStarted)
    assert drain.is_alive()  # the running step holds the drain
    served.runner.release.set()
    assert stream.next().result.step == 2  # the running step finishes and is answered
    assert stream.next().handed_over.step == 2
    assert list(stream.call) == [] and stream.call.code() == grpc.StatusCode.OK
    drain.join(5)
    assert not drain.is_alive()
    session = served.runner.sessions[0]
    assert session.detaches == 1 and session.key in served.runner.store.detached


def test_a_runner_that_lets_go_in_its_own_drain_has_the_next_request_answered_handed_over(durable):
    (served,) = durable()
    served.runner.hands_sessions_over = False  # its own drain detaches (or closes) sessions
    stream = served.stream(open_message("open"))
    stream.next()
    drain_in_background(served).join(5)  # streams of sessions are not waited for
    served.runner.sessions[0].detach()  # the runner's drain, under the open stream
    stream.send(step_message("a"))
    assert stream.next().handed_over.step == 1
    assert list(stream.call) == [] and served.runner.sessions[0].steps == []


# --------------------------------------------------------------------------- calling side


def test_after_a_hand_over_the_next_step_re_attaches_on_the_next_address(durable):
    first, second = durable(2)
    client = WorkerClient([first.address, second.address], retry_s=5)
    try:
        session, opened = client.open_session(JOB)
        assert session.key == first.runner.sessions[0].key
        session.run_step(Step("a"))
        drain_in_background(first).join(5)
        outcome = session.run_step(Step("b"))  # handed over unread: re-attached on the second, run there
        assert outcome.step == 3 and not outcome.session_ended
        assert session.address == second.address
        assert first.runner.store.attaches == [("w1", False)]
        assert first.runner.sessions[0].steps == ["a", "b"]
        session.close()
        assert wait_until(lambda: first.runner.sessions[0].closed.is_set())
        assert first.runner.store.detached == {}
    finally:
        client.close()


def test_a_step_answered_lost_raises_step_lost_and_the_session_goes_on(durable):
    """A router answers a step whose worker it lost with ``lost``: its client says StepLost (so a
    pool's result is marked lost), not a step that merely failed, and the session goes on."""
    (served,) = durable()
    client = WorkerClient(served.address)
    try:
        session, _ = client.open_session(JOB)
        with pytest.raises(StepLost):
            session.run_step(Step("lose"))
        assert not session.ended
        after = session.run_step(Step("next"))
        assert after.outcome.error is None and not after.session_ended
    finally:
        client.close()


def test_a_stream_broken_under_a_step_loses_it_and_the_next_takes_the_session_over(durable):
    first, second = durable(2)
    client = WorkerClient([first.address, second.address], retry_s=5)
    try:
        session, _ = client.open_session(JOB)
        outcome: list[object] = []
        thread = threading.Thread(target=lambda: outcome.append(_raised(lambda: session.run_step(Step("block")))))
        thread.start()
        assert wait_until(lambda: first.runner.sessions[0].steps == ["block"])
        first.server.server.stop(0).wait()  # the worker is gone under the step
        thread.join(10)
        assert isinstance(outcome[0], StepLost) and not session.ended
        first.runner.release.set()  # its driver lets go (a real worker's store has its last checkpoint)
        assert wait_until(lambda: first.runner.sessions[0].detaches == 1)
        after = session.run_step(Step("c"))
        assert not after.session_ended and session.address == second.address
        assert first.runner.store.attaches == [("w1", True)]
    finally:
        client.close()


def test_a_call_refused_as_not_started_goes_to_the_next_address(durable):
    first, second = durable(2)
    drain_in_background(first).join(5)
    client = WorkerClient([first.address, second.address], retry_s=5)
    try:
        assert client.run_job(JOB).stdout == "open"
        assert client.address == second.address
        with pytest.raises(NotStarted):
            WorkerClient([first.address]).run_job(JOB)  # one address, no retry: the refusal as it is
    finally:
        client.close()


def test_a_session_without_a_way_back_ends_with_its_stream(durable):
    (served,) = durable()
    client = WorkerClient(served.address)
    try:
        session, _ = client.open_session(JOB)
        session.reconnect = None
        drain_in_background(served).join(5)
        with pytest.raises(PoolWorkerError, match="state is gone"):
            session.run_step(Step("a"))
        assert session.ended
    finally:
        client.close()


def _raised(call: Callable[[], object]) -> object:
    try:
        return call()
    except BaseException as exc:  # noqa: BLE001
        return exc
