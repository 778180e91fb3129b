"""What a sandbox answers about its workspace's files: hostile bytes, checked and rebuilt (decision 31).

The executor answers a workspace call in :mod:`readie_executor.filewire`'s layout (a header's
length, a JSON header, the bytes it declares), but the job's code ran in that same process and
may have replaced the functions that write it. So an answer is read as a hostile frame is
(specs/hostile-frames.md): its size was bounded before it was received (the budgets here), the
header's length is checked before the header is parsed, and every name, size and count is
checked against the request: each path a checked workspace path that one of the request's
patterns matches, no path twice, sizes that add up exactly to the bytes sent, counts and bytes
within the job's limits, a chunk no longer than asked and within the file. Anything else is a
:class:`PoolWorkerError`, and the caller trusts the sandbox no more. A refusal the sandbox
sends (``{"refused": why}``: a path through a link, a missing file) is a :class:`RequestError`
naming the request's field.
"""

from __future__ import annotations

from typing import Any

from readie_executor.filewire import HEADER_LENGTH_BYTES, MAX_HEADER_BYTES, MAX_REFUSAL_CHARS, pattern_matches
from readie_protocol.workspace import (
    FILE_KINDS,
    LEFT_OUT_REASONS,
    MAX_LEFT_OUT,
    Collected,
    FileChunk,
    FileEntry,
    FileListing,
    LeftOut,
    workspace_path,
)

from ._job_result import JobResultInvalid, clean_text, load_json
from .errors import PoolWorkerError, RequestError, shown

__all__ = [
    "MAX_SMALL_HEADER_BYTES",
    "collect_budget",
    "download_budget",
    "listing_budget",
    "parse_chunk",
    "parse_collected",
    "parse_listing",
    "parse_uploaded",
    "upload_budget",
]

# The header of an upload's or a download's answer: a refusal (MAX_REFUSAL_CHARS, each at most
# a 6-byte escape) or a few numbers.
MAX_SMALL_HEADER_BYTES = 6 * MAX_REFUSAL_CHARS + 1024
# A size or a count a sandbox claims past this is not even plausible (tmpfs files are bounded by
# memory): refused before it is used in any sum.
MAX_CLAIMED_NUMBER = 2**62


def collect_budget(collect_bytes: int) -> int:
    """The most a collect's answer may be: its header and the job's ``collect_bytes``."""
    return HEADER_LENGTH_BYTES + MAX_HEADER_BYTES + collect_bytes


def listing_budget() -> int:
    return HEADER_LENGTH_BYTES + MAX_HEADER_BYTES


def upload_budget() -> int:
    return HEADER_LENGTH_BYTES + MAX_SMALL_HEADER_BYTES


def download_budget(length: int) -> int:
    return HEADER_LENGTH_BYTES + MAX_SMALL_HEADER_BYTES + length


def parse_collected(raw: bytes, patterns: tuple[str, ...], max_files: int, max_bytes: int) -> tuple[Collected, bool]:
    """A collect's answer as :class:`Collected`, and whether the sandbox's walk stopped at its
    bound (some matches were not looked at)."""
    answer = _FilesAnswer(raw, "collect", budget=collect_budget(max_bytes))
    answer.keys("files", "left_out", "left_out_more", "walk_cut")
    matched = _Matched(patterns)
    files: dict[str, bytes] = {}
    offset = 0
    for entry in answer.items("files", max_files):
        answer.only(entry, "path", "size")
        path = matched.path(answer.field(entry, "path"))
        size = answer.number(entry["size"], "a file's size", max_bytes - offset)
        files[path] = bytes(answer.data[offset : offset + size])
        offset += size
    if offset != len(answer.data):
        raise answer.invalid(f"declares {offset} bytes of files but carries {len(answer.data)}")
    left_out = []
    for entry in answer.items("left_out", MAX_LEFT_OUT):
        answer.only(entry, "path", "reason", "size")
        path = matched.path(answer.field(entry, "path"))
        reason = answer.field(entry, "reason")
        if reason not in LEFT_OUT_REASONS:
            raise answer.invalid(f"gives an unknown reason to leave a file out: {_shown(reason)}")
        size = entry["size"]
        if size is not None:
            size = answer.number(size, "a left-out file's size")
        left_out.append(LeftOut(path, reason, size))
    more = answer.number(answer.header["left_out_more"], "left_out_more")
    cut = answer.header["walk_cut"]
    if not isinstance(cut, bool):
        raise answer.invalid("gives walk_cut as something other than true or false")
    return Collected(files=files, left_out=tuple(left_out), left_out_more=more), cut


