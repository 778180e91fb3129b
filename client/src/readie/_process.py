"""The ``readie pool`` process under a :class:`~readie.Pool`: its command, its pipes, its stderr, its end.

The protocol spoken on the pipes is ``_pool``'s; this owns only the process:
how to start it, the bounded tail of its stderr kept for error messages
(:class:`PoolStderrTail`, which :class:`~readie.AsyncPool` keeps too), its exit
status, and stopping it (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO

from ._errors import PoolError
from ._requests import PathArg

__all__ = [
    "CLOSE_KILL_GRACE_S",
    "EXIT_WAIT_S",
    "STDERR_LINE_BYTES",
    "STDERR_TAIL_LINES",
    "StartedPool",
    "PoolStderrTail",
    "default_command",
    "pool_argv",
    "pool_flags",
]

#: After close(timeout=...) runs out: SIGTERM stops running jobs (the pool is
#: already draining, so this signal aborts), then this long before SIGKILL.
CLOSE_KILL_GRACE_S = 10.0
#: Error messages end with the pool's last stderr lines: this many of them, a
#: longer line read as pieces of STDERR_LINE_BYTES bytes, so a chatty pool
#: cannot grow the client.
STDERR_TAIL_LINES = 40
STDERR_LINE_BYTES = 2000
#: After stdout ends: how long to wait for the pool's exit status and the rest
#: of its stderr before reporting without them.
EXIT_WAIT_S = 10.0

_RUNNER = "import sys; from readie.cli import main; sys.exit(main())"


def default_command() -> list[str]:
    """The ``readie`` command of this Python: the entry point beside it, else ``python -c``."""
    entry_point = Path(sys.executable).with_name("readie")
    if entry_point.exists():
        return [str(entry_point)]
    return [sys.executable, "-c", _RUNNER]


class StartedPool:
    """A started ``readie pool``: ``stdin`` and ``stdout`` for the protocol, stderr kept here."""

    def __init__(self, argv: Sequence[str], cwd: Path) -> None:
        try:
            self._process = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd
            )
        except OSError as exc:
            raise PoolError(f"cannot start {' '.join(argv)}: {exc}") from None
        assert self._process.stdin and self._process.stdout and self._process.stderr
        self.stdin: IO[bytes] = self._process.stdin
        self.stdout: IO[bytes] = self._process.stdout
        self._tail = PoolStderrTail()
        self._stderr_thread = threading.Thread(
            target=self._keep_stderr, args=(self._process.stderr,), name="readie-pool-stderr", daemon=True
        )
        self._stderr_thread.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def stderr_tail(self) -> str:
        return self._tail.text

    def stderr_suffix(self) -> str:
        """The end of an error message: the pool's last stderr lines, or that there were none."""
        return self._tail.suffix()

    def poll(self) -> int | None:
        return self._process.poll()

    def status(self, timeout: float | None) -> int | None:
        """The exit status within ``timeout`` seconds, else None."""
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def settle(self) -> int | None:
        """After stdout ended: the exit status and the rest of stderr, each within :data:`EXIT_WAIT_S`."""
        status = self.status(EXIT_WAIT_S)
        self._stderr_thread.join(EXIT_WAIT_S)
        return status

    def close_stdin(self) -> None:
        try:
            self.stdin.close()
        except OSError:
            pass  # the pool is gone already; its exit status says why

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after :data:`CLOSE_KILL_GRACE_S`; stdout and stderr end with it."""
        if self._process.poll() is None:
            self._process.terminate()
            if self.status(CLOSE_KILL_GRACE_S) is None:
                self._process.kill()
                self._process.wait()
        self.close_stdin()

    def _keep_stderr(self, stderr: IO[bytes]) -> None:
        with stderr:
            # Bounded reads: an endless line arrives as several pieces, never as one huge one.
            for piece in iter(lambda: stderr.readline(STDERR_LINE_BYTES), b""):
                self._tail.feed(piece)
        self._tail.end()


class PoolStderrTail:
    """The pool's last stderr lines, fed its bytes in chunks of any size as they come.

    At most :data:`STDERR_TAIL_LINES` lines are kept, a longer line as pieces
    of :data:`STDERR_LINE_BYTES`, and an unfinished line waits here only up to
    that size: a chatty pool cannot grow the client.
    """

    def __init__(self) -> None:
        self._lines: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._partial = b""  # the line being written, shorter than STDERR_LINE_BYTES

    def feed(self, chunk: bytes) -> None:
        *lines, partial = (self._partial + chunk).split(b"\n")
        for line in lines:
            self._lines.extend(_pieces(line) or [""])
        whole = len(partial) - len(partial) % STDERR_LINE_BYTES
        self._lines.extend(_pieces(partial[:whole]))
        self._partial = partial[whole:]

    def end(self) -> None:
        """Stderr ended: keep its last line even without a newline."""
        self._lines.extend(_pieces(self._partial))
        self._partial = b""

    @property
    def text(self) -> str:
        return "\n".join(self._lines)

    def suffix(self) -> str:
        """The end of an error message: the pool's last stderr lines, or that there were none."""
        tail = self.text
        return f"; its stderr ended with:\n{tail}" if tail else " (nothing on its stderr)"


