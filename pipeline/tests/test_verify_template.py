"""verify_template: a template may carry one thread and stdio, nothing else."""

from __future__ import annotations

import pytest

from readie_pipeline.capture import CaptureError, verify_template

MAIN = {"tid": 1, "name": "python3"}
STDIO = [
    {"fd": 0, "target": "pipe:[10]"},
    {"fd": 1, "target": "pipe:[11]"},
    {"fd": 2, "target": "/readie/run/log"},
]


def test_one_thread_and_stdio_is_accepted():
    assert verify_template("numpy", {"threads": [MAIN], "fds": STDIO}) is None


def test_fewer_descriptors_than_stdio_is_accepted():
    verify_template("base", {"threads": [MAIN], "fds": STDIO[:1]})


def test_a_second_thread_is_rejected_by_name_and_tid():
    census = {"threads": [MAIN, {"tid": 7, "name": "openblas"}], "fds": STDIO}
    with pytest.raises(CaptureError) as rejected:
        verify_template("numpy", census)
    message = str(rejected.value)
    assert "checkpoint 'numpy' rejected" in message
    assert "1 thread(s) beyond the main one: openblas (tid 7)" in message
    assert "python3" not in message  # the main thread is not a culprit
    assert "descriptor" not in message


def test_every_extra_thread_is_named():
    threads = [MAIN, {"tid": 7, "name": "openblas"}, {"tid": 8, "name": "omp_worker"}]
    expected = r"2 thread\(s\) beyond the main one: openblas \(tid 7\), omp_worker \(tid 8\)"
    with pytest.raises(CaptureError, match=expected):
        verify_template("numpy", {"threads": threads, "fds": STDIO})


def test_an_extra_descriptor_is_rejected_by_number_and_target():
    census = {"threads": [MAIN], "fds": [*STDIO, {"fd": 3, "target": "socket:[4242]"}]}
    with pytest.raises(CaptureError) as rejected:
        verify_template("pandas", census)
    message = str(rejected.value)
    assert "checkpoint 'pandas' rejected" in message
    assert "open descriptor(s) beyond stdio: fd 3 -> socket:[4242]" in message
    assert "pipe:[10]" not in message  # stdio is allowed, so not listed
    assert "thread" not in message


def test_a_high_descriptor_in_place_of_stdio_is_still_extra():
    fds = [{"fd": 0, "target": "/dev/null"}, {"fd": 9, "target": "/tmp/x"}]
    census = {"threads": [MAIN], "fds": fds}
    with pytest.raises(CaptureError, match=r"fd 9 -> /tmp/x"):
        verify_template("base", census)


def test_both_problems_are_reported_in_one_message():
    census = {
        "threads": [MAIN, {"tid": 12, "name": "openblas"}],
        "fds": [*STDIO, {"fd": 5, "target": "/opt/readie/site/numpy/core.so"}],
    }
    with pytest.raises(CaptureError) as rejected:
        verify_template("numpy", census)
    assert str(rejected.value) == (
        "checkpoint 'numpy' rejected: the template has "
        "1 thread(s) beyond the main one: openblas (tid 12); "
        "open descriptor(s) beyond stdio: fd 5 -> /opt/readie/site/numpy/core.so"
    )
