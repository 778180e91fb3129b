"""The ``/metrics`` endpoint: one thread of its own, whatever its clients do.

prometheus_client's own server starts a thread per connection and waits on
each without a timeout, so every idle connection held a thread (40 idle
connections, 40 threads, and jobs slowed while they were held). This one runs
an event loop on a single daemon thread: an idle connection costs a
descriptor, not a thread, and it is bounded three ways. Each connection has
:data:`EXCHANGE_TIMEOUT_S` for its whole exchange (request read, answer
written); its request may be at most :data:`MAX_REQUEST_BYTES`; and at most
:data:`MAX_CONNECTIONS` are open at once. At that bound a new connection
closes the oldest one still silent, so a scraper, which sends its request
the moment it connects, is served however many idle connections are held
open, and the endpoint never holds more descriptors than the bound.

One answer per connection (``Connection: close``): ``GET /metrics`` (or
``/``) gets the registry in the format the ``Accept`` header asks for
(prometheus_client's encoders); any other path 404, any other method 405.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable

import structlog
from prometheus_client.exposition import choose_encoder

__all__ = ["EXCHANGE_TIMEOUT_S", "MAX_CONNECTIONS", "MAX_REQUEST_BYTES", "MetricsEndpoint", "render_registry"]

log = structlog.get_logger("readie.metrics")

#: A scraper sends its request as it connects and reads a few KiB back within
#: milliseconds; five seconds is generous for a loaded host, and a connection
#: still open after it is holding the endpoint, not scraping it.
EXCHANGE_TIMEOUT_S = 5.0
#: Open connections at once. One scraper uses one at a time; a few more for
#: people with curl. Past this the oldest silent one is closed.
MAX_CONNECTIONS = 16
#: A request line and headers: a scrape sends a few hundred bytes.
MAX_REQUEST_BYTES = 8 * 1024
#: How long :meth:`MetricsEndpoint.close` waits for the thread to finish.
_CLOSE_WAIT_S = 5.0
_PATHS = ("/metrics", "/")


class MetricsEndpoint:
    """Serves ``render(accept_header) -> (body, content_type)`` on ``host:port`` until :meth:`close`.

    The socket is bound before the constructor returns, so an unusable
    address raises OSError to the caller.
    """

    def __init__(
        self,
        host: str,
        port: int,
        render: Callable[[str], tuple[bytes, str]],
        *,
        exchange_timeout_s: float = EXCHANGE_TIMEOUT_S,
    ) -> None:
        self._render = render
        self._timeout_s = exchange_timeout_s
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self._socket = socket.create_server((host, port), family=family)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        self._loop = asyncio.new_event_loop()
        # Connections by their writer, oldest first; True once its request was read (being answered).
        self._open: dict[asyncio.StreamWriter, bool] = {}
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="readie-metrics", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed

    def close(self) -> None:
        """Stop listening and drop every connection; returns once the thread has ended."""
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_CLOSE_WAIT_S)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            server = self._loop.run_until_complete(
                asyncio.start_server(self._connected, sock=self._socket, limit=MAX_REQUEST_BYTES)
            )
        except BaseException as exc:  # handed to the constructor, which raises it
            self._failed = exc
            self._socket.close()
            self._loop.close()
            self._ready.set()
            return
        self._loop.call_soon(self._ready.set)
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for writer in list(self._open):
                writer.transport.abort()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= MAX_CONNECTIONS and not self._make_room():
            writer.transport.abort()  # every slot is answering a request: they finish within the timeout
            return
        self._open[writer] = False
        try:
            async with asyncio.timeout(self._timeout_s):
                head = await reader.readuntil(b"\r\n\r\n")
                self._open[writer] = True
                writer.write(self._answer(head))
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # silent too long, too large a request, or gone: closed below, nothing to tell
        finally:
            self._open.pop(writer, None)
            writer.transport.abort()

    def _make_room(self) -> bool:
        """Close the oldest connection that has not sent its request; whether there was one."""
        silent = next((writer for writer, answering in self._open.items() if not answering), None)
        if silent is None:
            return False
        del self._open[silent]
        silent.transport.abort()  # its readuntil ends with IncompleteReadError
        return True

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        path = rest.partition(" ")[0].partition("?")[0]
        if method != "GET":
            return _response("405 Method Not Allowed", b"only GET\n", "text/plain", "Allow: GET\r\n")
        if path not in _PATHS:
            return _response("404 Not Found", b"metrics are at /metrics\n", "text/plain")
        accept = next((value for name, _, value in (line.partition(":") for line in lines[1:])
                       if name.strip().lower() == "accept"), "")
        try:
            body, content_type = self._render(accept.strip())
        except Exception:  # a collector's bug: the scrape fails, the endpoint stays
            log.exception("metrics collection failed")
            return _response("500 Internal Server Error", b"collection failed\n", "text/plain")
        return _response("200 OK", body, content_type)


def render_registry(registry: object) -> Callable[[str], tuple[bytes, str]]:
    """The body and content type of ``registry`` in the format an ``Accept`` header asks for."""

    def render(accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        return encoder(registry), content_type  # type: ignore[arg-type]

    return render


def _response(status: str, body: bytes, content_type: str, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n{extra}\r\n"
    )
    return head.encode("latin-1") + body
