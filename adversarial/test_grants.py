"""Grants and paths: symlink swaps (with a held slot, not a timing lottery), scripts, file grants,
the worker's own directories, and refusals that must not tell where anything leads."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from readie_pool.sans_io import RequestError
from readie_policy.policy import Limits, resolve_script
from readie_pool import read_script
from readie_pool.sans_io import JobRequest
import readie_worker
from readie_worker.core import Worker, WorkerConfig
from readie_worker.state_dir import RUNTIME_ROOT
from readie_worker.errors import RequestError as WorkerRequestError
from readie_worker.jobs import CodeJob

from adversarial._target import target, unharmed  # noqa: F401 - fixtures

pytestmark = pytest.mark.runsc

SYMLINK_REFUSAL = "passes through a symbolic link, which readie never follows in a granted path"
HOLD = "from readie_host import hold\nhold()\n"


def hold_slots(target: Any, codes: list[str], **fields: Any) -> list[tuple[str, int]]:
    """Occupy every worker slot with a job waiting on a host call; (id, call_id) of each."""
    ids = []
    for code in codes:
        rid = target.request_id()
        target.pool.send({"id": rid, "functions": ["hold"], "code": code, **fields})
        ids.append(rid)
    calls = {}
    while len(calls) < len(ids):
        event = target.pool.read()
        assert event.get("event") == "call", event
        calls[event["id"]] = event["call_id"]
    return [(rid, calls[rid]) for rid in ids]


def queue_behind(target: Any, request: dict[str, Any]) -> None:
    """Send ``request`` and return once the pool has checked it (it waits for a slot).

    A request refused by the ceiling is sent after it: the pool checks
    requests in the order it read them (asyncio runs their tasks in order),
    so that refusal's answer means ``request`` passed its checks.
    """
    target.pool.send(request)
    marker = target.request_id()
    target.pool.send({"id": marker, "code": "pass", "allow_read": ["/etc"]})
    refusal = target.pool.read()
    assert refusal["id"] == marker and refusal["error"]["type"] == "RequestError", refusal


def release(target: Any, held: list[tuple[str, int]]) -> dict[Any, dict[str, Any]]:
    for _, call_id in held:
        target.pool.send({"reply": {"call_id": call_id, "result": None}})
    return {}


def results(target: Any, count: int) -> dict[Any, dict[str, Any]]:
    answers = {}
    for _ in range(count):
        line = target.pool.read(60)
        answers[line["id"]] = line
    return answers


def swap_for_symlink(path: Path, target_dir: Path) -> None:
    path.rename(path.with_name(path.name + ".moved"))
    path.symlink_to(target_dir)


@pytest.mark.parametrize("field", ["allow_read", "allow_write"])
def test_a_grant_swapped_for_a_symlink_while_its_job_waits_is_refused(target, field):
    """The finding: checked at parse, mounted at slot time, following a symlink made in between."""
    (target.out / "sub").mkdir()
    held = hold_slots(target, [HOLD] * 2)
    victim = target.request_id()
    code = "import os\nprint(os.listdir('out/sub'))\nopen('out/sub/planted', 'w').write('x')\n"
    queue_behind(target, {"id": victim, field: ["out/sub"], "code": code})
    swap_for_symlink(target.out / "sub", target.host / "canary-dir")
    release(target, held)
    answers = results(target, 3)
    refused = answers[victim]
    assert refused["exit"] == -1 and refused["error"]["type"] == "RequestError", refused
    assert refused["error"]["message"] == f"{field}: '{target.out / 'sub'}' {SYMLINK_REFUSAL}"
    assert not (target.host / "canary-dir" / "planted").exists()
    assert all(answers[rid]["exit"] == 0 for rid, _ in held)


def test_an_ancestor_swapped_for_a_symlink_is_refused(target):
    (target.out / "a" / "b").mkdir(parents=True)
    (target.host / "canary-dir" / "b").mkdir(exist_ok=True)
    held = hold_slots(target, [HOLD] * 2)
    victim = target.request_id()
    queue_behind(target, {"id": victim, "allow_write": ["out/a/b"], "code": "open('out/a/b/planted', 'w')"})
    swap_for_symlink(target.out / "a", target.host / "canary-dir")
    release(target, held)
    refused = results(target, 3)[victim]
    assert refused["error"]["type"] == "RequestError" and SYMLINK_REFUSAL in refused["error"]["message"]
    assert not (target.host / "canary-dir" / "b" / "planted").exists()
    (target.host / "canary-dir" / "b").rmdir()


def test_a_job_that_swaps_its_own_write_grant_cannot_hand_the_next_job_the_host(target):
    """The finding as reproduced: one job plants the swap, a queued one would have followed it."""
    swapper = (
        "import os\nos.mkdir('out/sub')\n" + HOLD
        + f"os.rmdir('out/sub')\nos.symlink({str(target.host / 'canary-dir')!r}, 'out/sub')\n"
    )
    held = hold_slots(target, [swapper, HOLD], allow_write=["out"])
    victim = target.request_id()
    queue_behind(target, {"id": victim, "allow_read": ["out/sub"], "code": "print(open('out/sub/canary.txt').read())"})
    # The swapper first, alone: released together, the other job's slot could
    # go to the victim between the swapper's rmdir and its symlink, and the
    # victim would be refused for a path that does not exist.
    release(target, held[:1])
    swapped = results(target, 1)
    assert swapped[held[0][0]]["exit"] == 0, swapped
    release(target, held[1:])
    answers = results(target, 2)
    refused = answers[victim]
    assert refused["error"]["type"] == "RequestError" and SYMLINK_REFUSAL in refused["error"]["message"], refused
    # And a request naming the planted link afterwards is refused at once.
    later = target.run(code="print(1)", allow_read=["out/sub"])
    assert later["error"]["type"] == "RequestError" and SYMLINK_REFUSAL in later["error"]["message"]


def test_a_session_keeps_the_directory_it_was_granted_when_the_path_moves(target):
    """Held from slot to sandbox end: the path changing under a live sandbox changes nothing inside."""
    (target.out / "sub").mkdir()
    (target.out / "sub" / "inside.txt").write_text("granted\n")
    first = target.run(session="held", code="import os\nprint(sorted(os.listdir('out/sub')))", allow_read=["out/sub"])
    assert first["stdout"] == "['inside.txt']\n", first
    swap_for_symlink(target.out / "sub", target.host / "canary-dir")
    second = target.run(session="held", code="print(sorted(os.listdir('out/sub')))")
    assert second["stdout"] == "['inside.txt']\n", second
    assert target.run(session="held", close=True)["closed"] is True


@pytest.mark.parametrize(
    ("read", "write"),
    [(["out/sub"], ["out"]), (["out"], ["out/sub"]), (["out", "out/sub"], [])],
    ids=["read-in-write", "write-in-read", "read-in-read"],
)
def test_nested_grants_are_refused_before_a_sandbox_is_made(target, read, write):
    (target.out / "sub").mkdir()
    result = target.run(code="print(1)", allow_read=read, allow_write=write)
    assert result["error"]["type"] == "RequestError" and "grants may not nest" in result["error"]["message"], result
    assert result["duration_ms"] == 0 or result["queue_us"] >= 0


def test_a_path_granted_both_ways_is_written(target):
    result = target.attack("open('out/both', 'w').write('ok')\nprint(open('out/both').read())", allow_read=["out"], allow_write=["out"])
    assert result["stdout"] == "ok\n" and result["policy"]["allow_read"] == [], result


@pytest.mark.parametrize(
    ("link", "points_to"),
    [("out/escape", "host/canary-dir"), ("out/inside", "project/data"), ("data/../out/escape", "host/canary-dir")],
)
def test_a_request_naming_a_symlink_is_refused_without_saying_where_it_leads(target, link, points_to):
    (target.out / "escape").symlink_to(target.base / "host" / "canary-dir")
    (target.out / "inside").symlink_to(target.data)
    result = target.run(code="print(1)", allow_read=[link])
    assert result["error"]["type"] == "RequestError", result
    assert result["error"]["message"] == f"allow_read: {link!r} {SYMLINK_REFUSAL}"
    assert "canary-dir" not in json.dumps(result) and str(target.host) not in json.dumps(result)


@pytest.mark.parametrize("path", ["/proc/self/fd/2", "/proc/self/cwd", "/proc/1/root", "/dev/stdin"])
def test_a_proc_link_names_nothing_of_the_pool(target, path):
    result = target.run(code="print(1)", allow_read=[path])
    assert result["error"]["type"] == "RequestError", result
    message = result["error"]["message"]
    assert message.startswith(f"allow_read: {path!r} is not beneath"), message  # never looked at
    for private in ("pool.log", str(target.scratch), "/dev/pts", "pipe:", "socket:"):
        assert private not in message, message


def test_a_relative_escape_is_quoted_as_written(target):
    result = target.run(code="print(1)", allow_read=["data/../../host"])
    assert result["error"]["message"].startswith("allow_read: 'data/../../host' is not beneath"), result


def test_a_single_file_may_be_granted_and_nothing_beside_it(target):
    code = (
        "import os\nprint(open('data/orders.csv').read().count('tea'))\n"
        "print(sorted(os.listdir('data')))\n"
        "try:\n    open('data/other.txt')\nexcept OSError as e:\n    print(type(e).__name__)\n"
    )
    result = target.attack(code, allow_read=["data/orders.csv"])
    assert result["exit"] == 0 and result["stdout"] == "1\n['orders.csv']\nFileNotFoundError\n", result


def test_a_file_write_grant_writes_that_file_only(target):
    (target.out / "log.txt").write_text("start\n")
    code = (
        "import ctypes, os\nopen('out/log.txt', 'a').write('appended\\n')\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = libc.open(b'/readie/grants/write-0/beside.txt', os.O_CREAT | os.O_WRONLY, 0o644)\n"
        "print(fd, os.strerror(ctypes.get_errno()))\n"
    )
    result = target.attack(code, allow_write=["out/log.txt"])
    assert result["exit"] == 0 and result["stdout"] == "-1 Read-only file system\n", result
    assert (target.out / "log.txt").read_text() == "start\nappended\n"
    assert sorted(os.listdir(target.out)) == ["log.txt"]


def test_a_script_that_is_a_symlink_is_refused_and_never_echoed(target):
    (target.data / "s.py").symlink_to(target.host / "canary.txt")
    try:
        result = target.run(script="data/s.py")
        assert result["error"]["type"] == "RequestError" and SYMLINK_REFUSAL in result["error"]["message"], result
        assert result["error"]["message"].startswith("script: 'data/s.py'")
    finally:
        (target.data / "s.py").unlink()


def test_a_script_through_a_symlinked_directory_is_refused(target):
    (target.data / "lib").symlink_to(target.host)
    try:
        result = target.run(script="data/lib/canary.txt")
        assert result["error"]["type"] == "RequestError" and SYMLINK_REFUSAL in result["error"]["message"], result
    finally:
        (target.data / "lib").unlink()


def test_a_script_that_is_a_fifo_is_refused_without_hanging_the_pool(target):
    os.mkfifo(target.data / "pipe.py")
    try:
        result = target.run(wait=10, script="data/pipe.py")
        assert result["error"]["type"] == "RequestError" and "neither a directory nor a regular file" in result["error"]["message"]
    finally:
        (target.data / "pipe.py").unlink()


def test_a_script_swapped_after_its_check_is_read_through_no_symlink(tmp_path):
    """The finding's race, made deterministic: the check passes, then the file becomes a link."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "s.py").write_text("print('harmless')\n")
    (tmp_path / "secret.py").write_text("SECRET = 'host file'\n")
    request = JobRequest(id=1, script="data/s.py")
    checked = resolve_script(request, cwd=tmp_path, limits=Limits(allow_read=(tmp_path / "data",), allow_write=()))
    assert read_script(checked, "data/s.py") == "print('harmless')\n"
    (tmp_path / "data" / "s.py").unlink()
    (tmp_path / "data" / "s.py").symlink_to(tmp_path / "secret.py")
    with pytest.raises(RequestError) as refused:
        read_script(checked, "data/s.py")
    assert str(refused.value) == f"script: 'data/s.py' {SYMLINK_REFUSAL}"


