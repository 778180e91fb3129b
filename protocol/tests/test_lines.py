"""The stdin line splitter: exact byte vectors, oversize lines, and a fuzz property."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from readie_protocol.lines import (
    ID_SCAN_BYTES,
    MAX_LINE_BYTES,
    Line,
    LineEvent,
    LineSplitter,
    OversizeLine,
    recover_id,
)

from conftest import fuzz_examples


def split(data: bytes, limit: int = MAX_LINE_BYTES, chunk: int | None = None) -> list[LineEvent]:
    splitter = LineSplitter(limit)
    events: list[LineEvent] = []
    step = chunk or max(1, len(data))
    for start in range(0, len(data), step):
        events += splitter.feed(data[start : start + step])
    events += splitter.feed(b"")
    return events


# (input bytes, expected events) -- written out by hand, not computed.
SIMPLE_CASES: list[tuple[bytes, list[LineEvent]]] = [
    (b"", []),
    (b"\n", []),
    (b"\n\n\r\n \t \n", []),
    (b'{"id": 1}\n', [Line(b'{"id": 1}')]),
    (b'{"id": 1}', [Line(b'{"id": 1}')]),  # unterminated last line still counts
    (b'{"id": 1}\r\n', [Line(b'{"id": 1}\r')]),  # \r is JSON whitespace; json.loads copes
    (b"a\nb\n\nc", [Line(b"a"), Line(b"b"), Line(b"c")]),
    (b"  x  \n", [Line(b"  x  ")]),
    (b"\x00\xff\n", [Line(b"\x00\xff")]),  # bytes pass through; the parser judges them
    (b"\x0b\n", [Line(b"\x0b")]),  # not JSON whitespace, so not blank
]


@pytest.mark.parametrize(("data", "expected"), SIMPLE_CASES)
def test_simple_cases(data: bytes, expected: list[LineEvent]) -> None:
    assert split(data) == expected
    assert split(data, chunk=1) == expected


def test_spec_request_lines() -> None:
    task1 = b'{"id": "task-1", "code": "import json\\nprint(json.dumps({\'ok\': True}))", "name": "step.py", "allow_write": ["out"]}'
    stats = b'{"id": "s1", "stats": true}'
    assert split(task1 + b"\n" + stats + b"\n") == [Line(task1), Line(stats)]


def test_limit_is_inclusive_and_excludes_the_newline() -> None:
    at_limit = b"x" * 10
    over = b"y" * 11
    assert split(at_limit + b"\n", limit=10) == [Line(at_limit)]
    assert split(over + b"\n", limit=10) == [OversizeLine(size=11, id=None)]


def test_oversize_line_is_drained_and_the_next_line_read_normally() -> None:
    long = b'{"id": "big", "code": "' + b"#" * 100 + b'"}'
    data = long + b'\n{"id": "next"}\n'
    for chunk in (None, 1, 7, 64):
        assert split(data, limit=32, chunk=chunk) == [
            OversizeLine(size=len(long), id="big"),
            Line(b'{"id": "next"}'),
        ], chunk


def test_tail_of_an_oversize_line_is_never_reparsed() -> None:
    # The tail looks like a complete request; it must not come out as one.
    long = b"#" * 40 + b'{"id": "forged", "code": "boom"}'
    assert split(long + b"\n", limit=32, chunk=8) == [OversizeLine(size=len(long), id=None)]


def test_oversize_unterminated_last_line() -> None:
    assert split(b"z" * 50, limit=10) == [OversizeLine(size=50, id=None)]


def test_real_limit_one_mebibyte() -> None:
    assert MAX_LINE_BYTES == 1024 * 1024
    body = b'{"id": 7, "code": "' + b"a" * MAX_LINE_BYTES + b'"}'
    events = split(body + b"\n" + b'{"id": 8}\n', chunk=65536)
    assert events == [OversizeLine(size=len(body), id=7), Line(b'{"id": 8}')]
    exact = b"b" * MAX_LINE_BYTES
    assert split(exact + b"\n", chunk=65536) == [Line(exact)]


def test_memory_stays_bounded_while_draining() -> None:
    splitter = LineSplitter(16)
    for _ in range(1000):
        assert splitter.feed(b"q" * 1000) == []
        assert len(splitter._buffer) <= 16
        assert len(splitter._head) <= ID_SCAN_BYTES
    assert splitter.feed(b"\n") == [OversizeLine(size=1_000_000, id=None)]


def test_feed_after_eof_is_a_usage_error() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b"") == []
    assert splitter.ended
    with pytest.raises(RuntimeError):
        splitter.feed(b"x")


def test_accepts_bytearray_and_memoryview() -> None:
    splitter = LineSplitter()
    assert splitter.feed(bytearray(b"a\n")) == [Line(b"a")]
    assert splitter.feed(memoryview(b"b\n")) == [Line(b"b")]  # type: ignore[arg-type]


def test_rejects_nonsense_limit() -> None:
    with pytest.raises(ValueError):
        LineSplitter(0)


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b'{"id": "task-1", "code": "x', "task-1"),
        (b'{"id":1,', 1),
        (b'  {  "id" : -42 }', -42),
        (b'{"id": 0, "x"', 0),
        (b'{"id": "a\\"b\\u00e9", ', 'a"b\u00e9'),
        (b'{"id": "caf\xc3\xa9", ', "caf\u00e9"),
        (b'{"code": "x", "id": "late"}', None),  # only a first-key id is trusted
        (b'{"env": {"id": "inner"}, "id": 1}', None),
        (b'{"id": 1.5, ', None),
        (b'{"id": 01, ', None),
        (b'{"id": true, ', None),
        (b'{"id": null, ', None),
        (b'{"id": "", ', None),  # an empty id is refused anyway
        (b'{"id": "\\ud800", ', None),  # a lone surrogate cannot be echoed
        (b'{"id": "\xff", ', None),  # not UTF-8
        (b'{"id": 99999999999999999999, ', None),
        (b'{"id": "' + b"x" * 300 + b'", ', None),  # longer than an id may be
        (b'{"id": "abc', None),  # cut before the closing quote
        (b'{"id": 12', None),  # cut inside the number: 12 could be 123
        (b'["id", 1]', None),
        (b"", None),
    ],
)
def test_recover_id(head: bytes, expected: object) -> None:
    assert recover_id(head) == expected


# --------------------------------------------------------------------------- fuzz


def reference(data: bytes, limit: int) -> list[LineEvent]:
    """The spec read literally: split on newlines, skip blank, drop long lines whole."""
    events: list[LineEvent] = []
    pieces = data.split(b"\n")
    for piece in pieces:
        if len(piece) > limit:
            events.append(OversizeLine(size=len(piece), id=recover_id(piece[:ID_SCAN_BYTES])))
        elif piece.strip(b" \t\r"):
            events.append(Line(piece))
    return events


line_bytes = st.lists(
    st.one_of(
        st.binary(max_size=40),
        st.sampled_from([b'{"id": 1, "code": "x"}', b'{"id": "k"', b"\n", b"\r\n", b" "]),
    ),
    max_size=12,
).map(b"".join)


@settings(max_examples=fuzz_examples(400))
@given(line_bytes, st.integers(min_value=1, max_value=48), st.lists(st.integers(1, 50), max_size=20))
def test_any_bytes_any_chunking_matches_the_reference(
    data: bytes, limit: int, cuts: list[int]
) -> None:
    splitter = LineSplitter(limit)
    events: list[LineEvent] = []
    position = 0
    for cut in cuts:
        piece = data[position : position + cut]
        if piece:
            events += splitter.feed(piece)
        position += cut
    if data[position:]:
        events += splitter.feed(data[position:])
    events += splitter.feed(b"")
    assert events == reference(data, limit)
    for event in events:
        if isinstance(event, Line):
            assert b"\n" not in event.data and len(event.data) <= limit


@given(st.binary(max_size=200))
def test_recover_id_never_raises(head: bytes) -> None:
    value = recover_id(head)
    assert value is None or isinstance(value, str | int)


def test_oversize_so_far_tells_a_reader_before_the_line_ends():
    splitter = LineSplitter(max_line_bytes=8)
    assert splitter.feed(b"12345") == [] and splitter.oversize_so_far is None
    assert splitter.feed(b"6789") == [] and splitter.oversize_so_far == 9
    assert splitter.feed(b"0\nok\n") == [OversizeLine(size=10, id=None), Line(b"ok")]
    assert splitter.oversize_so_far is None
