"""readie worker: restores gVisor sandboxes from checkpoints and runs jobs in them.

Public modules, for the RPC layer (``readie_rpc``), the pool, the router,
the pipeline and operators: ``core`` (Worker, WorkerConfig), ``runner``
(what the worker, its gRPC client and the router all implement), ``jobs``
(CodeJob, Step, JobOutcome, run_in_sandbox), ``sessions``, ``hibernation``,
``sandbox``, ``launchers`` and ``warm`` (one lifecycle, its launchers, warm
sandboxes), ``runsc``, ``manifest``, ``bundle``, ``errors``, ``cancel``,
``grants``, ``paths``, ``packages``, ``network``, ``written``, ``metrics``,
``stop_signal`` and ``testing``. The operator's configuration and policy are
``readie_policy``'s; no gRPC here: the services, their client and the
``readie worker`` command are ``readie_rpc``'s. Modules whose names start
with ``_`` are private to this package (a test checks it).
"""

from ._mounts import enter_mount_namespace

__all__ = ["enter_mount_namespace"]
