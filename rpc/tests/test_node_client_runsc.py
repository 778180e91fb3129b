"""readie's gRPC API from another language: Node's @grpc/grpc-js against a real ``readie worker``
with TLS (a CA made in the test) and a bearer token, loading the committed .proto files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from readie_rpc.security import ClientSecurity
from readie_rpc.testing import make_pki, start_worker, stop_worker

pytestmark = pytest.mark.runsc

NODE_DIR = Path(__file__).parent / "node"
PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"
TOKEN = "node-client-token"
# npm ci of two packages from the registry: seconds, once per lock file.
NPM_TIMEOUT_S = 300


def node_modules() -> Path:
    """The client's packages, installed once per package-lock.json in the cache (never the checkout)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        if os.environ.get("CI"):
            pytest.fail("node and npm are not installed (make setup installs them)")
        pytest.skip("node and npm are not installed")
    lock = (NODE_DIR / "package-lock.json").read_bytes()
    cache = Path(os.environ.get("READIE_CACHE") or Path.home() / ".cache" / "readie")
    home = cache / "node" / hashlib.sha256(lock).hexdigest()[:16]
    if not (home / "node_modules" / ".package-lock.json").exists():
        home.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy(NODE_DIR / name, home / name)
        subprocess.run(
            ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
            cwd=home, check=True, capture_output=True, timeout=NPM_TIMEOUT_S,
        )
    shutil.copy(NODE_DIR / "client.mjs", home / "client.mjs")
    return home


def test_a_node_client_speaks_tls_tokens_and_readies_metadata(checkpoints, checkpoint_dir, short_tmp):
    home = node_modules()
    pki = make_pki(short_tmp / "pki")
    token = short_tmp / "token"
    token.write_text(TOKEN)
    worker = start_worker(
        short_tmp / "worker",
        "node-target",
        checkpoint_dir / "manifest.json",
        warm="base=1",
        args=[f"--tls-cert={pki.server_cert}", f"--tls-key={pki.server_key}", f"--token-file={token}"],
        security=ClientSecurity.from_files(ca=pki.ca, token_file=token),
    )
    try:
        ran = subprocess.run(
            ["node", str(home / "client.mjs"), f"localhost:{worker.port}", str(PROTO_DIR), str(pki.ca), TOKEN],
            capture_output=True, text=True, timeout=60,
        )
        assert ran.returncode == 0, ran.stderr
        checks = json.loads(ran.stdout.splitlines()[-1])
    finally:
        assert stop_worker(worker) == 0
    assert checks["capacity"] == {"slots": 2}
    assert checks["run"] == {"exit": 0, "stdout": "42\n"}
    assert checks["refused"] == {"code": "INVALID_ARGUMENT", "error": "RequestError", "field": "allow_read"}
    assert checks["unauthenticated"]["code"] == "UNAUTHENTICATED"
