"""Helpers for tests, ours and yours, that run real sandboxes (they need runsc, root and checkpoints).

    from readie.testing import temp_pool

    def test_my_tool():
        with temp_pool() as pool:
            (pool.cwd / "data").mkdir()
            assert pool.run("print(1 + 1)").stdout == "2\\n"

    from readie.testing import local_router

    def test_my_remote_function():
        with local_router() as cluster, readie.Client(cluster.address) as client:
            assert client.call(len, "abc") == 3
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._pool import Pool
from ._requests import PathArg

__all__ = ["LocalRouter", "find_checkpoints", "local_router", "temp_pool"]

CHECKPOINTS_VARIABLE = "READIE_CHECKPOINTS"
MANIFEST = "manifest.json"
# What make capture writes, relative to the repository.
BUILD_CHECKPOINTS = Path("build") / "checkpoints" / MANIFEST
# Start-up is a manifest check and a sweep; the router's first probe follows at once.
ROUTER_START_TIMEOUT_S = 30.0
# A router with nothing in flight drains at once; workers wait for their calls.
STOP_TIMEOUT_S = 30.0


def find_checkpoints(checkpoints: PathArg | None = None) -> Path:
    """The checkpoint manifest: ``checkpoints`` (the manifest or its directory), else
    ``$READIE_CHECKPOINTS``, else ``build/checkpoints`` here or in a parent directory."""
    given = checkpoints if checkpoints is not None else os.environ.get(CHECKPOINTS_VARIABLE)
    if given:
        path = Path(given).absolute()
        manifest = path / MANIFEST if path.is_dir() else path
        if not manifest.is_file():
            raise FileNotFoundError(f"no checkpoint manifest at {manifest}")
        return manifest
    here = Path.cwd()
    for directory in (here, *here.parents):
        if (directory / BUILD_CHECKPOINTS).is_file():
            return directory / BUILD_CHECKPOINTS
    raise FileNotFoundError(
        f"no checkpoints: set {CHECKPOINTS_VARIABLE} or run make capture (it writes {BUILD_CHECKPOINTS})"
    )


@contextmanager
def temp_pool(workers: int = 1, *, checkpoints: PathArg | None = None, **options: Any) -> Iterator[Pool]:
    """A :class:`Pool` whose working directory (``pool.cwd``) is a new temp dir, removed afterwards.

    Closing it checks that the pool exited 0. ``options`` are :class:`Pool`'s.
    """
    project = Path(tempfile.mkdtemp(prefix="readie-project-"))
    try:
        with Pool(workers=workers, cwd=project, checkpoints=find_checkpoints(checkpoints), **options) as pool:
            yield pool
    finally:
        shutil.rmtree(project, ignore_errors=True)


@dataclass
class LocalRouter:
    address: str
    router: subprocess.Popen[bytes]
    workers: list[Any] = field(default_factory=list)  # readie_worker.testing.WorkerProcess
    log_path: Path | None = None


@contextmanager
def local_router(
    workers: int = 2, *, checkpoints: PathArg | None = None, warm: str = "base=1", slots: int = 2
) -> Iterator[LocalRouter]:
    """``readie router`` in front of ``workers`` ``readie worker`` processes, all on loopback.

    Everything is stopped on exit (SIGTERM: a graceful drain) and must exit 0;
    workers must leave no sandbox behind.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from readie_worker.testing import free_port, readie_command, start_worker, stop_worker

    manifest = find_checkpoints(checkpoints)
    # Short: sandbox socket paths under it may not exceed 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="rl-", dir="/tmp"))
    with ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, base, ignore_errors=True)
        started = []
        for index in range(workers):
            name = f"worker-{index + 1}"
            worker = start_worker(base / name, name, manifest, warm=warm, slots=slots)
            started.append(worker)
            cleanup.callback(_stop_worker, stop_worker, worker)
        port = free_port()
        log_path = base / "router.log"
        with open(log_path, "wb") as log:
            router = subprocess.Popen(
                [*readie_command(), "router", f"--listen=127.0.0.1:{port}", "--probe-interval=0.2",
                 *(f"--worker=127.0.0.1:{worker.port}" for worker in started)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        cleanup.callback(_stop_router, router, log_path)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        cleanup.callback(channel.close)
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while True:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            if router.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"router not serving:\n{log_path.read_text()}")
            time.sleep(0.1)
        yield LocalRouter(f"127.0.0.1:{port}", router, started, log_path)


def _stop_router(router: subprocess.Popen[bytes], log_path: Path) -> None:
    if router.poll() is None:
        router.terminate()
    try:
        status = router.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        router.kill()
        raise AssertionError(f"router did not drain:\n{log_path.read_text()[-2000:]}") from None
    if status != 0:
        raise AssertionError(f"router exited {status}:\n{log_path.read_text()[-2000:]}")


def _stop_worker(stop: Any, worker: Any) -> None:
    status = stop(worker)
    if status != 0:
        raise AssertionError(f"{worker.log_path.parent.name} exited {status}:\n{worker.log_path.read_text()[-2000:]}")
    leftovers = worker.containers()
    if leftovers:
        raise AssertionError(f"{worker.log_path.parent.name} left sandboxes behind: {leftovers}")
