"""A host call's reply sent from the thread that receives it (readie_worker._host_answer.EarlyReply).

Pure: the socket is a real socketpair whose other end is read here, so a full
buffer and a write it takes only part of are the kernel's, not a fake's. That
the reply reaches a real sandbox whole, whichever thread sent it, is shown by
pool/tests/test_pool_host_functions.py (a job that reads its replies only
after all its calls).
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from collections.abc import Iterator

import pytest
from readie_executor.framing import MessageReader, encode_message

from readie_worker._host_answer import EarlyReply
from readie_worker._host_frames import HostReply, encode_reply
from readie_worker.sandbox import NO_REPLY, SINGLE_WRITE_BYTES, UnsentRest


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, sandbox = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)  # a small buffer: filled at will
    with ours, sandbox:
        yield ours, sandbox


class Encoder:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, reply: HostReply) -> bytes:
        self.calls += 1
        return encode_reply(7, reply)


def send_now(sock: socket.socket):
    def send(data: bytes) -> int:
        try:
            return sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0

    return send


def fill(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        while sock.send(b"\0" * 4096):
            pass
    except BlockingIOError:
        pass


def received(sock: socket.socket) -> bytes:
    """The one message on ``sock``'s stream."""
    reader = MessageReader()
    while True:
        event = reader.next_event()
        if hasattr(event, "payload"):
            return event.payload
        reader.feed(sock.recv(1 << 20))


LATER = time.monotonic() + 3600


def test_a_reply_the_socket_takes_is_sent_there_and_the_job_thread_sends_nothing(pair):
    ours, sandbox = pair
    encode = Encoder()
    early = EarlyReply(encode, send_now(ours), LATER)
    assert early(HostReply(result=[1, "two"]))
    early.close()
    assert early.take_over(HostReply(result="ignored")) is NO_REPLY
    assert received(sandbox) == encode_reply(7, HostReply(result=[1, "two"]))
    assert encode.calls == 1  # encoded (and counted) once, by the thread that sent it


def test_a_reply_the_socket_takes_in_part_leaves_its_rest_to_the_job_thread(pair):
    ours, sandbox = pair
    reply = HostReply(result="x" * 40_000)  # well over the buffer, under one write
    early = EarlyReply(Encoder(), send_now(ours), LATER)
    assert early(reply)
    early.close()
    rest = early.take_over(reply)
    assert isinstance(rest, UnsentRest) and 0 < len(rest.data) < len(encode_message(encode_reply(7, reply)))
    reading = concurrent.futures.ThreadPoolExecutor(1).submit(received, sandbox)
    ours.setblocking(True)
    ours.sendall(rest.data)  # as the job's thread does, while the sandbox reads
    assert reading.result(timeout=10) == encode_reply(7, reply)


def test_a_full_socket_leaves_the_encoded_frame_to_the_job_thread(pair):
    ours, _ = pair
    fill(ours)
    encode = Encoder()
    early = EarlyReply(encode, send_now(ours), LATER)
    assert not early(HostReply(result=3))
    early.close()
    assert early.take_over(HostReply(result="not this one")) == encode_reply(7, HostReply(result=3))
    assert encode.calls == 1


def test_a_frame_over_one_write_is_never_sent_from_there():
    sent: list[bytes] = []
    reply = HostReply(result="y" * SINGLE_WRITE_BYTES)
    early = EarlyReply(Encoder(), lambda data: sent.append(data) or len(data), LATER)
    assert not early(reply)
    early.close()
    assert early.take_over(reply) == encode_reply(7, reply) and sent == []


def test_nothing_is_sent_from_there_after_the_deadline_or_once_the_job_thread_took_over():
    sent: list[bytes] = []
    encode = Encoder()
    late = EarlyReply(encode, lambda data: sent.append(data) or len(data), time.monotonic() - 1)
    assert not late(HostReply(result=1))
    late.close()
    assert late.take_over(HostReply(error="timed out")) is NO_REPLY  # the task is over: dropped
    closed = EarlyReply(encode, lambda data: sent.append(data) or len(data), LATER)
    closed.close()
    assert not closed(HostReply(result=1))
    assert closed.take_over(HostReply(error="the pool stopped")) == encode_reply(7, HostReply(error="the pool stopped"))
    assert sent == [] and encode.calls == 2  # each counted in the task's stats, the dropped one too


def test_a_call_read_after_the_tasks_deadline_never_reaches_the_host():
    """A job can write call frames ahead; read once its time is up, none is asked of the host: its
    client may still be answering the last call, and a second call of one request is a break of
    the pool protocol that no client takes."""
    from readie_worker._host_answer import HostAnswer
    from readie_worker._host_frames import HostConversation

    asked: list[object] = []
    frames = [b'{"call":{"call_id":%d,"function":"f","args":[],"kwargs":{}}}' % n for n in (1, 2)]
    on_time = HostAnswer(HostConversation({"f"}), lambda call: asked.append(call) or HostReply(result=1),
                         time.monotonic() + 60, None, lambda data: 0)
    assert on_time(frames[0]) != NO_REPLY and len(asked) == 1
    late = HostAnswer(HostConversation({"f"}), lambda call: asked.append(call) or HostReply(result=1),
                      time.monotonic() - 0.001, None, lambda data: 0)
    assert late(frames[0]) is NO_REPLY and len(asked) == 1
