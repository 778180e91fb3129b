"""The session store: hibernated sessions' images in a directory several workers share (decision 32).

Layout (every directory 0700, every file 0600)::

    <root>/.lock                        flock: bounds, leases, publishing and sweeps, across workers
    <root>/<sha256 of the key>/         one entry per session (the key itself is never written)
        lease                           the holder's token; its mtime is the heartbeat (_store_leases)
        g<N>/                           a complete generation: the newest one is the session (N canonical:
                                        no leading zero, at most 12 digits; other names are ignored)
            meta.json  meta.mac         metadata, and its HMAC-SHA256 under the store key
            checkpoint.img ...          runsc's image files
        .new-<random>-<bytes>/          a generation being written (renamed to g<N> once complete)

A write copies the image runsc wrote into the worker's private dir into a
new temporary generation while hashing it; then, under the lock and only
while the entry's lease is still the writer's token (else LeaseLost, and the
entry is the new holder's, untouched), it writes the metadata (format
version, the generation number, the store key's id, the setup job, memory
limit, step, writing worker, times, each file's size and SHA-256) and its
MAC, and renames the generation into place; older generations go after. A
read checks the MAC (constant time), that the metadata names this entry's
key and this generation's number, then copies each file into the worker's
private dir while hashing it, and the worker restores from that copy: a file
swapped after the check is never what runsc reads. A generation that
vanishes under a read was replaced by a newer one (its holder checkpointed
a step), and the read starts again from the newest. Anything else that
fails (but the machine's own errors, which keep it: ``_store_files``) is
refused with SandboxSetupError, logged (with the entry's hash, never
a key), and the entry removed, unless its metadata names another store key's
id: that entry is another key's (a rotation, a misconfigured worker), kept,
and ages out by its mtime alone.

The lock is ``flock`` on ``.lock`` (``_store_layout.flock_by``): the volume must honour
``flock`` between hosts (NFSv4, CephFS; not SMB/CIFS), or workers' writes and leases clash.

Bounds are per store, counted over the directory under the lock (other
workers write it too): ``max_entries`` stored sessions and ``max_bytes``
of generations, finished or being written. An entry not used for ``ttl_s``
and not leased live is removed by whichever worker sweeps next (each worker
sweeps every :data:`SWEEP_EVERY_S`).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog

from ._store_files import UnsafeFile, copy_hashing, make_dir, opened_dir, read_bounded, store_errors
from ._store_meta import (
    MAC, MAX_IMAGE_FILE_BYTES, MAX_MAC_BYTES, MAX_METADATA_BYTES, META, ForeignEntry, StoredSession, image_files, read_store_key,
    seal, unseal, write_sealed,
)
from ._store_layout import MAX_GENERATION, StoreBusy, entry_bytes, entry_names, generation_numbers, open_root, store_locked
from ._store_leases import LEASE, LeaseKeeper, LeaseLost, NoImage, check_lease, lease_state, new_token, take_lease, worker_of
from ._store_listing import EntryInfo, describe
from .errors import Cancelled, RequestError, SandboxSetupError
from .jobs import CodeJob
from .paths import remove_tree

__all__ = [
    "DEFAULT_STORE_BYTES", "DEFAULT_STORE_ENTRIES", "DEFAULT_STORE_TTL_S", "EntryInfo", "LeaseLost", "SessionStore",
    "StoreBusy", "StoreUnreadable", "StoredSession", "entry_name", "new_session_key", "read_store_key",
]

log = structlog.get_logger("readie.worker")

#: All generations together. An idle pandas session's image is ~50 MB uncompressed
#: (``--compression=none``, measured), so this holds about eighty: the size of a worker's
#: own store before there was a shared one.
DEFAULT_STORE_BYTES = 4 * 1024**3
#: Sessions stored at once: each is a session that left memory for disk; sixteen workers'
#: worth of their default ``max_sessions`` (16), which the byte bound reaches first anyway.
DEFAULT_STORE_ENTRIES = 256
#: A stored session nobody attached for a day is abandoned (issue 30's default).
DEFAULT_STORE_TTL_S = 24 * 3600.0
#: Each worker sweeps the TTL this often: minutes late is fine for a day-long TTL.
SWEEP_EVERY_S = 60.0
#: A session key: 32 random bytes in URL-safe base64 (43 characters); anything longer is not one.
SESSION_KEY_BYTES = 32
_SESSION_KEY = re.compile(r"[A-Za-z0-9_-]{43}")
_UNKNOWN = "no session is stored under this key"
#: Tries at naming a new generation: under the lock nobody else numbers one, so a second try
#: happens only when a name was planted, and a third would be the same plant again.
MAX_PUBLISH_TRIES = 3
#: Tries at reading a session whose generation vanished under the read: each vanishing is a
#: newer generation published meanwhile (the holder checkpointing a step), and the read goes on
#: with the newest; a holder publishing faster than a read, over and over, is refused.
MAX_READ_TRIES = 4
def new_session_key() -> str:
    """A new session's key: 32 random bytes, URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(secrets.token_bytes(SESSION_KEY_BYTES)).rstrip(b"=").decode()


