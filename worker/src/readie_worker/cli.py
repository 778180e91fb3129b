"""``readie worker``: serve one worker over gRPC (``readie_rpc.grpc_service``) until SIGTERM or SIGINT, then drain.

    readie worker --listen 127.0.0.1:50061 --warm base=2 --warm pandas=1 --log=json
    readie worker ... --egress-netns readie-egress --egress-dns 192.0.2.53   # networked jobs (decision 36)

A signal starts a graceful drain: health turns NOT_SERVING, new work is
refused with UNAVAILABLE, running jobs finish (up to --drain-grace), every
sandbox is destroyed, and the process exits 0. The checkpoints are found as
every readie command finds them (``readie_policy.locations``); where none
are, the worker serves cold starts only and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import structlog

from readie_worker.core import DEFAULT_DRAIN_GRACE_S, DEFAULT_MAX_SESSIONS, DEFAULT_SLOTS, SESSION_CHECKPOINTS, Worker, WorkerConfig
from readie_worker import enter_mount_namespace
from readie_policy.cli_flags import (
    LOG_CHOICES,
    duration_seconds,
    egress_dns,
    egress_netns,
    non_negative_int,
    positive_duration,
    positive_int,
)
from readie_protocol.errors import UnitError
from readie_protocol.units import format_size, parse_size
from readie_worker.errors import ConfigError, ReadieError
from readie_worker.session_store import DEFAULT_STORE_BYTES, DEFAULT_STORE_ENTRIES, DEFAULT_STORE_TTL_S
from readie_worker.sessions_cli import add_session_store_arguments
from readie_policy.locations import CheckpointsNotFound, default_checkpoints, locate_checkpoints
from readie_worker.manifest import MANIFEST_NAME
from readie_worker.metrics import Metrics, add_metrics_argument, serve_if_asked
from readie_rpc.grpc_service import DRAIN_NOTICE_S, serve
from readie_policy.logs import configure_logging
from readie_policy.config import Config, load_config
from readie_rpc.security import add_server_arguments, is_local_address, server_security
from readie_worker.stop_signal import StopSignal

log = structlog.get_logger("readie.worker")

DEFAULT_LISTEN = "127.0.0.1:50061"
# Refused flags and settings, as argparse exits for its own.
EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args((sys.argv[1:] if argv is None else argv)[1:])  # argv[0] is "worker"
    if args.egress_own_netns and args.egress_netns is None:
        parser.error("--egress-own-netns names the namespace --egress-netns gives; give it")  # exits 2
    configure_logging(json=args.log == "json", process="worker")
    try:
        enter_mount_namespace()  # before any thread: the sandboxes' mounts live there
    except ReadieError as exc:
        log.error("cannot start", error=str(exc))
        return 1
    try:
        manifest = _manifest(args.checkpoints)
    except ReadieError as exc:
        log.error("cannot start", error=str(exc))
        return 1
    config = WorkerConfig(
        manifest=manifest,
        state_dir=args.state_dir,  # None: a new one, removed at exit (readie_worker.state_dir)
        slots=args.slots,
        max_sessions=args.max_sessions,
        allow_unisolated=args.allow_unisolated,
        runsc=args.runsc,
        session_store=args.session_store,
        session_store_key=args.session_store_key,
        session_store_ttl_s=args.session_store_ttl,
        session_store_bytes=args.session_store_bytes,
        session_store_entries=args.session_store_entries,
        session_checkpoint=args.session_checkpoint,
        session_pause_s=args.session_pause,
        egress_netns=args.egress_netns,
        egress_dns=args.egress_dns,
        egress_own_netns=args.egress_own_netns,
        **({"warm": dict(args.warm)} if args.warm else {}),
    )
    return _serve(config, args, stop=StopSignal())


def _serve(config: WorkerConfig, args: argparse.Namespace, stop: StopSignal) -> int:
    try:
        security = server_security(args)
        security.check(args.listen)  # before any sandbox is made
        ceiling = load_config(args.config) if args.config is not None else Config()
    except ReadieError as exc:
        log.error("cannot serve", error=str(exc))
        return EXIT_USAGE
    if security.insecure and not is_local_address(args.listen):
        log.warning("serving unprotected beyond loopback (--insecure)", address=args.listen, **security.describe())
    config = egress_if_granted(config, ceiling)
    metrics = Metrics()
    try:
        worker = Worker(config, metrics=metrics).start()
    except ConfigError as exc:  # the state dir, the session store or its key refused
        log.error("worker did not start", error=str(exc))
        return EXIT_USAGE
    except ReadieError as exc:
        log.error("worker did not start", error=str(exc))
        return 1
    metrics.watch_worker(worker)
    try:
        serve_if_asked(metrics, args.metrics_listen)
        server = serve(worker, args.listen, name=args.name, security=security, config=ceiling, metrics=metrics)
    except (RuntimeError, OSError) as exc:  # grpc's way of saying it cannot bind; the metrics port's
        log.error("cannot listen", address=args.listen, metrics=args.metrics_listen, error=str(exc))
        worker.close()
        return 1
    stop.wait()
    server.drain(args.drain_grace, args.drain_notice)
    return 0


def egress_if_granted(config: WorkerConfig, ceiling: Config) -> WorkerConfig:
    """``config`` without its egress when the ceiling grants no request the network: no job
    could use the forwarding, the resolver and the warm networked sandboxes it would start."""
    if config.egress_netns is None or ceiling.network_limits.allow_network:
        return config
    log.info("egress not started: the ceiling grants no network ([pool.limits] allow_network)", egress_netns=config.egress_netns)
    return dataclasses.replace(config, egress_netns=None, egress_own_netns=False)


def _manifest(given: Path | None) -> Path:
    try:
        return locate_checkpoints(given).manifest
    except CheckpointsNotFound as exc:
        # A worker without checkpoints still serves, by cold starts (manifest's loading rules).
        log.warning("no checkpoints: cold starts only", reason=str(exc))
        if given is None:
            return default_checkpoints() / MANIFEST_NAME
        return given / MANIFEST_NAME if given.is_dir() else given


def _warm_spec(text: str) -> tuple[str, int]:
    name, _, count = text.partition("=")
    if not name or not count.isdigit():
        raise argparse.ArgumentTypeError(f"wants NAME=N, got {text!r}")
    return name, int(count)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except UnitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="readie worker", description="serve a readie worker over gRPC")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT", help="address to serve on (default %(default)s)")
    parser.add_argument(
        "--checkpoints", "--manifest", dest="checkpoints", type=Path, metavar="PATH",
        help="checkpoint manifest, or its directory (default: $READIE_CHECKPOINTS, else ./build/checkpoints "
        "if it holds one, else ~/.cache/readie/checkpoints; docs/pool.md)",
    )
    parser.add_argument(
        "--state-dir", type=Path, metavar="DIR",
        help="the worker's own dir for runsc's state, sandbox dirs and hibernated sessions; short, sockets live "
        "beneath it (default: a new dir under $XDG_RUNTIME_DIR/readie or ~/.cache/readie/run, removed at exit)",
    )
    parser.add_argument("--warm", type=_warm_spec, action="append", default=[], metavar="NAME=N", help="keep N sandboxes of checkpoint NAME ready (repeatable)")
    parser.add_argument("--slots", type=positive_int, default=DEFAULT_SLOTS, help="jobs run at once (default %(default)s)")
    parser.add_argument("--max-sessions", type=non_negative_int, default=DEFAULT_MAX_SESSIONS, help="sessions kept open at once, each holding a sandbox (default %(default)s)")
    parser.add_argument("--name", help="worker name reported by Capacity (default: HOST:PORT)")
    parser.add_argument("--runsc", default="runsc", metavar="BINARY", help="the runsc to run sandboxes with; its checkpoints must come from the same one (default: runsc on PATH)")
    parser.add_argument("--drain-grace", type=duration_seconds, default=DEFAULT_DRAIN_GRACE_S, metavar="DURATION", help="how long a drain lets running jobs finish, e.g. 30s (default %(default)s seconds)")
    parser.add_argument("--drain-notice", type=duration_seconds, default=DRAIN_NOTICE_S, metavar="DURATION", help="how long a drain answers NOT_SERVING before it closes the port, e.g. 5s (default %(default)s seconds)")
    parser.add_argument("--log", choices=LOG_CHOICES, default="console", help="log format on stderr (default %(default)s)")
    parser.add_argument("--allow-unisolated", action="store_true", help="DEVELOPMENT ONLY: without runsc, run jobs as plain host processes")
    parser.add_argument(
        "--config", type=Path, metavar="TOML", help="[pool.limits] and profiles for every job (without: nothing is granted)"
    )
    add_session_store_arguments(parser)
    parser.add_argument(
        "--session-store-ttl", type=positive_duration, default=DEFAULT_STORE_TTL_S, metavar="DURATION",
        help="a stored session nobody attaches for this long is removed, e.g. 24h (default %(default)s seconds)",
    )
    parser.add_argument(
        "--session-store-bytes", type=_size, default=DEFAULT_STORE_BYTES, metavar="SIZE",
        help=f"the store's images, every worker's, at most this big, e.g. 20g (default {format_size(DEFAULT_STORE_BYTES)})",
    )
    parser.add_argument(
        "--session-store-entries", type=positive_int, default=DEFAULT_STORE_ENTRIES, metavar="N",
        help="sessions the store keeps at most, every worker's (default %(default)s)",
    )
    parser.add_argument(
        "--session-checkpoint", choices=SESSION_CHECKPOINTS, default="off",
        help="step: write each session into the store after each step, in the background, so a crash loses "
        "at most the step in flight (~0.15 s of CPU a step; decision 32) (default %(default)s)",
    )
    parser.add_argument(
        "--session-pause", type=duration_seconds, default=WorkerConfig.session_pause_s, metavar="DURATION",
        help="a session idle this long with its sandbox quiet (no code of its own running) waits paused, "
        "taking no CPU, until its next request resumes it (about 0.5 ms); a thread it left sleeping on a "
        "timer waits too; 0: never (default %(default)s seconds; decision 33)",
    )
    parser.add_argument(
        "--egress-netns", type=egress_netns, metavar="NAME",
        help="the network namespace, made by the operator (ip netns add NAME), that stands for the outside "
        "world: every networked sandbox is wired into it; never the host's own, readie turns on ip_forward "
        "in it. Required for any job with the network (default: none, the network is refused; decision 36)",
    )
    parser.add_argument(
        "--egress-own-netns", action="store_true",
        help="--egress-netns names this worker's own network namespace: readie names it at start "
        "(ip netns attach) and drops the name at exit. For a container or pod whose own namespace is "
        "its way out (deploy/); never on a host, whose ip_forward readie would turn on",
    )
    parser.add_argument(
        "--egress-dns", type=egress_dns, metavar="IP[,IP...]",
        help="the upstream resolvers, IPv4, reached from the egress namespace, that readie's resolver asks "
        "for the names a job may reach (default: the host's /etc/resolv.conf)",
    )
    add_server_arguments(parser)
    add_metrics_argument(parser)
    return parser
