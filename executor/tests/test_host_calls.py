"""Host functions inside the sandbox: readie_host, its channel, and the server around it.

In this process: ``_host.declared`` only swaps ``sys.modules`` entries (and
restores them), and the channel is one end of a socketpair whose other end a
thread answers like a worker would. The whole path through a real worker is
in worker/tests/test_host_functions_runsc.py.
"""

from __future__ import annotations

import pickle
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import cloudpickle
import pytest

from readie_executor import _channel, hostwire, probe
from readie_executor._server import serve_connection
from readie_executor.jobs import _host
from readie_executor.jobs._spec import JobSpecError, parse_job
from readie_executor.framing import MessageReader, encode_message
from readie_executor.sockets import receive_message, send_message

TIMEOUT_S = 30


def job_dict(**fields: Any) -> dict[str, Any]:
    return {"code": "pass", "limits": {"max_output": 100}, **fields}


def test_functions_are_part_of_the_job_spec() -> None:
    assert parse_job(job_dict()).functions == ()
    assert parse_job(job_dict(functions=["search", "fetch"])).functions == ("search", "fetch")


@pytest.mark.parametrize(
    ("functions", "message"),
    [
        ("search", "functions must be a list"),
        (["search", "search"], "declared twice"),
        (["not-a-name"], "not a Python identifier"),
        (["HostError"], "reserved"),
        (["__getattr__"], "reserved"),
        ([1], "must be a string"),
    ],
)
def test_bad_function_names_are_refused(functions: object, message: str) -> None:
    with pytest.raises(JobSpecError, match=message):
        parse_job(job_dict(functions=functions))


def test_the_module_holds_only_the_declared_names_and_is_removed_after() -> None:
    assert "readie_host" not in sys.modules
    with _host.declared(("search",)) as module:
        import pynox_host
        import readie_host

        assert readie_host is pynox_host is module
        assert sorted(name for name in vars(module) if not name.startswith("__")) == ["HostError", "search"]
        assert module.search.__name__ == "search" and module.search.__module__ == "readie_host"
        with pytest.raises(ImportError):
            from readie_host import delete_everything  # noqa: F401
    assert "readie_host" not in sys.modules and "pynox_host" not in sys.modules


def test_a_call_outside_its_task_or_channel_raises_host_error() -> None:
    with _host.declared(("search",)) as module:
        search = module.search
        with pytest.raises(_host.HostError, match="no host channel"):
            search("x")
        with pytest.raises(_host.HostError, match="fetch is not a host function of this task"):
            _host.call("fetch", (), {})
    with pytest.raises(_host.HostError, match="only while the task that declared them runs"):
        search("x")


# --------------------------------------------------------------------------- with a fake worker


@contextmanager
def fake_worker(answer: Callable[[dict[str, Any]], list[bytes]]) -> Iterator[list[dict[str, Any]]]:
    """A channel whose frames a thread answers: ``answer`` gives the messages to send back."""
    ours, theirs = socket.socketpair()
    frames: list[dict[str, Any]] = []

    def serve() -> None:
        reader = MessageReader()
        while (payload := receive_message(theirs, reader)) is not None:
            frame = hostwire.loads(payload)["call"]
            frames.append(frame)
            for message in answer(frame):
                send_message(theirs, message)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ours.settimeout(TIMEOUT_S)
    try:
        with _channel.serving(_channel.Channel(ours, MessageReader(), 1024)):
            yield frames
    finally:
        ours.close()
        thread.join(TIMEOUT_S)
        theirs.close()


def reply(call_id: object, **outcome: Any) -> bytes:
    return hostwire.REPLY_PREFIX + hostwire.dumps({"call_id": call_id, **outcome}) + b"}"


def test_a_call_sends_one_frame_and_returns_the_result() -> None:
    with fake_worker(lambda frame: [reply(frame["call_id"], result=["first hit", 2**64 + 1])]) as frames:
        with _host.declared(("search",)) as module:
            assert module.search("readie", limit=2) == ["first hit", 2**64 + 1]
            assert module.search("again") == ["first hit", 2**64 + 1]
    assert frames == [
        {"call_id": 1, "function": "search", "args": ["readie"], "kwargs": {"limit": 2}},
        {"call_id": 2, "function": "search", "args": ["again"], "kwargs": {}},
    ]


