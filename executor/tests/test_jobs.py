"""Code jobs: readie_executor.jobs.run_job, in a child process, and through a real executor.

run_job changes process-wide state that cannot be undone (rlimits, a seccomp
filter, an audit hook), so every job runs in a fresh ``python -c`` child that
prints one result per line. Only pure helpers are tested in this process.
"""

from __future__ import annotations

import errno
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
from hypothesis import given
from hypothesis import strategies as st
from readie_executor.jobs import bounds, run_job
from readie_executor.jobs._result import fit_text
from readie_executor.jobs._spec import JobSpecError, parse_job
from readie_executor.protocol import MessageReader
from readie_executor.sockets import receive_message, send_message

CHILD_TIMEOUT_SECONDS = 30
RESULT_KEYS = {
    "exit",
    "system_exit",
    "timed_out",
    "stdout",
    "stderr",
    "stdout_truncated",
    "stderr_truncated",
    "error",
    "duration_us",
    "preloaded_modules",
    "python",
    "policy_notes",
}
# Reads a JSON list of jobs on stdin, runs them in order, prints one result per line.
CHILD = """
import json, sys
from readie_executor.jobs import run_job
jobs = json.load(sys.stdin)
for job in jobs:
    sys.stdout.buffer.write(run_job(job) + b"\\n")
    sys.stdout.flush()
"""


def job(code: str | None = None, **fields: Any) -> dict[str, Any]:
    limits = {
        "memory_bytes": None,
        "max_file_size": None,
        "max_output": 65536,
        "subprocesses": False,
    }
    limits.update(fields.pop("limits", {}))
    spec: dict[str, Any] = {
        "name": "step.py",
        "args": [],
        "env": {},
        "links": [],
        "limits": limits,
        "session": False,
    }
    if code is not None:
        spec["code"] = code
    spec.update(fields)
    return spec


