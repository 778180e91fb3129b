"""runsc at arm's length: every call has a timeout, stderr goes to a file, and a
failure raises :class:`RunscError`; runsc's own words go to the worker's log."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

import structlog

from . import _reaper, cgroups
from ._sentry import kill_sandbox_process, signal_sentry_pid
from .errors import SandboxSetupError, host_failure, log_host_facts
from .paths import remove_beneath

log = structlog.get_logger("readie.runsc")

# Flags that every runsc invocation of one checkpoint family shares, beside the
# platform (chosen per binary, see RunscFeatures): a restore refuses (or
# misbehaves) when they differ from the capture's.
COMMON_FLAGS = (
    "--network=none",
    "--host-uds=create",  # lets the executor bind its socket in a bind-mounted dir
    "--overlay2=root:memory",  # a writable root per sandbox that dies with it
)
# Best first. KVM is never chosen: it hangs at boot on these VMs, and a killed
# attempt leaks cgroup dirs. systrap (runsc 2023+) makes a job's syscalls ~12x
# cheaper than ptrace.
PREFERRED_PLATFORMS = ("systrap", "ptrace")
# Short commands (kill, delete, state, checkpoint) finish in well under a
# second here; the margin covers a loaded two-core machine.
COMMAND_TIMEOUT_S = 30.0
NETNS_DIR = Path("/var/run/netns")
# This much of a failed runsc command's stderr goes to the log.
STDERR_TAIL = 2000
# What is kept of a sandbox's stderr (runsc's own messages, and its executor's
# log): the tail, for the message of a sandbox that failed to start.
STDERR_KEPT_BYTES = 16 * 1024
# What is read of it at most. A job can reach that pipe too, and reading
# without end would spend the worker's CPU on whatever it writes (9 GB in 10 s,
# measured); past this the pipe is closed and its writers get EPIPE. An honest
# sandbox writes a few lines.
STDERR_READ_BYTES = 1024 * 1024
# The runsc subcommands readie runs: the label set of a failed command (anything else: "other").
RUNSC_COMMANDS = ("run", "restore", "checkpoint", "kill", "delete", "list", "state", "wait", "events", "flags")


class RunscObserver(Protocol):
    """Told what runsc did (``metrics.Metrics`` is one)."""

    def runsc_failed(self, command: str) -> None: ...

    def sandbox_destroyed(self, seconds: float) -> None: ...


class RunscError(SandboxSetupError):
    """A runsc command failed or timed out.

    The message is a client's to read: the subcommand, how it ended, and
    ``where`` the worker's log has the rest. The command line and runsc's
    stderr name host paths and pids, so they are attributes, logged by
    :meth:`logged`, and never part of the message.
    """

    def __init__(self, args: Sequence[str], returncode: int | None, stderr: str, where: str = "") -> None:
        what = "timed out" if returncode is None else f"exited {returncode}"
        # "sandbox checkpoint exited 128": the operation, never the program and its command line.
        super().__init__(f"sandbox {args[0] if args else 'command'} {what}" + (f"; {where}" if where else ""))
        self.returncode = returncode
        self.stderr = stderr

    @classmethod
    def logged(
        cls, command: Sequence[str], args: Sequence[str], returncode: int | None, stderr: str, *, expected: bool = False
    ) -> RunscError:
        """The error for ``command`` (``args`` its runsc arguments), its command line and the tail of
        its stderr logged first (at debug level when the caller ``expected`` it could fail)."""
        where = log_host_facts(
            "runsc failed", level="debug" if expected else "warning",
            command=" ".join(command), exit=returncode, stderr=stderr.strip()[-STDERR_TAIL:],
        )
        return cls(args, returncode, stderr, where)


@dataclass(frozen=True)
class RunscFeatures:
    """What one runsc binary offers, read from its own help (:func:`features`)."""

    version: str  # ``runsc --version``'s first line
    platforms: tuple[str, ...]
    compressions: tuple[str, ...]  # values of ``checkpoint --compression``; () before runsc 2024

    @property
    def platform(self) -> str:
        return next((p for p in PREFERRED_PLATFORMS if p in self.platforms), "ptrace")

    @property
    def sandbox_flags(self) -> tuple[str, ...]:
        return (f"--platform={self.platform}", *COMMON_FLAGS)

    @property
    def checkpoint_flags(self) -> tuple[str, ...]:
        # Uncompressed images restore in ~0.6x the time with ~0.4x the CPU and
        # leave half the sentry heap; they take ~4x the disk (notes).
        return ("--compression=none",) if "none" in self.compressions else ()


def parse_platforms(flags_help: str) -> tuple[str, ...]:
    """The platforms ``runsc flags`` lists: "specifies which platform to use: systrap (default), ptrace, kvm."."""
    match = re.search(r"which platform to use: ([^.\n]*)", flags_help)
    if match is None:
        return ()
    return tuple(re.sub(r"\(default\)", "", name).strip() for name in match.group(1).split(","))


def parse_compressions(checkpoint_help: str) -> tuple[str, ...]:
    """The values ``runsc help checkpoint`` offers for -compression ("Values: none|flate-best-speed.")."""
    match = re.search(r"-compression\b.*?Values: ([\w|-]+)", checkpoint_help, re.S)
    return tuple(match.group(1).split("|")) if match else ()


@functools.cache
def features(binary: str = "runsc") -> RunscFeatures:
    """Ask ``binary`` what it supports (three short commands, once per process)."""
    return RunscFeatures(
        version=version(binary),
        platforms=parse_platforms(_help(binary, "flags")),
        compressions=parse_compressions(_help(binary, "help", "checkpoint")),
    )


def _help(binary: str, *args: str) -> str:
    completed = _ask(binary, *args)
    return completed.stdout + completed.stderr  # runsc prints help on either, by version


def _ask(binary: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run one of runsc's short informational commands (its version, its help)."""
    with host_failure(SandboxSetupError, f"cannot run {binary}", caught=(OSError, subprocess.TimeoutExpired)):
        return _reaper.run([binary, *args], timeout=COMMAND_TIMEOUT_S)


