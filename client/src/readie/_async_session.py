"""``AsyncSession``: :class:`~readie.Session` on asyncio, one sandbox whose variables survive its steps."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Self

from readie_protocol.errors import ErrorType
from readie_protocol.events import ForkedEvent, HibernatedEvent, Result

from ._errors import ReadieError, RequestError
from ._output import OutputCallback, OutputCallbacks
from ._requests import Duration, Size, cancel_request, close_request, step_request
from ._session_images import answered, fork_name, fork_request, hibernate_request, require_open

if TYPE_CHECKING:
    from ._async_pool import AsyncPool

__all__ = ["AsyncSession"]


class AsyncSession:
    """A stateful sandbox of an :class:`AsyncPool` (see :class:`~readie.Session`); steps run one at a time."""

    def __init__(self, pool: AsyncPool, name: str, setup: Mapping[str, Any], functions: Mapping[str, Any]) -> None:
        self.pool = pool
        self.name = name
        self.setup = dict(setup)
        self.functions = dict(functions)
        self._lock = asyncio.Lock()
        self._open = False
        self.last_step = 0

    @property
    def open(self) -> bool:
        return self._open

    async def run(
        self,
        code: str,
        name: str | None = None,
        args: Iterable[str] = (),
        timeout: Duration | None = None,
        max_output: Size | None = None,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        report_files: bool = False,
    ) -> Result:
        """Run ``code`` as the session's next step (see :meth:`Session.run`).

        Cancelling the wait ends the session: its sandbox is freed once the
        running step ends (at its timeout at most), and the next ``run``
        starts a new one.
        """
        callbacks = OutputCallbacks.of(on_stdout, on_stderr)
        async with self._lock:
            request = step_request(
                self.pool._next_id(), self.name, code, name=name, args=args, timeout=timeout,
                max_output=max_output, setup=None if self._open else self.setup, stream=callbacks is not None,
                report_files=report_files,
            )
            was_open, self._open = self._open, True  # from here the pool may hold a process for it
            try:
                result = await self.pool._exchange(request, self.functions, callbacks)
            except ReadieError:
                self._open = was_open
                raise
            except BaseException:
                # Cancelled, or a callback raised: cancelling the step ends the session; the close lets the next run open anew.
                self._open = False
                self.pool._stop_in_background(cancel_request(self.pool._next_id(), request["id"]))
                self.pool._stop_in_background(close_request(self.pool._next_id(), self.name))
                raise
            assert isinstance(result, Result)
            if result.error is not None and result.error.type == ErrorType.REQUEST:
                self._open = was_open  # refused: nothing ran, nothing changed
                raise RequestError(result.error.message, result=result)
            self._open = not result.session_ended
            self.last_step = result.step or 0
            return result

    async def hibernate(self) -> int:
        """Checkpoint the session to disk and free its sandbox; the milliseconds it took (see :meth:`Session.hibernate`).

        0, and nothing sent, when the session is not open. Cancelling the
        wait does not stop the hibernation; the session stays open either way.
        """
        async with self._lock:
            if not self._open:
                return 0
            answer = await self.pool._exchange(hibernate_request(self.pool._next_id(), self.name))
            return answered(self, answer, HibernatedEvent).hibernate_ms

    async def fork(self, name: str | None = None) -> AsyncSession:
        """A new session, open at once, whose state is a copy of this one's (see :meth:`Session.fork`)."""
        new_name = fork_name(name)
        async with self._lock:
            require_open(self, "fork")
            request = fork_request(self.pool._next_id(), self.name, new_name)
            try:
                answer = await self.pool._exchange(request)
            except ReadieError:
                raise
            except BaseException:
                # Cancelled: the fork may be made all the same. A name made here is nobody else's,
                # so closing it cannot end another session; a caller's name may be, and is left alone.
                if name is None:
                    self.pool._stop_in_background(close_request(self.pool._next_id(), new_name))
                raise
            answered(self, answer, ForkedEvent)
        fork = AsyncSession(self.pool, new_name, self.setup, self.functions)
        fork._open = True  # the pool holds it: its steps must carry no setup (its next opening will)
        return fork

    async def close(self) -> None:
        """End the session and free its sandbox; does nothing when it is not open."""
        async with self._lock:
            await self._close_now()

    async def _close_now(self) -> None:
        if not self._open:
            return
        self._open = False
        answer = await self.pool._exchange(close_request(self.pool._next_id(), self.name))
        if isinstance(answer, Result):  # the pool refused the close
            assert answer.error is not None
            raise RequestError(answer.error.message, result=answer)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
