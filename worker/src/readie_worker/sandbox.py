"""One sandbox lifecycle, its launchers pluggable.

Every way of getting an executor ready follows the same steps, written once
in :func:`launch`: make the sandbox's own directory (a tmpfs with the job's
held grants mounted in it, ``_sandbox_dir``), start an executor that sits at
its capture point (restored from a checkpoint, or cold-started in capture
mode), hand it the environment it should serve with, wait for its socket.
Launchers (``launchers``) differ only in how the process is started and
destroyed: a runsc restore, a runsc cold start, a plain host process.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import cloudpickle
import structlog

from readie_executor import jobs as executor_jobs
from readie_executor import probe
from readie_executor.hibernation import HIBERNATE, HIBERNATING
from readie_executor.framing import (
    END_OF_STREAM, FramingError, Message, MessageReader, TruncatedMessage, encode_message, iter_frames,
)
from readie_executor.sockets import RECV_SIZE

from readie_policy.jobs import JOB_SUBPROCESSES  # what a job's spec sends, and a warm-up prepares for
from readie_policy.policy import DEFAULT_MAX_OUTPUT  # what most jobs ask, and a warm-up prepares for

from ._grant_fs import PathIdentity
from ._handover import hand_over
from ._sandbox_dir import SandboxDir
from ._socket_wait import connect_executor, wait_for_socket
from ._states import SandboxState, check_transition
from .bundle import capture_env, serve_env
from .errors import (
    ErrorMap, ExecutorTimeout, PoolWorkerError, SandboxSetupError, host_failure, host_reason,
    mapped_errors,
)
from .grants import NO_GRANTS, HeldGrants
from .manifest import Checkpoint, Manifest
from .launchers import Launcher, RunscCold, RunscRestore
from .runsc import Launched, Runsc

if TYPE_CHECKING:  # its module loads the resolver's DNS library: only networked workers need it
    from .egress_net import SandboxNetwork

log = structlog.get_logger("readie.sandbox")

# The executor spec: the worker retries the socket for up to 60 s by default.
SOCKET_WAIT_S = 60.0
# A healthy executor answers a ping in well under a millisecond; a second
# means it is wedged, and a wedged sandbox is never handed a job.
PROBE_TIMEOUT_S = 1.0
# A message up to this size is framed into one buffer and sent in one write.
# Each write is one buffer in the kernel's queue, charged at its true size
# (about a kilobyte even for a few bytes); replies the sandbox leaves unread
# must not fill the socket's send buffer three times faster than they need to.
SINGLE_WRITE_BYTES = 64 * 1024
# Pickled once: a reference to readie_executor.probe.ping, not code.
_PING_REQUEST = cloudpickle.dumps({"func": probe.ping, "args": (), "kwargs": {}})
# The warm-up runs a do-nothing job through the runner (~10-30 ms in a fresh
# sandbox); ten seconds means the sandbox is wedged and is not handed out.
WARM_UP_TIMEOUT_S = 10.0
# An honest warm-up answers jobs.WARMED_UP or a short failure line.
MAX_WARM_UP_ANSWER = 4096
# An idle executor closes its sockets at once when asked to hibernate. A thread the
# session left running may hold the interpreter for a while (a C call); five seconds
# without an answer means it is wedged, and it is not checkpointed.
HIBERNATE_ANSWER_S = 5.0
_WARM_UP_REQUEST = cloudpickle.dumps(
    {"func": executor_jobs.warm_up, "args": (), "kwargs": {"subprocesses": JOB_SUBPROCESSES, "max_output": DEFAULT_MAX_OUTPUT}}
)


#: What ``exchange``'s ``answer`` returns for a message that gets no reply.
NO_REPLY = b""


@dataclass(frozen=True, slots=True)
class UnsentRest:
    """What ``exchange``'s ``answer`` returns when another thread began sending its reply
    (:meth:`Sandbox.send_now`) and the socket took only part: the rest, sent as it is."""

    data: bytes


class _NoResponse(Exception):
    """The executor closed the connection between messages."""


def _exchange_failures(sandbox_id: str, timeout: float | None) -> ErrorMap:
    """What an exchange's failures are to its caller: a timeout the executor's, anything else
    on the socket a broken sandbox (it is not trusted again)."""
    return {
        TimeoutError: lambda _: ExecutorTimeout(f"sandbox {sandbox_id}: no response within {timeout} s"),
        TruncatedMessage: lambda exc: PoolWorkerError(f"sandbox {sandbox_id}: truncated response: {exc}"),
        FramingError: lambda exc: PoolWorkerError(f"sandbox {sandbox_id}: malformed response: {exc}"),
        _NoResponse: lambda _: PoolWorkerError(f"sandbox {sandbox_id}: no response: the executor closed the connection"),
        OSError: lambda exc: PoolWorkerError(f"sandbox {sandbox_id}: executor connection failed: {host_reason(exc)}"),
    }


def _set_timeout(connection: socket.socket, deadline: float | None) -> None:
    """The time left before ``deadline`` as the socket's timeout; TimeoutError once it has passed."""
    if deadline is None:
        connection.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    connection.settimeout(left)