def entry_name(key: str) -> str:
    """The entry of the session with ``key``: its SHA-256, so that the store never holds a key."""
    return hashlib.sha256(key.encode()).hexdigest()


class SessionStore:
    """One store directory, as one worker (``worker``) uses it; see the module docstring."""

    def __init__(
        self, root: Path, key: bytes, *, worker: str, ttl_s: float = DEFAULT_STORE_TTL_S,
        max_bytes: int = DEFAULT_STORE_BYTES, max_entries: int = DEFAULT_STORE_ENTRIES, keep_leases: bool = True,
    ) -> None:
        self.root = root
        self.worker = worker
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._key = key
        self._root_fd = open_root(root)
        self._threads = threading.Lock()  # flock excludes other processes; this, other threads
        self._usage = (0, 0)  # (entries, bytes) at the last count
        self.leases = LeaseKeeper(self._root_fd, self.sweep, SWEEP_EVERY_S) if keep_leases else None

    # -- usage -----------------------------------------------------------------------------

    @property
    def usage(self) -> tuple[int, int]:
        """(entries, bytes) as last counted (every write and sweep counts them again)."""
        return self._usage

    def check_room(self, estimate: int, *, new_entry: bool = True) -> None:
        """SandboxSetupError when an image of ``estimate`` bytes would not fit now."""
        with self._locked():
            self._check_room(self._count(), estimate, new_entry)

    # -- writing ---------------------------------------------------------------------------

    def save(self, key: str, image: Path, *, job: CodeJob, memory_limit: int | None, step: int,
             lease: str | None = None) -> int:
        """Store the image runsc wrote into ``image`` (the worker's own dir) as the session's newest
        generation; its bytes. ``lease``: the token :meth:`hold` returned (None: the one this worker
        holds now); the generation is published only while the entry's lease is still that token,
        else LeaseLost and the entry is left as it is. SandboxSetupError when the store is full or
        cannot be written."""
        entry = entry_name(key)
        token = self._token(entry, lease)
        sizes = image_files(image)
        total = sum(sizes.values())
        with store_errors("make room for the session"), self._locked():
            check_lease(self._root_fd, entry, token)
            previous = self._stored_generation(entry)
            new_entry = previous is None
            self._check_room(self._count(), total, new_entry)
            make_dir(entry, self._root_fd, exist_ok=True)
            writing = f".new-{secrets.token_hex(8)}-{total}"
            with opened_dir(entry, self._root_fd) as entry_fd:
                make_dir(writing, entry_fd)
        with self._unpublished(entry, writing, "the session could not be written to the session store"), \
                opened_dir(entry, self._root_fd) as entry_fd, opened_dir(writing, entry_fd) as new_fd, opened_dir(str(image)) as image_fd:
            files = tuple((name, *copy_hashing(image_fd, name, new_fd, MAX_IMAGE_FILE_BYTES)) for name in sorted(sizes))
            created = self._created(entry, previous)
            self._publish(entry, entry_fd, writing, token, lambda number: seal(
                self._key, entry, number, job, memory_limit=memory_limit, step=step, worker=self.worker,
                files=files, now=time.time(), created=created))
        with self._locked():
            self._usage = self._count()
        return total

    def share(self, stored: StoredSession, key: str, step: int, *, lease: str | None = None) -> None:
        """A second entry (for a fork's ``key``, leased as :meth:`save`'s) holding ``stored``'s image:
        the files hard-linked, the metadata the fork's own. SandboxSetupError when the store is full."""
        entry = entry_name(key)
        token = self._token(entry, lease)
        with store_errors("make room for the fork"), self._locked():
            check_lease(self._root_fd, entry, token)
            self._check_room(self._count(), 0, True)
            make_dir(entry, self._root_fd, exist_ok=True)
        writing = f".new-{secrets.token_hex(8)}-0"
        with self._unpublished(entry, writing, "cannot share a session image"), \
                opened_dir(stored.entry, self._root_fd) as source_fd, opened_dir(stored.generation, source_fd) as generation_fd, \
                opened_dir(entry, self._root_fd) as entry_fd:
            make_dir(writing, entry_fd)
            with opened_dir(writing, entry_fd) as new_fd:
                for name, _, _ in stored.files:
                    os.link(name, name, src_dir_fd=generation_fd, dst_dir_fd=new_fd, follow_symlinks=False)
            self._publish(entry, entry_fd, writing, token, lambda number: seal(
                self._key, entry, number, stored.job, memory_limit=stored.memory_limit, step=step, worker=self.worker,
                files=stored.files, now=time.time()))

    @contextlib.contextmanager
    def _unpublished(self, entry: str, writing: str, failure: str) -> Iterator[None]:
        """Whatever ends the block early (the store full or busy, the metadata too large, the lease
        lost, a disk error) removes ``writing``, the generation it was writing, which the store
        would otherwise count until STALE_WRITE_S; an OSError or UnsafeFile is SandboxSetupError."""
        try:
            yield
        except BaseException as exc:
            with contextlib.suppress(UnsafeFile, OSError), opened_dir(entry, self._root_fd) as entry_fd:
                remove_tree(writing, dir_fd=entry_fd)
            if isinstance(exc, (OSError, UnsafeFile)):
                raise SandboxSetupError(f"{failure}: {exc}") from None
            raise

    def _created(self, entry: str, previous: str | None) -> float | None:
        """When the session was first stored: the previous generation's, if it verifies."""
        if previous is None:
            return None
        try:
            return self._verified(entry, previous).created
        except (UnsafeFile, OSError, ValueError):
            return None

    def _publish(self, entry: str, entry_fd: int, writing: str, token: str,
                 sealed: Callable[[int], tuple[bytes, bytes]]) -> None:
        """Seal the complete ``writing`` as the next generation (``sealed(number)``: its metadata and
        MAC) and rename it into place, then drop the older ones: under the lock, and only while
        ``token`` is still the entry's lease. Every writer numbers under the lock, so a name taken
        meanwhile was planted: tried again :data:`MAX_PUBLISH_TRIES` times, then refused."""
        with self._locked():
            check_lease(self._root_fd, entry, token)
            with opened_dir(writing, entry_fd) as new_fd:
                for _ in range(MAX_PUBLISH_TRIES):
                    older = generation_numbers(entry_fd)
                    number = max(older, default=0) + 1
                    if number > MAX_GENERATION:
                        raise UnsafeFile(f"g{max(older)}: no generation number is left after it")
                    for name in (META, MAC):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(name, dir_fd=new_fd)
                    write_sealed(new_fd, sealed(number))
                    try:
                        os.rename(writing, f"g{number}", src_dir_fd=entry_fd, dst_dir_fd=entry_fd)
                        break
                    except OSError as exc:
                        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                            raise
                else:
                    raise UnsafeFile(f"generation names kept appearing ({MAX_PUBLISH_TRIES} tries)")
            for generation in older:
                remove_tree(f"g{generation}", dir_fd=entry_fd)

    # -- reading ---------------------------------------------------------------------------

    def load(self, key: str) -> StoredSession:
        """The verified metadata of the session stored under ``key``. RequestError (field
        ``attach``) when there is none, SandboxSetupError when it fails verification (logged, and
        the entry removed unless it is another store key's), or kept changing while read."""
        if not isinstance(key, str) or not _SESSION_KEY.fullmatch(key):
            raise RequestError(_UNKNOWN, field="attach")
        entry = entry_name(key)
        for _ in range(MAX_READ_TRIES):
            generation = self._stored_generation(entry)
            if generation is None:
                raise RequestError(_UNKNOWN, field="attach")
            try:
                return self._verified(entry, generation)
            except ForeignEntry as exc:
                log.warning("session store entry of another store key; kept", entry=entry[:16], reason=str(exc))
                raise SandboxSetupError("the stored session was written under another session store key; it is kept") from None
            except (UnsafeFile, ValueError) as exc:
                self._refuse(entry, generation, str(exc))  # returns: a newer generation replaced it
            except OSError as exc:  # the machine's, not the entry's (_store_files): the entry is kept
                raise StoreUnreadable(f"the stored session could not be read: {exc.strerror}") from None
        raise _kept_changing()

    def load_image(self, key: str, into: Path) -> StoredSession:
        """:meth:`load` and :meth:`copy_image` into the empty private dir ``into``, read again from
        the newest generation when the one being copied was replaced meanwhile: the metadata
        returned is always the image's in ``into``."""
        for _ in range(MAX_READ_TRIES):
            stored = self.load(key)
            try:
                self.copy_image(stored, into)
                return stored
            except _Replaced:
                with opened_dir(str(into)) as into_fd:  # what the copy left: only these names
                    for name, _, _ in stored.files:
                        remove_tree(name, dir_fd=into_fd)
        raise _kept_changing()

    def copy_image(self, stored: StoredSession, into: Path) -> None:
        """Copy ``stored``'s image files into the empty private dir ``into``, each checked against
        its recorded size and SHA-256 as it is copied: what a restore then reads. A generation
        replaced meanwhile by a newer one is a SandboxSetupError that keeps the entry
        (:meth:`load_image` reads the newer one instead)."""
        into_fd = -1
        try:
            into_fd = os.open(into, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the worker's own: never the entry's fault
            with opened_dir(stored.entry, self._root_fd) as entry_fd, opened_dir(stored.generation, entry_fd) as generation_fd:
                for name, size, digest in stored.files:
                    copied, got = copy_hashing(generation_fd, name, into_fd, size)
                    if copied != size or not hmac.compare_digest(got, digest):
                        raise UnsafeFile(f"{name}: {copied} bytes that do not match the image written")
        except UnsafeFile as exc:
            self._refuse(stored.entry, stored.generation, str(exc))
            raise _Replaced("the stored session was written again while it was read; attach again") from None
        except OSError as exc:  # the machine's (the worker's disk full, say): the entry may well be sound, and is kept
            raise SandboxSetupError(f"the stored session could not be copied to this worker: {exc.strerror}") from None
        finally:
            if into_fd >= 0:
                os.close(into_fd)

    def _verified(self, entry: str, generation: str) -> StoredSession:
        with opened_dir(entry, self._root_fd) as entry_fd, opened_dir(generation, entry_fd) as generation_fd:
            meta = read_bounded(generation_fd, META, MAX_METADATA_BYTES)
            mac = read_bounded(generation_fd, MAC, MAX_MAC_BYTES)
        return unseal(self._key, entry, generation, meta, mac)

    def _refuse(self, entry: str, generation: str, reason: str) -> None:
        """Remove ``entry``, whose ``generation`` failed a check, and raise the refusal; unless
        ``generation`` is no longer the entry's newest (a newer one was published while it was read,
        and the failure was only that): then return, for the caller to read the newest."""
        with self._locked():
            if self._stored_generation(entry) != generation:
                log.info("a stored session's generation was replaced while read; reading the newest", entry=entry[:16])
                return
            log.warning("session store entry refused and removed", entry=entry[:16], reason=reason)
            remove_tree(entry, dir_fd=self._root_fd)
        raise SandboxSetupError(f"the stored session failed verification and was removed: {reason}")

    # -- leases ----------------------------------------------------------------------------

    def hold(self, key: str, on_lost: Callable[[], None], *, take_over: bool = False, wait_s: float = 0.0,
             stop: Callable[[], bool] = lambda: False, new: bool = True) -> str:
        """Take the lease of ``key``'s entry for this worker, kept fresh until :meth:`let_go`;
        ``on_lost`` is called if another holder takes it. ``new``: the entry is made (a session
        opened here); else a missing one is a RequestError (field ``attach``). A lease held live
        elsewhere is waited for up to ``wait_s`` (SandboxSetupError then), taken at once with
        ``take_over``. The lease's token: what :meth:`save`, :meth:`share`, :meth:`drop_image` and
        :meth:`remove` take as ``lease``."""
        assert self.leases is not None
        entry = entry_name(key)
        token = new_token(self.worker)
        deadline = time.monotonic() + wait_s
        while True:
            with store_errors("lease the session's entry"), self._locked():
                if new:
                    make_dir(entry, self._root_fd, exist_ok=True)
                try:
                    holder = take_lease(self._root_fd, entry, token, take_over=take_over,
                                        holds_image=None if new else _holds_image)
                except NoImage:  # no entry, or one with nothing stored: no session to attach
                    raise RequestError(_UNKNOWN, field="attach") from None
                if holder is None:
                    self.leases.hold(entry, token, on_lost)
                    return token
            if stop():
                raise Cancelled("the attach was cancelled while it waited for the session's holder")
            if time.monotonic() >= deadline:
                # Never the holder's name: the lease file is unauthenticated text, and a client's business is not which host.
                log.info("a session's lease was still held live", entry=entry[:16], holder=worker_of(holder))
                raise SandboxSetupError("the session is held live by another worker that did not let go")
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def let_go(self, key: str) -> bool:
        """Give up this worker's lease of ``key``'s entry; whether it was still this worker's."""
        assert self.leases is not None
        entry = entry_name(key)
        token = self.leases.forget(entry)
        with self._locked(), contextlib.suppress(UnsafeFile, OSError), opened_dir(entry, self._root_fd) as entry_fd:
            if token is not None and lease_state(entry_fd, time.time())[0] == token:
                os.unlink(LEASE, dir_fd=entry_fd)
                return True
        return False

    def holds(self, key: str) -> bool:
        return self.leases is not None and self.leases.token(entry_name(key)) is not None

    # -- removing --------------------------------------------------------------------------

    def drop_image(self, key: str, *, lease: str | None = None) -> None:
        """Remove the stored generations of ``key`` (the session is live again), keeping its lease;
        ``lease`` as :meth:`save`'s (LeaseLost, and nothing removed, when it is not the entry's)."""
        entry = entry_name(key)
        token = self._token(entry, lease)
        with store_errors("drop the stored image"), self._locked():
            check_lease(self._root_fd, entry, token)
            with contextlib.suppress(UnsafeFile), opened_dir(entry, self._root_fd) as entry_fd:
                for generation in generation_numbers(entry_fd):
                    remove_tree(f"g{generation}", dir_fd=entry_fd)
            self._usage = self._count()

    def remove(self, key: str, *, lease: str | None = None) -> None:
        """Remove ``key``'s entry: the session has closed. ``lease`` as :meth:`save`'s: an entry
        whose lease is no longer this holder's is another's, and LeaseLost leaves it alone; an entry
        already gone is nothing to remove."""
        entry = entry_name(key)
        token = self._token(entry, lease)
        try:
            with store_errors("remove the session's entry"), self._locked():
                if entry in entry_names(self._root_fd):  # gone already (its new holder closed it): nothing to do
                    check_lease(self._root_fd, entry, token)
                    remove_tree(entry, dir_fd=self._root_fd)
                    self._usage = self._count()
        finally:  # removed or not (the store busy, say), the session is over here: its lease goes stale, and a sweep takes it
            if self.leases is not None and self.leases.token(entry) == token:
                self.leases.forget(entry)

    def remove_entry(self, entry: str) -> None:
        """Remove ``entry`` whoever holds it: the operator's ``readie sessions remove``."""
        with self._locked():
            remove_tree(entry, dir_fd=self._root_fd)
            self._usage = self._count()

    def sweep(self) -> list[str]:
        """Remove entries past the TTL (or unreadable, or holding nothing) that no live lease holds,
        and writes left by dead workers; the entries removed."""
        removed = []
        with self._locked():
            for info in self._described():
                if info.state in ("expired", "invalid"):
                    remove_tree(info.entry, dir_fd=self._root_fd)
                    removed.append(info.entry)
            self._usage = self._count()
        if removed:
            log.info("session store swept", entries=len(removed))
        return removed

    def entries(self) -> list[EntryInfo]:
        with self._locked():
            return self._described()

    def _described(self) -> list[EntryInfo]:
        now = time.time()
        return [describe(self._root_fd, entry, now, self.ttl_s, self._verified) for entry in entry_names(self._root_fd)]

    def close(self) -> None:
        """Stop the lease beat and let go of the directory; again: nothing."""
        if self.leases is not None:
            self.leases.close()
        root_fd, self._root_fd = self._root_fd, -1
        if root_fd >= 0:
            os.close(root_fd)

    # -- inside the lock -------------------------------------------------------------------

    def _token(self, entry: str, lease: str | None) -> str:
        """The lease token a write or removal of ``entry`` goes by: ``lease``, else this worker's."""
        token = lease if lease is not None else (self.leases.token(entry) if self.leases is not None else None)
        if token is None:
            raise LeaseLost("this worker does not hold the session's store entry")
        return token

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return store_locked(self._root_fd, self._threads)

    def _check_room(self, usage: tuple[int, int], estimate: int, new_entry: bool) -> None:
        """SandboxSetupError when the store is full; its totals go to the log, never to a client."""
        entries, used = self._usage = usage
        if (new_entry and entries >= self.max_entries) or used + estimate > self.max_bytes:
            log.warning("session store full", entries=entries, max_entries=self.max_entries, bytes=used,
                        needed=estimate, max_bytes=self.max_bytes)
            raise SandboxSetupError("the session store is full")

    def _count(self) -> tuple[int, int]:
        """(entries holding or writing an image, bytes of their generations)."""
        entries = total = 0
        for entry in entry_names(self._root_fd):
            with contextlib.suppress(UnsafeFile, OSError), opened_dir(entry, self._root_fd) as entry_fd:
                used = entry_bytes(entry_fd)
                if used is not None:
                    entries += 1
                    total += used
        return entries, total

    def _stored_generation(self, entry: str) -> str | None:
        try:
            with opened_dir(entry, self._root_fd) as entry_fd:
                generations = generation_numbers(entry_fd)
        except UnsafeFile:
            return None
        except OSError as exc:  # the machine's (_store_files): nothing is known of the entry
            raise StoreUnreadable(f"the session store could not be read: {exc.strerror}") from None
        return f"g{max(generations)}" if generations else None



class StoreUnreadable(SandboxSetupError):
    """The machine failed a read of the store (an I/O error, no descriptors left): nothing is known
    of the entry, which is kept, and whoever would act on it as gone must not."""


class _Replaced(SandboxSetupError):
    """The generation being copied was replaced by a newer one (no tampering: the entry is sound)."""


def _kept_changing() -> SandboxSetupError:
    return SandboxSetupError(f"the stored session was written again {MAX_READ_TRIES} times while it was read; attach again")


def _holds_image(entry_fd: int) -> bool:
    return bool(generation_numbers(entry_fd))
