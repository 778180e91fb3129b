"""Exhausting the host: memory (allocations and files, which live in memory too), threads,
descriptors, output, file sizes, disk, deep trees, CPU. Host memory and disk are measured
while the bombs go off; the bounds they are held to are the ones docs/security.md names."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from adversarial._target import target, unharmed  # noqa: F401 - fixtures

pytestmark = pytest.mark.runsc

MIB = 1024 * 1024
LIBC_WRITE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
block = b'x' * (1 << 20)

def fill(path, mib):
    fd = libc.open(path.encode(), os.O_CREAT | os.O_WRONLY, 0o644)
    if fd < 0:
        return os.strerror(ctypes.get_errno())
    for _ in range(mib):
        if libc.write(fd, block, len(block)) < 0:
            libc.close(fd)
            return os.strerror(ctypes.get_errno())
    libc.close(fd)
    return 'written'
"""
# A sandbox may hold its idle size (156 MB for pandas, measured into the
# manifest), plus the job's memory, plus 64 MiB for gVisor's share of it.
# Beyond that allowance the sandbox is killed; the bombs below try for 2 GiB.
BOMB_MIB = 2048
# Each file stays under the ceiling's max_file_size (16m): it is their sum that must be stopped.
FILE_MIB = 16


class MemoryLow:
    """The lowest MemAvailable seen while it runs: how much host memory a bomb took."""

    def __init__(self) -> None:
        self.start = self.lowest = _mem_available()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> MemoryLow:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            self.lowest = min(self.lowest, _mem_available())

    @property
    def taken(self) -> int:
        return self.start - self.lowest


@pytest.mark.parametrize("where", ["/tmp", "/var/cache", "/dev/shm"], ids=["tmp", "overlay-root", "shm"])
def test_files_count_against_memory(target, where):
    """The finding: 32 files of 64 MiB in /tmp with memory 256m took ~2 GB of host memory."""
    code = LIBC_WRITE + f"for i in range({BOMB_MIB // FILE_MIB}):\n    print(fill('{where}/bomb%d' % i, {FILE_MIB}), flush=True)\n"
    with MemoryLow() as host:
        result = target.attack(code, memory="256m", timeout="20s")
    assert result["error"]["type"] == "MemoryError", result
    assert "files it wrote to /tmp" in result["error"]["hint"] and "MiB" in result["error"]["hint"], result
    # 256 MiB + the sandbox's own ~160 MiB + 64 MiB; the rest is the machine's noise.
    print(f"{BOMB_MIB} MiB of files in {where} with memory 256m took {host.taken // MIB} MiB of host memory")
    assert host.taken < 1024 * MIB, f"the bomb took {host.taken // MIB} MiB of host memory"


def test_allocations_beyond_memory_raise_memory_error_in_the_job(target):
    code = "try:\n    block = bytearray(2 << 30)\nexcept MemoryError:\n    print('caught')\n"
    with MemoryLow() as host:
        result = target.attack(code, memory="256m")
    assert (result["exit"], result["stdout"]) == (0, "caught\n"), result
    assert host.taken < 512 * MIB


def test_a_job_that_sets_no_memory_gets_the_ceiling(target):
    """[pool.limits] memory = 512m applies to a request that sets none, files included."""
    code = LIBC_WRITE + f"for i in range({BOMB_MIB // FILE_MIB}):\n    fill('/tmp/bomb%d' % i, {FILE_MIB})\n"
    with MemoryLow() as host:
        result = target.attack(code)
    assert result["error"]["type"] == "MemoryError" and result["policy"]["memory_bytes"] == 512 * MIB, result
    assert host.taken < 1280 * MIB


def test_a_session_s_background_allocator_is_bounded_too(target):
    """Between steps nothing runs for the client, but a thread the job left does: same limit."""
    start = (
        "import threading, time\nhoard = []\n"
        "def grow():\n    while True:\n        hoard.append(bytearray(16 << 20))\n        time.sleep(0.005)\n"
        "threading.Thread(target=grow, daemon=True).start()\nprint('started')\n"
    )
    first = target.run(session="hoarder", code=start, memory="256m")
    assert first["stdout"] == "started\n", first
    time.sleep(3)  # long enough to pass 256 MiB several times over
    second = target.run(session="hoarder", code="print(len(hoard))")
    # RLIMIT_AS stops the thread with a MemoryError (the step then answers),
    # or the cgroup kills the sandbox (the session ends); never more memory.
    if second["error"] is None:
        assert int(second["stdout"]) * 16 <= 256 + 64, second
        target.run(session="hoarder", close=True)
    else:
        assert second["error"]["type"] in ("MemoryError", "PoolWorkerError") and second["session_ended"], second


