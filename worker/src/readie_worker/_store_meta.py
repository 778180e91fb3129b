"""What a session store entry's metadata says, and how it is sealed (``session_store.py``).

The metadata (``meta.json``) names the entry it belongs to (the hash of the
session key) and the generation (the ``g<N>`` directory it was published
as, so that a copy planted under a newer number is refused), the store key's
id (:func:`key_id`, never the key), the session's setup job (its one JSON form, ``_job_json``),
memory limit, step number, writing worker, times, and every image file's
name, size and SHA-256; ``meta.mac`` is its HMAC-SHA256 under the store key.
:func:`unseal` checks the MAC first (constant time) and only then parses
the text, strictly: a ValueError for anything off, which the store turns
into a refusal. A MAC that does not match on metadata naming another key id
is a :class:`ForeignEntry`: written by workers of another store key (one
being rotated in, or a worker given the wrong file), which this worker
neither reads nor removes. The id is read before the MAC is checked, so it
is only ever trusted to keep an entry, never to use one. The store key comes from a file the operator names,
read once (:func:`read_store_key`).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._job_json import job_from_json, job_to_json
from ._store_files import opened_dir, regular_sizes, write_new
from .errors import ConfigError, RequestError, SandboxSetupError
from .jobs import CodeJob

__all__ = [
    "check_storable",
    "FORMAT", "KEY_ID_CHARS", "MAC", "ForeignEntry", "MAX_IMAGE_FILES", "MAX_IMAGE_FILE_BYTES", "MAX_MAC_BYTES", "MAX_METADATA_BYTES", "META",
    "StoredSession", "image_files", "is_image_file", "key_id", "read_store_key", "seal", "unseal", "write_sealed",
]

#: The metadata holds a job's setup (env, grants, functions; its code and files are not kept):
#: kilobytes. Read whole, so bounded well before memory is at stake.
MAX_METADATA_BYTES = 256 * 1024
# What a generation's metadata holds besides the session's setup: ids, times and the image files'
# records (at most MAX_IMAGE_FILES of ~120 bytes), with room to spare.
METADATA_BESIDES_SETUP = 8 * 1024
#: The MAC file: 64 hex digits; anything longer is not one.
MAX_MAC_BYTES = 128
#: A runsc image is a handful of files (checkpoint.img, pages, pages' metadata).
MAX_IMAGE_FILES = 16
#: One image file: a session's memory, bounded by the sandbox backstop (a few GiB) well below this.
MAX_IMAGE_FILE_BYTES = 64 * 1024**3
#: The store key: at least 256 bits, like HMAC-SHA256's own; read whole, so bounded.
MIN_STORE_KEY_BYTES = 32
MAX_STORE_KEY_BYTES = 4096
#: The metadata's layout; an entry of another format is refused, not guessed at.
#: 2: the generation and the key id are in it.
FORMAT = 2
#: A key id: 64 bits of HMAC(key, KEY_ID_LABEL) in hex: tells stores' keys apart, reveals nothing of one.
KEY_ID_CHARS = 16
KEY_ID_LABEL = b"readie-store-key-id"
META = "meta.json"
MAC = "meta.mac"
_IMAGE_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KEY_ID = re.compile(r"[0-9a-f]{%d}" % KEY_ID_CHARS)


class ForeignEntry(ValueError):
    """Metadata sealed under another store key (by its unverified key id): another key's to use or remove."""


def key_id(key: bytes) -> str:
    """The id of the store key ``key``, written in every entry's metadata."""
    return hmac.new(key, KEY_ID_LABEL, hashlib.sha256).hexdigest()[:KEY_ID_CHARS]


@dataclass(frozen=True)
class StoredSession:
    """A verified entry's metadata: what a worker needs to go on with the session."""

    entry: str
    generation: str
    job: CodeJob
    memory_limit: int | None
    step: int
    worker: str
    created: float
    last_used: float
    files: tuple[tuple[str, int, str], ...]  # (name, bytes, sha256)

    @property
    def bytes(self) -> int:
        return sum(size for _, size, _ in self.files)


def is_image_file(name: str) -> bool:
    return bool(_IMAGE_FILE.fullmatch(name)) and name not in (META, MAC)


def image_files(image: Path) -> dict[str, int]:
    """The files runsc wrote into the worker's own dir ``image`` and their sizes, if a store may keep them."""
    with opened_dir(str(image)) as fd:
        sizes = regular_sizes(fd)
    if not 0 < len(sizes) <= MAX_IMAGE_FILES or not all(is_image_file(name) for name in sizes):
        raise SandboxSetupError(f"runsc wrote an image this store cannot keep: {sorted(sizes)[:MAX_IMAGE_FILES + 1]}")
    return sizes


def write_sealed(generation_fd: int, sealed: tuple[bytes, bytes]) -> None:
    """Write a generation's metadata and MAC (``seal``'s) into it."""
    meta, mac = sealed
    write_new(generation_fd, META, meta)
    write_new(generation_fd, MAC, mac)


