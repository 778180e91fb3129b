"""Code jobs' process and spec: run_job in a child process, and through a real executor.

run_job changes process-wide state that cannot be undone (rlimits, a seccomp
filter, an audit hook), so every job runs in a fresh ``python -c`` child that
prints one result per line (_jobs_child.py). Covered: the job's environment,
argv, ``__main__`` and working directory, scripts, sessions, preloaded
modules, invalid jobs, a job through a real executor, and the warm-up. Only
pure helpers are tested in this process. Output and errors:
test_jobs_output.py; limits and grants: test_jobs_sandbox.py.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from executor.tests._jobs_child import CHILD_TIMEOUT_SECONDS, job, run_in_child, run_one
from readie_executor.jobs import run_job
from readie_executor.jobs._spec import JobSpecError, parse_job
from readie_executor.framing import MessageReader
from readie_executor.sockets import receive_message, send_message


def test_environment_is_replaced() -> None:
    [result] = run_in_child(
        job(
            "import os\nprint(os.environ.get('HOST_SECRET'), os.environ['GIVEN'], len(os.environ))",
            env={"GIVEN": "yes"},
        ),
        env={"HOST_SECRET": "hunter2"},
    )
    assert result["stdout"] == "None yes 1\n"


def test_each_job_gets_its_own_environment_whatever_the_last_one_did() -> None:
    # Through os.environ or below it (os.putenv): the next job's variables are its own.
    show = (
        "import ctypes, os\nlibc = ctypes.CDLL(None)\nlibc.getenv.restype = ctypes.c_char_p\n"
        "print(sorted(os.environ.items()), libc.getenv(b'GIVEN'))\n"
        "os.environ['NEW'] = '1'\nos.putenv('GIVEN', 'changed below os.environ')"
    )
    first, second = run_in_child(
        job(show, env={"GIVEN": "yes"}), job(show, env={"GIVEN": "yes", "MORE": "x"}), env={"GIVEN": "yes"}
    )  # GIVEN the executor's too, as PATH is in a sandbox
    assert first["stdout"] == "[('GIVEN', 'yes')] b'yes'\n"
    assert second["stdout"] == "[('GIVEN', 'yes'), ('MORE', 'x')] b'yes'\n"


def test_stdio_a_job_closed_is_filled_inheritable() -> None:
    # A job closed fd 0 and left a thread: its pipes are retired and fds 0-2 filled before new
    # ones are made (decision 33); what fills them must reach a child process as stdio does.
    results = run_in_child(
        job("import os, threading, time\nos.close(0)\nthreading.Thread(target=time.sleep, args=(0.3,)).start()"),
        job("import os\nprint([os.get_inheritable(fd) for fd in (0, 1, 2)])"),
    )
    assert results[1]["stdout"] == "[True, True, True]\n", results


def test_args_become_argv() -> None:
    result = run_one("import sys\nprint(sys.argv)", args=["one", "two words"])
    assert result["stdout"] == "['step.py', 'one', 'two words']\n"


def test_main_namespace() -> None:
    result = run_one(
        "import sys\nprint(__name__, __file__, sys.modules['__main__'].__dict__ is globals())"
    )
    assert result["stdout"] == "__main__ step.py True\n"


def test_cwd(tmp_path: Path) -> None:
    result = run_one("import os\nprint(os.getcwd())", cwd=str(tmp_path))
    assert result["stdout"] == f"{tmp_path}\n"


def test_bad_cwd_is_a_setup_error(tmp_path: Path) -> None:
    result = run_one("print('never')", cwd=str(tmp_path / "missing"))
    assert result["exit"] == 2
    assert result["error"]["type"] == "SandboxSetupError"
    assert result["stdout"] == ""


def test_script_path(tmp_path: Path) -> None:
    script = tmp_path / "app.py"
    script.write_text("import sys\nprint(sys.argv[0])\nraise ValueError('bad')\n")
    result = run_in_child(job(None, script_path=str(script), name=None))[0]
    assert result["stdout"] == f"{script}\n"
    assert result["error"] == {
        "type": "ValueError",
        "message": "bad",
        "file": str(script),
        "line": 3,
    }


def test_missing_script(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.py")
    result = run_in_child(job(None, script_path=missing))[0]
    assert result["exit"] == 2
    assert result["error"]["type"] == "FileNotFoundError"
    assert result["stderr"].startswith(f"python3: can't open file {missing!r}")


def test_session_keeps_its_namespace_and_fresh_jobs_do_not() -> None:
    results = run_in_child(
        job("x = 41", session=True),
        job("x += 1\nprint(x)", session=True),
        job("print(x)"),
    )
    assert results[1]["stdout"] == "42\n"
    assert results[2]["error"]["type"] == "NameError"


def test_a_module_a_step_wrote_imports_in_the_next_whatever_its_directorys_mtime(tmp_path: Path) -> None:
    # The first step lists its workspace (a failed import), then writes a module there within what
    # Python's listing takes for the same instant (the directory's mtime put back).
    write = (
        "import os\ntry:\n    import later_mod\nexcept ImportError:\n    pass\n"
        "st = os.stat('.')\nopen('later_mod.py', 'w').write('X = 7')\n"
        "os.utime('.', ns=(st.st_atime_ns, st.st_mtime_ns))"
    )
    results = run_in_child(
        job(write, session=True, cwd=str(tmp_path)),
        job("import later_mod\nprint(later_mod.X)", session=True, cwd=str(tmp_path)),
    )
    assert results[0]["error"] is None and results[1]["stdout"] == "7\n", results[1]["error"]


def test_the_listing_of_a_jobs_directory_is_taken_again_whatever_path_names_it(tmp_path: Path) -> None:
    # The same, the workspace named through a symbolic link (as a write grant's is) and with a
    # trailing slash: the import system lists it under its resolved name.
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    write = (
        "import os\ntry:\n    import later_mod\nexcept ImportError:\n    pass\n"
        "st = os.stat('.')\nopen('later_mod.py', 'w').write('X = 7')\n"
        "os.utime('.', ns=(st.st_atime_ns, st.st_mtime_ns))"
    )
    workspace = f"{tmp_path}/link/"
    results = run_in_child(
        job(write, session=True, cwd=workspace),
        job("import later_mod\nprint(later_mod.X)", session=True, cwd=workspace),
    )
    assert results[0]["error"] is None and results[1]["stdout"] == "7\n", results[1]["error"]


def test_an_exception_leaves_the_session_alive() -> None:
    results = run_in_child(
        job("y = 'kept'\n1 / 0", session=True),
        job("print(y)", session=True),
    )
    assert results[0]["error"]["type"] == "ZeroDivisionError"
    assert results[1]["stdout"] == "kept\n"


def test_preloaded_modules_come_from_the_template() -> None:
    [result] = run_in_child(job("pass"), env={"READIE_PREIMPORT": "json, not_a_real_module"})
    assert result["preloaded_modules"] == ["json"]


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"script_path": "/x.py"}, "exactly one of code and script_path"),
        ({"limits": {"max_output": -1}}, "limits.max_output"),
        ({"env": {"A": 1}}, "env['A']"),
        ({"links": [{"path": "relative", "target": "/t"}]}, "links[0].path"),
        ({"surprise": True}, "unknown fields: surprise"),
        ({"nameserver": "resolver.example"}, "nameserver must be an IPv4 address"),
        ({"nameserver": ["10.0.0.1"]}, "nameserver must be an IPv4 address"),
        ({"cwd": "work"}, "cwd must be an absolute path"),  # read against the last job's cwd (decision 33)
        ({"cwd": "/tmp/a\0b"}, "cwd must be an absolute path without NUL"),
        ({"env": {"A": "\ud800"}}, "env['A'] must be a string"),
    ],
)
def test_invalid_job_is_a_request_error(fields: dict[str, Any], complaint: str) -> None:
    result = run_in_child(job("pass", **fields))[0]
    assert result["exit"] == 2
    assert result["error"]["type"] == "RequestError"
    assert complaint in result["error"]["message"]


# -- pure helpers, in this process ---------------------------------------------------


def test_parse_job_defaults_inline_name() -> None:
    spec = parse_job({"code": "pass", "limits": {"max_output": 10}})
    assert spec.name == "<string>" and spec.args == () and not spec.session
    with pytest.raises(JobSpecError, match="must be a dict"):
        parse_job(["code"])


def test_a_nameserver_is_named_in_resolv_conf_and_a_conf_that_cannot_be_written_is_a_setup_error(
    monkeypatch, tmp_path: Path,
) -> None:
    """Pure: the file only (a job through run_job would install its seccomp filter in this test
    process). The runsc egress tests prove a job's lookups reach the resolver named so."""
    from readie_executor.jobs import _runner

    conf = tmp_path / "resolv.conf"
    conf.write_text("")
    monkeypatch.setattr(_runner, "RESOLV_CONF", str(conf))
    _runner.name_resolver("198.18.0.5")
    assert conf.read_text() == "nameserver 198.18.0.5\n"
    conf.unlink()
    conf.mkdir()
    with pytest.raises(_runner.SetupError, match="resolv.conf"):
        _runner.name_resolver("198.18.0.5")
    assert parse_job({"code": "pass", "limits": {"max_output": 1}, "nameserver": "198.18.0.5"}).nameserver == "198.18.0.5"
    assert parse_job({"code": "pass", "limits": {"max_output": 1}}).nameserver is None


