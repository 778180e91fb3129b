"""The value of a job's last bare expression, shown as a notebook cell shows it.

Code whose last statement is an expression (``df.head()``, ``x + 1``)
is run as a notebook runs a cell: the statements before it, then the
expression, whose value (unless None) goes into the result as ``value``:

    {"text": "42", "truncated": false, "data": {}, "omitted": []}

``text`` is its ``repr()``, cut to :data:`~._bounds.MAX_VALUE_TEXT`; ``data``
holds what the object offers through IPython's display protocol
(``_repr_html_``, ``_repr_png_`` as base64, ...), each kind by its MIME type,
together at most :data:`~._bounds.MAX_DISPLAY_BYTES`: a kind that does not
fit is left out and named in ``omitted``. The methods are the job's own
code: they run under the job's deadline, guards and memory limit, and one
that raises or returns something else is skipped.
"""

from __future__ import annotations

import ast
import base64
from types import CodeType
from typing import Any

from ._bounds import (
    BINARY_DISPLAY_TYPES,
    DISPLAY_METHODS,
    MAX_DISPLAY_BYTES,
    MAX_VALUE_TEXT,
    encoded_size,
    fit_text,
)
from ._result import safe_repr

__all__ = ["compile_cell", "show_value"]



def compile_cell(source: str | bytes, name: str) -> tuple[CodeType, CodeType | None]:
    """The code before the last bare expression, and that expression (None without one).

    SyntaxError (or ValueError for a NUL) as ``compile`` raises them.
    """
    # compile() rather than ast.parse, whose own frame would show in a SyntaxError's traceback.
    tree = compile(source, name, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        expression = ast.Expression(tree.body.pop().value)
        last = compile(expression, name, "eval", dont_inherit=True)
    return compile(tree, name, "exec", dont_inherit=True), last


def show_value(value: Any, max_output: int) -> dict[str, Any] | None:
    """The result's ``value`` for ``value``; None for None, as a notebook shows nothing."""
    if value is None:
        return None
    text, truncated = fit_text(safe_repr(value), min(max_output, MAX_VALUE_TEXT))
    data: dict[str, str] = {}
    omitted: list[str] = []
    # A client that keeps its results small with max_output gets small display data too.
    room = min(max_output, MAX_DISPLAY_BYTES)
    for mime, method in DISPLAY_METHODS:
        rendered = _render(value, method, mime, room)
        if rendered is None:
            continue
        if rendered is _TOO_LARGE:
            omitted.append(mime)
            continue
        fitted, cut = fit_text(rendered, room)
        if cut:  # a cut picture or page is broken: left out whole
            omitted.append(mime)
            continue
        data[mime] = fitted
        room -= encoded_size(fitted)
    return {"text": text, "truncated": truncated, "data": data, "omitted": omitted}


_TOO_LARGE: Any = object()


def _render(value: Any, method: str, mime: str, room: int) -> Any:
    """The kind as text; None when the object does not offer it; _TOO_LARGE when it cannot fit."""
    try:
        render = getattr(value, method, None)
        if render is None or not callable(render):
            return None
        rendered = render()
        if isinstance(rendered, tuple) and len(rendered) == 2:  # IPython allows (data, metadata)
            rendered = rendered[0]
        if mime in BINARY_DISPLAY_TYPES:
            if not isinstance(rendered, bytes):
                return None
            raw = bytes.__bytes__(rendered)  # exact bytes: a subclass's methods are the job's code
            if (len(raw) + 2) // 3 * 4 > room:  # its base64 would not fit: not made at all
                return _TOO_LARGE
            return base64.b64encode(raw).decode("ascii")
        # The job's own str subclass could hand back anything from its methods: an exact copy only.
        return str.__str__(rendered) if isinstance(rendered, str) else None
    except Exception:  # noqa: BLE001 - the object's own method failed: it offers nothing
        return None
