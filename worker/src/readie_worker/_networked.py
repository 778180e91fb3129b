"""Networked sandboxes (issue 32, decision 36): each restored from its checkpoint into a network
namespace of its own, wired by its job's egress policy, which the sandbox owns until it is gone.

The checkpoints are the plain ones (captured with ``--network=none``): gVisor 20240729 takes the
interfaces from the namespace the restore spec names. A warm set of networked sandboxes per
checkpoint (:class:`WiredFactory`) is restored into namespaces wired to refuse everything; at
hand-out one nft batch gives the sandbox its job's rules (``SandboxNetwork.rerule``), so a
networked job costs what a warm one does plus that batch. One whose job needs mounts of its own
is restored for it, wired by its rules from the start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import structlog

from readie_policy.egress import Egress

from . import _netns
from .egress_net import EgressConfig, EgressGateway, NetRules, with_sandbox_network
from .grants import NO_GRANTS, HeldGrants
from .jobs import CodeJob
from .launchers import RunscCold, RunscRestore
from .runsc import Runsc
from .sandbox import Sandbox, SandboxFactory
from .warm import RefillBudget, SandboxObserver, WarmSandboxes

log = structlog.get_logger("readie.egress")

_L = TypeVar("_L", RunscRestore, RunscCold)
# ``allow_network: true`` with no ceiling at all: the public internet, never a denied address.
PUBLIC = Egress(public=True)
# A warm networked sandbox's rules until a job takes it: nothing allowed, every name refused.
CLOSED = NetRules()
# Warm networked sandboxes kept per checkpoint (none where the checkpoint keeps no warm ones): a
# networked job is rarer than a plain one, and a miss costs a restore, as for any warm set.
NETWORKED_WARM = 1


class NetworkedSandboxes:
    """The worker's egress (its gateway in ``egress_netns``) and the sandboxes it wires."""

    def __init__(self, netns: str, upstreams: tuple[str, ...] | None, runsc: Runsc, *, own: bool = False) -> None:
        config = EgressConfig(netns, own=own) if upstreams is None else EgressConfig(netns, upstreams, own=own)
        self.gateway = EgressGateway(config)
        self.runsc = with_sandbox_network(runsc)
        self.own: tuple = ()
        self.warm: dict[str, WarmSandboxes] = {}  # by checkpoint: restored and wired, refusing all

    def start(self) -> NetworkedSandboxes:
        # The worker's own addresses, as this process sees them: no sandbox reaches them unless
        # a ceiling names one alone (decision 35).
        self.own = tuple(_netns.addresses(None))
        self.gateway.start()
        log.info("egress open", netns=self.gateway.config.netns, upstreams=list(self.gateway.config.upstreams),
                 own_addresses=len(self.own))
        return self

    def rules(self, job: CodeJob) -> NetRules:
        return NetRules.of((job.egress or PUBLIC).for_worker(self.own))

    def sandbox(self, rules: NetRules, launcher: _L, make: Callable[[_L], Sandbox]) -> Sandbox:
        """``make(launcher)``, the launcher now restoring into a namespace wired by ``rules``;
        the sandbox owns the wiring (``Sandbox.network``), removed after the sandbox."""
        network = self.gateway.wire(rules)
        try:
            sandbox = make(dataclasses.replace(launcher, runsc=self.runsc, network_namespace=network.netns_path))
        except BaseException:
            network.discard()
            raise
        sandbox.network = network
        return sandbox

    def start_warm(
        self, factories: Mapping[str, SandboxFactory], targets: Mapping[str, int], budget: RefillBudget, *,
        warm_up: bool, observer: SandboxObserver,
    ) -> None:
        """A warm set of networked sandboxes for each checkpoint (sharing the worker's refill budget)."""
        for name, factory in factories.items():
            target = min(NETWORKED_WARM, targets.get(name, 0))
            self.warm[name] = WarmSandboxes(name, WiredFactory(factory, self), target, budget, warm_up=warm_up, observer=observer).start()

    def take(self, job: CodeJob) -> Sandbox:
        """A warm networked sandbox of ``job``'s checkpoint, given ``job``'s rules (one nft batch)."""
        sandbox = self.warm[job.checkpoint].take()
        try:
            assert sandbox.network is not None, "a warm networked sandbox has its wiring"
            sandbox.network.rerule(self.rules(job))
        except BaseException:
            sandbox.destroy()
            raise
        return sandbox

    def made_for(self, job: CodeJob, warm: WarmSandboxes, factory: SandboxFactory, grants: HeldGrants) -> Sandbox:
        """A sandbox restored for ``job`` alone (its own mounts), wired by its rules from the start."""
        return self.sandbox(self.rules(job), factory.primary, lambda primary: warm.made_for_a_job(
            grants, dataclasses.replace(factory, primary=primary, fallback=None)))

    def close(self) -> None:
        """Every warm networked sandbox (each removes its wiring), then the gateway."""
        try:
            for warm in self.warm.values():
                warm.close()
        finally:
            self.gateway.close()


@dataclass(frozen=True)
class WiredFactory:
    """``base``'s sandboxes, each restored into a namespace of its own wired to refuse everything
    (``CLOSED``) until a job takes it; no cold fallback (it would start without the network)."""

    base: SandboxFactory
    networked: NetworkedSandboxes

    def create(self, grants: HeldGrants = NO_GRANTS) -> Sandbox:
        return self.networked.sandbox(CLOSED, self.base.primary, lambda primary: dataclasses.replace(
            self.base, primary=primary, fallback=None).create(grants))
