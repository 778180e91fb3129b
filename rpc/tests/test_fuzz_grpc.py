"""Fuzzing the gRPC servers with protobuf messages: a real worker and a real router under runsc.

Every message type a client can send (``RunJobRequest``, ``ExecuteRequest``,
``InteractRequest`` streams, ``PoolInput`` streams) is drawn field by field
from its descriptor: any value of each field's type, unknown enum numbers,
absent and present optionals, nested messages, maps and repeated fields, with
the fields that pick a code path (checkpoint, code) biased towards ones that
get past the first check. The one allowed failure is a gRPC status that names
the caller's mistake or a refusal; ``UNKNOWN`` or ``INTERNAL`` means a server
raised where it should have refused, and fails the test. After the run both
servers still serve a plain job.

The number of examples is ``fuzz_examples(...)`` (conftest): bounded in
``make test``, larger with ``READIE_FUZZ_SCALE`` (docs/security.md).
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf import message_factory
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from readie_rpc.stubs import pool_pb2, pool_pb2_grpc
from readie_rpc.stubs import worker_pb2 as pb
from readie_rpc.testing import Cluster, start_cluster

from conftest import CHECKPOINTS, fuzz_examples

pytestmark = pytest.mark.runsc

# Statuses that answer a bad or refused request. UNAVAILABLE: a worker the
# router placed on went away (never here, but it is an answer, not a crash).
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAVAILABLE,
}
CALL_TIMEOUT_S = 60  # a job the fuzzer made runs its code under the job's own timeout; none sleeps
MAX_DEPTH = 3  # nested messages; InteractRequest -> RunJobRequest -> map entries is the deepest real one
# Field values that get past the first check, mixed with anything of the field's type.
BIASED = {
    "checkpoint": st.sampled_from(["base", "base", "base", "", "nope", "../base"]),
    "code": st.sampled_from(["print(1)", "", "x = 1", "raise ValueError('no')", "import sys; sys.exit(3)", "1/0", "x"])
    | st.text(max_size=40),
    "timeout_ms": st.sampled_from([1, 100, 5_000, 0, -1, 2**62]) | st.integers(-(2**63), 2**63 - 1),
}

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# protobuf refuses str fields that are not valid UTF-8: no lone surrogates.
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30) | st.sampled_from(["/", "/tmp", "/etc/passwd", "\x00", "a" * 5000])


def scalar(field: FieldDescriptor) -> st.SearchStrategy:
    if field.name in BIASED:
        return BIASED[field.name]
    kind = field.type
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        return st.sampled_from([low, high, 0, 1, -1 if low else 2]) | st.integers(low, high)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return _TEXT
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64) | st.sampled_from([b"\x80\x05N.", b"{}", b"\n" * 10])
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.sampled_from([math.nan, math.inf, -math.inf, -0.0]) | st.floats(width=32)
    if kind == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: unknown numbers arrive too
        return st.sampled_from([v.number for v in field.enum_type.values]) | st.integers(-(2**31), 2**31 - 1)
    raise AssertionError(f"no strategy for {field.full_name}")


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of ``descriptor``'s type: each field absent or drawn from its type."""
    cls = message_factory.GetMessageClass(descriptor)
    fields: dict[str, st.SearchStrategy] = {}
    for field in descriptor.fields:
        repeated = field.is_repeated
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            fields[field.name] = st.lists(scalar(field), max_size=4) if repeated else scalar(field)
        elif field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name
            fields[field.name] = st.dictionaries(scalar(entry["key"]), scalar(entry["value"]), max_size=4)
        elif depth < MAX_DEPTH:
            inner = messages(field.message_type, depth + 1)
            fields[field.name] = st.lists(inner, max_size=3) if repeated else inner
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: _build(cls, values))


def _build(cls: type[Message], values: dict) -> Message:
    message = cls()
    for name, value in values.items():  # a oneof's later member replaces an earlier one, as on the wire
        target = getattr(message, name)
        if isinstance(value, Message):
            target.CopyFrom(value)
        elif isinstance(value, dict):
            target.update(value)
        elif isinstance(value, list) and value and isinstance(value[0], Message):
            for item in value:
                target.add().CopyFrom(item)
        elif isinstance(value, list):
            target.extend(value)
        else:
            setattr(message, name, value)
    return message


run_jobs = messages(pb.RunJobRequest.DESCRIPTOR)
executes = messages(pb.ExecuteRequest.DESCRIPTOR)
interacts = st.lists(messages(pb.InteractRequest.DESCRIPTOR), min_size=1, max_size=4)
pool_lines = st.lists(
    st.binary(max_size=200)
    | st.sampled_from([b'{"id": 1, "code": "print(1)"}\n', b'{"id": "s", "stats": true}\n', b"\n", b'{"id": 2, "cancel": 1}\n']),
    max_size=4,
)


@pytest.fixture(scope="module")
def cluster(checkpoints) -> Iterator[Cluster]:
    base = Path(tempfile.mkdtemp(prefix="fzg-", dir="/tmp"))
    started = start_cluster(base, CHECKPOINTS / "manifest.json", workers=1, warm="base=2", slots=4)
    try:
        yield started
        # Both still serve a plain job after everything the fuzzer sent.
        assert started.stub.RunJob(pb.RunJobRequest(checkpoint="base", code="print(1)"), timeout=60).stdout == "1\n"
        assert started.workers[0].stub.RunJob(pb.RunJobRequest(checkpoint="base", code="print(2)"), timeout=60).stdout == "2\n"
    finally:
        started.stop()  # raises if a worker or the router fails to drain or leaves a container
        shutil.rmtree(base, ignore_errors=True)


def answered(call) -> None:
    try:
        outcome = call()
        if isinstance(outcome, Iterator):
            for _ in outcome:
                pass
    except grpc.RpcError as error:
        # A job's own timeout answers DEADLINE_EXCEEDED naming the sandbox; gRPC's own
        # "Deadline Exceeded" is this client giving up on a server that never answered.
        timed_out = error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and error.details() != "Deadline Exceeded"
        assert error.code() in ALLOWED or timed_out, f"{error.code().name}: {error.details()}"


FUZZ = settings(max_examples=fuzz_examples(25), deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(request=run_jobs, direct=st.booleans())
def test_run_job_messages_get_an_answer(cluster, request, direct):
    stub = cluster.workers[0].stub if direct else cluster.stub
    answered(lambda: stub.RunJob(request, timeout=CALL_TIMEOUT_S))


@FUZZ
@given(request=executes, direct=st.booleans())
def test_execute_messages_get_an_answer(cluster, request, direct):
    stub = cluster.workers[0].stub if direct else cluster.stub
    answered(lambda: stub.Execute(request, timeout=CALL_TIMEOUT_S))


@FUZZ
@given(requests=interacts, direct=st.booleans())
def test_interact_streams_get_an_answer(cluster, requests, direct):
    stub = cluster.workers[0].stub if direct else cluster.stub
    answered(lambda: stub.Interact(iter(requests), timeout=CALL_TIMEOUT_S))


@FUZZ
@given(chunks=pool_lines)
def test_pool_session_streams_get_an_answer(cluster, chunks):
    stub = pool_pb2_grpc.PoolStub(cluster.channel)
    answered(lambda: stub.Session(iter([pool_pb2.PoolInput(data=chunk) for chunk in chunks]), timeout=CALL_TIMEOUT_S))
