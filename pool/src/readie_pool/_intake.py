"""Intake's two buffers: stdin as requests, and the parsed lines that wait for a permit.

The engine (``_engine``) decides when to read and when to admit; these only
hold what was read, each with its bound.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from readie_protocol.connection import ENDED, NEED_DATA, PoolConnection
from readie_protocol.requests import Refused, Request

__all__ = ["MAX_PARKED_BYTES", "MIN_PARKED_LINE_BYTES", "ByteSource", "Parked", "RequestReader"]

log = structlog.get_logger("readie.pool")

#: While a host call waits for its reply, intake reads past lines that wait
#: for a permit, so the reply is not stuck behind them; this bounds the bytes
#: of such lines held (at least one is always held). A client that writes
#: more than this ahead of its reply waits for the call's timeout.
MAX_PARKED_BYTES = 8 * 1024 * 1024
#: What a parked line is charged at least against MAX_PARKED_BYTES: the memory of
#: its parsed request and refusal (about 0.6 KB measured for the shortest), rounded up.
MIN_PARKED_LINE_BYTES = 1024


class ByteSource(Protocol):
    async def read(self) -> bytes:
        """The next bytes, ``b""`` at the end."""
        ...


class RequestReader:
    """stdin as requests, through the pool's end of the connection: one read of the
    source only when no line is left."""

    def __init__(self, source: ByteSource, connection: PoolConnection) -> None:
        self._source = source
        self._connection = connection

    async def next(self) -> tuple[Request | Refused, int] | None:
        """The next request (or refusal) and the bytes of its line; None at the end."""
        while (event := self._connection.next_event()) is NEED_DATA:
            try:
                data = await self._source.read()
            except OSError as exc:
                log.error("cannot read stdin; treating it as ended", error=str(exc))
                data = b""
            self._connection.receive_data(data)
        if event is ENDED:
            return None
        assert isinstance(event, Request | Refused)
        return event, self._connection.last_line_bytes


@dataclass
class Parked:
    """Lines read and parsed that wait, in order, for a permit."""

    # (request, parsed_at, size in bytes)
    lines: deque[tuple[Request | Refused, int, int]] = field(default_factory=deque)
    size: int = 0  # bytes of the lines held
    ended: bool = False  # stdin ended: no more lines come

    def push(self, request: Request | Refused, parsed_at: int, size: int) -> None:
        # A parsed line holds more than its bytes (a 2-byte line held 564 B, measured): each is
        # charged at least that, so short lines cannot park gigabytes under the byte bound.
        size = max(size, MIN_PARKED_LINE_BYTES)
        self.lines.append((request, parsed_at, size))
        self.size += size

    def pop(self) -> tuple[Request | Refused, int]:
        request, parsed_at, size = self.lines.popleft()
        self.size -= size
        return request, parsed_at
