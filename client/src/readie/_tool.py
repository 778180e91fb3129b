"""``readie.tool``: Python in a pool's sandboxes as a tool a model can call.

A :class:`Tool` is a callable (``tool(code) -> str``) with the three things
tool-calling APIs ask for: ``name``, ``description`` and ``parameters`` (a
JSON schema with one string, ``code``). The description is written for the
model: whether state carries over between calls, which paths it may read
and write (as the request names them), the network, the limits, and the
host functions it may call, each one's signature and docstring
(:func:`describe_functions`).

What the model reads back is :func:`format_result`: output first, then the
error stated plainly, then what the network policy refused, then what happened to the
session if it ended.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from ._envelope import SANDBOX_PYTHON
from ._host import check_functions
from ._requests import session_setup
from readie_protocol.events import NetworkReport, Result
from ._session import Session

if TYPE_CHECKING:
    from ._pool import Pool

__all__ = ["DEFAULT_TOOL_NAME", "PARAMETERS", "Tool", "describe_functions", "format_result", "tool"]

DEFAULT_TOOL_NAME = "run_python"
#: The tool's one argument, as JSON schema.
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "description": "Python source to run. Use print() to see values."},
    },
    "required": ["code"],
    "additionalProperties": False,
}
#: The module a sandbox's code imports host functions from (the spec's ``pynox_host``).
HOST_MODULE = "readie_host"
#: The file name tracebacks show for the model's code.
CODE_NAME = "tool_call.py"


class Tool:
    """A model-facing tool; made by :func:`tool`. Call it with the model's code."""

    def __init__(
        self,
        pool: Pool,
        *,
        name: str,
        description: str,
        setup: Mapping[str, Any],
        session: Session | None,
        owns_session: bool,
        functions: Mapping[str, Callable[..., Any]] | None = None,
    ) -> None:
        self.pool = pool
        self.name = name
        self.description = description
        self.parameters: dict[str, Any] = PARAMETERS
        self.session = session
        self.functions = dict(functions or {})  # for jobs; a session's steps use the session's
        self._setup = dict(setup)
        self._owns_session = owns_session

    def __call__(self, code: str) -> str:
        """Run ``code`` and return the text the model reads next."""
        result, restarted = self._run(code)
        return format_result(result, restarted=restarted)

    def run(self, code: str) -> Result:
        """Run ``code`` (as the session's next step, or as a job of its own) and return its result."""
        return self._run(code)[0]

    def spec(self) -> dict[str, Any]:
        """``name``, ``description`` and ``parameters``, as most tool-calling APIs take them."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def openai_tool(self, api: str = "chat") -> dict[str, Any]:
        """The tool as OpenAI's API takes it: ``"chat"`` for Chat Completions'
        ``tools`` (``{"type": "function", "function": {...}}``), ``"responses"``
        for the Responses API's (the same fields, flat). Strict: the one
        parameter is required and nothing else is allowed."""
        function = {**self.spec(), "strict": True}
        if api == "chat":
            return {"type": "function", "function": function}
        if api == "responses":
            return {"type": "function", **function}
        raise ValueError(f"api: expected 'chat' or 'responses', got {api!r}")

    def anthropic_tool(self) -> dict[str, Any]:
        """The tool as Anthropic's Messages API takes it (``input_schema``)."""
        return {"name": self.name, "description": self.description, "input_schema": self.parameters}

    def call(self, arguments: str | Mapping[str, Any]) -> str:
        """Answer one tool call as a model's API delivers it: OpenAI's ``arguments``
        (a JSON string) or Anthropic's ``input`` (an object). Arguments that are
        not ``{"code": str}`` come back as a message the model can act on, not
        as an exception: the model made the mistake, and it can fix it."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                return f"Error: the arguments are not JSON ({exc}); send {{\"code\": \"<python>\"}}"
        if not isinstance(arguments, Mapping) or set(arguments) != {"code"} or not isinstance(arguments["code"], str):
            return 'Error: this tool takes exactly one argument, {"code": "<python source>"}'
        return self(arguments["code"])

    def langchain_tool(self) -> Any:
        """The tool as a LangChain ``StructuredTool`` (needs ``langchain-core``: the ``readie[langchain]`` extra)."""
        try:
            from langchain_core.tools import StructuredTool
        except ImportError:
            raise ImportError("Tool.langchain_tool needs langchain-core: install readie[langchain]") from None
        return StructuredTool.from_function(
            func=self, name=self.name, description=self.description, args_schema=self.parameters
        )

    def close(self) -> None:
        """Close the session this tool opened (a Session passed in is the caller's to close)."""
        if self.session is not None and self._owns_session:
            self.session.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _run(self, code: str) -> tuple[Result, bool]:
        if self.session is None:
            # The wire fields of session_setup() are Pool.run's keyword arguments.
            return self.pool.run(code, name=CODE_NAME, functions=self.functions, **self._setup), False
        was_open, last_step = self.session.open, self.session.last_step
        result = self.session.run(code, name=CODE_NAME)
        # A step number not past the last one seen, in a session this client thought open: the pool
        # closed it (idle) and began anew. (A fork's first step is its step 1, after none seen.)
        return result, was_open and result.step is not None and result.step <= last_step


def tool(
    *,
    pool: Pool,
    session: bool | Session = False,
    functions: Mapping[str, Callable[..., Any]] | None = None,
    name: str = DEFAULT_TOOL_NAME,
    **grants: Any,
) -> Tool:
    """A tool that runs a model's Python in ``pool``'s sandboxes.

    ``session=False``: every call is a fresh sandbox with ``grants``
    (``allow_read``, ``allow_write``, ``env``, ``timeout``, ``memory``, ... as
    :meth:`Pool.run <readie.Pool.run>` takes them). ``session=True``: calls
    share one :meth:`Pool.session <readie.Pool.session>` opened with
    ``grants``, so variables survive between calls; :meth:`Tool.close` ends
    it. A :class:`~readie.Session` passed in is used as it is (its own
    grants; give no others). ``functions`` (name to callable) are host
    functions: the code imports them from ``readie_host``, each call runs
    the callable in this process, and the description lists each one's
    signature and docstring (:func:`describe_functions`). A Session passed
    in brings its own functions.
    """
    declared = check_functions(functions)
    if isinstance(session, Session):
        if grants or declared:
            given = sorted(grants) + (["functions"] if declared else [])
            raise TypeError(f"grants belong to the Session passed in (functions too); got {', '.join(given)}")
        setup, the_session, owns, declared = session.setup, session, False, session.functions
    elif session is True:
        the_session = pool.session(functions=declared, **grants)
        setup, owns = the_session.setup, True
    elif session is False:
        setup, the_session, owns = session_setup(**grants), None, False
    else:
        raise TypeError(f"session: expected True, False or a Session, got {type(session).__name__}")
    description = describe(setup, stateful=the_session is not None, functions=declared)
    return Tool(
        pool, name=name, description=description, setup=setup, session=the_session, owns_session=owns,
        functions=None if the_session is not None else declared,
    )


def describe(
    setup: Mapping[str, Any],
    *,
    stateful: bool,
    functions: Mapping[str, Callable[..., Any]] | None = None,
) -> str:
    """The tool description a model reads, from a session's (or job's) wire fields."""
    major, minor = SANDBOX_PYTHON
    lines = [f"Run Python {major}.{minor} code in an isolated sandbox and return what it printed."]
    if stateful:
        lines.append(
            "Variables, imports and functions you define persist between calls, like cells of a "
            "notebook. If a call times out, crashes or calls sys.exit(), that state is lost and "
            "the next call starts from a clean interpreter."
        )
    else:
        lines.append(
            "Every call starts from a clean interpreter: variables and imports do not carry over, "
            "so import what you need each time."
        )
    lines.append(
        "What the code prints comes back, and so does the value of a last bare expression, as "
        "in a notebook cell (its repr)."
    )
    lines.append(_files(setup.get("allow_read", ()), setup.get("allow_write", ())))
    if setup.get("profile"):
        lines.append(f"The pool's profile {setup['profile']!r} may grant more.")
    network = "Network access is allowed." if setup.get("allow_network") else "There is no network access."
    lines.append(f"{network} Starting processes is not allowed.")
    limits = []
    if "timeout" in setup:
        limits.append(f"run for {_duration(setup['timeout'])}")
    if "memory" in setup:
        limits.append(f"use {setup['memory']} bytes of memory" if isinstance(setup["memory"], int)
                      else f"use {setup['memory']} of memory")
    if limits:
        lines.append(f"Each call may {' and '.join(limits)}.")
    if functions:
        lines.append(describe_functions(functions))
    return "\n".join(lines)


def describe_functions(functions: Mapping[str, Callable[..., Any]]) -> str:
    """What the description says about host functions: each one's signature and docstring."""
    names = ", ".join(functions)
    out = [f"Functions of the host you can call (from {HOST_MODULE} import {names}):"]
    for fn_name, function in functions.items():
        signature = _signature(function)
        out.append(f"- {fn_name}{signature}")
        doc = inspect.getdoc(function)
        if doc:
            out.extend(f"    {line}" if line else "" for line in doc.splitlines())
    return "\n".join(out)


def _signature(function: Callable[..., Any]) -> str:
    try:
        # Annotations as the reader wrote them (`str`, not 'str' under `from __future__ import annotations`).
        return str(inspect.signature(function, eval_str=True))
    except Exception:  # a name the annotation uses is gone, or no signature at all
        try:
            return str(inspect.signature(function))
        except (TypeError, ValueError):
            return "(...)"


def format_result(result: Result, *, restarted: bool = False) -> str:
    """The text a model reads back: output first, then what went wrong, stated plainly."""
    parts = []
    if restarted:
        parts.append("[The session had been closed (idle); this ran in a new one: earlier variables are gone.]")
    if result.stdout:
        parts.append(result.stdout.rstrip("\n") + ("\n[stdout truncated]" if result.stdout_truncated else ""))
    if result.stderr and result.error is None:
        parts.append("stderr:\n" + result.stderr.rstrip("\n") + ("\n[stderr truncated]" if result.stderr_truncated else ""))
    if result.value is not None:
        parts.append(result.value.text + (" [value truncated]" if result.value.truncated else ""))
    if result.error is not None:
        line = f" (line {result.error.line})" if result.error.line else ""
        parts.append(f"Error: {result.error.type}: {result.error.message}{line}")
        if result.error.hint:
            parts.append(f"Hint: {result.error.hint}")
    elif result.exit != 0:
        parts.append(f"Exited with status {result.exit}")
    refusals = _network_refusals(result.network)
    if refusals:
        parts.append(refusals)
    if result.session_ended:
        parts.append("[The session ended: its variables are gone; the next call starts from a clean interpreter.]")
    return "\n".join(parts) if parts else "(no output)"


def _network_refusals(report: NetworkReport | None) -> str | None:
    """What the egress policy refused, so that a model reads a refused connection as the
    policy's answer (no retrying, no guessing at an outage); None when it refused nothing."""
    if report is None or not (report.refused_connections or report.refused_lookups):
        return None
    said = []
    if report.refused_connections:
        where = ", ".join(f"{_host(item.address)}:{item.port}" for item in report.refused)
        said.append(_counted(report.refused_connections, "connection") + " refused" + (f" ({where})" if where else ""))
    if report.refused_lookups:
        names = ", ".join(report.refused_names)
        said.append(_counted(report.refused_lookups, "name lookup") + " refused" + (f" ({names})" if names else ""))
    return "[Network policy: " + "; ".join(said) + ". These destinations are not allowed.]"


def _counted(count: int, thing: str) -> str:
    return f"{count} {thing}" + ("" if count == 1 else "s")


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _files(readable: Iterable[str], writable: Iterable[str]) -> str:
    read, write = list(readable), list(writable)
    if not read and not write:
        return "No files of the host are readable or writable; /tmp is scratch space."
    parts = []
    if read:
        parts.append(f"You may read files under {_paths(read)} (read-only)")
    if write:
        parts.append(f"read and write files under {_paths(write)}")
    relative = any(not path.startswith("/") for path in (*read, *write))
    where = " Relative paths are relative to the working directory." if relative else ""
    return "; ".join(parts) + f". Nothing else on the host is readable or writable.{where}"


def _paths(paths: list[str]) -> str:
    return ", ".join(f"{path.rstrip('/')}/" for path in paths)


def _duration(value: Any) -> str:
    return f"{value} seconds" if isinstance(value, int) else str(value)
