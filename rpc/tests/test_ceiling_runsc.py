"""The operator's ceiling on network entry points: real ``readie worker`` and ``readie router``
processes, real gRPC clients. Without ``--config`` a request over the network is granted
nothing; with one, the same rules as ``readie pool`` (the policy module both use)."""

from __future__ import annotations

import queue
from pathlib import Path

import grpc
import pytest

from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from readie_rpc.testing import start_cluster, start_worker, stop_worker

pytestmark = pytest.mark.runsc

GIB = 1024**3


def refusal(stub: pb_grpc.WorkerStub, request: pb.RunJobRequest) -> tuple[str, str]:
    """The field and message a refused RunJob names."""
    with pytest.raises(grpc.RpcError) as refused:
        stub.RunJob(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    metadata = dict(refused.value.trailing_metadata())
    assert metadata["readie-error"] == "RequestError"
    return metadata["readie-field"], refused.value.details()


def job(**fields: object) -> pb.RunJobRequest:
    return pb.RunJobRequest(**{"checkpoint": "base", "code": "print('ran')", "timeout_ms": 10_000, **fields})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def open_worker(checkpoints, checkpoint_dir, tmp_path_factory):
    """A worker started without --config: what anyone gets by default."""
    worker = start_worker(tmp_path_factory.mktemp("no-ceiling"), "no-ceiling", checkpoint_dir / "manifest.json", warm="base=1")
    yield worker
    assert stop_worker(worker) == 0


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"allow_read": ["/etc"]}, "allow_read"),
        ({"allow_read": ["/tmp"]}, "allow_read"),
        ({"allow_write": ["/tmp"]}, "allow_write"),
        ({"package_dirs": ["/usr/lib/python3/dist-packages"]}, "package_dirs"),
        ({"network": True}, "network"),
        ({"network": True, "network_destinations": ["api.example.com:443"]}, "network"),
        ({"network_destinations": ["api.example.com:443"]}, "network_destinations"),
        ({"packages": ["six==1.16.0"]}, "packages"),
        ({"profile": "analysis"}, "profile"),
        ({"max_output": 2 * 1024 * 1024}, "max_output"),  # answers must fit a client's default 4 MiB
        ({"allow_read": ["relative"]}, "allow_read"),
    ],
)
def test_without_a_ceiling_a_network_request_is_granted_nothing(open_worker, fields, field):
    named, message = refusal(open_worker.stub, job(**fields))
    assert named == field and message.startswith(f"{field}: "), message


def test_without_a_ceiling_plain_code_still_runs(open_worker):
    assert open_worker.stub.RunJob(job(), timeout=30).stdout == "ran\n"


def test_a_session_is_held_to_the_ceiling_too_and_a_refused_step_keeps_it(open_worker):
    refused = open_worker.stub.Interact(iter([pb.InteractRequest(open_session=job(allow_read=["/etc"]))]), timeout=30)
    with pytest.raises(grpc.RpcError) as error:
        list(refused)
    assert dict(error.value.trailing_metadata())["readie-field"] == "allow_read"
    # A step above the ceiling (the network's 1 MiB max_output) is refused; the session goes on.
    requests: queue.Queue[pb.InteractRequest | None] = queue.Queue()
    requests.put(pb.InteractRequest(open_session=job(code="x = 41")))
    events = open_worker.stub.Interact(iter(requests.get, None), timeout=60)
    first = next(events).result
    requests.put(pb.InteractRequest(step=pb.SessionStep(code="print(x)", max_output=4 * 1024 * 1024)))
    refused_step = next(events).result
    requests.put(pb.InteractRequest(step=pb.SessionStep(code="print(x + 1)")))
    last = next(events).result
    requests.put(None)
    assert (first.step, first.session_ended) == (1, False)
    assert refused_step.error.type == "RequestError" and refused_step.error.message.startswith("step.max_output: ")
    assert not refused_step.session_ended
    assert (last.stdout, last.step) == ("42\n", 2)


