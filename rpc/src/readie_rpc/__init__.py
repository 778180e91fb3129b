"""readie's RPC layer: the ``readie.v1`` gRPC services over any runner (the worker's, a router's).

Public modules: ``stubs`` (the generated code of ``proto/``, ``pool.proto``
included, and the call payload bound), ``grpc_service`` (the Worker
service, serving any runner: a worker, or a router's placement),
``client`` (``WorkerClient``, the calling side, and its ``RemoteSession``
in ``remote_session``), ``security`` (TLS, mTLS and bearer tokens for
servers and clients) and ``testing`` (real worker processes and clusters
on loopback, a test PKI). It converts ``readie_policy``'s values and
imports nothing of the worker: the ``readie worker`` command that serves a
worker through it is ``readie_worker.cli``.
The wire conversions (``_convert``), the one error-to-status mapping
(``_status``), the Interact stream (``_interact``) and the host-function
messages (``_host_wire``) are private; a test checks that nothing outside
imports them.
"""