def _pieces(line: bytes) -> list[str]:
    """``line`` as text in pieces of at most STDERR_LINE_BYTES bytes (none for an empty line)."""
    starts = range(0, len(line), STDERR_LINE_BYTES)
    return [line[start : start + STDERR_LINE_BYTES].decode("utf-8", "replace") for start in starts]


def pool_flags(
    workers: int | None,
    preload: Iterable[str],
    package_dirs: Iterable[PathArg],
    config: PathArg | None,
    router: str | None,
    checkpoints: PathArg | None,
) -> list[str]:
    """``pool`` and its flags, as ``readie pool`` reads them."""
    flags = ["pool"]
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise TypeError(f"workers: expected an int, got {type(workers).__name__}")
        flags.append(f"--workers={workers}")
    if isinstance(preload, str):
        raise TypeError(f"preload: expected a list of module names, got a str; write preload=[{preload!r}]")
    names = list(preload)
    if names:
        flags.append(f"--preload={','.join(names)}")
    if isinstance(package_dirs, str | os.PathLike):
        raise TypeError("package_dirs: expected a list of directories, got a single one")
    flags.extend(f"--package-dir={os.fspath(path)}" for path in package_dirs)
    if config is not None:
        flags.append(f"--config={os.fspath(config)}")
    if router is not None:
        flags.append(f"--router={router}")
    if checkpoints is not None:
        flags.append(f"--checkpoints={os.fspath(checkpoints)}")
    return flags


def pool_argv(
    workers: int | None,
    preload: Iterable[str],
    package_dirs: Iterable[PathArg],
    config: PathArg | None,
    command: Sequence[str] | None,
    router: str | None,
    checkpoints: PathArg | None,
    *,
    token_file: PathArg | None = None,
    tls_ca: PathArg | None = None,
    tls_cert: PathArg | None = None,
    tls_key: PathArg | None = None,
) -> list[str]:
    """The whole ``readie pool`` command line of a :class:`~readie.Pool` (or ``AsyncPool``) made so."""
    security = {"token-file": token_file, "tls-ca": tls_ca, "tls-cert": tls_cert, "tls-key": tls_key}
    if router is None and any(value is not None for value in security.values()):
        raise TypeError("token_file, tls_ca, tls_cert and tls_key are for a router: pass router= too")
    return [
        *(command if command is not None else default_command()),
        *pool_flags(workers, preload, package_dirs, config, router, checkpoints),
        *(f"--router-{name}={os.fspath(value)}" for name, value in security.items() if value is not None),
    ]
