"""Reaching the host from inside: its files, /proc and /sys, inherited descriptors, the executor
dir and unused slots, other sandboxes, processes, the network, privileged syscalls."""

from __future__ import annotations

import os
import socket
import textwrap

import pytest

from adversarial._target import target, unharmed  # noqa: F401 - fixtures

pytestmark = pytest.mark.runsc

# Written with libc, so that the audit hooks (defence in depth, documented as
# bypassable) are out of the way and the boundary itself answers.
LIBC = textwrap.dedent(
    """
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def create(path, size=4096):
        fd = libc.open(path.encode(), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        if fd < 0:
            return os.strerror(ctypes.get_errno())
        written = libc.write(fd, b"x" * size, size)
        error = os.strerror(ctypes.get_errno()) if written < 0 else "written"
        libc.close(fd)
        return error
    """
)


def test_the_host_files_are_not_there(target):
    code = (
        f"import os\nfor path in [{str(target.host / 'canary.txt')!r}, {str(target.project)!r}, '/work', '/root/.cache']:\n"
        "    print(os.path.exists(path))\n"
        "print(open('/etc/hostname').read().strip())\n"
    )
    result = target.attack(code)
    assert result["stdout"] == "False\nFalse\nFalse\nFalse\nreadie\n", result


def test_the_sandbox_root_is_its_own_and_writes_there_stay_there(target):
    code = LIBC + "print(create('/etc/passwd'), create('/usr/bin/planted'))\n"
    result = target.attack(code)
    assert result["exit"] == 0, result
    assert "planted" not in os.listdir("/usr/bin")


@pytest.mark.parametrize("path", ["/proc/self/mountinfo", "/proc/1/environ", "/proc/self/cmdline", "/proc/mounts"])
def test_proc_shows_nothing_of_the_host(target, path):
    result = target.attack(f"import sys\nsys.stdout.write(open({path!r}, 'rb').read().decode('latin-1'))")
    for private in (str(target.base), str(target.scratch), "/work", "/root"):
        assert private not in result["stdout"], (path, result["stdout"][:2000])


def test_sys_is_read_only_and_shows_no_host_cgroup(target):
    code = LIBC + (
        "print(create('/sys/fs/cgroup/memory/memory.limit_in_bytes'), create('/sys/kernel/planted'))\n"
        "import os\nprint(os.path.exists('/sys/fs/cgroup/memory/memory.limit_in_bytes'))\n"
    )
    result = target.attack(code)
    first, exists = result["stdout"].splitlines()
    assert "written" not in first and exists == "False", result


def test_no_inherited_descriptor_leads_to_a_host_file(target):
    """The finding: fd 11 was the host's runsc.log. Every descriptor but the socket is written hard."""
    log_before = (target.base / "pool.log").stat().st_size
    code = textwrap.dedent(
        """
        import os, socket, stat
        written = {}
        for name in os.listdir('/proc/self/fd'):
            fd = int(name)
            if fd <= 2:
                continue  # the job's own output, captured and bounded by max_output
            try:
                mode = os.fstat(fd).st_mode
            except OSError:
                continue
            if stat.S_ISSOCK(mode):
                continue
            total = 0
            os.set_blocking(fd, False)
            for _ in range(64):
                try:
                    total += os.write(fd, b'y' * 65536)
                except OSError:
                    break
            written[fd] = (stat.filemode(mode), total)
        # Not to stdout: some of those descriptors lead to the job's own output capture.
        open('out/summary.txt', 'w').write(repr(sorted(written.items())))
        """
    )
    result = target.attack(code, allow_write=["out"])
    assert result["exit"] == 0, result
    summary = (target.out / "summary.txt").read_text()
    for fd, (mode, _) in eval(summary):  # noqa: S307 - our own output
        assert not mode.startswith("-"), f"fd {fd} is a regular file: {summary}"
    # The pool's log and its scratch dir hold nothing of it.
    assert (target.base / "pool.log").stat().st_size - log_before < 64 * 1024
    assert _du(target.scratch) < 1024 * 1024