CEILING = """
[pool.limits]
allow_read = ["data"]
allow_write = ["out"]
allow_network = ["api.example.com:443"]
timeout = "10s"
memory = "1g"
max_output = 65536
max_file_size = "1m"

[profiles.analysis]
allow_write = ["out"]
env = {{ MODE = "analysis" }}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ceiling")
    for name in ("data", "out", "secret"):
        (root / name).mkdir()
    (root / "data" / "orders.csv").write_text("tea,3\n")
    (root / "ceiling.toml").write_text(CEILING.format())
    return root


def cases(root: Path) -> list[tuple[dict[str, object], str]]:
    data, out, secret = str(root / "data"), str(root / "out"), str(root / "secret")
    return [
        ({"allow_read": [secret]}, "allow_read"),
        ({"allow_read": [data + "/../secret"]}, "allow_read"),  # lexically beneath nothing
        ({"allow_write": [data]}, "allow_write"),  # readable is not writable
        ({"timeout_ms": 11_000}, "timeout_ms"),
        ({"memory_bytes": 2 * GIB}, "memory_bytes"),
        ({"max_output": 65537}, "max_output"),
        ({"network": True}, "network"),  # the ceiling's list: no worker enforces one yet (decision 35)
        ({"network": True, "network_destinations": ["API.example.com:443"]}, "network"),  # within it: likewise
        ({"network": True, "network_destinations": ["api.example.com"]}, "network"),  # every port: beyond it
        ({"profile": "admin"}, "profile"),
        ({"package_dirs": ["/usr/lib"]}, "package_dirs"),
        ({"packages": ["six==1.16.0"]}, "packages"),
        ({"allow_read": [out, out + "/in"]}, "allow_read"),  # nested grants: refused by the worker
    ]


@pytest.fixture(scope="module", params=["worker", "router"])
def ceiled(request, checkpoints, checkpoint_dir, tmp_path_factory, project):
    """The ceiling, enforced by a worker; and by a router in front of one (which refuses first)."""
    manifest = checkpoint_dir / "manifest.json"
    base = tmp_path_factory.mktemp(request.param)
    config = f"--config={project / 'ceiling.toml'}"
    if request.param == "worker":
        worker = start_worker(base, "ceiled", manifest, warm="base=1", args=[config])
        yield worker.stub
        assert stop_worker(worker) == 0
        return
    cluster = start_cluster(base, manifest, workers=1, router_args=[config], worker_args=[config])
    yield cluster.stub
    cluster.stop()


@pytest.mark.parametrize("index", range(13))
def test_with_a_ceiling_the_pool_s_rules_hold_over_the_network(ceiled, project, index):
    fields, field = cases(project)[index]
    named, message = refusal(ceiled, job(**fields))
    assert named == field and message.startswith(f"{field}: "), message
    if field == "network":
        # Within the ceiling, a worker without egress_netns still refuses it (decision 36).
        assert ("not within" if "'api.example.com'" in message else "no egress for networked jobs") in message, message
    assert str(project / "secret") not in message or fields.get("allow_read") == [str(project / "secret")]


def test_with_a_ceiling_grants_profiles_and_its_limits_apply(ceiled, project):
    code = (
        "import os\nprint(open(%r).read().strip(), os.environ['MODE'])\n"
        "try:\n    open(%r, 'wb').write(b'x' * 2_000_000)\nexcept OSError as e:\n    print(e.errno)\n"
    ) % (str(project / "data" / "orders.csv"), str(project / "out" / "big.bin"))
    response = ceiled.RunJob(job(code=code, allow_read=[str(project / "data")], profile="analysis"), timeout=60)
    # The profile's write grant and env; the ceiling's max_file_size for a request that set none.
    assert (response.exit, response.stdout) == (0, "tea,3 analysis\n27\n"), response
