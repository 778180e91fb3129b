"""Who may call: bearer tokens, TLS and mTLS on real ``readie worker`` and ``readie router``
processes over loopback, with a CA made in the test; plaintext beyond loopback refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from readie_rpc.security import ClientSecurity
from readie_rpc.testing import SERVING, make_pki, start_cluster, start_worker, stop_worker
from readie_worker.testing import free_port, readie_command

pytestmark = pytest.mark.runsc

TOKEN = "s3cret-t0ken"
JOB = pb.RunJobRequest(checkpoint="base", code="print('ran')", timeout_ms=10_000)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    return path


def capacity(channel: grpc.Channel) -> pb.CapacityResponse:
    return pb_grpc.WorkerStub(channel).Capacity(pb.CapacityRequest(), timeout=5)


def refused_with(channel: grpc.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as refused:
        capacity(channel)
    return refused.value.code()


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


@pytest.fixture(scope="module")
def token_worker(checkpoints, checkpoint_dir, tmp_path_factory, token_file):
    worker = start_worker(
        tmp_path_factory.mktemp("token-worker"),
        "token-worker",
        checkpoint_dir / "manifest.json",
        warm="base=0",
        args=[f"--token-file={token_file}"],
    )
    yield worker
    assert stop_worker(worker) == 0


def test_no_token_and_a_wrong_token_are_unauthenticated(token_worker):
    address = f"127.0.0.1:{token_worker.port}"
    assert refused_with(ClientSecurity().channel(address)) == grpc.StatusCode.UNAUTHENTICATED
    assert refused_with(ClientSecurity(token="wrong").channel(address)) == grpc.StatusCode.UNAUTHENTICATED
    assert refused_with(ClientSecurity(token=TOKEN + "x").channel(address)) == grpc.StatusCode.UNAUTHENTICATED
    stub = pb_grpc.WorkerStub(ClientSecurity().channel(address))
    with pytest.raises(grpc.RpcError) as job:
        stub.RunJob(JOB, timeout=10)
    assert job.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert dict(job.value.trailing_metadata())["readie-error"] == "Unauthenticated"


def test_the_token_opens_every_rpc_and_health_needs_none(token_worker):
    address = f"127.0.0.1:{token_worker.port}"
    good = ClientSecurity(token=TOKEN).channel(address)
    assert capacity(good).slots == 2
    assert pb_grpc.WorkerStub(good).RunJob(JOB, timeout=30).stdout == "ran\n"
    # The streaming RPC too.
    events = pb_grpc.WorkerStub(good).Interact(iter([pb.InteractRequest(job=JOB)]), timeout=30)
    assert [event.result.stdout for event in events] == ["ran\n"]
    assert health(ClientSecurity().channel(address)) == SERVING  # probes carry no secret


@pytest.fixture(scope="module")
def tls_worker(checkpoints, checkpoint_dir, tmp_path_factory, pki, token_file):
    """TLS with mTLS required, and a token on top."""
    worker = start_worker(
        tmp_path_factory.mktemp("tls-worker"),
        "tls-worker",
        checkpoint_dir / "manifest.json",
        warm="base=0",
        args=[
            f"--tls-cert={pki.server_cert}",
            f"--tls-key={pki.server_key}",
            f"--tls-client-ca={pki.ca}",
            f"--token-file={token_file}",
        ],
        security=ClientSecurity.from_files(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, token_file=token_file),
    )
    yield worker
    assert stop_worker(worker) == 0


def test_tls_with_a_client_certificate_and_the_token_is_served(tls_worker, pki, token_file):
    secured = ClientSecurity.from_files(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, token_file=token_file)
    channel = secured.channel(f"localhost:{tls_worker.port}")  # the certificate names both
    assert capacity(channel).slots == 2
    assert pb_grpc.WorkerStub(channel).RunJob(JOB, timeout=30).stdout == "ran\n"


def test_tls_refuses_a_stranger_certificate_none_at_all_and_plaintext(tls_worker, pki, token_file):
    address = f"127.0.0.1:{tls_worker.port}"
    stranger = ClientSecurity.from_files(ca=pki.ca, cert=pki.stranger_cert, key=pki.stranger_key, token_file=token_file)
    assert refused_with(stranger.channel(address)) == grpc.StatusCode.UNAVAILABLE  # the handshake fails
    anonymous = ClientSecurity.from_files(ca=pki.ca, token_file=token_file)
    assert refused_with(anonymous.channel(address)) == grpc.StatusCode.UNAVAILABLE
    assert refused_with(ClientSecurity(token=TOKEN).channel(address)) == grpc.StatusCode.UNAVAILABLE
    # The right certificate is not enough without the token.
    no_token = ClientSecurity.from_files(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    assert refused_with(no_token.channel(address)) == grpc.StatusCode.UNAUTHENTICATED


def test_a_client_that_does_not_trust_the_server_is_refused(tls_worker, pki, token_file):
    wrong_ca = ClientSecurity.from_files(ca=pki.stranger_cert, cert=pki.client_cert, key=pki.client_key, token_file=token_file)
    assert refused_with(wrong_ca.channel(f"127.0.0.1:{tls_worker.port}")) == grpc.StatusCode.UNAVAILABLE


def _start_worker_process(tmp_path: Path, checkpoint_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *readie_command(),
            "worker",
            f"--manifest={checkpoint_dir / 'manifest.json'}",
            f"--state-dir={tmp_path / 'state'}",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "flags",
    [
        [],  # plaintext
        ["--tls-cert={cert}", "--tls-key={key}"],  # TLS, but anyone may call
    ],
    ids=["plaintext", "tls-without-client-auth"],
)
def test_an_unprotected_non_loopback_address_is_refused_at_start(tmp_path, checkpoint_dir, pki, flags):
    listen = f"--listen=0.0.0.0:{free_port()}"
    flags = [flag.format(cert=pki.server_cert, key=pki.server_key) for flag in flags]
    started = _start_worker_process(tmp_path, checkpoint_dir, listen, *flags)
    assert started.returncode == 2, started.stdout + started.stderr
    assert "refusing" in started.stdout + started.stderr and "--insecure" in started.stdout + started.stderr
    assert not (tmp_path / "state").exists()  # refused before any sandbox was made


def test_insecure_is_the_operator_s_explicit_choice(checkpoints, checkpoint_dir, short_tmp):
    worker = start_worker(short_tmp, "open-worker", checkpoint_dir / "manifest.json", warm="base=0", args=["--insecure"])
    try:
        assert capacity(worker.channel).slots == 2
    finally:
        assert stop_worker(worker) == 0


def test_a_router_presents_its_own_token_to_its_workers_and_asks_one_of_its_clients(
    checkpoints, checkpoint_dir, short_tmp, token_file
):
    router_token = short_tmp / "router-token"
    router_token.write_text("the-router's-own\n")
    cluster = start_cluster(
        short_tmp,
        checkpoint_dir / "manifest.json",
        workers=1,
        warm="base=0",
        worker_args=[f"--token-file={token_file}"],
        router_args=[f"--worker-token-file={token_file}", f"--token-file={router_token}"],
        security=ClientSecurity(token="the-router's-own"),
    )
    try:
        assert refused_with(ClientSecurity().channel(cluster.address)) == grpc.StatusCode.UNAUTHENTICATED
        assert pb_grpc.WorkerStub(cluster.channel).RunJob(JOB, timeout=60).stdout == "ran\n"
    finally:
        cluster.stop()