@pytest.mark.parametrize(
    "path",
    ["/readie/grants/write-3/planted", "/readie/grants/read-2/planted", "/readie/grants/write-0/planted",
     "/readie/grants/write-1/grant/planted"],  # an unfilled slot's grant point (decision 34)
)
def test_no_host_directory_is_writable_but_the_grants(target, path):
    """The finding: /readie/run and the unused write slots were writable host directories."""
    result = target.attack(LIBC + f"print(create({path!r}))\n")
    assert result["stdout"] == "Read-only file system\n", result


def test_the_executor_dir_is_bounded_in_bytes_and_inodes(target):
    """/readie/run is where the executor binds its socket, so it stays writable: a tmpfs of the
    sandbox's own, a few hundred KiB and inodes, gone with the sandbox."""
    code = LIBC + textwrap.dedent(
        """
        outcomes = set()
        for index in range(200):
            outcomes.add(create(f'/readie/run/f{index}', 64 * 1024))
        made = sum(libc.mkdir(f'/readie/run/d{index}'.encode(), 0o755) == 0 for index in range(200))
        print(sorted(outcomes), made < 64)
        """
    )
    result = target.attack(code)
    assert "No space left on device" in result["stdout"] and result["stdout"].endswith("True\n"), result


@pytest.mark.parametrize(
    "code",
    [
        "import os, shutil\nshutil.copyfile('/usr/bin/id', 'out/id')\nos.chmod('out/id', 0o4755)",
        "import os\nos.mkdir('out/d')\nos.chmod('out/d', 0o2777)",
        "import os\nos.close(os.open('out/f', os.O_CREAT | os.O_WRONLY, 0o6755))",
        "import os\nos.mkdir('out/d', 0o2777)",
        "import os\nos.chmod('out', 0o6777)",
        "import shutil\nshutil.copy2('/usr/bin/su', 'out/su')",  # su is setuid root in the rootfs
    ],
    ids=["chmod-file", "chmod-dir", "open-mode", "mkdir-mode", "chmod-grant", "copy-setuid"],
)
def test_no_setuid_or_setgid_file_is_left_in_a_write_grant(target, code):
    """The review's finding: files a job makes in a grant are root's on the host; a setuid
    copy of a program there would be root for whoever runs it."""
    result = target.attack(code, allow_write=["out"])
    assert result["error"] is not None and result["error"]["type"] == "PermissionError", result
    for path in [target.out, *target.out.rglob("*")]:
        assert not path.stat().st_mode & 0o6000, f"{path} is {oct(path.stat().st_mode)}"


def test_a_write_grant_is_the_only_writable_host_directory(target):
    code = LIBC + (
        "print(create('/readie/grants/write-0/grant/through-the-slot'), create('out/by-name'))\n"
        "print(create('/readie/grants/write-0/beside-the-grant'))\n"  # the slot around it (decision 34)
    )
    result = target.attack(code, allow_write=["out"])
    assert result["stdout"] == "written written\nRead-only file system\n", result
    assert sorted(os.listdir(target.out)) == ["by-name", "through-the-slot"]


def test_a_flood_on_the_sandbox_s_stderr_costs_the_pool_little(target):
    """The job can reach the pipe the worker drains for runsc's messages; past 1 MiB the worker
    stops reading it (its writers get EPIPE) instead of spending CPU on whatever comes."""
    code = textwrap.dedent(
        """
        import os, stat, time
        written, deadline = 0, time.monotonic() + 5
        targets = [int(n) for n in os.listdir('/proc/self/fd') if int(n) > 2]
        block = b'z' * 65536
        while time.monotonic() < deadline:
            for fd in targets:
                try:
                    written += os.write(fd, block)
                except OSError:
                    pass
        print(written > 0)
        """
    )
    pool = target.pool.process.pid
    before = _cpu_seconds(pool)
    target.attack(code, allow_write=["out"], timeout="20s")
    assert _cpu_seconds(pool) - before < 1.5, "the pool spent its CPU on a job's stderr"