def _send(connection: socket.socket, payload: bytes, deadline: float | None) -> None:
    if len(payload) <= SINGLE_WRITE_BYTES:
        _set_timeout(connection, deadline)
        connection.sendall(encode_message(payload))
        return
    for piece in iter_frames(payload):
        _set_timeout(connection, deadline)
        connection.sendall(piece)


def _receive(connection: socket.socket, reader: MessageReader, deadline: float | None) -> bytes | None:
    """The next message's payload, or None at a clean end of stream; every recv waits only
    until ``deadline``, so a trickle of bytes cannot stretch the exchange."""
    while True:
        event = reader.next_event()
        if isinstance(event, Message):
            return event.payload
        if event is END_OF_STREAM:
            return None
        _set_timeout(connection, deadline)
        reader.feed(connection.recv(RECV_SIZE))


@dataclass
class Sandbox:
    """A ready executor. Use :meth:`call` for raw framed calls; :meth:`destroy` always."""

    dir: SandboxDir
    launcher: Launcher
    launched: Launched
    ready_ms: float
    state: SandboxState = SandboxState.READY
    # The memory cgroup's limit once a job's 'memory' set it (None: the worker's backstop).
    memory_limit_bytes: int | None = None
    # What each write grant mounted in it was when opened: what report_files lists (jobs.py).
    write_grants: tuple[PathIdentity, ...] = ()
    # Keeps the gofer's mount namespace, where its grants are mounted, whole until destroy.
    mounts_held: int | None = None
    # Its network namespace's wiring (egress), removed after it: runsc holds the namespace till then.
    network: SandboxNetwork | None = None
    _connection: socket.socket | None = field(default=None, repr=False)
    # interrupt() may come from another thread at any moment of an exchange.
    _interrupted: bool = field(default=False, repr=False)
    _connecting: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _paused: bool = field(default=False, repr=False)

    @property
    def id(self) -> str:
        return self.dir.id

    @property
    def destroyed(self) -> bool:
        return self.state is SandboxState.DEAD

    def move(self, target: SandboxState) -> None:
        self.state = check_transition(self.state, target)

    def attach(self, grants: HeldGrants) -> None:
        """Mount a job's grants in this (running) sandbox's slots (``SandboxDir.attach``)."""
        with host_failure(SandboxSetupError, f"sandbox {self.id}: cannot mount its grants"):  # not the request's doing
            self.dir.attach(grants.grants)
        self.write_grants = grants.write_grants

    def call(self, payload: bytes, timeout: float | None = None, max_response: int | None = None) -> bytes:
        """Send one framed request and return the framed response's payload, unopened.

        A stream that ends inside the response is reported as truncated, one
        that ends before any byte as no response; either way the connection is
        not reused.
        """
        return self.exchange(payload, timeout=timeout, max_response=max_response)

    def exchange(
        self,
        payload: bytes,
        *,
        timeout: float | None = None,
        max_response: int | None = None,
        answer: Callable[[bytes], bytes | UnsentRest | None] | None = None,
    ) -> bytes:
        """Send one request; return the payload of the message that answers it.

        With ``answer``, each message from the executor is offered to it
        first: bytes it returns are sent back as a reply and the next message
        is read; :data:`NO_REPLY` sends nothing and reads on; None means this
        message is the response. The whole exchange
        keeps one deadline, ``timeout`` seconds from now, and time spent in
        ``answer`` counts against it. ``max_response`` bounds every message.
        Any failure, or an exception from ``answer``, drops the connection.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        connection = self._connect()
        reader = MessageReader(max_response) if max_response else MessageReader()
        try:
            with mapped_errors(_exchange_failures(self.id, timeout)):
                _send(connection, payload, deadline)
                while True:
                    response = _receive(connection, reader, deadline)
                    if response is None:
                        raise _NoResponse
                    reply = None if answer is None else answer(response)
                    if reply is None:
                        return response
                    if isinstance(reply, UnsentRest):
                        _set_timeout(connection, deadline)
                        connection.sendall(reply.data)
                    elif reply is not NO_REPLY:
                        _send(connection, reply, deadline)
        except BaseException:
            self._drop_connection()
            raise

    def send_now(self, data: bytes) -> int:
        """How much of ``data`` the executor's socket takes at once, never waiting: 0 when it is
        full, or the connection is gone or broken (the exchange's thread finds that out itself).

        For a thread other than the exchange's, while that one waits inside its ``answer``
        (which then returns what is left, as :class:`UnsentRest`): the two never write at once.
        """
        with self._connecting:
            connection = self._connection
            if connection is None or self._interrupted:
                return 0
            try:
                # Never waits; the exchange sets its own timeout again before its next send or receive.
                connection.settimeout(0.0)
                return connection.send(data)
            except OSError:
                return 0

    def oom_killed(self) -> bool:
        return self.launcher.oom_killed(self.dir)

    def interrupt(self) -> None:
        """Make the exchange under way, or the next one, fail at once: from any thread.

        Shutting the socket down wakes a thread blocked on it (closing it would
        not, and its descriptor number could be reused under that thread). The
        sandbox is not trusted again; its owner destroys it as after any
        broken exchange.
        """
        with self._connecting:
            self._interrupted = True
            if self._connection is not None:
                try:
                    self._connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @property
    def interrupted(self) -> bool:
        return self._interrupted

    def limit_memory(self, job_bytes: int) -> None:
        """Bound the whole sandbox, files in its memory-backed filesystems included, to what it
        holds now plus ``job_bytes`` (a job's ``memory``) and the sentry's share of those."""
        self.memory_limit_bytes = self.launcher.limit_memory(self.dir, job_bytes)

    def memory_left(self) -> int | None:
        """Bytes the sandbox may still take, files in its memory-backed filesystems included,
        before its memory cgroup's limit; None where no limit is known (unisolated)."""
        return self.launcher.memory_left(self.dir)

    def alive(self, timeout: float = PROBE_TIMEOUT_S) -> bool:
        """The liveness probe: run before a sandbox that waited warm is trusted with a job."""
        try:
            return self.call(_PING_REQUEST, timeout=timeout, max_response=len(probe.PONG)) == probe.PONG
        except PoolWorkerError:
            return False

    def connection_intact(self) -> bool:
        """Whether the connection kept from the last call is open and quiet, without a round trip.

        An idle executor never writes unasked, so anything readable (end of
        file above all: the executor or its sandbox died) means it is not.
        False too with no kept connection.
        """
        with self._connecting:
            if self._connection is None or self._interrupted:
                return False
            poller = select.poll()  # not select(): it refuses descriptors past 1023
            poller.register(self._connection, select.POLLIN | select.POLLPRI)
            try:
                return not poller.poll(0)  # POLLHUP and POLLERR are reported whatever was asked
            except OSError:
                return False

    def warm_up(self) -> str | None:
        """Pay a restored sandbox's first-touch costs now, not in its first job; why not, if it failed.

        Before hand-out, and after a session's per-step checkpoint (``_step_checkpoint``):
        the job asks for nothing the process keeps (no session ``__main__``, links or limits).
        """
        try:
            answer = self.call(_WARM_UP_REQUEST, timeout=WARM_UP_TIMEOUT_S, max_response=MAX_WARM_UP_ANSWER)
        except PoolWorkerError as exc:
            return str(exc)
        return None if answer == executor_jobs.WARMED_UP else repr(answer[:200])

    def checkpoint(self, image_dir: Path) -> None:
        """Save this sandbox, its session's state and all, to ``image_dir``; the container ends.

        The executor is asked to close its sockets first
        (``readie_executor.hibernation``), and the checkpoint waits for the end
        of its connection, which says both are closed. Only :meth:`destroy`
        is left to do afterwards, whatever happened. Raises PoolWorkerError
        when the executor does not hibernate, RunscError when the checkpoint
        fails.
        """
        self.quiesce()
        self.launcher.checkpoint(self.dir, image_dir)

    def quiesce(self) -> None:
        """Ask the executor to hibernate and wait until its connection ends (both its sockets closed):
        the sandbox may be checkpointed now. Raises PoolWorkerError when it does not."""
        deadline = time.monotonic() + HIBERNATE_ANSWER_S
        answer = self.exchange(HIBERNATE, timeout=HIBERNATE_ANSWER_S, max_response=len(HIBERNATING))
        connection = self._connect()
        try:
            if answer != HIBERNATING:
                raise PoolWorkerError(f"sandbox {self.id}: answered {answer[:40]!r} when asked to hibernate")
            with host_failure(PoolWorkerError, f"sandbox {self.id}: did not close its connection to hibernate"):
                _set_timeout(connection, deadline)
                if connection.recv(1):
                    raise PoolWorkerError(f"sandbox {self.id}: wrote after it said it was hibernating")
        finally:
            self._drop_connection()

    def pause(self) -> None:
        """Stop it while it waits (a warm set's, an idle session's): an idle gVisor sentry still wakes
        every 400 µs (systrap's fast-path controller). Its owner resumes it before anything talks to it."""
        if not self.destroyed and not self._paused:
            self._paused = self.launcher.pause(self.dir, self.launched.process)

    def resume(self) -> bool:
        """Let a paused sandbox run again; whether it runs (False: it could not be resumed)."""
        if self._paused:
            self._paused = not self.launcher.resume(self.dir, self.launched.process)
        return not self._paused

    @property
    def paused(self) -> bool:
        return self._paused

    def cpu_ns(self) -> int | None:
        """CPU nanoseconds it has used so far (None where the launcher cannot tell)."""
        return self.launcher.cpu_ns(self.dir, self.launched.process)

    def destroy(self) -> None:
        # A paused one needs no resume first: the launcher's destroy thaws what it has killed.
        if self.destroyed:
            return
        self.state = SandboxState.DEAD
        self._drop_connection()
        try:
            self.launcher.destroy(self.dir, self.launched.process)
        finally:
            self.launched.close()
            self.dir.remove()
            if self.mounts_held is not None:
                os.close(self.mounts_held)
            if self.network is not None:
                self.network.discard()

    def _connect(self) -> socket.socket:
        with self._connecting:
            if self._interrupted:
                raise PoolWorkerError(f"sandbox {self.id}: interrupted")
            if self._connection is None:
                connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                connection.settimeout(PROBE_TIMEOUT_S)  # a full backlog fails the connect, never hangs it
                try:
                    with host_failure(PoolWorkerError, f"sandbox {self.id}: cannot connect to the executor"):
                        connect_executor(connection, self.dir.socket_path)
                except PoolWorkerError:
                    connection.close()
                    raise
                self._connection = connection
            return self._connection

    def _drop_connection(self) -> None:
        with self._connecting:
            if self._connection is not None:
                self._connection.close()
                self._connection = None


def launch(
    launcher: Launcher,
    run_dir: Path,
    env: Mapping[str, str],
    grants: HeldGrants = NO_GRANTS,
    socket_wait_s: float = SOCKET_WAIT_S,
) -> Sandbox:
    """Start a sandbox with ``grants`` mounted, hand its executor ``env``, and return it once
    its socket answers."""
    started = time.monotonic()
    # The host's /tmp full, out of descriptors: not the request's doing.
    with host_failure(SandboxSetupError, "cannot make a sandbox directory"):
        sandbox_dir = SandboxDir.create(run_dir, grants.grants, private=launcher.isolated, grant_slots=launcher.plan.grant_slots())
    launched: Launched | None = None
    try:
        full_env = {**env, "EXECUTOR_DIR": launcher.executor_dir(sandbox_dir), "EXECUTOR_MODE": "sandbox"}
        with host_failure(SandboxSetupError, f"sandbox {sandbox_dir.id}: cannot start"):
            launched = launcher.start(sandbox_dir, full_env)
        hand_over(launched.process, full_env)
        wait_for_socket(sandbox_dir, launched, socket_wait_s)
        mounts_held = launcher.hold_mounts(sandbox_dir)
    except BaseException:
        # Also without a process: a runsc that timed out may have left a container behind.
        launcher.destroy(sandbox_dir, None if launched is None else launched.process)
        if launched is not None:
            launched.close()
        sandbox_dir.remove()
        raise
    ready_ms = (time.monotonic() - started) * 1000
    log.debug("sandbox ready", sandbox=sandbox_dir.id, launcher=launcher.name, ready_ms=round(ready_ms, 1))
    return Sandbox(sandbox_dir, launcher, launched, ready_ms, write_grants=grants.write_grants, mounts_held=mounts_held)


@dataclass(frozen=True)
class SandboxFactory:
    """Makes sandboxes of one kind; falls back to ``fallback`` when ``primary`` fails."""

    primary: Launcher
    run_dir: Path
    env: Mapping[str, str]
    fallback: Launcher | None = None
    socket_wait_s: float = SOCKET_WAIT_S

    def create(self, grants: HeldGrants = NO_GRANTS) -> Sandbox:
        """A ready sandbox with ``grants`` (held by the caller until this returns) mounted."""
        try:
            return launch(self.primary, self.run_dir, self.env, grants, self.socket_wait_s)
        except SandboxSetupError as exc:
            if self.fallback is None:
                raise
            log.warning(
                "sandbox start failed; falling back",
                launcher=self.primary.name,
                fallback=self.fallback.name,
                error=str(exc),
            )
        return launch(self.fallback, self.run_dir, self.env, grants, self.socket_wait_s)


def checkpoint_factory(
    runsc: Runsc,
    manifest: Manifest,
    checkpoint: Checkpoint,
    run_dir: Path,
    env: Mapping[str, str] | None = None,
    memory_limit_bytes: int | None = None,
) -> SandboxFactory:
    """Sandboxes restored from ``checkpoint``, cold-started from the same rootfs if a restore fails."""
    common = dict(
        runsc=runsc,
        rootfs=manifest.rootfs,
        plan=manifest.mount_plan,
        base_env=capture_env(manifest.mount_plan, checkpoint.preimport, checkpoint.after_restore),
        memory_limit_bytes=memory_limit_bytes,
    )
    return SandboxFactory(
        primary=RunscRestore(image_path=checkpoint.image_path, **common),  # type: ignore[arg-type]
        fallback=RunscCold(**common),  # type: ignore[arg-type]
        run_dir=run_dir,
        env=serve_env(checkpoint.preimport) if env is None else env,
    )
