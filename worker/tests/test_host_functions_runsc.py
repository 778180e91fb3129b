"""Host functions (CodeAct) end to end: job code in a sandbox calls back into the worker.

Every test runs twice: in real gVisor sandboxes restored from the captured
checkpoints (marker ``runsc``), and in the unisolated development transport,
which runs the same executor code as a host process and needs neither runsc
nor checkpoints. The adversarial tests write frames on the executor's socket
by hand from inside the sandbox, as hostile job code would.

Jobs go through ``jobs.run_in_sandbox`` with a sandbox from the worker's warm
pool: what ``Worker.run_job(job, host=...)`` does for a job without mounts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from readie_executor.hostwire import MAX_CALLS_PER_TASK, MAX_RESULT_BYTES
from readie_worker._host_frames import MAX_REFUSED_FRAMES
from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import RequestError
from readie_worker.jobs import CodeJob, HostCall, HostReply, HostStats, JobOutcome, run_in_sandbox
from readie_worker.sandbox import Sandbox
from readie_worker.testing import CHANNEL_FORGER, FakeHost

from conftest import CHECKPOINTS  # noqa: E402


@pytest.fixture(scope="module", params=[pytest.param("runsc", marks=pytest.mark.runsc), "local"])
def worker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    if request.param == "runsc":
        request.getfixturevalue("checkpoints")  # fails when the checkpoints are stale
        config = WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={"base": 1}, slots=2)
    else:
        no_manifest = tmp_path_factory.mktemp("local") / "no-manifest.json"
        config = WorkerConfig.in_temp(no_manifest, allow_unisolated=True)
    worker = Worker(config).start()
    assert worker.isolated is (request.param == "runsc")
    yield worker
    worker.close()
    if worker.isolated:
        assert worker.runsc.list_ids() == []


def run(
    worker: Worker,
    code: str,
    host: object = None,
    *,
    sandbox: Sandbox | None = None,
    session: bool = False,
    **fields: object,
) -> JobOutcome:
    if "functions" not in fields:
        fields["functions"] = host.names if isinstance(host, FakeHost) else ()
    job = CodeJob(checkpoint="base", code=code, name="step.py", **fields)  # type: ignore[arg-type]
    own = sandbox is None
    sandbox = sandbox or worker.warm["base"].take()
    try:
        return run_in_sandbox(sandbox, job, (), host=host, session=session)  # type: ignore[arg-type]
    finally:
        if own:
            sandbox.destroy()


def search_hits(query: str, limit: int = 10) -> list[str]:
    return ["first hit", "second hit"][:limit]


# --------------------------------------------------------------------------- the honest path


def test_the_spec_transcript(worker):
    host = FakeHost(search=search_hits)
    outcome = run(worker, "from readie_host import search\nprint(search('readie', limit=2))", host)
    assert (outcome.exit, outcome.stdout, outcome.error) == (0, "['first hit', 'second hit']\n", None)
    assert host.calls == [HostCall(1, "search", ("readie",), {"limit": 2})]
    assert host.calls[0].deadline is not None
    assert outcome.host == HostStats(calls=1, replies=1, wait_us=outcome.host.wait_us)


def test_pynox_host_is_the_same_module(worker):
    code = "import pynox_host, readie_host\nassert pynox_host is readie_host\nprint(pynox_host.search('x', limit=1))"
    outcome = run(worker, code, FakeHost(search=search_hits))
    assert (outcome.exit, outcome.stdout) == (0, "['first hit']\n"), outcome


def test_only_declared_names_exist(worker):
    code = (
        "import readie_host\n"
        "print(sorted(name for name in dir(readie_host) if not name.startswith('__')))\n"
        "from readie_host import delete_everything\n"
    )
    host = FakeHost(search=search_hits)
    outcome = run(worker, code, host)
    assert outcome.stdout == "['HostError', 'search']\n"
    assert outcome.error.type == "ImportError" and "delete_everything" in outcome.error.message
    assert (outcome.error.file, outcome.error.line) == ("step.py", 3)
    assert host.calls == []


def test_without_functions_readie_host_offers_nothing(worker):
    outcome = run(worker, "import readie_host\nfrom readie_host import search\n")
    assert outcome.error.type == "ImportError"
    assert outcome.host == HostStats()


def test_functions_without_a_host_are_a_request_error(worker):
    with pytest.raises(RequestError, match="nothing here answers them") as caught:
        run(worker, "pass", None, functions=("search",))
    assert caught.value.field == "functions"


def test_host_error_carries_the_hosts_text(worker):
    def broken(*args, **kwargs):
        raise ConnectionError("backend unavailable")

    code = (
        "import readie_host\n"
        "try:\n"
        "    readie_host.search('x')\n"
        "except readie_host.HostError as exc:\n"
        "    print('caught:', exc)\n"
        "readie_host.search('again')\n"
    )
    outcome = run(worker, code, FakeHost(search=broken))
    assert outcome.stdout == "caught: backend unavailable\n"
    assert (outcome.error.type, outcome.error.message, outcome.error.line) == ("HostError", "backend unavailable", 6)
    assert "readie_host.HostError: backend unavailable" in outcome.stderr
    assert "readie_executor" not in outcome.stderr  # the bridge's frames are not the job's
    assert outcome.host.host_errors == 2


def test_an_exception_in_the_host_callback_becomes_an_error_reply(worker):
    def host(call: HostCall) -> HostReply:
        raise RuntimeError("the host itself broke")

    outcome = run(worker, "from readie_host import search\nsearch()", host, functions=("search",))
    assert outcome.error.type == "HostError"
    assert outcome.error.message == "search failed on the host: RuntimeError: the host itself broke"


def test_big_integers_and_unicode_cross_exactly(worker):
    code = (
        "from readie_host import echo\n"
        "sent = [2**64 + 1, -(2**200), 'é😀\\ud800', 0.1, None, True]\n"
        "back = echo(*sent, key=2**53 + 1)\n"
        "print(back == sent + [2**53 + 1], type(back[0]).__name__)\n"
    )
    host = FakeHost(echo=lambda *args, key: [*args, key])
    outcome = run(worker, code, host)
    assert outcome.stdout == "True int\n", outcome
    assert host.calls[0].args == (2**64 + 1, -(2**200), "é😀\ud800", 0.1, None, True)
    assert host.calls[0].kwargs == {"key": 2**53 + 1}


def test_deep_values_cross_both_ways(worker):
    depth = 100_000
    code = (
        "from readie_host import echo\n"
        f"value = []\nfor _ in range({depth}):\n    value = [value]\n"
        "back = echo(value)\n"
        "depth = 0\nwhile back:\n    back = back[0]\n    depth += 1\n"
        "print(depth)\n"
    )
    seen = []

    def echo(value):
        depth = 0
        probe = value
        while probe:
            probe = probe[0]
            depth += 1
        seen.append(depth)
        return value

    outcome = run(worker, code, FakeHost(echo=echo), timeout_ms=60_000)
    assert (outcome.exit, outcome.stdout) == (0, f"{depth}\n"), outcome
    assert seen == [depth]


def test_values_that_cannot_cross_are_refused_with_clear_errors(worker):
    code = (
        "from readie_host import search, HostError\n"
        "for bad in (float('nan'), {1, 2}, 'x' * 1_000_001):\n"
        "    try:\n"
        "        search(bad)\n"
        "    except (TypeError, ValueError) as exc:\n"
        "        print(type(exc).__name__, exc)\n"
        "try:\n"
        "    search('big')\n"
        "except HostError as exc:\n"
        "    print('HostError', exc)\n"
    )
    host = FakeHost(search=lambda query: "x" * (MAX_RESULT_BYTES + 1))
    outcome = run(worker, code, host)
    assert outcome.stdout.splitlines() == [
        "ValueError search(): nan is not JSON: only finite numbers can be sent",
        "TypeError search(): set is not JSON: send None, bool, int, float, str, list, tuple or dict (with str keys)",
        "ValueError search(): arguments too large: more than 1000000 bytes of JSON",
        "HostError the host's result cannot be sent: result too large: more than 1000000 bytes of JSON",
    ], outcome
    assert len(host.calls) == 1


def test_the_1001st_call_is_refused_without_reaching_the_host(worker):
    code = (
        "from readie_host import count, HostError\n"
        f"results = [count(i) for i in range({MAX_CALLS_PER_TASK})]\n"
        "print(results[-1])\n"
        "try:\n"
        "    count(-1)\n"
        "except HostError as exc:\n"
        "    print(exc)\n"
    )
    host = FakeHost(count=lambda index: index + 1)
    started = time.monotonic()
    outcome = run(worker, code, host, timeout_ms=120_000)
    elapsed = time.monotonic() - started
    assert outcome.stdout == "1000\ncount: this task has made its 1000 host calls; no more are allowed\n", outcome
    assert len(host.calls) == MAX_CALLS_PER_TASK
    assert [call.call_id for call in host.calls] == list(range(1, MAX_CALLS_PER_TASK + 1))
    assert outcome.host.calls == outcome.host.replies == MAX_CALLS_PER_TASK
    print(f"{MAX_CALLS_PER_TASK} calls in {elapsed:.2f} s ({worker.isolated=})")


def test_waiting_for_the_host_counts_against_the_timeout(worker):
    def slow(*args):
        time.sleep(3)
        return "too late"

    host = FakeHost(search=slow)
    started = time.monotonic()
    outcome = run(worker, "from readie_host import search\nprint(search('x'))", host, timeout_ms=1000)
    assert outcome.error.type == "TimeoutError" and outcome.exit is None, outcome
    assert outcome.stdout == ""  # the late reply was dropped with the sandbox
    deadline = host.calls[0].deadline
    # The job's clock starts once it has a sandbox, a little after ``started``: on a
    # loaded machine a warm take or a restore adds up to a few hundred ms (1.105 s seen).
    assert deadline is not None and started < deadline <= started + 1.0 + 0.5
    assert time.monotonic() - started < 10
    if worker.isolated:
        assert outcome.sandbox_id not in worker.runsc.list_ids()


def test_a_session_step_keeps_calling_with_the_sessions_functions(worker):
    sandbox = worker.warm["base"].take()
    try:
        first = FakeHost(search=lambda query: f"step 1: {query}")
        one = run(worker, "from readie_host import search\nprint(search('a'))", first, sandbox=sandbox, session=True)
        assert one.stdout == "step 1: a\n", one
        second = FakeHost(search=lambda query: f"step 2: {query}")
        two = run(worker, "print(search('b'))", second, sandbox=sandbox, session=True)  # imported in step 1
        assert two.stdout == "step 2: b\n", two
        assert [call.call_id for call in second.calls] == [1]  # each step is a task of its own
    finally:
        sandbox.destroy()


# --------------------------------------------------------------------------- a hostile job

# Finds the executor's connection among the process's descriptors and speaks
# framing v2 on it by hand: what hostile job code can always do.
FORGER = CHANNEL_FORGER

FORGED_FRAMES = r'''
frames = {
    "undeclared": b'{"call":{"call_id":1,"function":"delete_everything","args":[],"kwargs":{}}}',
    "wrong id": b'{"call":{"call_id":7,"function":"search","args":["x"],"kwargs":{}}}',
    "deep undeclared": b'{"call":{"call_id":1,"function":"nope","args":' + b"[" * 200_000 + b"]" * 200_000 + b',"kwargs":{}}}',
    "oversized": b'{"call":{"call_id":1,"function":"search","args":["' + b"x" * 1_500_000 + b'"],"kwargs":{}}}',
    "invalid utf-8": b'{"call":{"call_id":1,"function":"search","args":["\xff\xfe"],"kwargs":{}}}',
    "deep unclosed": b'{"call":{"call_id":1,"function":"search","args":' + b"[" * 400_000 + b"}}",
    "huge integer": b'{"call":{"call_id":1,"function":"search","args":[' + b"9" * 5000 + b'],"kwargs":{}}}',
    "extra field": b'{"call":{"call_id":1,"function":"search","args":[],"kwargs":{},"as_root":true}}',
    "NaN": b'{"call":{"call_id":1,"function":"search","args":[NaN],"kwargs":{}}}',
    "duplicate key": b'{"call":{"call_id":1,"function":"search","function":"search","args":[],"kwargs":{}}}',
    "not json": b'{"call":\x00\x01\x02',
}
for name, payload in frames.items():
    reply = ask(sock, payload)
    print(f"{name} | {reply['call_id']} | {reply['error']}")
from readie_host import search
print("honest |", search("still works"))
'''

FORGED = {"undeclared": 1, "wrong id": 7, "deep undeclared": 1}
JUNK = ["oversized", "invalid utf-8", "deep unclosed", "huge integer", "extra field", "NaN", "duplicate key", "not json"]


def test_forged_and_malformed_frames_never_reach_the_host(worker):
    host = FakeHost(search=lambda query: f"found {query}")
    outcome = run(worker, FORGER + FORGED_FRAMES, host, timeout_ms=60_000)
    assert outcome.exit == 0, outcome
    lines = dict(line.split(" | ", 1) for line in outcome.stdout.splitlines())
    for name, call_id in FORGED.items():
        assert lines[name].startswith(f"{call_id} | host call refused: "), (name, lines[name])
    for name in JUNK:
        assert lines[name].startswith("None | host call refused: "), (name, lines[name])
    assert "'delete_everything' is not a declared host function" in lines["undeclared"]
    assert "out of sequence: the next call is 1" in lines["wrong id"]
    assert "at most 1004096 are allowed" in lines["oversized"]
    assert "not UTF-8" in lines["invalid utf-8"]
    assert "more than 4300 digits" in lines["huge integer"]
    assert "unknown fields: as_root" in lines["extra field"]
    assert "NaN" in lines["NaN"] and "duplicate key" in lines["duplicate key"]
    assert lines["honest"] == "found still works"
    # Only the honest call reached the host, as call 1: refusals use up no id.
    assert host.calls == [HostCall(1, "search", ("still works",), {})]
    assert outcome.host == HostStats(
        calls=1, replies=1 + len(FORGED) + len(JUNK), junk=len(JUNK), forged=len(FORGED), wait_us=outcome.host.wait_us
    )


def test_a_flood_of_junk_ends_the_job_and_the_worker_keeps_serving(worker):
    flood = FORGER + (
        "for index in range(10_000):\n"
        "    send(sock, b'{\"call\":junk %d}' % index)\n"
        "print('flooded')\n"
    )
    host = FakeHost(search=search_hits)
    started = time.monotonic()
    outcome = run(worker, flood, host, timeout_ms=30_000)
    assert outcome.error.type == "PoolWorkerError", outcome
    assert f"at most {MAX_REFUSED_FRAMES} are allowed" in outcome.error.message
    assert outcome.host.junk == MAX_REFUSED_FRAMES + 1 and outcome.host.replies == MAX_REFUSED_FRAMES
    assert host.calls == []
    assert time.monotonic() - started < 20
    after = run(worker, "from readie_host import search\nprint(search('next'))", host)
    assert (after.exit, after.stdout) == (0, "['first hit', 'second hit']\n")


def test_a_frame_past_what_the_worker_reads_at_all_ends_the_job(worker):
    code = FORGER + "send(sock, b'{\"call\":' + b' ' * 3_000_000)\nprint(json.loads(receive(sock)))\n"
    host = FakeHost(search=search_hits)
    outcome = run(worker, code, host, max_output=0)
    assert outcome.error.type == "PoolWorkerError" and "exceeds the limit" in outcome.error.message, outcome
    assert host.calls == []
    assert run(worker, "print('next')", max_output=100).stdout == "next\n"


def test_replies_left_unread_are_skipped_by_the_honest_call(worker):
    code = FORGER + (
        "send(sock, b'{\"call\":\"junk, answered but never read\"}')\n"
        "send(sock, b'{\"call\":{\"call_id\":5,\"function\":\"nope\",\"args\":[],\"kwargs\":{}}}')\n"
        "from readie_host import search\n"
        "print(search('mine'))\n"
    )
    host = FakeHost(search=lambda query: f"answer to {query}")
    outcome = run(worker, code, host)
    assert (outcome.exit, outcome.stdout) == (0, "answer to mine\n"), outcome
    assert (outcome.host.junk, outcome.host.forged, outcome.host.calls) == (1, 1, 1)


def test_a_session_survives_replies_its_last_step_never_read(worker):
    sandbox = worker.warm["base"].take()
    try:
        host = FakeHost(search=lambda query: f"answer to {query}")
        one = run(worker, FORGER + "send(sock, b'{\"call\":0}')\nprint('left a reply unread')", host, sandbox=sandbox, session=True)
        assert (one.exit, one.host.junk) == (0, 1), one
        two = run(worker, "from readie_host import search\nprint(search('next step'))", host, sandbox=sandbox, session=True)
        assert (two.exit, two.stdout) == (0, "answer to next step\n"), two
    finally:
        sandbox.destroy()


def test_the_job_can_forge_its_own_result_but_not_a_call(worker):
    # What a job may always do (decision 2): answer for itself. A forged result
    # is checked like any other; it cannot make the worker call the host.
    code = FORGER + (
        "fake = {'exit': 0, 'system_exit': False, 'timed_out': False, 'stdout': 'forged\\n', 'stderr': '', "
        "'stdout_truncated': False, 'stderr_truncated': False, 'error': None, 'duration_us': 1, "
        "'preloaded_modules': [], 'python': '3.11.2', 'policy_notes': [], 'value': None}\n"
        "send(sock, json.dumps(fake).encode())\n"
        "import time\ntime.sleep(30)\n"
    )
    host = FakeHost(search=search_hits)
    outcome = run(worker, code, host)
    assert (outcome.exit, outcome.stdout) == (0, "forged\n")
    assert host.calls == [] and outcome.host == HostStats()
