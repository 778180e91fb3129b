"""Framing v2 (readie_executor.framing): the shared golden fixture, golden errors, properties."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from readie_executor.framing import (
    BYTES_PER_CHUNK,
    END_OF_STREAM,
    MAX_CHUNK_SIZE,
    MAX_MESSAGE_SIZE,
    MIN_CHUNKS,
    NEED_DATA,
    PROTOCOL_VERSION,
    FramingError,
    Message,
    MessageReader,
    TooManyChunks,
    encode_message,
    iter_frames,
)

from conftest import fuzz_examples

FIXTURE = Path(__file__).parents[2] / "fixtures" / "frames.golden.json"
GOLDEN = json.loads(FIXTURE.read_text(encoding="utf-8"))
CASES = GOLDEN["cases"]
CASE_IDS = [case["name"] for case in CASES]


def drain(reader: MessageReader) -> list[bytes]:
    """Payloads of every message the reader can produce now; stops at NEED_DATA or END_OF_STREAM."""
    payloads = []
    while isinstance(event := reader.next_event(), Message):
        payloads.append(event.payload)
    assert event in (NEED_DATA, END_OF_STREAM)
    return payloads


def header(length: int) -> bytes:
    return struct.pack(">Q", length)


def test_fixture_is_for_this_protocol() -> None:
    assert GOLDEN["protocol_version"] == PROTOCOL_VERSION
    assert GOLDEN["max_chunk_size"] == MAX_CHUNK_SIZE
    assert GOLDEN["max_message_size"] == MAX_MESSAGE_SIZE
    assert len(CASES) >= 10


# --- the golden cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_golden_decodes_whole(case: dict) -> None:
    reader = MessageReader()
    reader.feed(bytes.fromhex(case["encoded_hex"]))

    event = reader.next_event()

    assert event == Message(bytes.fromhex(case["payload_hex"]))
    assert reader.next_event() is NEED_DATA
    reader.feed(b"")
    assert reader.next_event() is END_OF_STREAM


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_golden_decodes_one_byte_at_a_time(case: dict) -> None:
    encoded = bytes.fromhex(case["encoded_hex"])
    reader = MessageReader()
    early = []  # nothing may come out before the terminator's last byte
    for index in range(len(encoded) - 1):
        reader.feed(encoded[index : index + 1])
        if (event := reader.next_event()) is not NEED_DATA:
            early.append((index, event))
    assert early == []

    reader.feed(encoded[-1:])

    assert reader.next_event() == Message(bytes.fromhex(case["payload_hex"]))
    reader.feed(b"")
    assert reader.next_event() is END_OF_STREAM


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_golden_encodes_exactly(case: dict) -> None:
    payload = bytes.fromhex(case["payload_hex"])
    expected = bytes.fromhex(case["encoded_hex"])

    assert encode_message(payload, case["chunk_size"]) == expected
    assert b"".join(iter_frames(payload, case["chunk_size"])) == expected
    assert encode_message(bytearray(payload), case["chunk_size"]) == expected
    assert encode_message(memoryview(payload), case["chunk_size"]) == expected


def test_golden_messages_back_to_back_in_one_feed() -> None:
    stream = b"".join(bytes.fromhex(case["encoded_hex"]) for case in CASES)
    reader = MessageReader()
    reader.feed(stream)
    reader.feed(b"")

    payloads = []
    while (event := reader.next_event()) is not END_OF_STREAM:
        payloads.append(event.payload)

    assert payloads == [bytes.fromhex(case["payload_hex"]) for case in CASES]


# --- end of stream ------------------------------------------------------------------------------


def test_end_of_stream_before_any_message() -> None:
    reader = MessageReader()
    assert reader.next_event() is NEED_DATA
    reader.feed(b"")
    assert reader.next_event() is END_OF_STREAM
    assert reader.next_event() is END_OF_STREAM


def test_end_of_stream_between_messages() -> None:
    reader = MessageReader()
    reader.feed(encode_message(b"first", 2) + encode_message(b"second", 4))

    assert reader.next_event() == Message(b"first")
    assert reader.next_event() == Message(b"second")
    assert reader.next_event() is NEED_DATA
    reader.feed(b"")
    assert reader.next_event() is END_OF_STREAM


def test_message_completed_by_the_last_bytes_before_end_of_stream() -> None:
    reader = MessageReader()
    reader.feed(encode_message(b"last"))
    reader.feed(b"")

    assert reader.next_event() == Message(b"last")
    assert reader.next_event() is END_OF_STREAM


def test_empty_chunk_ends_the_message() -> None:
    # Why a sender must never write an empty chunk mid-message: the reader stops there.
    reader = MessageReader()
    reader.feed(header(2) + b"hi" + header(0) + header(3) + b"abc" + header(0))

    assert drain(reader) == [b"hi", b"abc"]


def test_feed_after_end_of_stream() -> None:
    reader = MessageReader()
    reader.feed(b"")
    reader.feed(b"")  # harmless: still the end
    with pytest.raises(RuntimeError, match="after the end of the stream"):
        reader.feed(b"x")


def test_in_message_tracks_a_partly_read_message() -> None:
    reader = MessageReader()
    assert not reader.in_message
    reader.feed(header(3) + b"ab")
    assert reader.next_event() is NEED_DATA
    assert reader.in_message
    reader.feed(b"c" + header(0))
    assert reader.next_event() == Message(b"abc")
    assert not reader.in_message


# --- limits -------------------------------------------------------------------------------------


def test_chunk_of_exactly_the_limit_is_accepted() -> None:
    reader = MessageReader()
    reader.feed(header(MAX_CHUNK_SIZE))
    assert reader.next_event() is NEED_DATA


def test_message_of_exactly_the_limit_is_accepted() -> None:
    reader = MessageReader(max_message_size=11)
    reader.feed(encode_message(b"hello world", 6))
    assert reader.next_event() == Message(b"hello world")


def test_a_message_cut_into_more_chunks_than_its_limit_allows_is_refused_at_the_header_past_them() -> None:
    """Chunks of a byte or two cost the reader a loop turn each: one per BYTES_PER_CHUNK bytes of
    the limit (MIN_CHUNKS at least) is any sender's chunking, and a flood of them is refused."""
    limit = 64 * 1024 * BYTES_PER_CHUNK  # 65,536 chunks allowed
    allowed = limit // BYTES_PER_CHUNK
    reader = MessageReader(max_message_size=limit)
    reader.feed(encode_message(b"x" * allowed, 1) + encode_message(b"y" * (allowed + 1), 1))
    assert reader.next_event() == Message(b"x" * allowed)  # exactly as many: accepted
    with pytest.raises(TooManyChunks):
        reader.next_event()
    small = MessageReader(max_message_size=10)
    small.feed(encode_message(b"0123456789", 1))  # a small limit still allows MIN_CHUNKS
    assert small.next_event() == Message(b"0123456789") and MIN_CHUNKS > 10