def seal(key: bytes, entry: str, generation: int, job: CodeJob, *, memory_limit: int | None, step: int, worker: str,
         files: tuple[tuple[str, int, str], ...], now: float, created: float | None = None) -> tuple[bytes, bytes]:
    """The metadata of generation ``generation`` (published as ``g<generation>``) of ``entry`` and its
    MAC under ``key``; ``created``: when the session was first stored (None: now)."""
    setup = _setup(job)
    data = {"format": FORMAT, "entry": entry, "generation": generation, "key_id": key_id(key), "job": setup, "memory_limit": memory_limit, "step": step,
            "worker": worker, "created": now if created is None else created, "last_used": now, "files": [list(file) for file in files]}
    meta = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    if len(meta) > MAX_METADATA_BYTES:
        raise SandboxSetupError(f"the session's setup takes {len(meta)} bytes of metadata; the store keeps at most {MAX_METADATA_BYTES}")
    return meta, _mac(key, meta)


def check_storable(job: CodeJob) -> None:
    """RequestError (field ``env``, what makes a setup large) when ``job``'s setup would not fit a
    stored generation's metadata: refused as the session opens, not at its first hibernation."""
    size = len(json.dumps(_setup(job), separators=(",", ":")))
    room = MAX_METADATA_BYTES - METADATA_BESIDES_SETUP
    if size > room:
        raise RequestError(f"the session's setup takes {size} bytes (its env above all); a session that can be "
                           f"stored takes at most {room}", field="env")


def _setup(job: CodeJob) -> dict[str, Any]:
    """What a stored generation keeps of the session's setup: a step's code and files are not the
    session's (every later step replaces them)."""
    return job_to_json(dataclasses.replace(job, code="", files=()))


def unseal(key: bytes, entry: str, generation: str, meta: bytes, mac: bytes) -> StoredSession:
    """The session ``meta`` describes, once its ``mac`` is checked; ValueError naming what is wrong."""
    if not hmac.compare_digest(mac, _mac(key, meta)):
        theirs = peek_key_id(meta)
        if theirs is not None and theirs != key_id(key):
            raise ForeignEntry(f"it was written under another store key (id {theirs})")
        raise ValueError("its MAC does not match: written under another key, or changed since")
    try:
        data = json.loads(meta)
        if data["format"] != FORMAT:
            raise ValueError(f"format {data['format']!r}, this worker reads {FORMAT}")
        if not hmac.compare_digest(str(data["entry"]), entry):
            raise ValueError("it was written for another session")
        if f"g{_int(data['generation'])}" != generation:
            raise ValueError(f"it was published as generation {data['generation']}, not as {generation}")
        files = tuple(_file(file) for file in data["files"])
        if not 0 < len(files) <= MAX_IMAGE_FILES:
            raise ValueError(f"{len(files)} image files")
        return StoredSession(
            entry, generation, job_from_json(data["job"]), _optional_int(data["memory_limit"]), _int(data["step"]),
            str(data["worker"]), float(data["created"]), float(data["last_used"]), files,
        )
    except (KeyError, TypeError, AttributeError, RecursionError) as exc:  # a field missing, or of another shape
        raise ValueError(f"its metadata is malformed ({type(exc).__name__}: {exc})") from None


def read_store_key(path: Path) -> bytes:
    """The store key in ``path`` (its bytes as they are), read once. ConfigError naming the file
    when it is a symlink, not a regular file, readable by group or others, or too short."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        reason = "is a symlink; name the file itself" if exc.errno == errno.ELOOP else f"cannot be read: {exc.strerror}"
        raise ConfigError(str(path), None, f"the session store key {reason}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(str(path), None, "the session store key is not a regular file")
        if info.st_mode & 0o077:
            raise ConfigError(str(path), None, f"the session store key is readable by others (mode {stat.S_IMODE(info.st_mode):o}); chmod 600 it")
        key = os.read(fd, MAX_STORE_KEY_BYTES + 1)
    finally:
        os.close(fd)
    if not MIN_STORE_KEY_BYTES <= len(key) <= MAX_STORE_KEY_BYTES:
        raise ConfigError(str(path), None, f"the session store key must be {MIN_STORE_KEY_BYTES} to {MAX_STORE_KEY_BYTES} bytes, not {len(key)}")
    return key


def peek_key_id(meta: bytes) -> str | None:
    """The key id unverified ``meta`` names, if it names one: what keeps a foreign entry, nothing more."""
    try:
        data = json.loads(meta)
    except (ValueError, RecursionError):  # unauthenticated bytes: nested deep enough, json recurses out
        return None
    value = data.get("key_id") if isinstance(data, dict) else None
    return value if isinstance(value, str) and _KEY_ID.fullmatch(value) else None


def _mac(key: bytes, meta: bytes) -> bytes:
    return hmac.new(key, meta, hashlib.sha256).hexdigest().encode()


def _file(value: object) -> tuple[str, int, str]:
    if not (isinstance(value, list) and len(value) == 3):
        raise ValueError("an image file's record is not [name, bytes, sha256]")
    name, size, digest = value
    if not (isinstance(name, str) and is_image_file(name)):
        raise ValueError(f"image file name {name!r}")
    if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
        raise ValueError("an image file's digest is not a SHA-256")
    return name, _int(size), digest


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def _optional_int(value: object) -> int | None:
    return None if value is None else _int(value)
