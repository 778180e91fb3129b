"""readie's RPC layer: the ``readie.v1`` gRPC services over the worker.

Public modules: ``stubs`` (the generated code of ``proto/``, ``pool.proto``
included, and the call payload bound), ``grpc_service`` (the Worker
service, serving any runner: a worker, or a router's placement),
``client`` (``WorkerClient``, the calling side, and its ``RemoteSession``
in ``remote_session``), ``security`` (TLS, mTLS and bearer tokens for
servers and clients), the ``readie worker`` command (``cli``) and
``testing`` (real worker processes and clusters on loopback, a test PKI).
The wire conversions (``_convert``), the one error-to-status mapping
(``_status``), the Interact stream (``_interact``) and the host-function
messages (``_host_wire``) are private; a test checks that nothing outside
imports them.
"""
