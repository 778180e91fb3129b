"""Every per-job policy item, enforced inside real gVisor sandboxes, with the pool spec's error types."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import RequestError
from readie_worker.grants import hold_grants
from readie_worker.jobs import CodeJob
from readie_worker.testing import wait_until

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS  # noqa: E402


@pytest.fixture(scope="module")
def worker():
    config = WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={"base": 1}, slots=2)
    worker = Worker(config).start()
    yield worker
    worker.close()
    assert worker.runsc.list_ids() == []


def job(code: str, **fields) -> CodeJob:
    return CodeJob(checkpoint=fields.pop("checkpoint", "base"), code=code, name=fields.pop("name", "step.py"), **fields)


def test_print_runs_in_a_restored_sandbox(worker):
    outcome = worker.run_job(job("print('hello from gvisor')"))
    assert (outcome.exit, outcome.stdout, outcome.error) == (0, "hello from gvisor\n", None)
    assert outcome.backend == "gvisor:runsc-restore"
    assert outcome.python.startswith("3.11")


def test_an_exception_points_at_the_named_file_and_line(worker):
    outcome = worker.run_job(job("x = 1\n\nraise ValueError('bad value')\n", name="step.py"))
    assert outcome.exit == 1
    assert (outcome.error.type, outcome.error.message) == ("ValueError", "bad value")
    assert (outcome.error.file, outcome.error.line) == ("step.py", 3)


def test_timeout_kills_the_sandbox_and_the_worker_keeps_serving(worker):
    started = time.monotonic()
    outcome = worker.run_job(job("while True:\n    pass\n", timeout_ms=1500))
    assert outcome.error.type == "TimeoutError" and outcome.exit is None
    assert time.monotonic() - started < 10
    assert outcome.sandbox_id not in worker.runsc.list_ids()
    assert worker.run_job(job("print('next')")).stdout == "next\n"


def test_memory_over_the_limit_is_a_memory_error_with_a_hint(worker):
    outcome = worker.run_job(job("block = bytearray(400 * 1024 * 1024)\nprint(len(block))", memory_bytes=128 * 1024 * 1024))
    assert outcome.error.type == "MemoryError", outcome
    assert outcome.error.hint and "memory" in outcome.error.hint.lower()
    within = worker.run_job(job("block = bytearray(32 * 1024 * 1024)\nprint(len(block))", memory_bytes=128 * 1024 * 1024))
    assert (within.exit, within.stdout) == (0, f"{32 * 1024 * 1024}\n")


@pytest.fixture
def grants(tmp_path):
    data = tmp_path / "data"
    out = tmp_path / "out"
    secret = tmp_path / "secret"
    for directory in (data, out, secret):
        directory.mkdir()
    (data / "orders.csv").write_text("product,amount\ntea,3\ncake,5\ntea,4\n")
    (secret / "key.txt").write_text("do not read")
    return data, out, secret


def test_read_and_write_grants_are_enforced_by_the_sandbox(worker, grants):
    data, out, secret = grants
    code = f"""
import os
print(open({str(data / 'orders.csv')!r}).read().count('tea'))
with open({str(out / 'result.txt')!r}, 'w') as f:
    f.write('written in gvisor')
