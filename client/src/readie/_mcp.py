"""``readie mcp``: a Model Context Protocol server whose ``run_python`` runs code in readie's sandboxes.

    readie mcp [--config readie.toml] [--workers N] [--preload pandas,numpy] [--checkpoints DIR]
               [--router HOST:PORT] [--profile NAME] [--allow-read PATH] [--allow-write PATH]
               [--allow-network] [--timeout 30s] [--memory 512m]
               [--max-sessions 8] [--session-idle 5m]
               [--http HOST:PORT [--token-file FILE] [--tls-cert PEM --tls-key PEM] [--insecure]]
               [--log json]

It starts one ``readie pool`` (a :class:`~readie.Pool`, so ``--config`` with
the operator's ceiling and profiles, ``--workers``, ``--preload`` and
``--router`` are the pool's) and serves MCP on stdio, or on streamable HTTP
with ``--http``. Logs go to stderr (structlog); on stdio, stdout is the MCP
channel and nothing else writes to it. The tools are ``_mcp_tools``'s.

HTTP is closed by default: a loopback address serves as it is (with DNS
rebinding protection: the SDK checks Host and Origin); any other address
needs ``--token-file`` (every request must carry ``Authorization: Bearer``
with the file's token, compared in constant time) and TLS (``--tls-cert``,
``--tls-key``) unless ``--insecure`` says a proxy in front provides it.
A token given on loopback is required there too. Exit status: 2 for usage
(a refused combination, a bad flag), 1 when the pool cannot start.
"""

from __future__ import annotations

import argparse
import hmac
import shlex
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from readie_protocol.units import parse_duration_ms
from readie_rpc.security import read_token
from readie_protocol.errors import ReadieError
from readie_policy.logs import configure_logging

from ._errors import PoolError
from ._mcp_tools import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_IDLE_S, SessionLimits, build_server
from ._pool import Pool

__all__ = ["HTTP_PATH", "build_parser", "main"]

log = structlog.get_logger("readie.mcp")

EXIT_USAGE = 2
EXIT_FAILED = 1
#: Closing drains the pool: running calls finish (each within its own timeout,
#: 30 s under the demo ceiling); past this the pool is stopped.
POOL_CLOSE_TIMEOUT_S = 60.0
#: Where streamable HTTP serves MCP (the SDK's default path).
HTTP_PATH = "/mcp"

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class UsageError(Exception):
    """A refused combination of flags; the message says which and what to add."""


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv[1:])  # argv[0] is "mcp"
    configure_logging(json=args.log == "json", process="mcp")
    try:
        limits = _limits(args)
        grants = _grants(args)
        http = _http_settings(args) if args.http is not None else None
    except (UsageError, ReadieError, ValueError) as exc:
        _fail(str(exc))
        return EXIT_USAGE
    stop = _Stop()  # from here on, SIGTERM and SIGINT stop the server instead of killing it
    try:
        pool = Pool(
            workers=args.workers, preload=args.preload or (), config=args.config, router=args.router,
            checkpoints=args.checkpoints, command=shlex.split(args.readie_command) if args.readie_command else None,
            token_file=args.router_token_file, tls_ca=args.router_tls_ca,
        )
    except (ReadieError, TypeError) as exc:
        _fail(f"cannot start the pool: {exc}")
        return EXIT_FAILED
    log.info("pool ready", pid=pool.pid, workers=pool.ready.workers, profiles=list(pool.ready.profiles),
             transport="http" if http else "stdio")
    try:
        server, tools = build_server(pool, grants, limits)
    except (ReadieError, TypeError) as exc:  # a grant the client refuses before sending (a bad size, ...)
        _close(pool)
        _fail(str(exc))
        return EXIT_USAGE
    if stop.requested.is_set():
        return _close(pool)

    async def serve() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(tools.sweep_idle)
            if http is None:
                await group.start(stop.on_signals, group.cancel_scope)
            try:
                if http is None:
                    await server.run_stdio_async()
                else:
                    await _serve_http(server, http, stop)
            finally:
                group.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await tools.close_all()

    anyio.run(serve)
    return _close(pool)


