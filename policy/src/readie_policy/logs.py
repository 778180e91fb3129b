"""structlog set-up shared by every readie process: one log schema (decision 0021).

With ``--log=json`` every line a readie process writes on stderr is one JSON
object that starts ``{"ts_ms": <epoch ms>, "event": <name>, ...`` and ends
with ``"level"`` and ``"process"`` (the ``readie`` subcommand: worker, router,
pool, mcp, capture, ...). The pool's per-job line (the spec's ``--log=json``
line) is one of them, its spec keys first, so a log pipeline parses one shape
from every process. The console format renders the same events for people.

The lowest level written is ``$READIE_LOG_LEVEL`` (debug, info, warning,
error; default info), or what a caller passes.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import MutableMapping
from typing import Any

import structlog

__all__ = ["LEVEL_VARIABLE", "LEVELS", "configure_logging"]

LEVEL_VARIABLE = "READIE_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
# Keys every line starts with, in this order; the rest keep the order they were logged in.
_LEADING = ("ts_ms", "event")
_TRAILING = ("level", "process")


def configure_logging(json: bool = False, level: str | None = None, *, process: str = "readie") -> None:
    """Console lines by default, the JSON schema with ``json``; ``level`` overrides $READIE_LOG_LEVEL.

    ``process`` names the writer in every line: the ``readie`` subcommand.
    """
    asked = (level or os.environ.get(LEVEL_VARIABLE) or "info").lower()
    # A typo in the variable must not stop a worker from starting: info, and a warning naming it.
    chosen = asked if asked in LEVELS else "info"
    renderer: list[structlog.typing.Processor] = (
        [_stamp_ms, _in_schema_order, structlog.processors.JSONRenderer()]
        if json
        else [structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.dev.ConsoleRenderer(colors=False)]
    )
    structlog.configure(
        processors=[
            # The ids of the session or job at hand (errors.bound_ids), after the line's own keys.
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            functools.partial(_stamp_process, process=process),
            structlog.processors.format_exc_info,
            *renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[chosen.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    if asked != chosen:
        structlog.get_logger().warning(
            "unknown log level, logging at info", variable=LEVEL_VARIABLE, value=asked[:40], levels=list(LEVELS)
        )


def _stamp_process(
    logger: Any, method: str, event_dict: MutableMapping[str, Any], *, process: str
) -> MutableMapping[str, Any]:
    event_dict.setdefault("process", process)
    return event_dict


def _stamp_ms(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    # setdefault: the pool's job line brings its own ts_ms (its engine's clock).
    event_dict.setdefault("ts_ms", time.time_ns() // 1_000_000)
    return event_dict


def _in_schema_order(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> dict[str, Any]:
    edges = set(_LEADING) | set(_TRAILING)
    return {
        **{key: event_dict[key] for key in _LEADING if key in event_dict},
        **{key: value for key, value in event_dict.items() if key not in edges},
        **{key: event_dict[key] for key in _TRAILING if key in event_dict},
    }