# --------------------------------------------------------------------------- the worker's own paths


@pytest.fixture(scope="module")
def worker(checkpoints, checkpoint_dir):
    made = Worker(WorkerConfig.in_temp(checkpoint_dir / "manifest.json", warm={})).start()
    assert made.run_job(CodeJob(checkpoint="base", code="pass")).exit == 0  # its dirs all exist now
    yield made
    made.close()
    assert made.runsc.list_ids() == []


def own_paths(worker: Worker) -> dict[str, Path]:
    manifest = worker.checkpoints.manifest
    return {
        "run dir": worker.state.run_dir,
        "runsc root": worker.state.runsc_root,
        "state dir (holds both)": worker.state.path,
        "every readie scratch on the host": RUNTIME_ROOT,
        "rootfs": manifest.rootfs,
        "checkpoint images": worker.config.manifest.parent.resolve(),
        "readie's own code": Path(readie_worker.__file__).parent,
        "the worker's Python": Path(sys.prefix),
        "runsc": Path(shutil.which("runsc")),
    }


@pytest.mark.parametrize("which", ["run dir", "runsc root", "state dir (holds both)", "every readie scratch on the host"])
@pytest.mark.parametrize("field", ["allow_read", "allow_write"])
def test_no_grant_reaches_the_worker_s_own_directories(worker, which, field):
    path = str(own_paths(worker)[which])
    with pytest.raises(WorkerRequestError) as refused:
        worker.run_job(CodeJob(checkpoint="base", code="print(1)", **{field: (path,)}))
    assert refused.value.field == field and "overlaps a directory the worker keeps for itself" in str(refused.value)


@pytest.mark.parametrize("which", ["rootfs", "checkpoint images", "readie's own code", "the worker's Python", "runsc"])
def test_what_every_sandbox_is_made_from_can_be_read_but_never_written(worker, which):
    path = str(own_paths(worker)[which])
    with pytest.raises(WorkerRequestError, match="overlaps"):
        worker.run_job(CodeJob(checkpoint="base", code="print(1)", allow_write=(path,)))
    read = worker.run_job(CodeJob(checkpoint="base", code="import os\nprint(os.path.exists(%r))" % path, allow_read=(path,)))
    assert (read.exit, read.stdout) == (0, "True\n"), read


@pytest.mark.parametrize("path", ["relative/dir", "/tmp/../etc", "/tmp//x", "/tmp/x/"])
def test_the_worker_takes_only_absolute_normal_paths(worker, path):
    with pytest.raises(WorkerRequestError, match="is not an absolute path|is not a normal path"):
        worker.run_job(CodeJob(checkpoint="base", code="print(1)", allow_read=(path,)))
