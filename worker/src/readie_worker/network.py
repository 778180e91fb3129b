"""The network backend for jobs that ask for the network.

On this runsc, ``--network=sandbox`` cannot start in the root network
namespace and a checkpoint captured with ``--network=none`` cannot be
restored with ``host``. So a networked job is a cold start with
``--network=host`` run inside a network namespace the worker owns: the job
sees that namespace's interfaces only, never the host's loopback services
(the router, the worker's gRPC port). A fresh namespace has just ``lo``;
egress is the operator's choice, by adding a veth and routes to it
(``setup_command``), and is not readie's to grant implicitly.
"""

from __future__ import annotations

import secrets
import shlex
import subprocess
from dataclasses import dataclass

from .errors import SandboxSetupError
from .runsc import NETNS_DIR

BACKENDS = ("none", "netns")
# ip(8) answers in milliseconds; this only catches a wedged system.
IP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class NetworkNamespace:
    name: str

    @classmethod
    def create(cls, setup_command: str | None = None) -> NetworkNamespace:
        namespace = cls("readie-" + secrets.token_hex(4))
        _ip("netns", "add", namespace.name)
        try:
            _ip("-n", namespace.name, "link", "set", "lo", "up")
            if setup_command:
                _run(shlex.split(setup_command.replace("{netns}", namespace.name)))
        except BaseException:
            namespace.delete()
            raise
        return namespace

    @property
    def path(self) -> str:
        return str(NETNS_DIR / self.name)

    def delete(self) -> None:
        try:
            _ip("netns", "delete", self.name)
        except SandboxSetupError:
            pass


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(args: list[str]) -> None:
    try:
        completed = subprocess.run(args, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxSetupError(f"{' '.join(args)}: {exc}") from None
    if completed.returncode != 0:
        raise SandboxSetupError(f"{' '.join(args)} exited {completed.returncode}: {completed.stderr.strip()}")
