"""Decision 32 on the wire: the attach request, its answer, and what a result says of a session's key,
a lost step and an older state. No pool: the pure protocol layer."""

from __future__ import annotations

import json

import pytest
from readie_protocol.connection import PoolConnection, Role
from readie_protocol.events import AttachedEvent, ErrorInfo, ForkedEvent, ReadyEvent, Result, parse_result
from readie_protocol.request_lines import request_json
from readie_protocol.requests import MAX_SESSION_KEY_CHARS, AttachSession, Refused, parse_request

KEY = "k" * 43


def test_an_attach_line_is_parsed_and_written_back_as_itself() -> None:
    line = json.dumps({"id": 1, "session": "nb", "attach": KEY})
    request = parse_request(line)
    assert request == AttachSession(1, "nb", KEY)
    assert parse_request(json.dumps(request_json(request))) == request


@pytest.mark.parametrize(
    "obj, field",
    [
        ({"id": 1, "session": "nb", "attach": 7}, "attach"),
        ({"id": 1, "session": "nb", "attach": ""}, "attach"),
        ({"id": 1, "session": "nb", "attach": "x" * (MAX_SESSION_KEY_CHARS + 1)}, "attach"),
        ({"id": 1, "session": "nb", "attach": "secret key/with+other chars"}, "attach"),
        ({"id": 1, "attach": KEY}, "session"),
        ({"session": "nb", "attach": KEY}, "id"),
        ({"id": 1, "session": "nb", "attach": KEY, "code": "x"}, "code"),
        ({"id": 1, "session": "nb", "attach": KEY, "close": True}, "close"),
    ],
)
def test_a_bad_attach_is_refused_naming_the_field_and_never_echoing_the_key(obj: dict, field: str) -> None:
    refused = parse_request(json.dumps(obj))
    assert isinstance(refused, Refused) and refused.error.field == field
    key = obj.get("attach")
    if isinstance(key, str) and key:
        assert key not in str(refused.error)


def test_keys_stay_out_of_reprs() -> None:
    assert KEY not in repr(AttachSession(1, "nb", KEY))
    assert KEY not in repr(Result(id=1, exit=0, session="nb", step=1, session_key=KEY))
    assert KEY not in repr(ForkedEvent(1, "nb", "nb2", 3, session_key=KEY))


def test_a_result_carries_the_key_the_lost_mark_and_the_older_state_only_when_set() -> None:
    plain = Result(id=1, exit=0, session="nb", step=2).to_json()
    assert not {"session_key", "lost", "resumed_from_step"} & set(plain)
    first = Result(id=1, exit=0, session="nb", step=1, session_key=KEY)
    lost = Result(id=2, exit=-1, error=ErrorInfo("PoolWorkerError", "lost"), session="nb", lost=True)
    older = Result(id=3, exit=0, session="nb", step=5, resumed_ms=300, resumed_from_step=3)
    assert first.to_json()["session_key"] == KEY
    assert lost.to_json()["lost"] is True and lost.to_json()["session_ended"] is False
    assert older.to_json()["resumed_from_step"] == 3
    for result in (first, lost, older):
        assert parse_result(json.loads(json.dumps(result.to_json()))) == result


def test_a_client_reads_the_attached_event_and_a_refusal_as_the_answer_to_its_attach() -> None:
    client, pool = PoolConnection(Role.CLIENT), PoolConnection(Role.POOL)
    ready = ReadyEvent.pool(workers=1)
    client.receive_data(pool.send(ready))
    assert client.next_event() == ready
    client.send(AttachSession(1, "nb", KEY))
    client.send(AttachSession(2, "other", KEY))
    refusal = Result(id=2, exit=-1, error=ErrorInfo("RequestError", "attach: no stored session has this key"),
                     session="other", session_ended=True)
    client.receive_data(pool.send(AttachedEvent(1, "nb", 4)) + pool.send(refusal))
    assert client.next_event() == AttachedEvent(1, "nb", 4)
    assert client.next_event() == refusal
    forked = ForkedEvent(3, "nb", "nb2", 12, session_key=KEY)
    assert json.loads(pool.send(forked))["session_key"] == KEY


def test_a_stray_answer_is_shown_without_its_session_key() -> None:
    from readie_protocol.connection import Stray

    line = json.dumps(Result(id=1, exit=0, session="nb", step=1, session_key=KEY).to_json()).encode()
    assert KEY.encode() in line and KEY not in repr(Stray(line))
