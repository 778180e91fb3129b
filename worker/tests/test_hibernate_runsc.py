"""Sessions that hibernate, resume and fork, in real gVisor sandboxes (issue 18, decision 0022).

Hibernating checkpoints a session's sandbox to an image in the worker's own
dir and ends it; the next step restores it. A fork is a hibernation whose
image a second session shares. Each test checks the sandbox is really gone
(``runsc list``) and the image really removed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import ErrorType, PoolWorkerError, RequestError, SandboxSetupError
from readie_worker.jobs import CodeJob, Step
from readie_worker.state_dir import IMAGES
from readie_worker.testing import FakeHost

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS  # noqa: E402

PANDAS_STATE = "import pandas as pd\ndf = pd.DataFrame({'n': range(200_000)})\nanswer = 42\nprint('set')"


@pytest.fixture(scope="module")
def worker(checkpoints):
    config = WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={"base": 1, "pandas": 1}, slots=2, max_sessions=8)
    worker = Worker(config).start()
    yield worker
    worker.close()
    assert worker.runsc.list_ids() == []
    assert not worker.images.store.root.exists(), "the worker's close removes every image"


@pytest.fixture
def grant_dir():
    # Not under /tmp: the worker keeps its own dirs there, and no grant may overlap them.
    path = Path(tempfile.mkdtemp(prefix="hib-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def job(code: str, checkpoint: str = "base", **fields) -> CodeJob:
    return CodeJob(checkpoint=checkpoint, code=code, name=fields.pop("name", "cell.py"), **fields)


def entries(worker: Worker) -> list[str]:
    """The session store's entries: one per session that can hibernate, stored or live."""
    return sorted(entry.name for entry in worker.images.store.root.iterdir() if not entry.name.startswith("."))


def images(worker: Worker) -> list[str]:
    """The entries that hold a stored image (a generation)."""
    root = worker.images.store.root
    return [name for name in entries(worker) if any(part.name.startswith("g") for part in (root / name).iterdir())]


