"""A seccomp filter that refuses new processes: the real enforcement of subprocesses=false.

The audit hook in :mod:`._guards` gives Python code a clear PermissionError,
but ctypes or a C extension can call fork() directly; this filter makes the
kernel (gVisor's, inside the sandbox) answer EPERM instead. It refuses fork,
vfork, execve, execveat and clone unless clone creates a thread, so threads
keep working. A filter cannot be removed: once installed it holds for the rest
of the process, which is what a sandbox that runs one job (or one session)
wants.

Only x86_64 is described. On another architecture the filter allows
everything rather than refuse syscalls by numbers that mean something else
there, and the audit hook is left to do the refusing.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import threading

# <linux/audit.h>: AUDIT_ARCH_X86_64 = EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
AUDIT_ARCH_X86_64 = 0xC000003E
# x86_64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl)
SYS_CLONE = 56
SYS_FORK = 57
SYS_VFORK = 58
SYS_EXECVE = 59
SYS_SECCOMP = 317
SYS_EXECVEAT = 322
SYS_CLONE3 = 435
# The x32 ABI reuses the x86_64 arch value with this bit set in the number;
# nothing in a Python job uses it, so all of it is refused.
X32_SYSCALL_BIT = 0x40000000
CLONE_THREAD = 0x00010000

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
OFFSET_ARG0_LOW = 16  # little-endian: the low 32 bits of args[0], where the clone flags are

_SOCK_FILTER = struct.Struct("=HBBI")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _statement(code: int, k: int) -> bytes:
    return _SOCK_FILTER.pack(code, 0, 0, k)


def _jump(code: int, k: int, if_true: int, if_false: int) -> bytes:
    return _SOCK_FILTER.pack(code, if_true, if_false, k)


def deny_new_processes_program() -> bytes:
    """The BPF program, as the bytes of its ``struct sock_filter`` array."""
    allow = _statement(BPF_RET_K, SECCOMP_RET_ALLOW)
    deny = _statement(BPF_RET_K, SECCOMP_RET_ERRNO | errno.EPERM)
    # clone3 passes its flags in memory a filter cannot read. ENOSYS makes
    # glibc fall back to clone, whose flags the filter can check.
    no_clone3 = _statement(BPF_RET_K, SECCOMP_RET_ERRNO | errno.ENOSYS)
    # Jump offsets count instructions after the jump; the three returns are
    # at the end: ALLOW, DENY, NO_CLONE3.
    program = [
        _statement(BPF_LD_W_ABS, OFFSET_ARCH),  # 0
        _jump(BPF_JEQ_K, AUDIT_ARCH_X86_64, 0, 10),  # 1: unknown arch -> ALLOW (12)
        _statement(BPF_LD_W_ABS, OFFSET_NR),  # 2
        _jump(BPF_JGE_K, X32_SYSCALL_BIT, 9, 0),  # 3: x32 -> DENY (13)
        _jump(BPF_JEQ_K, SYS_FORK, 8, 0),  # 4 -> DENY
        _jump(BPF_JEQ_K, SYS_VFORK, 7, 0),  # 5 -> DENY
        _jump(BPF_JEQ_K, SYS_EXECVE, 6, 0),  # 6 -> DENY
        _jump(BPF_JEQ_K, SYS_EXECVEAT, 5, 0),  # 7 -> DENY
        _jump(BPF_JEQ_K, SYS_CLONE3, 5, 0),  # 8 -> NO_CLONE3 (14)
        _jump(BPF_JEQ_K, SYS_CLONE, 0, 2),  # 9: not clone -> ALLOW
        _statement(BPF_LD_W_ABS, OFFSET_ARG0_LOW),  # 10
        _jump(BPF_JSET_K, CLONE_THREAD, 0, 1),  # 11: a thread -> ALLOW, else DENY
        allow,  # 12
        deny,  # 13
        no_clone3,  # 14
    ]
    return b"".join(program)


class SeccompUnavailable(Exception):
    pass


_installed = False
_install_lock = threading.Lock()


def is_installed() -> bool:
    return _installed


def deny_new_processes() -> None:
    """Install the filter on every thread of this process (once); raise SeccompUnavailable."""
    global _installed
    with _install_lock:
        if _installed:
            return
        if platform.machine() not in ("x86_64", "AMD64"):
            raise SeccompUnavailable(f"no filter for architecture {platform.machine()}")
        _install(deny_new_processes_program())
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
