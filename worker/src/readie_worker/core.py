"""The worker: checkpoints loaded, warm sandboxes kept, jobs run in pristine sandboxes.

Everything here is synchronous and thread-safe; the gRPC layer calls it from its thread pool. A
job holds one of ``slots`` for its whole run (``_slots``), so capacity is a plain count that
placement can trust. A session (``sessions.py``, kept by the worker's ``_session_keeping`` part)
holds a slot only while one of its steps runs; its sandbox lives between steps (paused once idle
long: ``_idle_pause``) and is destroyed when the session ends, or when the worker closes or drains.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from readie_policy.config import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_PAUSE_MS
from readie_policy.jobs import Capacity
from readie_policy.sandbox_memory import SANDBOX_MEMORY_BACKSTOP, SANDBOX_OVERHEAD
from readie_protocol.cancel import NEVER, Cancellation

from . import runsc as runsc_module
from ._mounts import enter_mount_namespace
from ._networked import NetworkedSandboxes
from ._retire import Retirer
from ._session_keeping import SessionSandboxes, WorkerSessions
from ._slots import Slots
from .bundle import MountPlan, serve_env
from .errors import ConfigError, ErrorType, RequestError, SandboxSetupError, bound_ids
from .grants import NO_GRANTS, HeldGrants, hold_grants
from .hibernation import SessionImages
from .jobs import CodeJob, HostFunction, JobOutcome, OutputSink, _since, answered, run_in_sandbox
from .launchers import JOB_MEMORY_SLACK, Launcher, LocalProcess
from .manifest import LoadedCheckpoints, checkpoints_for
from .metrics import Metrics
from .packages import ensure_packages, package_cache
from .paths import canonical_dirs, code_dirs
from .runsc import Runsc
from .sandbox import Sandbox, SandboxFactory, checkpoint_factory, launch
from .session_store import DEFAULT_STORE_BYTES, DEFAULT_STORE_ENTRIES, DEFAULT_STORE_TTL_S, SessionStore, read_store_key
from .sessions import SandboxSession, StepOutcome
from .state_dir import RUNTIME_ROOT, StateDir
from .warm import RefillBudget, WarmSandboxes

log = structlog.get_logger("readie.worker")

# Two cores run about two jobs at full speed; more only queue inside gVisor.
DEFAULT_SLOTS = 2
# The backstop and the sentry's share are the config's bounds too: defined once, there.
DEFAULT_SANDBOX_MEMORY = SANDBOX_MEMORY_BACKSTOP
# How long a drain lets running jobs finish before it destroys their sandboxes.
DEFAULT_DRAIN_GRACE_S = 30.0
# What WorkerConfig.session_checkpoint may be: no checkpoints between steps, or one after each.
SESSION_CHECKPOINTS = ("off", "step")
# A store of the worker's own gets a key of HMAC-SHA256's own size, made at start.
STORE_KEY_BYTES = 32
# A restore answers in 0.2-1 s here, a few on a loaded host: the resume's bound on its socket.
RESUME_SOCKET_WAIT_S = 15.0


@dataclass(frozen=True)
class WorkerConfig:
    manifest: Path
    # The worker's own dir, holding all it keeps on the host (state_dir.py); None: a new one
    # under the per-user runtime root, removed at close. Short: sockets live beneath it.
    state_dir: Path | None = None
    warm: Mapping[str, int] = field(default_factory=lambda: {"base": 1, "pandas": 1})
    slots: int = DEFAULT_SLOTS
    max_sessions: int = DEFAULT_MAX_SESSIONS
    refill_concurrency: int = 1
    # Warm sandboxes run the warm-up call before hand-out (see WarmSandboxes). Off
    # only to measure what it saves (the bench's before/after arm).
    warm_up: bool = True
    strict_manifest: bool = False
    # Development without gVisor: jobs run as plain host processes. Never a default.
    allow_unisolated: bool = False
    # An unisolated worker's launcher: LocalProcess, or testing.FaultyLauncher in tests.
    unisolated_launcher: Launcher | None = None
    # The cgroup backstop of every sandbox (sentry and gofer included). A job's
    # own 'memory' limit (RLIMIT_AS inside) must leave SANDBOX_OVERHEAD below it.
    sandbox_memory_bytes: int = DEFAULT_SANDBOX_MEMORY
    # Egress (issue 32, decision 36): the network namespace that stands for the outside world,
    # into which each networked sandbox is wired; None: jobs asking for the network are refused.
    # ``egress_dns``: the upstream resolvers readie's resolver forwards allowed names to (None:
    # the IPv4 nameservers of the host's /etc/resolv.conf).
    egress_netns: str | None = None
    egress_dns: tuple[str, ...] | None = None
    # ``egress_netns`` is to name the worker's own network namespace (a container's or pod's).
    egress_own_netns: bool = False
    # The runsc binary; its flags follow from what it supports (runsc.RunscFeatures).
    runsc: str = "runsc"
    # The session store (decision 32): a directory several workers share, and the file holding
    # its MAC key. None: a store in the worker's own state dir with a key made at start, which a
    # restart forgets (and a drain does not hand sessions over to).
    session_store: Path | None = None
    session_store_key: Path | None = None
    session_store_ttl_s: float = DEFAULT_STORE_TTL_S
    session_store_bytes: int = DEFAULT_STORE_BYTES
    session_store_entries: int = DEFAULT_STORE_ENTRIES
    # "off", or "step": write each session into the store after each step (issue 30, item 3).
    session_checkpoint: str = "off"
    # A session idle this long with its sandbox quiet waits paused (_idle_pause); 0: never.
    session_pause_s: float = DEFAULT_SESSION_PAUSE_MS / 1000

    @classmethod
    def in_temp(cls, manifest: Path, **overrides: object) -> WorkerConfig:
        """A worker whose state dir is a new one that it removes on close (the default)."""
        return cls(manifest=manifest, **overrides)  # type: ignore[arg-type]


class Worker:
    def __init__(self, config: WorkerConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else Metrics()  # unserved unless the CLI serves it
        self.state: StateDir | None = None  # claimed at start
        # Its root is the state dir's runsc/, set when start claims it; a placeholder until then.
        self.runsc = Runsc(root=RUNTIME_ROOT, binary=config.runsc, observer=self.metrics)
        self._slots = Slots(config.slots)
        self.warm: dict[str, WarmSandboxes] = {}
        self.factories: dict[str, SandboxFactory] = {}
        self.checkpoints: LoadedCheckpoints | None = None
        self.isolated = True
        self._retirer = Retirer()
        self.egress: NetworkedSandboxes | None = None  # with egress_netns: networked jobs' sandboxes
        self.images: SessionImages | None = None  # where sessions hibernate; None unisolated
        self.sessions = WorkerSessions(
            SessionSandboxes(self._slots.taken, self._check_job, self._acquire, self._restore_session),
            config.max_sessions,
            self.metrics,
        )
        # Paths no grant may touch (the worker's own), and paths no grant may write (what
        # every sandbox is made from); absolute and symlink-free, set at start.
        self._private_dirs: tuple[Path, ...] = ()
        self._template_dirs: tuple[Path, ...] = ()

    def start(self) -> Worker:
        try:
            return self._start()
        except BaseException:
            self.close()  # whatever was started is torn down; nothing outlives a failed start
            raise

    def _start(self) -> Worker:
        store_key = self._store_key()  # a refused key file or store setting: nothing touched yet
        self.sessions.checkpoint_steps = self.config.session_checkpoint == "step"
        self.sessions.pause_idle_after(self.config.session_pause_s)  # ConfigError: nothing touched yet
        state = self.state = StateDir.claim(self.config.state_dir)  # StateDirRefused: nothing touched
        # Its path as the kernel names it: mount points are compared with what the kernel reports.
        self.config = dataclasses.replace(self.config, state_dir=state.path)
        self.runsc = dataclasses.replace(self.runsc, root=state.runsc_root)
        if not runsc_module.available():
            state.prepare()
            return self._start_unisolated("runsc is not installed or the worker is not root")
        enter_mount_namespace()  # where the sandboxes' mounts live (_mounts.py)
        swept = self.runsc.sweep()  # an earlier run's containers in this state dir, by their state there
        if swept:
            log.warning("swept containers left by an earlier run", containers=swept)
        state.prepare()
        self.checkpoints = self._load_checkpoints()
        if self.checkpoints.manifest is None:
            return self._start_unisolated(self.checkpoints.problems["*"])
        self.images = self.sessions.images = self._open_store(state, store_key)
        # A shared store and its key are the worker's too: a grant reaching either would read other
        # sessions' memory, or forge images.
        store_paths = [path for path in (self.config.session_store, self.config.session_store_key) if path is not None]
        self._private_dirs = canonical_dirs(RUNTIME_ROOT, state.path, *store_paths)
        self._template_dirs = canonical_dirs(
            self.checkpoints.manifest.rootfs, self.config.manifest.parent, package_cache(), *code_dirs(self.runsc.binary)
        )
        for problem in self.checkpoints.problems.values():
            log.warning("checkpoint unusable", problem=problem)
        budget = RefillBudget(self.config.refill_concurrency)
        for name, checkpoint in self.checkpoints.usable.items():
            factory = checkpoint_factory(
                self.runsc,
                self.checkpoints.manifest,
                checkpoint,
                state.run_dir,
                memory_limit_bytes=self.config.sandbox_memory_bytes,
            )
            self.factories[name] = factory
            target = self.config.warm.get(name, 0)
            self.warm[name] = WarmSandboxes(name, factory, target, budget, warm_up=self.config.warm_up, observer=self.metrics).start()
        if self.config.egress_netns is not None:
            self.egress = NetworkedSandboxes(self.config.egress_netns, self.config.egress_dns, self.runsc,
                                             own=self.config.egress_own_netns).start()
            self.egress.start_warm(self.factories, self.config.warm, budget, warm_up=self.config.warm_up, observer=self.metrics)
        log.info(
            "worker started",
            checkpoints=sorted(self.factories),
            warm=dict(self.config.warm),
            egress_netns=self.config.egress_netns,
        )
        return self

    def _store_key(self) -> bytes:
        """The session store's MAC key, read once: the named file's, else a new one (a store of
        the worker's own). ConfigError for a shared store without a key, or a key file refused."""
        config = self.config
        if config.session_checkpoint not in SESSION_CHECKPOINTS:
            raise ConfigError("session_checkpoint", None, f"{config.session_checkpoint!r} is not one of {', '.join(SESSION_CHECKPOINTS)}")
        if config.session_store_key is not None:
            return read_store_key(config.session_store_key)
        if config.session_store is not None:
            raise ConfigError(str(config.session_store), None, "a shared session store needs --session-store-key (the MAC key every worker of it shares)")
        return secrets.token_bytes(STORE_KEY_BYTES)

    def _open_store(self, state: StateDir, key: bytes) -> SessionImages:
        """The session store: the configured shared one, else one of the worker's own."""
        config = self.config
        shared = config.session_store is not None
        store = SessionStore(
            config.session_store if config.session_store is not None else state.store_dir, key,
            worker=f"{socket.gethostname()}:{os.getpid()}", ttl_s=config.session_store_ttl_s,
            max_bytes=config.session_store_bytes, max_entries=config.session_store_entries,
        )
        store.sweep()
        return SessionImages(store, state.images_dir, shared=shared)

    def _start_unisolated(self, reason: str) -> Worker:
        if not self.config.allow_unisolated:
            raise SandboxSetupError(f"cannot start an isolated worker: {reason}")
        log.warning("NO ISOLATION: jobs run as plain host processes", reason=reason)
        self.isolated = False
        self.sessions.backend = "local"
        assert self.state is not None
        factory = SandboxFactory(self.config.unisolated_launcher or LocalProcess(), self.state.run_dir, serve_env(()))
        self.factories = {"base": factory}
        self.warm = {"base": WarmSandboxes("base", factory, 0, RefillBudget(), observer=self.metrics).start()}
        return self

    def _load_checkpoints(self) -> LoadedCheckpoints:
        return checkpoints_for(self.runsc, self.config.manifest, strict=self.config.strict_manifest)

    def run_job(
        self, job: CodeJob, job_id: str | None = None, host: HostFunction | None = None, *,
        cancel: Cancellation = NEVER, output: OutputSink | None = None,
        then: Callable[[JobOutcome], None] | None = None,
    ) -> JobOutcome:
        """Run ``job`` in a pristine sandbox; ``host`` answers its calls to declared host functions.

        ``cancel`` stops it at any point: waiting for a slot (Cancelled), or
        running (its sandbox interrupted and destroyed; the outcome says so).
        ``output`` takes its output as it is written. ``then`` is called once, on this thread,
        with the outcome this returns, as soon as it is known: before the sandbox's retirement,
        the refill, the log line and the metrics (a pool writes the result line there; it must
        not raise). Not called when this raises.
        """
        started = time.monotonic()
        with self._slots.taken(cancel), bound_ids(job_id=job_id):
            queued_us = _since(started)
            outcome = self._run_job(job, host, cancel, output, then)
        # One line per job: identifiers, outcome and timing, never captured output.
        log.info(
            "job",
            job_id=job_id,
            checkpoint=job.checkpoint,
            **outcome.log_fields(),
            queue_us=queued_us,
            acquire_us=outcome.acquire_us,
            host_calls=outcome.host.calls if outcome.host else 0,  # None: no job ran
            host_refused=outcome.host.refused if outcome.host else 0,
        )
        self.metrics.job_finished(job.checkpoint, outcome, queued_us / 1_000_000)
        return outcome

    def _run_job(
        self, job: CodeJob, host: HostFunction | None, cancel: Cancellation, output: OutputSink | None,
        then: Callable[[JobOutcome], None] | None,
    ) -> JobOutcome:
        self._check_job(job)
        started = time.monotonic()
        # The refill this job's take starts (from the networked set for a networked job) waits for
        # it, and its answer (``then``).
        taken_from = self.egress.warm[job.checkpoint] if job.network and self.egress is not None else self.warm[job.checkpoint]
        with taken_from.refill_held():
            try:
                sandbox, links = self._acquire(job)
            except SandboxSetupError as exc:
                failed = JobOutcome.failure(ErrorType.SANDBOX_SETUP, str(exc), _since(started), "gvisor" if self.isolated else "local")
                return answered(then, failed)
            acquire_us = _since(started)
            try:
                outcome = dataclasses.replace(run_in_sandbox(sandbox, job, links, host=host, cancel=cancel, output=output), acquire_us=acquire_us)
            except BaseException:
                self._retirer.retire(sandbox)
                raise
            if then is None or self._retirer.backed_up():  # the destroy is inline: before the answer, as always
                self._retirer.retire(sandbox)
                return answered(then, outcome)
            then(outcome)  # before the retirement's runsc processes start, beside its answer
            self._retirer.after_answer(sandbox)
            return outcome

    def _check_job(self, job: CodeJob, memory_limit: int | None = None) -> None:
        """RequestError for a job this worker cannot take; ``memory_limit``: the cgroup limit a
        stored session (``attach_session``) restores under, bounded by this worker's backstop."""
        if job.checkpoint not in self.warm:
            raise RequestError(f"no checkpoint named {job.checkpoint!r} on this worker (have {', '.join(sorted(self.warm))})", field="checkpoint")
        if job.network and self.egress is None:
            raise RequestError("this worker has no egress for networked jobs (its operator sets egress_netns)",
                               field="allow_network")
        ceiling = self.memory_ceiling(job.checkpoint)
        if job.memory_bytes is not None and job.memory_bytes > ceiling:
            raise RequestError(f"{job.memory_bytes} bytes is above this worker's ceiling of {ceiling}", field="memory")
        if memory_limit is not None and not 0 < memory_limit <= self.config.sandbox_memory_bytes:
            raise RequestError(f"a sandbox limit of {memory_limit} bytes is outside this worker's backstop of "
                               f"{self.config.sandbox_memory_bytes}", field="memory")

    def memory_ceiling(self, checkpoint: str) -> int:
        """The most a job may ask for as ``memory``: the backstop less the sandbox's own share."""
        measured = None
        if self.checkpoints is not None and checkpoint in self.checkpoints.usable:
            measured = self.checkpoints.usable[checkpoint].idle_memory_bytes
        overhead = SANDBOX_OVERHEAD if measured is None else measured + JOB_MEMORY_SLACK
        return self.config.sandbox_memory_bytes - overhead

    def _acquire(self, job: CodeJob) -> tuple[Sandbox, tuple[Mapping[str, object], ...]]:
        """A sandbox for ``job`` and the links its grants need: a warm one (a networked one given
        its rules, if it has the network: ``_networked``) unless it needs packages (mount sources
        fixed at restore). Grants are opened here, when the
        job has its slot, and held until its sandbox has them mounted (``grants.py``): a warm
        sandbox's grant points take them after restore (decision 0034)."""
        warm = self.warm[job.checkpoint]
        networked = self.egress if job.network else None  # _check_job refused a network without egress
        if job.needs_own_mounts:
            with self._hold_grants(job) as grants:
                if networked is not None:
                    sandbox = networked.made_for(job, warm, self.factories[job.checkpoint], grants)
                else:
                    sandbox = warm.made_for_a_job(grants)
        elif job.allow_read or job.allow_write:
            # Opened first: a refused grant costs no warm sandbox.
            with self._hold_grants(job) as grants:
                sandbox = networked.take(job) if networked is not None else warm.take()
                try:
                    if self.isolated:
                        sandbox.attach(grants)
                except BaseException:
                    self._retirer.retire(sandbox)
                    raise
        else:
            sandbox, grants = networked.take(job) if networked is not None else warm.take(), NO_GRANTS
        # Unisolated, the job sees the host itself: links would be made on the host.
        links = grants.links if self.isolated else ()
        if job.memory_bytes is not None:
            try:
                sandbox.limit_memory(job.memory_bytes)
            except BaseException:
                self._retirer.retire(sandbox)
                raise
        return sandbox, links

    def _restore_session(
        self, job: CodeJob, image: Path, memory_limit: int | None
    ) -> tuple[Sandbox, tuple[Mapping[str, object], ...]]:
        """A hibernated session's sandbox, restored from ``image`` with its grants opened again
        under the rules of a new job (a grant that is gone or moved refuses the resume).

        The memory limit the session had is in the restore's own spec, so the restored
        sandbox is never without it, not even before its first step.
        """
        factory = self.factories[job.checkpoint]
        limit = factory.primary.memory_limit_bytes if memory_limit is None else memory_limit
        restore = dataclasses.replace(factory.primary, image_path=image, memory_limit_bytes=limit)
        with self._hold_grants(job) as grants:
            # A job's thread can take the hand-over meant for its executor; then no socket comes,
            # and this wait, not the restore's usual minute, is what the session costs its slot.
            sandbox = launch(restore, factory.run_dir, factory.env, grants, RESUME_SOCKET_WAIT_S)
        sandbox.memory_limit_bytes = memory_limit
        return sandbox, grants.links

    def _hold_grants(self, job: CodeJob) -> HeldGrants:
        package_dirs = job.package_dirs
        if job.packages:
            package_dirs = (*package_dirs, os.path.realpath(ensure_packages(job.packages)))
        return hold_grants(
            self._mount_plan(),
            allow_read=job.allow_read,
            allow_write=job.allow_write,
            package_dirs=package_dirs,
            private=self._private_dirs,
            read_only=self._template_dirs,
        )

    def _mount_plan(self) -> MountPlan:
        if self.checkpoints is None or self.checkpoints.manifest is None:
            return MountPlan()  # unisolated: no mount slots to fill, but the same request limits
        return self.checkpoints.manifest.mount_plan

    def open_session(
        self, job: CodeJob, job_id: str | None = None, host: HostFunction | None = None, *,
        cancel: Cancellation = NEVER, output: OutputSink | None = None,
    ) -> tuple[SandboxSession, StepOutcome]:
        """Open a session whose setup and first step are ``job`` (:meth:`WorkerSessions.open_session`)."""
        return self.sessions.open_session(job, job_id, host, cancel=cancel, output=output)

    def fork_session(self, session: SandboxSession, cancel: Cancellation = NEVER) -> tuple[SandboxSession, float]:
        """A new session with ``session``'s state now (:meth:`WorkerSessions.fork_session`)."""
        return self.sessions.fork_session(session, cancel)

    def attach_session(self, key: str, *, take_over: bool = False, cancel: Cancellation = NEVER) -> tuple[SandboxSession, int]:
        """The session stored under ``key``, held here now (:meth:`WorkerSessions.attach_session`)."""
        return self.sessions.attach_session(key, take_over=take_over, cancel=cancel)

    @property
    def hands_sessions_over(self) -> bool:
        """Whether a drain hands keyed sessions over (``ServedRunner``'s, decision 32): with a shared
        store only. Then each session's stream detaches its own and ends with ``handed_over`` as
        soon as it is stored, instead of lingering until the server stops."""
        return self.images is not None and self.images.shared

    def hand_over_sessions(self) -> list[SandboxSession]:
        """Detach every session into the shared store (a drain's, once running steps finished);
        those handed over. Without a shared store every session is closed."""
        return self.sessions.hand_over(self.config.slots)

    def execute_call(
        self,
        checkpoint: str,
        payload: bytes,
        timeout_s: float,
        max_response: int | None = None,
        *,
        cancel: Cancellation = NEVER,
    ) -> bytes:
        """A readie-style call: pickled function in, envelope bytes out, never opened here."""
        with self._slots.taken(cancel):
            warm = self.warm.get(checkpoint)
            if warm is None:
                raise RequestError(f"no checkpoint named {checkpoint!r} on this worker", field="checkpoint")
            sandbox = warm.take()
            try:
                with cancel.stopping(sandbox.interrupt):
                    return sandbox.call(payload, timeout=timeout_s, max_response=max_response)
            finally:
                self._retirer.retire(sandbox)

    def capacity(self) -> Capacity:
        busy, draining = self._slots.state()
        sessions = self.sessions.places
        return Capacity(
            slots=self.config.slots,
            busy=busy,
            draining=draining,
            warm={name: {"ready": warm.ready_count, "target": warm.target} for name, warm in self.warm.items()},
            isolated=self.isolated,
            sessions=sessions,
            max_sessions=self.config.max_sessions,
            hibernated=self.sessions.hibernated,
            hibernated_bytes=self.images.store.usage[1] if self.images is not None else 0,
            problem=self._problem(),
        )

    def session_store_usage(self) -> tuple[int, int]:
        """(entries, bytes) of the session store, every worker's, as last counted."""
        return self.images.store.usage if self.images is not None else (0, 0)

    def _problem(self) -> str | None:
        if self.warm:
            return None
        if self.checkpoints is None:
            return "the worker has not started"
        reasons = "; ".join(self.checkpoints.problems.values()) or "the manifest lists none"
        return f"no usable checkpoint: {reasons}"

    def drain(self, grace_s: float = DEFAULT_DRAIN_GRACE_S) -> None:
        """Stop taking work, let running jobs finish (up to ``grace_s``), hand every session over
        to a shared store (:meth:`hand_over_sessions`), destroy everything else."""
        self._slots.drain(grace_s)
        self.hand_over_sessions()
        self.close()

    def close(self) -> None:
        self.sessions.close()  # their sandboxes; a step still running ends with a worker error
        if self.images is not None:
            self.images.store.close()  # a store of its own goes with the state dir: a restart forgets it
        self._retirer.close()
        for warm in self.warm.values():
            warm.close()
        if self.egress is not None:  # after every sandbox: each removes its own wiring first
            self.egress.close()
        if self.state is not None:  # never touched unless it was claimed: a refused one is not ours
            self._close_state(self.state)

    def _close_state(self, state: StateDir) -> None:
        survivors = []
        if self.isolated and runsc_module.available():
            self.runsc.sweep()
            survivors = self.runsc.list_ids()
        if survivors:  # what is left is an operator's to see
            log.error("containers outlived the worker; its state dir is kept", state_dir=str(state.path), containers=survivors)
        else:
            state.close()
