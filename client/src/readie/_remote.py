"""readie-style remote calls: a Python function run in a sandbox behind ``readie router``.

``Client.call(f, *args, **kwargs)`` pickles the call, sends it with the
Worker API's ``Execute`` (a router serves the same API as a worker), and
decodes the envelope here, the only place it is ever opened. The function's
value comes back; what it printed is written to this process's stdout (or
kept on a :class:`RemoteResult` by :meth:`Client.call_result`); an exception
in the sandbox is raised here as :class:`RemoteError`.

The async forms (:meth:`Client.call_async`, :meth:`Client.call_result_async`,
:meth:`RemoteFunction.aio`) run the same blocking call on a thread rather
than on a second (``grpc.aio``) stack, so both forms share one code path and
one error translation. What async adds is cancellation: a task that stops
awaiting cancels the gRPC call (a :class:`~readie_rpc.client.Cancellation`
handed to ``WorkerClient.execute_call``), and the worker destroys the sandbox
at once instead of letting it run to its timeout.

gRPC and the generated stubs are imported on the first call, so ``import
readie`` stays cheap for programs that only use :class:`~readie.Pool`.
"""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Self, TypeVar, overload

from readie_policy.policy import DEFAULT_TIMEOUT_MS

from ._envelope import RemoteResult, call_payload, check_python, decode_envelope
from ._errors import CallTimeout, RequestError

if TYPE_CHECKING:
    from readie_rpc.client import WorkerClient
    from readie_rpc.client import Cancellation

__all__ = ["DEFAULT_CHECKPOINT", "DEFAULT_TIMEOUT_S", "ROUTER_VARIABLE", "Client", "RemoteFunction", "remote"]

#: Where a Client or @remote without router= finds the router: host:port.
ROUTER_VARIABLE = "READIE_ROUTER"
DEFAULT_CHECKPOINT = "base"
#: The worker's own default for a call (proto: ExecuteRequest.timeout_ms), in seconds.
DEFAULT_TIMEOUT_S = DEFAULT_TIMEOUT_MS / 1000
#: Async calls in flight at once in one process; more wait for a thread (not
#: yet sent, so their timeout has not started). The threads only wait on gRPC.
MAX_ASYNC_CALLS = 64

P = ParamSpec("P")
R = TypeVar("R")


