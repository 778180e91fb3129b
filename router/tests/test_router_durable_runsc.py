"""Durable sessions through `readie router` in front of two real `readie worker`s sharing a store (decision 32).

One cluster for the module (two workers with ``--session-store`` and one key, a router);
each test opens its own session through the router with ``WorkerClient``, as
``readie pool --router`` does:

* SIGTERM the worker holding a session with a pandas DataFrame and a counter, and restart
  it as a supervisor would: the next step through the router continues with both intact,
  says how long its resume took, and no error;
* the client's stream to the router cancelled: the session is detached into the store, not
  closed; a new stream attaches to it by key and sees its state; a wrong key is refused as
  an unknown one is;
* a session opened with host functions, detached by a broken stream and attached by key on
  a new client that never saw its opening (as ``readie pool --router`` attaches): its job is
  the one it opened with, and a step calls its function through the router.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from readie_policy.jobs import CodeJob, HostCall, HostReply, Step
from readie_protocol.errors import RequestError
from readie_rpc.client import ROUTER_RETRY_S, WorkerClient
from readie_rpc.stubs import worker_pb2 as pb
from readie_rpc.testing import Cluster, WorkerProcess, not_a_subreaper, start_cluster, start_worker, stop_worker
from readie_worker.testing import wait_until

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS  # noqa: E402

MANIFEST = CHECKPOINTS / "manifest.json"
ROWS = 10_000  # a frame worth keeping; the bench measures the 200,000 rows
OPEN = CodeJob(
    "pandas", f"import pandas as pd\ndf = pd.DataFrame({{'x': range({ROWS})}})\ncounter = 1", timeout_ms=60_000
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    base = Path(tempfile.mkdtemp(prefix="rd-", dir="/tmp"))  # short: sandbox socket paths
    key = base / "store.key"
    key.write_bytes(secrets.token_bytes(32))
    key.chmod(0o600)
    store_args = [f"--session-store={base / 'store'}", f"--session-store-key={key}"]
    with not_a_subreaper():
        made = start_cluster(base, MANIFEST, warm="pandas=1", worker_args=store_args)
        made.store_args = store_args  # type: ignore[attr-defined]  # for a restart
        yield made
        made.stop()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def client(cluster: Cluster) -> Iterator[WorkerClient]:
    made = WorkerClient(cluster.address, retry_s=ROUTER_RETRY_S)
    yield made
    made.close()


def sessions(worker: WorkerProcess) -> int:
    return worker.stub.Capacity(pb.CapacityRequest(), timeout=5).sessions


def restart(cluster: Cluster, index: int) -> None:
    """Start the stopped worker ``index`` again on its port and state dir, as a supervisor would."""
    old = cluster.workers[index]
    args = [*cluster.store_args, f"--config={cluster.ceiling}"]  # type: ignore[attr-defined]
    cluster.workers[index] = start_worker(
        old.state_dir.parent, f"worker-{index}", MANIFEST, warm="pandas=1", args=args, port=old.port
    )


def test_a_session_outlives_the_sigterm_of_its_worker(cluster, client):
    session, first = client.open_session(OPEN)
    assert first.outcome.error is None and session.key
    assert session.run_step(Step("counter += 1")).outcome.error is None
    holding = [index for index, worker in enumerate(cluster.workers) if sessions(worker) == 1]
    assert len(holding) == 1
    assert stop_worker(cluster.workers[holding[0]]) == 0  # SIGTERM: a drain hands the session on
    restart(cluster, holding[0])

    after = session.run_step(Step("counter += 1\nprint(counter, len(df))"))
    assert after.outcome.error is None, after.outcome.error
    assert after.outcome.stdout == f"3 {ROWS}\n"
    assert after.resumed_ms is not None and after.resumed_ms > 0
    assert not after.session_ended and after.resumed_from_step is None
    session.close()
    assert wait_until(lambda: [sessions(w) for w in cluster.workers] == [0, 0], 10)


def test_a_cancelled_client_stream_detaches_and_an_attach_by_key_sees_the_state(cluster, client):
    session, _ = client.open_session(OPEN)
    session.run_step(Step("counter = 41"))
    key = session.key
    assert key is not None
    session._stream.cancel()  # the client's connection to the router breaks: no close
    assert wait_until(lambda: [sessions(w) for w in cluster.workers] == [0, 0], 20)  # detached, not held

    with pytest.raises(RequestError) as refused:
        client.attach_session(secrets.token_urlsafe(32))
    assert refused.value.field == "attach"

    attached, step = client.attach_session(key)
    assert step == 2
    outcome = attached.run_step(Step("counter += 1\nprint(counter, len(df))"))
    assert (outcome.outcome.error, outcome.outcome.stdout) == (None, f"42 {ROWS}\n")
    assert outcome.resumed_ms is not None
    attached.close()
    assert wait_until(lambda: [sessions(w) for w in cluster.workers] == [0, 0], 10)


def test_a_session_attached_by_key_through_the_router_keeps_its_host_functions(cluster, client):
    opening = CodeJob("pandas", "counter = 1", timeout_ms=45_000, functions=("lookup",))
    session, _ = client.open_session(opening)
    key = session.key
    assert key is not None
    session._stream.cancel()  # the connection breaks: detached into the store
    assert wait_until(lambda: [sessions(w) for w in cluster.workers] == [0, 0], 20)

    calls: list[HostCall] = []

    def host(call: HostCall) -> HostReply:
        calls.append(call)
        return HostReply(result=call.args[0] * 2)

    fresh = WorkerClient(cluster.address, retry_s=ROUTER_RETRY_S)  # a new connection: no opening seen
    try:
        attached, step = fresh.attach_session(key)
        assert step == 1
        assert (attached.job.functions, attached.job.timeout_ms, attached.job.checkpoint) == (("lookup",), 45_000, "pandas")
        outcome = attached.run_step(Step("from readie_host import lookup\nprint(lookup(counter + 20))"), host=host)
        assert (outcome.outcome.error, outcome.outcome.stdout) == (None, "42\n")
        assert [call.function for call in calls] == ["lookup"]
        attached.close()
    finally:
        fresh.close()
    assert wait_until(lambda: [sessions(w) for w in cluster.workers] == [0, 0], 10)
