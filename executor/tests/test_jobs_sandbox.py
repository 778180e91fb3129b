"""Code jobs' limits and grants: readie_executor.jobs.run_job, in a child process.

run_job changes process-wide state that cannot be undone (rlimits, a seccomp
filter, an audit hook), so every job runs in a fresh ``python -c`` child that
prints one result per line (_jobs_child.py). Covered: the memory and file
size limits, subprocesses refused (by the audit hook and by seccomp) or
allowed, setuid and setgid modes refused, and writes outside the grants
refused while reads and writable links work. Output and errors:
test_jobs_output.py; the job's process, scripts, sessions and the
executor: test_jobs_setup.py.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from executor.tests._jobs_child import CHILD_TIMEOUT_SECONDS, run_one


def test_memory_limit_raises_memory_error_with_hint() -> None:
    code = "try:\n    x = bytearray(512 * 2**20)\nfinally:\n    print('still here')\n"
    result = run_one(code, limits={"memory_bytes": 64 * 2**20})
    assert result["exit"] == 1
    assert result["stdout"] == "still here\n"
    assert result["error"]["type"] == "MemoryError"
    assert (result["error"]["file"], result["error"]["line"]) == ("step.py", 2)
    assert str(64 * 2**20) in result["error"]["hint"]


def test_output_still_drains_when_the_job_holds_all_its_memory() -> None:
    code = (
        "import os\n"
        "data = b'x' * 300000\n"
        "blocks = []\n"
        "try:\n"
        "    while True:\n"
        "        blocks.append(bytearray(4096))\n"
        "except MemoryError:\n"
        "    pass\n"
        "for _ in range(4):\n"
        "    os.write(1, data)  # more than a pipe holds: blocks unless the drain keeps reading\n"
    )
    result = run_one(code, limits={"memory_bytes": 64 * 2**20, "max_output": 100})
    assert (result["exit"], result["stdout"], result["stdout_truncated"]) == (0, "x" * 100, True)


def test_memory_within_the_limit_is_usable() -> None:
    result = run_one(
        "x = bytearray(32 * 2**20)\nprint(len(x))", limits={"memory_bytes": 128 * 2**20}
    )
    assert (result["exit"], result["stdout"]) == (0, f"{32 * 2**20}\n")


def test_file_size_limit_raises_efbig(tmp_path: Path) -> None:
    grant = tmp_path / "grant"
    grant.mkdir()
    link = {"path": str(tmp_path / "host" / "out"), "target": str(grant), "writable": True}
    code = f"with open({link['path'] + '/big.bin'!r}, 'wb') as f:\n    f.write(b'x' * 5000)\n"
    result = run_one(code, links=[link], limits={"max_file_size": 1000})
    assert result["exit"] == 1
    assert result["error"]["type"] == "OSError"
    assert result["error"]["message"].startswith(f"[Errno {errno.EFBIG}]")
    assert (grant / "big.bin").stat().st_size == 1000


@pytest.mark.parametrize(
    "code",
    [
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.fork()",
        "import os\nos.system('true')",
        "import os\nos.execv('/bin/true', ['true'])",
        "import os\nos.posix_spawn('/bin/true', ['true'], {})",
    ],
)
def test_subprocesses_are_refused(code: str) -> None:
    result = run_one(code)
    assert result["exit"] == 1
    assert result["error"]["type"] == "PermissionError"
    assert result["error"]["message"] == "subprocesses are not allowed in this sandbox"
    assert "Subprocesses are not allowed" in result["error"]["hint"]
    assert (result["error"]["file"], result["error"]["line"]) == ("step.py", 2)


def test_seccomp_refuses_fork_that_bypasses_the_hook_but_allows_threads() -> None:
    code = (
        "import ctypes, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.fork(), ctypes.get_errno())\n"
        "print(libc.execv(b'/bin/true', None), ctypes.get_errno())\n"
        "seen = []\n"
        "t = threading.Thread(target=seen.append, args=('thread ran',))\n"
        "t.start(); t.join()\n"
        "print(seen[0])\n"
    )
    result = run_one(code)
    assert result["policy_notes"] == [], result["policy_notes"]
    assert result["stdout"] == f"-1 {errno.EPERM}\n-1 {errno.EPERM}\nthread ran\n"


def test_seccomp_refuses_setuid_and_setgid_modes(tmp_path: Path) -> None:
    """Files a job makes in a write grant are root's on the host: none may be setuid or setgid."""
    code = (
        "import ctypes, os, stat\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"base = {str(tmp_path)!r}\n"
        "results = []\n"
        "def errno_of(call):\n"
        "    return 0 if call() >= 0 else ctypes.get_errno()\n"
        "libc.close(libc.open((base + '/f').encode(), os.O_CREAT | os.O_WRONLY, 0o644))\n"
        "results.append(errno_of(lambda: libc.chmod((base + '/f').encode(), 0o4755)))\n"
        "results.append(errno_of(lambda: libc.chmod((base + '/f').encode(), 0o2755)))\n"
        "results.append(errno_of(lambda: libc.chmod((base + '/f').encode(), 0o1755)))\n"
        "results.append(errno_of(lambda: libc.open((base + '/g').encode(), os.O_CREAT | os.O_WRONLY, 0o4755)))\n"
        "results.append(errno_of(lambda: libc.mkdir((base + '/d').encode(), 0o2777)))\n"
        "results.append(errno_of(lambda: libc.mkdir((base + '/e').encode(), 0o777)))\n"
        "results.append(errno_of(lambda: libc.syscall(437, -100, (base + '/h').encode(), 0, 0)))\n"
        "print(results, oct(stat.S_IMODE(os.stat(base + '/f').st_mode)))\n"
    )
    result = run_one(code)
    assert result["policy_notes"] == [], result["policy_notes"]
    eperm, enosys = errno.EPERM, errno.ENOSYS
    assert result["stdout"] == f"[{eperm}, {eperm}, 0, {eperm}, {eperm}, 0, {enosys}] 0o1755\n", result
    assert not os.path.exists(tmp_path / "g") and not os.path.exists(tmp_path / "d")


