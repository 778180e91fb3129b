"""Host-function replies: ``{"reply": {"call_id": n, "result": ...}}`` or ``{..., "error": "text"}``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from readie_executor import hostwire

from ._values import Invalid, text_value
from .errors import RequestError
from .units import MAX_VALUE
from .wire import json_type

__all__ = ["MAX_REPLY_BYTES", "ReplyRequest", "parse_reply"]

#: The spec: host-function "arguments and results are JSON, at most 1 MB each way".
MAX_REPLY_BYTES = 1_000_000


@dataclass(frozen=True, slots=True)
class ReplyRequest:
    """A host-function answer: ``error`` is None when the call returned ``result``.

    ``result`` is any JSON value exactly as parsed (bounded by
    :data:`MAX_REPLY_BYTES`); it goes on to the sandbox as JSON, never
    interpreted here.
    """

    call_id: int
    result: Any = None
    error: str | None = None


def parse_reply(value: Any) -> ReplyRequest:
    """The value of a reply line's ``reply``; RequestError naming the field when it is not one."""
    if not isinstance(value, dict):
        raise RequestError(f"expected an object, got {json_type(value)}", "reply")
    for key in value:
        if key not in ("call_id", "result", "error"):
            raise RequestError("unknown field", f"reply.{key}")
    if "call_id" not in value:
        raise RequestError("required", "reply.call_id")
    call_id = value["call_id"]
    if isinstance(call_id, bool) or not isinstance(call_id, int) or not 0 <= call_id <= MAX_VALUE:
        raise RequestError(
            f"expected an integer from 0 to {MAX_VALUE}, got {json_type(call_id)}",
            "reply.call_id",
        )
    has_result, has_error = "result" in value, "error" in value
    if has_result == has_error:
        raise RequestError("give exactly one of result and error", "reply")
    if has_error:
        try:
            error = text_value(value["error"])
        except Invalid as exc:
            raise RequestError(str(exc), "reply.error") from None
        _check_reply_size(error, "reply.error")
        return ReplyRequest(call_id=call_id, error=error)
    _check_reply_size(value["result"], "reply.result")
    return ReplyRequest(call_id=call_id, result=value["result"])


def _check_reply_size(value: Any, field: str) -> None:
    # Measured as the worker will send it into the sandbox: compact JSON, by
    # hostwire's iterative encoder (a deep value needs no recursion).
    try:
        hostwire.dumps(value, MAX_REPLY_BYTES)
    except ValueError:
        raise RequestError(f"too large: the limit is {MAX_REPLY_BYTES} bytes of JSON", field) from None