@dataclass(frozen=True)
class Runsc:
    """One runsc binary and state directory (``--root``), and the flags shared by its sandboxes.

    ``flags`` and ``checkpoint_flags`` default to what ``binary`` supports best
    (:func:`features`); both are part of a checkpoint family (:attr:`family_flags`).
    """

    root: Path
    binary: str = "runsc"
    flags: tuple[str, ...] = ()
    checkpoint_flags: tuple[str, ...] | None = None
    # Runs runsc under a wrapper, e.g. egress_net.HIDE_NET_SYSCTLS for a networked sandbox.
    prefix: tuple[str, ...] = ()
    # Told of every failed command and every destroy's time (a worker's Metrics); kept by replace().
    observer: RunscObserver | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.flags:
            object.__setattr__(self, "flags", features(self.binary).sandbox_flags)
        if self.checkpoint_flags is None:
            object.__setattr__(self, "checkpoint_flags", features(self.binary).checkpoint_flags)

    @property
    def family_flags(self) -> tuple[str, ...]:
        """Every flag an image depends on: a systrap image restored under ptrace segfaults, unrefused."""
        return (*self.flags, *(self.checkpoint_flags or ()))

    def checkpoint(self, container_id: str, image_dir: Path, *, leave_running: bool = False) -> None:
        """Checkpoint ``container_id`` into ``image_dir``, which ends the container unless
        ``leave_running`` (the sentry pauses, saves and goes on: ~0.15 s of CPU for a pandas session)."""
        resume = ("--leave-running",) if leave_running else ()
        self.run("checkpoint", *resume, *(self.checkpoint_flags or ()), f"--image-path={image_dir}", container_id)

    def command(self, *args: str) -> list[str]:
        return [*self.prefix, self.binary, f"--root={self.root}", *self.flags, *args]

    def run(self, *args: str, timeout: float = COMMAND_TIMEOUT_S, reaping: bool = False, counted: bool = True) -> str:
        """Run a short runsc command and return its stdout; ``counted=False``: a failure here is expected."""
        with tempfile.TemporaryFile("w+") as stderr:
            try:
                completed = _reaper.run(self.command(*args), stderr=stderr, timeout=timeout, reaping=reaping)
            except subprocess.TimeoutExpired:
                raise self._failed(args, None, _read(stderr), counted) from None
            if completed.returncode != 0:
                raise self._failed(args, completed.returncode, _read(stderr), counted)
            return completed.stdout

    def _failed(self, args: Sequence[str], returncode: int | None, stderr: str, counted: bool = True) -> RunscError:
        """The error for a failed command, counted for the observer unless expected (``counted=False``)."""
        if counted and self.observer is not None:
            self.observer.runsc_failed(args[0] if args and args[0] in RUNSC_COMMANDS else "other")
        return RunscError.logged(self.command(*args), args, returncode, stderr, expected=not counted)

    def start_detached(self, args: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> Launched:
        """Start ``run --detach`` or ``restore --detach`` with pipes on the container's stdio.

        The container's stdio is runsc's own. stdin and stdout are pipes, which
        is how the executor is handed its settings and announces itself.
        stderr is a pipe too, drained by :class:`StderrTail`: never a host
        file, which the sandbox could write to without bound. (A detached
        runsc leaves a grandchild holding its stdio, so nothing here waits for
        that pipe's end.) The runsc process has exited when this returns.
        """
        launched = Launched.popen(self.command(*args))
        try:
            returncode = _reaper.wait_exit(launched.process, timeout)
        except subprocess.TimeoutExpired:
            launched.process.kill()
            launched.process.wait()
            launched.close()
            raise self._failed(args, None, launched.stderr.text()) from None
        if returncode != 0:
            launched.close()
            raise self._failed(args, returncode, launched.stderr.text(wait_s=STDERR_SETTLE_S))
        return launched

    def state(self, container_id: str) -> dict[str, object]:
        return json.loads(self.run("state", container_id))

    def list_ids(self) -> list[str]:
        if not self.root.exists():
            return []
        lines = self.run("list", "--quiet").split()
        return [line for line in lines if line]

    def destroy(self, container_id: str, pid_file: Path | None = None) -> None:
        """Kill and delete a container, quickly and without raising for one already gone.

        With the ``pid_file`` it was started with, the sandbox process is
        SIGKILLed from here: that works on a sentry too wedged (or stopped) to
        take ``runsc kill``'s request, and saves a runsc start (~20 ms CPU). A
        paused sandbox is thawed after that kill: frozen, not even a SIGKILL
        ends it, nor does its sentry answer runsc.
        """
        started = time.monotonic()
        killed = pid_file is not None and kill_sandbox_process(container_id, pid_file)
        if cgroups.freeze(container_id, False) is False:  # a frozen one would hold up delete till its timeout
            log.error("cannot thaw the container to destroy it", container=container_id)
        if not killed:
            try:
                self.run("kill", container_id, "KILL", reaping=True, counted=False)
            except RunscError:
                pass  # already stopped, or never started
        try:
            self.run("delete", "--force", container_id, reaping=True)
        except RunscError:
            if container_id in self.list_ids():
                raise
        if self.observer is not None:
            self.observer.sandbox_destroyed(time.monotonic() - started)

    def release_paused(self, container_id: str) -> None:
        """Let a container left paused run again (a warm set's or an idle session's, of a worker that
        died): runsc state, kill and delete would wait on it. Thawed, and its sentry sent a SIGCONT
        as well, for one an earlier readie stopped that way; its pid from runsc's own record, read
        as ``hold_mounts`` reads it (asking runsc would wait)."""
        cgroups.freeze(container_id, False)
        try:
            record = json.loads((self.root / f"{container_id}_sandbox:{container_id}.state").read_bytes())
            signal_sentry_pid(container_id, int(record["sandbox"]["pid"]), signal.SIGCONT)
        except (OSError, ValueError, TypeError, KeyError):
            pass

    def sweep(self) -> list[str]:
        """Destroy every container in this state dir and remove what runsc left behind.

        A worker owns its state dir alone, so anything found here at start-up
        belongs to an earlier run of the same worker that did not shut down.
        """
        swept = []
        for container_id in self.list_ids():
            self.release_paused(container_id)
            self.destroy(container_id)
            swept.append(container_id)
        try:  # what runsc left, removed from the root as opened here: never through a link
            root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return swept
        except OSError as exc:
            log.error("cannot open the runsc root to sweep it", root=str(self.root), error=exc.strerror)
            return swept
        try:
            remove_beneath(root)
        finally:
            os.close(root)
        return swept


def version(binary: str = "runsc") -> str:
    """``runsc --version`` first line, e.g. ``runsc version 0.0~20221219.0``."""
    completed = _ask(binary, "--version")
    if completed.returncode != 0:
        raise RunscError.logged([binary, "--version"], ["version"], completed.returncode, completed.stderr)
    return completed.stdout.splitlines()[0].strip()


def available(binary: str = "runsc") -> bool:
    return shutil.which(binary) is not None and os.geteuid() == 0


def wait_for_line(stream: IO[bytes], prefix: bytes, timeout: float, limit: int = 1 << 20) -> bytes:
    """Read lines from a container's stdout pipe until one starts with ``prefix``."""
    deadline = time.monotonic() + timeout
    fd = stream.fileno()
    buffer = bytearray()
    while True:
        newline = buffer.find(b"\n")
        while newline >= 0:
            line = bytes(buffer[: newline + 1])
            del buffer[: newline + 1]
            if line.startswith(prefix):
                return line[len(prefix) :]
            newline = buffer.find(b"\n")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SandboxSetupError(f"no {prefix.decode().strip()!r} line within {timeout:.0f} s")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            raise SandboxSetupError(f"container stdout closed before a {prefix.decode().strip()!r} line")
        buffer += chunk
        if len(buffer) > limit:
            raise SandboxSetupError(f"container printed over {limit} bytes without a newline")


def _read(stream: IO[str]) -> str:
    stream.seek(0)
    return stream.read()


# A failed runsc has written its last words by the time it exits, but the
# drain thread may not have read them yet.
STDERR_SETTLE_S = 0.2


class StderrTail:
    """Drains a pipe on a thread of its own until every writer is gone, keeping the last bytes."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._kept: deque[bytes] = deque()
        self._size = 0
        self._lock = threading.Lock()
        self._ended = threading.Event()
        threading.Thread(target=self._drain, name="sandbox-stderr", daemon=True).start()

    def text(self, wait_s: float = 0.0) -> str:
        """What was kept so far, decoded leniently; ``wait_s`` waits that long for the writers to end."""
        self._ended.wait(wait_s)
        with self._lock:
            data = b"".join(self._kept)
        return data.decode("utf-8", "replace")

    def _drain(self) -> None:
        read = 0
        try:
            while read < STDERR_READ_BYTES and (chunk := os.read(self._fd, 65536)):
                read += len(chunk)
                with self._lock:
                    self._kept.append(chunk)
                    self._size += len(chunk)
                    while self._size - len(self._kept[0]) >= STDERR_KEPT_BYTES:
                        self._size -= len(self._kept.popleft())
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._ended.set()


@dataclass(frozen=True)
class Launched:
    """A process with pipes on its stdin and stdout, and its stderr drained into a tail."""

    process: subprocess.Popen[bytes]
    stderr: StderrTail

    @classmethod
    def popen(cls, argv: Sequence[str], **kwargs: object) -> Launched:
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        try:
            process = _reaper.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=write_end, **kwargs)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        return cls(process, StderrTail(read_end))

    def close(self) -> None:
        """Close our ends of stdin and stdout; the stderr drain ends with its last writer."""
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
