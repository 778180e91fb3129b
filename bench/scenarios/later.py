"""Scenarios 4 (session step latency), 5 (host-function round trip) and 11 (streamed output).

Both go through ``readie pool`` the way the pool spec says a client would.
Where the pool refuses (the feature has not landed), the entry is
``available: false`` with the pool's own reason; the day it answers, the
measurement below runs without a change here.

Session steps take turns with fresh warm-pool jobs (settled before each), so
"a step in a live session vs a new sandbox per step" is a side-by-side ratio.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from readie_protocol.requests import Refused as LineRefused
from readie_protocol.requests import Request, parse_request
from readie_protocol.wire import RequestId

from .._bench import Bench
from .._floors import chained_call_us, measured, process_round_trip_us, sandbox_echo_us
from .._jobs import PRINT
from .._pool_client import PoolClient, PoolError
from .._stats import ratio, summary

STEP_TIMEOUT_S = 60.0
HOST_FUNCTION_CODE = """\
import json, time
from readie_host import echo
times = []
for i in range({calls}):
    t = time.perf_counter()
    assert echo(i) == i
    times.append((time.perf_counter() - t) * 1000)
print(json.dumps(times))
"""

# The same calls with the sandbox's own steps timed (issue 31's breakdown): the honest
# client's parts, wrapped from the job itself (the channel is the running call's), in µs.
HOST_SPLIT_CODE = """\
import json, time
from readie_executor import _channel, hostwire
from readie_executor.jobs import _host
parts = {{}}
def timed(owner, name, part):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        started = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            parts.setdefault(part, []).append((time.perf_counter_ns() - started) / 1000)
    setattr(owner, name, wrapper)
timed(hostwire, "encode_call", "encode_call")
timed(_channel.Channel, "send", "send")
timed(_channel.Channel, "receive", "wait_for_reply")
timed(_host, "_decode_reply", "decode_reply")
from readie_host import echo
for i in range({calls}):
    assert echo(i) == i
