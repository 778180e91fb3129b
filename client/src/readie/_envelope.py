"""readie-style calls without I/O: a call pickled for the sandbox, its envelope decoded here.

The executor in the sandbox answers every call with a cloudpickled envelope:

    {"ok": True,  "value": <return value>, "output": ["..."]}
    {"ok": False, "exc_type": "ValueError", "message": "...", "traceback": "...", "output": ["..."]}

The worker and the router pass it on unopened. This module is the one place
it is opened, on the client, which sent the code and so trusts what that
code returns as much as it trusted the code. An ``ok: False`` envelope
becomes :class:`RemoteError` with the sandbox's words; the exception's class
is not re-created.
"""

from __future__ import annotations

import pickle
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ._errors import EnvelopeError, RemoteError, RequestError, VersionMismatch

__all__ = ["SANDBOX_PYTHON", "RemoteResult", "by_value_module", "call_payload", "check_python", "decode_envelope"]

#: The Python minor version inside the sandboxes: Debian bookworm's python3,
#: which the rootfs is built from. cloudpickle pickles functions by value as
#: code objects, and code objects (bytecode, their constructor's arguments)
#: differ between minor versions: a function pickled by 3.12 cannot be loaded
#: by 3.11, or loads and misbehaves. So a call is refused before it is sent
#: unless this Python's minor version is the same. (Patch versions may differ.)
SANDBOX_PYTHON = (3, 11)

# Where installed distributions live; modules under these go by reference.
_INSTALLED_DIRS = frozenset({"site-packages", "dist-packages"})
_REGISTRY_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class RemoteResult:
    """A remote call's return value and what it printed (stdout and stderr, in order)."""

    value: Any
    output: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        return "".join(self.output)


def check_python(version: Sequence[int] | None = None) -> None:
    """Refuse, naming both versions, when this Python cannot exchange pickles with the sandbox's."""
    mine = tuple((sys.version_info if version is None else version)[:2])
    sandbox = tuple(SANDBOX_PYTHON)  # the module global at call time: tests patch it
    if mine != sandbox:
        raise VersionMismatch(
            f"remote calls need Python {_dotted(sandbox)} on this side: the sandboxes run Python "
            f"{_dotted(sandbox)}, and cloudpickle only carries functions between equal minor "
            f"versions; this is Python {_dotted(mine)} ({sys.executable}). Run the client with "
            f"Python {_dotted(sandbox)} (uv run --python {_dotted(sandbox)} ...)"
        )


def call_payload(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    """The executor's request: ``cloudpickle.dumps({"func", "args", "kwargs"})``.

    The function's own module goes by value when it is the caller's code (see
    :func:`by_value_module`): the sandbox has the standard library and the
    checkpoint's packages, not the caller's project, so a reference to
    ``myproject.tasks.f`` would fail there with ModuleNotFoundError.
    """
    import cloudpickle

    if not callable(func):
        raise TypeError(f"expected a callable, got {type(func).__name__}")
    call = {"func": func, "args": tuple(args), "kwargs": dict(kwargs)}
    module = by_value_module(func)
    try:
        # cloudpickle's by-value registry is process-wide: one dump at a time
        # changes it, and a module the caller registered stays registered.
        with _REGISTRY_LOCK:
            registered = module is not None and module.__name__ not in cloudpickle.list_registry_pickle_by_value()
            if registered:
                cloudpickle.register_pickle_by_value(module)
            try:
                return cloudpickle.dumps(call)
            finally:
                if registered:
                    cloudpickle.unregister_pickle_by_value(module)
    except Exception as exc:
        name = getattr(func, "__qualname__", repr(func))
        raise RequestError(
            f"cannot pickle the call to {name}: {type(exc).__name__}: {exc} "
            "(the function, its arguments and what it refers to must be picklable)",
            "payload",
        ) from exc


def by_value_module(func: Callable[..., Any]) -> ModuleType | None:
    """The module to pickle by value with ``func``: the caller's own code, not an installed package.

    Installed packages (site-packages, dist-packages) and the standard library
    are left by reference: the sandbox imports its own copies. ``__main__`` is
    by value already (cloudpickle's rule).
    """
    name = getattr(func, "__module__", None)
    if not isinstance(name, str) or name == "__main__":
        return None
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if module is None or not isinstance(path, str) or name.partition(".")[0] in sys.stdlib_module_names:
        return None
    if _INSTALLED_DIRS & set(Path(path).parts):
        return None
    return module


def decode_envelope(data: bytes) -> RemoteResult:
    """The call's result; :class:`RemoteError` if the function raised, :class:`EnvelopeError` if undecodable."""
    try:
        envelope = pickle.loads(data)
    except Exception as exc:
        # Most often the value's class or module exists in the sandbox but not here.
        raise EnvelopeError(
            f"the remote call's answer cannot be loaded here: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(envelope, dict) or not isinstance(envelope.get("ok"), bool):
        raise EnvelopeError(f"the remote call's answer is not an envelope: {_short(envelope)}")
    output = _output(envelope)
    if envelope["ok"]:
        if "value" not in envelope:
            raise EnvelopeError("the remote call's envelope says ok but holds no value")
        return RemoteResult(envelope["value"], output)
    exc_type, message, traceback = (_text(envelope, key) for key in ("exc_type", "message", "traceback"))
    raise RemoteError(exc_type, message, traceback, output)


def _text(envelope: dict[str, Any], key: str) -> str:
    value = envelope.get(key)
    if not isinstance(value, str):
        raise EnvelopeError(f"the remote call's failure envelope has no text {key}: {_short(value)}")
    return value


def _output(envelope: dict[str, Any]) -> tuple[str, ...]:
    output = envelope.get("output", [])
    if not isinstance(output, list | tuple) or not all(isinstance(text, str) for text in output):
        raise EnvelopeError(f"the remote call's output is not a list of text: {_short(output)}")
    return tuple(output)


def _dotted(version: Sequence[int]) -> str:
    return ".".join(str(part) for part in version)


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
