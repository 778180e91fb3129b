"""Networked sandboxes (issue 32, decision 36): each restored from its checkpoint into a network
namespace of its own, wired by its job's egress policy, which the sandbox owns until it is gone.

The checkpoints are the plain ones (captured with ``--network=none``): gVisor 20240729 takes the
interfaces from the namespace the restore spec names, so a networked job pays a restore and its
wiring (~40 ms), never a cold start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import structlog

from readie_policy.egress import Egress

from . import _netns
from .egress_net import EgressConfig, EgressGateway, NetRules, SandboxNetwork, with_sandbox_network
from .errors import SandboxSetupError
from .jobs import CodeJob
from .launchers import RunscCold, RunscRestore
from .runsc import Runsc
from .sandbox import Sandbox

log = structlog.get_logger("readie.egress")

_L = TypeVar("_L", RunscRestore, RunscCold)
# ``allow_network: true`` with no ceiling at all: the public internet, never a denied address.
PUBLIC = Egress(public=True)


class NetworkedSandboxes:
    """The worker's egress (its gateway in ``egress_netns``) and the sandboxes it wires."""

    def __init__(self, netns: str, upstreams: tuple[str, ...] | None, runsc: Runsc) -> None:
        config = EgressConfig(netns) if upstreams is None else EgressConfig(netns, upstreams)
        self.gateway = EgressGateway(config)
        self.runsc = with_sandbox_network(runsc)
        self.own: tuple = ()

    def open(self) -> NetworkedSandboxes:
        # The worker's own addresses, as this process sees them: no sandbox reaches them unless
        # a ceiling names one alone (decision 35).
        self.own = tuple(_netns.addresses(None))
        self.gateway.open()
        log.info("egress open", netns=self.gateway.config.netns, upstreams=list(self.gateway.config.upstreams),
                 own_addresses=len(self.own))
        return self

    def rules(self, job: CodeJob) -> NetRules:
        return NetRules.of((job.egress or PUBLIC).for_worker(self.own))

    def sandbox(self, job: CodeJob, launcher: _L, make: Callable[[_L], Sandbox]) -> Sandbox:
        """``make(launcher)``, the launcher now restoring into a namespace wired by ``job``'s
        policy; the sandbox owns the wiring (``Sandbox.network``), removed after the sandbox."""
        network = self.gateway.wire(self.rules(job))
        try:
            sandbox = make(dataclasses.replace(launcher, runsc=self.runsc, network_namespace=network.netns_path))
        except BaseException:
            remove_quietly(network)
            raise
        sandbox.network = network
        return sandbox

    def close(self) -> None:
        self.gateway.close()


def remove_quietly(network: SandboxNetwork) -> None:
    """Remove ``network`` where a failure is not the caller's to hear (the gateway's sweep and
    close get what is left); logged."""
    try:
        network.remove()
    except SandboxSetupError as exc:
        log.error("sandbox network not removed", key=network.key, error=str(exc))


