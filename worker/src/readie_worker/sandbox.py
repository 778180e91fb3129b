"""One sandbox lifecycle, three transports.

Every way of getting an executor ready follows the same steps, written once
in :func:`launch`: make the sandbox's own directory, start an executor that
sits at its capture point (restored from a checkpoint, or cold-started in
capture mode), hand it the environment it should serve with, wait for its
socket. Transports differ only in how the process is started and destroyed:

* :class:`RunscRestore`: ``runsc restore`` from a checkpoint image;
* :class:`RunscCold`: ``runsc run`` of the same rootfs and imports (fallback);
* :class:`LocalProcess`: a plain host subprocess, for development only: no
  isolation at all, refused unless explicitly enabled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Protocol

import structlog

import cloudpickle

from readie_executor import probe
from readie_executor.protocol import (
    END_OF_STREAM,
    FramingError,
    Message,
    MessageReader,
    TruncatedMessage,
    encode_message,
    iter_frames,
)
from readie_executor.sockets import RECV_SIZE

from . import _reaper
from .bundle import EXECUTOR_DIR, SINGLE_THREAD_ENV, MountPlan, SandboxSpec, capture_env, serve_env
from ._states import SandboxState, check_transition
from .errors import PoolWorkerError, SandboxSetupError
from .manifest import Checkpoint, Manifest
from .runsc import Runsc, RunscError

log = structlog.get_logger("readie.sandbox")

# The executor spec: the worker retries the socket for up to 60 s by default.
SOCKET_WAIT_S = 60.0
SOCKET_POLL_S = 0.002
# A sandbox id becomes part of the socket path, which may not exceed 107 bytes.
SANDBOX_ID_BYTES = 6
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


class ExecutorTimeout(PoolWorkerError):
    """The executor did not answer within the call's deadline."""


class _NoResponse(Exception):
    """The executor closed the connection between messages."""


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