def pss_bytes(needle: str, field: str = "Pss:") -> int:
    """Proportional set size of every host process whose command line holds ``needle``."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in rollup.splitlines():
            if line.startswith(field):
                total += int(line.split()[1]) * 1024
    return total


def test_a_pandas_session_hibernates_frees_its_memory_and_resumes_with_its_state(worker):
    session, first = worker.open_session(job(PANDAS_STATE, "pandas"))
    try:
        assert first.outcome.stdout == "set\n", first.outcome
        sandbox = session.sandbox_id
        assert sandbox in worker.runsc.list_ids()
        for pool in worker.warm.values():  # their refills would blur what the hibernation frees
            assert pool.wait_until_full(60)
        session_pss = pss_bytes(sandbox)
        worker_before = pss_bytes(f"--root={worker.runsc.root}")
        private = pss_bytes(sandbox, "Private_Dirty:") + pss_bytes(sandbox, "Private_Clean:")
        hibernate_ms = session.hibernate()
        assert hibernate_ms > 0 and session.hibernated
        assert sandbox not in worker.runsc.list_ids()
        assert session.sandbox_id is None
        worker_after = pss_bytes(f"--root={worker.runsc.root}")
        assert session_pss > 30 * 1024**2, session_pss  # a pandas sandbox: sentry, gofer, interpreter
        # What it held alone goes; of the pages it shared with the other sandboxes (the rootfs's
        # libraries), its share moves to them: measured, the drop is 84-86 % of its PSS.
        freed = worker_before - worker_after
        assert freed >= private and freed >= session_pss * 0.75, (freed, private, session_pss)
        capacity = worker.capacity()
        assert (capacity.sessions, capacity.hibernated) == (1, 1) and capacity.hibernated_bytes > 10 * 1024**2
        assert len(images(worker)) == 1
        # The image holds the session's memory in clear: the worker's alone.
        files = list(worker.images.store.root.glob("*/g*/*"))
        assert files and all(path.stat().st_mode & 0o777 == 0o600 for path in files)
        assert worker.images.store.root.stat().st_mode & 0o777 == 0o700
        assert session.hibernate() == 0.0  # already: nothing to do

        resumed = session.run_step(Step("answer += 1\nprint(answer, len(df), df.n.sum(), pd.__name__)"))
        assert (resumed.outcome.exit, resumed.outcome.stdout) == (0, "43 200000 19999900000 pandas\n"), resumed.outcome
        assert resumed.resumed_ms is not None and resumed.resumed_ms > 0
        assert (resumed.step, resumed.session_ended) == (2, False)
        assert session.sandbox_id in worker.runsc.list_ids() and session.sandbox_id != sandbox
        assert images(worker) == [] and worker.capacity().hibernated == 0
        again = session.run_step(Step("print(answer)"))
        assert again.outcome.stdout == "43\n" and again.resumed_ms is None
    finally:
        session.close()
    assert worker.capacity().sessions == 0


def test_a_session_hibernates_and_resumes_more_than_once(worker):
    session, _ = worker.open_session(job("n = 0"))
    try:
        for round in range(1, 4):
            session.hibernate()
            step = session.run_step(Step("n += 1\nprint(n)"))
            assert (step.outcome.stdout, step.step) == (f"{round}\n", round + 1)
            assert step.resumed_ms is not None
    finally:
        session.close()


def test_files_in_a_write_grant_and_the_grant_itself_survive_a_resume(worker, grant_dir):
    session, first = worker.open_session(
        job(f"open('{grant_dir}/a.txt', 'w').write('before')", allow_write=(str(grant_dir),))
    )
    try:
        assert first.outcome.exit == 0, first.outcome
        session.hibernate()
        (grant_dir / "b.txt").write_text("written while it slept")
        step = session.run_step(Step(
            f"print(open('{grant_dir}/a.txt').read(), open('{grant_dir}/b.txt').read())\n"
            f"open('{grant_dir}/c.txt', 'w').write('after')"
        ))
        assert step.outcome.stdout == "before written while it slept\n", step.outcome
        assert (grant_dir / "c.txt").read_text() == "after"
    finally:
        session.close()


def test_a_grant_gone_while_hibernated_ends_the_session_at_resume(worker, grant_dir):
    granted = grant_dir / "work"
    granted.mkdir()
    session, _ = worker.open_session(job("x = 1", allow_write=(str(granted),)))
    session.hibernate()
    granted.rmdir()
    granted.symlink_to("/etc")  # the same path, now a link: refused as a new job's grant would be
    step = session.run_step(Step("print(x)"))
    assert step.session_ended and step.outcome.error.type == ErrorType.SANDBOX_SETUP
    assert "could not resume" in step.outcome.error.message
    assert session.ended and entries(worker) == [] and worker.capacity().sessions == 0


def test_host_functions_work_after_a_resume(worker):
    host = FakeHost(search=lambda query, limit=1: [f"hit for {query}"] * limit)
    session, first = worker.open_session(job("from readie_host import search", functions=("search",)), host=host)
    try:
        assert first.outcome.exit == 0, first.outcome
        session.hibernate()
        step = session.run_step(Step("print(search('resume', limit=2))"), host=host)
        assert step.outcome.stdout == "['hit for resume', 'hit for resume']\n", step.outcome
    finally:
        session.close()


def test_the_session_rules_hold_after_a_resume(worker):
    session, _ = worker.open_session(job("x = 1", timeout_ms=1000))
    session.hibernate()
    raised = session.run_step(Step("x = 2\nraise ValueError('kept')"))
    assert (raised.session_ended, raised.outcome.error.type) == (False, "ValueError")
    session.hibernate()
    assert session.run_step(Step("print(x)")).outcome.stdout == "2\n"
    session.hibernate()
    spun = session.run_step(Step("while True:\n    pass"))
    assert spun.session_ended and spun.outcome.error.type == "TimeoutError"
    assert session.ended and entries(worker) == []


def test_closing_a_hibernated_session_removes_its_image(worker):
    session, _ = worker.open_session(job("x = 1"))
    session.hibernate()
    assert len(images(worker)) == 1
    session.close()
    assert entries(worker) == [] and worker.capacity().sessions == 0
    with pytest.raises(RequestError, match="has ended"):
        session.run_step(Step("print(x)"))
    with pytest.raises(RequestError, match="has ended"):
        session.hibernate()


def test_a_fork_has_the_state_at_fork_time_and_both_go_on_independently(worker):
    a, _ = worker.open_session(job("import json\nstate = {'who': 'a', 'n': 1}"))
    try:
        b, fork_ms = worker.fork_session(a)
        try:
            assert fork_ms > 0 and a.hibernated and b.hibernated and b.id != a.id
            assert worker.capacity().sessions == 2 and len(images(worker)) == 2
            in_a = a.run_step(Step("state['n'] += 10\nprint(json.dumps(state))"))
            in_b = b.run_step(Step("state['who'] = 'b'\nprint(json.dumps(state))"))
            assert in_a.outcome.stdout == '{"who": "a", "n": 11}\n', in_a.outcome
            assert in_b.outcome.stdout == '{"who": "b", "n": 1}\n', in_b.outcome
            assert in_b.resumed_ms is not None and in_b.step == 1  # the fork's own first step
            assert a.run_step(Step("print(state['who'])")).outcome.stdout == "a\n"
            assert b.run_step(Step("print(state['n'])")).outcome.stdout == "1\n"
            assert a.sandbox_id != b.sandbox_id and images(worker) == []
        finally:
            b.close()
    finally:
        a.close()
    assert worker.capacity().sessions == 0


def test_four_forks_of_one_session_run_at_once(worker):
    parent, _ = worker.open_session(job("base = 100"))
    forks = []
    try:
        for _ in range(4):
            forks.append(worker.fork_session(parent)[0])
        results: dict[int, str] = {}

        def run(index: int) -> None:
            step = forks[index].run_step(Step(f"import time\ntime.sleep(0.3)\nbase += {index}\nprint(base)"))
            results[index] = step.outcome.stdout

        threads = [threading.Thread(target=run, args=(index,)) for index in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert results == {index: f"{100 + index}\n" for index in range(4)}
        assert len({fork.sandbox_id for fork in forks}) == 4
        assert parent.run_step(Step("print(base)")).outcome.stdout == "100\n"
    finally:
        for fork in forks:
            fork.close()
        parent.close()
    assert entries(worker) == [] and worker.capacity().sessions == 0


def test_a_job_that_closes_the_hand_over_pipe_spoils_only_its_own_resume(worker):
    session, _ = worker.open_session(job("import os\nx = 1"))
    # The hand-over pipe: the one host descriptor the executor keeps open for reading.
    closed = session.run_step(Step(
        "import fcntl, os\n"
        "for fd in [int(fd) for fd in os.listdir('/proc/self/fd')]:\n"
        "    try:\n"
        "        host = os.readlink(f'/proc/self/fd/{fd}').startswith('host:')\n"
        "    except OSError:\n"
        "        continue\n"
        "    if fd > 2 and host and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:\n"
        "        os.close(fd)\n"
        "        print('closed', fd)\n"
    ))
    assert (closed.outcome.exit, closed.outcome.stdout.count("closed")) == (0, 1), closed.outcome
    try:
        # Without its pipe the executor cannot wait for a hand-over: it exits, the checkpoint fails.
        session.hibernate()
    except PoolWorkerError as exc:
        assert "could not hibernate" in str(exc) or "closed while" in str(exc), exc
    else:
        # Under load the checkpoint can win the race against the executor's exit: the image then
        # holds an executor without its pipe, and its resume is what fails.
        resumed = session.run_step(Step("print(x)"))
        assert resumed.session_ended and resumed.outcome.error is not None, resumed.outcome
    assert session.ended and entries(worker) == [] and worker.capacity().sessions == 0
    other, first = worker.open_session(job("print('still serving')"))
    other.close()
    assert first.outcome.stdout == "still serving\n"


# runsc, except that a checkpoint's image path is one nobody can write: its checkpoint fails,
# with runsc's own words, as on a full or broken disk.
UNWRITABLE_IMAGES = """#!/usr/bin/python3
import os, sys
args = sys.argv[1:]
if "checkpoint" in args:
    args = [a.replace("--image-path=", "--image-path=/proc/readie-unwritable", 1) for a in args]
