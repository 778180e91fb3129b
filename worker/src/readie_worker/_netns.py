"""Network namespaces by name: run a function inside one (on a thread of its own), write a
sysctl there, and run ``ip -batch`` in one. A socket keeps the namespace it was made in, so a
listener made here serves that namespace from any thread."""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import stat
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from . import _reaper
from .errors import SandboxSetupError, host_failure, log_host_facts
from .runsc import NETNS_DIR

_T = TypeVar("_T")

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
# ip(8) answers in milliseconds; this only catches a wedged system.
IP_TIMEOUT_S = 10.0


def path(name: str | None) -> str:
    """The namespace file of ``name`` (None: this process's own)."""
    return f"/proc/{os.getpid()}/ns/net" if name is None else str(NETNS_DIR / name)


def enter(name: str | None) -> None:
    """Move the calling thread (only it: a network namespace is per thread) into ``name``."""
    if name is None:
        return
    descriptor = os.open(path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(descriptor, CLONE_NEWNET) != 0:  # os.setns arrives in Python 3.12
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {name}: {os.strerror(error)}")
    finally:
        os.close(descriptor)


def call_in(name: str | None, function: Callable[[], _T]) -> _T:
    """``function()`` run on a short thread inside network namespace ``name``."""
    if name is None:
        return function()
    result: list[_T] = []
    failure: list[BaseException] = []

    def body() -> None:
        try:
            enter(name)
            result.append(function())
        except BaseException as exc:  # handed to the caller below
            failure.append(exc)

    thread = threading.Thread(target=body, name=f"netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def write_sysctls(name: str | None, values: dict[str, str]) -> None:
    """Write ``/proc/sys/net/...`` entries as namespace ``name`` sees them (no sysctl process)."""

    def write() -> None:
        for key, value in values.items():
            with open(f"/proc/sys/net/{key}", "w") as entry:
                entry.write(value)

    with host_failure(SandboxSetupError, f"cannot set {', '.join(values)} in a sandbox's network namespace"):
        call_in(name, write)


def ip_batch(netns: str | None, commands: Sequence[str], *, check: bool = True) -> str:
    """Run ``commands`` through one ``ip -batch -`` (in ``netns``); its stderr (``check``: raise on failure).

    ``-force`` goes on past a failed line, which removal wants (remove what is there)."""
    argv = ["ip", *(["-n", netns] if netns else []), *([] if check else ["-force"]), "-batch", "-"]
    with host_failure(SandboxSetupError, "cannot run ip", caught=(OSError, subprocess.TimeoutExpired)):
        completed = _reaper.run(argv, input="\n".join(commands) + "\n", timeout=IP_TIMEOUT_S)
    if check and completed.returncode != 0:  # its words name namespaces and addresses: the operator's to read
        where = log_host_facts("ip failed", command=" ".join(argv), exit=completed.returncode, stderr=completed.stderr.strip()[-2000:])
        raise SandboxSetupError(f"the sandbox's network could not be wired: ip exited {completed.returncode}; {where}")
    return completed.stderr


def present(name: str) -> bool:
    """Whether namespace ``name`` is there (ip's file for it in /var/run/netns)."""
    return (NETNS_DIR / name).exists()


def identity(name: str) -> tuple[int, int]:
    """Which namespace ``name`` is now (its nsfs device and inode): one deleted and made again
    under the same name is another."""
    with host_failure(SandboxSetupError, f"cannot find the network namespace {name}"):
        found = os.stat(NETNS_DIR / name)
    return found.st_dev, found.st_ino


def attach_own(name: str) -> bool:
    """Name the calling thread's network namespace ``name`` (``ip netns attach NAME TID``): a
    container's or pod's own namespace, which ``ip netns`` knows under no name. False when the
    name is already this namespace's (a worker restarted in the same container); a name that is
    another namespace is refused, never replaced."""
    own = os.stat(f"/proc/self/task/{threading.get_native_id()}/ns/net")
    if present(name) and _stale_name(name):
        # An attach whose mount went with its worker's mount namespace (a worker killed in a
        # container that keeps its files): the empty file ip made, naming no namespace.
        ip_batch(None, [f"netns delete {name}"], check=False)
    if present(name):
        if identity(name) != (own.st_dev, own.st_ino):
            raise SandboxSetupError(f"the network namespace {name!r} exists and is not this worker's own")
        return False
    ip_batch(None, [f"netns attach {name} {threading.get_native_id()}"])
    return True


def _stale_name(name: str) -> bool:
    """Whether ``name``'s file is an empty regular file with nothing mounted on it."""
    entry = NETNS_DIR / name
    try:
        found = os.lstat(entry)
    except OSError:
        return False
    return stat.S_ISREG(found.st_mode) and found.st_size == 0 and not os.path.ismount(entry)


def names() -> list[str]:
    """The names of the namespaces ``ip netns`` knows."""
    try:
        return sorted(path.name for path in NETNS_DIR.iterdir())
    except OSError:
        return []


def links(netns: str | None, prefix: str) -> list[str]:
    """Interfaces of ``netns`` whose name starts with ``prefix`` (read from ``ip -o link show``)."""
    argv = ["ip", *(["-n", netns] if netns else []), "-o", "link", "show"]
    with host_failure(SandboxSetupError, "cannot run ip", caught=(OSError, subprocess.TimeoutExpired)):
        completed = _reaper.run(argv, timeout=IP_TIMEOUT_S)
    names = []
    for line in completed.stdout.splitlines():  # "7: rdiev1a2b3c4d@if2: <BROADCAST,..."
        parts = line.split(":", 2)
        if len(parts) >= 2 and (name := parts[1].strip().split("@", 1)[0]).startswith(prefix):
            names.append(name)
    return names


def addresses(netns: str | None) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses of every interface of ``netns`` (None: this process's): a worker's own,
    which no sandbox may reach unless its ceiling names one (read from ``ip -o addr show``)."""
    argv = ["ip", *(["-n", netns] if netns else []), "-o", "addr", "show"]
    with host_failure(SandboxSetupError, "cannot run ip", caught=(OSError, subprocess.TimeoutExpired)):
        completed = _reaper.run(argv, timeout=IP_TIMEOUT_S)
    found = []
    for line in completed.stdout.splitlines():  # "2: eth0    inet 10.0.0.5/24 brd ... scope global eth0"
        words = line.split()
        if len(words) >= 4 and words[2] in ("inet", "inet6"):
            with contextlib.suppress(ValueError):
                found.append(ipaddress.ip_interface(words[3]).ip)
    return found