class Launcher(Protocol):
    """How one kind of sandbox is started and torn down."""

    name: str
    isolated: bool

    def start(self, sandbox: SandboxDir, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        """Start an executor at its capture point; its stdin and stdout are pipes."""

    def executor_dir(self, sandbox: SandboxDir) -> str:
        """EXECUTOR_DIR as the executor inside sees it."""

    def destroy(self, sandbox: SandboxDir, process: subprocess.Popen[bytes]) -> None: ...

    def oom_killed(self, sandbox: SandboxDir) -> bool:
        """Whether the memory backstop killed the sandbox (asked before destroy)."""


@dataclass(frozen=True)
class SandboxDir:
    """The host directory of one sandbox: its bundle, executor dir and logs."""

    id: str
    path: Path

    @property
    def executor_dir(self) -> Path:
        return self.path / "run"

    @property
    def socket_path(self) -> Path:
        return self.executor_dir / "executor.sock"

    @property
    def unused_slots(self) -> Path:
        return self.path / "unused"

    @property
    def log_path(self) -> Path:
        return self.path / "runsc.log"

    @classmethod
    def create(cls, run_dir: Path) -> SandboxDir:
        sandbox_id = "rd-" + secrets.token_hex(SANDBOX_ID_BYTES)
        path = run_dir / sandbox_id
        for directory in (path, path / "run", path / "unused"):
            directory.mkdir(parents=True, exist_ok=False)
        return cls(sandbox_id, path)


@dataclass
class Sandbox:
    """A ready executor. Use :meth:`call` for raw framed calls; :meth:`destroy` always."""

    dir: SandboxDir
    launcher: Launcher
    process: subprocess.Popen[bytes]
    ready_ms: float
    state: SandboxState = SandboxState.READY
    _connection: socket.socket | None = field(default=None, repr=False)

    @property
    def id(self) -> str:
        return self.dir.id

    @property
    def destroyed(self) -> bool:
        return self.state is SandboxState.DEAD

    def move(self, target: SandboxState) -> None:
        self.state = check_transition(self.state, target)

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
        answer: Callable[[bytes], bytes | None] | None = None,
    ) -> bytes:
        """Send one request; return the payload of the message that answers it.

        With ``answer``, each message from the executor is offered to it
        first: bytes it returns are sent back as a reply and the next message
        is read; None means this message is the response. The whole exchange
        keeps one deadline, ``timeout`` seconds from now, and time spent in
        ``answer`` counts against it. ``max_response`` bounds every message.
        Any failure, or an exception from ``answer``, drops the connection.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        connection = self._connect()
        reader = MessageReader(max_response) if max_response else MessageReader()
        try:
            _send(connection, payload, deadline)
            while True:
                response = _receive(connection, reader, deadline)
                if response is None:
                    raise _NoResponse
                reply = None if answer is None else answer(response)
                if reply is None:
                    return response
                _send(connection, reply, deadline)
        except TimeoutError:
            self._drop_connection()
            raise ExecutorTimeout(f"sandbox {self.id}: no response within {timeout} s") from None
        except TruncatedMessage as exc:
            self._drop_connection()
            raise PoolWorkerError(f"sandbox {self.id}: truncated response: {exc}") from None
        except FramingError as exc:
            self._drop_connection()
            raise PoolWorkerError(f"sandbox {self.id}: malformed response: {exc}") from None
        except _NoResponse:
            self._drop_connection()
            raise PoolWorkerError(f"sandbox {self.id}: no response: the executor closed the connection") from None
        except OSError as exc:
            self._drop_connection()
            raise PoolWorkerError(f"sandbox {self.id}: executor connection failed: {exc}") from None
        except BaseException:
            self._drop_connection()
            raise

    def oom_killed(self) -> bool:
        return self.launcher.oom_killed(self.dir)

    def alive(self) -> bool:
        """The liveness probe: run before a sandbox that waited in a pool is trusted with a job."""
        try:
            return self.call(_PING_REQUEST, timeout=PROBE_TIMEOUT_S, max_response=len(probe.PONG)) == probe.PONG
        except PoolWorkerError:
            return False

    def destroy(self) -> None:
        if self.destroyed:
            return
        self.state = SandboxState.DEAD
        self._drop_connection()
        try:
            self.launcher.destroy(self.dir, self.process)
        finally:
            _close_pipes(self.process)
            shutil.rmtree(self.dir.path, ignore_errors=True)

    def _connect(self) -> socket.socket:
        if self._connection is None:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connection.connect(os.fsencode(self.dir.socket_path))
            except OSError as exc:
                connection.close()
                raise PoolWorkerError(f"sandbox {self.id}: cannot connect to the executor: {exc}") from exc
            self._connection = connection
        return self._connection

    def _drop_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def launch(
    launcher: Launcher,
    run_dir: Path,
    env: Mapping[str, str],
    socket_wait_s: float = SOCKET_WAIT_S,
) -> Sandbox:
    """Start a sandbox, hand its executor ``env``, and return it once its socket answers."""
    started = time.monotonic()
    sandbox_dir = SandboxDir.create(run_dir)
    process: subprocess.Popen[bytes] | None = None
    try:
        full_env = {**env, "EXECUTOR_DIR": launcher.executor_dir(sandbox_dir), "EXECUTOR_MODE": "sandbox"}
        process = launcher.start(sandbox_dir, full_env)
        hand_over(process, full_env)
        _wait_for_socket(sandbox_dir, process, socket_wait_s)
    except BaseException:
        if process is not None:
            launcher.destroy(sandbox_dir, process)
            _close_pipes(process)
        shutil.rmtree(sandbox_dir.path, ignore_errors=True)
        raise
    ready_ms = (time.monotonic() - started) * 1000
    log.debug("sandbox ready", sandbox=sandbox_dir.id, launcher=launcher.name, ready_ms=round(ready_ms, 1))
    return Sandbox(sandbox_dir, launcher, process, ready_ms)


def hand_over(process: subprocess.Popen[bytes], env: Mapping[str, str]) -> None:
    """Give an executor waiting at its capture point the environment it wakes up to."""
    assert process.stdin is not None
    try:
        process.stdin.write(json.dumps({"env": dict(env)}).encode() + b"\n")
        process.stdin.flush()
    except OSError as exc:
        raise SandboxSetupError(f"executor took no handover: {exc}") from None


def _wait_for_socket(sandbox: SandboxDir, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    path = os.fsencode(sandbox.socket_path)
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            return
        except OSError:
            pass
        finally:
            probe.close()
        if _stdout_closed(process.stdout):
            raise SandboxSetupError(f"sandbox {sandbox.id}: executor exited before binding its socket{_log_tail(sandbox)}")
        if time.monotonic() >= deadline:
            raise SandboxSetupError(f"sandbox {sandbox.id}: no executor socket after {timeout:.0f} s{_log_tail(sandbox)}")
        time.sleep(SOCKET_POLL_S)


def _stdout_closed(stdout: IO[bytes] | None) -> bool:
    """The executor never writes to stdout once serving, so readable means EOF: it died."""
    if stdout is None:
        return False
    ready, _, _ = select.select([stdout.fileno()], [], [], 0)
    return bool(ready) and not os.read(stdout.fileno(), 4096)


def _log_tail(sandbox: SandboxDir) -> str:
    try:
        tail = sandbox.log_path.read_text(errors="replace")[-1500:].strip()
    except OSError:
        return ""
    return f": {tail}" if tail else ""


def _close_pipes(process: subprocess.Popen[bytes]) -> None:
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


@dataclass(frozen=True)
class _RunscLauncher:
    runsc: Runsc
    rootfs: Path
    plan: MountPlan
    base_env: Mapping[str, str]
    sources: Mapping[PurePosixPath, Path] = field(default_factory=dict)
    # The cgroup backstop under the per-job RLIMIT_AS: it kills the whole sandbox.
    memory_limit_bytes: int | None = None
    isolated: bool = True

    def executor_dir(self, sandbox: SandboxDir) -> str:
        return str(EXECUTOR_DIR)

    def oom_killed(self, sandbox: SandboxDir) -> bool:
        return self.runsc.oom_killed(sandbox.id)

    def spec(self, sandbox: SandboxDir) -> SandboxSpec:
        return SandboxSpec(
            rootfs=self.rootfs,
            executor_dir=sandbox.executor_dir,
            env=self.base_env,
            plan=self.plan,
            sources=self.sources,
            unused_slot_source=sandbox.unused_slots,
            memory_limit_bytes=self.memory_limit_bytes,
        )

    def destroy(self, sandbox: SandboxDir, process: subprocess.Popen[bytes]) -> None:
        try:
            self.runsc.destroy(sandbox.id)
        except RunscError as exc:
            log.warning("sandbox destroy failed", sandbox=sandbox.id, error=str(exc))


@dataclass(frozen=True)
class RunscRestore(_RunscLauncher):
    checkpoint: Checkpoint | None = None
    name: str = "runsc-restore"

    def start(self, sandbox: SandboxDir, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        assert self.checkpoint is not None
        self.spec(sandbox).write(sandbox.path)
        args = ["restore", "--detach", f"--image-path={self.checkpoint.image_path}", "--bundle", str(sandbox.path), sandbox.id]
        return self.runsc.start_detached(args, sandbox.log_path)


@dataclass(frozen=True)
class RunscCold(_RunscLauncher):
    """A cold runsc start that still pre-imports: the executor starts in capture
    mode and is handed its serving environment at once, so the path to the
    socket is the same as after a restore."""

    name: str = "runsc-cold"

    def start(self, sandbox: SandboxDir, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        self.spec(sandbox).write(sandbox.path)
        return self.runsc.start_detached(["run", "--detach", "--bundle", str(sandbox.path), sandbox.id], sandbox.log_path)


@dataclass(frozen=True)
class SandboxFactory:
    """Makes sandboxes of one kind; falls back to ``fallback`` when ``primary`` fails."""

    primary: Launcher
    run_dir: Path
    env: Mapping[str, str]
    fallback: Launcher | None = None
    socket_wait_s: float = SOCKET_WAIT_S

    def with_sources(self, sources: Mapping[PurePosixPath, Path]) -> SandboxFactory:
        """The same kind of sandbox with these mount slots pointed at host paths."""
        return dataclasses.replace(
            self,
            primary=_with_sources(self.primary, sources),
            fallback=None if self.fallback is None else _with_sources(self.fallback, sources),
        )

    def create(self) -> Sandbox:
        try:
            return launch(self.primary, self.run_dir, self.env, self.socket_wait_s)
        except SandboxSetupError as exc:
            if self.fallback is None:
                raise
            log.warning(
                "sandbox start failed; falling back",
                launcher=self.primary.name,
                fallback=self.fallback.name,
                error=str(exc),
            )
        return launch(self.fallback, self.run_dir, self.env, self.socket_wait_s)


@dataclass(frozen=True)
class LocalProcess:
    """No isolation whatsoever: the executor runs as a host process. Development only."""

    preimport: tuple[str, ...] = ()
    python: str = sys.executable  # the worker's own environment has readie_executor
    name: str = "local-unisolated"
    isolated: bool = False

    def executor_dir(self, sandbox: SandboxDir) -> str:
        return str(sandbox.executor_dir)

    def start(self, sandbox: SandboxDir, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        capture_env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            **SINGLE_THREAD_ENV,
            "EXECUTOR_DIR": str(sandbox.executor_dir),
            "EXECUTOR_MODE": "capture",
            "READIE_PREIMPORT": ",".join(self.preimport),
        }
        with open(sandbox.log_path, "ab") as stderr:
            return _reaper.popen(
                [self.python, "-u", "-m", "readie_executor"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=capture_env,
                cwd=sandbox.path,
            )

    def destroy(self, sandbox: SandboxDir, process: subprocess.Popen[bytes]) -> None:
        process.kill()
        process.wait()

    def oom_killed(self, sandbox: SandboxDir) -> bool:
        return False


def _with_sources(launcher: Launcher, sources: Mapping[PurePosixPath, Path]) -> Launcher:
    if isinstance(launcher, _RunscLauncher):
        return dataclasses.replace(launcher, sources={**launcher.sources, **sources})
    return launcher  # a local process sees the host as it is: there is nothing to mount


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
        base_env=capture_env(manifest.mount_plan, checkpoint.preimport),
        memory_limit_bytes=memory_limit_bytes,
    )
    return SandboxFactory(
        primary=RunscRestore(checkpoint=checkpoint, **common),  # type: ignore[arg-type]
        fallback=RunscCold(**common),  # type: ignore[arg-type]
        run_dir=run_dir,
        env=serve_env(checkpoint.preimport) if env is None else env,
    )
