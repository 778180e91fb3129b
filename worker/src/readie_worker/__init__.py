"""readie worker: restores gVisor sandboxes from checkpoints and runs jobs in them.

Public modules, for the RPC layer (``readie_rpc``), the pool, the router,
the pipeline and operators: ``core`` (Worker, WorkerConfig), ``jobs``
(run_in_sandbox; it names the values of ``readie_policy.jobs``: CodeJob,
Step, JobOutcome), ``sessions``, ``hibernation``,
``sandbox``, ``launchers`` and ``warm`` (one lifecycle, its launchers, warm
sandboxes), ``runsc``, ``manifest``, ``bundle``, ``errors``,
``grants``, ``paths``, ``packages``, ``network``, ``written``, ``metrics``,
``stop_signal``, ``testing`` and ``cli`` (``readie worker``). The
operator's configuration and policy are ``readie_policy``'s; no gRPC here
but in ``cli``, which serves the worker through ``readie_rpc``'s service. Modules whose names start
with ``_`` are private to this package (a test checks it).
"""

from ._mounts import enter_mount_namespace

__all__ = ["enter_mount_namespace"]
