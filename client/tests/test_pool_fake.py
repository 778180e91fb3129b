"""``Pool`` against a stand-in pool that misbehaves on purpose: flags, dying, garbage, start failures,
another protocol version, a bad exit status, an endless line; the stderr tail both pools keep. No gVisor.

How a client meets a pool that behaves (demultiplexing, refusals, host
functions, sessions, the drain) is test_pool_engine_backed.py's, against the
real engine.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from readie_worker.testing import wait_until
import readie
from readie._process import STDERR_LINE_BYTES, STDERR_TAIL_LINES, PoolStderrTail, pool_flags

FAKE = [sys.executable, str(Path(__file__).with_name("fake_pool.py"))]


@pytest.fixture
def pool(tmp_path):
    with readie.Pool(command=FAKE, cwd=tmp_path) as pool:
        yield pool


def test_ready_event_and_flags(pool, tmp_path):
    assert pool.ready == readie.ReadyEvent(
        workers=2, runtime="readie", preloaded_modules=(), package_dirs=(), config=None, profiles=(), protocol=1
    )
    assert pool.argv == [*FAKE, "pool"]  # the config's settings, else the pool's defaults
    assert pool.cwd == tmp_path
    # stderr is its own pipe, read on its own thread: it may trail the ready event.
    assert wait_until(lambda: "fake pool started with ['pool']" in pool.stderr_tail, 5), pool.stderr_tail


def test_flags_name_only_what_was_given():
    assert pool_flags(None, (), (), None, None, None) == ["pool"]
    assert pool_flags(3, ["pandas", "numpy"], [Path("/srv/site")], "readie.toml", "10.0.0.1:1", "build/cp") == [
        "pool", "--workers=3", "--preload=pandas,numpy", "--package-dir=/srv/site", "--config=readie.toml",
        "--router=10.0.0.1:1", "--checkpoints=build/cp",
    ]
    with pytest.raises(TypeError, match=r"preload=\['pandas'\]"):
        pool_flags(None, "pandas", (), None, None, None)


def test_an_oversize_request_is_refused_before_it_is_sent(pool):
    with pytest.raises(readie.RequestError, match="1 MiB"):
        pool.run("x" * readie.MAX_LINE_BYTES)
    assert pool.stats() == {"id": 2, "event": "stats", "jobs": 0, "lines": 1}


def test_a_pool_that_dies_fails_every_waiting_caller_and_says_why(tmp_path):
    pool = readie.Pool(command=FAKE, cwd=tmp_path)
    errors: list[Exception] = []

    def wait_long() -> None:
        try:
            pool.run("sleep 5\nsay late")
        except readie.PoolError as exc:
            errors.append(exc)

    waiting = threading.Thread(target=wait_long)
    waiting.start()
    time.sleep(0.2)
    with pytest.raises(readie.PoolError) as died:
        pool.run("die")
    waiting.join(10)
    for error in (died.value, *errors):
        assert "exited with status 7" in str(error)
        assert "fake pool: dying as asked" in str(error)
    assert len(errors) == 1
    with pytest.raises(readie.PoolError, match="status 7"):
        pool.run("say again")
    with pytest.raises(readie.PoolError, match="exited with status 7"):
        pool.close()


def test_a_line_that_is_not_json_breaks_the_pool_loudly(pool):
    with pytest.raises(readie.PoolError, match="broke the protocol: the pool wrote a line that is not JSON"):
        pool.run("garbage")
    with pytest.raises(readie.PoolError, match="broke the protocol"):
        pool.run("say again")


def test_start_failures_name_the_status_and_the_pools_words(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_POOL", "exit-before-ready")
    with pytest.raises(readie.PoolError) as failed:
        readie.Pool(command=FAKE, cwd=tmp_path, router="10.0.0.1:1")
    assert "exited with status 2 before it was ready" in str(failed.value)
    assert "remote routers are not supported yet" in str(failed.value)

    monkeypatch.setenv("FAKE_POOL", "silent")
    started = time.monotonic()
    with pytest.raises(readie.PoolError, match="not ready within 0.5 s"):
        readie.Pool(command=FAKE, cwd=tmp_path, start_timeout=0.5)
    assert time.monotonic() - started < 15

    with pytest.raises(readie.PoolError, match="cannot start"):
        readie.Pool(command=[str(tmp_path / "no-such-readie")], cwd=tmp_path)


def test_a_pool_speaking_another_protocol_version_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_POOL", "protocol-2")
    with pytest.raises(readie.VersionMismatch, match="pool protocol version 2, this client speaks version 1"):
        readie.Pool(command=FAKE, cwd=tmp_path)


def test_close_checks_the_exit_status(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_POOL", "exit-3-at-eof")
    with pytest.raises(readie.PoolError, match="exited with status 3"), readie.Pool(command=FAKE, cwd=tmp_path):
        pass


def test_a_line_over_the_event_limit_breaks_the_pool_instead_of_growing_the_client(tmp_path, monkeypatch):
    """The reader holds no line past MAX_EVENT_LINE_BYTES (lowered here: the real one is 193 MiB)."""
    monkeypatch.setattr(readie._pool, "MAX_EVENT_LINE_BYTES", 4096)
    with readie.Pool(command=FAKE, cwd=tmp_path) as pool:
        assert pool.run("say short").stdout == "short\n"
        with pytest.raises(readie.PoolError, match=r"broke the protocol: the pool wrote a line of at least \d+ bytes, over 4096"):
            pool.run("say " + "x" * 5000)
        with pytest.raises(readie.PoolError, match="broke the protocol"):
            pool.run("say again")


def test_a_line_without_end_breaks_the_pool_once_it_is_over_the_limit_not_at_its_end(tmp_path, monkeypatch):
    monkeypatch.setattr(readie._pool, "MAX_EVENT_LINE_BYTES", 4096)
    pool = readie.Pool(command=FAKE, cwd=tmp_path)
    started = time.monotonic()
    with pytest.raises(readie.PoolError, match="broke the protocol: the pool wrote a line of at least"):
        pool.run("endless 10000")
    assert time.monotonic() - started < 30  # the fake writes nothing more for 60 s
    with pytest.raises(readie.PoolError):
        pool.close(timeout=1)


def test_the_stderr_tail_keeps_the_last_lines_in_bounded_pieces_however_the_bytes_come():
    tail = PoolStderrTail()
    for byte in b"one\n\ntw":  # a byte at a time, as a slow pipe gives it
        tail.feed(bytes([byte]))
    tail.feed(b"o\n" + b"x" * (STDERR_LINE_BYTES + 5))
    assert tail.text.split("\n")[:3] == ["one", "", "two"]
    assert [len(line) for line in tail.text.split("\n")[3:]] == [STDERR_LINE_BYTES], "the unfinished rest waits"
    tail.end()
    assert tail.text.endswith("\n" + "x" * 5) and tail.suffix().startswith("; its stderr ended with:\none\n")
    tail.feed(b"line\n" * (STDERR_TAIL_LINES + 10))
    assert tail.text == "\n".join(["line"] * STDERR_TAIL_LINES)
    assert PoolStderrTail().suffix() == " (nothing on its stderr)"
