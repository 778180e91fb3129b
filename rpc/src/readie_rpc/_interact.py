"""The serving side of the ``Interact`` stream: a job or a session, its host calls relayed to the client.

One stream, three threads, each blocking on one thing:

* the *reader* pulls the client's messages off the request stream into a
  bounded inbox (grpc's own flow control pushes back when it is full);
* the *driver* runs the job, or opens the session and runs its steps, on the
  runner (the in-process :class:`~readie_worker.core.Worker`, or a router's
  placement). Its host callback puts a ``call`` event in the outbox and waits
  in the inbox for the matching ``reply``, both up to the task's deadline;
  for a task that streams its output, its output sink puts ``output`` events
  there too (decision 16);
* grpc's handler thread yields the outbox's events onto the response stream.

A short reply to the waiting call is sent on by the reader itself where the
call lets it (``HostCall.reply_now``: into the sandbox on a worker, onto the
worker's stream on a router), before the driver wakes to read it too; only
when the driver waits in the inbox with nothing ahead of the reply, so that
the reply sent is the one the driver takes, after every message before it
(a protocol break, the stale reply too many) has had its effect.

Between steps an open session may also be asked to ``hibernate`` or to
``fork`` (decision 0022); a fork waits in the server's table (``_forks``)
for a second stream whose first message is ``attach`` with the token the
answer carried, and that stream is then the fork's life. Between steps, too,
its workspace's files move a chunk at a time (``upload``, ``download``,
``list_files``, decision 31), each answered before the next request is
read; a long transfer holds only its own stream's threads, never another's.

A session without a key lives as long as its stream. When the client's side
ends, whether it closed it or cancelled or went away, steps not yet started are
dropped (the two look alike to the reader for a moment: grpc ends the request
iterator cleanly on a cancel too, before its termination callback runs), a
waiting host call is answered with an error, and the driver closes the session
(its sandbox is destroyed). A session with a key (decision 32) outlives it: the
driver detaches it into the store instead, and only ``close`` ends it;
``attach`` with its key continues it on a new stream. When the server drains,
:meth:`Interaction.hand_over` has the driver detach such a session after its
running step and end the stream with ``handed_over``. A step running then
finishes after a clean close; after a cancel (the RPC terminated: cancelled,
deadline, connection lost) it is stopped at once. The first message of a stream
is always served. The server's stream place is given back only when the driver
is done, so work a cancelled stream left running still counts. A client that
breaks the protocol (a first message that is neither ``job``, ``open_session``
nor ``attach``, or none within :data:`FIRST_MESSAGE_S`; a job message
mid-session; a reply that is not JSON) gets INVALID_ARGUMENT naming the field, and
its session ends. Steps sent before the previous one's result are not a break:
they wait (a few at most, :data:`INBOX_MESSAGES`) and run in order, even while
a host call waits, as long as the client's side stays open.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import grpc
import structlog

from ._client_wire import setup_message
from ._convert import Ceiling, code_job, lost_step_response, run_job_response, session_step
from ._files_wire import FILE_EVENTS, answer_file_request
from ._forks import WaitingForks
from ._session_wire import attach_names, forked_message, hibernated_message
from ._host_wire import call_message, output_message, reply_from_message
from ._mailbox import Mailbox, Closed
from ._proto.readie.v1 import worker_pb2 as pb
from ._status import on_the_wire
from readie_protocol.cancel import NEVER, Cancellation
from readie_protocol.errors import ErrorType, NotStarted, PoolWorkerError, RequestError, SandboxSetupError, StepLost
from readie_policy.jobs import MAX_EARLY_REPLY_BYTES, HostCall, HostReply, JobOutcome, OutputChunk, OutputSink, StepOutcome
from readie_policy.policy import NO_LIMITS
from readie_policy.runner import JobRunner, SessionHandle

__all__ = ["Interaction", "Mailbox", "key_of"]

log = structlog.get_logger("readie.grpc")

# A client that keeps to the protocol has one message in flight (a step, or
# the reply to the one waiting call); a few more absorb a late reply racing
# the next step. Beyond that the reader stops reading and grpc pushes back.
INBOX_MESSAGES = 4
# Events waiting for grpc to send them. The driver blocks past this, and the
# job with it: a client that stops reading stops its own job's calls (until
# the call's deadline).
OUTBOX_EVENTS = 4
# How long a result may wait for a client that stopped reading before the
# stream is given up; by then the job or step is over and its slot free.
RESULT_SEND_S = 60.0
# Replies to no waiting call that one stream may send: a reply can honestly
# lose a race with the task's deadline, but not thousands of times.
MAX_STALE_REPLIES = 64
# How long, in all, a task's output events may wait for a client that reads
# slowly or not at all; then the task's later output goes only into its result.
# Short, and per task rather than per event: the task's exchange with its
# sandbox waits meanwhile, and its timeout is only checked between frames.
OUTPUT_SEND_S = 5.0
# A stream holds a server thread from its start: one that does not say what
# it wants within this long is refused, and its thread freed.
FIRST_MESSAGE_S = 30.0

class Interaction:
    """One Interact stream: :meth:`start` it, then :meth:`events` is the handler's response iterator."""

    def __init__(
        self,
        runner: JobRunner,
        requests: Iterator[pb.InteractRequest],
        context: grpc.ServicerContext,
        job_id: str,
        ceiling: Ceiling = Ceiling(NO_LIMITS, {}),
        bind: Callable[..., None] = lambda **fields: None,
        done: Callable[[], None] = lambda: None,
        forks: WaitingForks | None = None,
    ) -> None:
        self._runner = runner
        self._forks = forks if forks is not None else WaitingForks()  # the server's: forks outlive this stream
        self._requests = requests
        self._context = context
        self._job_id = job_id
        self._ceiling = ceiling  # what the server's operator lets a request ask for
        self._bind = bind  # the call's log line
        self._done = done  # called once the driver has finished, however the stream ended
        self._inbox: Mailbox[pb.InteractRequest] = Mailbox(INBOX_MESSAGES)
        self._outbox: Mailbox[pb.InteractEvent] = Mailbox(OUTBOX_EVENTS)
        self._held: deque[pb.InteractRequest] = deque()  # steps that came while a host call waited
        self._error: BaseException | None = None
        self._broken: RequestError | None = None  # the client broke the protocol during a call
        self._stale_replies = 0
        self._waiting: HostCall | None = None  # the call the driver waits on a reply for
        self._output_wait_s = OUTPUT_SEND_S  # what the running task's events may still wait; 0: not streaming
        self._client_done = False  # the request stream ended: no further step starts
        self._handing_over = threading.Event()  # the server drains (hand_over)
        self._detach_on_drain = False  # and its runner hands sessions over: each stream detaches its own
        self._ended = False  # a result ended the session
        self._released = False  # the session was closed by the client's word, or handed over
        # A drain waits for this stream: it opens or serves a session that may outlive it, and
        # the driver is not done yet (hands_over).
        self._hand_over_due = False
        # Set when the RPC ends (cancelled, deadline, client gone): the running job or step stops.
        self._cancel = Cancellation()

    def start(self) -> Interaction:
        # Called when the RPC ends for any reason, cancellation included: a
        # handler blocked on the outbox, or a driver blocked on the inbox, wakes.
        if not self._context.add_callback(self._hang_up):
            self._hang_up()  # it has ended already
        threading.Thread(target=self._read, name="interact-read", daemon=True).start()
        # Not joined: after a hang-up the driver finishes its job (the worker's
        # slot and deadline bound it), closes the session and calls ``done``.
        threading.Thread(target=self._drive, name="interact-drive", daemon=True).start()
        return self

    def events(self) -> Iterator[pb.InteractEvent]:
        """Events for the client, in order; raises what ended the stream badly (mapped by the caller)."""
        while not isinstance(event := self._outbox.get(), Closed):
            assert event is not None  # no timeout given
            yield event
        if self._error is not None:
            raise self._error

    @property
    def hands_over(self) -> bool:
        """Whether a drain still waits for this stream: a session's, handed over once its running
        step ends; a job's, or a keyless session's, is the runner's drain to wait for."""
        return self._hand_over_due and self._detach_on_drain

    def hand_over(self, detach: bool) -> None:
        """The server drains (decision 32): a stream that has not said what it wants is refused as
        not started. With ``detach`` (its runner hands sessions over), a session with a key is
        detached into the store once its running step (if any) is answered, and its stream ends
        with ``handed_over``; without, the runner's own drain lets go of it. Jobs, and sessions
        without a key, run on as before."""
        self._detach_on_drain = detach
        self._handing_over.set()
        self._inbox.wake()

    def _hang_up(self) -> None:
        self._inbox.close(discard=True)
        self._outbox.close(discard=True)
        self._cancel.cancel()

    def _read(self) -> None:
        try:
            for request in self._requests:
                early = self._reply_early if request.WhichOneof("kind") == "reply" else None
                if not self._inbox.put(request, taken_next=early):
                    return
        except Exception:  # noqa: BLE001 - the stream broke: the same as the client's side closing
            pass
        finally:
            self._client_done = True
            self._inbox.close()

    # -- the driver ---------------------------------------------------------

    def _drive(self) -> None:
        session: SessionHandle | None = None
        try:
            first = self._inbox.get(FIRST_MESSAGE_S, stop=self._handing_over.is_set)
            if first is None:
                if self._handing_over.is_set():
                    raise NotStarted("the server is draining; nothing of this stream ran")
                raise RequestError(f"no job or open_session within {FIRST_MESSAGE_S:.0f} s", field="kind")
            if isinstance(first, Closed):
                return  # the client left before asking anything
            kind = first.WhichOneof("kind")
            self._hand_over_due = kind in ("open_session", "attach")
            if kind == "job":
                job = code_job(first.job, self._context.time_remaining(), *self._ceiling)
                self._bind(kind="job", checkpoint=job.checkpoint, functions=len(job.functions))
                outcome = self._runner.run_job(
                    job, self._job_id, host=self._relay, cancel=self._cancel, output=self._output(first.job.stream_output)
                )
                self._check_protocol()
                self._send_last(pb.InteractEvent(result=run_job_response(outcome)))
            elif kind == "open_session":
                job = code_job(first.open_session, self._context.time_remaining(), *self._ceiling)
                self._bind(kind="session", checkpoint=job.checkpoint, functions=len(job.functions))
                output = self._output(first.open_session.stream_output)
                session, step = self._runner.open_session(
                    job, self._job_id, host=self._relay, cancel=self._cancel, output=output
                )
                self._bind(session=session.id)
                opened = run_job_response(step.outcome, step, session.id, session_key=key_of(session))
                self._serve_session(session, pb.InteractEvent(result=opened), step.step)
            elif kind == "attach":
                session, attached = self._attach(first.attach)
                self._bind(kind="session", session=session.id, attached=True)
                self._serve_session(session, pb.InteractEvent(attached=attached), attached.step)
            else:
                raise RequestError("the first message must be a job, open_session or attach", field=kind or "kind")
        except BaseException as exc:  # noqa: BLE001 - reported to the client by events()
            self._error = exc
        finally:
            try:
                if session is not None:
                    self._let_go(session)
            finally:
                self._hand_over_due = False
                self._outbox.close()
                self._done()

    def _attach(self, attach: pb.AttachSession) -> tuple[SessionHandle, pb.SessionAttached]:
        """The session an ``attach`` names, and the answer: its last step, its setup, a fork's key."""
        kind, name = attach_names(attach)
        if kind == "token":
            session, steps = self._forks.claim(name), 0
        else:
            session, steps = self._runner.attach_session(name, take_over=attach.take_over, cancel=self._cancel)
        fork_key = key_of(session) if kind == "token" else None
        setup = setup_message(session.job)
        return session, pb.SessionAttached(session_id=session.id, step=steps, key=fork_key or "", setup=setup)

    def _let_go(self, session: SessionHandle) -> None:
        """The stream is over: a session with a key outlives it (detached into the store), unless
        the client closed it, a result ended it, it was handed over already or the client broke
        the protocol; any other session is closed, as the stream was its life."""
        if self._released:
            return
        if key_of(session) is None or self._ended or isinstance(self._error, RequestError):
            session.close()
            return
        if session.ended:  # the runner let go of it already (its drain, a take-over elsewhere)
            return
        try:
            session.detach(NEVER)  # the call's own cancellation has fired: this must still finish
        except Exception as exc:  # noqa: BLE001 - the session has ended: nobody is left to tell
            log.warning("detaching a session failed; it has ended", session=session.id, error=str(exc))

    def _serve_session(self, session: SessionHandle, answer: pb.InteractEvent, steps: int) -> None:
        """Send ``answer`` (the opening step's result, or an attached session's ``attached``), then
        answer the session's requests until it ends; ``steps`` is the number of its last step."""
        self._ended = answer.WhichOneof("kind") == "result" and answer.result.session_ended
        # A session with a key is handed over when the server drains; one without runs on, as ever.
        keeps = key_of(session) is not None
        self._hand_over_due = keeps

        def hand_over() -> bool:
            return keeps and self._detach_on_drain and self._handing_over.is_set()

        while True:
            self._check_protocol()
            if not self._send_last(answer):
                return  # the client is gone or stopped reading: the session ends
            self._bind(steps=steps)
            if self._ended:
                return
            request = self._next_request(hand_over)
            if request is None and hand_over():
                self._hand_over(session, steps)
                return
            if request is None:  # the client's side ended: the session outlives it or ends with it (_let_go)
                return
            kind = request.WhichOneof("kind")
            if kind == "close":
                self._released = True
                session.close()
                return
            if session.ended and keeps and self._handing_over.is_set():  # the runner's drain let go of it
                self._released = True
                self._send_last(pb.InteractEvent(handed_over=pb.SessionHandedOver(step=steps)))
                return
            if (kind in ("hibernate", "fork") or kind in FILE_EVENTS) and session.ended:  # as for a step: not the client's doing
                raise PoolWorkerError(f"session {session.id} was closed by the worker")
            if kind == "hibernate":
                answer = pb.InteractEvent(hibernated=_hibernate(session, self._cancel))
                continue
            if kind == "fork":
                answer = pb.InteractEvent(forked=self._fork(session))
                continue
            if kind in FILE_EVENTS:
                answer = answer_file_request(session, request, self._cancel)
                continue
            if kind != "step":
                raise RequestError(
                    "an open session takes steps, replies, hibernate, fork, upload, download, list_files and close only",
                    field=kind or "kind",
                )
            try:
                asked = session_step(request.step, self._ceiling.limits)
            except RequestError as refused:  # as in the pool protocol: the step is refused, the session goes on
                outcome = JobOutcome.failure(ErrorType.REQUEST, str(on_the_wire(refused)), 0, "")
                answer = pb.InteractEvent(result=run_job_response(outcome, StepOutcome(outcome, steps, False), session.id))
                continue
            if session.ended:  # the worker closed it between steps (a drain): not the client's doing
                raise PoolWorkerError(f"session {session.id} was closed by the worker")
            try:
                step = session.run_step(
                    asked,
                    job_id=self._job_id,
                    host=self._relay,
                    # Stopped at once when the call ends (cancelled, deadline, client gone); a keyed
                    # session then goes on from its last stored state (the step is lost, decision 32).
                    cancel=self._cancel,
                    output=self._output(request.step.stream_output),
                )
            except StepLost as lost:  # a router's session whose worker was lost under the step: it goes on
                answer = pb.InteractEvent(result=lost_step_response(lost, steps + 1, session.id))
                continue
            except NotStarted:  # a draining worker refused the step before it ran: the session is as it was
                if not keeps:
                    raise
                self._hand_over(session, steps)  # the client sends the step again where the session goes
                return
            steps, self._ended = step.step, step.session_ended
            answer = pb.InteractEvent(result=run_job_response(step.outcome, step, session.id))

    def _hand_over(self, session: SessionHandle, steps: int) -> None:
        """The server drains: the session goes into the store, and the client hears where it is."""
        self._released = True
        session.detach(NEVER)  # what it raises has ended the session: the stream ends with its status
        self._bind(handed_over=True)
        self._send_last(pb.InteractEvent(handed_over=pb.SessionHandedOver(step=steps)))

    def _fork(self, session: SessionHandle) -> pb.SessionForked:
        """Fork between steps: the fork waits in the server's table for the stream that attaches
        to it. Refusals are answered and the session goes on, as for a hibernation."""
        try:
            fork, fork_ms = session.fork(self._cancel)
            return forked_message(fork_ms, self._forks.add(fork))
        except (RequestError, SandboxSetupError) as refused:
            return forked_message(refused=refused)

    def _next_request(self, stop: Callable[[], bool]) -> pb.InteractRequest | None:
        """The client's next step, skipping stale replies; None once its side ended, or once
        ``stop()`` holds (a hand-over: what the client sent and is not started stays unrun)."""
        if self._client_done or stop():
            return None
        if self._held:
            return self._held.popleft()
        while True:
            message = self._inbox.get(stop=stop)
            if isinstance(message, Closed) or message is None:
                return None
            if message.WhichOneof("kind") != "reply":
                return message
            self._stale_reply()

    def _send(self, event: pb.InteractEvent, timeout: float | None) -> bool:
        return self._outbox.put(event, timeout)

    def _send_last(self, event: pb.InteractEvent) -> bool:
        """Send what ends the driver's work (a result, a hand-over); False when it could not go.
        Then the client stopped reading (or left): grpc's send of the events before holds the
        handler's thread for as long as the client keeps the stream open, after this stream gave
        its place back. Ending the RPC frees that thread; on an RPC over already, it does nothing.
        (A call's or output's event that cannot go is that event's failure alone: the task goes on.)"""
        if self._send(event, RESULT_SEND_S):
            return True
        self._context.cancel()
        return False

    # -- host calls, on the driver's thread inside the job -------------------

    def _relay(self, call: HostCall) -> HostReply:
        """The runner's host callback: the call to the client, its reply back, by the task's deadline."""
        deadline = call.deadline if call.deadline is not None else time.monotonic() + RESULT_SEND_S
        event = pb.InteractEvent(call=call_message(call))
        self._waiting = call
        try:
            return self._wait_for_reply(call, event, deadline)
        finally:
            self._waiting = None

    def _wait_for_reply(self, call: HostCall, event: pb.InteractEvent, deadline: float) -> HostReply:
        if self._broken is not None or not self._send(event, _left(deadline)):
            return HostReply(error=f"{call.function}: the client is gone or not reading")
        while True:
            message = self._inbox.get(_left(deadline))
            if message is None:
                return HostReply(error=f"{call.function}: no reply from the client before the task's deadline")
            if isinstance(message, Closed):
                return HostReply(error=f"{call.function}: the client closed the stream")
            try:
                if self._hold(message):
                    continue
                call_id, reply = reply_from_message(message.reply)
                if call_id == call.call_id:
                    return reply
                self._stale_reply()
            except RequestError as exc:
                self._broken = exc  # raised once the job has ended; the job sees a failed call
                self._inbox.close(discard=True)
                return HostReply(error=f"{call.function}: the client broke the protocol")

    def _reply_early(self, request: pb.InteractRequest) -> None:
        """On the reader, a reply the driver takes next, having taken all before it (the inbox's
        ``taken_next``): a short one to the call it waits on goes on from here (see the module's
        doc). The driver reads it all the same; one that is not valid is its to refuse."""
        call = self._waiting  # the driver waits in the inbox: it sets and clears this outside
        message = request.reply
        if call is None or call.reply_now is None or message.call_id != call.call_id:
            return
        if message.ByteSize() > MAX_EARLY_REPLY_BYTES:
            return
        try:
            call.reply_now(reply_from_message(message)[1])
        except RequestError:
            pass
        except Exception:  # a bug (or no memory) costs this send, never the call nor the stream
            log.exception("sending a host call's reply from the stream's reader failed")

    def _output(self, stream: bool) -> OutputSink | None:
        """The output sink of a task that asked for its output as it is written."""
        self._output_wait_s = OUTPUT_SEND_S
        return self._forward_output if stream else None

    def _forward_output(self, chunk: OutputChunk) -> None:
        if self._output_wait_s <= 0:
            return
        started = time.monotonic()
        sent = self._send(pb.InteractEvent(output=output_message(chunk)), self._output_wait_s)
        self._output_wait_s = self._output_wait_s - (time.monotonic() - started) if sent else 0

    def _hold(self, message: pb.InteractRequest) -> bool:
        """Keep a step that came early for after this one; False for a reply; RequestError for anything else."""
        kind = message.WhichOneof("kind")
        if kind == "reply":
            return False
        if kind != "step":
            raise RequestError("only a reply or a later step may come while a host call waits", field=kind or "kind")
        if len(self._held) >= INBOX_MESSAGES:
            raise RequestError(f"more than {INBOX_MESSAGES} steps sent ahead", field="step")
        self._held.append(message)
        return True

    def _stale_reply(self) -> None:
        self._stale_replies += 1
        if self._stale_replies > MAX_STALE_REPLIES:
            raise RequestError(f"more than {MAX_STALE_REPLIES} replies to no waiting call", field="reply.call_id")

    def _check_protocol(self) -> None:
        if self._broken is not None:
            raise self._broken


def _hibernate(session: SessionHandle, cancel: Cancellation) -> pb.SessionHibernated:
    """Hibernate between steps: refusals are answered and the session goes on; any other
    failure has ended the session and ends the stream with its status."""
    try:
        return hibernated_message(session.hibernate(cancel))
    except (RequestError, SandboxSetupError) as refused:
        return hibernated_message(refused=refused)


def key_of(session: SessionHandle) -> str | None:
    """The session's key (decision 32); None for one that cannot outlive its holder, or from a
    runner older than keys (it has no ``key``: such a session is closed with its stream, as ever)."""
    return getattr(session, "key", None)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
