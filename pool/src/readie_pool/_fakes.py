"""The in-memory backend the pool engine's unit tests run on: no gVisor, no worker, no code.

:class:`FakeBackend` answers each job with an outcome the test decides and
holds it back on a gate; its sessions (:class:`FakeSession`) keep their
workspace as a dict of path to bytes, so a job's ``files`` and ``collect``
and a session's upload, download and list requests cross the engine as they
would to a worker. Its glob is ``fnmatch``'s, where ``*`` crosses ``/``: the
worker's own matching is the worker's tests' (and the runsc tests') to prove.
``readie_pool.testing`` exports these.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fnmatch
import hmac
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from readie_protocol.cancel import NEVER, Cancellation
from readie_worker.errors import ErrorType, PoolWorkerError, RequestError
from readie_protocol.errors import StepLost
from readie_worker.jobs import (
    CANCELLED_MESSAGE,
    CodeJob,
    HostCall,
    HostFunction,
    HostReply,
    JobOutcome,
    OutputChunk,
    OutputSink,
    Step,
)
from readie_worker.sessions import StepOutcome
from readie_protocol.workspace import (
    MAX_LISTED_ENTRIES,
    Collected,
    FileChunk,
    FileEntry,
    FileListing,
    LeftOut,
    is_pattern,
)

__all__ = ["FakeBackend", "FakeSession", "ok_outcome"]


def ok_outcome(
    stdout: str = "", *, exit: int | None = 0, error: Any = None, duration_us: int = 1000
) -> JobOutcome:
    """A worker outcome for FakeBackend answers; by default a clean exit printing ``stdout``."""
    return JobOutcome(
        exit=exit,
        stdout=stdout,
        stderr="",
        stdout_truncated=False,
        stderr_truncated=False,
        error=error,
        duration_us=duration_us,
        python="3.11.2",
        preloaded_modules=(),
        sandbox_id="fake",
        backend="fake",
    )


@dataclass
class FakeBackend:
    """Runs no code: ``answer(job)`` gives each outcome (or raises), gates hold jobs back.

    A job whose ``code`` is a key of ``gates`` waits until that event is set.
    Session steps go through the same ``answer`` and gates; a step ends its
    session when ``session_ends(job)`` says so or it timed out.
    With a ``host``,
    a job first makes the calls ``host_calls(job)`` lists, one at a time on a
    thread (as the worker does, with the job's deadline set), then waits for
    its gate; ``replies`` keeps what each job id got back.
    A job's ``files`` are its workspace (a session step's are written into
    the session's), and its ``collect`` brings back what matches there, within
    the job's ``collect_files`` and ``collect_bytes``. A session's transfer of
    a path that is a key of ``gates`` waits for it too.

    Durable sessions (decision 32): with ``keys``, each session gets a key;
    ``detach`` puts it in ``store`` by its key, and ``attach_session`` takes
    it out (an unknown key and a wrong one: the same RequestError). A step
    for which ``lose(job)`` is true raises StepLost, as a lost worker's
    does; the session's next step then says ``resumed_from_step``.
    """

    answer: Callable[[CodeJob], JobOutcome] = lambda job: ok_outcome(job.code)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    started: list[CodeJob] = field(default_factory=list)
    running: int = 0
    most_running: int = 0
    closed: int = 0
    session_ends: Callable[[CodeJob], bool] = lambda job: job.code.startswith("exit")
    sessions: list[FakeSession] = field(default_factory=list)
    host_calls: Callable[[CodeJob], list[HostCall]] = lambda job: []
    replies: dict[str | None, list[HostReply]] = field(default_factory=dict)
    transfers: list[str] = field(default_factory=list)  # the path of each session transfer, in order
    keys: bool = False
    store: dict[str, FakeSession] = field(default_factory=dict)  # detached sessions by key
    lose: Callable[[CodeJob], bool] = lambda job: False
    attached: int = 0

    async def attach_session(self, key: str) -> tuple[FakeSession, int]:
        if self.closed:
            raise PoolWorkerError("the pool is shutting down")
        found = next((held for stored, held in self.store.items() if hmac.compare_digest(stored, key)), None)
        if found is None:
            raise RequestError("no stored session has this key", "attach")
        del self.store[found.key]  # type: ignore[arg-type]
        session = dataclasses.replace(found, ended=False, closes=0, detaches=0)
        self.sessions.append(session)
        self.attached += 1
        return session, session.steps

    async def open_session(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None = None, output: OutputSink | None = None,
        cancel: Cancellation = NEVER,
    ) -> tuple[FakeSession, StepOutcome]:
        session = FakeSession(self, job, key=secrets.token_urlsafe(32) if self.keys else None)
        self.sessions.append(session)
        return session, await session.step(job, job_id, host, output, cancel)

    async def run(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None = None, cancel: Cancellation = NEVER,
        output: OutputSink | None = None, then: Callable[[JobOutcome], None] | None = None,
    ) -> JobOutcome:
        outcome = await self._run(job, job_id, host, cancel, output)
        if then is not None:
            then(outcome)
        return outcome

    async def _run(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None, cancel: Cancellation,
        output: OutputSink | None,
    ) -> JobOutcome:
        if self.closed:
            raise PoolWorkerError("the pool is shutting down; the job did not run")
        self.started.append(job)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if host is not None:
                deadline = time.monotonic() + job.timeout_ms / 1000
                for call in self.host_calls(job):
                    call = dataclasses.replace(call, deadline=deadline)
                    reply = await asyncio.to_thread(host, call)
                    self.replies.setdefault(job_id, []).append(reply)
            gate = self.gates.get(job.code)
            if gate is not None:
                while not gate.is_set():  # as a worker does: a cancel stops the job at once
                    if cancel.cancelled:
                        return JobOutcome.failure(ErrorType.POOL_WORKER, CANCELLED_MESSAGE, 0, "fake")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(gate.wait(), 0.01)
            outcome = self.answer(job)
            if job.collect and outcome.collected is None:  # a job's workspace is its files
                outcome = dataclasses.replace(outcome, collected=_collected(job, dict(job.files)))
            if output is not None:  # as a worker streams: what the result holds, ahead of it
                for stream, data in (("stdout", outcome.stdout), ("stderr", outcome.stderr)):
                    if data:
                        await asyncio.to_thread(output, OutputChunk(stream, data))
            return outcome
        finally:
            self.running -= 1

    async def close(self) -> None:
        self.closed += 1
        for gate in self.gates.values():
            gate.set()

    async def gated(self, key: str) -> None:
        gate = self.gates.get(key)
        if gate is not None:
            await gate.wait()


@dataclass(eq=False)
class FakeSession:
    """A :class:`FakeBackend` session: each step is one of the backend's jobs, numbered."""

    backend: FakeBackend
    job: CodeJob
    steps: int = 0
    ended: bool = False
    closes: int = 0
    workspace: dict[str, bytes] = field(default_factory=dict)
    key: str | None = field(default=None, repr=False)
    detaches: int = 0
    lost_after: int | None = None  # the step whose state a step lost since left the session at

    async def run_step(
        self, step: Step, job_id: str | None, host: HostFunction | None = None, output: OutputSink | None = None,
        cancel: Cancellation = NEVER, then: Callable[[StepOutcome], None] | None = None,
    ) -> StepOutcome:
        outcome = await self.step(self.job.step(step), job_id, host, output, cancel)
        if then is not None:
            then(outcome)
        return outcome

    async def step(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None = None, output: OutputSink | None = None,
        cancel: Cancellation = NEVER,
    ) -> StepOutcome:
        if self.ended:
            raise RequestError("the session has ended", "session")
        if self.backend.lose(job):
            self.lost_after = self.steps
            raise StepLost("the worker running this step was lost; the step may have run in part")
        resumed_from, self.lost_after = self.lost_after, None
        self.workspace.update(job.files)
        outcome = await self.backend.run(job, job_id, host, cancel, output)  # a subclass's run, if it has one
        if job.collect:  # from the session's workspace, whatever run made of the job's own files
            outcome = dataclasses.replace(outcome, collected=_collected(job, self.workspace))
        self.steps += 1
        # As the worker's sessions: a step that did not end on its own (timeout, cancel) ends the session.
        timed_out = outcome.error is not None and getattr(outcome.error, "type", None) == ErrorType.TIMEOUT
        self.ended = self.backend.session_ends(job) or timed_out or outcome.exit is None
        return StepOutcome(outcome, self.steps, self.ended, resumed_from_step=resumed_from)

    async def close(self) -> None:
        self.closes += 1
        self.ended = True

    async def detach(self) -> None:
        self.detaches += 1
        if self.key is None:
            await self.close()
            return
        self.ended = True
        self.backend.store[self.key] = self

    # A fake has no sandbox to checkpoint: hibernation is the real worker's (test_pool_hibernate).
    hibernated = False

    async def hibernate(self) -> float:
        raise RequestError("a FakeBackend session cannot hibernate", "session")

    async def fork(self) -> tuple[FakeSession, float]:
        raise RequestError("a FakeBackend session cannot fork", "session")



    # Files: the workspace dict, held to the session's transfer_bytes as the worker holds it.

    async def upload_chunk(self, path: str, offset: int, data: bytes, size: int) -> int:
        await self._transfer(path)
        if size > self.job.transfer_bytes:
            raise RequestError(f"{size} bytes is more than the session's transfer_bytes", "size")
        held = b"" if offset == 0 else self.workspace.get(path, b"")
        if offset != len(held):
            raise RequestError(f"starts at {offset}, but {path!r} holds {len(held)} bytes", "offset")
        self.workspace[path] = held + data
        return len(self.workspace[path])

    async def download_chunk(self, path: str, offset: int, length: int) -> FileChunk:
        await self._transfer(path)
        if path not in self.workspace:
            raise RequestError(f"no file {path!r} in the workspace", "download")
        data = self.workspace[path]
        if offset > len(data):
            raise RequestError(f"{path!r} holds {len(data)} bytes, fewer than {offset}", "offset")
        return FileChunk(path, offset, len(data), 0, data[offset : offset + length])

    async def list_files(self, path: str) -> FileListing:
        await self._transfer(path)
        prefix = "" if path == "." else path + "/"
        entries: dict[str, FileEntry] = {}
        for name, data in self.workspace.items():
            if name.startswith(prefix):
                first, _, rest = name[len(prefix) :].partition("/")
                entries[first] = FileEntry(first, 0, "dir") if rest else FileEntry(first, len(data), "file")
        if not entries and path != ".":
            raise RequestError(f"no directory {path!r} in the workspace", "list")
        listed = sorted(entries.values(), key=lambda entry: entry.name)
        return FileListing(path, tuple(listed[:MAX_LISTED_ENTRIES]), truncated=len(listed) > MAX_LISTED_ENTRIES)

    async def _transfer(self, path: str) -> None:
        if self.ended:
            raise RequestError("the session has ended", "session")
        self.backend.transfers.append(path)  # not a running job: a transfer holds no slot
        await self.backend.gated(path)


def _collected(job: CodeJob, workspace: Mapping[str, bytes]) -> Collected:
    """What ``job.collect`` brings back from ``workspace``, as the worker would (bar its glob)."""
    files: dict[str, bytes] = {}
    left_out: list[LeftOut] = []
    for pattern in job.collect:
        matched = [path for path in workspace if fnmatch.fnmatchcase(path, pattern)]
        if not matched and not is_pattern(pattern):
            left_out.append(LeftOut(pattern, "unreadable"))
        for path in matched:
            data = workspace[path]
            if path in files:
                continue
            if len(files) >= job.collect_files:
                left_out.append(LeftOut(path, "count", len(data)))
            elif sum(map(len, files.values())) + len(data) > job.collect_bytes:
                left_out.append(LeftOut(path, "size", len(data)))
            else:
                files[path] = data
    return Collected(files, tuple(left_out))