class Client:
    """Calls into sandboxes behind one ``readie router`` (or a single ``readie worker``).

    ``router`` is ``host:port`` (default: ``$READIE_ROUTER``). ``checkpoint``
    is the sandbox image the calls restore (its preloaded packages are
    importable). ``timeout`` bounds each call in seconds; the sandbox is
    destroyed when it runs out. With ``echo_output`` (the default), what a
    call printed is written to ``sys.stdout`` when it returns or raises.
    ``token_file``, ``tls_ca``, ``tls_cert`` and ``tls_key`` say how to reach
    the router (a bearer token in a file; TLS against that CA; a client
    certificate for mTLS). Thread-safe; :meth:`close` (or ``with``) releases
    the connection. The ``*_async`` methods are the same calls for asyncio.
    """

    def __init__(
        self,
        router: str | None = None,
        *,
        checkpoint: str = DEFAULT_CHECKPOINT,
        timeout: float = DEFAULT_TIMEOUT_S,
        echo_output: bool = True,
        token_file: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
    ) -> None:
        self._security = {"token_file": token_file, "ca": tls_ca, "cert": tls_cert, "key": tls_key}
        address = router or os.environ.get(ROUTER_VARIABLE)
        if not address:
            raise ValueError(f"no router: pass router='host:port' or set {ROUTER_VARIABLE}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.router = address
        self.checkpoint = checkpoint
        self.timeout = float(timeout)
        self.echo_output = echo_output
        self._lock = threading.Lock()
        self._worker: WorkerClient | None = None

    def call(self, func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run ``func(*args, **kwargs)`` in a fresh sandbox and return its value.

        Raises :class:`~readie.RemoteError` if it raised there,
        :class:`~readie.VersionMismatch` if this Python cannot exchange pickles
        with the sandbox's, :class:`~readie.RequestError` if the router refused
        the call, :class:`~readie.CallTimeout` past the timeout, and the other
        :class:`~readie.ReadieError` families when no sandbox could run it.
        """
        with self._echoing_failure():
            result = self.call_result(func, *args, **kwargs)
        return self._echoed_value(result)  # type: ignore[no-any-return]

    def call_result(self, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> RemoteResult:
        """Like :meth:`call`, but returns the value with its output and never echoes it."""
        return self._result(func, args, kwargs)

    async def call_async(self, func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """:meth:`call` for asyncio: the same value, errors and echo, without blocking the loop.

        Cancelling the awaiting task (``task.cancel()``, ``asyncio.wait_for``,
        a ``TaskGroup`` that failed) cancels the call: the worker destroys the
        sandbox at once, and nothing is echoed.
        """
        with self._echoing_failure():
            result = await self.call_result_async(func, *args, **kwargs)
        return self._echoed_value(result)  # type: ignore[no-any-return]

    async def call_result_async(self, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> RemoteResult:
        """:meth:`call_result` for asyncio; cancellable as :meth:`call_async` is."""
        from readie_rpc.client import Cancellation

        cancel = Cancellation()
        # Pickling, connecting and the call all happen on the thread: a large
        # argument or the first import of gRPC never stalls the loop.
        loop = asyncio.get_running_loop()
        running = loop.run_in_executor(_threads(), self._result, func, args, kwargs, cancel)
        try:
            return await running
        except asyncio.CancelledError:
            # The thread cannot be interrupted, but its gRPC call can: cancelling
            # it ends the worker's call (and the sandbox), then the thread returns.
            # Not started yet, it never runs (the executor drops it) or sees the
            # cancel as soon as it calls.
            cancel.cancel()
            raise

    def _result(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        cancel: Cancellation | None = None,
    ) -> RemoteResult:
        """The one blocking call, shared by the sync and async forms (``cancel``: the async caller's)."""
        check_python()
        payload = call_payload(func, args, kwargs)
        worker = self._connection()
        from readie_rpc.stubs import MAX_CALL_PAYLOAD_BYTES
        from readie_rpc.client import NEVER

        if len(payload) > MAX_CALL_PAYLOAD_BYTES:
            raise RequestError(
                f"the pickled call is {len(payload)} bytes; a router takes at most {MAX_CALL_PAYLOAD_BYTES}",
                "payload",
            )
        with _translated_errors():
            envelope = worker.execute_call(
                self.checkpoint, payload, self.timeout, cancel=NEVER if cancel is None else cancel
            )
        return decode_envelope(envelope)

    @contextmanager
    def _echoing_failure(self) -> Iterator[None]:
        """A failed call's output (a RemoteError's prints) is echoed as a returned call's is."""
        try:
            yield
        except Exception as exc:
            if self.echo_output:
                _echo(getattr(exc, "output", ()))
            raise

    def _echoed_value(self, result: RemoteResult) -> Any:
        if self.echo_output:
            _echo(result.output)
        return result.value

    def close(self) -> None:
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _connection(self) -> WorkerClient:
        with self._lock:
            if self._worker is None:
                from readie_rpc.client import WorkerClient
                from readie_rpc.security import ClientSecurity

                files = {name: None if value is None else Path(value) for name, value in self._security.items()}
                self._worker = WorkerClient(self.router, ClientSecurity.from_files(**files))
            return self._worker


class RemoteFunction(Generic[P, R]):
    """A function whose calls run remotely; ``.local(...)`` runs it here, ``.result(...)`` keeps the output,
    ``await .aio(...)`` is the call on asyncio."""

    def __init__(
        self, func: Callable[P, R], *, checkpoint: str, router: str | None, timeout: float, echo_output: bool
    ) -> None:
        functools.update_wrapper(self, func)
        self.local = func
        self._options = {"checkpoint": checkpoint, "timeout": timeout, "echo_output": echo_output}
        self._router = router
        self._client: Client | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.client().call(self.local, *args, **kwargs)

    def result(self, *args: P.args, **kwargs: P.kwargs) -> RemoteResult:
        return self.client().call_result(self.local, *args, **kwargs)

    async def aio(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """``await f.aio(...)``: :meth:`Client.call_async` (Modal's spelling).

        A cancelled await frees the sandbox at once."""
        return await self.client().call_async(self.local, *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # Picklable (another remote function may refer to this one), without
        # its connection and lock, which are made again on first use.
        state = dict(self.__dict__)
        state.update(_client=None, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def client(self) -> Client:
        """The client, made on first use (so ``$READIE_ROUTER`` may be set after decorating)."""
        with self._lock:
            if self._client is None:
                self._client = Client(self._router, **self._options)  # type: ignore[arg-type]
            return self._client


@overload
def remote(func: Callable[P, R], /) -> RemoteFunction[P, R]: ...
@overload
def remote(
    *,
    checkpoint: str = ...,
    router: str | None = ...,
    timeout: float = ...,
    echo_output: bool = ...,
) -> Callable[[Callable[P, R]], RemoteFunction[P, R]]: ...
def remote(
    func: Callable[P, R] | None = None,
    /,
    *,
    checkpoint: str = DEFAULT_CHECKPOINT,
    router: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    echo_output: bool = True,
) -> Any:
    """Decorate a function so that calling it runs it in a sandbox: ``@remote`` or ``@remote(checkpoint="pandas")``.

    The options are :class:`Client`'s; ``router`` defaults to ``$READIE_ROUTER``
    at the first call.
    """

    def decorate(f: Callable[P, R]) -> RemoteFunction[P, R]:
        return RemoteFunction(f, checkpoint=checkpoint, router=router, timeout=timeout, echo_output=echo_output)

    return decorate(func) if func is not None else decorate


def _translated_errors() -> AbstractContextManager[None]:
    """The worker client's errors, as the client's public ones: the one translation of this boundary."""
    from readie_protocol.errors import ExecutorTimeout, mapped_errors

    return mapped_errors({
        RequestError: lambda exc: RequestError(exc.reason, exc.field),  # anew: no worker's result or chain
        ExecutorTimeout: lambda exc: CallTimeout(f"the remote call did not finish in time: {exc}"),
    })


_executor: tuple[int, ThreadPoolExecutor] | None = None
_executor_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    """The async calls' own threads, not the loop's default executor.

    That one has ``min(32, cpus + 4)`` threads and is shared with the rest of
    the program (``asyncio.to_thread``, the loop's DNS lookups), so a few
    long remote calls would hold it all. Made again in a forked child, whose
    copy of the parent's executor has no threads behind it.
    """
    global _executor
    with _executor_lock:
        if _executor is None or _executor[0] != os.getpid():
            _executor = (os.getpid(), ThreadPoolExecutor(MAX_ASYNC_CALLS, thread_name_prefix="readie-remote"))
        return _executor[1]


def _echo(output: Any) -> None:
    text = "".join(output) if isinstance(output, tuple | list) else ""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
