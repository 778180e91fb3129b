"""What a sandbox answers about its files is hostile (decision 31): every lie is a PoolWorkerError,
every refusal a RequestError naming the field, and an honest answer is rebuilt exactly.

The answers are built here by hand (length, JSON header, data), not by the executor's encoder.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest

from readie_executor.filewire import MAX_HEADER_BYTES
from readie_protocol.workspace import MAX_LEFT_OUT, LeftOut
from readie_worker._workspace_answers import parse_chunk, parse_collected, parse_listing, parse_uploaded
from readie_worker.errors import PoolWorkerError, RequestError

PATTERNS = ("out/*.png", "report.xlsx")


def answer(header: Any, data: bytes = b"", *, length: int | None = None) -> bytes:
    encoded = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack(">I", len(encoded) if length is None else length) + encoded + data


def files(*entries: tuple[str, int], left_out: list[dict[str, Any]] | None = None, more: int = 0, cut: bool = False) -> dict[str, Any]:
    return {
        "files": [{"path": path, "size": size} for path, size in entries],
        "left_out": left_out or [],
        "left_out_more": more,
        "walk_cut": cut,
    }


def test_an_honest_collect_is_rebuilt_byte_exact():
    raw = answer(
        files(("out/a.png", 3), ("report.xlsx", 2), left_out=[{"path": "out/big.png", "reason": "size", "size": 10**9}], more=7),
        b"\x89PNxl",
    )
    collected, cut = parse_collected(raw, PATTERNS, max_files=64, max_bytes=100)
    assert collected.files == {"out/a.png": b"\x89PN", "report.xlsx": b"xl"} and not cut
    assert collected.left_out == (LeftOut("out/big.png", "size", 10**9),) and collected.left_out_more == 7


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (answer(files(("out/a.png", 3)), b"\x89P"), "declares 3 bytes of files but carries 2"),
        (answer(files(("out/a.png", 1)), b"\x89PN"), "declares 1 bytes of files but carries 3"),
        (answer(files(("etc/passwd", 3)), b"abc"), "no pattern asked for"),
        (answer(files(("out/sub/a.png", 3)), b"abc"), "no pattern asked for"),
        (answer(files(("out/../../x.png", 3)), b"abc"), "not a normalised workspace path"),
        (answer(files(("out//a.png", 3)), b"abc"), "not a normalised workspace path"),
        (answer(files(("/out/a.png", 3)), b"abc"), "not a normalised workspace path"),
        (answer(files(("out/a.png", 1), ("out/a.png", 1)), b"ab"), "twice"),
        (answer(files(("out/a.png", 1), left_out=[{"path": "out/a.png", "reason": "size", "size": 1}]), b"a"), "twice"),
        (answer(files(*[(f"out/{i}.png", 0) for i in range(3)])), "lists 3 files; at most 2"),
        (answer(files(("out/a.png", 60), ("out/b.png", 60)), b"x" * 120), "not a whole number in 0..40"),
        (answer(files(left_out=[{"path": "report.xlsx", "reason": "tired", "size": None}])), "unknown reason"),
        (answer(files(left_out=[{"path": "report.xlsx", "reason": "size", "size": -1}])), "not a whole number"),
        (answer(files(left_out=[{"path": "out/x.png", "reason": "size", "size": 1}] * (MAX_LEFT_OUT + 1))), "at most 64"),
        (answer(files(("out/a.png", True)), b"a"), "not a whole number"),
        (answer(files(more=-1)), "left_out_more"),
        (answer({**files(), "extra": 1}), "has fields"),
        (answer({"refused": "no"}), "has fields"),
        (answer(b'{"files": [], "files": []}'), "repeats the key"),
        (answer(b"[]"), "not a JSON object"),
        (answer(b"{nope"), "its header is not valid JSON"),
        (answer(files(), length=MAX_HEADER_BYTES + 1), f"declares a header of {MAX_HEADER_BYTES + 1} bytes"),
        (answer(files(), length=10_000), "but carries"),
        (b"\x00\x00", "shorter than its header's length"),
        (b"", "shorter than its header's length"),
    ],
)
def test_a_lying_collect_is_a_worker_error(raw, why):
    with pytest.raises(PoolWorkerError, match=why):
        parse_collected(raw, PATTERNS, max_files=2, max_bytes=100)


def test_an_answer_past_its_budget_is_not_parsed():
    with pytest.raises(PoolWorkerError, match="past its budget"):
        parse_collected(answer(files(), b"x" * (MAX_HEADER_BYTES + 200)), PATTERNS, max_files=2, max_bytes=100)


def test_an_honest_chunk_and_the_lies_a_chunk_can_tell():
    header = {"offset": 4, "size": 10, "modified_ns": 123}
    chunk = parse_chunk(answer(header, b"4567"), "big.bin", 4, 4, transfer_bytes=100)
    assert (chunk.offset, chunk.size, chunk.modified_ns, chunk.data, chunk.last) == (4, 10, 123, b"4567", False)
    assert parse_chunk(answer(header, b"456789"), "big.bin", 4, 100, transfer_bytes=100).last
    lies = [
        (answer(header, b"45678"), 4, "sends 5 bytes"),  # longer than asked
        (answer(header, b"45"), 4, "sends 2 bytes"),  # shorter than the file holds
        (answer({**header, "offset": 0}, b"0123"), 4, "not 4"),
        (answer({**header, "size": 3}, b""), 4, "offset 4 of a file it says holds 3"),
        (answer({**header, "modified_ns": "now"}, b"4567"), 4, "modified_ns"),
        (answer({"refused": 7}), 4, "without saying why"),
        (answer({"refused": "x" * 5000}), 4, "without saying why"),
        (answer({"refused": "no", "size": 1}), 4, "has fields"),
    ]
    for raw, length, why in lies:
        with pytest.raises(PoolWorkerError, match=why):
            parse_chunk(raw, "big.bin", 4, length, transfer_bytes=100)


def test_a_refusal_or_a_file_past_transfer_bytes_is_the_requests_error():
    with pytest.raises(RequestError, match="download of x.bin was refused: x.bin is a symbolic link") as refused:
        parse_chunk(answer({"refused": "x.bin is a symbolic link"}), "x.bin", 0, 10, transfer_bytes=100)
    assert refused.value.field == "download"
    with pytest.raises(RequestError, match="at most 100 may be downloaded") as refused:
        parse_chunk(answer({"offset": 0, "size": 101, "modified_ns": 1}, b"x" * 10), "x.bin", 0, 10, transfer_bytes=100)
    assert refused.value.field == "download"
    with pytest.raises(RequestError) as refused:
        parse_uploaded(answer({"refused": "grant is a symbolic link"}), "grant/x", 0, 3)
    assert refused.value.field == "upload"
    with pytest.raises(RequestError) as refused:
        parse_listing(answer({"refused": "no such directory"}), "gone", 10)
    assert refused.value.field == "list"
    # A lone surrogate (JSON's \ud800) in the sandbox's reason: a message any writer can encode.
    with pytest.raises(RequestError) as refused:
        parse_listing(answer({"refused": "bad \ud800 name"}), "gone", 10)
    str(refused.value).encode("utf-8")


def test_an_upload_answer_must_count_exactly_what_was_sent():
    assert parse_uploaded(answer({"received": 7}), "f", 4, 3) == 7
    for raw in (answer({"received": 8}), answer({"received": 7}, b"x"), answer({"received": 7, "more": 1})):
        with pytest.raises(PoolWorkerError):
            parse_uploaded(raw, "f", 4, 3)


def test_a_listing_holds_single_sorted_names_within_its_bound():
    entries = [{"name": "a", "size": 1, "kind": "file"}, {"name": "b", "size": 0, "kind": "dir"}]
    listing = parse_listing(answer({"entries": entries, "truncated": False}), ".", 10)
    assert [(e.name, e.kind) for e in listing.entries] == [("a", "file"), ("b", "dir")]
    lies = [
        ({"entries": entries[::-1], "truncated": False}, "out of order or twice"),
        ({"entries": entries[:1] * 2, "truncated": False}, "out of order or twice"),
        ({"entries": [{"name": "a/b", "size": 1, "kind": "file"}], "truncated": False}, "not a single name"),
        ({"entries": [{"name": "..", "size": 1, "kind": "file"}], "truncated": False}, "not a single name"),
        ({"entries": [{"name": "a", "size": 1, "kind": "socket"}], "truncated": False}, "unknown kind"),
        ({"entries": entries * 6, "truncated": False}, "at most 10"),
        ({"entries": entries, "truncated": 0}, "truncated"),
    ]
    for header, why in lies:
        with pytest.raises(PoolWorkerError, match=why):
            parse_listing(answer(header), ".", 10)
