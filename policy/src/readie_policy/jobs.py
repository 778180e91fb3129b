"""A job, a session step and what they came to, as every layer passes them.

The pool's engine builds a :class:`CodeJob` (or a :class:`Step`), a router
places it, ``readie_rpc`` carries it over the wire and the worker runs it;
the :class:`JobOutcome` (a step's :class:`StepOutcome`) comes back the same
way, with the host-function calls (:class:`HostCall`, :class:`HostReply`,
:class:`HostStats`) and the output (:class:`OutputChunk`) the job made on the
way, and a worker's :class:`Capacity`. They live here, below the wire and the
worker both, so that ``readie_rpc`` converts them without importing the
worker (decision 27); the code that runs them is the worker's
(``readie_worker.jobs``, ``sessions``, ``core``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from readie_executor import hostwire
from readie_executor.hostwire import MAX_FUNCTIONS, MAX_OUTPUT_CHUNK_BYTES, OUTPUT_INTERVAL_S
from readie_executor.jobs import DEFAULT_INLINE_NAME
from readie_protocol.errors import RequestError
from readie_protocol.events import ErrorInfo, FileInfo, NetworkReport, Value
from readie_protocol.requests import MAX_REQUIREMENT_CHARS
from readie_protocol.workspace import MAX_COLLECTED_BYTES, MAX_COLLECTED_FILES, MAX_TRANSFER_BYTES, Collected

from .egress import Egress
from .policy import DEFAULT_MAX_OUTPUT, DEFAULT_TIMEOUT_MS, Policy

__all__ = [
    "BASE_JOB_ENV",
    "DEFAULT_INLINE_NAME",
    "FORWARD_BYTES",
    "JOB_SUBPROCESSES",
    "MAX_EARLY_REPLY_BYTES",
    "MAX_REQUIREMENTS",
    "MIN_FORWARD_INTERVAL_S",
    "Capacity",
    "CodeJob",
    "HostCall",
    "HostFunction",
    "HostReply",
    "HostStats",
    "JobOutcome",
    "OutputChunk",
    "OutputSink",
    "Step",
    "StepOutcome",
    "ask_host",
    "check_functions",
    "max_output_events",
    "validate_requirements",
]

#: What every job's environment starts from; the request's env goes on top.
#: Nothing of the worker's own environment is ever copied in.
BASE_JOB_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
#: No job may start processes (the worker's seccomp filter refuses fork and
#: exec): what the worker's spec sends, and what every result's policy reports.
JOB_SUBPROCESSES = False
# Well under the sandbox's own interval, so that its honest frames never wait
# here however the two clocks' wake-ups fall.
MIN_FORWARD_INTERVAL_S = OUTPUT_INTERVAL_S / 2.5
# Held text goes out at this size regardless of the interval: a job printing
# fast sends full-sized chunks (the sandbox's size trigger), which pass at once.
FORWARD_BYTES = MAX_OUTPUT_CHUNK_BYTES // 2
# name[extras] with optional version clauses; no URLs, paths, options or markers.
_REQUIREMENT = re.compile(
    r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
    r"(?:\[[A-Za-z0-9._-]+(?:,[A-Za-z0-9._-]+)*\])?"
    r"(?:(?:===|==|>=|<=|~=|!=|<|>)[A-Za-z0-9.*+!_-]+"
    r"(?:,(?:===|==|>=|<=|~=|!=|<|>)[A-Za-z0-9.*+!_-]+)*)?"
)
# Enough for any real job's list; bounds the install command and the cache key.
MAX_REQUIREMENTS = 32


@dataclass(frozen=True)
class CodeJob:
    """One job as the worker runs it: validated, paths absolute, limits resolved."""

    checkpoint: str
    code: str
    name: str = DEFAULT_INLINE_NAME
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = "/tmp"
    allow_read: tuple[str, ...] = ()
    allow_write: tuple[str, ...] = ()
    package_dirs: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()  # requirements, installed on the worker host and mounted
    network: bool = False
    # Where its network may go (decision 35); None with ``network``: the public internet, as a
    # job without destinations always had. A worker refuses a list until the enforcement lands.
    egress: Egress | None = None
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    memory_bytes: int | None = None
    max_output: int = DEFAULT_MAX_OUTPUT
    max_file_size: int | None = None
    # Host functions the code may call through readie_host (the sessions and
    # host functions issue); empty means readie_host offers nothing.
    functions: tuple[str, ...] = ()
    # List the files it creates or changes in allow_write (written.py) in its outcome.
    report_files: bool = False
    # Files written into the workspace (its cwd, in the sandbox) before the code runs, as
    # checked workspace paths and bytes (readie_protocol.workspace.check_files); and the
    # paths or patterns whose files come back with the outcome (decision 31).
    files: tuple[tuple[str, bytes], ...] = ()
    collect: tuple[str, ...] = ()
    # What the operator's ceiling lets come back: bytes and files of one outcome's
    # ``collected``, and the largest file one session upload or download moves.
    collect_bytes: int = MAX_COLLECTED_BYTES
    collect_files: int = MAX_COLLECTED_FILES
    transfer_bytes: int = MAX_TRANSFER_BYTES
    # Ask the sandbox's runner to time its phases (``JobOutcome.runner_us``): the bench's breakdown.
    # Off for every other job: a dozen clock reads, each a system call in a sandbox's first second.
    phases: bool = False

    @classmethod
    def under(
        cls,
        policy: Policy,
        *,
        checkpoint: str,
        code: str,
        name: str = DEFAULT_INLINE_NAME,
        args: tuple[str, ...] = (),
        cwd: str = "/tmp",
        packages: tuple[str, ...] = (),
        functions: tuple[str, ...] = (),
        report_files: bool = False,
        files: tuple[tuple[str, bytes], ...] = (),
        collect: tuple[str, ...] = (),
        pool_package_dirs: Iterable[Path] = (),
    ) -> CodeJob:
        """The job that runs ``code`` with what ``policy`` grants and limits it to.

        The one place a resolved :class:`Policy` becomes a job's fields (paths as
        the text the worker opens), for the pool's parse and the wire's alike.
        ``pool_package_dirs`` (the pool's own) come before the policy's. ``files``
        and ``collect`` are the request's, checked by its wire's parser
        (``readie_protocol.workspace``); what may come back is the policy's.
        """
        package_dirs = dict.fromkeys((*pool_package_dirs, *policy.package_dirs))
        return cls(
            checkpoint=checkpoint,
            code=code,
            name=name,
            args=args,
            env=dict(policy.env),
            cwd=cwd,
            allow_read=tuple(str(path) for path in policy.allow_read),
            allow_write=tuple(str(path) for path in policy.allow_write),
            package_dirs=tuple(str(path) for path in package_dirs),
            packages=packages,
            network=policy.network,
            egress=policy.egress,
            timeout_ms=policy.timeout_ms,
            memory_bytes=policy.memory_bytes,
            max_output=policy.max_output,
            max_file_size=policy.max_file_size,
            functions=functions,
            report_files=report_files,
            files=files,
            collect=collect,
            collect_bytes=policy.collect_bytes,
            collect_files=policy.collect_files,
            transfer_bytes=policy.transfer_bytes,
        )

    def step(self, step: Step) -> CodeJob:
        """The job ``step`` runs in the session this job opened: the step's code, and its own
        ``timeout_ms`` and ``max_output`` where it sets them, else this job's. The one place a
        step's defaults are filled in: the worker's session, its remote mirror and the fake
        backend all run steps through it."""
        return dataclasses.replace(
            self,
            code=step.code,
            name=step.name,
            args=step.args,
            timeout_ms=self.timeout_ms if step.timeout_ms is None else step.timeout_ms,
            max_output=self.max_output if step.max_output is None else step.max_output,
            report_files=step.report_files,
            files=step.files,
            collect=step.collect,
        )

    def spec(self, links: tuple[Mapping[str, object], ...], *, session: bool = False, stream: bool = False) -> dict[str, Any]:
        """The job as the sandbox's runner reads it (``readie_executor.jobs``' spec): plain data.

        ``links`` are the worker's mounts of the grants (where each host path
        appears inside). ``session``: run in the sandbox's persistent
        ``__main__`` (a notebook step) instead of a fresh namespace.
        ``stream``: send output frames while the job runs.
        """
        return {
            "code": self.code,
            "name": self.name,
            "args": list(self.args),
            "env": {**BASE_JOB_ENV, **self.env},
            "cwd": self.cwd,
            "links": [dict(link) for link in links],
            "limits": {
                "memory_bytes": self.memory_bytes,
                "max_file_size": self.max_file_size,
                "max_output": self.max_output,
                "subprocesses": JOB_SUBPROCESSES,
                "timeout_ms": self.timeout_ms,
            },
            "session": session,
            "functions": list(self.functions),
            "stream": stream,
        } | ({"phases": True} if self.phases else {})

    @property
    def needs_own_mounts(self) -> bool:
        """Package dirs fill their slots themselves (on sys.path), fixed at restore: no warm
        sandbox has them. Read and write grants reach a warm sandbox (decision 0034)."""
        return bool(self.package_dirs or self.packages)


@dataclass(frozen=True, slots=True)
class Step:
    """A later step of an open session: its code, and its own timeout and output cap.

    ``timeout_ms`` and ``max_output`` left None are the session's (its first
    job's). Every layer passes this one value as the request set it: the pool
    engine, the router's placement, the gRPC stream (``session_step`` converts
    the wire's) and the worker's session, which runs it as its job through
    :meth:`CodeJob.step`, where the session's values fill what it left None.
    """

    code: str
    name: str = DEFAULT_INLINE_NAME
    args: tuple[str, ...] = ()
    timeout_ms: int | None = None
    max_output: int | None = None
    report_files: bool = False
    # Like a job's: written into the session's workspace before the step's code runs, and
    # brought back after it (decision 31).
    files: tuple[tuple[str, bytes], ...] = ()
    collect: tuple[str, ...] = ()


# Refused destinations and names a job's log line names (its result lists up to 32 of each).
LOGGED_REFUSALS = 8


@dataclass(frozen=True)
class JobOutcome:
    """What a job came to: its own result, or the worker's account of why there is none."""

    exit: int | None  # None when the job did not end on its own (timeout, crash, refusal)
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    error: ErrorInfo | None
    duration_us: int  # the worker's clock around the call, not the job's claim
    python: str
    preloaded_modules: tuple[str, ...]
    sandbox_id: str | None
    backend: str
    # The code raised SystemExit (in a session, that ends the session).
    system_exit: bool = False
    # What the host-function channel carried (None only where no job ran).
    host: HostStats | None = None
    # Where the time went, for stats and the bench (None where not measured):
    # getting a sandbox (a warm one's check, or a restore) on the worker's
    # clock, and the job's own claim of how long its code ran (untrusted).
    acquire_us: int | None = None
    code_us: int | None = None
    # Finer, for the bench (None where not measured): the runner's claim of its phases
    # (readie_executor.jobs.bounds.RUNNER_PHASES) and the worker's own around the exchange
    # ("request": pickling it, "exchange": the round trip, "validate": reading the answer), in µs.
    runner_us: Mapping[str, int] | None = None
    worker_us: Mapping[str, int] | None = None
    # The code's last bare expression, shown (None: no such expression, or its value was None).
    value: Value | None = None
    # What it wrote to its write grants, when the job asked (report_files); None otherwise.
    files: tuple[FileInfo, ...] | None = None
    files_truncated: bool = False
    # What its ``collect`` brought back, checked by the worker (decision 31); None when it
    # asked for nothing.
    collected: Collected | None = None
    # What its egress policy refused (decision 35), counted by the worker outside the sandbox;
    # a session step's covers that step only. None: the job had no network.
    network: NetworkReport | None = None

    def log_fields(self) -> dict[str, object]:
        """What the worker's one log line per job or step says of its outcome: never captured output.
        A networked one names what its egress policy refused (the first few: one line stays short)."""
        fields: dict[str, object] = {
            "sandbox": self.sandbox_id,
            "backend": self.backend,
            "exit": self.exit,
            "error": self.error.type if self.error else None,
            "duration_us": self.duration_us,
            "truncated": self.stdout_truncated or self.stderr_truncated,
        }
        if self.network is not None:
            fields["network_refused"] = self.network.refused_connections
            fields["network_refused_to"] = [f"{r.address}:{r.port}" for r in self.network.refused[:LOGGED_REFUSALS]]
            fields["network_refused_names"] = list(self.network.refused_names[:LOGGED_REFUSALS])
            fields["network_allowed"] = self.network.allowed_connections
        return fields

    @classmethod
    def failure(cls, error_type: str, message: str, duration_us: int, backend: str,
                sandbox_id: str | None = None, hint: str | None = None) -> JobOutcome:
        return cls(None, "", "", False, False, ErrorInfo(error_type, message, None, None, hint),
                   duration_us, "", (), sandbox_id, backend)