print(os.path.exists({str(secret / 'key.txt')!r}))
"""
    assert worker.warm["base"].wait_until_full(60)
    hits = worker.warm["base"].hits
    outcome = worker.run_job(job(code, allow_read=(str(data),), allow_write=(str(out),)))
    assert (outcome.exit, outcome.stdout, outcome.error) == (0, "2\nFalse\n", None), outcome
    assert (out / "result.txt").read_text() == "written in gvisor"
    assert worker.warm["base"].hits == hits + 1  # a warm sandbox took the grants (decision 0034)
    # Once the used sandbox is retired, nothing of the grants stays mounted in the worker.
    assert wait_until(lambda: not _mounted_from(data, out, where=Path("/proc/self/mountinfo")), timeout=30)


def test_a_warm_sandbox_s_gofer_holds_a_read_grant_read_only_at_the_host(worker, grants):
    """The grant reaches runsc's gofer (its own mount namespace) after restore, and with the
    read-only flag it had before anything could see it: the host refuses writes, not gVisor alone."""
    data, out, _ = grants
    sandbox = worker.warm["base"].take()
    try:
        with hold_grants(worker._mount_plan(), allow_read=(str(data),), allow_write=(str(out),)) as held:
            sandbox.attach(held)
        [gofer] = [pid for pid in _pids() if _cmdline(pid).startswith("runsc-gofer ") and f" --bundle={sandbox.dir.path} " in _cmdline(pid)]
        mounts = {line.split()[4]: line.split()[5].split(",")[0] for line in _mounted_from(data, out, where=Path(f"/proc/{gofer}/mountinfo"))}
        assert mounts == {"/readie/grants/read-0/grant": "ro", "/readie/grants/write-0/grant": "rw"}
        # The worker holds that namespace, so a gofer that dies takes no grant from under a job.
        assert os.readlink(f"/proc/self/fd/{sandbox.mounts_held}") == os.readlink(f"/proc/{gofer}/ns/mnt")
        # No other gofer holds it: neither one started before the attach nor the spare the take
        # set restoring after it (their mount namespaces are copies of the worker's, and runsc's
        # pivot into the rootfs is what leaves the worker's slots behind: decision 0034).
        assert worker.warm["base"].wait_until_full(60)
        ours = f" --bundle={sandbox.dir.path.parent}/"
        others = [pid for pid in _pids() if _cmdline(pid).startswith("runsc-gofer ") and ours in _cmdline(pid) and pid != gofer]
        assert others, "the refilled spare's gofer"
        assert {pid: _mounted_from(data, out, where=Path(f"/proc/{pid}/mountinfo")) for pid in others} == dict.fromkeys(others, [])
    finally:
        sandbox.destroy()
    assert not sandbox.dir.path.exists()
    assert not _mounted_from(data, out, where=Path("/proc/self/mountinfo"))


def _mounted_from(*sources: Path, where: Path) -> list[str]:
    """The mountinfo lines in ``where`` of a mount whose root is one of ``sources`` (on the host's root fs)."""
    roots = {str(source) for source in sources}
    return [line for line in where.read_text().splitlines() if line.split()[3] in roots]


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_writing_to_a_read_grant_is_a_permission_error_with_a_hint(worker, grants):
    data, out, _ = grants
    outcome = worker.run_job(job(f"open({str(data / 'new.txt')!r}, 'w').write('x')", allow_read=(str(data),), allow_write=(str(out),)))
    assert outcome.error.type == "PermissionError", outcome
    assert str(out) in outcome.error.hint
    assert not (data / "new.txt").exists()


def test_writing_anywhere_else_is_a_permission_error(worker):
    outcome = worker.run_job(job("open('/etc/readie-was-here', 'w').write('x')"))
    assert outcome.error.type == "PermissionError", outcome


def test_more_grants_than_planned_slots_is_a_request_error_naming_the_limit(worker, tmp_path):
    many = tuple(str(tmp_path) for _ in range(worker.checkpoints.manifest.mount_plan.read_slots + 1))
    with pytest.raises(RequestError, match="slots") as refused:
        worker.run_job(job("pass", allow_read=many))
    assert refused.value.field == "allow_read"


def test_max_file_size_makes_a_larger_write_fail(worker, grants):
    _, out, _ = grants
    code = f"with open({str(out / 'big.bin')!r}, 'wb') as f:\n    f.write(b'x' * 200_000)\n"
    outcome = worker.run_job(job(code, allow_write=(str(out),), max_file_size=100_000))
    assert outcome.error.type == "OSError", outcome
    assert "27" in outcome.error.message or "too large" in outcome.error.message.lower()


def test_report_files_never_lists_what_a_swapped_ancestor_of_the_grant_leads_to(worker, tmp_path):
    """Issue 27, hole 1: job B writes ``out/b/etc`` and asks for ``report_files``; while it runs, ``out/b``
    is renamed away and made a link to ``/`` (job A, with a grant on ``out``, can do that). B's listing
    must report the grant changed and list nothing of the host's ``/etc``; B wrote to its own directory."""
    grant = tmp_path / "out" / "b" / "etc"
    grant.mkdir(parents=True)
    held = tmp_path / "out" / "b-away" / "etc"  # where B's directory is once out/b is renamed
    code = f"""
import os, time
open({str(grant / 'started')!r}, 'w').close()
deadline = time.monotonic() + 20
while not os.path.exists({str(grant / 'go')!r}) and time.monotonic() < deadline:
    time.sleep(0.01)
open({str(grant / 'mine.txt')!r}, 'w').write('B')
"""
    outcomes = []
    b = threading.Thread(target=lambda: outcomes.append(
        worker.run_job(job(code, allow_write=(str(grant),), report_files=True, timeout_ms=30_000))))
    b.start()
    try:
        assert wait_until((grant / "started").exists, 60), "job B never started"
        (tmp_path / "out" / "b").rename(tmp_path / "out" / "b-away")
        (tmp_path / "out" / "b").symlink_to("/")
        assert (tmp_path / "out" / "b" / "etc" / "passwd").exists()  # the path now leads to the host's /etc
        (held / "go").touch()  # through B's mount, which still is its own directory
    finally:
        b.join(60)
    [outcome] = outcomes
    assert outcome.exit == 0, outcome
    assert (held / "mine.txt").read_text() == "B"
    assert outcome.files == () and outcome.files_truncated is True, outcome.files


@pytest.mark.parametrize(
    "code",
    [
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.fork()",
        "import os\nos.system('true')",
    ],
    ids=["subprocess.run", "os.fork", "os.system"],
)
def test_subprocesses_are_denied(worker, code):
    outcome = worker.run_job(job(code))
    assert outcome.error.type == "PermissionError", outcome


def test_the_job_sees_only_the_environment_it_was_given(worker, monkeypatch):
    monkeypatch.setenv("READIE_WORKER_SECRET", "leak")
    outcome = worker.run_job(job("import os, json\nprint(json.dumps(dict(os.environ)))", env={"KEY": "value"}))
    import json

    environ = json.loads(outcome.stdout)
    assert environ["KEY"] == "value"
    assert "READIE_WORKER_SECRET" not in environ
    assert not any(key.startswith("EXECUTOR_") for key in environ)


def test_output_beyond_max_output_is_truncated(worker):
    outcome = worker.run_job(job("import sys\nsys.stdout.write('x' * (100 * 1024 * 1024))", max_output=65536, timeout_ms=60_000))
    assert outcome.exit == 0, outcome
    assert outcome.stdout_truncated and len(outcome.stdout) <= 65536


@pytest.fixture
def cold_worker():
    """No warm pool: the only running sandbox is the job's own."""
    worker = Worker(WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={})).start()
    yield worker
    worker.close()
    assert worker.runsc.list_ids() == []


