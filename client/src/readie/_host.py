"""Host functions on the client's side: the pool's ``call`` events run as Python calls here.

A job (or session) run with ``functions={"search": search}`` declares the
names; when its code calls one, the pool writes a ``call`` event and waits
for a ``reply`` line. :class:`HostCallRunner` runs each call on one of a few
threads of its own, never on the thread that reads the pool's stdout (a
callable that takes long, or a reply line that waits for the stdin lock
while another thread's request line waits for the pool, must not stop the
results and call events behind it), and writes the reply, the protocol's
:class:`~readie_protocol.replies.ReplyRequest`, as
:func:`~readie_protocol.request_lines.reply_line` writes it:

* the callable's return value as ``result``, encoded by the same lossless,
  iterative encoder the sandbox uses (:func:`readie_executor.hostwire.dumps`),
  at most 1,000,000 bytes of JSON;
* an exception as ``error``: ``str(exc)`` (its class name when that is
  empty), which the sandbox's code sees as ``readie_host.HostError``; a
  value that cannot be sent (not JSON, NaN, too large) is an error too.

A call for a name or a request this client did not declare (which the pool
never forwards) is answered with an error, so nothing waits on it. (A call
event that is not well formed is the pool breaking the protocol: the
connection refuses it, and the pool with it.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from readie_executor.hostwire import function_name_problem
from readie_protocol.events import CallEvent
from readie_protocol.replies import ReplyRequest
from readie_protocol.request_lines import reply_line

from ._errors import PoolError, RequestError

__all__ = [
    "HostCallRunner",
    "HostFunctions",
    "check_functions",
    "error_reply",
    "failed_reply",
    "missing_reply",
    "value_reply",
]

HostFunctions = Mapping[str, Callable[..., Any]]

#: Error texts are cut here: well within the pool's 1 MB per reply even when
#: every character needs a 6-byte escape.
MAX_ERROR_CHARS = 100_000


def check_functions(functions: HostFunctions | None) -> dict[str, Callable[..., Any]]:
    """``functions`` as a dict, checked before anything is sent: names the sandbox can import, callables."""
    if functions is None:
        return {}
    if not isinstance(functions, Mapping):
        kind = type(functions).__name__
        raise TypeError(f"functions: expected a mapping of names to callables, got {kind}")
    checked = {}
    for name, function in functions.items():
        problem = function_name_problem(name)
        if problem is not None:
            raise RequestError(problem, "functions")
        if not callable(function):
            raise TypeError(f"functions: {name!r} is a {type(function).__name__}, not a callable")
        checked[name] = function
    return checked


def error_reply(call_id: int, text: str) -> ReplyRequest:
    """The reply carrying ``text`` as the error, cut and made valid UTF-8."""
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + " [cut]"
    text = text.encode("utf-8", "replace").decode("utf-8")  # lone surrogates: the pool refuses them
    return ReplyRequest(call_id, error=text)


def answer(
    function: Callable[..., Any] | None, name: str, call_id: int, args: list[Any], kwargs: dict[str, Any]
) -> bytes:
    """Run one call and return its reply line; never raises for what the callable does."""
    if function is None:
        return missing_reply(call_id, name)
    try:
        value = function(*args, **kwargs)
    except Exception as exc:
        return failed_reply(call_id, exc)
    return value_reply(call_id, name, value)


def missing_reply(call_id: int, name: str) -> bytes:
    """The reply line to a call of a function the task did not declare here."""
    return reply_line(error_reply(call_id, f"{name}: this client has no such host function for the task"))


def failed_reply(call_id: int, exc: Exception) -> bytes:
    """The reply line to a call whose callable raised ``exc``."""
    return reply_line(error_reply(call_id, str(exc) or type(exc).__name__))


def value_reply(call_id: int, name: str, value: Any) -> bytes:
    """The line of the reply carrying ``value``, or of an error saying why it cannot be sent."""
    try:
        return reply_line(ReplyRequest(call_id, result=value))
    except (TypeError, ValueError) as exc:
        return reply_line(error_reply(call_id, f"{name} returned a value that cannot be sent: {exc}"))


class HostCallRunner:
    """The declared functions of the requests in flight, and the threads that run their calls."""

    def __init__(self, send: Callable[[bytes], None], threads: int) -> None:
        self._send = send
        self.threads = threads  # set to the pool's workers once they are known
        self._lock = threading.Lock()
        self._by_request: dict[Any, dict[str, Callable[..., Any]]] = {}
        self._answering: set[Any] = set()  # requests whose call is being answered
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    def register(self, request_id: Any, functions: dict[str, Callable[..., Any]]) -> None:
        with self._lock:
            self._by_request[request_id] = functions

    def unregister(self, request_id: Any) -> None:
        with self._lock:
            self._by_request.pop(request_id, None)

    def handle(self, event: CallEvent) -> None:
        """Start answering one ``call`` event (on the reader thread: never blocks).

        A task waits on its one call, so a second call of a request before its
        first was answered is the pool breaking the protocol (:class:`PoolError`):
        answering it would let a pool queue work here without end.
        """
        with self._lock:
            if event.id in self._answering:
                raise PoolError(
                    f"readie pool broke the protocol: a second call of request {event.id!r} before its first was answered"
                )
            self._answering.add(event.id)
            functions = self._by_request.get(event.id, {})
        function = functions.get(event.function)
        self._submit(event.id, lambda: answer(function, event.function, event.call_id, event.args, event.kwargs))

    def _submit(self, request_id: Any, reply: Callable[[], bytes]) -> None:
        with self._lock:
            if self._closed:
                return
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max(1, self.threads), thread_name_prefix="readie-host")
            self._executor.submit(self._run, request_id, reply)

    def _run(self, request_id: Any, reply: Callable[[], bytes]) -> None:
        line = reply()
        # Before the reply goes out: the task's next call may come the moment the pool has it.
        with self._lock:
            self._answering.discard(request_id)
        self._send(line)

    def close(self) -> None:
        """Run no more calls; calls running now finish (their replies may find stdin closed)."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
