"""The committed generated code is what proto/generate.py makes from proto/, and the check catches drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATOR = REPO / "proto" / "generate.py"
GENERATED = REPO / "rpc" / "src" / "readie_rpc" / "_proto"


def check(output: Path = GENERATED) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GENERATOR), "--check", "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_committed_generated_code_matches_the_proto_files():
    completed = check()
    assert completed.returncode == 0, completed.stderr


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    target = tmp_path / "_proto"
    shutil.copytree(GENERATED, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def test_the_check_fails_on_a_hand_edit_naming_the_file(copy: Path):
    stub = copy / "readie" / "v1" / "worker_pb2_grpc.py"
    stub.write_text(stub.read_text().replace("'/readie.v1.Worker/RunJob'", "'/readie.v1.Worker/RunJobs'"))
    completed = check(copy)
    assert completed.returncode == 1
    assert "changed: readie/v1/worker_pb2_grpc.py" in completed.stderr
    assert "RunJobs" in completed.stderr


def test_the_check_fails_on_a_missing_or_a_stray_file(copy: Path):
    (copy / "readie" / "v1" / "worker_pb2.pyi").unlink()
    (copy / "readie" / "v1" / "old_pb2.py").write_text("# from a removed .proto\n")
    completed = check(copy)
    assert completed.returncode == 1
    assert "missing: readie/v1/worker_pb2.pyi" in completed.stderr
    assert "readie/v1/old_pb2.py" in completed.stderr


def test_the_generated_modules_import_with_the_installed_runtimes():
    # worker_pb2 refuses a protobuf runtime older than its protoc, and
    # worker_pb2_grpc a grpcio older than its grpcio-tools: importing is the check.
    from readie_rpc._proto.readie.v1 import worker_pb2, worker_pb2_grpc

    service = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    assert worker_pb2.DESCRIPTOR.name == "readie/v1/worker.proto"
    assert [method.name for method in service.methods] == ["RunJob", "Execute", "Capacity", "Interact"]
    assert hasattr(worker_pb2_grpc, "WorkerServicer") and hasattr(worker_pb2_grpc, "WorkerStub")
