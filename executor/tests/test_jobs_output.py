"""Code jobs' output and errors: readie_executor.jobs.run_job, in a child process.

run_job changes process-wide state that cannot be undone (rlimits, a seccomp
filter, an audit hook), so every job runs in a fresh ``python -c`` child that
prints one result per line (_jobs_child.py). Covered: stdout and stderr,
exceptions and syntax errors pointing at the job's line, SystemExit, the
output caps, and the result's budget; the text fitting under it is tested
in this process. Limits and grants: test_jobs_sandbox.py; the job's
process, scripts, sessions and the executor: test_jobs_setup.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from executor.tests._jobs_child import CHILD, CHILD_TIMEOUT_SECONDS, job, run_in_child, run_one
from readie_executor.jobs import bounds
from readie_executor.jobs._result import fit_text
from readie_executor.jobs._bounds import RUNNER_PHASES


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
    # Only a job that asks is timed (each lap is a clock read: decision 33).
    assert "phases" not in result


def test_a_job_that_asks_gets_every_phase_it_ran() -> None:
    result = run_one("print('hello')", phases=True)
    assert result["stdout"] == "hello\n"
    assert list(result["phases"]) == list(RUNNER_PHASES)


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


@pytest.mark.parametrize(
    "code",
    [
        "import os, sys\nprint('a')\nos.write(1, b'b\\n')\nprint('c')\nsys.stdout.flush()\nprint('d')",
        "import os\nprint('x' * 9000)\nos.write(1, b'between\\n')\nprint('y' * 100)",
        "import os, sys\nsys.stdout.reconfigure(write_through=False)\nprint('kept')\nos.write(1, b'raw\\n')",
    ],
    ids=["flushed-between", "past-the-buffer", "reconfigured"],
)
def test_buffered_and_descriptor_output_interleave_as_python3_s_do(code: str) -> None:
    # The job's last buffered output goes straight to the capture, after what its pipe holds
    # (decision 33): the order must stay what python3 writes into a pipe.
    buffered = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    expected = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, check=True, env=buffered, timeout=CHILD_TIMEOUT_SECONDS
    )
    assert run_one(code)["stdout"] == expected.stdout.decode()


def test_invalid_utf8_output_is_replaced() -> None:
    result = run_one("import os; os.write(1, b'ok \\xff\\xfe end')")
    assert result["stdout"] == "ok \ufffd\ufffd end"


def test_stdin_is_empty() -> None:
    result = run_one("import sys; print(repr(sys.stdin.read()))\ninput()")
    assert result["stdout"] == "''\n"
    assert result["error"]["type"] == "EOFError"


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


def test_a_job_after_a_longer_one_gets_only_its_own_output() -> None:
    # The capture's buffers are kept for the next job of the same max_output (and remade for
    # another): what an earlier, longer output left in them never shows.
    first, second, third = run_in_child(
        job("print('a long first output')"), job("print('x')"), job("print('y')", limits={"max_output": 10})
    )
    assert (first["stdout"], second["stdout"], third["stdout"]) == ("a long first output\n", "x\n", "y\n")