def test_a_sandbox_killed_mid_job_is_a_pool_worker_error(cold_worker, tmp_path):
    worker = cold_worker
    started = tmp_path / "started"
    code = f"import time\nopen({str(started)!r}, 'w').close()\ntime.sleep(30)"
    results = {}

    def run():
        results["outcome"] = worker.run_job(job(code, allow_write=(str(tmp_path),), timeout_ms=60_000))

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 20
    while not started.exists() and time.monotonic() < deadline:  # the job itself is running
        time.sleep(0.02)
    victim = _busy_sandbox_pid(worker)
    assert victim, "no busy sandbox found"
    os.kill(victim, 9)
    thread.join(30)
    assert results["outcome"].error.type == "PoolWorkerError", results["outcome"]
    assert worker.run_job(job("print(1)")).stdout == "1\n"


def test_garbage_on_the_executor_socket_is_a_pool_worker_error(worker):
    code = """
import os, socket
for fd in os.listdir('/proc/self/fd'):
    try:
        target = os.readlink(f'/proc/self/fd/{fd}')
    except OSError:
        continue
    if target.startswith('socket:'):
        try:
            os.write(int(fd), b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x10garbage')
        except OSError:
            pass
os._exit(0)
"""
    outcome = worker.run_job(job(code))
    assert outcome.error.type == "PoolWorkerError", outcome
    assert "truncated" in outcome.error.message or "no response" in outcome.error.message
    assert worker.run_job(job("print(2)")).stdout == "2\n"