def parse_uploaded(raw: bytes, path: str, offset: int, sent: int) -> int:
    """An upload chunk's answer: the bytes the file holds now, which must be ``offset + sent``."""
    answer = _FilesAnswer(raw, "upload", budget=upload_budget())
    answer.refusal(f"upload of {path}")
    answer.keys("received")
    answer.no_data()
    received = answer.number(answer.header["received"], "received")
    if received != offset + sent:
        raise answer.invalid(f"says the file holds {received} bytes after {sent} were written at {offset}")
    return received


def parse_chunk(raw: bytes, path: str, offset: int, length: int, transfer_bytes: int) -> FileChunk:
    """A download chunk's answer: at most ``length`` bytes from ``offset``, exactly as many as the
    file holds from there up to ``length``; a file past ``transfer_bytes`` is refused."""
    answer = _FilesAnswer(raw, "download", budget=download_budget(length))
    answer.refusal(f"download of {path}")
    answer.keys("offset", "size", "modified_ns")
    size = answer.number(answer.header["size"], "the file's size")
    if size > transfer_bytes:
        raise RequestError(
            f"{path} holds {size} bytes; at most {transfer_bytes} may be downloaded (transfer_bytes)", field="download"
        )
    if answer.header["offset"] != offset or isinstance(answer.header["offset"], bool):
        raise answer.invalid(f"answers for offset {_shown(answer.header['offset'])}, not {offset}")
    if offset > size:
        raise answer.invalid(f"sends offset {offset} of a file it says holds {size} bytes")
    if len(answer.data) != min(length, size - offset):
        raise answer.invalid(f"sends {len(answer.data)} bytes from {offset} of a {size}-byte file, {length} asked")
    modified_ns = answer.number(answer.header["modified_ns"], "modified_ns")
    return FileChunk(path=path, offset=offset, size=size, modified_ns=modified_ns, data=bytes(answer.data))


def parse_listing(raw: bytes, path: str, max_entries: int) -> FileListing:
    """A listing's answer: at most ``max_entries`` entries, each a single name, sorted, none twice."""
    answer = _FilesAnswer(raw, "listing", budget=listing_budget())
    answer.refusal(f"listing of {path}", field="list")
    answer.keys("entries", "truncated")
    answer.no_data()
    entries = []
    for entry in answer.items("entries", max_entries):
        answer.only(entry, "name", "size", "kind")
        name = answer.field(entry, "name")
        if _checked(name) != name or "/" in name:
            raise answer.invalid(f"lists {_shown(name)}, which is not a single name in the workspace")
        if entries and name <= entries[-1].name:
            raise answer.invalid(f"lists {_shown(name)} out of order or twice")
        kind = answer.field(entry, "kind")
        if kind not in FILE_KINDS:
            raise answer.invalid(f"gives {_shown(name)} an unknown kind {_shown(kind)}")
        entries.append(FileEntry(name, answer.number(entry["size"], "a size"), kind))
    truncated = answer.header["truncated"]
    if not isinstance(truncated, bool):
        raise answer.invalid("gives truncated as something other than true or false")
    return FileListing(path=path, entries=tuple(entries), truncated=truncated)


