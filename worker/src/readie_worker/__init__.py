"""readie worker: restores gVisor sandboxes from checkpoints and runs jobs in them.

Public modules, for the RPC layer (``readie_rpc``), the router, the client,
the pipeline and operators: ``core`` (Worker, WorkerConfig), ``runner``
(what the worker, its gRPC client and the router all implement), ``jobs``
(CodeJob, Step, JobOutcome, run_in_sandbox), ``sessions``, ``sandbox``,
``launchers`` and ``warm`` (one lifecycle, its launchers, warm sandboxes),
``runsc``, ``manifest``, ``bundle``, ``policy`` and ``config`` (the
operator's ceiling), ``errors``, ``cancel``, ``grants``, ``paths``,
``packages``, ``network``, ``units``, ``logs``, ``stop_signal``,
``locations`` (where every command finds the checkpoints), ``cli_flags``
(flag values every command reads alike) and ``testing``. No gRPC here: the services, their client and the ``readie
worker`` command are ``readie_rpc``'s. Modules whose names start with ``_``
are private to this package (a test checks it).
"""

from ._mounts import enter_mount_namespace

__all__ = ["enter_mount_namespace"]
