"""The fault suite's load: a mixed load through ``readie pool --router`` that accounts for
every request and every session (docs/faults.md; the processes it aims at are
``_fault_processes``).

The load keeps a few requests in flight at a time, of four kinds: plain jobs,
session steps (three steps then a close), host-function jobs (the client
answers the call) and streaming jobs. Every job and step makes one side effect
in the pool's write grant, a file named after its request id, so a request
that ran twice shows two files whatever its answers said.

Sessions are durable (decision 32): a session ends only when the client closes
it; one that ends otherwise is counted as a session lost. A session step prints
a counter kept in the session's own ``__main__``, so the load checks at each
answer that the state went on: one more than the last answer's, more still by
the steps answered as lost in between (they may have run), or one more than
the step the result says it resumed from (``resumed_from_step``); never a
silent step back.
"""

from __future__ import annotations

import hashlib
import json
import random
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
# Words of an error that says the request was refused before it started (a draining router or
# worker): such a request must have been retried on another connection, never answered lost.
REFUSED_WORDS = ("draining", "takes no new work", "never started", "not started")


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
    answered_at: float = 0.0
    # A step's verdict on its session's counter, made when it was answered (the order matters):
    # the stdout it had to print, or why the state it printed cannot be the session's.
    expected: str | None = None
    state_problem: str | None = None


@dataclass
class SessionState:
    name: str
    steps: int = 0  # steps answered, lost ones included
    busy: bool = False
    ended: bool = False  # closed by the client, or lost
    lost: bool = False  # ended without the client's close: told so by an answer
    key: str | None = None  # its first result's session_key: a new pool attaches with it
    counter: int = 0  # the counter the last step answered normally printed
    maybe_ran: int = 0  # steps answered as lost since: each may or may not be in the state
    irregular: bool = False  # a step was lost or resumed from an older state: step numbers may skip


