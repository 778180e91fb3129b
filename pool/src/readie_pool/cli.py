"""``readie pool``: the pool JSONL protocol on stdin and stdout, jobs in gVisor sandboxes.

    readie pool --workers=2 [--preload=pandas,numpy] [--package-dir=DIR] [--config=readie.toml]
                [--log=json] [--checkpoints=DIR] [--state-dir=DIR]
                [--max-sessions=16] [--session-idle=10m] [--session-pause=10s] [--router=HOST:PORT ...]
                [--session-store=DIR --session-store-key=FILE] [--session-checkpoint=off|step]
                [--egress-netns=NAME] [--egress-dns=IP[,IP...]]   # the network's way out (decision 36)
                [--metrics-listen=HOST:PORT]   # Prometheus /metrics, off by default (docs/operations.md)

The first stdout line is the ready event; then one result per request, in
completion order. EOF on stdin, SIGTERM or SIGINT drain the pool: accepted
jobs finish, their results are written, every sandbox is destroyed and the
process exits 0. A second signal stops running jobs. With a session store
(or through a router) a signal detaches the open sessions into the store
instead of closing them, so a later pool attaches to them by key (decision
32); EOF still closes them. See docs/pool.md.

Start-up failures (a bad flag or config, no checkpoint for the preload set,
no runsc) are reported on stderr before any ready event: exit 2 for usage
and configuration, 1 for everything else.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import structlog
from readie_worker import enter_mount_namespace
from readie_rpc.client import ROUTER_RETRY_S, WorkerClient
from readie_worker.core import WorkerConfig
from readie_worker.errors import ReadieError, SandboxSetupError
from readie_policy.logs import configure_logging
from readie_worker.metrics import Metrics, add_metrics_argument, serve_if_asked
from readie_rpc.security import ClientSecurity, add_client_arguments, client_security

from ._backend import JobBackend, LocalWorkerBackend, ThreadedBackend, choose_checkpoint
from readie_policy.cli_flags import comma_separated
from readie_policy.config import CliOverrides, Config, apply_cli, load_config
from readie_policy.config_keys import SESSION_CHECKPOINTS
from readie_worker.errors import ConfigError
from readie_policy.locations import CHECKPOINTS_VARIABLE, locate_checkpoints
from ._events import RuntimeInfo
from ._engine import PoolEngine, PoolSetup
from ._stdio import FdReader, FdWriter
from .reference import config_schema_json, schema_json

__all__ = ["main"]

log = structlog.get_logger("readie.pool")

#: The pool's state dir when --state-dir is not given (readie_worker.state_dir).
STATE_DIR_VARIABLE = "READIE_STATE_DIR"
# A router answers Capacity from memory; seconds mean it is not there.
ROUTER_PROBE_TIMEOUT_S = 5.0
EXIT_USAGE = 2
EXIT_FAILED = 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args((sys.argv[1:] if argv is None else argv)[1:])  # argv[0] is "pool"
    if args.schema:  # what a client may write and will read, from the code's one definition
        sys.stdout.write(schema_json())
        return 0
    if args.config_schema:  # what --config may hold, from the loader's key table
        sys.stdout.write(config_schema_json())
        return 0
    configure_logging(json=args.log == "json", process="pool")
    try:
        enter_mount_namespace()  # before any thread: an embedded worker's mounts live there
    except ReadieError as exc:
        _fail(str(exc))
        return EXIT_USAGE
    try:
        cwd = Path(os.path.realpath(os.getcwd()))
        config = load_config(args.config) if args.config is not None else Config()
        overrides = CliOverrides(
            workers=args.workers,
            preload=args.preload,
            package_dirs=tuple(args.package_dir) if args.package_dir else None,
            log=args.log,
            max_sessions=args.max_sessions,
            session_idle=args.session_idle,
            session_hibernate=args.session_hibernate,
            session_pause=args.session_pause,
            session_store=args.session_store,
            session_store_key=args.session_store_key,
            session_checkpoint=args.session_checkpoint,
            egress_netns=args.egress_netns,
            egress_dns=args.egress_dns,
        )
        settings = apply_cli(config.pool, overrides, cwd=cwd)
    except ConfigError as exc:
        _fail(str(exc))
        return EXIT_USAGE
    _configure_logging(json=settings.log == "json")
    try:
        located = locate_checkpoints(args.checkpoints, cwd=cwd)
        manifest, checkpoint = choose_checkpoint(located.manifest, settings.preload)
        _check_package_dirs(settings.package_dirs, manifest.mount_plan.package_slots)
    except ReadieError as exc:
        _fail(str(exc))
        return EXIT_FAILED
    setup = PoolSetup(
        workers=settings.workers,
        checkpoint=checkpoint.name,
        runtime=RuntimeInfo.pool(manifest.python, checkpoint.preimport),
        cwd=cwd,
        config=config,
        package_dirs=settings.package_dirs,
        log_jobs=settings.log == "json",
        max_sessions=settings.max_sessions,
        session_idle_ms=settings.session_idle_ms,
        session_hibernate_ms=settings.session_hibernate_ms,
    )
    try:
        router_security = client_security(args, "router")
    except ReadieError as exc:
        _fail(str(exc))
        return EXIT_USAGE
    state_dir = args.state_dir or os.environ.get(STATE_DIR_VARIABLE)
    worker_config = WorkerConfig(
        manifest=located.manifest,
        state_dir=Path(state_dir) if state_dir else None,  # None: a new one, removed at exit
        warm={checkpoint.name: settings.workers},
        slots=settings.workers,
        # The pool's table bounds its sessions (forks included); its worker must keep as many, and
        # as many again being closed: a name leaves the table when its close is read, its sandbox
        # a moment later.
        max_sessions=2 * settings.max_sessions,
        # Decision 32: where its sessions outlive the pool, and when each is written there.
        session_store=settings.session_store,
        session_store_key=settings.session_store_key,
        session_checkpoint=settings.session_checkpoint,
        session_pause_s=settings.session_pause_ms / 1000,
        # Decision 36: where networked sandboxes are wired, and the resolvers behind readie's own.
        egress_netns=settings.egress_netns,
        egress_dns=settings.egress_dns,
    )
    # The protocol owns descriptors 0 and 1; anything else that writes to
    # stdout (a library's print, a child process) goes to stderr instead,
    # and nothing but the pool reads stdin.
    protocol_in, protocol_out = _claim_stdio()
    routers = _routers(args.router)
    # Sessions outlive a signal where something can keep them: a session store, or a router's workers.
    keep_sessions = settings.session_store is not None or bool(routers)
    return asyncio.run(
        _serve(setup, worker_config, protocol_in, protocol_out, routers, router_security, args.metrics_listen,
               keep_sessions=keep_sessions)
    )


def _routers(given: list[str] | None) -> tuple[str, ...]:
    """Every ``--router`` address, in order, once: repeated flags and comma-separated lists alike."""
    addresses = (address.strip() for flag in given or () for address in flag.split(","))
    return tuple(dict.fromkeys(address for address in addresses if address))


async def _serve(
    setup: PoolSetup,
    worker_config: WorkerConfig,
    fd_in: int,
    fd_out: int,
    routers: tuple[str, ...] = (),
    router_security: ClientSecurity = ClientSecurity(),
    metrics_listen: str | None = None,
    *,
    keep_sessions: bool = False,
) -> int:
    signals = _Signals(keep_sessions)
    metrics = Metrics()
    engines: list[PoolEngine] = []  # the engine starts after the worker; a scrape before sees zeros
    metrics.watch_pool(lambda: engines[0].stats if engines else None)
    try:
        serve_if_asked(metrics, metrics_listen)
    except OSError as exc:
        _fail(f"cannot serve metrics on {metrics_listen}: {exc}")
        return EXIT_FAILED
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, signals.received, signum)
    try:
        if routers:
            # The router's workers restore the same checkpoints (the manifest read here names them).
            # Several routers: the client moves to the next when one goes away, and its sessions
            # re-attach there by key (decision 32).
            client = WorkerClient(routers[0] if len(routers) == 1 else routers, router_security, retry_s=ROUTER_RETRY_S)
            try:
                await asyncio.to_thread(client.capacity, ROUTER_PROBE_TIMEOUT_S)
            except ReadieError as exc:
                client.close()
                raise SandboxSetupError(f"cannot reach the router at {', '.join(routers)}: {exc}") from None
            backend: JobBackend = ThreadedBackend(client, setup.workers)
        else:
            local = await asyncio.to_thread(LocalWorkerBackend.start, worker_config, setup.checkpoint, metrics=metrics)
            metrics.watch_worker(local.worker)  # the embedded worker's warm sandboxes, slots and sessions
            worker_config = local.worker.config  # its state dir as made
            backend = local
    except ConfigError as exc:  # the state dir refused: bad configuration, like a bad flag
        _fail(f"cannot start the worker: {exc}")
        return EXIT_USAGE
    except ReadieError as exc:
        _fail(f"cannot start the worker: {exc}")
        return EXIT_FAILED
    try:
        if signals.count:
            log.info("stopped before the pool was ready")
            return 0
        engine = PoolEngine(setup, backend, log_job=structlog.get_logger().info)
        signals.engine = engine
        engines.append(engine)
        log.info(
            "pool ready",
            workers=setup.workers,
            checkpoint=setup.checkpoint,
            state_dir=None if routers else str(worker_config.state_dir),
        )
        return await engine.serve(FdReader(fd_in), FdWriter(fd_out))
    finally:
        await backend.close()
        log.info("pool closed")


class _Signals:
    """SIGTERM and SIGINT: each one moves the engine a step further (drain, then abort). With
    ``keep_sessions`` the first detaches the open sessions at the end of the drain instead of
    closing them (decision 32)."""

    def __init__(self, keep_sessions: bool = False) -> None:
        self.count = 0
        self.engine: PoolEngine | None = None
        self._keep_sessions = keep_sessions

    def received(self, signum: int) -> None:
        self.count += 1
        log.info("signal received", signal=signal.Signals(signum).name)
        if self.engine is not None:
            if self.count == 1 and self._keep_sessions:
                self.engine.detach_sessions()
            else:
                self.engine.drain()


def _claim_stdio() -> tuple[int, int]:
    protocol_in = os.dup(0)
    protocol_out = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol_in, protocol_out


def _check_package_dirs(dirs: tuple[Path, ...], slots: int) -> None:
    for path in dirs:
        if not path.is_dir():
            raise ReadieError(f"--package-dir {path}: not an existing directory")
    if len(dirs) > slots:
        raise ReadieError(
            f"{len(dirs)} package dirs, but sandboxes have {slots} package slots "
            "(planned at capture: [mounts] package_slots in checkpoints.toml)"
        )


def _configure_logging(*, json: bool) -> None:
    configure_logging(json=json, process="pool")
    processors = structlog.get_config()["processors"]
    structlog.configure(processors=[_drop_worker_job_lines, *processors])


def _drop_worker_job_lines(
    logger: Any, method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    # The worker logs one line per job; the pool writes its own (the spec's
    # --log=json line), and two "job" lines per job would be counted twice.
    if event_dict.get("event") == "job" and "sandbox" in event_dict:
        raise structlog.DropEvent
    return event_dict


def _fail(message: str) -> None:
    sys.stderr.write(f"readie pool: {message}\n")
    sys.stderr.flush()


def _preload(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="readie pool", description="serve the pool JSONL protocol on stdin and stdout"
    )
    parser.add_argument(
        "--workers", type=int, help="jobs run at once (default: [pool] workers, else 2)"
    )
    parser.add_argument(
        "--preload",
        type=_preload,
        metavar="A,B",
        help="modules every job finds imported: picks the checkpoint preloading exactly these",
    )
    parser.add_argument(
        "--package-dir",
        action="append",
        metavar="DIR",
        help="site-packages dir mounted read-only into every job (repeatable; "
        "replaces [pool] package_dirs)",
    )
    parser.add_argument("--config", metavar="FILE", help="pool configuration (TOML)")
    parser.add_argument(
        "--schema", action="store_true",
        help="print the JSON Schema of the protocol's request and event lines, and exit (docs/requests.md)",
    )
    parser.add_argument(
        "--config-schema", action="store_true",
        help="print the JSON Schema of the --config file, and exit (docs/config.md)",
    )
    parser.add_argument(
        "--log",
        choices=("console", "json", "none"),
        help="json: JSON logs and one line per finished job on stderr; console (or none): "
        "readable logs, no job lines (default: [pool] log, else console)",
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        metavar="N",
        help="sessions open at once (default: [pool] max_sessions, else 16; 0 disables sessions)",
    )
    parser.add_argument(
        "--session-idle",
        metavar="DURATION",
        help="close a session idle this long, e.g. 90s or 10m (default: [pool] session_idle, else 10m)",
    )
    parser.add_argument(
        "--session-hibernate",
        metavar="DURATION",
        help="checkpoint a session idle this long to disk, freeing its memory; its next step resumes it "
        "(default: [pool] session_hibernate, else off; shorter than the session idle time)",
    )
    parser.add_argument(
        "--session-pause",
        metavar="DURATION",
        help="pause a session idle this long with its sandbox quiet (no code of its own running): no CPU "
        "until its next request resumes it; a thread it left sleeping on a timer waits too; 0: never "
        "(default: [pool] session_pause, else 10s)",
    )
    parser.add_argument(
        "--router",
        action="append",
        metavar="HOST:PORT[,HOST:PORT]",
        help="run jobs through a `readie router` instead of a worker in this process; repeat it (or "
        "give a comma-separated list) for several routers in front of the same workers: when one goes "
        "away the pool goes on through the next, and sessions with a key follow (docs/pool.md)",
    )
    store = parser.add_argument_group("sessions that outlive the pool (decision 32)")
    store.add_argument(
        "--session-store", metavar="DIR",
        help="a directory of session images shared with later pools (and workers): a signal detaches the "
        "open sessions into it, and a new pool attaches to them by key (default: [pool] session_store, "
        "else none: sessions end with the pool)",
    )
    store.add_argument(
        "--session-store-key", metavar="FILE",
        help="the file of the key that signs the store's images (0600), the same for every pool and worker "
        "of the store; required with --session-store (default: [pool] session_store_key)",
    )
    store.add_argument(
        "--session-checkpoint", choices=sorted(SESSION_CHECKPOINTS),
        help="step: write each session into the store after each step, in the background, so a crash "
        "costs at most the step in flight (default: [pool] session_checkpoint, else off)",
    )
    egress = parser.add_argument_group("the network's way out (decision 36)")
    egress.add_argument(
        "--egress-netns", metavar="NAME",
        help="the network namespace, made by the operator (ip netns add NAME), that stands for the outside "
        "world: every networked sandbox is wired into it; never the host's own, readie turns on ip_forward "
        "in it. Required for any job with the network (default: [pool] egress_netns, else none: the "
        "network is refused)",
    )
    egress.add_argument(
        "--egress-dns", type=comma_separated, metavar="IP[,IP...]",
        help="the upstream resolvers, IPv4, reached from the egress namespace, that readie's resolver asks "
        "for the names a job may reach (default: [pool] egress_dns, else the host's /etc/resolv.conf)",
    )
    parser.add_argument(
        "--checkpoints",
        metavar="PATH",
        help=f"checkpoint manifest, or its directory (default: ${CHECKPOINTS_VARIABLE}, "
        "else ./build/checkpoints if it holds one, else ~/.cache/readie/checkpoints; docs/pool.md)",
    )
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        help="the pool's own dir for runsc's state, sandbox dirs and hibernated sessions: made mode 0700 "
        "if missing, refused if a link, another user's or writable by others, emptied at start and exit "
        f"(default: ${STATE_DIR_VARIABLE}, else a new dir under $XDG_RUNTIME_DIR/readie or "
        "~/.cache/readie/run, removed at exit; docs/pool.md)",
    )
    add_metrics_argument(parser)
    add_client_arguments(parser, "router", "the router")
    return parser
