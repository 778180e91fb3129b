"""The fault suite's machinery: a mixed load through ``readie pool --router`` that accounts
for every request, and the processes a fault is aimed at (docs/faults.md).

The load keeps a few requests in flight at a time, of four kinds: plain jobs,
session steps (three steps then a close), host-function jobs (the client
answers the call) and streaming jobs. Every job and step makes one side effect
in the pool's write grant, a file named after its request id, so a request
that ran twice shows two files whatever its answers said.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from readie_pool.testing import PoolProcess

# Requests in flight at once: below the pool's 2 x workers permits, so writing
# a request never blocks on backpressure while the reader thread replies to calls.
IN_FLIGHT = 4
# Pause between two sends: the load is steady, not a flood of fast failures while a router is down.
SEND_GAP_S = 0.05
# Steps a session takes before the client closes it.
SESSION_STEPS = 3
# A job's and a step's own limit: long enough for a restore on a busy machine, short enough
# that a job stuck behind a stopped worker answers within a phase.
JOB_TIMEOUT = "20s"
# The error types that say "this request was lost" (pool.md "Outcomes"): the only failures
# a fault may cause. A job's own code never fails in this load.
LOSS_TYPES = {"PoolWorkerError", "SandboxSetupError", "TimeoutError"}
# How long the driver waits for the answers in flight when a phase ends: the job
# timeout plus a restore, with margin for a loaded two-core machine.
QUIESCE_S = 60.0
# What a job writes to its side-effect file as its last act.
DONE = "done"


@dataclass
class Request:
    id: str
    kind: str  # job, step, close, host, stream, probe
    phase: str
    line: dict[str, Any]
    session: str | None = None
    step: int = 0  # the step this request should be in its session (1 for the opening one)
    answers: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    sent_at: float = 0.0


@dataclass
class SessionState:
    name: str
    steps: int = 0
    busy: bool = False
    ended: bool = False


class Load:
    """Drives one ``readie pool`` at a time (:meth:`attach` swaps in a new one): a sender thread,
    a reader thread, and the ledger of every request sent."""

    def __init__(self, out: Path, rng: random.Random) -> None:
        self.out = out
        self.rng = rng
        self.requests: dict[str, Request] = {}
        self.strays: list[dict[str, Any]] = []  # answers naming no request in flight (late replies)
        self.problems: list[str] = []
        self.phase = "start"
        self._lock = threading.Lock()
        self._write = threading.Lock()
        self._answered = threading.Condition(self._lock)
        self._sessions: dict[str, SessionState] = {}
        self._serial = 0
        self._pool: PoolProcess | None = None
        self._reader: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self.sending = threading.Event()
        self.stalled = threading.Event()  # set: the reader does not read stdout
        self._stop = threading.Event()

    # -- the pool

    def attach(self, pool: PoolProcess) -> None:
        with self._lock:  # sessions end with their pool: a new pool knows none of them
            for session in self._sessions.values():
                session.ended = True
        self._pool = pool
        self._reader = threading.Thread(target=self._read, args=(pool,), daemon=True)
        self._reader.start()
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, daemon=True)
            self._sender.start()

    def detach(self, timeout: float = QUIESCE_S) -> None:
        """Wait for the current pool's reader to see EOF (after a close_stdin or its death)."""
        assert self._reader is not None
        self._reader.join(timeout)
        if self._reader.is_alive():
            self.problems.append(f"{self.phase}: the pool's stdout did not end within {timeout} s")
        self._pool = None

    def stop(self) -> None:
        self._stop.set()
        self.sending.clear()

    # -- sending

    def _next_id(self, kind: str) -> str:
        self._serial += 1
        return f"{kind}-{self._serial}"

    def _effect(self, rid: str) -> str:
        """Code that leaves this request's side effect: one new file, never overwritten, which
        :data:`DONE` is written to as the job's last act (file I/O through the gofer after the
        fault may have struck)."""
        return (
            f"import os\n_effect = os.path.join({str(self.out)!r}, {rid!r} + '.' + os.urandom(6).hex())\n"
            "open(_effect, 'x').close()\n"
        )

    @staticmethod
    def _done() -> str:
        return f"with open(_effect, 'a') as _f:\n    _f.write({DONE!r})\n"

    def _make(self) -> Request | None:
        kind = self.rng.choice(["job", "job", "session", "host", "stream"])
        sleep = round(self.rng.uniform(0.1, 1.2), 2)
        if kind == "session":
            return self._session_request(sleep)
        rid = self._next_id(kind)
        code = self._effect(rid) + f"import time\ntime.sleep({sleep})\n"
        line: dict[str, Any] = {"id": rid, "allow_write": [str(self.out)], "timeout": JOB_TIMEOUT}
        if kind == "host":
            line["functions"] = ["mark"]
            code += f"from readie_host import mark\nprint(mark({rid!r}))\n"
        elif kind == "stream":
            line["stream"] = True
            code += "for n in range(3):\n    print(n, flush=True)\n    time.sleep(0.1)\n"
        else:
            code += f"print({rid!r})\n"
        line["code"] = code + self._done()
        return Request(rid, kind, self.phase, line)

    def _session_request(self, sleep: float) -> Request | None:
        idle = [s for s in self._sessions.values() if not s.busy and not s.ended]
        if not idle and len(self._sessions) < 64:
            name = f"s{self._serial + 1}"
            idle = [self._sessions.setdefault(name, SessionState(name))]
        if not idle:
            return None
        session = self.rng.choice(idle)
        session.busy = True
        if session.steps >= SESSION_STEPS:
            rid = self._next_id("close")
            session.ended = True
            return Request(rid, "close", self.phase, {"id": rid, "session": session.name, "close": True}, session.name)
        rid = self._next_id("step")
        code = self._effect(rid) + f"import time\ntime.sleep({sleep})\nn = globals().get('n', 0) + 1\nprint(n)\n" + self._done()
        line = {"id": rid, "session": session.name, "code": code, "timeout": JOB_TIMEOUT}
        if session.steps == 0:
            line["allow_write"] = [str(self.out)]
        return Request(rid, "step", self.phase, line, session.name, session.steps + 1)

    def send(self, request: Request) -> bool:
        """Write one request to the current pool; False when it is gone (the request is not accepted)."""
        pool = self._pool
        if pool is None:
            return False
        with self._lock:
            request.sent_at = time.monotonic()
            self.requests[request.id] = request
        try:
            with self._write:
                pool.send(request.line)
        except (BrokenPipeError, ValueError, OSError):
            with self._lock:
                del self.requests[request.id]  # never reached the pool: not accepted
                if request.session is not None:
                    self._sessions[request.session].busy = False
            return False
        return True

    def probe(self) -> Request:
        rid = self._next_id("probe")
        request = Request(rid, "probe", self.phase, {"id": rid, "code": "print('serving')", "timeout": JOB_TIMEOUT})
        self.send(request)
        return request

    def in_flight(self) -> list[Request]:
        with self._lock:
            return [r for r in self.requests.values() if not r.answers]

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            if not self.sending.wait(0.1):
                continue
            with self._lock:
                busy = sum(1 for r in self.requests.values() if not r.answers and r.kind != "probe")
                request = self._make() if busy < IN_FLIGHT else None
            if request is not None:
                self.send(request)
            time.sleep(SEND_GAP_S)

    def quiesce(self, timeout: float = QUIESCE_S) -> list[Request]:
        """Stop sending and wait for every request in flight; returns those left unanswered."""
        self.sending.clear()
        deadline = time.monotonic() + timeout
        with self._answered:
            while any(not r.answers for r in self.requests.values()) and time.monotonic() < deadline:
                self._answered.wait(0.2)
            return [r for r in self.requests.values() if not r.answers]

    # -- reading

    def _read(self, pool: PoolProcess) -> None:
        while True:
            while self.stalled.is_set():
                time.sleep(0.05)
            try:
                line = pool.read_line(timeout=3600)
            except (TimeoutError, OSError, ValueError):
                return
            if line is None:
                return
            try:
                message = json.loads(line)
            except ValueError:
                self.problems.append(f"{self.phase}: not JSON on stdout: {line[:200]!r}")
                continue
            self._dispatch(pool, message)

    def _dispatch(self, pool: PoolProcess, message: dict[str, Any]) -> None:
        event = message.get("event")
        if event == "call":
            reply = {"call_id": message["call_id"], "result": f"{message['args'][0]}!"}
            try:
                with self._write:
                    pool.send({"reply": reply})
            except OSError:
                pass  # the pool is gone; the job's answer says what happened
            return
        if event in ("ready", "stats"):
            return
        with self._answered:
            request = self.requests.get(str(message.get("id")))
            if request is None:
                self.strays.append(message)
                return
            if event == "output":
                request.outputs.append(message)
                return
            request.answers.append(message)
            if request.session is not None:
                session = self._sessions[request.session]
                session.busy = False
                if request.kind == "step" and len(request.answers) == 1:
                    session.steps += 1
                    if message.get("session_ended") or message.get("error"):
                        session.ended = True
            self._answered.notify_all()

    # -- accounting

    def effects(self) -> Counter[str]:
        """How many times each request id ran (files it created)."""
        return Counter(path.name.rsplit(".", 1)[0] for path in self.out.iterdir())

    def finished(self) -> set[str]:
        """The request ids whose run got to its last act."""
        return {path.name.rsplit(".", 1)[0] for path in self.out.iterdir() if path.read_text() == DONE}

    def judge(self, request: Request, effects: Counter[str], finished: set[str]) -> str:
        """``answered``, ``lost`` (a typed error said so) or a problem's text."""
        if len(request.answers) > 1:
            return f"answered {len(request.answers)} times: {request.answers}"
        if not request.answers:
            return "never answered"
        answer = request.answers[0]
        ran = effects.get(request.id, 0)
        if ran > 1:
            return f"ran {ran} times: {answer}"
        if request.kind == "close":
            return "answered" if answer.get("closed") else _lost_or(answer, "close refused")
        error = answer.get("error")
        if error is not None:
            if request.kind == "step" and error["type"] in LOSS_TYPES and not answer.get("session_ended"):
                return f"a lost step without session_ended: {answer}"
            if request.kind == "host" and error["type"] == "HostError" and "no reply can come" in error["message"]:
                return "lost"  # the client closed stdin: the call could not be answered, and the job was told
            return _lost_or(answer, "an error no fault explains")
        if request.kind != "probe" and (ran != 1 or request.id not in finished):
            return f"succeeded but ran {ran} times (finished: {request.id in finished}): {answer}"
        expected = {
            "job": f"{request.id}\n",
            "host": f"{request.id}!\n",
            "stream": "0\n1\n2\n",
            "step": f"{request.step}\n",
            "probe": "serving\n",
        }[request.kind]
        if (answer.get("exit"), answer.get("stdout")) != (0, expected):
            return f"wrong result (a silent restart?), wanted {expected!r}: {answer}"
        if request.kind == "step" and answer.get("step") != request.step:
            return f"step {answer.get('step')} where {request.step} was due: {answer}"
        if request.kind == "stream":
            streamed = "".join(o["data"] for o in request.outputs if o.get("stream") == "stdout")
            if not expected.startswith(streamed):
                return f"streamed {streamed!r}, not a prefix of the result's stdout"
        return "answered"


