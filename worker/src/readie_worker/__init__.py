"""readie worker: restores gVisor sandboxes from checkpoints and runs jobs in them.

Public modules, for the router, the client, the pipeline and operators:
``core`` (Worker, WorkerConfig), ``runner`` (what the worker, its client and the router all implement), ``jobs`` (CodeJob, JobOutcome, run_in_sandbox),
``sessions``, ``sandbox``, ``launchers`` and ``warm`` (one lifecycle, its launchers, warm sandboxes), ``runsc``,
``manifest``, ``bundle``, ``policy`` and ``config`` (the operator's ceiling),
``errors``, ``grpc_service`` and ``client`` (the Worker service and its
client), ``rpc`` (the generated gRPC code), ``remote_session``, ``security``,
``cancel``, ``grants``, ``paths``, ``packages``, ``network``, ``units``,
``logs``, ``stop_signal``, the ``cli`` and ``testing``. Modules whose names
start with ``_`` are private to this package (a test checks it).
"""

from ._mounts import enter_mount_namespace

__all__ = ["enter_mount_namespace"]