@dataclass(frozen=True, slots=True)
class HostCall:
    """A validated call, rebuilt from the frame. ``deadline`` is not from the frame: the worker
    sets it to the ``time.monotonic()`` at which the task's timeout runs out, so a host that
    waits (on a client) knows when to give up."""

    call_id: int
    function: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    deadline: float | None = field(default=None, compare=False)
    # args and kwargs as the JSON they arrived in, already parsed and checked: a
    # hop that only relays the call (a router) sends these bytes on, unencoded.
    encoded: tuple[bytes, bytes] | None = field(default=None, compare=False, repr=False)
    # Not from the frame either: set by whoever hands the call on (the worker, or a stream that
    # relays it), for a host that receives the reply on a thread other than the one it was called
    # on. Called there with a reply of up to MAX_EARLY_REPLY_BYTES, it sends the reply on at once
    # (into the sandbox, or onto the stream) if it can, so the call's thread need not wake first;
    # True once it went. The host returns the reply all the same.
    reply_now: Callable[[HostReply], bool] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class HostReply:
    """The host's answer: ``result`` (any JSON value) unless ``error`` is set."""

    result: Any = None
    error: str | None = None
    # result as the JSON it arrived in, already parsed and checked: relayed as it is.
    encoded: bytes | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class HostStats:
    """What one task's host-function channel carried."""

    calls: int = 0  # valid calls handed to the host
    replies: int = 0  # replies sent into the sandbox: answers and refusals
    junk: int = 0  # frames that were not a well-formed call: dropped, answered with an error
    forged: int = 0  # well-formed calls refused: undeclared name, out of sequence, over the limit
    host_errors: int = 0  # calls the host answered with an error (or raised on)
    wait_us: int = 0  # time spent waiting for the host

    @property
    def refused(self) -> int:
        return self.junk + self.forged