def test_a_thread_bomb_stops_at_the_memory_limit(target):
    code = (
        "import threading, time\nthreads = 0\n"
        "try:\n    while True:\n        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n        threads += 1\n"
        "except (RuntimeError, MemoryError) as exc:\n    print(type(exc).__name__, threads < 10_000)\n"
    )
    result = target.attack(code, memory="256m", timeout="20s")
    assert result["error"] is None and result["stdout"].endswith("True\n"), result


def test_a_descriptor_bomb_stops_at_the_sandbox_s_limit(target):
    code = (
        "import os, socket\nheld = []\n"
        "try:\n    while True:\n        held.append(os.open('/dev/null', os.O_RDONLY))\n        held.append(socket.socket())\n"
        "except OSError as exc:\n    print(exc.errno, len(held) <= 4096)\n"
    )
    result = target.attack(code)
    assert result["stdout"] == "24 True\n", result  # EMFILE


@pytest.mark.parametrize("stream", ["print('x' * (1 << 20) * 100)", "import os\nfor _ in range(100):\n    os.write(2, b'e' * (1 << 20))"])
def test_output_is_cut_at_max_output(target, stream):
    result = target.attack(stream, max_output=65536)
    assert result["exit"] == 0 and (result["stdout_truncated"] or result["stderr_truncated"]), result
    assert len(result["stdout"]) <= 65536 and len(result["stderr"]) <= 65536


def test_a_file_in_a_write_grant_stops_at_max_file_size(target):
    code = "open('out/big', 'wb').write(b'x' * (32 << 20))"
    result = target.attack(code, allow_write=["out"])
    assert result["error"]["type"] == "OSError" and "[Errno 27]" in result["error"]["message"], result
    assert (target.out / "big").stat().st_size <= 16 * MIB


def test_no_host_disk_is_written_without_a_write_grant(target):
    """Every place a job could write lands in memory (bounded above) or is read-only or full."""
    code = LIBC_WRITE + (
        "for path in ['/readie/run/d', '/readie/grants/write-0/d', '/readie/grants/write-3/d', '/readie/packages/0/d', '/tmp/d', '/d']:\n"
        "    print(path, fill(path, 512), flush=True)\n"
    )
    before, used_before = _disk_free(target.scratch), _du(target.scratch)
    result = target.attack(code, memory="256m", timeout="20s")
    print(f"disk: {(before - _disk_free(target.scratch)) // 1024} KiB less free, scratch du {used_before} -> {_du(target.scratch)} bytes")
    assert result["error"] is None or result["error"]["type"] == "MemoryError", result
    for line in result["stdout"].splitlines()[:4]:
        assert line.endswith(("Read-only file system", "No space left on device")), result["stdout"]
    assert before - _disk_free(target.scratch) < 64 * MIB
    assert _du(target.scratch) < MIB


@pytest.mark.parametrize("where", ["/tmp", "out"], ids=["tmp", "write-grant"])
def test_a_deep_tree_defeats_no_clean_up(target, where):
    """The finding: 1,500 nested directories made the worker's rmtree raise and leak the sandbox dir."""
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"fd = os.open({where!r}, os.O_RDONLY)\n"
        "for _ in range(3000):\n"
        "    libc.mkdirat(fd, b'd', 0o755)\n"
        "    next_fd = os.open('d', os.O_RDONLY, dir_fd=fd)\n"
        "    os.close(fd)\n    fd = next_fd\n"
        "print('deep')\n"
    )
    result = target.attack(code, allow_write=["out"])
    assert result["stdout"] == "deep\n", result
    # The unharmed fixture checks that the sandbox dir went; the grant's tree is the user's data.


def test_a_cpu_spin_is_killed_at_its_timeout(target):
    result = target.attack("while True:\n    pass", timeout="2s")
    assert (result["exit"], result["error"]["type"]) == (124, "TimeoutError"), result


def test_a_timeout_is_capped_by_the_ceiling(target):
    result = target.run(code="pass", timeout="21s")
    assert result["error"]["type"] == "RequestError" and result["error"]["message"].startswith("timeout:"), result


def _mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def _disk_free(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def _du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total
