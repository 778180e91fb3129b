"""``readie pool`` without sandboxes, for the host-call breakdown: run as ``python -m bench._host_pool``.

The real engine on stdin and stdout (``readie_pool.testing.serve_stdio``),
with a backend whose job makes ``int(code)`` calls to ``echo`` on a thread,
as the worker does, timing each: what a host call costs between the worker's
host callback and the client's function, and back (the pool's loop, its
pipes, the client's reader and its threads), without gVisor and the frames.
A call ends where the worker's would send its reply into the sandbox: when
the pool's loop hands it to the call's ``reply_now``. Its result's stdout is
the list of round trips, in microseconds.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from readie_pool.testing import ok_outcome, serve_stdio
from readie_worker.jobs import HostCall, HostReply, JobOutcome

# A job's calls may wait for the client this long each (the pool's own deadline check).
CALL_DEADLINE_S = 60.0


class TimedCalls:
    async def run(
        self, job: Any, job_id: Any, host: Any = None, cancel: Any = None, output: Any = None, then: Any = None
    ) -> JobOutcome:
        calls = int(job.code)

        def make_calls() -> JobOutcome:
            deadline = time.monotonic() + CALL_DEADLINE_S
            times = []
            for call_id in range(1, calls + 1):
                handed: list[int] = []

                def reply_now(reply: HostReply, handed: list[int] = handed) -> bool:  # on the pool's loop
                    handed.append(time.perf_counter_ns())
                    return True

                started = time.perf_counter_ns()
                reply = host(HostCall(call_id, "echo", (call_id,), {}, deadline, reply_now=reply_now))
                times.append(((handed[0] if handed else time.perf_counter_ns()) - started) / 1000)
                if reply.result != call_id:
                    raise RuntimeError(f"echo({call_id}) came back as {reply}")
            outcome = ok_outcome(json.dumps(times))
            if then is not None:  # the backend contract: on the job's thread, before returning it
                then(outcome)
            return outcome

        return await asyncio.to_thread(make_calls)

    async def close(self) -> None:
        pass


if __name__ == "__main__":
    raise SystemExit(serve_stdio(TimedCalls(), workers=1))
