"""Request values as the JSON objects a client writes: the inverse of :func:`~readie_protocol.requests.parse_request`.

Both roles of :class:`~readie_protocol.connection.PoolConnection` hold the
same typed requests: the pool parses a line into one, a client builds one
(a :class:`~readie_protocol.requests.JobRequest`, a
:class:`~readie_protocol.requests.StatsRequest`, ...) and the connection
writes it with :func:`request_json`. For every request the parser accepts,
``parse_request(encode_request(request_json(request)))`` is that request
again (a property test holds it): one definition of each field's wire name
(``requests.JOB_FIELDS``), read both ways.

A host function's reply is the one request whose line is not written by
``json``: its result is any value the sandbox's code may receive (integers
of any size, nesting of any depth), so :func:`reply_line` writes it with
hostwire's lossless, iterative encoder, as the pool's side writes a call.
"""

from __future__ import annotations

from typing import Any

from readie_executor import hostwire

from .encoding import encode_request
from .replies import MAX_REPLY_BYTES, ReplyRequest
from .requests import (
    JOB_FIELDS,
    AttachSession,
    CancelJob,
    CloseSession,
    ForkSession,
    HibernateSession,
    JobRequest,
    Request,
    StatsRequest,
)
from .transfers import DownloadChunk, ListFiles, UploadChunk
from .units import format_duration_ms
from .workspace import encode_bytes

__all__ = ["reply_line", "request_json"]


def reply_line(reply: ReplyRequest) -> bytes:
    """The line of a host function's reply; TypeError or ValueError when its result cannot be sent
    (not JSON, a cycle, NaN, over :data:`~readie_protocol.replies.MAX_REPLY_BYTES` of JSON).

    Stateless: a reply is answered by nothing, so a client may write it
    without holding its connection (a 1 MB result is encoded off the lock).
    """
    if reply.error is not None:
        return encode_request(request_json(reply))
    body = hostwire.dumps(reply.result, MAX_REPLY_BYTES, what="result")
    return b'{"reply":{"call_id":%d,"result":' % reply.call_id + body + b"}}\n"


def request_json(request: Request) -> dict[str, Any]:
    """The JSON object of ``request``'s line (``encode_request`` makes it a line)."""
    if isinstance(request, JobRequest):
        return _job(request)
    if isinstance(request, ReplyRequest):
        answer = {"result": request.result} if request.error is None else {"error": request.error}
        return {"reply": {"call_id": request.call_id, **answer}}
    if isinstance(request, StatsRequest):
        return {"id": request.id, "stats": True}
    if isinstance(request, CancelJob):
        return {"id": request.id, "cancel": request.target}
    if isinstance(request, CloseSession):
        return {"id": request.id, "session": request.session, "close": True}
    if isinstance(request, HibernateSession):
        return {"id": request.id, "session": request.session, "hibernate": True}
    if isinstance(request, ForkSession):
        return {"id": request.id, "session": request.session, "fork": request.fork}
    if isinstance(request, AttachSession):
        return {"id": request.id, "session": request.session, "attach": request.key}
    if isinstance(request, UploadChunk | DownloadChunk | ListFiles):
        return request.to_json()
    raise TypeError(f"not a request: {type(request).__name__}")


def _job(request: JobRequest) -> dict[str, Any]:
    """The fields the request carried (``fields``, for a parsed one), and any it sets beside them."""
    out: dict[str, Any] = {"id": request.id}
    for field in JOB_FIELDS:
        value = getattr(request, field.attr)
        if field.name in request.fields or value not in (None, (), False):
            out[field.name] = _wire(field.name, value)
    return out


def _wire(name: str, value: Any) -> Any:
    if name == "timeout":
        return format_duration_ms(value)  # "250ms", "5s": what parse_duration_ms reads back exactly
    if name == "env":
        return dict(value)
    if name == "files":  # checked paths to their bytes, as base64
        return {path: encode_bytes(data) for path, data in value}
    if isinstance(value, tuple):
        return list(value)
    return value