def test_message_limit_applies_per_message() -> None:
    reader = MessageReader(max_message_size=5)
    reader.feed(encode_message(b"12345", 2) * 3)
    assert drain(reader) == [b"12345"] * 3


@pytest.mark.parametrize("chunk_size", [0, -1, MAX_CHUNK_SIZE + 1])
def test_writer_refuses_a_chunk_size_out_of_range(chunk_size: int) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        encode_message(b"payload", chunk_size)


def test_writer_accepts_the_largest_chunk_size() -> None:
    assert encode_message(b"abc", MAX_CHUNK_SIZE) == header(3) + b"abc" + header(0)


# --- errors, against golden files ---------------------------------------------------------------


def decode_until_error(data: bytes, max_message_size: int, step: int) -> dict:
    """Feed ``data`` ``step`` bytes at a time, then end the stream; describe the error raised."""
    reader = MessageReader(max_message_size=max_message_size)
    payloads: list[bytes] = []
    before_end = True
    try:
        for start in range(0, len(data), step):
            reader.feed(data[start : start + step])
            payloads += drain(reader)
        reader.feed(b"")
        before_end = False
        payloads += drain(reader)
    except FramingError as exc:
        return {
            "error_class": type(exc).__name__,
            "message": str(exc),
            "raised_before_end_of_stream": before_end,
            "payloads_before_error_hex": [payload.hex() for payload in payloads],
        }
    pytest.fail(f"no FramingError; decoded {payloads!r}")


@pytest.mark.golden_test("golden/framing_errors/*.yml")
def test_framing_error(golden) -> None:
    data = bytes.fromhex(golden["input_hex"])
    max_message_size = golden.get("max_message_size") or MAX_MESSAGE_SIZE

    whole = decode_until_error(data, max_message_size, step=max(len(data), 1))
    dribbled = decode_until_error(data, max_message_size, step=1)

    # How the bytes were split must not change what is reported.
    assert dribbled == whole
    assert whole["error_class"] == golden.out["error_class"]
    assert whole["message"] == golden.out["message"]
    assert whole["raised_before_end_of_stream"] == golden.out["raised_before_end_of_stream"]
    assert whole["payloads_before_error_hex"] == golden.out["payloads_before_error_hex"]


