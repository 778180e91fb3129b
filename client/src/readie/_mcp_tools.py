"""The tools of ``readie mcp``: ``run_python`` and ``close_session`` over one :class:`~readie.Pool`.

Transport-free: :func:`build_server` returns an :class:`mcp.server.MCPServer`
whose tools drive a pool the caller started (``_mcp.py`` adds the command
line, stdio and streamable HTTP). A job's outcome, whatever it is, is a tool
result the model reads (:func:`~readie.format_result`, then the images and
text files the code saved, ``_mcp_files``), with ``isError`` set when the code failed; a refusal (:class:`~readie.RequestError`) and a pool
that died are tool errors too, with the pool's own words. Nothing here
raises into the MCP server: a broken pool must not take the server down, and
every answer comes from the pool or from a failure already recorded, so no
call waits for a pool that is gone.

Named sessions (``session="analysis"``) keep one sandbox's ``__main__``
between calls. :class:`Sessions` bounds them in number and in idle time
(:class:`SessionLimits`) and closes the idle ones itself, before the pool's own
``session_idle`` would close them behind the model's back.
"""

from __future__ import annotations

import importlib.metadata
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import anyio
import anyio.to_thread
import structlog
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import Field
from readie_protocol.events import Result
from readie_protocol.units import parse_duration_ms
from readie_policy.policy import DEFAULT_TIMEOUT_MS

from ._errors import PoolError, ReadieError, RequestError
from ._mcp_files import (
    DEFAULT_COLLECT,
    Base64File,
    CollectArgument,
    FilesArgument,
    Shown,
    describe_files,
    file_contents,
    model_files,
)
from ._pool import Pool
from ._requests import session_setup
from ._session import Session
from ._tool import CODE_NAME, DEFAULT_TOOL_NAME, describe, format_result

__all__ = [
    "CLOSE_TOOL_NAME",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_IDLE_S",
    "MAX_SESSION_NAME_CHARS",
    "SessionLimits",
    "Sessions",
    "build_server",
]

log = structlog.get_logger("readie.mcp")

CLOSE_TOOL_NAME = "close_session"
#: Each open session holds a restored sandbox (70-140 MB of gVisor sentry and
#: gofer plus what its Python holds) for as long as it lives, and one agent
#: seldom works in more than a couple of notebooks at once; eight bounds the
#: memory a forgetful model can pin at about a gigabyte.
DEFAULT_MAX_SESSIONS = 8
#: Half the pool's default ``session_idle`` (10 min): the server closes a
#: session before the pool would, so a model never meets a session that the
#: pool restarted without its grants; five minutes outlasts a model's think
#: between two cells.
DEFAULT_SESSION_IDLE_S = 300.0
#: Session names are chosen by the model; short, plain names keep them usable
#: in messages and logs. The pool's wire name is our own (random), never this.
MAX_SESSION_NAME_CHARS = 64
SESSION_NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
#: How often idle sessions are looked for: a tenth of the idle limit, at most
#: every five seconds, so a session outlives its limit by a tenth at most.
MAX_SWEEP_INTERVAL_S = 5.0
#: The HTTP header of a streamable HTTP connection's MCP session: sessions
#: opened through one connection are not visible to another.
MCP_SESSION_HEADER = "mcp-session-id"

T = TypeVar("T")


@dataclass(frozen=True)
class SessionLimits:
    """How many sessions may be open at once and how long one may sit unused (seconds)."""

    max_sessions: int = DEFAULT_MAX_SESSIONS
    session_idle_s: float = DEFAULT_SESSION_IDLE_S

    def __post_init__(self) -> None:
        if self.max_sessions < 0:
            raise ValueError(f"max_sessions: expected 0 or more, got {self.max_sessions}")
        if self.session_idle_s <= 0:
            raise ValueError(f"session_idle: expected a positive duration, got {self.session_idle_s}")

    @property
    def sweep_interval_s(self) -> float:
        return min(self.session_idle_s / 10, MAX_SWEEP_INTERVAL_S)