#: A reply this size or less (its line, or its JSON and error) is sent on by the thread that
#: receives it (``HostCall.reply_now``); a larger one by the call's own thread. That thread is
#: a pool's event loop or a stream's reader, which every other message waits behind; encoding
#: and checking a reply is pure Python, and nested lists cost it the most per byte: ~2 ms at this
#: size (a list nested 1,900 deep), a typical reply far less.
MAX_EARLY_REPLY_BYTES = 4 * 1024


#: Answers one host-function call; runs on the worker thread that runs the job.
#: An exception it raises becomes an error reply (HostError in the sandbox).
HostFunction = Callable[[HostCall], HostReply]


def check_functions(functions: Collection[str]) -> None:
    """Refuse declared names readie_host cannot offer, before anything runs."""
    if len(functions) > MAX_FUNCTIONS:
        raise RequestError(f"at most {MAX_FUNCTIONS} may be declared", field="functions")
    for name in functions:
        problem = hostwire.function_name_problem(name)
        if problem is not None:
            raise RequestError(problem, field="functions")
    if len(set(functions)) != len(functions):
        raise RequestError("a name is declared twice", field="functions")


def ask_host(host: HostFunction, call: HostCall) -> HostReply:
    """``host``'s answer to ``call``; whatever goes wrong in it is the call's failure, not the job's."""
    try:
        reply = host(call)
    except Exception as exc:  # noqa: BLE001
        return HostReply(error=f"{call.function} failed on the host: {type(exc).__name__}: {exc}")
    if not isinstance(reply, HostReply):
        return HostReply(error=f"{call.function}: the host answered with {type(reply).__name__}, not a reply")
    return reply


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """Text a running job wrote on one stream, validated and bounded."""

    stream: Literal["stdout", "stderr"]
    data: str


