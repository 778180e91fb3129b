"""``readie router``: the gRPC front end that places jobs on ``readie worker`` processes.

    readie router --listen 127.0.0.1:50060 --worker 127.0.0.1:50061 --worker 127.0.0.1:50062
    readie router --listen 0.0.0.0:50060 --worker-dns readie-workers.readie.svc.cluster.local:50061

Workers are named by ``--worker``, or found by ``--worker-dns NAME:PORT``:
every address the name resolves to, re-resolved every ``--dns-interval``,
so workers behind a Kubernetes headless Service come and go (``_discovery``).

It serves the same ``readie.v1.Worker`` API as a worker (so a client needs
to know only one), plus health and reflection, and places each call on the
least loaded healthy worker (see ``_placement``). SIGTERM or SIGINT drains:
health turns NOT_SERVING, new calls are refused as not started (a client
sends them to its next router), running calls finish, sessions with a key
are handed over (their clients re-attach elsewhere, decision 32), the
process exits 0.

Only ``Pool.Session`` needs the checkpoints' manifest (the ready event names
the checkpoint and its Python); it is found as every readie command finds it
(``readie_policy.locations``), and where none is found the router serves
without ``Pool.Session`` and says so.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import structlog

from readie_rpc.stubs import pool_pb2_grpc
from readie_policy.cli_flags import LOG_CHOICES, duration_seconds, non_negative_int, positive_duration
from readie_worker.errors import ReadieError
from readie_policy.locations import CHECKPOINTS_VARIABLE, CheckpointsNotFound, locate_checkpoints
from readie_rpc.grpc_service import DRAIN_NOTICE_S, serve
from readie_policy.logs import configure_logging
from readie_worker.metrics import Metrics, add_metrics_argument, serve_if_asked
from readie_rpc.security import add_client_arguments, add_server_arguments, client_security, server_security
from readie_worker.stop_signal import StopSignal

from readie_pool import choose_checkpoint
from readie_policy.config import Config, load_config
from readie_worker.errors import ConfigError
from ._discovery import DEFAULT_DNS_INTERVAL_S, Discovery, dns_name
from readie_protocol.events import RuntimeInfo
from ._placement import DEFAULT_ROUTER_SESSIONS, PROBE_INTERVAL_S, Placement
from readie_pool import PoolSetup
from ._pool_service import MAX_POOL_STREAMS, POOL_SERVICE, PoolServicer

log = structlog.get_logger("readie.router")

DEFAULT_LISTEN = "127.0.0.1:50060"
DEFAULT_DRAIN_GRACE_S = 30.0
# Each in-flight call holds a server thread while its worker runs it; this
# bounds the calls a router forwards at once (workers bound their own slots).
ROUTER_THREADS = 64
# Jobs with host functions in flight through the router at once (each an
# Interact stream to its worker); sessions' streams come on top.
ROUTER_JOB_STREAMS = 32


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args((sys.argv[1:] if argv is None else argv)[1:])  # argv[0] is "router"
    configure_logging(json=args.log == "json", process="router")
    if not args.worker and not args.worker_dns:
        log.error("no workers: pass --worker HOST:PORT or --worker-dns NAME:PORT at least once")
        return 2
    stop = StopSignal()
    try:
        security = server_security(args)
        security.check(args.listen)
        to_workers = client_security(args, "worker")
        config = _config(args)
        setup = _pool_setup(args, config)
    except ReadieError as exc:
        log.error("cannot serve", error=str(exc))
        return 2
    metrics = Metrics()  # the router's gRPC calls and placement; its workers export their own
    placement = Placement(
        args.worker,
        probe_interval_s=args.probe_interval,
        max_sessions=args.max_sessions,
        security=to_workers,
        discovery=Discovery(args.worker_dns) if args.worker_dns else None,
        dns_interval_s=args.dns_interval,
        metrics=metrics,
    ).start()
    metrics.watch_router(placement.discovered_workers)
    extra_services = []
    if setup is not None:
        servicer = PoolServicer(setup, placement, metrics)
        extra_services.append((POOL_SERVICE, lambda server: pool_pb2_grpc.add_PoolServicer_to_server(servicer, server)))
    try:
        serve_if_asked(metrics, args.metrics_listen)
        server = serve(
            placement,  # type: ignore[arg-type]  # a Placement has the Worker's shape
            args.listen,
            name=args.name or f"router:{args.listen}",
            # A session's stream holds a thread for its life; so does a job with host functions while it runs.
            max_streams=args.max_sessions + ROUTER_JOB_STREAMS,
            threads=ROUTER_THREADS + args.max_sessions + ROUTER_JOB_STREAMS + (MAX_POOL_STREAMS if setup is not None else 0),
            extra_services=extra_services,
            security=security,
            config=config,
            metrics=metrics,
        )
    except (RuntimeError, OSError) as exc:  # grpc's way of saying it cannot bind; the metrics port's
        log.error("cannot listen", address=args.listen, metrics=args.metrics_listen, error=str(exc))
        placement.close()
        return 1
    log.info("router serving", address=server.address, workers=list(args.worker), worker_dns=[str(n) for n in args.worker_dns])
    stop.wait()
    server.drain(args.drain_grace, args.drain_notice)
    return 0


def _config(args: argparse.Namespace) -> Config:
    try:
        config = load_config(args.config) if args.config is not None else Config()
    except ConfigError as exc:
        raise ReadieError(str(exc)) from None
    # Everything here comes over the network: without [pool.limits] it is granted nothing.
    return replace(config, limits=config.network_limits)


def _pool_setup(args: argparse.Namespace, config: Config) -> PoolSetup | None:
    """What every Pool.Session of this router runs with (operator settings, never the wire's);
    None, with a warning, when no checkpoints were named and none were found."""
    cwd = Path(os.path.realpath(os.getcwd()))
    try:
        located = locate_checkpoints(args.checkpoints, cwd=cwd)
    except CheckpointsNotFound as exc:
        if args.checkpoints is not None or os.environ.get(CHECKPOINTS_VARIABLE):
            raise
        log.warning("no checkpoints: serving without Pool.Session", reason=str(exc))
        return None
    manifest, checkpoint = choose_checkpoint(located.manifest, tuple(args.preload.split(",")) if args.preload else ())
    return PoolSetup(
        workers=args.session_workers,
        checkpoint=checkpoint.name,
        runtime=RuntimeInfo.pool(manifest.python, checkpoint.preimport),
        cwd=cwd,
        config=config,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="readie router", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help="host:port to serve on")
    parser.add_argument("--worker", action="append", default=[], metavar="HOST:PORT", help="a worker to place jobs on")
    parser.add_argument(
        "--worker-dns", action="append", default=[], type=dns_name, metavar="NAME:PORT",
        help="place jobs on every address NAME resolves to (e.g. a Kubernetes headless Service), re-resolved "
        "every --dns-interval; repeatable, and may be combined with --worker",
    )
    parser.add_argument(
        "--dns-interval", type=positive_duration, default=DEFAULT_DNS_INTERVAL_S, metavar="DURATION",
        help="time between resolutions of --worker-dns, e.g. 5s (default %(default)s seconds)",
    )
    parser.add_argument("--name", default=None, help="what Capacity reports as this router's name")
    parser.add_argument("--probe-interval", type=duration_seconds, default=PROBE_INTERVAL_S, metavar="DURATION", help="time between worker probes, e.g. 1s or 200ms (default %(default)s seconds)")
    parser.add_argument("--drain-grace", type=duration_seconds, default=DEFAULT_DRAIN_GRACE_S, metavar="DURATION", help="how long running calls get on SIGTERM, e.g. 30s (default %(default)s seconds)")
    parser.add_argument(
        "--drain-notice", type=duration_seconds, default=DRAIN_NOTICE_S, metavar="DURATION",
        help="how long a drain answers NOT_SERVING before it closes the port, e.g. 2s (default %(default)s seconds)",
    )
    parser.add_argument("--log", choices=LOG_CHOICES, default="console", help="log format on stderr (default %(default)s)")
    parser.add_argument(
        "--config", type=Path, default=None, help="[pool.limits] and profiles for every job and session (without: nothing is granted)"
    )
    parser.add_argument(
        "--checkpoints", metavar="PATH",
        help="the workers' checkpoint manifest, or its directory, for Pool.Session (default: $READIE_CHECKPOINTS, "
        "else ./build/checkpoints if it holds one, else ~/.cache/readie/checkpoints; without any: no Pool.Session)",
    )
    parser.add_argument("--preload", default="", help="the checkpoint Pool sessions use, by its pre-imports (a,b)")
    parser.add_argument("--max-sessions", type=non_negative_int, default=DEFAULT_ROUTER_SESSIONS, help="sessions kept open at once across the workers")
    parser.add_argument("--session-workers", type=int, default=4, help="jobs one Pool session runs at once")
    add_server_arguments(parser)
    add_metrics_argument(parser)
    add_client_arguments(parser, "worker", "the workers")
    return parser