@dataclass
class _Entry:
    session: Session
    last_used: float
    busy: int = 0
    shown: Shown = field(default_factory=Shown)  # what the model has seen of its workspace


class Sessions:
    """The open named sessions of one server, keyed by (MCP connection, name).

    Touched only from the event loop; the blocking pool calls run on worker
    threads and each :class:`~readie.Session` serializes its own steps.
    """

    def __init__(self, pool: Pool, grants: Mapping[str, Any], limits: SessionLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.grants = dict(grants)
        self.limits = limits
        self._clock = clock
        self._open: dict[tuple[str, str], _Entry] = {}

    def names(self, connection: str) -> list[str]:
        return sorted(name for (conn, name) in self._open if conn == connection)

    def __len__(self) -> int:
        return len(self._open)

    def acquire(self, connection: str, name: str) -> Session:
        """The session of that name, opened (on the pool: by its first step) when new.

        Raises :class:`~readie.RequestError` past :attr:`SessionLimits.max_sessions`.
        """
        key = (connection, name)
        entry = self._open.get(key)
        if entry is None:
            if self.limits.max_sessions == 0:
                raise RequestError("sessions are disabled on this server (readie mcp --max-sessions=0)")
            if len(self._open) >= self.limits.max_sessions:
                raise RequestError(
                    f"{len(self._open)} of at most {self.limits.max_sessions} sessions are open "
                    f"(here: {', '.join(self.names(connection)) or 'none'}); call {CLOSE_TOOL_NAME} "
                    f"on one, or let one idle out ({_seconds(self.limits.session_idle_s)} unused)"
                )
            entry = self._open[key] = _Entry(self.pool.session(**self.grants), self._clock())
        entry.busy += 1
        return entry.session

    def release(self, connection: str, name: str, session: Session) -> None:
        """After a step: keep the session for the next call, or forget it if the pool has no process for it."""
        key = (connection, name)
        entry = self._open.get(key)
        if entry is None or entry.session is not session:
            return
        entry.busy -= 1
        entry.last_used = self._clock()
        if not session.open and entry.busy == 0:
            del self._open[key]  # ended, or refused before it opened: the next call starts afresh

    def shown(self, connection: str, name: str) -> Shown:
        """What the model has seen of the workspace of the session of that name (acquired)."""
        return self._open[(connection, name)].shown

    def pop(self, connection: str, name: str) -> Session | None:
        entry = self._open.pop((connection, name), None)
        return None if entry is None else entry.session

    def idle(self) -> list[Session]:
        """Remove and return the sessions unused for longer than the limit (none mid-step)."""
        deadline = self._clock() - self.limits.session_idle_s
        expired = [key for key, entry in self._open.items() if entry.busy == 0 and entry.last_used <= deadline]
        return [self._open.pop(key).session for key in expired]

    def all(self) -> list[Session]:
        """Remove and return every session (the server is closing)."""
        sessions = [entry.session for entry in self._open.values()]
        self._open.clear()
        return sessions


class ReadieTools:
    """What the tools do, against one pool; :func:`build_server` registers them."""

    def __init__(self, pool: Pool, grants: Mapping[str, Any], limits: SessionLimits) -> None:
        self.pool = pool
        self.sessions = Sessions(pool, grants, limits)
        self.grants = dict(grants)
        # A model may shorten a call, never lengthen it past the operator's --timeout (else the
        # pool's default): without a ceiling in a config, nothing else would bound it.
        given = grants.get("timeout")
        self.max_timeout_s = (DEFAULT_TIMEOUT_MS if given is None else parse_duration_ms(given)) / 1000
        self.failure: str | None = None  # set once the pool is gone: every later call says so at once

    async def run_python(
        self,
        code: str,
        session: str | None,
        timeout: float | None,
        connection: str,
        files: Mapping[str, str | Base64File] | None = None,
        collect: list[str] | None = None,
    ) -> CallToolResult:
        if self.failure is not None:
            return _error(self.failure)
        if timeout is not None and not (math.isfinite(timeout) and 0 < timeout <= self.max_timeout_s):
            return _error(f"Refused: timeout must be more than 0 and at most {self.max_timeout_s:g} seconds here")
        try:
            sent = model_files(files)
        except RequestError as exc:
            return _error(f"Refused: {exc}")
        step = {
            **({"timeout": timeout} if timeout is not None else {}),
            "files": sent,
            "collect": DEFAULT_COLLECT if collect is None else collect,
        }
        if session is None:
            fields = {**self.grants, **step}
            shown = Shown()  # a fresh sandbox: nothing was seen of it
            result, restarted = await self._call(lambda: self.pool.run(code, name=CODE_NAME, **fields)), False
        else:
            try:
                the_session = self.sessions.acquire(connection, session)
            except RequestError as exc:
                return _error(f"Refused: {exc}")
            shown = self.sessions.shown(connection, session)
            was_open = the_session.open
            try:
                result = await self._call(lambda: the_session.run(code, name=CODE_NAME, **step))
            finally:
                self.sessions.release(connection, session, the_session)
            # Step 1 of a session that was open: the pool closed it (idle) and began anew.
            restarted = isinstance(result, Result) and was_open and result.step == 1
            if isinstance(result, Result) and result.step == 1:
                shown.digests.clear()  # a new sandbox: a new workspace, nothing of it seen
        if isinstance(result, CallToolResult):
            return result
        log.info("run_python", session=session, exit=result.exit, error=result.error.type if result.error else None,
                 duration_ms=result.duration_ms, step=result.step, collected=len(result.collected or {}))
        shown.sent(sent)  # what the model sent it knows: shown back only once changed
        contents, notes = file_contents(result, shown)
        text = format_result(result, restarted=restarted)
        if notes:
            text = f"{text}\n{describe_files(notes)}"
        return CallToolResult(content=[TextContent(type="text", text=text), *contents], is_error=not result.ok)

    async def close_session(self, session: str, connection: str) -> CallToolResult:
        the_session = self.sessions.pop(connection, session)
        if the_session is None:
            return _text(f"No session named {session!r} is open; nothing to close.")
        if self.failure is None:
            closed = await self._call(the_session.close)
            if isinstance(closed, CallToolResult):
                return closed
        return _text(f"Session {session!r} is closed: its variables are gone.")

    async def close_idle(self) -> None:
        for session in self.sessions.idle():
            log.info("session idle, closed", limit_s=self.sessions.limits.session_idle_s)
            await self._call(session.close)

    async def close_all(self) -> None:
        for session in self.sessions.all():
            await self._call(session.close)

    async def sweep_idle(self) -> None:
        """Close idle sessions until cancelled (a task of the serving loop)."""
        while True:
            await anyio.sleep(self.sessions.limits.sweep_interval_s)
            await self.close_idle()

    async def _call(self, blocking: Callable[[], T]) -> T | CallToolResult:
        """Run a pool call on a thread; a refusal or a failure becomes the tool error the model reads."""
        if self.failure is not None:
            return _error(self.failure)
        try:
            return await anyio.to_thread.run_sync(blocking)
        except RequestError as exc:
            # Nothing ran: the request is outside what the operator allows, and the pool says why.
            log.info("request refused", reason=str(exc))
            return _error(f"Refused: {exc}")
        except PoolError as exc:
            self.failure = f"The sandbox pool has failed and this server cannot run code any more: {exc}"
            log.error("pool failed", error=str(exc))
            return _error(self.failure)
        except ReadieError as exc:  # a readie error of another family: this call's, not the pool's
            log.warning("call failed", error=str(exc), error_type=type(exc).__name__)
            return _error(f"{type(exc).__name__}: {exc}")


def build_server(pool: Pool, grants: Mapping[str, Any] | None = None, limits: SessionLimits = SessionLimits()) -> tuple[MCPServer, ReadieTools]:
    """An MCP server with ``run_python`` and ``close_session`` over ``pool``.

    ``grants`` are :meth:`Pool.run <readie.Pool.run>`'s keyword arguments
    (``allow_read``, ``profile``, ``timeout``, ...), applied to every job and
    session, and checked here first (:func:`readie.tool` checks them the same
    way). The caller serves the server and runs :meth:`ReadieTools.sweep_idle`.
    """
    setup = session_setup(**(grants or {}))
    tools = ReadieTools(pool, grants or {}, limits)
    server: MCPServer = MCPServer(
        "readie",
        instructions=(
            "Runs Python in isolated gVisor sandboxes. Use run_python; pass a session name to keep "
            f"variables between calls, and {CLOSE_TOOL_NAME} when done with it."
        ),
        version=_version(),
        log_level="WARNING",
    )
    idle = _seconds(limits.session_idle_s)

    async def run_python(
        code: Annotated[str, Field(description="Python source to run. Use print() to see values.")],
        ctx: Context,
        session: Annotated[
            str | None,
            Field(
                description="A name of your choice to run in a session that keeps variables, imports and "
                "functions between calls with the same name. Omit it for a clean interpreter.",
                min_length=1, max_length=MAX_SESSION_NAME_CHARS, pattern=SESSION_NAME_PATTERN,
            ),
        ] = None,
        timeout: Annotated[
            float | None,
            Field(description="Seconds this call may run, at most the operator's limit.", gt=0),
        ] = None,
        files: FilesArgument = None,
        collect: CollectArgument = None,
    ) -> CallToolResult:
        return await tools.run_python(code, session, timeout, _connection(ctx), files, collect)

    async def close_session(
        session: Annotated[str, Field(description="The session name given to run_python.", max_length=MAX_SESSION_NAME_CHARS)],
        ctx: Context,
    ) -> CallToolResult:
        return await tools.close_session(session, _connection(ctx))

    server.add_tool(
        run_python,
        name=DEFAULT_TOOL_NAME,
        description=_description(setup, limits, idle),
        annotations=ToolAnnotations(title="Run Python in a sandbox", read_only_hint=False, open_world_hint=bool(setup.get("allow_network"))),
        structured_output=False,
    )
    server.add_tool(
        close_session,
        name=CLOSE_TOOL_NAME,
        description="End a run_python session and free its sandbox; its variables are gone afterwards.",
        annotations=ToolAnnotations(title="Close a Python session", destructive_hint=True, idempotent_hint=True),
        structured_output=False,
    )
    return server, tools


def _description(setup: Mapping[str, Any], limits: SessionLimits, idle: str) -> str:
    """``readie.tool``'s description (files, network, limits) with the session rules of this server."""
    # describe() says either "state persists" or "every call is clean"; here it depends on `session`,
    # so keep the lines both versions share and say that part ourselves.
    stateful = describe(setup, stateful=True).splitlines()
    shared = [line for line in describe(setup, stateful=False).splitlines() if line in stateful]
    if limits.max_sessions:
        sessions = (
            "Without `session`, every call starts from a clean interpreter. With `session` (a name you "
            "choose), variables, imports and functions persist between calls of that name, like cells of "
            "a notebook; a timeout, crash or sys.exit() ends it. "
            f"At most {limits.max_sessions} sessions may be open; one unused for {idle} is closed. "
            f"Call {CLOSE_TOOL_NAME} when you no longer need one."
        )
    else:
        sessions = "Every call starts from a clean interpreter: sessions are disabled on this server."
    files = (
        "`files` puts files in the working directory before the code runs; the PNG and JPEG images "
        "and text files the code saves there come back to you (`collect` says which), and so does a "
        "last bare expression's image."
    )
    return "\n".join([shared[0], sessions, files, *shared[1:]])


def _connection(ctx: Context) -> str:
    """Which MCP connection asks: its streamable HTTP session id, else one shared name (stdio)."""
    try:
        request = ctx.request_context.request
    except ValueError:
        return ""
    headers = getattr(request, "headers", None)
    return (headers.get(MCP_SESSION_HEADER) or "") if headers is not None else ""


def _version() -> str:
    try:
        return importlib.metadata.version("readie")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return ""


def _text(text: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)])


def _error(text: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)


def _seconds(value: float) -> str:
    if value >= 60 and value % 60 == 0:
        return f"{int(value // 60)} min"
    return f"{value:g} s"
