"""``readie_host`` (alias ``pynox_host``): the host functions a job declared, for its code.

For the job's duration the runner puts a fresh module under both names in
``sys.modules``, holding only the declared names and :class:`HostError`.
Calling one encodes the arguments as JSON (:mod:`readie_executor.hostwire`),
sends a call frame on the executor's connection to the worker, and blocks
until the worker's reply: the result is returned, an error is raised as
``HostError`` with the host's text.

The functions themselves are one object per name for the life of the
process, and look up the running task when called: a session step that
imported ``search`` in an earlier step still calls it, under the functions
the current step declared. Outside a task (a thread the job left behind) a
call raises HostError.

Nothing here is a boundary: the job runs in this process and can write any
frame on the socket itself. The worker validates every frame
(``readie_worker._host_frames``); this module is the honest client.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .. import _channel, hostwire

MODULE_NAMES = ("readie_host", "pynox_host")
MODULE_DOC = (
    "Host functions of this task: call them like Python functions. Arguments and "
    "results are JSON (at most 1 MB each way); a failure on the host side raises HostError."
)


class HostError(Exception):
    """A host function failed; the message is the host's own text."""


HostError.__module__ = "readie_host"


@dataclass
class _Task:
    functions: frozenset[str]
    calls: int = 0


_task: _Task | None = None
# One frame and its reply at a time on the connection, across threads and
# across a session's steps (a thread of an earlier step may still call).
_channel_lock = threading.Lock()
_functions: dict[str, Callable[..., Any]] = {}


@contextlib.contextmanager
def declared(functions: tuple[str, ...]) -> Iterator[types.ModuleType]:
    """Install ``readie_host`` with ``functions`` for the duration of one task."""
    global _task
    module = types.ModuleType(MODULE_NAMES[0], MODULE_DOC)
    module.HostError = HostError  # type: ignore[attr-defined]
    for name in functions:
        setattr(module, name, _function(name))
    module.__all__ = [*functions, "HostError"]  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in MODULE_NAMES}
    for name in MODULE_NAMES:
        sys.modules[name] = module
    _task = _Task(frozenset(functions))
    try:
        yield module
    finally:
        _task = None
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


def _function(name: str) -> Callable[..., Any]:
    function = _functions.get(name)
    if function is None:

        def function(*args: Any, **kwargs: Any) -> Any:
            return call(name, args, kwargs)

        function.__name__ = function.__qualname__ = name
        function.__module__ = MODULE_NAMES[0]
        function.__doc__ = f"The host function {name!r}. {MODULE_DOC}"
        _functions[name] = function
    return function


def call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call the host function ``name``; raises HostError, or TypeError/ValueError for arguments
    that are not JSON."""
    task = _task
    if task is None:
        raise HostError(
            f"{name}: host functions can be called only while the task that declared them runs"
        )
    if name not in task.functions:
        raise HostError(f"{name} is not a host function of this task")
    channel = _channel.current()
    if channel is None:
        raise HostError(f"{name}: no host channel (the job was not started by a worker)")
    with _channel_lock:
        if _task is not task:
            raise HostError(f"{name}: the task that declared it has ended")
        if task.calls >= hostwire.MAX_CALLS_PER_TASK:
            raise HostError(
                f"{name}: this task has made its {hostwire.MAX_CALLS_PER_TASK} host calls; "
                "no more are allowed"
            )
        call_id = task.calls + 1
        try:
            frame = hostwire.encode_call(call_id, name, args, kwargs)
        except (TypeError, ValueError) as exc:  # not JSON, or too much of it: the caller's to fix
            raise type(exc)(f"{name}(): {exc}") from None
        task.calls = call_id
        try:
            channel.send(frame)
            while True:
                reply_id, result, error = _decode_reply(channel.receive())
                # Another id answers a frame the job wrote on the socket by hand: skipped.
                if type(reply_id) is int and reply_id == call_id:
                    break
        except _channel.ChannelBroken as exc:
            raise HostError(f"{name}: the connection to the host failed: {exc}") from None
    if error is not None:
        raise HostError(error)
    return result


def _decode_reply(payload: bytes) -> tuple[object, Any, str | None]:
    """A reply from the worker (trusted, but checked): its call id, result and error."""
    if not payload.startswith(hostwire.REPLY_PREFIX):
        raise HostError("the worker sent something other than a reply")
    try:
        document = hostwire.loads(payload)
    except hostwire.WireError as exc:
        raise HostError(f"the worker's reply is not valid JSON: {exc}") from None
    reply = document.get("reply") if isinstance(document, dict) else None
    if not isinstance(reply, dict) or ("result" in reply) == ("error" in reply):
        raise HostError("the worker's reply has neither a result nor an error")
    error = reply.get("error")
    if "error" in reply and not isinstance(error, str):
        raise HostError("the worker's reply has an error that is not text")
    return reply.get("call_id"), reply.get("result"), error
