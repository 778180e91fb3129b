"""readie-style remote calls: a Python function run in a sandbox behind ``readie router``.

``Client.call(f, *args, **kwargs)`` pickles the call, sends it with the
Worker API's ``Execute`` (a router serves the same API as a worker), and
decodes the envelope here, the only place it is ever opened. The function's
value comes back; what it printed is written to this process's stdout (or
kept on a :class:`RemoteResult` by :meth:`Client.call_result`); an exception
in the sandbox is raised here as :class:`RemoteError`.

gRPC and the generated stubs are imported on the first call, so ``import
readie`` stays cheap for programs that only use :class:`~readie.Pool`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Self, TypeVar, overload

from ._envelope import RemoteResult, call_payload, check_python, decode_envelope
from ._errors import CallTimeout, RequestError

if TYPE_CHECKING:
    from readie_rpc.client import WorkerClient

__all__ = ["DEFAULT_CHECKPOINT", "DEFAULT_TIMEOUT_S", "ROUTER_VARIABLE", "Client", "RemoteFunction", "remote"]

#: Where a Client or @remote without router= finds the router: host:port.
ROUTER_VARIABLE = "READIE_ROUTER"
DEFAULT_CHECKPOINT = "base"
#: The worker's own default for a call (proto: ExecuteRequest.timeout_ms).
DEFAULT_TIMEOUT_S = 30.0

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
    the connection.
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
        try:
            result = self.call_result(func, *args, **kwargs)
        except Exception as exc:
            if self.echo_output:
                _echo(getattr(exc, "output", ()))
            raise
        if self.echo_output:
            _echo(result.output)
        return result.value  # type: ignore[no-any-return]

    def call_result(self, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> RemoteResult:
        """Like :meth:`call`, but returns the value with its output and never echoes it."""
        check_python()
        payload = call_payload(func, args, kwargs)
        worker = self._connection()
        from readie_rpc.stubs import MAX_CALL_PAYLOAD_BYTES

        if len(payload) > MAX_CALL_PAYLOAD_BYTES:
            raise RequestError(
                f"the pickled call is {len(payload)} bytes; a router takes at most {MAX_CALL_PAYLOAD_BYTES}",
                "payload",
            )
        with _translated_errors():
            envelope = worker.execute_call(self.checkpoint, payload, self.timeout)
        return decode_envelope(envelope)

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
    """A function whose calls run remotely; ``.local(...)`` runs it here, ``.result(...)`` keeps the output."""

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


@contextmanager
def _translated_errors() -> Iterator[None]:
    """The worker client's errors, as the client's public ones: the one translation of this boundary."""
    from readie_worker.errors import RequestError as WorkerRequestError
    from readie_worker.sandbox import ExecutorTimeout

    try:
        yield
    except WorkerRequestError as exc:
        raise RequestError(exc.reason, exc.field) from None
    except ExecutorTimeout as exc:
        raise CallTimeout(f"the remote call did not finish in time: {exc}") from None


def _echo(output: Any) -> None:
    text = "".join(output) if isinstance(output, tuple | list) else ""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