def run_in_child(*jobs: dict[str, Any], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    child_env = {**os.environ, **(env or {})}
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(jobs).encode(),
        capture_output=True,
        env=child_env,
        timeout=CHILD_TIMEOUT_SECONDS,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    lines = done.stdout.splitlines()
    assert len(lines) == len(jobs), done.stdout
    results = [json.loads(line) for line in lines]
    for result in results:
        assert set(result) == RESULT_KEYS
    return results


def run_one(code: str, **fields: Any) -> dict[str, Any]:
    return run_in_child(job(code, **fields))[0]


def test_print_goes_to_stdout() -> None:
    result = run_one("print('hello')\nimport sys; print('oops', file=sys.stderr)")
    assert result["exit"] == 0
    assert result["stdout"] == "hello\n"
    assert result["stderr"] == "oops\n"
    assert result["error"] is None
    assert result["stdout_truncated"] is result["stderr_truncated"] is False
    assert result["python"].startswith("3.11.")
    assert result["policy_notes"] == []
    assert result["system_exit"] is False
    assert isinstance(result["duration_us"], int) and result["duration_us"] >= 0


def test_exception_points_at_the_job_file_and_line() -> None:
    result = run_one("x = 1\ndef f():\n    return {}['missing']\nf()\n")
    assert result["exit"] == 1
    assert result["error"] == {
        "type": "KeyError",
        "message": "'missing'",
        "file": "step.py",
        "line": 3,
    }
    assert result["stderr"].startswith("Traceback (most recent call last):\n")
    assert 'File "step.py", line 3, in f' in result["stderr"]
    assert "return {}['missing']" in result["stderr"]  # the source of inline code is shown
    assert "readie_executor" not in result["stderr"]  # no runner frames
    assert result["stderr"].endswith("KeyError: 'missing'\n")


def test_exception_in_a_library_still_points_at_the_job_line() -> None:
    result = run_one("import json\n\njson.loads('{')\n")
    assert result["error"]["type"] == "JSONDecodeError"
    assert (result["error"]["file"], result["error"]["line"]) == ("step.py", 3)


def test_syntax_error() -> None:
    result = run_one("x = 1\ny = (\n")
    assert result["exit"] == 1
    assert result["error"]["type"] == "SyntaxError"
    assert (result["error"]["file"], result["error"]["line"]) == ("step.py", 2)
    assert "SyntaxError" in result["stderr"] and "Traceback" not in result["stderr"]


@pytest.mark.parametrize(
    ("code", "status", "stderr"),
    [
        ("import sys; sys.exit()", 0, ""),
        ("import sys; sys.exit(0)", 0, ""),
        ("import sys; sys.exit(3)", 3, ""),
        ("raise SystemExit(7)", 7, ""),
        ("import sys; sys.exit('bye')", 1, "bye\n"),
    ],
)
def test_system_exit(code: str, status: int, stderr: str) -> None:
    result = run_one(code)
    assert (result["exit"], result["stderr"], result["error"]) == (status, stderr, None)
    assert result["system_exit"] is True


def test_several_exit_codes_in_one_child() -> None:
    results = run_in_child(*(job(f"raise SystemExit({n})") for n in (0, 1, 42, 256, -1)))
    # As the OS would report them: 256 & 0xFF and -1 & 0xFF.
    assert [result["exit"] for result in results] == [0, 1, 42, 0, 255]


def test_stdout_is_capped_with_a_flag() -> None:
    result = run_one(
        "print('x' * 5000)\nimport sys; print('e' * 10, file=sys.stderr)",
        limits={"max_output": 100},
    )
    assert result["stdout"] == "x" * 100
    assert result["stdout_truncated"] is True
    assert result["stderr"] == "e" * 10 + "\n"
    assert result["stderr_truncated"] is False


def test_output_cap_counts_encoded_bytes_for_characters_json_escapes() -> None:
    result = run_one("print('é' * 100, end='')", limits={"max_output": 50})
    assert result["stdout"] == "é" * 25  # two UTF-8 bytes each
    assert result["stdout_truncated"] is True


def test_flood_of_output_stays_bounded() -> None:
    result = run_one(
        "import os\nfor _ in range(2000):\n    os.write(1, b'y' * 10000)\n",
        limits={"max_output": 1000},
    )
    assert result["exit"] == 0
    assert result["stdout"] == "y" * 1000 and result["stdout_truncated"] is True


def test_descriptor_level_output_is_captured() -> None:
    code = (
        "import os, ctypes\n"
        "os.write(1, b'raw one\\n')\n"
        "os.write(2, b'raw two\\n')\n"
        "ctypes.CDLL(None).printf(b'from C\\n')\n"
    )
    result = run_one(code)
    assert "raw one\n" in result["stdout"] and "from C\n" in result["stdout"]
    assert result["stderr"] == "raw two\n"


def test_invalid_utf8_output_is_replaced() -> None:
    result = run_one("import os; os.write(1, b'ok \\xff\\xfe end')")
    assert result["stdout"] == "ok \ufffd\ufffd end"


def test_stdin_is_empty() -> None:
    result = run_one("import sys; print(repr(sys.stdin.read()))\ninput()")
    assert result["stdout"] == "''\n"
    assert result["error"]["type"] == "EOFError"


def test_memory_limit_raises_memory_error_with_hint() -> None:
    code = "try:\n    x = bytearray(512 * 2**20)\nfinally:\n    print('still here')\n"
    result = run_one(code, limits={"memory_bytes": 64 * 2**20})
    assert result["exit"] == 1
    assert result["stdout"] == "still here\n"
    assert result["error"]["type"] == "MemoryError"
    assert (result["error"]["file"], result["error"]["line"]) == ("step.py", 2)
    assert str(64 * 2**20) in result["error"]["hint"]


def test_output_still_drains_when_the_job_holds_all_its_memory() -> None:
    code = (
        "import os\n"
        "data = b'x' * 300000\n"
        "blocks = []\n"
        "try:\n"
        "    while True:\n"
        "        blocks.append(bytearray(4096))\n"
        "except MemoryError:\n"
        "    pass\n"
        "for _ in range(4):\n"
        "    os.write(1, data)  # more than a pipe holds: blocks unless the drain keeps reading\n"
    )
    result = run_one(code, limits={"memory_bytes": 64 * 2**20, "max_output": 100})
    assert (result["exit"], result["stdout"], result["stdout_truncated"]) == (0, "x" * 100, True)


def test_memory_within_the_limit_is_usable() -> None:
    result = run_one(
        "x = bytearray(32 * 2**20)\nprint(len(x))", limits={"memory_bytes": 128 * 2**20}
    )
    assert (result["exit"], result["stdout"]) == (0, f"{32 * 2**20}\n")


def test_file_size_limit_raises_efbig(tmp_path: Path) -> None:
    grant = tmp_path / "grant"
    grant.mkdir()
    link = {"path": str(tmp_path / "host" / "out"), "target": str(grant), "writable": True}
    code = f"with open({link['path'] + '/big.bin'!r}, 'wb') as f:\n    f.write(b'x' * 5000)\n"
    result = run_one(code, links=[link], limits={"max_file_size": 1000})
    assert result["exit"] == 1
    assert result["error"]["type"] == "OSError"
    assert result["error"]["message"].startswith(f"[Errno {errno.EFBIG}]")
    assert (grant / "big.bin").stat().st_size == 1000


@pytest.mark.parametrize(
    "code",
    [
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.fork()",
        "import os\nos.system('true')",
        "import os\nos.execv('/bin/true', ['true'])",
        "import os\nos.posix_spawn('/bin/true', ['true'], {})",
    ],
)
def test_subprocesses_are_refused(code: str) -> None:
    result = run_one(code)
    assert result["exit"] == 1
    assert result["error"]["type"] == "PermissionError"
    assert result["error"]["message"] == "subprocesses are not allowed in this sandbox"
    assert "Subprocesses are not allowed" in result["error"]["hint"]
    assert (result["error"]["file"], result["error"]["line"]) == ("step.py", 2)


def test_seccomp_refuses_fork_that_bypasses_the_hook_but_allows_threads() -> None:
    code = (
        "import ctypes, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.fork(), ctypes.get_errno())\n"
        "print(libc.execv(b'/bin/true', None), ctypes.get_errno())\n"
        "seen = []\n"
        "t = threading.Thread(target=seen.append, args=('thread ran',))\n"
        "t.start(); t.join()\n"
        "print(seen[0])\n"
    )
    result = run_one(code)
    assert result["policy_notes"] == [], result["policy_notes"]
    assert result["stdout"] == f"-1 {errno.EPERM}\n-1 {errno.EPERM}\nthread ran\n"


def test_seccomp_refuses_setuid_and_setgid_modes(tmp_path: Path) -> None:
    """Files a job makes in a write grant are root's on the host: none may be setuid or setgid."""
    code = (
        "import ctypes, os, stat\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"base = {str(tmp_path)!r}\n"
        "results = []\n"
        "def errno_of(call):\n"
        "    return 0 if call() >= 0 else ctypes.get_errno()\n"
        "libc.close(libc.open((base + '/f').encode(), os.O_CREAT | os.O_WRONLY, 0o644))\n"
        "results.append(errno_of(lambda: libc.chmod((base + '/f').encode(), 0o4755)))\n"
        "results.append(errno_of(lambda: libc.chmod((base + '/f').encode(), 0o2755)))\n"
        "results.append(errno_of(lambda: libc.chmod((base + '/f').encode(), 0o1755)))\n"
        "results.append(errno_of(lambda: libc.open((base + '/g').encode(), os.O_CREAT | os.O_WRONLY, 0o4755)))\n"
        "results.append(errno_of(lambda: libc.mkdir((base + '/d').encode(), 0o2777)))\n"
        "results.append(errno_of(lambda: libc.mkdir((base + '/e').encode(), 0o777)))\n"
        "results.append(errno_of(lambda: libc.syscall(437, -100, (base + '/h').encode(), 0, 0)))\n"
        "print(results, oct(stat.S_IMODE(os.stat(base + '/f').st_mode)))\n"
    )
    result = run_one(code)
    assert result["policy_notes"] == [], result["policy_notes"]
    eperm, enosys = errno.EPERM, errno.ENOSYS
    assert result["stdout"] == f"[{eperm}, {eperm}, 0, {eperm}, {eperm}, 0, {enosys}] 0o1755\n", result
    assert not os.path.exists(tmp_path / "g") and not os.path.exists(tmp_path / "d")


def test_subprocesses_allowed_when_asked() -> None:
    result = run_one(
        "import subprocess\nprint(subprocess.run(['echo', 'child'], capture_output=True).stdout)",
        limits={"subprocesses": True},
        env={"PATH": "/usr/bin:/bin"},
    )
    assert (result["exit"], result["stdout"]) == (0, "b'child\\n'\n")


def test_environment_is_replaced() -> None:
    [result] = run_in_child(
        job(
            "import os\nprint(os.environ.get('HOST_SECRET'), os.environ['GIVEN'], len(os.environ))",
            env={"GIVEN": "yes"},
        ),
        env={"HOST_SECRET": "hunter2"},
    )
    assert result["stdout"] == "None yes 1\n"


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


@pytest.mark.parametrize(
    "code",
    [
        "open('/etc/readie-test-file', 'w')",
        "import os\nos.open('/etc/readie-test-file', os.O_WRONLY | os.O_CREAT)",
        "import pathlib\npathlib.Path('/etc/readie-test-file').write_text('x')",
        "import os\nos.mkdir('/etc/readie-test-dir')",
        "import os\nos.remove('/etc/readie-test-file')",
    ],
)
def test_writes_outside_the_grants_are_refused(tmp_path: Path, code: str) -> None:
    grant = tmp_path / "grant"
    grant.mkdir()
    link = {"path": str(tmp_path / "work"), "target": str(grant), "writable": True}
    result = run_one(code, links=[link])
    assert result["exit"] == 1
    error = result["error"]
    assert error["type"] == "PermissionError"
    assert error["message"].startswith("[Errno 13] Permission denied: '/etc/readie-test-")
    assert link["path"] in error["hint"]
    assert not Path("/etc/readie-test-file").exists() and not Path("/etc/readie-test-dir").exists()


def test_guard_is_off_between_jobs(tmp_path: Path) -> None:
    child = (
        "import sys\n"
        "from readie_executor.jobs import run_job\n"
        "run_job({'code': 'pass', 'limits': {'max_output': 10}})\n"
        f"open({str(tmp_path / 'after.txt')!r}, 'w').write('the executor may write')\n"
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=CHILD_TIMEOUT_SECONDS)
    assert (tmp_path / "after.txt").read_text() == "the executor may write"


def test_reading_outside_the_grants_is_not_refused() -> None:
    result = run_one("import sys\nprint(len(open(sys.executable, 'rb').read(10)))")
    assert result["stdout"] == "10\n"


def test_write_through_a_writable_link_lands_in_the_target(tmp_path: Path) -> None:
    write_grant, read_grant = tmp_path / "grants" / "write-0", tmp_path / "grants" / "read-0"
    write_grant.mkdir(parents=True)
    read_grant.mkdir()
    (read_grant / "data.txt").write_text("input")
    links = [
        {"path": str(tmp_path / "srv" / "work"), "target": str(write_grant), "writable": True},
        {"path": str(tmp_path / "srv" / "data"), "target": str(read_grant), "writable": False},
    ]
    # Absolute paths for the other grant: the working directory is the link's
    # target once entered, so ".." would be the grants directory, not srv/.
    data = links[1]["path"]
    code = (
        f"data = open({data + '/data.txt'!r}).read()\n"
        "with open('out.txt', 'w') as f:\n    f.write(data + ' processed')\n"
        "import os\nos.mkdir('sub')\nos.rename('out.txt', 'sub/moved.txt')\n"
        f"open({data + '/new.txt'!r}, 'w')\n"
    )
    result = run_one(code, links=links, cwd=links[0]["path"])
    assert (write_grant / "sub" / "moved.txt").read_text() == "input processed"
    assert os.readlink(links[0]["path"]) == str(write_grant)
    assert (
        result["error"]["type"] == "PermissionError"
    )  # the read-only grant refuses the last write
    assert (result["error"]["file"], result["error"]["line"]) == ("step.py", 7)
    assert not (read_grant / "new.txt").exists()
    assert links[1]["path"] in result["error"]["hint"]


def test_erofs_is_reported_as_permission_error() -> None:
    result = run_one(
        "import errno\nraise OSError(errno.EROFS, 'Read-only file system', '/srv/data/x')"
    )
    error = result["error"]
    assert error["type"] == "PermissionError"
    assert error["message"] == "[Errno 13] Permission denied: '/srv/data/x'"
    assert "EROFS" in error["hint"]


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
    ],
)
def test_invalid_job_is_a_request_error(fields: dict[str, Any], complaint: str) -> None:
    result = run_in_child(job("pass", **fields))[0]
    assert result["exit"] == 2
    assert result["error"]["type"] == "RequestError"
    assert complaint in result["error"]["message"]


