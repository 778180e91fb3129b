"""Who may call a worker or a router, and how calls are protected: TLS, mTLS, a bearer token.

With grpcio's own credentials throughout. A server (``readie worker``,
``readie router``) takes:

* ``--tls-cert`` and ``--tls-key``: serve TLS;
* ``--tls-client-ca``: also require a client certificate that chains to it (mTLS);
* ``--token-file``: require ``authorization: Bearer <token>`` on every call,
  compared in constant time (health checks are exempt, so a load balancer or
  a Kubernetes probe needs no secret; they reveal only SERVING or not);
* ``--insecure``: allow what is refused otherwise.

Refused at start unless ``--insecure``: plaintext on anything but a loopback
address or a Unix socket, and, beyond loopback, no client authentication at
all (neither a token nor mTLS). A network entry point grants nothing until
the operator configures it (the ceiling, ``policy.network_limits``); this is
the part that decides who may ask.

A client (``WorkerClient``, the router's hop to its workers, ``readie pool
--router``, ``readie.Pool(router=...)``) takes the same pieces from the other
side: the CA that signed the server's certificate, its own certificate and key
for mTLS, and the token.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from readie_protocol.errors import ReadieError
from readie_policy.operator_files import read_regular

__all__ = [
    "AUTHORIZATION_KEY",
    "ClientSecurity",
    "SecurityError",
    "ServerSecurity",
    "add_client_arguments",
    "add_server_arguments",
    "client_security",
    "is_local_address",
    "server_security",
]

AUTHORIZATION_KEY = "authorization"
# Anything longer is not a token someone typed or generated; the bound keeps a
# hostile header from costing a comparison of megabytes.
MAX_TOKEN_BYTES = 4096
# A PEM certificate chain or key: a few KiB; a megabyte is no credential.
MAX_CREDENTIAL_BYTES = 1024 * 1024
# Calls that need no token: a load balancer's or an orchestrator's probe.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


class SecurityError(ReadieError):
    """The security settings cannot be used: a missing file, a refused combination."""


def is_local_address(address: str) -> bool:
    """Whether ``address`` ("host:port", "[v6]:port", "unix:path") is reachable only from this host."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(path: Path) -> str:
    try:
        # Regular files only, checked before a byte is read: a FIFO named here would hang the start.
        token = read_regular(path, MAX_TOKEN_BYTES + 2).decode("utf-8", "replace").strip()
    except OSError as exc:
        raise SecurityError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    if not token or len(token.encode()) > MAX_TOKEN_BYTES or any(c.isspace() or not c.isprintable() for c in token):
        raise SecurityError(f"{path}: a token is 1-{MAX_TOKEN_BYTES} printable characters without spaces")
    return token


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return read_regular(path, MAX_CREDENTIAL_BYTES)
    except OSError as exc:
        raise SecurityError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class ServerSecurity:
    """How a server protects its calls; the default is plaintext without a token (loopback only)."""

    cert: bytes | None = None  # PEM, the server's chain
    key: bytes | None = None
    client_ca: bytes | None = None  # mTLS: clients present a certificate this CA signed
    token: str | None = None
    insecure: bool = False

    @classmethod
    def from_files(
        cls,
        *,
        cert: Path | None = None,
        key: Path | None = None,
        client_ca: Path | None = None,
        token_file: Path | None = None,
        insecure: bool = False,
    ) -> ServerSecurity:
        if (cert is None) != (key is None):
            raise SecurityError("--tls-cert and --tls-key go together")
        if client_ca is not None and cert is None:
            raise SecurityError("--tls-client-ca needs --tls-cert and --tls-key: mTLS is TLS")
        return cls(
            cert=_read(cert, "TLS certificate"),
            key=_read(key, "TLS key"),
            client_ca=_read(client_ca, "client CA"),
            token=None if token_file is None else read_token(token_file),
            insecure=insecure,
        )

    @property
    def tls(self) -> bool:
        return self.cert is not None

    def check(self, address: str) -> None:
        """Refuse to serve ``address`` unprotected unless the operator said ``insecure``."""
        if self.insecure or is_local_address(address):
            return
        if not self.tls:
            raise SecurityError(
                f"refusing plaintext on {address}, which is not a loopback address: pass --tls-cert and "
                "--tls-key (and --token-file or --tls-client-ca), or --insecure to serve it unprotected"
            )
        if self.token is None and self.client_ca is None:
            raise SecurityError(
                f"refusing to serve {address} to anyone who can reach it: pass --token-file or "
                "--tls-client-ca, or --insecure"
            )

    def add_port(self, server: grpc.Server, address: str) -> int:
        if not self.tls:
            return server.add_insecure_port(address)
        assert self.key is not None and self.cert is not None
        credentials = grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )
        return server.add_secure_port(address, credentials)

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [] if self.token is None else [_TokenCheck(self.token)]

    def describe(self) -> dict[str, object]:
        """For the start-up log line: what protects the port, never the secrets."""
        return {"tls": self.tls, "mtls": self.client_ca is not None, "token": self.token is not None, "insecure": self.insecure}