class _FilesAnswer:
    """One answer split into its header (parsed strictly, after its length was checked) and data."""

    def __init__(self, raw: bytes, what: str, *, budget: int) -> None:
        self.what = what
        if len(raw) > budget:  # the exchange bounds it already; a caller that forgot must not parse it
            raise self.invalid(f"is {len(raw)} bytes, past its budget of {budget}")
        if len(raw) < HEADER_LENGTH_BYTES:
            raise self.invalid("is shorter than its header's length")
        length = int.from_bytes(raw[:HEADER_LENGTH_BYTES], "big")
        if length > MAX_HEADER_BYTES:
            raise self.invalid(f"declares a header of {length} bytes; at most {MAX_HEADER_BYTES} are read")
        end = HEADER_LENGTH_BYTES + length
        if end > len(raw):
            raise self.invalid(f"declares a header of {length} bytes but carries {len(raw) - HEADER_LENGTH_BYTES}")
        try:
            header = load_json(bytes(raw[HEADER_LENGTH_BYTES:end]), "its header")
        except JobResultInvalid as exc:
            raise self.invalid(str(exc)) from None
        if not isinstance(header, dict):
            raise self.invalid("has a header that is not a JSON object")
        self.header: dict[str, Any] = header
        self.data = memoryview(raw)[end:]

    def invalid(self, why: str) -> PoolWorkerError:
        return PoolWorkerError(f"the sandbox answered the {self.what} out of bounds: it {why}")

    def refusal(self, what: str, field: str | None = None) -> None:
        """Raise the sandbox's refusal of the request as a RequestError naming ``field``."""
        if "refused" not in self.header:
            return
        self.keys("refused")
        self.no_data()
        why = self.header["refused"]
        if not isinstance(why, str) or len(why) > MAX_REFUSAL_CHARS:
            raise self.invalid(f"refuses without saying why in at most {MAX_REFUSAL_CHARS} characters")
        raise RequestError(f"the {what} was refused: {clean_text(why)}", field=field or self.what)

    def keys(self, *names: str) -> None:
        self.only(self.header, *names)

    def only(self, entry: dict[str, Any], *names: str) -> None:
        if set(entry) != set(names):
            raise self.invalid(f"has fields {_shown(sorted(entry))}, not {list(names)}")

    def no_data(self) -> None:
        if self.data:
            raise self.invalid(f"carries {len(self.data)} bytes it does not declare")

    def items(self, name: str, most: int) -> list[dict[str, Any]]:
        value = self.header[name]
        if not isinstance(value, list):
            raise self.invalid(f"gives {name} as something other than a list")
        if len(value) > most:
            raise self.invalid(f"lists {len(value)} {name}; at most {most} may be")
        if not all(isinstance(entry, dict) for entry in value):
            raise self.invalid(f"lists {name} that are not JSON objects")
        return value

    def field(self, entry: dict[str, Any], name: str) -> str:
        value = entry.get(name)
        if not isinstance(value, str):
            raise self.invalid(f"gives a {name} that is not a string: {_shown(value)}")
        return value

    def number(self, value: Any, name: str, most: int = MAX_CLAIMED_NUMBER) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
            raise self.invalid(f"gives {name} {_shown(value)}, not a whole number in 0..{most}")
        return value


class _Matched:
    """The paths of one collect's answer: each a workspace path a pattern matches, none twice."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        self._patterns = patterns
        self._seen: set[str] = set()

    def path(self, value: str) -> str:
        path = _checked(value)
        if path != value:
            raise PoolWorkerError(f"the sandbox answered the collect out of bounds: {_shown(value)} is not a normalised workspace path")
        if not any(pattern_matches(path, pattern) for pattern in self._patterns):
            raise PoolWorkerError(f"the sandbox answered the collect out of bounds: no pattern asked for {_shown(path)}")
        if path in self._seen:
            raise PoolWorkerError(f"the sandbox answered the collect out of bounds: it names {_shown(path)} twice")
        self._seen.add(path)
        return path


def _checked(value: str) -> str | None:
    """``value`` as a checked workspace path; None if it is not one."""
    try:
        return workspace_path(value)
    except ValueError:  # readie_protocol's Invalid
        return None


def _shown(value: Any) -> str:
    return shown(value if isinstance(value, str) else str(value))
