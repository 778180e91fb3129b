"""Output frames from a sandbox (decision 16): the checks, the allowances and the relay's bounds,
without I/O."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from readie_executor.hostwire import MAX_OUTPUT_FRAME_BYTES, encode_output
from readie_executor.jobs import bounds
from readie_worker import _output_frames
from readie_worker._output_frames import (
    FORWARD_BYTES,
    MIN_FORWARD_INTERVAL_S,
    SMALL_FRAME_BURST,
    SMALL_FRAMES_PER_S,
    OutputChunk,
    OutputRefused,
    OutputRelay,
    max_output_events,
    parse_output_frame,
)

from conftest import fuzz_examples


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def relay(max_output: int = 1000) -> tuple[OutputRelay, list[OutputChunk], Clock]:
    chunks: list[OutputChunk] = []
    clock = Clock()
    return OutputRelay(chunks.append, max_output, clock=clock), chunks, clock


def test_an_honest_frame_is_rebuilt():
    assert parse_output_frame(encode_output("stderr", "oops\n")) == OutputChunk("stderr", "oops\n")


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (b'{"output":{"stream":"stdout","data":"x"}', "not valid JSON"),
        (b'{"output":{"stream":"stdout","data":"x","extra":1}}', "an output frame is"),
        (b'{"output":{"stream":"stdout","data":"x"},"call":{}}', "an output frame is"),
        (b'{"output":{"stream":"stdout","data":"x","data":"y"}}', "a key is repeated"),
        (b'{"output":{"stream":"stdout","data":NaN}}', "not valid JSON"),
        (b'{"output":{"stream":"stdout","data":"\xff"}}', "not valid JSON"),
        (b'{"output":{"stream":"stdout","data":7}}', "an output frame is"),
        (b'{"output":{"stream":"stdin","data":"x"}}', "as the sandbox writes one"),
        (b'{"output": {"stream":"stdout","data":"x"}}', "as the sandbox writes one"),
        (b'{"output":[]}', "as the sandbox writes one"),
        (b'{"output":{"stream":"stdout","data":"' + b"x" * MAX_OUTPUT_FRAME_BYTES + b'"}}', "at most"),
    ],
)
def test_anything_else_is_refused(frame, why):
    with pytest.raises(OutputRefused, match=why):
        parse_output_frame(frame)
    with pytest.raises(OutputRefused):
        relay()[0].receive(frame)


def test_a_lone_surrogate_becomes_text_a_line_can_carry():
    chunk = parse_output_frame(b'{"output":{"stream":"stdout","data":"a\\ud800b"}}')
    chunk.data.encode("utf-8")  # does not raise
    assert chunk.data == "a?b"


def test_frames_faster_than_the_interval_are_held_and_joined():
    made, chunks, clock = relay()
    made.receive(encode_output("stdout", "a"))  # the first goes out at once
    clock.now += MIN_FORWARD_INTERVAL_S / 4
    made.receive(encode_output("stdout", "b"))
    made.receive(encode_output("stdout", "c"))
    assert chunks == [OutputChunk("stdout", "a")]
    clock.now += MIN_FORWARD_INTERVAL_S
    made.receive(encode_output("stdout", "d"))
    assert chunks[1:] == [OutputChunk("stdout", "bcd")]
    made.receive(encode_output("stdout", "e"))
    made.finish()  # the job ended: what is held goes out
    assert chunks[2:] == [OutputChunk("stdout", "e")] and made.forwarded == 3


def test_enough_held_text_goes_out_regardless_of_the_interval():
    made, chunks, _ = relay(max_output=10 * FORWARD_BYTES)
    made.receive(encode_output("stdout", "x"))
    made.receive(encode_output("stdout", "y" * FORWARD_BYTES))
    assert [len(chunk.data) for chunk in chunks] == [1, FORWARD_BYTES]


def test_the_streams_are_held_apart():
    made, chunks, _ = relay()
    made.receive(encode_output("stdout", "o"))
    made.receive(encode_output("stderr", "e"))  # its own first frame: out at once
    assert chunks == [OutputChunk("stdout", "o"), OutputChunk("stderr", "e")]


def test_the_budget_is_max_output_measured_as_the_result_measures_it():
    made, chunks, clock = relay(max_output=10)
    made.receive(encode_output("stdout", 'ab"\n'))  # 6 bytes in a result: " and the newline are escaped
    clock.now += 1
    made.receive(encode_output("stdout", "cdefgh"))
    clock.now += 1
    made.receive(encode_output("stdout", "more"))  # nothing left
    made.finish()
    assert "".join(chunk.data for chunk in chunks) == 'ab"\ncdef'
    assert bounds.encoded_size('ab"\ncdef') == 10


def test_a_flood_of_small_frames_is_refused_past_its_burst_and_an_honest_pace_never_is():
    made, _, clock = relay(max_output=10**6)
    for _ in range(SMALL_FRAME_BURST):
        made.receive(encode_output("stdout", "x"))
    with pytest.raises(OutputRefused, match="faster than"):
        made.receive(encode_output("stdout", "x"))
    honest, _, clock = relay(max_output=10**6)
    for _ in range(10 * SMALL_FRAME_BURST):  # twice the honest sandbox's own most, for a long while
        clock.now += 1 / (SMALL_FRAMES_PER_S * 2 / 3)
        honest.receive(encode_output("stdout", "x"))


def test_large_frames_may_carry_what_the_budget_needs_escaped_and_no_more():
    max_output = 4 * FORWARD_BYTES
    made, _, _ = relay(max_output=max_output)
    frame = encode_output("stdout", "\x00" * FORWARD_BYTES)  # six bytes a character on the wire
    frames = (6 * max_output + MAX_OUTPUT_FRAME_BYTES) // len(frame)
    for _ in range(frames):
        made.receive(frame)
    with pytest.raises(OutputRefused, match="more output frames"):
        made.receive(frame)


def test_frames_past_the_budget_are_dropped_unparsed(monkeypatch):
    made, chunks, clock = relay(max_output=3)
    made.receive(encode_output("stdout", "abcdef"))
    parsed: list[bytes] = []
    monkeypatch.setattr(_output_frames, "parse_output_frame", lambda payload: parsed.append(payload))
    clock.now += 1
    made.receive(encode_output("stdout", "later"))
    assert parsed == [] and chunks == [OutputChunk("stdout", "abc")]


def test_max_output_events_bounds_what_one_stream_forwards():
    made, chunks, clock = relay(max_output=2 * FORWARD_BYTES)
    for _ in range(200):
        clock.now += MIN_FORWARD_INTERVAL_S
        made.receive(encode_output("stdout", "x" * 100))
    made.finish()
    assert len(chunks) <= max_output_events(200 * MIN_FORWARD_INTERVAL_S, 2 * FORWARD_BYTES)


@given(st.lists(st.text(max_size=40), max_size=20), st.integers(min_value=0, max_value=200))
def test_what_goes_out_is_a_prefix_within_the_budget(pieces, budget):
    made, chunks, clock = relay(max_output=budget)
    for piece in pieces:
        clock.now += 0.001
        made.receive(encode_output("stdout", piece))
    made.finish()
    forwarded = "".join(chunk.data for chunk in chunks)
    written = "".join(pieces).encode("utf-8", "replace").decode("utf-8")
    assert written.startswith(forwarded)
    assert bounds.encoded_size(forwarded) <= budget
    assert len(json.dumps(forwarded, ensure_ascii=False).encode()) - 2 == bounds.encoded_size(forwarded)


def test_a_sink_that_raises_is_dropped_and_the_job_goes_on():
    calls: list[OutputChunk] = []

    def sink(chunk: OutputChunk) -> None:
        calls.append(chunk)
        raise RuntimeError("the caller's bug")

    made = OutputRelay(sink, 100)
    made.receive(encode_output("stdout", "a"))
    made.receive(encode_output("stderr", "b"))  # no exception reaches the exchange
    assert calls == [OutputChunk("stdout", "a")]


_honest = st.tuples(st.sampled_from(["stdout", "stderr"]), st.text(max_size=40)).map(lambda p: encode_output(*p))
_frames = st.one_of(
    st.binary(max_size=300),
    _honest,
    st.tuples(_honest, st.integers(0, 80), st.binary(min_size=1, max_size=6)).map(lambda t: t[0][: t[1]] + t[2] + t[0][t[1]:]),
)


@settings(max_examples=fuzz_examples(300), deadline=None)
@given(st.lists(_frames, max_size=20), st.integers(0, 2000))
def test_any_frames_are_relayed_or_refused_and_never_past_the_budget(frames, max_output):
    """The fuzz target for output frames: any frame is a chunk or OutputRefused, nothing else."""
    forward, chunks, clock = relay(max_output)
    for frame in frames:
        clock.now += 0.001
        try:
            forward.receive(frame)
        except OutputRefused:
            pass
    forward.finish()
    for name in ("stdout", "stderr"):
        sent = "".join(chunk.data for chunk in chunks if chunk.stream == name)
        assert bounds.encoded_size(sent) <= max_output
