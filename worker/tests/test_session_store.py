"""The session store's file layer (decision 32), without runsc: images are plain files here.

Every way the shared directory can lie is tried: a byte changed, a file cut
short, another store's key, a symlink or FIFO where a file or entry should
be, an entry renamed to another session's name. Each is refused with
SandboxSetupError and the entry removed; an unknown key and a wrong one are
the same RequestError. Bounds, the TTL and leases are checked on the files.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest

from readie_worker.errors import Cancelled, ConfigError, RequestError, SandboxSetupError
from readie_worker.jobs import CodeJob
from readie_worker.session_store import (
    LeaseLost,
    SessionStore,
    entry_name,
    new_session_key,
    read_store_key,
)
from readie_worker._store_leases import LEASE, LEASE_STALE_S

KEY = b"k" * 32
JOB = CodeJob(checkpoint="pandas", code="import pandas", env={"A": "b"}, allow_read=("/data",), memory_bytes=64 << 20,
              files=(("in.csv", b"1,2"),))


@pytest.fixture
def store(tmp_path):
    store = SessionStore(tmp_path / "store", KEY, worker="w1", max_bytes=10_000, max_entries=3)
    yield store
    store.close()


def image(where: Path, payload: bytes = b"memory" * 100) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "checkpoint.img").write_bytes(payload)
    (where / "pages.img").write_bytes(b"pages")
    return where


def stored(store: SessionStore, tmp_path: Path, payload: bytes = b"memory" * 100, step: int = 3) -> str:
    """A session stored under a new key, and let go (as a drain leaves it)."""
    key = new_session_key()
    store.hold(key, lambda: None)
    store.save(key, image(tmp_path / f"img-{key[:6]}", payload), job=JOB, memory_limit=123, step=step)
    store.let_go(key)
    return key


def generation(store: SessionStore, key: str) -> Path:
    [newest] = [path for path in (store.root / entry_name(key)).iterdir() if path.name.startswith("g")]
    return newest


def restore_into(store: SessionStore, key: str, tmp_path: Path) -> Path:
    into = tmp_path / f"restore-{key[:6]}"
    into.mkdir()
    store.copy_image(store.load(key), into)
    return into


def test_a_stored_session_comes_back_as_written_and_the_store_never_holds_its_key(store, tmp_path):
    key = stored(store, tmp_path)
    loaded = store.load(key)
    assert (loaded.step, loaded.memory_limit, loaded.worker) == (3, 123, "w1")
    # Its code and files were the first step's: a later step replaces both.
    assert loaded.job.checkpoint == "pandas" and loaded.job.env == {"A": "b"} and loaded.job.allow_read == ("/data",)
    assert loaded.job.code == "" and loaded.job.files == ()
    copy = restore_into(store, key, tmp_path)
    assert (copy / "checkpoint.img").read_bytes() == b"memory" * 100 and (copy / "pages.img").read_bytes() == b"pages"
    for path in store.root.rglob("*"):
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), path
        if path.is_file():
            assert key.encode() not in path.read_bytes()
    # Every file of the entry counts, its metadata too.
    assert store.usage == (1, sum(path.stat().st_size for path in generation(store, key).iterdir()))


def test_a_newer_generation_replaces_the_older(store, tmp_path):
    key = stored(store, tmp_path)
    store.hold(key, lambda: None, new=False)
    store.save(key, image(tmp_path / "next", b"later"), job=JOB, memory_limit=None, step=4)
    assert [path.name for path in (store.root / entry_name(key)).iterdir() if path.name != LEASE] == ["g2"]
    assert store.load(key).step == 4 and store.load(key).memory_limit is None


def test_an_unknown_key_and_a_wrong_one_are_the_same_refusal(store, tmp_path):
    stored(store, tmp_path)
    refusals = []
    for key in (new_session_key(), "not a key", "A" * 43, ""):
        with pytest.raises(RequestError) as refused:
            store.load(key)
        refusals.append((refused.value.field, str(refused.value)))
    assert len(set(refusals)) == 1 and refusals[0][0] == "attach"


@pytest.mark.parametrize("spoil", ["a byte", "cut short", "grown"])
def test_a_changed_image_file_is_refused_and_its_entry_removed(store, tmp_path, spoil):
    key = stored(store, tmp_path)
    path = generation(store, key) / "checkpoint.img"
    data = path.read_bytes()
    path.write_bytes({"a byte": data[:10] + b"X" + data[11:], "cut short": data[:-1], "grown": data + b"!"}[spoil])
    loaded = store.load(key)  # the metadata is intact
    with pytest.raises(SandboxSetupError, match="failed verification"):
        restore_into(store, key, tmp_path)
    assert not (store.root / entry_name(key)).exists()


def test_changed_metadata_and_another_stores_key_are_refused(store, tmp_path):
    key = stored(store, tmp_path)
    meta = generation(store, key) / "meta.json"
    meta.write_bytes(meta.read_bytes().replace(b'"step":3', b'"step":9'))
    with pytest.raises(SandboxSetupError, match="MAC does not match"):
        store.load(key)
    assert not (store.root / entry_name(key)).exists()
    foreign = SessionStore(store.root, b"x" * 32, worker="w2")
    try:
        key = stored(foreign, tmp_path)
    finally:
        foreign.close()
    with pytest.raises(SandboxSetupError, match="another session store key; it is kept"):
        store.load(key)
    assert (store.root / entry_name(key)).exists()


def test_an_entry_renamed_to_another_sessions_name_is_refused(store, tmp_path):
    theirs, mine = stored(store, tmp_path), new_session_key()
    os.rename(store.root / entry_name(theirs), store.root / entry_name(mine))
    with pytest.raises(SandboxSetupError, match="another session"):
        store.load(mine)


def test_symlinks_and_fifos_in_the_store_are_never_followed_or_read(store, tmp_path):
    key = stored(store, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    os.rename(store.root / entry_name(key), elsewhere)
    os.symlink(elsewhere, store.root / entry_name(key))
    with pytest.raises(RequestError):  # an entry that is a symlink is no entry
        store.load(key)
    os.unlink(store.root / entry_name(key))
    os.rename(elsewhere, store.root / entry_name(key))
    loaded = store.load(key)
    target = generation(store, key) / "checkpoint.img"
    target.unlink()
    os.mkfifo(target)  # a read would block forever
    with pytest.raises(SandboxSetupError, match="not a regular file"):
        restore_into(store, key, tmp_path)
    key = stored(store, tmp_path)
    loaded = store.load(key)
    secret = tmp_path / "secret"
    secret.write_bytes(b"memory" * 100)
    (generation(store, key) / "checkpoint.img").unlink()
    os.symlink(secret, generation(store, key) / "checkpoint.img")
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(SandboxSetupError):
        store.copy_image(loaded, into)


def test_the_bounds_count_every_entry_and_byte_in_the_directory(store, tmp_path):
    keys = [stored(store, tmp_path, b"m" * 100) for _ in range(3)]
    with pytest.raises(SandboxSetupError, match="the session store is full$"):  # its totals are the log's
        stored(store, tmp_path)
    store.hold(keys[0], lambda: None, new=False)
    store.save(keys[0], image(tmp_path / "again", b"m" * 50), job=JOB, memory_limit=None, step=5)  # not a new entry
    store.remove(keys[0])
    # Another worker's entries count too: the directory, not this object, is the truth.
    other = SessionStore(store.root, KEY, worker="w2", max_bytes=10_000)
    try:
        with pytest.raises(SandboxSetupError, match="the session store is full$"):
            stored(other, tmp_path, b"m" * 9_800)
    finally:
        other.close()
    assert store.usage[0] == 2 and not (store.root / entry_name(keys[0])).exists()


def test_the_ttl_removes_what_nobody_holds_and_keeps_what_is_leased(tmp_path):
    store = SessionStore(tmp_path / "store", KEY, worker="w1", ttl_s=0.0)
    try:
        old, held = stored(store, tmp_path), stored(store, tmp_path)
        store.hold(held, lambda: None, new=False)
        time.sleep(0.01)
        assert {info.entry: info.state for info in store.entries()} == {entry_name(old): "expired", entry_name(held): "leased"}
        removed = store.sweep()
        assert removed == [entry_name(old)] and (store.root / entry_name(held)).exists()
    finally:
        store.close()


def test_a_live_lease_is_waited_for_a_stale_one_taken_and_its_holder_told(tmp_path):
    one = SessionStore(tmp_path / "store", KEY, worker="w1")
    two = SessionStore(tmp_path / "store", KEY, worker="w2")
    try:
        key = stored(one, tmp_path)
        lost = threading.Event()
        one.hold(key, lost.set, new=False)
        with pytest.raises(SandboxSetupError, match="held live by another worker that did not let go") as refused:
            two.hold(key, lambda: None, wait_s=0.3, new=False)
        assert "w1" not in str(refused.value)  # a client never learns which host holds it
        with pytest.raises(Cancelled):  # the caller gave up while it waited
            two.hold(key, lambda: None, wait_s=5, stop=lambda: True, new=False)
        threading.Timer(0.3, one.let_go, [key]).start()  # a drain: written, then let go
        two.hold(key, lambda: None, wait_s=5, new=False)
        assert two.holds(key) and not one.holds(key)
        one.hold(key, lost.set, take_over=True, new=False)  # the caller saw w2 die
        two.leases.beat_now()
        assert not two.holds(key)
        past = time.time() - LEASE_STALE_S - 1
        os.utime(one.root / entry_name(key) / LEASE, (past, past))
        two.hold(key, lambda: None, new=False)  # stale: taken at once
        one.leases.beat_now()
        assert lost.is_set() and not one.let_go(key) and two.let_go(key)
        with pytest.raises(RequestError, match="no session is stored"):
            two.hold(new_session_key(), lambda: None, new=False)
    finally:
        one.close()
        two.close()


def test_the_store_key_file_must_be_the_workers_alone(tmp_path):
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    assert len(read_store_key(key)) == 32
    key.chmod(0o640)
    with pytest.raises(ConfigError, match=f"{key}: .*readable by others"):
        read_store_key(key)
    key.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(key)
    with pytest.raises(ConfigError, match="symlink"):
        read_store_key(link)
    key.write_bytes(b"short")
    with pytest.raises(ConfigError, match="32 to 4096 bytes, not 5"):
        read_store_key(key)


def test_a_store_others_may_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        SessionStore(shared, KEY, worker="w1")


@pytest.mark.parametrize("problem", ["no key", "open key", "linked key", "unknown checkpoint mode"])
def test_a_worker_refuses_a_bad_store_setting_before_it_touches_anything(tmp_path, problem):
    from readie_worker.core import Worker, WorkerConfig

    key = tmp_path / "store.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o644 if problem == "open key" else 0o600)
    if problem == "linked key":
        (tmp_path / "link").symlink_to(key)
        key = tmp_path / "link"
    config = WorkerConfig(
        manifest=tmp_path / "manifest.json", state_dir=tmp_path / "state", session_store=tmp_path / "store",
        session_store_key=None if problem == "no key" else key,
        session_checkpoint="sometimes" if problem == "unknown checkpoint mode" else "off",
    )
    with pytest.raises(ConfigError) as refused:
        Worker(config).start()
    named = {"no key": str(tmp_path / "store"), "open key": str(key), "linked key": str(key),
             "unknown checkpoint mode": "session_checkpoint"}[problem]
    assert str(refused.value).startswith(f"{named}: ")
    assert sorted(os.listdir(tmp_path)) == sorted(["store.key", *(["link"] if problem == "linked key" else [])])


def test_an_entry_that_holds_nothing_ages_from_its_leases_last_beat(tmp_path):
    store = SessionStore(tmp_path / "store", KEY, worker="w1", ttl_s=60)
    try:
        key = new_session_key()
        store.hold(key, lambda: None)  # a live session that never hibernated
        store.leases.forget(entry_name(key))  # its holder died: no more beats
        lease = store.root / entry_name(key) / LEASE
        stalled = time.time() - LEASE_STALE_S - 1
        os.utime(lease, (stalled, stalled))
        assert store.sweep() == []  # stale, but a stall of seconds costs no entry
        gone = time.time() - 61
        os.utime(lease, (gone, gone))
        os.utime(lease.parent, (gone, gone))
        assert store.sweep() == [entry_name(key)]
    finally:
        store.close()


def test_a_store_that_cannot_be_written_is_a_setup_error_not_a_crash(store, tmp_path):
    key = new_session_key()
    (store.root / entry_name(key)).write_text("planted where the entry goes")
    with pytest.raises(SandboxSetupError, match="could not lease"):
        store.hold(key, lambda: None)
    with pytest.raises(LeaseLost):
        store.save(key, image(tmp_path / "img"), job=JOB, memory_limit=None, step=1)
    assert store.sweep() == [entry_name(key)]  # not a directory: planted, and swept


def test_an_old_holder_can_neither_publish_into_nor_remove_the_new_holders_entry(tmp_path):
    one = SessionStore(tmp_path / "store", KEY, worker="w1")
    two = SessionStore(tmp_path / "store", KEY, worker="w2")
    try:
        key = new_session_key()
        old = one.hold(key, lambda: None)
        one.save(key, image(tmp_path / "a", b"first"), job=JOB, memory_limit=None, step=1, lease=old)
        new = two.hold(key, lambda: None, take_over=True, new=False)
        before = sorted(os.listdir(one.root / entry_name(key)))
        for attempt in (
            lambda: one.save(key, image(tmp_path / "b", b"stale"), job=JOB, memory_limit=None, step=2, lease=old),
            lambda: one.drop_image(key, lease=old),
            lambda: one.remove(key, lease=old),
            lambda: one.remove(key),  # this worker's own token is still the old one: refused the same
        ):
            with pytest.raises(LeaseLost):
                attempt()
        assert sorted(os.listdir(one.root / entry_name(key))) == before
        assert two.load(key).step == 1
        two.remove(key, lease=new)
        assert not (two.root / entry_name(key)).exists()
        one.remove(key, lease=old)  # gone already: nothing to remove, nothing refused
    finally:
        one.close()
        two.close()


def test_a_lease_taken_while_a_generation_is_written_stops_its_publication(tmp_path, monkeypatch):
    one = SessionStore(tmp_path / "store", KEY, worker="w1")
    two = SessionStore(tmp_path / "store", KEY, worker="w2")
    try:
        key = stored(one, tmp_path)
        token = one.hold(key, lambda: None, new=False)
        import readie_worker.session_store as module

        real = module.copy_hashing

        def taken_meanwhile(*args, **kwargs):  # the copy is the long part, outside the lock
            if not two.holds(key):
                two.hold(key, lambda: None, take_over=True, new=False)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "copy_hashing", taken_meanwhile)
        with pytest.raises(LeaseLost):
            one.save(key, image(tmp_path / "late", b"late"), job=JOB, memory_limit=None, step=9, lease=token)
        assert [name for name in os.listdir(one.root / entry_name(key)) if name != LEASE] == ["g1"]
        assert two.load(key).step == 3
    finally:
        one.close()
        two.close()


def test_a_take_over_of_an_entry_with_nothing_stored_leaves_its_live_holder_alone(tmp_path):
    one = SessionStore(tmp_path / "store", KEY, worker="w1")
    two = SessionStore(tmp_path / "store", KEY, worker="w2")
    try:
        key = new_session_key()
        token = one.hold(key, lambda: None)  # live, never hibernated
        with pytest.raises(RequestError, match="no session is stored"):
            two.hold(key, lambda: None, take_over=True, new=False)
        one.leases.beat_now()
        assert one.holds(key) and not two.holds(key)
        one.save(key, image(tmp_path / "img"), job=JOB, memory_limit=None, step=1, lease=token)  # still its own
    finally:
        one.close()
        two.close()


def test_a_generation_replaced_while_it_is_read_is_read_again_never_refused(store, tmp_path, monkeypatch):
    key = stored(store, tmp_path, step=3)
    token = store.hold(key, lambda: None, new=False)
    old = store.load(key)
    store.save(key, image(tmp_path / "newer", b"newer"), job=JOB, memory_limit=None, step=4, lease=token)
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(SandboxSetupError, match="written again while it was read"):
        store.copy_image(old, into)  # g1 went: a publish, not tampering
    assert store.load(key).step == 4
    for name in os.listdir(into):
        os.unlink(into / name)
    # The same race inside load and load_image: a publish between listing and reading.
    import readie_worker.session_store as module

    real, published = module.read_bounded, []

    def publish_first(*args, **kwargs):
        if not published:
            published.append(True)
            store.save(key, image(tmp_path / "racing", b"racing"), job=JOB, memory_limit=None, step=5, lease=token)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "read_bounded", publish_first)
    assert store.load(key).step == 5
    monkeypatch.setattr(module, "read_bounded", real)
    real_copy = module.copy_hashing

    def publish_during_copy(*args, **kwargs):
        if len(published) == 1:
            published.append(True)
            store.save(key, image(tmp_path / "copied", b"copied"), job=JOB, memory_limit=None, step=6, lease=token)
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(module, "copy_hashing", publish_during_copy)
    loaded = store.load_image(key, into)
    assert loaded.step == 6 and (into / "checkpoint.img").read_bytes() == b"copied"
    assert sorted(os.listdir(into)) == ["checkpoint.img", "pages.img"]


def test_a_generation_is_bound_to_its_number_and_only_canonical_names_count(store, tmp_path):
    key = stored(store, tmp_path, step=3)
    entry = store.root / entry_name(key)
    token = store.hold(key, lambda: None, new=False)
    store.save(key, image(tmp_path / "b", b"second"), job=JOB, memory_limit=None, step=4, lease=token)
    import shutil

    for planted in ("g01", "g0", "g1000000000000", "gx"):  # not generations: ignored, kept, never read
        shutil.copytree(entry / "g2", entry / planted)
    assert store.load(key).step == 4 and store.sweep() == []
    assert {"g01", "g0", "g1000000000000", "gx"} <= set(os.listdir(entry))
    shutil.copytree(entry / "g2", entry / "g99")  # a rollback's copy under a newer number
    with pytest.raises(SandboxSetupError, match="published as generation 2, not as g99"):
        store.load(key)
    assert not entry.exists()


def test_a_planted_last_generation_number_stops_a_write_instead_of_looping(store, tmp_path):
    key = stored(store, tmp_path)
    token = store.hold(key, lambda: None, new=False)
    (store.root / entry_name(key) / "g999999999999").mkdir()
    with pytest.raises(SandboxSetupError, match="no generation number is left"):
        store.save(key, image(tmp_path / "b", b"b"), job=JOB, memory_limit=None, step=4, lease=token)


def test_another_store_keys_entries_are_kept_until_they_age_out_by_mtime(tmp_path):
    ours = SessionStore(tmp_path / "store", KEY, worker="w1", ttl_s=60)
    theirs = SessionStore(tmp_path / "store", b"r" * 32, worker="w2")  # a key being rotated in
    try:
        foreign, mine = stored(theirs, tmp_path), stored(ours, tmp_path)
        meta = (generation(theirs, foreign) / "meta.json").read_text()
        assert '"key_id":"' in meta and "rrrr" not in meta  # its id, never the key
        with pytest.raises(SandboxSetupError, match="another session store key"):
            ours.load(foreign)
        states = {info.entry: info.state for info in ours.entries()}
        assert states == {entry_name(foreign): "foreign", entry_name(mine): "stored"}
        assert ours.sweep() == [] and (ours.root / entry_name(foreign)).exists()
        spoiled = generation(ours, mine) / "meta.json"  # this key's entry that fails: removed
        spoiled.write_bytes(spoiled.read_bytes().replace(b'"step":3', b'"step":4'))
        assert ours.sweep() == [entry_name(mine)]
        gone = time.time() - 61
        os.utime(ours.root / entry_name(foreign), (gone, gone))
        assert ours.sweep() == [entry_name(foreign)]
    finally:
        ours.close()
        theirs.close()


def test_the_store_lock_is_waited_for_a_bounded_time(store, monkeypatch):
    import fcntl

    import readie_worker._store_layout as layout
    import readie_worker.session_store as module

    monkeypatch.setattr(layout, "STORE_LOCK_WAIT_S", 0.2)
    fd = os.open(store.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another worker's, or a hung host's
        started = time.monotonic()
        with pytest.raises(module.StoreBusy):
            store.check_room(1)
        assert time.monotonic() - started < 2
    finally:
        os.close(fd)
    store.check_room(1)


def test_a_lease_of_any_other_text_is_shown_as_unreadable_and_the_listing_escapes_what_it_prints(store):
    from readie_worker.sessions_cli import escaped

    key = new_session_key()
    store.hold(key, lambda: None)
    (store.root / entry_name(key) / LEASE).write_bytes(b"\x1b]0;owned\x07host:1/ab")
    [info] = store.entries()
    assert (info.state, info.worker) == ("leased", "?")
    assert escaped("w\x1b[2J\u202e") == "w\\x1b[2J\\u202e"