print(json.dumps(parts))
"""


class Refused(Exception):
    """The pool answered, but does not offer the feature (RequestError), or failed at it."""


# Ten flushed prints: the sandbox gathers them into one output event (50 ms), so the
# figure is what streaming adds to a job, not what ten events cost.
STREAMED_CODE = "for n in range(10):\n    print('line', n, flush=True)\n"


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    return {"session_step": _sessions(bench), "host_function": _host_function(bench), "stream": _stream(bench)}


def _unavailable(reason: str) -> dict[str, Any]:
    return {"available": False, "reason": reason}


def pool_request(pool: PoolClient, body: dict[str, Any], **kwargs: Any) -> tuple[dict[str, Any], float]:
    """Send a request line's fields (its id ours); the pool protocol's own parser makes the typed request."""

    def make(request_id: RequestId) -> Request:
        request = parse_request(json.dumps({"id": request_id, **body}))
        if isinstance(request, LineRefused):
            raise Refused(f"not a request: {request.error}")
        return request

    try:
        result, elapsed_s = pool.request(make, STEP_TIMEOUT_S, **kwargs)
    except PoolError as exc:
        raise Refused(f"readie pool failed: {exc}") from None
    error = result.get("error")
    if error and error.get("type") == "RequestError":
        raise Refused(f"readie pool: {error.get('message')}")
    return result, elapsed_s


# ---------------------------------------------------------------- 4. sessions


def _sessions(bench: Bench) -> dict[str, Any]:
    entries = {}
    for name in bench.load_names:
        if name not in bench.pools:
            return _unavailable(bench.pool_problems.get(name, "no readie pool"))
        try:
            entries[name] = _session(bench, name)
        except Refused as exc:
            return _unavailable(str(exc))
    return {
        "available": True,
        "what": "one step (x += 1; print(x)) in a live session vs one print(1) job on a fresh warm-pool "
        "sandbox, taking turns; request line to result line",
        "checkpoints": entries,
    }


def _session(bench: Bench, name: str) -> dict[str, Any]:
    pool, warm = bench.pools[name], bench.warm_path(name)
    session = f"bench-{name}"
    bench.settle()
    first, first_s = pool_request(pool, {"session": session, "code": "x = 0\n"})
    if first.get("exit") != 0:
        raise Refused(f"the session's first step failed: {first.get('error')}")
    steps, jobs, problems = [], [], []
    for step in range(1, bench.settings.session_steps + 1):
        bench.settle()
        result, elapsed_s = pool_request(pool, {"session": session, "code": "x += 1\nprint(x)\n"})
        if result.get("exit") == 0 and result.get("stdout") == f"{step}\n":
            steps.append(elapsed_s * 1000)
        else:
            problems.append(str(result.get("error") or result.get("stdout")))
        bench.settle()
        sample = warm.run(PRINT)
        if sample.error is None:
            jobs.append(sample.elapsed_ms)
    pool_request(pool, {"session": session, "close": True})
    step_ms, job_ms = summary(steps), summary(jobs)
    return {
        "first_step_ms": round(first_s * 1000, 1),  # takes a warm sandbox and runs the first step
        "step_ms": step_ms,
        "warm_job_ms": job_ms,
        "warm_job_over_step": ratio(job_ms, step_ms),
        "errors": problems[:3],
    }


# ---------------------------------------------------------------- 5. host functions


def _host_function(bench: Bench) -> dict[str, Any]:
    """Round trips timed inside the sandbox: call -> pool -> this client -> pool -> return.

    On the smallest checkpoint: the figure is about the channel, not the imports.
    """
    name = bench.names[0]
    pool = bench.pools.get(name)
    if pool is None:
        return _unavailable(bench.pool_problems.get(name, "no readie pool"))
    bench.settle()
    try:
        times = host_call_times(pool, bench.settings.host_calls)
    except Refused as exc:
        return _unavailable(str(exc))
    return {
        "available": True,
        "what": "one host-function call and its JSON reply, timed inside the sandbox",
        "checkpoint": name,
        "round_trip_ms": summary(times, digits=3),
        "breakdown_us": _host_breakdown(bench, pool, name),
    }


def _host_breakdown(bench: Bench, pool: PoolClient, name: str) -> dict[str, Any]:
    """Where a round trip goes: the sandbox's own parts (p50 of each, timed in another task), and
    the pool and client's share, measured by a pool without sandboxes (``bench._host_pool``);
    what is left is the sandbox's socket, gVisor and the worker's frame checks."""
    calls = bench.settings.host_calls
    body = {"functions": ["echo"], "code": HOST_SPLIT_CODE.format(calls=calls)}
    bench.settle()
    try:
        result, _ = pool_request(pool, body, on_call=_echo)
        parts = json.loads(result["stdout"])
    except (Refused, ValueError, TypeError, KeyError) as exc:
        return {"available": False, "reason": f"the timed task failed: {exc}"}
    in_sandbox = {part: summary(times, digits=1)["p50"] for part, times in parts.items()}
    try:
        fake = PoolClient.spawn([sys.executable, "-m", "bench._host_pool"], bench.scratch / "host-pool.log")
    except PoolError as exc:
        return {"available": False, "reason": f"the pool without sandboxes did not start: {exc}"}
    try:
        bench.settle()
        result, _ = pool_request(fake, {"functions": ["echo"], "code": str(calls)}, on_call=_echo)
        pool_and_client = summary([float(t) for t in json.loads(result["stdout"])], digits=1)
    except (Refused, ValueError, TypeError, KeyError) as exc:
        return {"available": False, "reason": f"the pool without sandboxes failed: {exc}"}
    finally:
        fake.close()
    samples = bench.settings.floor_samples
    bench.settle()
    process_us = measured(lambda: process_round_trip_us(samples), digits=1)
    return {
        "in_sandbox_p50": in_sandbox,
        "pool_and_client": pool_and_client,
        "sandbox_echo_us": measured(lambda: _in_sandbox(bench, name, sandbox_echo_us, samples), digits=1),
        "process_round_trip_us": process_us,
        "chained_call_us": measured(lambda: _in_sandbox(bench, name, chained_call_us, samples), digits=1),
        "what": "in_sandbox_p50: the honest client's steps inside the sandbox (wait_for_reply holds "
        "everything outside it); pool_and_client: a round trip from the worker's host callback to "
        "this client and back to the pool's loop, where a reply goes into the sandbox, in readie "
        "pool without sandboxes; the floors (bench._floors): "
        "sandbox_echo_us, one byte into a sandbox of the same checkpoint and back, echoed by a "
        "thread doing nothing else; process_round_trip_us, one byte to a child process and back; "
        "chained_call_us, the two chained as a call chains them: a byte from the sandbox to a child "
        "process and back into the sandbox, timed in the sandbox",
    }


def _in_sandbox(bench: Bench, name: str, floor: Callable[..., list[float]], samples: int) -> list[float]:
    """``floor`` (a sandbox's echo or chain) on a fresh restore of ``name``, destroyed after."""
    sandbox = bench.restore_factory(name).create()
    try:
        return floor(sandbox, samples, before=bench.settle)
    finally:
        sandbox.destroy()


def _echo(event: dict[str, Any]) -> dict[str, Any]:
    return {"result": (event.get("args") or [None])[0]}


# ---------------------------------------------------------------- 11. streamed output


def _stream(bench: Bench) -> dict[str, Any]:
    """The same job with and without ``"stream": true``, taking turns on a settled warm pool."""
    name = bench.names[0]
    pool = bench.pools.get(name)
    if pool is None:
        return _unavailable(bench.pool_problems.get(name, "no readie pool"))
    times: dict[bool, list[float]] = {False: [], True: []}
    events = 0
    for turn in range(bench.settings.session_steps):
        for stream in (False, True) if turn % 2 else (True, False):
            bench.settle()
            try:
                result, elapsed_s = pool_request(pool, {"code": STREAMED_CODE, "stream": stream})
            except Refused as exc:
                return _unavailable(str(exc))
            if result.get("exit") == 0:
                times[stream].append(elapsed_s * 1000)
                events += int(stream) * result.get("output_events", 0)
    plain, streamed = summary(times[False]), summary(times[True])
    return {
        "available": True,
        "what": "ten flushed prints, with and without stream: true, taking turns; request line to result line",
        "checkpoint": name,
        "plain_ms": plain,
        "stream_ms": streamed,
        "stream_over_plain": ratio(streamed, plain),
        "output_events_per_job": round(events / max(1, len(times[True])), 1),
    }


def host_call_times(pool: PoolClient, calls: int) -> list[float]:
    """One task calling ``echo`` ``calls`` times; each round trip in ms, timed inside the sandbox."""

    body = {"functions": ["echo"], "code": HOST_FUNCTION_CODE.format(calls=calls)}
    result, _ = pool_request(pool, body, on_call=_echo)
    if result.get("exit") != 0:
        raise Refused(f"the pool accepted the task but it failed: {result.get('error')}")
    try:
        return [float(t) for t in json.loads(result["stdout"])]
    except (ValueError, TypeError, KeyError):
        raise Refused(f"unexpected output: {str(result.get('stdout'))[:200]!r}") from None
