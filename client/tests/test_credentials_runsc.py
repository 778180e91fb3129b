"""The client library's credentials against a real ``readie router`` that asks for TLS and a token:
``readie.Client`` and ``readie.Pool(router=...)`` (and so ``readie pool --router-*``) pass them on."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import readie
from readie_rpc.security import ClientSecurity
from readie_rpc.testing import make_pki, start_cluster

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc


@pytest.fixture(scope="module")
def guarded():
    """A router with TLS (a CA made here) and a token, in front of one worker; yields (cluster, pki, token file)."""
    base = Path(tempfile.mkdtemp(prefix="cr-", dir="/tmp"))  # short: socket paths beneath it
    pki = make_pki(base / "pki")
    token = base / "token"
    token.write_text("client-library-token\n")
    cluster = start_cluster(
        base, Path(CHECKPOINTS) / "manifest.json", workers=1, warm="base=0",
        router_args=[f"--token-file={token}", f"--tls-cert={pki.server_cert}", f"--tls-key={pki.server_key}"],
        security=ClientSecurity.from_files(ca=pki.ca, token_file=token),
    )
    try:
        yield cluster, pki, token
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


def answer():
    return 41 + 1


def test_a_client_with_the_ca_and_token_is_served_and_one_without_the_token_is_told_why(guarded):
    cluster, pki, token = guarded
    with readie.Client(cluster.address, token_file=token, tls_ca=pki.ca) as client:
        assert client.call(answer) == 42
    with readie.Client(cluster.address, tls_ca=pki.ca) as client, pytest.raises(
        readie.PoolWorkerError, match=r"UNAUTHENTICATED.*Bearer"
    ):
        client.call(answer)


def test_a_pool_passes_its_router_credentials_on(guarded, tmp_path):
    cluster, pki, token = guarded
    with readie.Pool(router=cluster.address, token_file=token, tls_ca=pki.ca, cwd=tmp_path, checkpoints=CHECKPOINTS) as pool:
        assert pool.run("print('through TLS')").raise_for_error().stdout == "through TLS\n"
    # Without the token the pool does not start, and says what the router said.
    with pytest.raises(readie.PoolError, match=r"cannot reach the router.*UNAUTHENTICATED"):
        readie.Pool(router=cluster.address, tls_ca=pki.ca, cwd=tmp_path, checkpoints=CHECKPOINTS)