def test_an_error_reply_raises_host_error_with_the_text() -> None:
    with fake_worker(lambda frame: [reply(frame["call_id"], error="backend unavailable")]):
        with _host.declared(("search",)) as module:
            with pytest.raises(module.HostError, match="^backend unavailable$"):
                module.search("x")


def test_replies_to_other_ids_are_skipped() -> None:
    # Answers to frames the job wrote by hand arrive first; the call waits for its own.
    def answer(frame: dict[str, Any]) -> list[bytes]:
        return [reply(None, error="junk"), reply(99, error="forged"), reply(frame["call_id"], result="mine")]

    with fake_worker(answer), _host.declared(("search",)) as module:
        assert module.search() == "mine"


def test_arguments_that_are_not_json_never_leave() -> None:
    with fake_worker(lambda frame: [reply(frame["call_id"], result=None)]) as frames:
        with _host.declared(("search",)) as module:
            for bad, error in (
                (float("nan"), ValueError),
                ({"k": {1, 2}}, TypeError),
                ("x" * (hostwire.MAX_ARGUMENT_BYTES + 1), ValueError),
            ):
                with pytest.raises(error, match="^search\\(\\): "):
                    module.search(bad)
            assert module.search([[[[1]]]]) is None  # and the count starts at 1
    assert [frame["call_id"] for frame in frames] == [1]


def test_the_1001st_call_is_refused_without_reaching_the_host() -> None:
    with fake_worker(lambda frame: [reply(frame["call_id"], result=frame["call_id"])]) as frames:
        with _host.declared(("search",)) as module:
            assert [module.search() for _ in range(hostwire.MAX_CALLS_PER_TASK)][-1] == 1000
            with pytest.raises(module.HostError, match="made its 1000 host calls"):
                module.search()
    assert len(frames) == hostwire.MAX_CALLS_PER_TASK


def test_a_broken_channel_fails_this_call_and_the_next() -> None:
    with fake_worker(lambda frame: []):  # the worker hangs up without answering
        with _host.declared(("search",)) as module:
            channel = _channel.current()
            assert channel is not None
            channel._connection.shutdown(socket.SHUT_RD)  # type: ignore[attr-defined]
            with pytest.raises(module.HostError, match="connection to the host failed"):
                module.search()
            with pytest.raises(module.HostError, match="broke earlier"):
                module.search()
            assert channel.broken


# --------------------------------------------------------------------------- the server


def test_the_server_drops_replies_left_unread_by_the_last_job() -> None:
    ours, theirs = socket.socketpair()
    server = threading.Thread(target=serve_connection, args=(theirs, 1024), daemon=True)
    server.start()
    ours.settimeout(TIMEOUT_S)
    try:
        ours.sendall(encode_message(reply(None, error="an answer nobody read")))
        ping = cloudpickle.dumps({"func": probe.ping, "args": (), "kwargs": {}})
        ours.sendall(encode_message(ping))
        assert receive_message(ours, MessageReader()) == probe.PONG
    finally:
        ours.close()
        server.join(TIMEOUT_S)
        theirs.close()


def test_the_running_call_sees_the_channel_and_only_it() -> None:
    ours, theirs = socket.socketpair()
    server = threading.Thread(target=serve_connection, args=(theirs, 1024), daemon=True)
    server.start()
    ours.settimeout(TIMEOUT_S)
    try:
        request = cloudpickle.dumps({"func": _channel_is_set, "args": (), "kwargs": {}})
        ours.sendall(encode_message(request))
        envelope = pickle.loads(receive_message(ours, MessageReader()) or b"")
        assert envelope["value"] is True
    finally:
        ours.close()
        server.join(TIMEOUT_S)
        theirs.close()
    assert _channel.current() is None


def _channel_is_set() -> bool:
    return _channel.current() is not None