def test_result_stays_within_its_budget() -> None:
    code = (
        "import sys\n"
        "print('\\x01' * 3000)\n"
        "sys.stderr.write('😀' * 3000)\n"
        "class " + "E" * 300 + "(Exception): pass\n"
        "raise " + "E" * 300 + "('\\x00' * 100000)\n"
    )
    max_output = 1000
    [raw] = _raw_results(job(code, limits={"max_output": max_output}))
    assert len(raw) <= bounds.result_budget(max_output)
    result = json.loads(raw)
    assert result["stdout_truncated"] and result["stderr_truncated"]
    assert len(json.dumps(result["error"]["message"])) - 2 <= bounds.MAX_ERROR_MESSAGE
    assert len(result["error"]["type"]) <= bounds.MAX_ERROR_TYPE


def _raw_results(*jobs: dict[str, Any]) -> list[bytes]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(jobs).encode(),
        capture_output=True,
        timeout=CHILD_TIMEOUT_SECONDS,
        check=True,
    )
    return done.stdout.splitlines()


# -- pure helpers, in this process ---------------------------------------------------


@given(st.text(), st.integers(min_value=0, max_value=200))
def test_fit_text_respects_the_encoded_budget(text: str, budget: int) -> None:
    fitted, cut = fit_text(text, budget)
    encoded = json.dumps(fitted, ensure_ascii=False).encode("utf-8")
    assert len(encoded) - 2 <= budget
    clean = text.encode("utf-8", "replace").decode("utf-8")
    assert clean.startswith(fitted)
    assert cut == (fitted != clean)