class _Stop:
    """SIGTERM or SIGINT: stop serving; the pool is then drained and closed, and the exit is 0.

    A Python handler notes a signal that comes while the pool starts (or after
    uvicorn, which handles them itself while it serves, shut down and raised
    it again); on stdio, an anyio receiver takes over while serving.
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: object) -> None:
        if self.requested.is_set():
            raise KeyboardInterrupt  # a second signal while the pool starts or drains: stop waiting
        self.requested.set()

    async def on_signals(self, scope: anyio.CancelScope, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            if not self.requested.is_set():
                async for signum in signals:
                    log.info("signal received", signal=signal.Signals(signum).name)
                    break
            scope.cancel()


def _close(pool: Pool) -> int:
    """Drain the pool (accepted jobs finish); 1 if it did not exit cleanly."""
    try:
        pool.close(timeout=POOL_CLOSE_TIMEOUT_S)
    except PoolError as exc:
        # A pool that already failed was reported to every call; say it once more and exit 1.
        log.error("pool closed with an error", error=str(exc))
        return EXIT_FAILED
    log.info("closed")
    return 0


# ---------------------------------------------------------------------------- HTTP


#: Hosts ``--http`` may bind without a token: loopback, by the names the SDK's rebinding check knows.
TOKEN_FREE_HOSTS = ("127.0.0.1", "localhost", "::1")


class _HttpSettings:
    def __init__(self, host: str, port: int, token: str | None, cert: Path | None, key: Path | None) -> None:
        self.host, self.port, self.token, self.cert, self.key = host, port, token, cert, key


def _http_settings(args: argparse.Namespace) -> _HttpSettings:
    address: str = args.http
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or not host:
        raise UsageError(f"--http {address!r}: expected HOST:PORT, e.g. 127.0.0.1:8765")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    # Token-free only on the names the SDK guards against DNS rebinding (it checks Host and Origin
    # for exactly these); any other address, 127.0.0.2 and ::ffff:127.0.0.1 too, needs the token.
    loopback = host.strip("[]") in TOKEN_FREE_HOSTS
    if not loopback and args.token_file is None:
        raise UsageError(
            f"refusing to serve {address} to anyone who can reach it: pass --token-file "
            "(clients then send 'Authorization: Bearer <token>'), or bind 127.0.0.1"
        )
    if not loopback and args.tls_cert is None and not args.insecure:
        raise UsageError(
            f"refusing to send the token and the code's output in plaintext on {address}: pass --tls-cert "
            "and --tls-key, or --insecure if a proxy in front terminates TLS"
        )
    token = read_token(args.token_file) if args.token_file is not None else None
    return _HttpSettings(host.strip("[]"), int(port_text), token, args.tls_cert, args.tls_key)


def require_token(app: ASGIApp, token: str) -> ASGIApp:
    """An ASGI app that answers 401 to any HTTP request without ``Authorization: Bearer <token>``."""
    expected = f"Bearer {token}".encode()

    async def guarded(scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                await send({"status": 401, "type": "http.response.start", "headers": [
                    (b"content-type", b"application/json"), (b"www-authenticate", b'Bearer realm="readie"')]})
                await send({"type": "http.response.body", "body": b'{"error": "a valid bearer token is required"}'})
                return
        await app(scope, receive, send)

    return guarded


async def _serve_http(server: Any, http: _HttpSettings, stop: _Stop) -> None:
    import uvicorn

    app: ASGIApp = server.streamable_http_app(streamable_http_path=HTTP_PATH, host=http.host)
    if http.token is not None:
        app = require_token(app, http.token)
    config = uvicorn.Config(
        app, host=http.host, port=http.port, log_config=None, access_log=False, log_level="warning",
        ssl_certfile=str(http.cert) if http.cert else None, ssl_keyfile=str(http.key) if http.key else None,
    )
    uvicorn_server = uvicorn.Server(config)

    async def announce() -> None:
        while not uvicorn_server.started:
            await anyio.sleep(0.05)
        if stop.requested.is_set():  # a signal before uvicorn took them over
            uvicorn_server.should_exit = True
        for listener in uvicorn_server.servers:
            for sock in listener.sockets:
                host, port = sock.getsockname()[:2]
                scheme = "https" if http.cert else "http"
                log.info("serving MCP", url=f"{scheme}://{_url_host(host)}:{port}{HTTP_PATH}", token=http.token is not None)

    async with anyio.create_task_group() as group:
        group.start_soon(announce)
        await uvicorn_server.serve()
        group.cancel_scope.cancel()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# ---------------------------------------------------------------------------- flags


def _limits(args: argparse.Namespace) -> SessionLimits:
    idle_s = DEFAULT_SESSION_IDLE_S if args.session_idle is None else parse_duration_ms(args.session_idle) / 1000
    max_sessions = DEFAULT_MAX_SESSIONS if args.max_sessions is None else args.max_sessions
    from readie_policy.config import DEFAULT_SESSION_IDLE_MS, load_config

    pool_idle_s = DEFAULT_SESSION_IDLE_MS / 1000
    if args.config is not None:
        # The pool's own bounds apply first; ours must not promise more than it keeps.
        pool_settings = load_config(args.config).pool
        max_sessions = min(max_sessions, pool_settings.max_sessions)
        pool_idle_s = pool_settings.session_idle_ms / 1000
    # Ours closes first, by two sweeps' margin: a session the pool closed for idleness would come
    # back as a new one without the operator's grants and limits.
    limits = SessionLimits(max_sessions=max_sessions, session_idle_s=idle_s)
    cap = max(pool_idle_s - 2 * limits.sweep_interval_s, pool_idle_s / 2)
    return SessionLimits(max_sessions=max_sessions, session_idle_s=min(idle_s, cap))


def _grants(args: argparse.Namespace) -> dict[str, Any]:
    grants: dict[str, Any] = {}
    if args.profile:
        grants["profile"] = args.profile
    if args.allow_read:
        grants["allow_read"] = list(args.allow_read)
    if args.allow_write:
        grants["allow_write"] = list(args.allow_write)
    if args.allow_network:
        grants["allow_network"] = True
    for key in ("timeout", "memory", "max_output", "max_file_size"):
        value = getattr(args, key)
        if value is not None:
            grants[key] = int(value) if value.isdigit() else value  # bare digits: seconds / bytes
    return grants


def _preload(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="readie mcp", description="serve run_python over the Model Context Protocol (stdio, or HTTP with --http)"
    )
    pool = parser.add_argument_group("the pool (as readie pool takes them)")
    pool.add_argument("--config", metavar="FILE", help="pool configuration (TOML): the ceiling, profiles, [pool] settings")
    pool.add_argument("--workers", type=int, help="jobs run at once (default: [pool] workers, else 2)")
    pool.add_argument("--preload", type=_preload, metavar="A,B", help="modules every job finds imported")
    pool.add_argument("--checkpoints", metavar="DIR", help="the checkpoints (default: where readie pool finds them)")
    pool.add_argument("--router", metavar="HOST:PORT", help="run the jobs through a readie router")
    pool.add_argument("--router-token-file", type=Path, metavar="FILE", help="the bearer token the router requires")
    pool.add_argument("--router-tls-ca", type=Path, metavar="PEM", help="use TLS to the router; its certificate's CA")
    pool.add_argument("--readie-command", metavar="CMD", help="the readie command that runs the pool (default: this Python's)")
    jobs = parser.add_argument_group("what every call gets (held to the config's ceiling)")
    jobs.add_argument("--profile", metavar="NAME", help="a [profiles.NAME] of the config for every call")
    jobs.add_argument("--allow-read", action="append", metavar="PATH", help="a path the code may read (repeatable)")
    jobs.add_argument("--allow-write", action="append", metavar="PATH", help="a path the code may write (repeatable)")
    jobs.add_argument("--allow-network", action="store_true", help="network access (the ceiling must allow it)")
    jobs.add_argument("--timeout", metavar="DURATION", help="each call's default time limit, e.g. 30s")
    jobs.add_argument("--memory", metavar="SIZE", help="each call's memory limit, e.g. 512m")
    jobs.add_argument("--max-output", metavar="SIZE", help="bytes of stdout and stderr kept per call")
    jobs.add_argument("--max-file-size", metavar="SIZE", help="largest file a call may write")
    sessions = parser.add_argument_group("sessions")
    sessions.add_argument("--max-sessions", type=int, metavar="N",
                          help=f"sessions open at once (default {DEFAULT_MAX_SESSIONS}, at most the pool's; 0 disables them)")
    sessions.add_argument("--session-idle", metavar="DURATION",
                          help="close a session unused this long (default 5m, at most the pool's session_idle)")
    http = parser.add_argument_group("streamable HTTP instead of stdio")
    http.add_argument("--http", metavar="HOST:PORT", help="serve MCP at http://HOST:PORT/mcp (loopback unless protected)")
    http.add_argument("--token-file", type=Path, metavar="FILE", help="require 'Authorization: Bearer <the file's token>'")
    http.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve HTTPS with this certificate")
    http.add_argument("--tls-key", type=Path, metavar="PEM", help="the key of --tls-cert")
    http.add_argument("--insecure", action="store_true", help="allow plaintext HTTP beyond loopback (a token is still required)")
    parser.add_argument("--log", choices=("json", "console"), default="console", help="log format on stderr")
    return parser


def _fail(message: str) -> None:
    sys.stderr.write(f"readie mcp: {message}\n")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main(["mcp", *sys.argv[1:]]))
