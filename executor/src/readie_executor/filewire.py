"""The workspace calls' wire (decision 31), without I/O: what a ``collect`` pattern matches, and the
answers' layout; one for the sandbox that walks and writes them (:mod:`readie_executor.jobs._workspace`,
``_collect``) and the worker that checks them (``readie_worker._workspace``).

A pattern is a checked workspace path whose components may hold ``*``, ``?`` and ``[...]``
(:func:`fnmatch.fnmatchcase`, within one name; ``*`` matches a leading dot too) or be ``**``:
any number of directories, none included. A last ``**`` is ``**/*`` (every file below it).

A workspace call (collect, upload_chunk, download_chunk, list_files) answers with raw bytes, not
a pickle (``RAW_RESPONSE_ATTRIBUTE``: the worker never unpickles what leaves a sandbox)::

    header length (HEADER_LENGTH_BYTES, big-endian) | header: compact UTF-8 JSON object | data

``data`` is the bytes the header declares (a collect's files one after the other, a download's
chunk), as they are: never base64 inside the sandbox. A request the workspace cannot serve as
asked (a path through a link, a missing file) is answered ``{"refused": "why"}`` and no data.

Standard library only: this runs in the sandbox's own python3.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from typing import Any

__all__ = [
    "HEADER_LENGTH_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_REFUSAL_CHARS",
    "encode_answer",
    "is_glob",
    "pattern_matches",
    "pattern_parts",
    "refusal",
]

HEADER_LENGTH_BYTES = 4
# The largest honest header: a listing of 1000 entries (MAX_LISTED_ENTRIES) whose 255-byte
# names have every byte escaped as \u00XX (6 bytes) is 1.6 MB with its keys; a collect's 64
# files and 64 left out with 1024-byte paths so escaped is 0.8 MB. The worker refuses a longer
# header before parsing it.
MAX_HEADER_BYTES = 2 * 1024 * 1024
# A refusal names a path (at most 1 KiB) and says why in a sentence.
MAX_REFUSAL_CHARS = 2048


def encode_answer(header: dict[str, Any], data: bytes | bytearray = b"") -> bytearray:
    """The answer: its header's length, the header, then ``data``.

    A bytearray, so that a collect's files, read into one, are not copied once more here.
    """
    encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    answer = data if isinstance(data, bytearray) else bytearray(data)
    answer[:0] = len(encoded).to_bytes(HEADER_LENGTH_BYTES, "big") + encoded
    return answer


def refusal(message: str) -> bytearray:
    """The answer to a request the workspace cannot serve as asked."""
    return encode_answer({"refused": message[:MAX_REFUSAL_CHARS]})


# --------------------------------------------------------------------------- patterns

_GLOB_CHARACTERS = frozenset("*?[")


def is_glob(part: str) -> bool:
    """Whether one component of a pattern matches more than its own name."""
    return part == "**" or any(c in _GLOB_CHARACTERS for c in part)


def pattern_parts(pattern: str) -> list[str]:
    """A checked pattern's components: a run of ``**`` as one, a last ``**`` as ``**/*``."""
    parts: list[str] = []
    for part in pattern.split("/"):
        if not (part == "**" and parts and parts[-1] == "**"):
            parts.append(part)
    if parts[-1] == "**":
        parts.append("*")
    return parts


def pattern_matches(path: str, pattern: str) -> bool:
    """Whether workspace ``path`` is one ``pattern`` matches."""
    return _matches(path.split("/"), pattern_parts(pattern))


def _matches(names: list[str], parts: list[str]) -> bool:
    # Positions in ``parts`` reachable after each name: no recursion, at most len(parts) of them.
    states = {0}
    for name in names:
        following = set()
        for index in _closure(states, parts):
            if index < len(parts):
                part = parts[index]
                if part == "**":
                    following.add(index)
                elif fnmatchcase(name, part):
                    following.add(index + 1)
        states = following
        if not states:
            return False
    return len(parts) in _closure(states, parts)


def _closure(states: set[int], parts: list[str]) -> set[int]:
    """``states`` and, past each ``**``, the position after it (it may match no directory)."""
    reached = set(states)
    for index in sorted(states):
        while index < len(parts) and parts[index] == "**":
            index += 1
            reached.add(index)
    return reached