def _lost_or(answer: dict[str, Any], why: str) -> str:
    error = answer.get("error") or {}
    return "lost" if error.get("type") in LOSS_TYPES else f"{why}: {answer}"


# -------------------------------------------------------------------------- processes


def processes() -> list[tuple[int, list[str]]]:
    """Every process's pid and argv (those that vanish while read are left out)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = [part.decode(errors="replace") for part in cmdline.read().split(b"\0") if part]
        except OSError:
            continue
        if argv:
            found.append((int(entry), argv))
    return found


def runsc_processes(container_id: str, program: str | None = None) -> list[int]:
    """The pids of the runsc processes naming ``container_id`` (``program``: only argv[0] that)."""
    return [
        pid
        for pid, argv in processes()
        if argv[0].startswith("runsc") and container_id in " ".join(argv) and (program is None or argv[0] == program)
    ]


def containers(runsc_root: Path) -> list[str]:
    listed = subprocess.run(["runsc", f"--root={runsc_root}", "list", "--quiet"], capture_output=True, text=True, timeout=30)
    return listed.stdout.split()


def kill_all(pids: list[int], signum: int = signal.SIGKILL) -> int:
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, signum)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


def argv_of(process: subprocess.Popen[bytes]) -> list[str]:
    """A running process's command line, to start it again the same way (same port, same dirs)."""
    with open(f"/proc/{process.pid}/cmdline", "rb") as cmdline:
        return [part.decode() for part in cmdline.read().split(b"\0") if part]


def relaunch(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``argv`` again (as a supervisor would), appending to its log."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


def table(rows: list[dict[str, Any]]) -> str:
    """The suite's report: one row per fault kind."""
    columns = ["fault", "injected", "accepted", "answered", "lost-with-error", "duplicated", "problems", "recovery max s"]
    lines = [columns] + [[str(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    rendered = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines]
    return "\n".join([rendered[0], "  ".join("-" * w for w in widths), *rendered[1:]])


def serves_beneath(container_id: str, directory: Path) -> bool:
    """Whether the container's gofer holds ``directory`` open: it serves a job's grant there (a
    warm spare, restored before any job, mounts no grant). Compared by device and inode, since
    the gofer sees the grant through a bind mount at a path of the worker's own."""
    wanted = os.stat(directory)
    for pid, argv in processes():
        if argv[0] == "runsc-gofer" and container_id in " ".join(argv):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                return False
            for fd in fds:
                try:
                    held = os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if (held.st_dev, held.st_ino) == (wanted.st_dev, wanted.st_ino):
                    return True
            return False
    return False