os.execvp("runsc", ["runsc", *args])
"""


def test_a_failed_hibernation_shows_the_client_no_host_fact_and_logs_them_under_its_session(checkpoints, short_tmp):
    binary = short_tmp / "runsc"
    binary.write_text(UNWRITABLE_IMAGES)
    binary.chmod(0o755)
    worker = Worker(WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={"base": 0}, runsc=str(binary))).start()
    try:
        session, first = worker.open_session(job("x = 1"))
        assert first.outcome.exit == 0, first.outcome
        with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            with pytest.raises(PoolWorkerError) as failed:
                session.hibernate()
        message = str(failed.value)
        assert message.startswith(f"session {session.id} could not hibernate and has ended: sandbox checkpoint exited ")
        assert message.endswith(f"; the worker's log has the details under session {session.id}")
        assert "/" not in message and "--" not in message and "pid" not in message
        [line] = [line for line in logs if line["event"] == "runsc failed"]
        assert line["session"] == session.id and line["log_level"] == "warning"
        assert f"--image-path={worker.state.images_dir}/" in line["command"]
        assert "/proc/readie-unwritable" in line["stderr"]  # runsc's own words, for the operator
        assert session.ended and entries(worker) == [] and worker.runsc.list_ids() == []
    finally:
        worker.close()


def test_the_image_bounds_refuse_a_hibernation_and_keep_the_session(checkpoints):
    config = WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={"base": 0}, session_store_entries=1)
    worker = Worker(config).start()
    try:
        one, _ = worker.open_session(job("x = 1"))
        two, _ = worker.open_session(job("x = 2"))
        one.hibernate()
        with pytest.raises(SandboxSetupError, match="the session store is full"):
            two.hibernate()
        assert not two.hibernated and two.run_step(Step("print(x)")).outcome.stdout == "2\n"
        with pytest.raises(SandboxSetupError, match="the session store is full"):
            worker.fork_session(one)
        assert worker.capacity().sessions == 2  # the refused fork took no place
        assert one.run_step(Step("print(x)")).outcome.stdout == "1\n"
    finally:
        worker.close()
    assert worker.runsc.list_ids() == [] and not worker.images.store.root.exists()


def test_a_restart_forgets_the_images_of_an_earlier_run(checkpoints, short_tmp):
    config = WorkerConfig(manifest=CHECKPOINTS / "manifest.json", state_dir=short_tmp / "state", warm={"base": 0})
    stale = short_tmp / "state" / IMAGES / "0123456789abcdef"
    stale.mkdir(parents=True)
    (stale / "checkpoint.img").write_bytes(b"an earlier run's session")
    worker = Worker(config).start()
    try:
        assert images(worker) == [] and worker.capacity().hibernated == 0
    finally:
        worker.close()


def cgroup_limit(container: str) -> int:
    from readie_worker.cgroups import CGROUP_V1_MEMORY, CGROUP_V2

    for path in (CGROUP_V1_MEMORY / container / "memory.limit_in_bytes", CGROUP_V2 / container / "memory.max"):
        if path.exists():
            return int(path.read_text())
    raise AssertionError(f"no memory cgroup for {container}")


def test_a_resume_keeps_the_memory_limit_the_session_opened_with(worker):
    """Measured again from a restored sandbox's usage, the limit would grow by 'memory' at every
    resume (found by the attacker read: 153 -> 496 MiB in five cycles of a job filling a memfd)."""
    memory = 64 * 1024**2
    session, first = worker.open_session(job("import os\nkept = []", memory_bytes=memory))
    try:
        assert first.outcome.exit == 0, first.outcome
        opened = session.memory_limit
        assert opened is not None and cgroup_limit(session.sandbox_id) == opened
        for _ in range(2):  # the limit grew at every resume: two show it
            grew = session.run_step(Step(
                "fd = os.memfd_create('fill')\nos.write(fd, b'x' * (16 * 1024 * 1024))\nkept.append(fd)"
            ))
            assert grew.outcome.exit == 0, grew.outcome
            session.hibernate()
            resumed = session.run_step(Step("print(len(kept))"))
            assert resumed.resumed_ms is not None, resumed.outcome
            assert cgroup_limit(session.sandbox_id) == opened == session.memory_limit
        forked, _ = worker.fork_session(session)
        try:
            assert forked.run_step(Step("print(len(kept))")).outcome.stdout == "2\n"
            assert cgroup_limit(forked.sandbox_id) == opened
        finally:
            forked.close()
    finally:
        session.close()


def test_the_byte_bound_counts_the_hibernation_under_way(checkpoints):
    # The sandbox's memory is booked before its checkpoint: an image that cannot fit is refused
    # before it is written, and the session runs on.
    config = WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={"base": 0}, session_store_bytes=1024**2)
    worker = Worker(config).start()
    try:
        session, _ = worker.open_session(job("x = 1"))
        with pytest.raises(SandboxSetupError, match="the session store is full"):
            session.hibernate()
        assert not session.hibernated and worker.capacity().hibernated_bytes == 0
        assert session.run_step(Step("print(x)")).outcome.stdout == "1\n"
    finally:
        worker.close()
    assert worker.runsc.list_ids() == []


def test_metrics_count_hibernations_resumes_and_forks_and_gauge_the_images(checkpoints):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from readie_worker.testing import sample

    def samples() -> dict:
        text = generate_latest(worker.metrics.registry).decode()
        return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}

    worker = Worker(WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={"base": 0})).start()
    worker.metrics.watch_worker(worker)  # the gauges, read at scrape time (as `readie worker --metrics`)
    try:
        session, _ = worker.open_session(job("x = 1"))
        session.hibernate()
        got = samples()
        assert sample(got, "readie_worker_sessions_hibernated") == 1
        assert sample(got, "readie_worker_hibernated_bytes") == worker.capacity().hibernated_bytes > 0
        session.run_step(Step("pass"))
        fork, _ = worker.fork_session(session)
        got = samples()
        name = "readie_worker_session_image_duration_seconds_count"
        counts = {operation: sample(got, name, operation=operation) for operation in ("hibernate", "resume", "fork")}
        # The fork hibernated the session (a second hibernation) and then shared its image.
        assert counts == {"hibernate": 2, "resume": 1, "fork": 1}, counts
        assert sample(got, "readie_worker_sessions_hibernated") == 2  # both wait on disk
        fork.close()
        session.close()
        assert sample(samples(), "readie_worker_hibernated_bytes") == 0
    finally:
        worker.close()
