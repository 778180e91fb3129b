"""What state a session store's entry is in, as a sweep judges it and ``readie sessions`` lists it.

States: ``leased`` (a worker holds it live: never removed), ``stored``
(waiting for an attach), ``foreign`` (its metadata names another store
key's id: never judged by this key, it ages out by its mtime alone),
``expired`` (past the TTL, or holding nothing for that long),
``invalid`` (this key's entry that fails verification, or not a directory)
and ``unreadable`` (the machine failed a read: descriptors ran out, an I/O
error, a network volume's stale handle; nothing is known of the entry, and
it is kept). A sweep removes ``expired`` and ``invalid``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._store_files import UnsafeFile, opened_dir
from ._store_layout import entry_bytes, generation_numbers, last_touched
from ._store_leases import lease_state, worker_of
from ._store_meta import ForeignEntry, StoredSession

__all__ = ["EntryInfo", "describe"]


@dataclass(frozen=True)
class EntryInfo:
    """One entry as ``readie sessions`` lists it."""

    entry: str
    state: str  # leased, stored, foreign (another store key's), expired, invalid, unreadable
    worker: str | None
    bytes: int
    age_s: float | None  # since last used


def describe(root_fd: int, entry: str, now: float, ttl_s: float,
             verified: Callable[[str, str], StoredSession]) -> EntryInfo:
    """``entry``'s state at ``now``; ``verified(entry, generation)`` reads a generation's metadata
    (raising as the store's reads do). Call under the store's lock."""
    try:
        with opened_dir(entry, root_fd) as entry_fd:
            holder, live = lease_state(entry_fd, now)
            used = entry_bytes(entry_fd, now) or 0
            generations = generation_numbers(entry_fd)
            touched = last_touched(entry_fd)
    except UnsafeFile:
        return EntryInfo(entry, "invalid", None, 0, None)  # not a directory: planted
    except OSError:
        return EntryInfo(entry, "unreadable", None, 0, None)
    stored, foreign = None, False
    if generations:
        try:
            stored = verified(entry, f"g{max(generations)}")
        except ForeignEntry:
            foreign = True
        except (UnsafeFile, ValueError):
            pass
        except OSError:
            return EntryInfo(entry, "unreadable", worker_of(holder), used, None)
    # A stored session's age is its metadata's (under the MAC); an entry holding nothing (a live
    # session's, whose holder stalled or died without writing) or another key's ages from its
    # mtime or its lease's last beat, so that a holder's stall of seconds never costs it its entry.
    age = now - (stored.last_used if stored is not None else touched)
    if live:
        state = "leased"
    elif foreign:
        state = "expired" if age > ttl_s else "foreign"
    elif generations and stored is None:
        state = "invalid"
    else:
        state = "expired" if age > ttl_s else "stored"
    return EntryInfo(entry, state, stored.worker if stored else worker_of(holder), used, age)