def test_parse_job_defaults_inline_name() -> None:
    spec = parse_job({"code": "pass", "limits": {"max_output": 10}})
    assert spec.name == "<string>" and spec.args == () and not spec.session
    with pytest.raises(JobSpecError, match="must be a dict"):
        parse_job(["code"])


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
from readie_executor.jobs import WARMED_UP, warm_up, _limits, _seccomp
before = (resource.getrlimit(resource.RLIMIT_AS), resource.getrlimit(resource.RLIMIT_FSIZE), dict(os.environ), os.getcwd())
main = sys.modules["__main__"]
answer = warm_up(subprocesses=False)
after = (resource.getrlimit(resource.RLIMIT_AS), resource.getrlimit(resource.RLIMIT_FSIZE), dict(os.environ), os.getcwd())
print(json.dumps({
    "answer": answer.decode(),
    "same_process_state": before == after and sys.modules["__main__"] is main,
    "seccomp": _seccomp.is_installed(),
    "memory_ceiling": _limits.memory_limit_bytes(),
    "linecache": [name for name in linecache.cache if "warm-up" in name],
    "threads": sorted(thread.name for thread in threading.enumerate()),
    "os_threads": len(os.listdir("/proc/self/task")),
}))
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


def test_jobs_in_one_process_share_one_drain_thread_and_a_kept_copy_of_stdout_holds_up_only_its_own_job() -> None:
    # The drain thread is kept between jobs; a job that leaves a copy of fd 1 open (a
    # background writer) delays only its own result (by the drain grace), and the next
    # job's output is its own.
    keeper = "import os, threading\nfd = os.dup(1)\nprint('first', flush=True)\n"
    census = "import threading\nprint(sorted(t.name for t in threading.enumerate()))\n"
    first, second, third = run_in_child(job(keeper), job(census), job("print('third')"))
    assert first["stdout"] == "first\n"
    assert second["stdout"] == "['MainThread', 'readie-capture']\n"
    assert third["stdout"] == "third\n"


def test_a_warm_up_for_jobs_that_may_start_processes_installs_no_filter() -> None:
    code = WARM_UP_CHILD.replace("warm_up(subprocesses=False)", "warm_up(subprocesses=True)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_TIMEOUT_SECONDS)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["seccomp"] is False
