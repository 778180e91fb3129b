"""The lease beat of a session store (readie_worker._store_leases), on real files: races with a
let-go. The rest of the leases' behaviour is in test_session_store.py."""

from __future__ import annotations

import threading

from readie_worker.session_store import SessionStore, new_session_key

KEY = b"k" * 32


def test_a_lease_let_go_while_the_beat_runs_is_not_reported_taken(tmp_path, monkeypatch):
    """A drain lets go of a session's lease between the beat's copy of its leases and its touch
    of that one: the copy was given up, not taken, and its holder is not told it was."""
    store = SessionStore(tmp_path / "store", KEY, worker="w1")
    try:
        key, lost = new_session_key(), threading.Event()
        store.hold(key, lost.set)  # a session opened here
        touch = store.leases._touch

        def let_go_first(entry: str, token: str) -> bool:
            assert store.let_go(key)
            return touch(entry, token)

        monkeypatch.setattr(store.leases, "_touch", let_go_first)
        store.leases.beat_now()
        assert not lost.is_set() and not store.holds(key)
    finally:
        store.close()
