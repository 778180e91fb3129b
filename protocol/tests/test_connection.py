"""Both ends of PoolConnection against each other: what one side sends, the other reads back as the same value."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from readie_protocol.connection import ENDED, NEED_DATA, PoolConnection, Role, Stray
from readie_protocol.errors import PoolError, RequestError, VersionMismatch
from readie_protocol.events import CallEvent, CancelledEvent, ClosedEvent, ErrorInfo, ReadyEvent, Result, RuntimeInfo, StatsEvent
from readie_protocol.lines import MAX_LINE_BYTES
from readie_protocol.requests import CancelJob, CloseSession, JobRequest, Refused, ReplyRequest, StatsRequest

READY = ReadyEvent.pool(workers=2, preloaded_modules=["pandas"], profiles=["fetch"])


def result(id: Any, **fields: Any) -> Result:
    values: dict[str, Any] = {
        "id": id, "exit": 0, "stdout": "hi\n", "stderr": "", "error": None, "stdout_truncated": False,
        "stderr_truncated": False, "duration_ms": 4, "duration_us": 4001, "queue_us": 12,
        "runtime": RuntimeInfo.pool("3.11.2"), "policy": None,
    }
    return Result(**{**values, **fields})


def events(connection: PoolConnection, data: bytes = b"") -> list[Any]:
    if data:
        connection.receive_data(data)
    out = []
    while (event := connection.next_event()) not in (NEED_DATA, ENDED):
        out.append(event)
    return out


def pair() -> tuple[PoolConnection, PoolConnection]:
    """A client and a pool past the ready event."""
    client, pool = PoolConnection(Role.CLIENT), PoolConnection(Role.POOL)
    assert events(client, pool.send(READY)) == [READY]
    return client, pool


def test_requests_cross_as_the_pool_parses_them() -> None:
    client, pool = pair()
    sent = [
        JobRequest(id=1, code="print(1)", timeout_ms=5000, allow_read=("/data",), env=(("A", "b"),),
                   fields=frozenset({"code", "timeout", "allow_read", "env"})),
        StatsRequest("s"),
        CloseSession(2, "nb"),
        ReplyRequest(call_id=3, result=[1, {"x": None}]),
        ReplyRequest(call_id=4, error="no"),
        CancelJob("c", 1),
    ]
    received = events(pool, b"".join(client.send(request) for request in sent))
    assert received == sent
    assert pool.next_event() is NEED_DATA
    pool.receive_data(b"")
    assert pool.next_event() is ENDED


def test_each_answer_is_read_as_what_its_request_asked_for() -> None:
    client, pool = pair()
    for request in (JobRequest(1, code="x"), StatsRequest("s"), CloseSession(2, "nb"), CloseSession(3, "gone"),
                    CancelJob("c", 1)):
        client.send(request)
    refused = result(3, exit=-1, stdout="", error=ErrorInfo("RequestError", "session: no session 'gone'"))
    answers = [
        CallEvent(1, 7, "search", ["readie", 10**40], {"deep": [[[]]]}),
        StatsEvent("s", {"uptime_ms": 5, "jobs": 1}),
        ClosedEvent(2, "nb"),
        CancelledEvent("c", 1, found=True),
        refused,
        result(1),
    ]
    assert events(client, b"".join(pool.send(answer) for answer in answers)) == answers
    # Answered: the same id again answers nothing in flight.
    (stray,) = events(client, pool.send(result(1)))
    assert isinstance(stray, Stray) and stray.line.startswith(b'{"id": 1')


@given(st.data())
def test_any_split_of_the_bytes_gives_the_same_events(data: st.DataObject) -> None:
    client, pool = pair()
    for n in range(3):
        client.send(JobRequest(n, code="x"))
    stream = b"".join(pool.send(result(n, stdout="é\n" * n)) for n in range(3))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    got: list[Any] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        got += events(client, stream[start:end])
    assert got == [result(n, stdout="é\n" * n) for n in range(3)]


def test_the_ready_event_is_the_pools_first_line_and_only_that() -> None:
    pool = PoolConnection(Role.POOL)
    with pytest.raises(RuntimeError, match="first line"):
        pool.send(result(1))
    pool.send(READY)
    with pytest.raises(RuntimeError, match="first line"):
        pool.send(READY)


def test_a_client_refuses_another_version_and_a_first_line_that_is_not_ready() -> None:
    client = PoolConnection(Role.CLIENT)
    client.receive_data(json.dumps({**READY.to_json(), "protocol": 99}).encode() + b"\n")
    with pytest.raises(VersionMismatch, match="version 99"):
        client.next_event()
    with pytest.raises(PoolError):  # and nothing after it is read
        client.next_event()
    for first, message in ((b"nonsense\n", "first line is not JSON"), (b'{"id": 1}\n', "not the ready event")):
        with pytest.raises(PoolError, match=message):
            events(PoolConnection(Role.CLIENT), first)


def test_a_broken_line_breaks_the_client_side_for_good() -> None:
    client, pool = pair()
    client.send(JobRequest(1, code="x"))
    with pytest.raises(PoolError, match="broke the protocol: the pool wrote a line that is not JSON"):
        events(client, b"{oops\n" + pool.send(result(1)))
    with pytest.raises(PoolError, match="not JSON"):
        client.next_event()


def test_a_result_with_a_wrong_type_breaks_the_protocol() -> None:
    client, pool = pair()
    client.send(JobRequest(1, code="x"))
    line = json.dumps({**result(1).to_json(), "exit": "0"}).encode() + b"\n"
    with pytest.raises(PoolError, match="exit has the wrong type"):
        events(client, line)


def test_an_event_line_over_the_clients_bound_breaks_it_before_the_line_ends() -> None:
    client = PoolConnection(Role.CLIENT, max_line_bytes=4096)
    events(client, PoolConnection(Role.POOL).send(READY))
    client.receive_data(b'{"id": 1, "stdout": "' + b"x" * 5000)
    with pytest.raises(PoolError, match="line of at least 5021 bytes, over 4096"):
        client.next_event()


def test_the_pool_side_refuses_an_oversize_line_by_its_id_and_goes_on() -> None:
    pool = PoolConnection(Role.POOL)
    pool.send(READY)
    line = b'{"id": "big", "code": "' + b"#" * MAX_LINE_BYTES + b'"}\n'
    refused, job = events(pool, line + b'{"id": 2, "code": "ok"}\n')
    assert isinstance(refused, Refused) and refused.id == "big" and "1048576-byte limit" in str(refused.error)
    assert pool.last_line_bytes == len(b'{"id": 2, "code": "ok"}')
    assert isinstance(job, JobRequest) and job.code == "ok"


def test_a_client_refuses_to_send_a_line_the_pool_would_refuse() -> None:
    client, pool = pair()
    with pytest.raises(RequestError, match="1 MiB") as refused:
        client.send(JobRequest(1, code="#" * MAX_LINE_BYTES))
    assert refused.value.field == "code"
    # Nothing is in flight for it: a later answer under its id is a stray.
    (stray,) = events(client, pool.send(result(1)))
    assert isinstance(stray, Stray)


def test_a_forgotten_request_is_answered_as_a_stray() -> None:
    client, pool = pair()
    client.send(JobRequest(1, code="x"))
    client.forget(1)
    (stray,) = events(client, pool.send(result(1)))
    assert isinstance(stray, Stray)


def test_an_id_of_true_is_a_stray_and_does_not_take_request_ones_answer() -> None:
    client, pool = pair()
    client.send(JobRequest(1, code="x"))
    forged = json.dumps({**result(1).to_json(), "id": True}).encode() + b"\n"
    stray, answer = events(client, forged + pool.send(result(1)))
    assert isinstance(stray, Stray) and answer == result(1)


def test_a_client_sends_typed_requests_only() -> None:
    # One definition of each request: a JSON object is not one (a hostile-input test writes bytes instead).
    client, _ = pair()
    with pytest.raises(TypeError, match="not a request: dict"):
        client.send({"id": 1, "code": "x"})  # type: ignore[arg-type]


def test_a_reply_is_written_losslessly_and_one_that_cannot_be_sent_is_a_type_or_value_error() -> None:
    client, pool = pair()
    deep: Any = 10**400  # past 64 bits, and nested: written as hostwire writes it
    for _ in range(50):
        deep = [deep]
    assert events(pool, client.send(ReplyRequest(call_id=1, result=deep))) == [ReplyRequest(call_id=1, result=deep)]
    with pytest.raises(ValueError):
        client.send(ReplyRequest(call_id=2, result=float("nan")))
    with pytest.raises(TypeError):
        client.send(ReplyRequest(call_id=3, result=object()))