class _TokenCheck(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method in OPEN_METHODS:  # type: ignore[attr-defined]
            return handler
        for key, value in details.invocation_metadata or ():  # type: ignore[attr-defined]
            if key == AUTHORIZATION_KEY and isinstance(value, str) and len(value) <= MAX_TOKEN_BYTES + 16:
                if hmac.compare_digest(value.encode(), self._expected):
                    return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler that ends the call UNAUTHENTICATED without reading its request.

    Streaming requests, whatever ``handler``'s kind: grpc reads a unary call's request before it
    calls its handler, on a server thread, waiting as long as the caller keeps the call open. A
    caller without the token that never sends its request would hold that thread, and enough of
    them every thread. A streaming handler is called at once, and this one reads nothing.
    """

    def refuse(requests: Any, context: grpc.ServicerContext) -> Any:
        context.set_trailing_metadata((("readie-error", "Unauthenticated"),))
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid 'authorization: Bearer <token>' is required")

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.stream_unary_rpc_method_handler(refuse)


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a server: plaintext, or TLS against ``ca``; a token; mTLS."""

    ca: bytes | None = None  # PEM of the CA that signed the server's certificate; None: plaintext
    cert: bytes | None = None  # mTLS: this client's chain and key
    key: bytes | None = None
    token: str | None = None
    server_name: str | None = None  # the name the server's certificate must carry, if not the address's

    @classmethod
    def from_files(
        cls,
        *,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        token_file: Path | None = None,
        server_name: str | None = None,
    ) -> ClientSecurity:
        if (cert is None) != (key is None):
            raise SecurityError("a client certificate and its key go together")
        if cert is not None and ca is None:
            raise SecurityError("a client certificate is for TLS: give the server's CA too")
        return cls(
            ca=_read(ca, "TLS CA"),
            cert=_read(cert, "client certificate"),
            key=_read(key, "client key"),
            token=None if token_file is None else read_token(token_file),
            server_name=server_name,
        )

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        options = list(options)
        if self.ca is None:
            channel = grpc.insecure_channel(address, options=options)
        else:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
            )
            if self.server_name is not None:
                options.append(("grpc.ssl_target_name_override", self.server_name))
            channel = grpc.secure_channel(address, credentials, options=options)
        if self.token is None:
            return channel
        return grpc.intercept_channel(channel, _BearerToken(self.token))


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call: works on plaintext loopback channels too, where grpc
    refuses call credentials."""

    def __init__(self, token: str) -> None:
        self._header = (AUTHORIZATION_KEY, f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), self._header),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), requests)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


# --------------------------------------------------------------------------- command lines


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a server's own port (``readie worker``, ``readie router``)."""
    group = parser.add_argument_group("security of the listening port")
    group.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve TLS with this certificate chain")
    group.add_argument("--tls-key", type=Path, metavar="PEM", help="the key of --tls-cert")
    group.add_argument("--tls-client-ca", type=Path, metavar="PEM", help="mTLS: require client certificates this CA signed")
    group.add_argument("--token-file", type=Path, metavar="FILE", help="require 'authorization: Bearer <the file's token>'")
    group.add_argument(
        "--insecure", action="store_true", help="allow plaintext, or no client authentication, beyond loopback"
    )


def server_security(args: argparse.Namespace) -> ServerSecurity:
    return ServerSecurity.from_files(
        cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca, token_file=args.token_file, insecure=args.insecure
    )


def add_client_arguments(parser: argparse.ArgumentParser, prefix: str, whom: str) -> None:
    """The flags of a connection to ``whom`` (``--{prefix}-tls-ca`` and so on)."""
    group = parser.add_argument_group(f"security of the connection to {whom}")
    group.add_argument(f"--{prefix}-tls-ca", type=Path, metavar="PEM", help=f"use TLS; {whom} presents a certificate this CA signed")
    group.add_argument(f"--{prefix}-tls-cert", type=Path, metavar="PEM", help=f"mTLS: the certificate to present to {whom}")
    group.add_argument(f"--{prefix}-tls-key", type=Path, metavar="PEM", help=f"the key of --{prefix}-tls-cert")
    group.add_argument(f"--{prefix}-token-file", type=Path, metavar="FILE", help=f"the bearer token {whom} requires")
    group.add_argument(f"--{prefix}-tls-server-name", metavar="NAME", help="the name its certificate carries, if not the address's")


def client_security(args: argparse.Namespace, prefix: str) -> ClientSecurity:
    key = prefix.replace("-", "_")
    return ClientSecurity.from_files(
        ca=getattr(args, f"{key}_tls_ca"),
        cert=getattr(args, f"{key}_tls_cert"),
        key=getattr(args, f"{key}_tls_key"),
        token_file=getattr(args, f"{key}_token_file"),
        server_name=getattr(args, f"{key}_tls_server_name"),
    )