#: Takes each chunk as the job writes; called on the thread that runs the job.
#: It must not block for long: the job's exchange waits for it.
OutputSink = Callable[[OutputChunk], None]


def max_output_events(task_s: float, max_output: int) -> int:
    """The most chunks a task of ``task_s`` seconds forwards per stream: one per interval, one per
    FORWARD_BYTES of its budget, and the last."""
    return int(task_s / MIN_FORWARD_INTERVAL_S) + max_output // FORWARD_BYTES + 2


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """One step's outcome, its number in the session (1 opens it), and whether it ended the session."""

    outcome: JobOutcome
    step: int
    session_ended: bool
    # Milliseconds the step spent restoring its hibernated session first; None when it did not.
    resumed_ms: float | None = None
    # Set when the step resumed its session by taking it over from a holder that was lost (a
    # crash: decision 32): the number of the step its state is from, which a client compares
    # with the last step it was answered; never left out when the state may be older.
    resumed_from_step: int | None = None


@dataclass
class Capacity:
    """What a worker can take now: its slots and sessions, its warm sandboxes by checkpoint
    (``warm``: ready and target), and why it can serve nothing, when it cannot."""

    slots: int
    busy: int
    draining: bool
    warm: dict[str, dict[str, int]]  # by checkpoint: its warm sandboxes ready and kept
    isolated: bool
    sessions: int = 0
    max_sessions: int = 0
    hibernated: int = 0  # sessions whose image is on disk (they count in sessions too)
    hibernated_bytes: int = 0
    # Why nothing can be served, when nothing can: health says NOT_SERVING then.
    problem: str | None = None


def validate_requirements(requirements: Sequence[str]) -> tuple[str, ...]:
    if len(requirements) > MAX_REQUIREMENTS:
        raise RequestError(f"{len(requirements)} requirements, at most {MAX_REQUIREMENTS}", field="packages")
    cleaned = []
    for requirement in requirements:
        text = requirement.strip()
        if len(text) > MAX_REQUIREMENT_CHARS or not _REQUIREMENT.fullmatch(text):
            raise RequestError(
                f"{requirement[:80]!r} is not a requirement of the form name[extras]==version", field="packages"
            )
        cleaned.append(text)
    return tuple(sorted(dict.fromkeys(cleaned)))
