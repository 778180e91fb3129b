"""Host calls, replies and output as Interact messages, and back: validation without I/O.

Both ends of an ``Interact`` stream use these: the worker turns a client's
``HostReply`` into a :class:`~readie_policy.jobs.HostReply`; the client (a router, ``readie pool
--router``) turns the worker's ``HostCall`` into a
:class:`~readie_policy.jobs.HostCall` for its host function. Neither end
trusts the other's bytes: JSON goes through :mod:`readie_executor.hostwire`
(iterative, lossless, size-checked first), and a message that is not what
the protocol allows is a :class:`~readie_protocol.errors.RequestError` (from a
client) or a :class:`~readie_protocol.errors.PoolWorkerError` (from a worker)
naming what was wrong.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from readie_executor import hostwire
from readie_executor.hostwire import MAX_ARGUMENT_BYTES, MAX_CALL_ID, MAX_RESULT_BYTES

from ._proto.readie.v1 import worker_pb2 as pb
from readie_protocol.errors import PoolWorkerError, RequestError
from readie_policy.jobs import HostCall, HostReply, OutputChunk

__all__ = [
    "call_from_message",
    "call_message",
    "output_from_message",
    "output_message",
    "reply_from_message",
    "reply_message",
]

_STREAMS = {"stdout": pb.OUTPUT_STREAM_STDOUT, "stderr": pb.OUTPUT_STREAM_STDERR}
_STREAM_NAMES = {number: name for name, number in _STREAMS.items()}


# --------------------------------------------------------------------------- worker -> client


def call_message(call: HostCall) -> pb.HostCall:
    """The event for a call that passed the worker's frame checks (so it encodes within its budget)."""
    remaining_ms = 0 if call.deadline is None else max(0, int((call.deadline - time.monotonic()) * 1000))
    args_json, kwargs_json = call.encoded or (hostwire.dumps(list(call.args)), hostwire.dumps(call.kwargs))
    return pb.HostCall(
        call_id=call.call_id,
        function=call.function,
        args_json=args_json,
        kwargs_json=kwargs_json,
        deadline_ms=remaining_ms,
    )


def call_from_message(message: pb.HostCall, functions: Collection[str], max_wait_s: float | None = None) -> HostCall:
    """The worker's call, checked against what this client declared; PoolWorkerError otherwise.

    ``max_wait_s`` (the task's own timeout) caps how long the deadline the worker names lets a host wait.
    """
    if message.function not in functions:
        raise PoolWorkerError(f"the worker relayed a call to {message.function[:80]!r}, which was not declared")
    if not 1 <= message.call_id <= MAX_CALL_ID:
        raise PoolWorkerError(f"the worker relayed a call with id {message.call_id}")
    size = len(message.args_json) + len(message.kwargs_json)
    if size > MAX_ARGUMENT_BYTES:
        raise PoolWorkerError(f"the worker relayed {size} bytes of arguments; at most {MAX_ARGUMENT_BYTES} are allowed")
    try:
        args, kwargs = hostwire.loads(message.args_json), hostwire.loads(message.kwargs_json)
    except hostwire.WireError as exc:
        raise PoolWorkerError(f"the worker relayed arguments that are not valid JSON: {exc}") from None
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise PoolWorkerError("the worker relayed arguments that are not an array and an object")
    wait_s = max(0, message.deadline_ms) / 1000
    if max_wait_s is not None:
        wait_s = min(wait_s, max_wait_s)
    encoded = (message.args_json, message.kwargs_json)
    return HostCall(message.call_id, message.function, tuple(args), kwargs, time.monotonic() + wait_s, encoded)


def output_message(chunk: OutputChunk) -> pb.OutputChunk:
    return pb.OutputChunk(stream=_STREAMS[chunk.stream], data=chunk.data)


def output_from_message(message: pb.OutputChunk) -> OutputChunk:
    """The worker's output event; PoolWorkerError for a stream that is neither stdout nor stderr.
    (Its size is the receiver's to bound: it knows the task's max_output.)"""
    stream = _STREAM_NAMES.get(message.stream)
    if stream is None:
        raise PoolWorkerError(f"the worker sent output on stream {message.stream}, neither stdout nor stderr")
    return OutputChunk(stream, message.data)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- client -> worker


def reply_message(call_id: int, reply: HostReply) -> pb.HostReply:
    """The message answering ``call_id``; a result that cannot be sent becomes an error reply."""
    if reply.error is None and reply.encoded is not None:  # relayed: checked where it was parsed
        return pb.HostReply(call_id=call_id, result_json=reply.encoded)
    if reply.error is None:
        try:
            return pb.HostReply(call_id=call_id, result_json=hostwire.dumps(reply.result, MAX_RESULT_BYTES, what="result"))
        except (TypeError, ValueError) as exc:
            reply = HostReply(error=f"the host's result cannot be sent: {exc}")
    # A proto string must be valid UTF-8; a host's message may hold lone surrogates (file names).
    error = str(reply.error).encode("utf-8", "backslashreplace").decode("utf-8")
    return pb.HostReply(call_id=call_id, error=error)


def reply_from_message(message: pb.HostReply) -> tuple[int, HostReply]:
    """The call id a client's reply answers and the reply; RequestError naming the field otherwise."""
    outcome = message.WhichOneof("outcome")
    if outcome is None:
        raise RequestError("a reply carries result_json or error", field="reply")
    if outcome == "error":
        # Cut and escaped by the worker's frame encoder (MAX_ERROR_CHARS); only its type matters here.
        return message.call_id, HostReply(error=message.error)
    if len(message.result_json) > MAX_RESULT_BYTES:
        raise RequestError(
            f"{len(message.result_json)} bytes; at most {MAX_RESULT_BYTES} are allowed", field="reply.result_json"
        )
    try:
        result: Any = hostwire.loads(message.result_json)
    except hostwire.WireError as exc:
        raise RequestError(f"not valid JSON: {exc}", field="reply.result_json") from None
    return message.call_id, HostReply(result=result, encoded=message.result_json)
