"""The session store when things go wrong around it, without runsc (decision 32, "A second review").

Four faults an attacker's review found, each tried here on real files:

* metadata nested deep enough that parsing it recurses out, planted where the MAC has not yet
  been checked, must not stop a read, a listing or the TTL sweep;
* a write that fails after it began (metadata too large, the store busy) must leave nothing
  that the store's bounds count;
* a store busy past its wait while a session closes must still stop that session's lease
  and give up its place;
* the machine's own errors (descriptors exhausted, an I/O error) say nothing of an entry:
  they never remove it, never count as a lost lease, never name a host path to a client.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from pathlib import Path

import pytest

import readie_worker._store_files as store_files
import readie_worker._store_layout as layout
from readie_worker._store_meta import check_storable
from readie_worker.errors import RequestError, SandboxSetupError
from readie_worker.hibernation import SessionImages
from readie_worker.jobs import CodeJob
from readie_worker.session_store import SessionStore, StoreBusy, entry_name, new_session_key

KEY = b"k" * 32
JOB = CodeJob(checkpoint="pandas", code="import pandas", env={"A": "b"})
# An env larger than a stored generation's metadata may be, and within a request line's bound.
LARGE_ENV = {f"V{index}": "x" * 1000 for index in range(300)}


@pytest.fixture
def store(tmp_path):
    store = SessionStore(tmp_path / "store", KEY, worker="w1", max_bytes=1_000_000, max_entries=8)
    yield store
    store.close()


def image(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "checkpoint.img").write_bytes(b"memory" * 100)
    return where


def stored(store: SessionStore, tmp_path: Path) -> str:
    key = new_session_key()
    store.hold(key, lambda: None)
    store.save(key, image(tmp_path / f"img-{key[:6]}"), job=JOB, memory_limit=None, step=1)
    store.let_go(key)
    return key


def writes_left(store: SessionStore) -> list[str]:
    return [path.name for entry in store.root.iterdir() if entry.is_dir() for path in entry.iterdir()
            if path.name.startswith(".new-")]


def test_metadata_nested_past_the_parsers_depth_is_refused_and_swept_not_raised(store, tmp_path):
    key = new_session_key()
    planted = store.root / entry_name(key) / "g1"
    planted.mkdir(parents=True)
    (planted / "meta.json").write_bytes(b"[" * 200_000)  # under MAX_METADATA_BYTES; json recurses out
    (planted / "meta.mac").write_bytes(b"0" * 64)
    kept = stored(store, tmp_path)
    assert {info.entry: info.state for info in store.entries()}[entry_name(key)] == "invalid"
    with pytest.raises(SandboxSetupError, match="failed verification"):
        store.load(key)
    planted.mkdir(parents=True)
    (planted / "meta.json").write_bytes(b"[" * 200_000)
    (planted / "meta.mac").write_bytes(b"0" * 64)
    assert store.sweep() == [entry_name(key)]
    assert store.load(kept).step == 1  # the sound entry beside it untouched


def test_a_setup_the_store_cannot_keep_is_refused_before_the_session_opens():
    check_storable(JOB)
    with pytest.raises(RequestError) as refused:
        check_storable(CodeJob(checkpoint="pandas", code="", env=LARGE_ENV))
    assert refused.value.field == "env" and "bytes" in str(refused.value)


def test_a_write_that_fails_midway_leaves_nothing_the_bounds_count(store, tmp_path, monkeypatch):
    key = new_session_key()
    store.hold(key, lambda: None)
    with pytest.raises(SandboxSetupError, match="metadata"):  # seal() refuses it, inside the publish
        store.save(key, image(tmp_path / "big"), job=CodeJob(checkpoint="pandas", code="", env=LARGE_ENV),
                   memory_limit=None, step=1)
    assert writes_left(store) == [] and store.usage == (0, 0)

    import readie_worker.session_store as module

    def busy(*_: object, **__: object) -> tuple[bytes, bytes]:
        raise StoreBusy("the session store's lock was busy")

    monkeypatch.setattr(module, "seal", busy)
    with pytest.raises(StoreBusy):
        store.save(key, image(tmp_path / "small"), job=JOB, memory_limit=None, step=1)
    assert writes_left(store) == []


def test_a_store_busy_at_close_still_ends_the_lease_and_the_close_does_not_raise(store, tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "STORE_LOCK_WAIT_S", 0.2)
    images = SessionImages(store, tmp_path / "scratch", shared=True)
    key, closed = new_session_key(), new_session_key()
    lease, closed_lease = store.hold(key, lambda: None), store.hold(closed, lambda: None)
    fd = os.open(store.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a hung host's, on a network volume
        with pytest.raises(SandboxSetupError):
            store.remove(key, lease=lease)
        assert not store.holds(key)  # its lease is no longer kept fresh: it goes stale, and is swept
        images.let_go(closed, closed_lease, keep=False)  # a session's close: logged, never raised
        assert not store.holds(closed)
    finally:
        os.close(fd)


def test_the_machines_errors_never_remove_an_entry_or_lose_a_lease(store, tmp_path, monkeypatch):
    key = stored(store, tmp_path)
    generation = next(path.name for path in (store.root / entry_name(key)).iterdir() if path.name.startswith("g"))
    real_open = os.open

    failing = {generation}

    def exhausted(path, flags, *args, **kwargs):  # descriptors run out, for these paths only
        if path in failing:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(store_files.os, "open", exhausted)
    with pytest.raises(SandboxSetupError) as failed:
        store.load(key)
    assert "failed verification" not in str(failed.value)
    assert [info.state for info in store.entries()] == ["unreadable"]
    assert store.sweep() == []
    failing.add(entry_name(key))  # the entry's own directory: a typed error, never an OSError
    with pytest.raises(SandboxSetupError, match="could not be read"):
        store.load(key)
    assert [info.state for info in store.entries()] == ["unreadable"] and store.sweep() == []
    failing.clear()
    monkeypatch.setattr(store_files.os, "open", real_open)
    assert store.load(key).step == 1  # kept, and sound

    missing = tmp_path / "not-made"  # the worker's own dir, gone: its trouble, not the entry's
    with pytest.raises(SandboxSetupError) as failed:
        store.copy_image(store.load(key), missing)
    assert str(missing) not in str(failed.value)
    assert store.load(key).step == 1

    held, lost = new_session_key(), threading.Event()
    store.hold(held, lost.set)

    def io_error(*_: object, **__: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "utime", io_error)
    store.leases.beat_now()
    assert not lost.is_set() and store.holds(held)


def test_a_detach_that_meets_a_machine_error_keeps_the_sessions_entry(store, tmp_path, monkeypatch):
    """A drain's detach asks whether the entry holds a generation before it lets go: a read the
    machine failed is no answer, and the entry (the session's only copy) must stay for an attach."""
    key = new_session_key()
    lease = store.hold(key, lambda: None)
    store.save(key, image(tmp_path / "img"), job=JOB, memory_limit=None, step=4)
    import readie_worker.session_store as module

    real_read = module.read_bounded

    def io_error(*args: object) -> bytes:  # reading the metadata fails; removing would not
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(module, "read_bounded", io_error)
    SessionImages(store, tmp_path / "scratch", shared=True).let_go(key, lease, keep=True)
    monkeypatch.setattr(module, "read_bounded", real_read)
    assert store.load(key).step == 4 and not store.holds(key)