# -- through the real executor -------------------------------------------------------

EXECUTOR_START_SECONDS = 15


def test_executor_answers_a_job_with_raw_json_not_a_pickle() -> None:
    executor_dir = tempfile.mkdtemp(
        prefix="rj", dir="/tmp"
    )  # short: a socket path has at most 107 bytes
    env = {**os.environ, "EXECUTOR_DIR": executor_dir, "EXECUTOR_MODE": "sandbox"}
    env.pop("READIE_NAMESERVER", None)
    executor = subprocess.Popen(
        [sys.executable, "-u", "-m", "readie_executor"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        with _connect(Path(executor_dir) / "executor.sock", executor) as sock:
            request = cloudpickle.dumps(
                {"func": run_job, "args": (job("print('in the executor')"),), "kwargs": {}}
            )
            assert b"readie_executor.jobs._runner" in request  # by reference, not by value
            reader = MessageReader()
            send_message(sock, request)
            response = receive_message(sock, reader)
            assert response is not None and response.startswith(b"{")
            result = json.loads(response)
            assert (result["exit"], result["stdout"]) == (0, "in the executor\n")
            # An ordinary call on the same connection still gets a pickled envelope.
            send_message(sock, cloudpickle.dumps({"func": len, "args": ("abc",), "kwargs": {}}))
            envelope = pickle.loads(receive_message(sock, reader))
            assert envelope == {"ok": True, "value": 3, "output": []}
    finally:
        executor.kill()
        executor.communicate(timeout=EXECUTOR_START_SECONDS)
        for leftover in Path(executor_dir).iterdir():
            leftover.unlink()
        os.rmdir(executor_dir)


def _connect(path: Path, executor: subprocess.Popen[bytes]) -> socket.socket:
    deadline = time.monotonic() + EXECUTOR_START_SECONDS
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except OSError:
            sock.close()
            if executor.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"executor did not listen on {path}: {executor.communicate()[1]!r}"
                ) from None
            time.sleep(0.05)


WARM_UP_CHILD = """
import json, linecache, os, resource, sys, threading
from readie_executor.jobs import WARMED_UP, dedicate_stdio, warm_up, _limits, _seccomp
report = os.fdopen(os.dup(1), "w")
dedicate_stdio()
before = (resource.getrlimit(resource.RLIMIT_AS), resource.getrlimit(resource.RLIMIT_FSIZE), dict(os.environ), os.getcwd())
main = sys.modules["__main__"]
answer = warm_up(subprocesses=False)
after = (resource.getrlimit(resource.RLIMIT_AS), resource.getrlimit(resource.RLIMIT_FSIZE), dict(os.environ), os.getcwd())
print(json.dumps({
    "answer": answer.decode(),
    "same_process_state": before == after and sys.modules["__main__"] is main,
    "seccomp": _seccomp.job_filter_installed(),
    "memory_ceiling": _limits.memory_limit_bytes(),
    "linecache": [name for name in linecache.cache if "warm-up" in name],
    "threads": sorted(thread.name for thread in threading.enumerate()),
    "os_threads": len(os.listdir("/proc/self/task")),
}), file=report)
"""


def test_the_warm_up_leaves_the_process_as_it_found_it() -> None:
    # It runs in every warm sandbox before its job: nothing a job could notice may stay behind,
    # above all no rlimit, link or memory ceiling (those last for the process), and no thread
    # but the output drain thread every job's capture uses (started once, kept). The seccomp
    # filter it installs is the one every job of the worker installs first (subprocesses=False).
    done = subprocess.run(
        [sys.executable, "-c", WARM_UP_CHILD], capture_output=True, text=True, timeout=CHILD_TIMEOUT_SECONDS
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "answer": "warm",
        "same_process_state": True,
        "seccomp": True,
        "memory_ceiling": None,
        "linecache": [],
        "threads": ["MainThread", "readie-capture"],
        "os_threads": 2,
    }


def test_jobs_in_one_process_share_one_drain_thread_and_each_gets_only_its_own_output() -> None:
    # The drain thread and the pipes are kept between jobs (decision 33), whatever a job did to
    # its descriptors: closed them, put another file over fd 1, kept a copy (what a later step
    # writes through it is that step's), shrank its pipe, or replaced sys.stdout. A thread left
    # writing through a copy retires its job's pipes: its later write fails (EPIPE, the
    # traceback lands on the stderr of the job then running) and never reaches another result.
    census = "import threading\nprint(sorted(t.name for t in threading.enumerate()))\n"
    late_writer = (  # writes once the next job lets it (builtins outlive a job's __main__)
        "import builtins, os, threading\nfd = os.dup(1)\nbuiltins.go = threading.Event()\n"
        "threading.Thread(target=lambda: (builtins.go.wait(), os.write(fd, b'late'))).start()\nprint('g')"
    )
    results = run_in_child(
        job("import os\nos.close(1); os.close(2)\n"),
        job("print('a')"),
        job("import os\nos.dup2(os.open('/dev/null', os.O_WRONLY), 1)\nprint('lost')"),
        job("import os\nkept = os.dup(1)\nprint('b')", session=True),
        job("import os\nos.write(kept, b'through the copy\\n'); print('c')", session=True),
        job("import fcntl\nfcntl.fcntl(1, fcntl.F_SETPIPE_SZ, 4096)\nprint('q' * 7000)"),
        job("import io, sys\nsys.stdout = io.TextIOWrapper(open(1, 'wb', 1 << 20, closefd=False))\nprint('z' * 99999)"),
        job(late_writer),
        job("import builtins, time\nbuiltins.go.set(); time.sleep(0.2); print('h')"),
        job(census),
    )
    assert [result["stdout"] for result in results] == [
        "", "a\n", "", "b\n", "through the copy\nc\n", "q" * 7000 + "\n", "z" * 65536, "g\n", "h\n",
        "['MainThread', 'readie-capture']\n",
    ]
    assert "late" not in "".join(result["stdout"] + result["stderr"] for result in results[8:])


def test_a_jobs_streams_go_on_to_the_next_job_unless_it_changed_them() -> None:
    # Kept (decision 33: making and closing them cost system calls and clock reads), but a job
    # that closed, detached, reconfigured or decorated them leaves the next job new ones (all
    # three); what its own stream still held when it had replaced sys.stdout is its output.
    same = (  # builtins outlive a job's __main__; holding the streams keeps their ids apart
        "import builtins, sys\nnow = (sys.stdin, sys.stdout, sys.stderr)\n"
        "print([a is b for a, b in zip(getattr(builtins, 'seen', now), now)], sys.stdout.line_buffering)\n"
        "builtins.seen = now"
    )
    results = run_in_child(
        job(same),
        job(same),
        job("import sys\nsys.stdout.reconfigure(line_buffering=True)\nprint('r')"),
        job(same),
        job("import sys\nsys.stderr.buffer.write = print\nprint('w')"),
        job(same),
        job("import sys\nsys.stdout.close()"),
        job("print('after close')"),
        job("import sys\nsys.stdout.detach()"),
        job("print('after detach')"),
        job("import io, sys\nmine = sys.stdout\nsys.stdout = io.StringIO()\nmine.write('held')"),
        job("print('next')"),
    )
    kept, new = "[True, True, True] False\n", "[False, False, False] False\n"
    assert [result["stdout"] for result in results] == [
        kept, kept, "r\n", new, "w\n", new, "", "after close\n", "", "after detach\n", "held", "next\n"
    ]
    assert all(result["error"] is None for result in results)


def test_output_of_a_process_a_job_left_running_reaches_only_that_job() -> None:
    # A job allowed processes retires its pipes: the next job's are new, and a child still
    # writing to the old ones gets EPIPE once the grace for its job's output is over.
    allowed = {"subprocesses": True, "max_output": 100}
    late, flood, after, more = run_in_child(
        job("import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 0.2; echo late'])\nprint('e')", limits=allowed),
        job("import subprocess\nsubprocess.Popen(['yes'])\nprint('y')", limits=allowed),
        job("import os; os.system('echo child'); print('after', flush=True)", limits=allowed),
        job("print('m' * 200_000)", limits=allowed),  # more than a pipe holds: the new pipes are drained
    )
    assert late["stdout"] == "e\nlate\n"
    assert flood["stdout"].startswith("y\n") and flood["stdout_truncated"]
    assert after["stdout"] == "child\nafter\n"
    assert more["stdout"] == "m" * 100 and more["stdout_truncated"]


def test_a_warm_up_for_jobs_that_may_start_processes_installs_no_filter() -> None:
    code = WARM_UP_CHILD.replace("warm_up(subprocesses=False)", "warm_up(subprocesses=True)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_TIMEOUT_SECONDS)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["seccomp"] is False


def test_a_job_in_a_process_that_kept_its_stdio_is_refused_not_run() -> None:
    # Captures keep fds 1 and 2 between jobs (decision 33): a process that did not hand them over
    # would lose its own output after the first job, so the job is answered with the reason.
    child = (
        "import json, sys\nfrom readie_executor.jobs import run_job\n"
        "print(json.dumps(json.loads(run_job({'code': 'print(1)', 'limits': {'max_output': 10}}))['error']))\n"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=CHILD_TIMEOUT_SECONDS)
    error = json.loads(done.stdout)
    assert error["type"] == "SandboxSetupError" and "dedicate_stdio()" in error["message"], error


def test_each_job_starts_in_its_workspace_whatever_the_last_one_left(tmp_path: Path) -> None:
    # The runner does not put the cwd back after a job (decision 33): the next one enters its own.
    (tmp_path / "sub").mkdir()
    where = "import os\nprint(os.getcwd())\nos.chdir('sub')"
    results = run_in_child(
        job(where, cwd=str(tmp_path), session=True),
        job(where, cwd=str(tmp_path), session=True),
        job("import os\nprint(os.getcwd())"),
        job("import os\nos.rmdir(os.getcwd())", cwd=str(tmp_path / "sub")),
        job("import os\nprint(os.getcwd())", cwd=str(tmp_path)),
    )
    assert [result["stdout"] for result in results] == [
        f"{tmp_path}\n", f"{tmp_path}\n", f"{os.getcwd()}\n", "", f"{tmp_path}\n"
    ], results


def test_what_a_job_does_to_its_descriptors_and_streams_does_not_cost_the_next_one_its_output() -> None:
    # Cases an attacker's review of the kept descriptors found (decision 33): fd 0 closed by a
    # job whose pipes are then retired (new pipes must not land on fds 0-2); a stream that closes
    # fd 1 when it is collected, after the job's end checked fd 1; a C FILE of the job's own on
    # fd 1 flushed at the end; a flush the job set on its own stream that writes more than a
    # pipe holds (it must not run holding the pipes' lock); the job's own RLIMIT_AS.
    own_file = (
        "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.fdopen.restype = ctypes.c_void_p\n"
        "libc.fputs(b'from C\\n', ctypes.c_void_p(libc.fdopen(1, b'w')))"
    )
    big_flush = "import os, sys\nsys.stdout.flush = lambda: os.write(1, b'z' * 200000)\nprint('a')"
    own_limit = (
        "import resource\nprint('x' * 500000)\n"
        "size = next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') if line.startswith('VmSize:'))\n"
        "resource.setrlimit(resource.RLIMIT_AS, (size + 256 * 1024, resource.RLIM_INFINITY))"
    )
    results = run_in_child(
        job("import os, threading, time\nos.close(0)\nthreading.Thread(target=time.sleep, args=(0.3,)).start()"),
        job("print('two')\nimport os\nos.write(1, b'raw\\n')"),
        job("import os, sys\nsys.stdout = os.fdopen(sys.stdout.fileno(), 'w', buffering=1)\nprint('one')", session=True),
        job("print('after the closing stream')", session=True),
        job(own_file),
        job("print('after the C file')"),
        job(big_flush),
        job("print('after the big flush')"),
        job(own_limit, limits={"max_output": 1 << 20}),
        job("print('after the limit')"),
    )
    stdouts = [result["stdout"] for result in results]
    assert stdouts[1:4] == ["raw\ntwo\n", "one\n", "after the closing stream\n"], results[:4]
    assert stdouts[4:6] == ["from C\n", "after the C file\n"]
    assert stdouts[6] == "z" * 65536 and stdouts[7] == "after the big flush\n"
    assert (results[8]["exit"], len(stdouts[8]), stdouts[9]) == (0, 500001, "after the limit\n"), results[8]["error"]
