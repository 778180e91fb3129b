"""The job's seccomp filter: no new processes, and no setuid or setgid files.

The audit hook in :mod:`._guards` gives Python code a clear PermissionError,
but ctypes or a C extension can call fork() directly; this filter makes the
kernel (gVisor's, inside the sandbox) answer EPERM instead. It refuses fork,
vfork, execve, execveat and clone unless clone creates a thread, so threads
keep working.

It also refuses to give a file the setuid or setgid bit (chmod, fchmod,
fchmodat and fchmodat2, and a new file's or directory's mode in open, creat,
openat, mkdir, mkdirat, mknod and mknodat): files a job writes in a write
grant are root's on the host, and a setuid-root copy of a shell left there
would be root for whoever runs it. openat2 carries its mode in memory a
filter cannot read, so it is ENOSYS (glibc never uses it for open).

A filter cannot be removed: once installed it holds for the rest of the
process, which is what a sandbox that runs one job (or one session) wants.

Only x86_64 is described. On another architecture the filter allows
everything rather than refuse syscalls by numbers that mean something else
there, and the audit hook is left to do the refusing.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

# <linux/audit.h>: AUDIT_ARCH_X86_64 = EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
AUDIT_ARCH_X86_64 = 0xC000003E
# x86_64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl)
SYS_OPEN = 2
SYS_CLONE = 56
SYS_FORK = 57
SYS_VFORK = 58
SYS_EXECVE = 59
SYS_CREAT = 85
SYS_MKDIR = 83
SYS_CHMOD = 90
SYS_FCHMOD = 91
SYS_MKNOD = 133
SYS_SECCOMP = 317
SYS_OPENAT = 257
SYS_MKDIRAT = 258
SYS_MKNODAT = 259
SYS_FCHMODAT = 268
SYS_EXECVEAT = 322
SYS_CLONE3 = 435
SYS_OPENAT2 = 437
SYS_FCHMODAT2 = 452
# The x32 ABI reuses the x86_64 arch value with this bit set in the number;
# nothing in a Python job uses it, so all of it is refused.
X32_SYSCALL_BIT = 0x40000000
CLONE_THREAD = 0x00010000
SETID_BITS = stat.S_ISUID | stat.S_ISGID

# <linux/prctl.h> and <linux/seccomp.h>
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC = 1
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000

# <linux/filter.h> opcodes
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_JGE_K = 0x35
BPF_JSET_K = 0x45
BPF_RET_K = 0x06

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6];
OFFSET_NR = 0
OFFSET_ARCH = 4
OFFSET_ARGS = 16  # args[i] at 16 + 8 * i; little-endian, so its low 32 bits come first

ALLOW = SECCOMP_RET_ALLOW
DENY = SECCOMP_RET_ERRNO | errno.EPERM
NO_SUCH_CALL = SECCOMP_RET_ERRNO | errno.ENOSYS


@dataclass(frozen=True, slots=True)
class ArgBits:
    """For syscall ``nr``: ``if_set`` when argument ``arg`` has any of ``bits`` (low 32 bits), else ``if_clear``."""

    nr: int
    arg: int
    bits: int
    if_set: int
    if_clear: int


#: Refused whatever their arguments.
REFUSED = (
    (SYS_FORK, DENY),
    (SYS_VFORK, DENY),
    (SYS_EXECVE, DENY),
    (SYS_EXECVEAT, DENY),
    # clone3 passes its flags in memory a filter cannot read; ENOSYS makes
    # glibc fall back to clone, whose flags the filter can check.
    (SYS_CLONE3, NO_SUCH_CALL),
    (SYS_OPENAT2, NO_SUCH_CALL),
)
#: Decided by one argument.
BY_ARGUMENT = (
    ArgBits(SYS_CLONE, 0, CLONE_THREAD, if_set=ALLOW, if_clear=DENY),
    *(
        ArgBits(nr, arg, SETID_BITS, if_set=DENY, if_clear=ALLOW)
        for nr, arg in (
            (SYS_CHMOD, 1),
            (SYS_FCHMOD, 1),
            (SYS_FCHMODAT, 2),
            (SYS_FCHMODAT2, 2),
            (SYS_OPEN, 2),
            (SYS_CREAT, 1),
            (SYS_OPENAT, 3),
            (SYS_MKDIR, 1),
            (SYS_MKDIRAT, 2),
            (SYS_MKNOD, 1),
            (SYS_MKNODAT, 2),
        )
    ),
)

_SOCK_FILTER = struct.Struct("=HBBI")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def job_filter_program(
    refused: Sequence[tuple[int, int]] = REFUSED, by_argument: Sequence[ArgBits] = BY_ARGUMENT
) -> bytes:
    """The BPF program, as the bytes of its ``struct sock_filter`` array.

    Laid out as: the architecture check, the syscall number, one comparison
    per rule, ALLOW; then a two-instruction block per argument rule; then the
    distinct return statements. Jumps are resolved to those labels here, so
    no offset is counted by hand.
    """
    returns = sorted({ALLOW, *(ret for _, ret in refused), *(r.if_set for r in by_argument), *(r.if_clear for r in by_argument)})
    program: list[tuple[int, int, object, object]] = []  # (code, k, jump if true, jump if false); labels or None
    program.append((BPF_LD_W_ABS, OFFSET_ARCH, None, None))
    program.append((BPF_JEQ_K, AUDIT_ARCH_X86_64, None, ("ret", ALLOW)))  # another arch: allow (see above)
    program.append((BPF_LD_W_ABS, OFFSET_NR, None, None))
    program.append((BPF_JGE_K, X32_SYSCALL_BIT, ("ret", DENY), None))
    for nr, ret in refused:
        program.append((BPF_JEQ_K, nr, ("ret", ret), None))
    for index, rule in enumerate(by_argument):
        program.append((BPF_JEQ_K, rule.nr, ("arg", index), None))
    program.append((BPF_RET_K, ALLOW, None, None))
    labels: dict[object, int] = {}
    for index, rule in enumerate(by_argument):
        labels[("arg", index)] = len(program)
        program.append((BPF_LD_W_ABS, OFFSET_ARGS + 8 * rule.arg, None, None))
        program.append((BPF_JSET_K, rule.bits, ("ret", rule.if_set), ("ret", rule.if_clear)))
    for ret in returns:
        labels[("ret", ret)] = len(program)
        program.append((BPF_RET_K, ret, None, None))
    encoded = []
    for position, (code, k, if_true, if_false) in enumerate(program):
        if code == BPF_RET_K or code == BPF_LD_W_ABS:
            encoded.append(_SOCK_FILTER.pack(code, 0, 0, k))
            continue
        jumps = [0 if label is None else labels[label] - position - 1 for label in (if_true, if_false)]
        if not all(0 <= jump <= 255 for jump in jumps):
            raise ValueError("seccomp program too long for BPF's 8-bit jumps")
        encoded.append(_SOCK_FILTER.pack(code, jumps[0], jumps[1], k))
    return b"".join(encoded)


class SeccompUnavailable(Exception):
    pass


_installed = False
_install_lock = threading.Lock()


def job_filter_installed() -> bool:
    return _installed


def install_job_filter() -> None:
    """Install the filter on every thread of this process (once); raise SeccompUnavailable."""
    global _installed
    if _installed:  # once in, for good; and a lock taken is a clock read in CPython 3.11 (decision 33)
        return
    with _install_lock:
        if _installed:
            return
        if platform.machine() not in ("x86_64", "AMD64"):
            raise SeccompUnavailable(f"no filter for architecture {platform.machine()}")
        _install(job_filter_program())
        _installed = True


def _install(program: bytes) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as exc:
        raise SeccompUnavailable(f"cannot load libc: {exc}") from None
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // _SOCK_FILTER.size, ctypes.cast(buffer, ctypes.c_void_p))
    # Without no_new_privs an unprivileged process may not install a filter.
    if libc.prctl(*_longs(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) != 0:
        raise SeccompUnavailable(f"prctl(PR_SET_NO_NEW_PRIVS) failed: {_errno_text()}")
    # TSYNC puts the filter on threads that already exist (a preloaded numpy's
    # OpenBLAS thread, the output drain thread) as well as this one.
    status = libc.syscall(
        *_longs(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC),
        ctypes.byref(fprog),
    )
    if status == 0:
        return
    first_error = _errno_text()
    if _os_thread_count() > 1:
        raise SeccompUnavailable(f"seccomp(SECCOMP_SET_MODE_FILTER, TSYNC) failed: {first_error}")
    # A kernel without the seccomp syscall still has the prctl form, which
    # covers the calling thread only: enough while it is the only one.
    if (
        libc.prctl(*_longs(PR_SET_SECCOMP, SECCOMP_MODE_FILTER), ctypes.byref(fprog), *_longs(0, 0))
        != 0
    ):
        raise SeccompUnavailable(
            f"seccomp() failed ({first_error}) and prctl(PR_SET_SECCOMP) failed: {_errno_text()}"
        )


def _longs(*values: int) -> tuple[ctypes.c_long, ...]:
    # syscall() and prctl() are variadic and read each argument as a long;
    # ctypes would pass a bare int as a C int, leaving the upper half unset.
    return tuple(ctypes.c_long(value) for value in values)


def _os_thread_count() -> int:
    # The OS's count, not threading's: a C library's helper thread is invisible to threading.
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _errno_text() -> str:
    code = ctypes.get_errno()
    return f"{errno.errorcode.get(code, str(code))} ({os.strerror(code)})"
