"""readie's configuration and policy: what the operator fixed, read the same by every command.

Public modules: ``policy`` (a job's resolved limits and grants under the
operator's ceiling), ``egress`` (where a job's network may go: the
``allow_network`` destinations, their containment and the enforcement's
queries), ``config`` (``readie.toml``) and ``config_keys`` (its
one key table, from which the loader, the schema and docs/config.md come),
``cli_flags`` (flag values every command reads alike), ``locations`` (where
every command finds the checkpoints), ``logs`` (the one log schema),
``jobs`` (a job, a session step, their outcomes and the host-function and
output values every layer passes), ``runner`` (what runs them: the worker,
a worker's gRPC client, a router's placement) and ``testing``.
The worker, the gRPC layer, the pool, the router, the pipeline and the
client import these; this package imports only ``readie_protocol`` (and the
executor's standard-library wire rules), so none of them needs another's
internals to agree on a limit or a job.
"""
