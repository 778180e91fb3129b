"""``readie pool``'s real engine on stdin/stdout over a fake backend: no sandboxes, the real protocol.

The client's tests start it as the pool command (``Pool(command=[python,
this file])``); its arguments (``pool --workers=N ...``) are read for the
worker count only. A job's code is a script of verbs, one per line:

* ``say TEXT``: print TEXT (streamed as it is said, to a request that asks); ``sleep S``: take S seconds;
* ``warn TEXT``: print TEXT on stderr;
* ``raise``: end with an uncaught ValueError (a job failure, exit 1);
* ``call NAME ARGS KWARGS``: call host function NAME (ARGS and KWARGS JSON)
  and print the reply's answer, ``{"result": ...}`` or ``{"error": ...}``;
* ``exit``: in a session, end it;
* ``cat PATH``: print the text of a file the request sent (``files``);
* ``write PATH TEXT``, ``png PATH``: save TEXT, or a small PNG, in the workspace;
* ``show``: end with a value that renders as that PNG (``_repr_png_``);
* ``lose``: in a session, the step's worker is lost (StepLost; the session goes on).

Sessions have keys (decision 32), and the store holds one detached session of four steps under
:data:`STORED_KEY`, for an attach to find.

A request's ``collect`` brings back what it sent and what the script saved, by ``fnmatch`` (the
real matching is the worker's).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import fnmatch
import json
import sys
import time

from readie_pool.testing import FakeBackend, FakeSession, ok_outcome, serve_stdio
from readie_protocol.events import ErrorInfo, Value
from readie_protocol.workspace import Collected
from readie_protocol.cancel import NEVER, Cancellation
from readie_worker.errors import ErrorType
from readie_worker.jobs import CANCELLED_MESSAGE, CodeJob, HostCall, HostFunction, JobOutcome, OutputChunk, OutputSink

#: The key of the session the fake store holds from the start (not a real key: a fake's).
STORED_KEY = "stored-session-key-of-the-engine-pool"

#: What ``png`` saves: a PNG's signature and a little more, enough for a client to tell it by.
PNG = b"\x89PNG\r\n\x1a\n" + bytes(24)


class ScriptedBackend(FakeBackend):
    async def _run(  # FakeBackend.run's job: it hands the outcome to its ``then`` too
        self, job: CodeJob, job_id: str | None, host: HostFunction | None = None, cancel: Cancellation = NEVER,
        output: OutputSink | None = None,
    ) -> JobOutcome:
        out, err, error, status = [], [], None, 0
        sent, saved, value = dict(job.files), {}, None
        for line in job.code.splitlines():
            verb, _, arg = line.partition(" ")
            if verb in ("say", "warn"):
                (out if verb == "say" else err).append(arg)
                if output is not None:
                    chunk = OutputChunk("stdout" if verb == "say" else "stderr", f"{arg}\n")
                    await asyncio.to_thread(output, chunk)
            elif verb == "sleep":
                deadline = time.monotonic() + float(arg)
                while time.monotonic() < deadline:  # as a worker does: a cancel stops the job at once
                    if cancel.cancelled:
                        return JobOutcome.failure(ErrorType.POOL_WORKER, CANCELLED_MESSAGE, 0, "fake")
                    await asyncio.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
            elif verb == "cat":
                out.append(sent[arg].decode())
            elif verb == "write":
                path, _, text = arg.partition(" ")
                saved[path] = text.encode()
            elif verb == "png":
                saved[arg] = PNG
            elif verb == "show":
                value = Value("<image>", data={"image/png": base64.b64encode(PNG).decode()})
            elif verb == "raise":
                error, status = ErrorInfo("ValueError", "boom", job.name, 1, None), 1
            elif verb == "call" and host is not None:
                name, args, kwargs = arg.split(" ")
                call = HostCall(len(out) + 1, name, tuple(json.loads(args)), json.loads(kwargs), time.monotonic() + 5)
                reply = await asyncio.to_thread(host, call)
                answer = {"result": reply.result} if reply.error is None else {"error": reply.error}
                out.append(json.dumps(answer, sort_keys=True))
        outcome = ok_outcome("".join(f"{text}\n" for text in out), exit=status, error=error)
        workspace = {**sent, **saved}
        collected = Collected({
            path: data for path, data in workspace.items()
            if any(fnmatch.fnmatchcase(path, pattern.removeprefix("**/")) for pattern in job.collect)
        }) if job.collect else None
        return dataclasses.replace(
            outcome, stderr="".join(f"{text}\n" for text in err), value=value, collected=collected,
        )


def main() -> int:
    workers = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--workers=")), 2)
    backend = ScriptedBackend(keys=True, lose=lambda job: job.code == "lose")
    backend.store[STORED_KEY] = FakeSession(backend, CodeJob(checkpoint="fake", code=""), steps=4, key=STORED_KEY)
    return serve_stdio(backend, workers=workers)


if __name__ == "__main__":
    sys.exit(main())