def test_subprocesses_allowed_when_asked() -> None:
    result = run_one(
        "import subprocess\nprint(subprocess.run(['echo', 'child'], capture_output=True).stdout)",
        limits={"subprocesses": True},
        env={"PATH": "/usr/bin:/bin"},
    )
    assert (result["exit"], result["stdout"]) == (0, "b'child\\n'\n")


@pytest.mark.parametrize(
    "code",
    [
        "open('/etc/readie-test-file', 'w')",
        "import os\nos.open('/etc/readie-test-file', os.O_WRONLY | os.O_CREAT)",
        "import pathlib\npathlib.Path('/etc/readie-test-file').write_text('x')",
        "import os\nos.mkdir('/etc/readie-test-dir')",
        "import os\nos.remove('/etc/readie-test-file')",
    ],
)
def test_writes_outside_the_grants_are_refused(tmp_path: Path, code: str) -> None:
    grant = tmp_path / "grant"
    grant.mkdir()
    link = {"path": str(tmp_path / "work"), "target": str(grant), "writable": True}
    result = run_one(code, links=[link])
    assert result["exit"] == 1
    error = result["error"]
    assert error["type"] == "PermissionError"
    assert error["message"].startswith("[Errno 13] Permission denied: '/etc/readie-test-")
    assert link["path"] in error["hint"]
    assert not Path("/etc/readie-test-file").exists() and not Path("/etc/readie-test-dir").exists()


def test_guard_is_off_between_jobs(tmp_path: Path) -> None:
    child = (
        "import json, sys\n"
        "from readie_executor.jobs import dedicate_stdio, run_job\n"
        "dedicate_stdio()\n"
        "assert json.loads(run_job({'code': 'pass', 'limits': {'max_output': 10}}))['exit'] == 0\n"
        f"open({str(tmp_path / 'after.txt')!r}, 'w').write('the executor may write')\n"
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=CHILD_TIMEOUT_SECONDS)
    assert (tmp_path / "after.txt").read_text() == "the executor may write"


def test_reading_outside_the_grants_is_not_refused() -> None:
    result = run_one("import sys\nprint(len(open(sys.executable, 'rb').read(10)))")
    assert result["stdout"] == "10\n"


def test_write_through_a_writable_link_lands_in_the_target(tmp_path: Path) -> None:
    write_grant, read_grant = tmp_path / "grants" / "write-0", tmp_path / "grants" / "read-0"
    write_grant.mkdir(parents=True)
    read_grant.mkdir()
    (read_grant / "data.txt").write_text("input")
    links = [
        {"path": str(tmp_path / "srv" / "work"), "target": str(write_grant), "writable": True},
        {"path": str(tmp_path / "srv" / "data"), "target": str(read_grant), "writable": False},
    ]
    # Absolute paths for the other grant: the working directory is the link's
    # target once entered, so ".." would be the grants directory, not srv/.
    data = links[1]["path"]
    code = (
        f"data = open({data + '/data.txt'!r}).read()\n"
        "with open('out.txt', 'w') as f:\n    f.write(data + ' processed')\n"
        "import os\nos.mkdir('sub')\nos.rename('out.txt', 'sub/moved.txt')\n"
        f"open({data + '/new.txt'!r}, 'w')\n"
    )
    result = run_one(code, links=links, cwd=links[0]["path"])
    assert (write_grant / "sub" / "moved.txt").read_text() == "input processed"
    assert os.readlink(links[0]["path"]) == str(write_grant)
    assert (
        result["error"]["type"] == "PermissionError"
    )  # the read-only grant refuses the last write
    assert (result["error"]["file"], result["error"]["line"]) == ("step.py", 7)
    assert not (read_grant / "new.txt").exists()
    assert links[1]["path"] in result["error"]["hint"]


def test_erofs_is_reported_as_permission_error() -> None:
    result = run_one(
        "import errno\nraise OSError(errno.EROFS, 'Read-only file system', '/srv/data/x')"
    )
    error = result["error"]
    assert error["type"] == "PermissionError"
    assert error["message"] == "[Errno 13] Permission denied: '/srv/data/x'"
    assert "EROFS" in error["hint"]