class Load:
    """Drives one ``readie pool`` at a time (:meth:`attach` swaps in a new one): a sender thread,
    a reader thread, and the ledger of every request sent."""

    def __init__(self, out: Path, rng: random.Random) -> None:
        self.out = out
        self.rng = rng
        self.requests: dict[str, Request] = {}
        self.strays: list[dict[str, Any]] = []  # answers naming no request in flight (late replies)
        self.problems: list[str] = []
        # Sessions that ended without the client closing them, by the phase that ended them.
        self.sessions_lost: Counter[str] = Counter()
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

    def attach(self, pool: PoolProcess) -> list[Request]:
        """Drive ``pool`` from now on. The open sessions of the last pool are attached to it by
        their keys (decision 32: a new connection continues a session); the attach requests are
        returned, sent before any other."""
        self._pool = pool
        self._reader = threading.Thread(target=self._read, args=(pool,), daemon=True)
        self._reader.start()
        attaches = []
        with self._lock:
            for session in self._sessions.values():
                if session.ended:
                    continue
                if session.key is None:  # its opening was lost: nobody was told its key
                    self._session_gone(session, self.phase)
                    continue
                rid = self._next_id("attach")
                session.busy = True
                line = {"id": rid, "session": session.name, "attach": session.key}
                attaches.append(Request(rid, "attach", self.phase, line, session.name))
        for request in attaches:
            self.send(request)
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, daemon=True)
            self._sender.start()
        return attaches

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
        return self._next_of(self.rng.choice(idle), sleep)

    def _next_of(self, session: SessionState, sleep: float) -> Request:
        """The session's next request (under the lock): a step, or its close after its last."""
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

    def step_sessions(self) -> list[Request]:
        """Every open session's next request, sent now (the load has stopped): a session whose
        sandbox a fault killed between its steps finds out here, in that fault's phase."""
        with self._lock:
            nexts = [self._next_of(s, 0.0) for s in self._sessions.values() if not s.ended and not s.busy]
        for request in nexts:
            self.send(request)
        return nexts

    def close_sessions(self) -> list[Request]:
        """Close every session still open (the load has stopped): the client's own end of them."""
        closes = []
        with self._lock:
            for session in self._sessions.values():
                if not session.ended and not session.busy:
                    session.busy = session.ended = True
                    rid = self._next_id("close")
                    closes.append(Request(rid, "close", self.phase, {"id": rid, "session": session.name, "close": True}, session.name))
        for request in closes:
            self.send(request)
        return closes

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
            request.answered_at = request.answered_at or time.monotonic()
            if request.session is not None and len(request.answers) == 1:
                self._session_answered(self._sessions[request.session], request, message)
            self._answered.notify_all()

    def _session_answered(self, session: SessionState, request: Request, message: dict[str, Any]) -> None:
        """Follow a session's life through its answers, in their order (under the lock)."""
        session.busy = False
        error = message.get("error")
        if request.kind == "attach":
            if error is not None or not message.get("attached"):
                self._session_gone(session, request.phase)
            return
        if request.kind != "step":
            return
        session.steps += 1
        session.key = session.key or message.get("session_key")
        if error is not None:
            if message.get("session_ended"):
                self._session_gone(session, request.phase)
            else:  # lost (or refused): the session goes on, with or without this step's effect
                session.maybe_ran += 1
                session.irregular = True
            return
        resumed = message.get("resumed_from_step")
        try:
            printed = int(str(message.get("stdout", "")).strip())
        except ValueError:
            request.state_problem = "its stdout is not the session's counter"
            return
        if resumed is None:
            fits = session.counter + 1 <= printed <= session.counter + 1 + session.maybe_ran
            why = f"the session's counter was {session.counter} (+{session.maybe_ran} lost steps)"
        else:  # resumed from an older image: its counter is that step's, and the result says so
            fits = isinstance(resumed, int) and 0 <= resumed <= session.counter + session.maybe_ran and printed == resumed + 1
            why = f"it resumed from step {resumed}; the counter was {session.counter} (+{session.maybe_ran} lost steps)"
        # A resumed step is numbered from the state it resumed from, which can be older than
        # the last step answered (a worker killed before an idle session's checkpoint was written).
        if fits and not session.irregular and resumed is None and message.get("step") != request.step:
            request.state_problem = f"step {message.get('step')} where {request.step} was due"
        elif fits:
            request.expected = f"{printed}\n"
        else:
            request.state_problem = f"printed {printed}, but {why} (a silent restart or step back?)"
        session.counter, session.maybe_ran = printed, 0
        session.irregular = session.irregular or resumed is not None

    def _session_gone(self, session: SessionState, phase: str) -> None:
        """A session ended that the client did not close: lost, if the client had been told of
        its state (a step answered); one whose opening failed is only that request lost."""
        if not session.ended and session.counter > 0:
            self.sessions_lost[phase] += 1
        session.ended = session.lost = True

    # -- accounting

    def known_entries(self) -> set[str]:
        """The store entries of the sessions whose key the client was told (decision 32: an entry
        is named by the SHA-256 of its session's key)."""
        return {hashlib.sha256(s.key.encode()).hexdigest() for s in self._sessions.values() if s.key}

    def lost_entries(self) -> set[str]:
        """The store entries of the sessions that ended without the client's close."""
        return {hashlib.sha256(s.key.encode()).hexdigest() for s in self._sessions.values() if s.key and s.lost}

    def keyless_sessions(self) -> int:
        """Sessions opened whose key never reached the client: the opening's answer was lost or an
        error. Such a session may still live on a worker, and nobody can name it to close it."""
        return sum(1 for s in self._sessions.values() if s.key is None and s.steps > 0)

    def history(self, entry: str) -> str:
        """What the client did with the session whose store entry is ``entry`` (named by the SHA-256
        of its key): its name and requests, for a report of what the store kept."""
        named = [s.name for s in self._sessions.values() if s.key and hashlib.sha256(s.key.encode()).hexdigest() == entry]
        if not named:
            return f"{entry[:12]}: no session of this client"
        requests = sorted((r for r in self.requests.values() if r.session == named[0]), key=lambda r: r.sent_at)
        return f"{entry[:12]} is {named[0]}: " + "; ".join(
            f"{r.id} ({r.phase}) sent {r.sent_at:.2f} answered {r.answered_at:.2f}: "
            + ("closed" if (r.answers or [{}])[0].get("closed") else str({k: v for k, v in (r.answers or [{}])[0].items() if k in ("error", "stdout", "lost", "resumed_from_step")}))
            for r in requests
        )

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
        if request.kind == "attach":
            if answer.get("attached"):
                return "answered"
            return "lost" if (answer.get("error") or {}).get("type") in LOSS_TYPES | {"RequestError"} else f"attach refused: {answer}"
        error = answer.get("error")
        if error is not None:
            if request.kind == "step" and error["type"] in LOSS_TYPES:
                if answer.get("session_ended") or answer.get("lost") or refused(answer):
                    return "lost"
                return f"a failed step that neither ended its session nor said it was lost: {answer}"
            if request.kind == "host" and error["type"] == "HostError" and "no reply can come" in error["message"]:
                return "lost"  # the client closed stdin: the call could not be answered, and the job was told
            return _lost_or(answer, "an error no fault explains")
        if request.kind != "probe" and (ran != 1 or request.id not in finished):
            return f"succeeded but ran {ran} times (finished: {request.id in finished}): {answer}"
        if request.state_problem is not None:
            return f"{request.state_problem}: {answer}"
        expected = {
            "job": f"{request.id}\n",
            "host": f"{request.id}!\n",
            "stream": "0\n1\n2\n",
            "step": request.expected,
            "probe": "serving\n",
        }[request.kind]
        if (answer.get("exit"), answer.get("stdout")) != (0, expected):
            return f"wrong result (a silent restart?), wanted {expected!r}: {answer}"
        if request.kind == "stream":
            streamed = "".join(o["data"] for o in request.outputs if o.get("stream") == "stdout")
            if not expected.startswith(streamed):
                return f"streamed {streamed!r}, not a prefix of the result's stdout"
        return "answered"


def _lost_or(answer: dict[str, Any], why: str) -> str:
    error = answer.get("error") or {}
    return "lost" if error.get("type") in LOSS_TYPES else f"{why}: {answer}"


def refused(answer: dict[str, Any]) -> bool:
    """Whether an error answer says its request was refused before it started."""
    message = str((answer.get("error") or {}).get("message", "")).lower()
    return any(words in message for words in REFUSED_WORDS)


def table(rows: list[dict[str, Any]]) -> str:
    """The suite's report: one row per fault kind."""
    columns = ["fault", "injected", "accepted", "answered", "lost-with-error", "sessions lost", "unstarted lost",
               "duplicated", "problems", "recovery max s"]
    lines = [columns] + [[str(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    rendered = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines]
    return "\n".join([rendered[0], "  ".join("-" * w for w in widths), *rendered[1:]])
