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
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from readie_policy.locations import locate_checkpoints

from ._pool import Pool
from ._requests import PathArg

if TYPE_CHECKING:
    from readie_rpc.testing import Cluster

__all__ = ["LocalRouter", "find_checkpoints", "local_router", "temp_pool"]


def __getattr__(name: str) -> object:
    # LocalRouter was local_router's own class until the cluster launcher was
    # shared; kept as a name for it (address, router, workers, log_path all remain).
    if name == "LocalRouter":
        from readie_rpc.testing import Cluster

        return Cluster
    raise AttributeError(name)

def find_checkpoints(checkpoints: PathArg | None = None) -> Path:
    """The checkpoint manifest, found as every readie command finds it
    (:func:`readie_policy.locations.locate_checkpoints`): ``checkpoints`` (the
    manifest or its directory), else ``$READIE_CHECKPOINTS``, else
    ``./build/checkpoints``, else ``~/.cache/readie/checkpoints``.
    Raises ``CheckpointsNotFound`` naming where it looked."""
    return locate_checkpoints(checkpoints).manifest


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


@contextmanager
def local_router(
    workers: int = 2,
    *,
    checkpoints: PathArg | None = None,
    warm: str = "base=1",
    slots: int = 2,
    config: PathArg | None = None,
) -> Iterator[Cluster]:
    """``readie router`` in front of ``workers`` ``readie worker`` processes, all on loopback.

    ``config`` is the router's and workers' ``--config`` (their ceiling): by
    default one that grants paths under /tmp (``readie_rpc.testing.TEST_CEILING``);
    a network server without one grants nothing. Everything is stopped on exit
    (SIGTERM: a graceful drain) and must exit 0; workers must leave no sandbox behind.
    """
    from readie_rpc.testing import start_cluster

    # Short: sandbox socket paths under it may not exceed 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="rl-", dir="/tmp"))
    given = [f"--config={os.fspath(config)}"] if config is not None else []
    try:
        cluster = start_cluster(
            base, find_checkpoints(checkpoints), workers=workers, warm=warm, slots=slots,
            router_args=given, worker_args=given,
        )
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