def test_a_job_sees_nothing_of_another_running_job(target):
    writer = target.request_id()
    target.pool.send(
        {"id": writer, "functions": ["hold"], "code": LIBC + "create('/tmp/secret')\nfrom readie_host import hold\nhold()\n"}
    )
    call = target.pool.read()
    assert call["event"] == "call", call
    reader = target.run(code="import os\nprint(os.path.exists('/tmp/secret'), sorted(os.listdir('/readie/run')))")
    target.pool.send({"reply": {"call_id": call["call_id"], "result": None}})
    assert target.pool.read()["exit"] == 0
    assert reader["stdout"] == "False ['executor.sock']\n", reader


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.fork()",
        "import os\nos.posix_spawn('/bin/true', ['true'], {})",
        "import subprocess\nsubprocess.run(['/bin/true'])",
        "import os\nos.system('true')",
        "import os\nos.execv('/bin/true', ['true'])",
    ],
    ids=["fork", "posix_spawn", "subprocess", "system", "execv"],
)
def test_no_process_from_python(target, code):
    result = target.attack(code)
    assert result["error"]["type"] == "PermissionError", result


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ("libc.fork()", "EPERM"),
        ("libc.syscall(58)", "EPERM"),  # vfork
        ("libc.syscall(56, 17, 0, 0, 0, 0)", "EPERM"),  # clone(SIGCHLD): a process, not a thread
        ("libc.syscall(435, 0, 0)", "ENOSYS"),  # clone3: refused so glibc falls back to clone
        ("libc.execve(b'/bin/true', None, None)", "EPERM"),
        ("libc.posix_spawn(ctypes.byref(ctypes.c_int()), b'/bin/true', None, None, (ctypes.c_char_p * 2)(b'true', None), None)", "EPERM"),
    ],
    ids=["fork", "vfork", "clone", "clone3", "execve", "posix_spawn"],
)
def test_no_process_through_ctypes(target, call, expected):
    code = LIBC + f"import errno\nr = {call}\nprint(r, errno.errorcode.get(r if r > 0 else ctypes.get_errno()))\n"
    result = target.attack(code)
    value, name = result["stdout"].split()
    assert name == expected, result  # posix_spawn returns the error; the others set errno
    assert int(value) in (-1, getattr(__import__("errno"), expected)), result


def test_no_network_without_allow_network(target):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    code = textwrap.dedent(
        f"""
        import socket
        outcomes = []
        for address in [('127.0.0.1', {port}), ('10.0.2.2', 22), ('8.8.8.8', 53)]:
            probe = socket.socket()
            probe.settimeout(2)
            try:
                probe.connect(address)
                outcomes.append('connected')
            except OSError as exc:
                outcomes.append(type(exc).__name__)
            finally:
                probe.close()
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            udp.sendto(b'x', ('8.8.8.8', 53))
            outcomes.append('sent')
        except OSError as exc:
            outcomes.append(type(exc).__name__)
        print(outcomes, [name for _, name in socket.if_nameindex()])
        """
    )
    try:
        result = target.attack(code)
        listener.settimeout(0.1)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
    assert "connected" not in result["stdout"] and "'sent'" not in result["stdout"], result
    assert "['lo']" in result["stdout"] or "[]" in result["stdout"], result


def test_the_network_cannot_be_asked_for(target):
    result = target.run(code="print(1)", allow_network=True)
    assert result["error"]["type"] == "RequestError" and result["error"]["message"].startswith("allow_network:"), result


@pytest.mark.parametrize(
    "call",
    [
        "libc.mount(b'tmpfs', b'/mnt', b'tmpfs', 0, None)",
        "libc.umount2(b'/readie/grants/read-0', 2)",
        "libc.chroot(b'/tmp')",
        "libc.unshare(0x00020000 | 0x40000000)",
        "libc.ptrace(16, 1, 0, 0)",
        "libc.kill(-1, 9)",
        "libc.reboot(0x4321FEDC)",
        "libc.sethostname(b'owned', 5)",
    ],
    ids=["mount", "umount", "chroot", "unshare", "ptrace", "kill-all", "reboot", "sethostname"],
)
def test_privileged_calls_touch_only_the_sandbox(target, call):
    """Whatever these do inside gVisor, they do it to the sandbox; the host and the pool go on."""
    result = target.attack(LIBC + f"print({call})\n")
    assert result["error"] is None or result["error"]["type"] in ("PoolWorkerError", "PermissionError", "OSError"), result
    assert socket.gethostname() != "owned"


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _du(path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total