def _busy_sandbox_pid(worker: Worker) -> int | None:
    """The host pid of the one running sandbox of a worker without warm pools."""
    for container_id in worker.runsc.list_ids():
        state = worker.runsc.state(container_id)
        if state.get("status") == "running" and state.get("pid"):
            return int(state["pid"])
    return None


def test_a_sandbox_killed_by_the_memory_backstop_reports_memory_error(short_tmp):
    config = WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={}, sandbox_memory_bytes=400 * 1024 * 1024)
    small = Worker(config).start()
    try:
        # No per-job limit: only the cgroup stands between this and the host.
        outcome = small.run_job(job("block = bytearray(700 * 1024 * 1024)\nprint(len(block))"))
        assert outcome.error.type == "MemoryError", outcome
        assert "backstop" in outcome.error.hint
        assert small.run_job(job("print('alive')")).stdout == "alive\n"
    finally:
        small.close()
    assert small.runsc.list_ids() == []


def test_package_dirs_are_importable_and_read_only(worker):
    # Not under /tmp: that is the job's workspace, where its code may write (decision 31).
    packages = Path(tempfile.mkdtemp(prefix="site-", dir="/var/tmp"))
    try:
        (packages / "readie_demo_mod.py").write_text("ANSWER = 42\n")
        code = f"""
import readie_demo_mod
print(readie_demo_mod.ANSWER)
open({str(packages / 'x.py')!r}, 'w')
"""
        outcome = worker.run_job(job(code, package_dirs=(str(packages),)))
        assert outcome.stdout == "42\n", outcome
        assert outcome.error.type == "PermissionError"
        assert not (packages / "x.py").exists()
    finally:
        shutil.rmtree(packages, ignore_errors=True)


def test_packages_are_installed_on_the_host_and_mounted(worker, tmp_path, monkeypatch):
    monkeypatch.setenv("READIE_CACHE", str(tmp_path / "cache"))
    code = "import six\nprint(six.__version__)"
    first = worker.run_job(job(code, packages=("six==1.16.0",)))
    assert (first.exit, first.stdout) == (0, "1.16.0\n"), first
    assert len(list((tmp_path / "cache" / "packages").glob("*/site"))) == 1
    again = worker.run_job(job(code, packages=("six==1.16.0",)))
    assert again.stdout == "1.16.0\n"


@pytest.mark.parametrize("requirement", ["-e .", "git+https://example.invalid/x", "x @ file:///etc"])
def test_a_bad_requirement_is_a_request_error(worker, requirement):
    with pytest.raises(RequestError) as refused:
        worker.run_job(job("pass", packages=(requirement,)))
    assert refused.value.field == "packages"


def test_each_job_logs_one_line_without_its_output(worker):
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        worker.run_job(job("print('secret output')"), job_id="job-7")
    [line] = [entry for entry in logs if entry["event"] == "job"]
    assert line["job_id"] == "job-7" and line["exit"] == 0 and line["error"] is None
    assert line["duration_us"] > 0 and "queue_us" in line
    assert "secret output" not in repr(line)


def test_network_is_refused_without_egress(worker):
    with pytest.raises(RequestError) as refused:
        worker.run_job(job("pass", network=True))
    assert refused.value.field == "allow_network"
