"""Issue 30's "must show", walked as one story through `readie router` in front of two `readie worker`
processes sharing a session store (decision 32).

The client is `readie pool --router`, the path users take. Its session holds a 200,000-row pandas
DataFrame and a counter; each step adds one to the counter and prints it with the frame's length,
so every answer says whether the state came through intact. The workers checkpoint a session into
the store after each step (`--session-checkpoint=step`). In order, one cluster:

1. SIGTERM the worker holding the session, start it again as a supervisor would: the next step
   has the counter and the frame, and says it resumed (`resumed_ms`).
2. SIGKILL the worker holding it while a step runs: that step is answered as lost (never re-run),
   the next one continues from the last step's state and says which step that was.
3. SIGKILL the client and the router, start the router again: a new client attaches with the
   session's name and key, and the state is intact.
4. A wrong key, a tampered image, a truncated image: typed refusals; the workers keep serving.
5. Closing the session leaves no store entry, no runsc container and no sandbox dir behind.

Each test is a chapter and needs the ones before it; ``-s`` prints the story's key lines.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from readie_policy.testing import readie_command
from readie_pool.testing import PoolProcess
from readie_rpc.stubs import worker_pb2 as pb
from readie_rpc.testing import (
    EXIT_TIMEOUT_S,
    Cluster,
    WorkerProcess,
    not_a_subreaper,
    start_cluster,
    start_worker,
)
from readie_worker.session_store import entry_name
from readie_worker.state_dir import IMAGES, RUN
from readie_worker.testing import wait_until

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc

ROWS = 200_000
SETUP = f"import pandas as pd\ndf = pd.DataFrame({{'n': range({ROWS})}})\nn = 0\nprint('set')"
STEP = "n += 1\nprint(n, len(df))"
# A step still running when its worker is killed: its side effect on n must never show.
IN_FLIGHT = "n += 100\nprint('running', flush=True)\nimport time\ntime.sleep(60)"
WARM = "pandas=1"
# Restores of pandas, a hibernation and a restart on two busy cores: generous, never hit when well.
STEP_TIMEOUT_S = 90.0
# A background checkpoint of the pandas session takes ~0.3 s here; a restarted worker serves in ~1 s.
SETTLE_TIMEOUT_S = 30.0


@dataclass
class Story:
    cluster: Cluster
    store: Path
    key_file: Path
    worker_args: list[str]
    pool: PoolProcess | None = None  # the client of the moment
    key: str = ""
    chapters: set[str] = field(default_factory=set)
    pools: int = 0

    @property
    def client(self) -> PoolProcess:
        assert self.pool is not None
        return self.pool

    def after(self, chapter: str) -> None:
        """Fail (not skip) a chapter whose prerequisite did not pass: the story is one."""
        if chapter not in self.chapters:
            pytest.fail(f"needs chapter {chapter!r} of the story, which did not pass")

    def new_pool(self) -> PoolProcess:
        self.pools += 1
        project = self.cluster.base / f"project-{self.pools}"
        project.mkdir()
        pool = PoolProcess(
            ["--router", self.cluster.address, "--workers=2", "--preload=pandas,numpy", "--log=json",
             f"--checkpoints={CHECKPOINTS}"],
            cwd=project,
            stderr_path=self.cluster.base / f"pool-{self.pools}.err",
        )
        pool.ready()
        return pool

    def step(self, pool: PoolProcess, request_id: str, count: int, name: str = "nb") -> dict[str, Any]:
        """A counting step of session ``name``, checked: the counter is ``count`` and the frame whole."""
        result = pool.run({"id": request_id, "session": name, "code": STEP}, timeout=STEP_TIMEOUT_S)
        assert result.get("error") is None and not result.get("session_ended"), result
        assert result["stdout"] == f"{count} {ROWS}\n", result
        return result

    def holder(self) -> int:
        """The index of the worker the session is live on now."""
        live = [i for i, worker in enumerate(self.cluster.workers) if _sessions(worker) > 0]
        assert len(live) == 1, f"the session is live on workers {live}"
        return live[0]

    def restart_worker(self, index: int) -> WorkerProcess:
        """The worker at ``index`` started again on its address and state dir, as a supervisor would."""
        old = self.cluster.workers[index]
        old.channel.close()
        restarted = start_worker(
            self.cluster.base / f"worker-{index}", f"worker-{index}", CHECKPOINTS / "manifest.json", warm=WARM,
            args=self.worker_args, port=old.port,
        )
        self.cluster.workers[index] = restarted
        return restarted

    def restart_router(self) -> None:
        """The router started again with the command it had, on its address."""
        with open(self.cluster.log_path, "ab") as log:
            self.cluster.router = subprocess.Popen(
                self.cluster.router.args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        health = health_pb2_grpc.HealthStub(self.cluster.channel)

        def serving() -> bool:
            try:
                return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:  # not listening yet
                return False

        assert wait_until(serving, SETTLE_TIMEOUT_S, poll_s=0.1), self.cluster.log_path.read_text()[-3000:]

    def stored_step(self, key: str) -> int | None:
        """The step of the newest image the store holds for ``key`` (its entry's newest generation, read
        from outside the workers, as decision 32 lays it out); None while it holds none."""
        entry = self.store / entry_name(key)
        try:
            generations = [int(p.name[1:]) for p in entry.iterdir() if p.name[:1] == "g" and p.name[1:].isdigit()]
            if not generations:
                return None
            return int(json.loads((entry / f"g{max(generations)}" / "meta.json").read_text())["step"])
        except (OSError, ValueError):  # no entry yet, or a newer generation replaced this one as we read
            return None

    def listing(self) -> list[dict[str, Any]]:
        """What ``readie sessions --json`` (the operator's view) lists in the store."""
        listed = subprocess.run(
            [*readie_command(), "sessions", f"--session-store={self.store}", f"--session-store-key={self.key_file}", "--json"],
            capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=True,
        )
        return [json.loads(line) for line in listed.stdout.splitlines()]

    def leftovers(self) -> list[str]:
        """What the store holds besides its lock file: entries, writes in progress, anything."""
        return sorted(str(p.relative_to(self.store)) for p in self.store.rglob("*") if p.name != ".lock")


def _sessions(worker: WorkerProcess) -> int:
    return worker.stub.Capacity(pb.CapacityRequest(), timeout=5).sessions


def _listing(worker: WorkerProcess, part: str) -> list[str]:
    """What the worker keeps in ``part`` of its state dir (RUN: a dir per sandbox; IMAGES: images)."""
    path = worker.state_dir / part
    return sorted(os.listdir(path)) if path.exists() else []


@pytest.fixture(scope="module")
def story() -> Iterator[Story]:
    base = Path(tempfile.mkdtemp(prefix="ds-", dir="/tmp"))
    # The key where no job's grant reaches (the test ceiling grants /tmp).
    secret = Path(tempfile.mkdtemp(prefix="readie-ds-", dir="/dev/shm"))
    store = base / "store"
    store.mkdir(mode=0o700)
    key_file = secret / "store.key"
    with os.fdopen(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(secrets.token_urlsafe(32))
    # Every session is checkpointed into the store after each step: a crash costs the step in flight.
    worker_args = [f"--session-store={store}", f"--session-store-key={key_file}", "--session-checkpoint=step"]
    try:
        with not_a_subreaper():  # workers are killed here: their sandboxes must go to init, who reaps
            cluster = start_cluster(base, CHECKPOINTS / "manifest.json", warm=WARM, worker_args=worker_args)
            made = Story(cluster, store, key_file, worker_args)
            try:
                made.pool = made.new_pool()
                yield made
            finally:
                if made.pool is not None:
                    made.pool.stop()
                cluster.stop()  # raises if a worker failed to drain or left a container
    finally:
        shutil.rmtree(secret, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def test_1_a_drained_worker_hands_the_session_on(story: Story) -> None:
    pool = story.client
    opened = pool.run({"id": "open", "session": "nb", "code": SETUP}, timeout=STEP_TIMEOUT_S)
    assert (opened["exit"], opened["stdout"], opened["step"]) == (0, "set\n", 1), opened
    story.key = opened["session_key"]
    assert len(base64.urlsafe_b64decode(story.key + "=" * (-len(story.key) % 4))) >= 16  # >= 128 random bits
    story.step(pool, "count-1", 1)
    holder = story.holder()
    worker = story.cluster.workers[holder]
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(EXIT_TIMEOUT_S) == 0, worker.log_path.read_text()[-3000:]
    # The session's stream ended with handed_over once it was stored, not cut off when the server stopped.
    assert any(line.get("event") == "call" and line.get("handed_over") for line in worker.log_lines()), worker.log_lines()
    (stored,) = story.listing()  # the operator's view: one entry, waiting for an attach, never the key
    assert entry_name(story.key).startswith(stored["entry"]) and stored["state"] == "stored" and stored["bytes"] > 0, stored
    assert story.key not in json.dumps(stored)
    story.restart_worker(holder)
    after = story.step(pool, "count-2", 2)
    assert after.get("resumed_ms") is not None, after
    print(f"\n[must-show] SIGTERM worker-{holder}: stored {stored['bytes'] / 2**20:.0f} MiB; restarted: "
          f"{after['stdout'].strip()!r} step {after['step']} resumed_ms={after['resumed_ms']} (now on worker-{story.holder()})")
    story.chapters.add("drain")


def test_2_a_killed_worker_costs_at_most_the_step_in_flight(story: Story) -> None:
    story.after("drain")
    pool = story.client
    last = story.step(pool, "count-3", 3)
    holder = story.holder()
    # The checkpoint of that step is written after its result, in the background: wait for it.
    assert wait_until(lambda: story.stored_step(story.key) == last["step"], SETTLE_TIMEOUT_S), story.stored_step(story.key)
    pool.send({"id": "in-flight", "session": "nb", "stream": True, "code": IN_FLIGHT})
    running = pool.read(STEP_TIMEOUT_S)
    assert (running.get("event"), running.get("id"), running.get("data")) == ("output", "in-flight", "running\n"), running
    worker = story.cluster.workers[holder]
    worker.process.kill()
    worker.process.wait(EXIT_TIMEOUT_S)
    lost = pool.read(STEP_TIMEOUT_S)
    assert lost["id"] == "in-flight" and lost["error"]["type"] == "PoolWorkerError", lost
    assert lost.get("lost") is True and not lost.get("session_ended"), lost
    story.restart_worker(holder)
    after = story.step(pool, "count-4", 4)  # from step 3's state: the lost step's n += 100 is not in it
    assert after.get("resumed_from_step") == last["step"], after
    print(f"[must-show] SIGKILL worker-{holder} mid-step: in-flight answered {lost['error']['type']} lost=true; "
          f"next {after['stdout'].strip()!r} step {after['step']} resumed_from_step={after['resumed_from_step']}")
    story.chapters.add("crash")


def test_3_the_session_outlives_its_client_and_its_router(story: Story) -> None:
    story.after("crash")
    story.client.process.kill()
    story.client.finish()
    story.cluster.router.kill()
    story.cluster.router.wait(EXIT_TIMEOUT_S)
    story.restart_router()
    story.pool = pool = story.new_pool()
    attached = pool.run({"id": "attach", "session": "nb", "attach": story.key}, timeout=STEP_TIMEOUT_S)
    assert (attached.get("session"), attached.get("attached")) == ("nb", True), attached
    after = story.step(pool, "count-5", 5)
    print(f"[must-show] SIGKILL client and router, router restarted, new client attached at step "
          f"{attached['step']}: {after['stdout'].strip()!r}")
    story.chapters.add("reconnect")


def test_4_bad_keys_and_bad_images_are_refused_and_the_workers_keep_serving(story: Story) -> None:
    story.after("reconnect")
    pool = story.client
    # Two more sessions, left behind by a client that dies: their images are what gets damaged.
    doomed = story.new_pool()
    keys = {}
    for name in ("tampered", "truncated"):
        first = doomed.run({"id": name, "session": name, "code": "x = 1"}, timeout=STEP_TIMEOUT_S)
        assert first["exit"] == 0, first
        keys[name] = first["session_key"]
    doomed.process.kill()
    doomed.finish()
    # Their streams broke: each is detached (hibernated into the store), only nb stays live.
    assert wait_until(lambda: sum(_sessions(w) for w in story.cluster.workers) == 1, SETTLE_TIMEOUT_S)
    assert wait_until(lambda: all(story.stored_step(key) == 1 for key in keys.values()), SETTLE_TIMEOUT_S)
    _damage(story.store / entry_name(keys["tampered"]), truncate=False)
    _damage(story.store / entry_name(keys["truncated"]), truncate=True)

    wrong = pool.run({"id": "wrong", "session": "intruder", "attach": secrets.token_urlsafe(32)})
    near = pool.run({"id": "near", "session": "intruder", "attach": story.key[:-1] + ("A" if story.key[-1] != "A" else "B")})
    for refused in (wrong, near):
        assert refused["error"]["type"] == "RequestError", refused
        assert story.key not in str(refused)
    assert wrong["error"]["message"] == near["error"]["message"]  # an unknown key and a wrong one: no oracle
    for name in ("tampered", "truncated"):
        refusal = _attach_or_first_step(pool, name, keys[name])
        assert refusal["error"]["type"] == "SandboxSetupError", refusal
        print(f"[must-show] {name} image: {refusal['error']['type']}: {refusal['error']['message'][:120]}")
    print(f"[must-show] wrong key: {wrong['error']['type']}: {wrong['error']['message'][:120]}")
    story.step(pool, "count-6", 6)
    job = pool.run({"id": "job", "code": "print('still serving')"}, timeout=STEP_TIMEOUT_S)
    assert job["stdout"] == "still serving\n", job
    assert all(w.process.poll() is None for w in story.cluster.workers)
    story.chapters.add("refusals")


def test_5_closing_the_session_leaves_nothing_behind(story: Story) -> None:
    story.after("refusals")
    pool = story.client
    closed = pool.run({"id": "close", "session": "nb", "close": True})
    assert closed == {"id": "close", "session": "nb", "closed": True}, closed
    # No entry, no half-written generation, no lease: the damaged ones went at their refusal.
    assert wait_until(lambda: story.leftovers() == [], SETTLE_TIMEOUT_S), story.leftovers()
    assert story.listing() == []
    for worker in story.cluster.workers:
        assert _sessions(worker) == 0
        # What the worker holds is its warm sandbox and nothing else: one container, one sandbox dir, no image.
        def only_warm() -> bool:
            return len(worker.containers()) == 1 and len(_listing(worker, RUN)) == 1 and _listing(worker, IMAGES) == []

        assert wait_until(only_warm, SETTLE_TIMEOUT_S), (worker.containers(), _listing(worker, RUN), _listing(worker, IMAGES))
    again = pool.run({"id": "gone", "session": "ghost", "attach": story.key})
    assert again["error"]["type"] == "RequestError", again  # a closed session's key opens nothing
    assert pool.close() == 0
    story.pool = None
    print("[must-show] closed: store empty, each worker holds only its warm sandbox")
    story.chapters.add("closed")


def test_6_a_close_its_worker_never_read_still_removes_the_session(story: Story) -> None:
    """The fault suite's find: a close sent to a worker killed before it read the close was
    answered ``closed`` while the session's last checkpoint stayed in the store. The router now
    takes the session over on the other worker and closes it there."""
    story.after("closed")
    story.pool = pool = story.new_pool()
    first = pool.run({"id": "late-1", "session": "late", "code": "x = 1"}, timeout=STEP_TIMEOUT_S)
    assert first["exit"] == 0, first
    assert wait_until(lambda: story.stored_step(first["session_key"]) == first["step"], SETTLE_TIMEOUT_S)
    holder = story.holder()
    worker = story.cluster.workers[holder]
    worker.process.send_signal(signal.SIGSTOP)  # the close reaches its socket, and nobody reads it
    try:
        pool.send({"id": "late-close", "session": "late", "close": True})
        with pytest.raises(TimeoutError):  # waiting on the stopped worker
            pool.read_line(timeout=1.0)
        worker.process.kill()
        worker.process.wait(EXIT_TIMEOUT_S)
    finally:
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGCONT)
    closed = pool.read(STEP_TIMEOUT_S)
    assert closed == {"id": "late-close", "session": "late", "closed": True}, closed
    assert wait_until(lambda: story.leftovers() == [], SETTLE_TIMEOUT_S), story.leftovers()
    story.restart_worker(holder)
    assert pool.close() == 0
    story.pool = None


def _damage(entry: Path, *, truncate: bool) -> None:
    """Flip a byte in the middle of the largest image file of the entry's generation, or cut it in half."""
    largest = max((p for p in entry.glob("g*/*") if p.is_file()), key=lambda p: p.stat().st_size)
    size = largest.stat().st_size
    with open(largest, "r+b") as file:
        if truncate:
            file.truncate(size // 2)
        else:
            file.seek(size // 2)
            byte = file.read(1)
            file.seek(size // 2)
            file.write(bytes([byte[0] ^ 0xFF]))


def _attach_or_first_step(pool: PoolProcess, name: str, key: str) -> dict[str, Any]:
    """The refusal of a damaged image: at the attach, or at the step that would restore it."""
    answer = pool.run({"id": f"attach-{name}", "session": name, "attach": key}, timeout=STEP_TIMEOUT_S)
    if answer.get("error") is not None:
        return answer
    return pool.run({"id": f"step-{name}", "session": name, "code": "print(x)"}, timeout=STEP_TIMEOUT_S)
