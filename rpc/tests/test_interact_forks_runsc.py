"""Hibernate and fork on the Interact stream: a real ``readie worker`` and real gVisor sandboxes.

The raw stub, as in test_interact_runsc_sessions.py: ``hibernate`` between
steps answers ``hibernated``; ``fork`` answers ``forked`` with a token, and
a second stream whose first message is ``attach`` with that token serves
the fork (decision 0022). A token attaches once; an unknown one is
INVALID_ARGUMENT naming ``attach``; a fork nobody attaches is closed.
"""

from __future__ import annotations

import pytest

from readie_rpc._forks import WaitingForks
from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc.client import WorkerClient
from readie_worker.jobs import CodeJob, Step
from rpc.tests._interact_worker import Stream, invalid_argument, open_stream, wait_until
from rpc.tests._interact_worker import worker, worker_dir  # noqa: F401 - fixtures

pytestmark = pytest.mark.runsc


def attach(worker, token: str) -> Stream:
    return Stream(worker.stub, pb.InteractRequest(attach=pb.AttachSession(token=token)))


def test_hibernate_then_fork_then_attach_on_the_raw_stream(worker):
    parent = open_stream(worker.stub, "open_session", "x = 1")
    first = parent.result()
    parent.send(hibernate=pb.HibernateSession())
    hibernated = parent.event("hibernated")
    assert hibernated.hibernate_ms > 0 and not hibernated.error_type
    # The sandbox is gone; the session is on disk.
    wait_until(lambda: first.sandbox_id not in worker.containers(), "the hibernated sandbox outlived it")
    parent.step("x += 1\nprint(x)")
    resumed = parent.result()
    assert (resumed.stdout, resumed.step, resumed.resumed_ms > 0) == ("2\n", 2, True), resumed
    parent.send(fork=pb.ForkSession())
    forked = parent.event("forked")
    assert forked.fork_ms > 0 and len(forked.token) >= 40 and not forked.error_type
    child = attach(worker, forked.token)
    attached = child.event("attached")
    assert attached.session_id.startswith("ws-") and attached.session_id != resumed.session_id
    child.step("x *= 100\nprint(x)")
    in_child = child.result()
    assert (in_child.stdout, in_child.step, in_child.session_id) == ("200\n", 1, attached.session_id), in_child
    parent.step("print(x)")
    assert parent.result().stdout == "2\n"
    again = attach(worker, forked.token)  # a token attaches once
    invalid_argument(again.refused(), "attach")
    for stream in (child, parent):
        stream.close()
        stream.ends_ok()
    wait_until(lambda: capacity_sessions(worker) == 0, "the sessions were not closed")


def test_an_unknown_token_is_refused_naming_attach(worker):
    invalid_argument(attach(worker, "not-a-token").refused(), "attach")


def test_a_fork_nobody_attaches_is_closed():
    # The worker's own table expires forks after FORK_ATTACH_S (30 s); an in-test table, 0.5 s.
    forks = WaitingForks(attach_s=0.5)
    closed = []

    class Fork:
        id = "ws-test"

        def close(self) -> None:
            closed.append(self.id)

    token = forks.add(Fork())  # type: ignore[arg-type]
    wait_until(lambda: closed == ["ws-test"], "the fork was not closed")
    with pytest.raises(Exception, match="no fork waits under this token"):
        forks.claim(token)


def test_remote_session_fork_through_the_worker_client(worker):
    client = WorkerClient(f"127.0.0.1:{worker.port}")
    try:
        session, first = client.open_session(CodeJob(checkpoint="base", code="items = ['a']", name="cell.py"))
        assert first.outcome.exit == 0, first.outcome
        fork, fork_ms = session.fork()
        try:
            assert fork_ms > 0 and fork.hibernated and session.hibernated
            step = fork.run_step(Step("items.append('fork')\nprint(items)"))
            assert (step.outcome.stdout, step.step) == ("['a', 'fork']\n", 1) and step.resumed_ms > 0
            assert not fork.hibernated
            assert session.run_step(Step("print(items)")).outcome.stdout == "['a']\n"
        finally:
            fork.close()
            session.close()
    finally:
        client.close()
    wait_until(lambda: capacity_sessions(worker) == 0, "the sessions were not closed")


def capacity_sessions(worker) -> int:
    from rpc.tests._interact_worker import capacity

    return capacity(worker).sessions