# --- properties ---------------------------------------------------------------------------------


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({cut % (len(data) + 1) for cut in cuts}), len(data)]
    return [data[start:end] for start, end in zip(bounds, bounds[1:])]


@given(payload=st.binary(max_size=4096), data=st.data())
def test_any_payload_round_trips(payload: bytes, data: st.DataObject) -> None:
    chunk_size = data.draw(st.integers(1, len(payload) + 16), label="chunk_size")
    encoded = encode_message(payload, chunk_size)

    chunk_count = -(-len(payload) // chunk_size)
    assert len(encoded) == len(payload) + 8 * (chunk_count + 1)
    reader = MessageReader()
    reader.feed(encoded)
    assert reader.next_event() == Message(payload)
    assert reader.next_event() is NEED_DATA


@given(
    payloads=st.lists(st.binary(max_size=2048), min_size=1, max_size=4),
    chunk_size=st.integers(1, 300),
    cuts=st.lists(st.integers(0, 20_000), max_size=30),
)
def test_any_payloads_round_trip_through_random_splits(
    payloads: list[bytes], chunk_size: int, cuts: list[int]
) -> None:
    stream = b"".join(encode_message(payload, chunk_size) for payload in payloads)
    reader = MessageReader()
    decoded = []
    for piece in split_at(stream, cuts):
        if piece:  # an empty feed would mean the end of the stream
            reader.feed(piece)
            decoded += drain(reader)
    reader.feed(b"")
    decoded += drain(reader)

    assert decoded == payloads
    assert reader.next_event() is END_OF_STREAM


# Random bytes almost always start with a huge length; mixing in small, plausible headers
# lets the fuzzer reach chunk bodies, terminators and truncation too.
_segments = st.one_of(
    st.integers(0, 24).map(header),
    st.integers(0, 2**64 - 1).map(header),
    st.binary(max_size=24),
)
_streams = st.one_of(st.binary(max_size=512), st.lists(_segments, max_size=12).map(b"".join))


@settings(max_examples=fuzz_examples(300))
@given(
    stream=_streams,
    max_message_size=st.one_of(st.just(MAX_MESSAGE_SIZE), st.integers(0, 64)),
    cuts=st.lists(st.integers(0, 600), max_size=8),
)
def test_garbage_yields_messages_or_a_framing_error(
    stream: bytes, max_message_size: int, cuts: list[int]
) -> None:
    reader = MessageReader(max_message_size=max_message_size)
    decoded_size = 0
    try:
        for piece in split_at(stream, cuts):
            if piece:
                reader.feed(piece)
                decoded_size += sum(map(len, drain(reader)))
        reader.feed(b"")
        while (event := reader.next_event()) is not END_OF_STREAM:
            # After the end of the stream there is no more data to wait for.
            assert isinstance(event, Message), event
            decoded_size += len(event.payload)
    except FramingError:
        pass
    assert decoded_size <= len(stream)


class _ShortWriter:
    """A socket whose sendmsg writes at most ``limit`` bytes (as after a signal), recording every call."""

    def __init__(self, limit: int) -> None:
        self.limit, self.data, self.calls = limit, bytearray(), []

    def sendmsg(self, pieces):
        joined = b"".join(bytes(piece) for piece in pieces)[: self.limit]
        self.calls.append(("sendmsg", len(pieces)))
        self.data += joined
        return len(joined)

    def sendall(self, piece):
        self.calls.append(("sendall", 1))
        self.data += bytes(piece)


@pytest.mark.parametrize("limit", [1, 3, 4, 7, 10_000])
@pytest.mark.parametrize("size", [0, 5, 64, 150])
def test_send_message_writes_each_frame_once_and_finishes_a_short_write(limit, size):
    from readie_executor.sockets import send_message

    payload = bytes(range(256))[:size] * 1
    sock = _ShortWriter(limit)
    send_message(sock, payload, chunk_size=64)  # type: ignore[arg-type]
    assert bytes(sock.data) == encode_message(payload, 64)
    frames = max(1, -(-size // 64))
    assert sum(1 for call, _ in sock.calls if call == "sendmsg") == frames  # one vectored write per frame
