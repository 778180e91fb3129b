"""A stand-in for ``readie pool`` that misbehaves on purpose, for the client's tests without gVisor.

A client's tests against a pool that behaves run the real engine
(``engine_pool.py``); this one does what no real pool should, or shows
what the client sent. Behaviour comes from ``FAKE_POOL`` (a mode: dying
before ready, silence, another protocol version, a bad exit status) and
from each request's code, a tiny script of its own: ``sleep 0.2`` then
``say TEXT`` answers after 0.2 s with stdout TEXT; ``die`` exits at once
with status 7 and a word on stderr; ``raise`` answers a ValueError result;
``garbage`` writes a line that is not JSON; ``endless N`` writes N bytes
with no newline and then nothing.

Sessions are answered in order, inline: ``request`` prints the request line
as received (sorted keys), ``exit`` ends the session, a later step carrying
a setup field is refused naming it, and ``close`` answers ``closed``.
"""

import json
import os
import sys
import threading
import time

MODE = os.environ.get("FAKE_POOL", "normal")
write_lock = threading.Lock()
jobs = []


def write(obj):
    with write_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


STEP_FIELDS = {"id", "session", "code", "name", "args", "timeout", "max_output", "files", "collect"}
sessions = {}


def session_step(request):
    name = request["session"]
    if request.get("close"):
        sessions.pop(name, None)
        write({"id": request["id"], "session": name, "closed": True})
        return
    extra = sorted(set(request) - STEP_FIELDS)
    if name in sessions and extra:
        write({"id": request["id"], "exit": -1, "stdout": "", "stderr": "",
               "error": {"type": "RequestError", "message": f"{extra[0]}: session {name!r} is open", "file": None, "line": None},
               "stdout_truncated": False, "stderr_truncated": False, "duration_ms": 0, "duration_us": 0, "queue_us": 0,
               "runtime": None, "policy": None, "session": name, "step": None, "session_ended": False})
        return
    sessions[name] = step = sessions.get(name, 0) + 1
    code = request["code"]
    ended = code == "exit"
    out = json.dumps(request, sort_keys=True) + "\n" if code == "request" else ""
    if ended:
        del sessions[name]
    write({"id": request["id"], "exit": 0, "stdout": out, "stderr": "", "error": None,
           "stdout_truncated": False, "stderr_truncated": False, "duration_ms": 1, "duration_us": 1000,
           "queue_us": 5, "runtime": None, "policy": None, "session": name, "step": step,
           "session_ended": ended})


def result(rid, code):
    out, error, exit_status = "", None, 0
    for step in code.splitlines():
        verb, _, arg = step.partition(" ")
        if verb == "sleep":
            time.sleep(float(arg))
        elif verb == "say":
            out += arg + "\n"
        elif verb == "raise":
            error, exit_status = {"type": "ValueError", "message": "boom", "file": "<string>", "line": 1}, 1
        elif verb == "die":
            sys.stderr.write("fake pool: dying as asked\n")
            sys.stderr.flush()
            os._exit(7)
        elif verb == "endless":  # a line that never ends: N bytes, no newline, then silence
            with write_lock:
                sys.stdout.write("x" * int(arg))
                sys.stdout.flush()
                time.sleep(60)
            return
        elif verb == "garbage":
            with write_lock:
                sys.stdout.write("this is not json\n")
                sys.stdout.flush()
            return
    write({"id": rid, "exit": exit_status, "stdout": out, "stderr": "", "error": error,
           "stdout_truncated": False, "stderr_truncated": False, "duration_ms": 1, "duration_us": 1000,
           "queue_us": 5, "runtime": {"name": "readie", "python": "3.11.2", "mode": "pool", "preloaded_modules": []},
           "policy": {
               "allow_read": [], "allow_write": [], "network": "deny", "subprocesses": "deny",
               "timeout_ms": 30000, "memory_bytes": None, "backend": "fake"},
           "future_field": "ignored by clients"})


def main():
    sys.stderr.write(f"fake pool started with {sys.argv[1:]}\n")
    sys.stderr.flush()
    if MODE == "exit-before-ready":
        sys.stderr.write("readie pool: --router 10.0.0.1:1: remote routers are not supported yet\n")
        return 2
    if MODE == "silent":
        time.sleep(30)
        return 0
    ready = {"event": "ready", "workers": 2, "runtime": "readie", "preloaded_modules": [], "package_dirs": [],
             "config": None, "profiles": [], "argv": sys.argv[1:], "cwd": os.getcwd()}
    if MODE == "protocol-2":
        ready["protocol"] = 2
    write(ready)
    threads = []
    received = 0
    for line in sys.stdin:
        request = json.loads(line)
        received += 1
        if request.get("stats"):
            write({"id": request["id"], "event": "stats", "jobs": received - 1, "lines": received})
            continue
        if "session" in request:
            session_step(request)
            continue
        thread = threading.Thread(target=result, args=(request["id"], request.get("code", "")))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return 3 if MODE == "exit-3-at-eof" else 0


if __name__ == "__main__":
    sys.exit(main())
