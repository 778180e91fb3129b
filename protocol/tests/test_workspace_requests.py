"""Files in the workspace on the pool protocol (decision 31): a job's and a step's ``files`` and
``collect``, a session's upload, download and list requests, and the events that answer them,
through the parser, a client's connection and the published schema."""

from __future__ import annotations

import base64
import json
from typing import Any

import jsonschema
import pytest
from readie_protocol.connection import NEED_DATA, PoolConnection, Role
from readie_protocol.errors import PoolError, RequestError
from readie_protocol.events import ErrorInfo, ReadyEvent, Result, RuntimeInfo
from readie_protocol.request_lines import request_json
from readie_protocol.encoding import encode_request
from readie_protocol.requests import SESSION_STEP_FIELDS, JobRequest, Refused, build_job, parse_request
from readie_protocol.schema import SCHEMA_DIALECT, event_schemas, request_schema
from readie_protocol.transfers import (
    ChunkEvent,
    DownloadChunk,
    ListFiles,
    ListingEvent,
    UploadChunk,
    UploadedEvent,
)
from readie_protocol.workspace import (
    MAX_COLLECT_PATTERNS,
    MAX_REQUEST_FILES,
    MAX_REQUEST_FILES_BYTES,
    UPLOAD_CHUNK_BYTES,
    FileChunk,
    FileEntry,
    FileListing,
    LeftOut,
)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def parsed(obj: dict[str, Any]) -> Any:
    return parse_request(json.dumps(obj))


def refusal(obj: dict[str, Any]) -> RequestError:
    result = parsed(obj)
    assert isinstance(result, Refused), result
    return result.error


def valid(schema: dict[str, Any], obj: Any) -> bool:
    return jsonschema.Draft202012Validator({"$schema": SCHEMA_DIALECT, **schema}).is_valid(obj)


# --------------------------------------------------------------------------- files and collect


def test_a_job_carries_files_and_collect_normalised() -> None:
    job = parsed({"id": 1, "code": "x", "files": {"data//./orders.csv": b64(b"a,b\n1,2\n"), "empty": ""},
                  "collect": ["out/*.png", "./report.xlsx", "**/*.csv"]})
    assert isinstance(job, JobRequest)
    assert job.files == (("data/orders.csv", b"a,b\n1,2\n"), ("empty", b""))
    assert job.collect == ("out/*.png", "report.xlsx", "**/*.csv")


def test_a_session_step_may_carry_files_and_collect() -> None:
    step = parsed({"id": 2, "session": "nb", "code": "x", "files": {"a.txt": b64(b"hi")}, "collect": ["a.txt"]})
    assert isinstance(step, JobRequest) and step.fields <= SESSION_STEP_FIELDS
    assert not step.setup_fields


@pytest.mark.parametrize(
    ("files", "words"),
    [
        ({"../etc/passwd": ""}, "'..'"),
        ({"a/../../b": ""}, "'..'"),
        ({"/etc/passwd": ""}, "absolute"),
        ({"a\u0000b": ""}, "NUL"),
        ({"a/b": "", "a//./b": ""}, "another entry names too"),
        ({".": ""}, "the workspace itself"),
        ({"": ""}, "empty"),
        ({"x" * 1025: ""}, "longer than 1024 bytes"),
        ({"a/" + "n" * 256: ""}, "longer than 255 bytes"),
        ({"a": "not base64!"}, "not valid base64"),
        ({"a": "aGk"}, "not valid base64"),  # unpadded
        ({"a": 5}, "expected base64 text"),
        ({f"f{i}": "" for i in range(MAX_REQUEST_FILES + 1)}, f"at most {MAX_REQUEST_FILES}"),
    ],
)
def test_bad_files_are_refused_naming_the_field(files: dict[str, Any], words: str) -> None:
    error = refusal({"id": 1, "code": "x", "files": files})
    assert error.field == "files" and words in str(error), error


@pytest.mark.parametrize(("fields", "field"), [
    ('"code": "1", "collect": {deep}', "collect"),
    ('"session": "s", "download": "a", "offset": {deep}', "offset"),
    ('"session": "s", "upload": "a", "size": {deep}, "offset": 0, "data": ""', "size"),
])
def test_a_value_nested_past_pythons_depth_is_refused_naming_its_field_never_raised(fields: str, field: str) -> None:
    """The strict parser takes any depth a line allows; the refusal's message must not recurse (a
    RecursionError out of the parser ended the pool's intake: no later line was answered)."""
    deep = "[" * 1000 + "]" * 1000  # 2 KB
    line = ('{"id": 7, ' + fields.format(deep=deep) + "}").encode()
    refused = parse_request(line)
    assert isinstance(refused, Refused) and refused.id == 7 and refused.error.field == field
    connection = PoolConnection(Role.POOL)
    connection.receive_data(line + b"\n" + b'{"id": 8, "code": "1"}\n')
    assert isinstance(connection.next_event(), Refused)
    assert isinstance(connection.next_event(), JobRequest)  # the next line is read as ever


def test_files_are_an_object_and_collect_an_array() -> None:
    assert refusal({"id": 1, "code": "x", "files": ["a"]}).field == "files"
    assert refusal({"id": 1, "code": "x", "collect": "out/*.png"}).field == "collect"


def test_more_bytes_of_files_than_a_request_may_carry_are_refused() -> None:
    # Past a line's 1 MiB as base64, so a client builds it and the check refuses it before it is sent.
    half = b64(b"x" * (MAX_REQUEST_FILES_BYTES // 2 + 1))
    with pytest.raises(RequestError, match="upload") as caught:
        build_job(1, {"code": "x", "files": {"a": half, "b": half}})
    assert caught.value.field == "files"


def test_a_line_too_long_for_its_files_says_to_upload_them() -> None:
    request = build_job(1, {"code": "x", "files": {"a": b64(b"x" * (MAX_REQUEST_FILES_BYTES - 10))}})
    with pytest.raises(RequestError, match="upload large files into a session") as caught:
        encode_request(request_json(request))
    assert caught.value.field == "files"


@pytest.mark.parametrize(
    ("collect", "words"),
    [
        (["../x"], "'..'"),
        (["/tmp/*"], "absolute"),
        (["out/*.png", "out//*.png"], "another entry names too"),
        ([f"p{i}" for i in range(MAX_COLLECT_PATTERNS + 1)], f"at most {MAX_COLLECT_PATTERNS}"),
        ([3], "expected a path as a string"),
        (["a\u0000"], "NUL"),
    ],
)
def test_bad_collect_entries_are_refused_naming_the_field(collect: list[Any], words: str) -> None:
    error = refusal({"id": 1, "code": "x", "collect": collect})
    assert error.field == "collect" and words in str(error), error


def test_files_and_collect_are_written_back_as_themselves() -> None:
    job = parsed({"id": 1, "code": "x", "files": {"a": b64(b"\x00\xff"), "d/b": ""}, "collect": ["d/*"]})
    line = encode_request(request_json(job))
    assert json.loads(line)["files"] == {"a": "AP8=", "d/b": ""}
    assert parse_request(line.rstrip(b"\n")) == job


# --------------------------------------------------------------------------- session transfers


def test_the_three_transfer_requests() -> None:
    assert parsed({"id": 1, "session": "nb", "upload": "in//data.bin", "size": 5, "offset": 3, "data": b64(b"lo")}) == (
        UploadChunk(1, "nb", "in/data.bin", 3, 5, b"lo"))
    assert parsed({"id": 2, "session": "nb", "download": "out/a.png"}) == DownloadChunk(2, "nb", "out/a.png", 0)
    assert parsed({"id": 3, "session": "nb", "download": "a", "offset": 7}) == DownloadChunk(3, "nb", "a", 7)
    assert parsed({"id": 4, "session": "nb", "list": "."}) == ListFiles(4, "nb", ".")
    assert parsed({"id": 5, "session": "nb", "list": "./out/"}) == ListFiles(5, "nb", "out")


UPLOAD = {"id": 1, "session": "nb", "upload": "a", "size": 2, "offset": 0, "data": b64(b"hi")}


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"upload": "../a"}, "upload", "'..'"),
        ({"upload": "/a"}, "upload", "absolute"),
        ({"upload": "."}, "upload", "the workspace itself"),
        ({"data": b64(b"hi!")}, "data", "runs past the upload's size"),
        ({"offset": 1}, "data", "runs past the upload's size"),
        ({"offset": 3}, "offset", "between 0 and 2"),
        ({"size": 2**40}, "size", "between 0 and"),
        ({"size": True}, "size", "whole number"),
        ({"offset": -1}, "offset", "between 0 and"),
        ({"data": "aGk"}, "data", "not valid base64"),
        ({"data": b64(b"x" * (UPLOAD_CHUNK_BYTES + 1)), "size": UPLOAD_CHUNK_BYTES + 1}, "data", "at most"),
        ({"session": ""}, "session", "empty"),
        ({"code": "x"}, "code", "not allowed"),
        ({"download": "a"}, "download", "not allowed"),
        ({"close": True}, "close", "not allowed"),
    ],
)
def test_bad_uploads_are_refused_naming_the_field(changes: dict[str, Any], field: str, words: str) -> None:
    error = refusal({**UPLOAD, **changes})
    assert error.field == field and words in str(error), error


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ({"id": 1, "upload": "a", "size": 0, "offset": 0, "data": ""}, "session"),
        ({"id": 1, "session": "nb", "upload": "a", "offset": 0, "data": ""}, "size"),
        ({"session": "nb", "list": "."}, "id"),
        ({"id": 1, "session": "nb", "list": ".."}, "list"),
        ({"id": 1, "session": "nb", "download": "a", "offset": "0"}, "offset"),
        ({"id": 1, "stats": True, "list": "."}, "list"),
        ({"id": 1, "session": "nb", "hibernate": True, "download": "a"}, "download"),
        ({"id": 1, "code": "x", "size": 3}, "size"),
    ],
)
def test_incomplete_and_mixed_transfer_lines_are_refused(line: dict[str, Any], field: str) -> None:
    assert refusal(line).field == field


@pytest.mark.parametrize(
    "request_",
    [UploadChunk(1, "nb", "a/b", 0, 3, b"abc"), DownloadChunk("d", "nb", "a", 5), ListFiles(3, "nb", ".")],
    ids=lambda request: type(request).__name__,
)
def test_transfer_requests_are_written_back_as_themselves(request_: Any) -> None:
    assert parse_request(encode_request(request_json(request_)).rstrip(b"\n")) == request_


# --------------------------------------------------------------------------- a client's connection

CHUNK = FileChunk("a.bin", 0, 3, 1_700_000_000_000_000_000, b"abc")
LISTING = FileListing(".", (FileEntry("a.bin", 3, "file"), FileEntry("out", 0, "dir")), truncated=False)


def pair() -> tuple[PoolConnection, PoolConnection]:
    client, pool = PoolConnection(Role.CLIENT), PoolConnection(Role.POOL)
    client.receive_data(pool.send(ReadyEvent.pool(workers=1)))
    client.next_event()
    return client, pool


def read_all(connection: PoolConnection, data: bytes) -> list[Any]:
    connection.receive_data(data)
    out = []
    while (event := connection.next_event()) is not NEED_DATA:
        out.append(event)
    return out


def refused_result(request_id: Any) -> Result:
    return Result(id=request_id, exit=-1, error=ErrorInfo("RequestError", "session: no open session 'nb'"),
                  session="nb", session_ended=True, runtime=RuntimeInfo.pool("3.11.2"))


def test_transfers_cross_and_each_answer_is_read_as_its_request_asked() -> None:
    client, pool = pair()
    sent = [UploadChunk(1, "nb", "a.bin", 0, 3, b"abc"), DownloadChunk(2, "nb", "a.bin"), ListFiles(3, "nb"),
            UploadChunk(4, "nb", "b", 0, 0, b"")]
    assert read_all(pool, b"".join(client.send(request) for request in sent)) == sent
    answers = [UploadedEvent(1, "nb", "a.bin", 3, 3), ChunkEvent(2, "nb", CHUNK), ListingEvent(3, "nb", LISTING),
               refused_result(4)]
    assert read_all(client, b"".join(pool.send(answer) for answer in answers)) == answers


def test_a_refused_download_or_listing_is_a_result() -> None:
    client, pool = pair()
    for request in (DownloadChunk(1, "nb", "a"), ListFiles(2, "nb")):
        client.send(request)
    answers = [refused_result(1), refused_result(2)]
    assert read_all(client, b"".join(pool.send(answer) for answer in answers)) == answers


@pytest.mark.parametrize(
    "line",
    [
        {"id": 1, "event": "file_chunk", "session": "nb", "path": "a", "offset": 0, "size": 2, "modified_ns": 0,
         "data": b64(b"abc")},  # more bytes than the file holds
        {"id": 1, "event": "file_chunk", "session": "nb", "path": "a", "offset": 0, "size": 3, "modified_ns": 0,
         "data": "!!"},
        {"id": 1, "event": "file_chunk", "session": "nb", "path": "a", "offset": 0, "size": 2**31, "modified_ns": 0,
         "data": b64(b"x" * (1024 * 1024 + 1))},  # more than a chunk
    ],
)
def test_a_pool_sending_a_chunk_out_of_bounds_breaks_the_connection(line: dict[str, Any]) -> None:
    client, _ = pair()
    client.send(DownloadChunk(1, "nb", "a"))
    with pytest.raises(PoolError, match="broke the protocol"):
        read_all(client, json.dumps(line).encode() + b"\n")


def test_a_listing_of_an_unknown_kind_breaks_the_connection() -> None:
    client, _ = pair()
    client.send(ListFiles(1, "nb"))
    line = {"id": 1, "event": "listing", "session": "nb", "path": ".", "truncated": False,
            "entries": [{"name": "a", "size": 1, "kind": "fifo"}]}
    with pytest.raises(PoolError, match="unknown kind"):
        read_all(client, json.dumps(line).encode() + b"\n")


# --------------------------------------------------------------------------- the schema


@pytest.mark.parametrize(
    "line",
    [
        UPLOAD,
        {"id": 2, "session": "nb", "download": "out/a.png"},
        {"id": 2, "session": "nb", "download": "out/a.png", "offset": 1048576},
        {"id": 3, "session": "nb", "list": "."},
        {"id": 4, "code": "x", "files": {"data/orders.csv": b64(b"a,b\n")}, "collect": ["out/*.png", "report.xlsx"]},
    ],
)
def test_the_new_lines_are_valid_and_the_pool_accepts_them(line: dict[str, Any]) -> None:
    assert valid(request_schema(), line)
    assert not isinstance(parsed(line), Refused)


@pytest.mark.parametrize(
    "line",
    [
        {"id": 1, "session": "nb", "upload": "a", "size": 2, "offset": 0},  # no data
        {"id": 1, "session": "nb", "list": ".", "code": "x"},
        {"id": 1, "upload": "a", "size": 0, "offset": 0, "data": ""},  # no session
        {"id": 1, "session": "nb", "download": "a", "offset": -1},
        {"id": 1, "code": "x", "files": {"a": 5}},
        {"id": 1, "code": "x", "collect": [f"p{i}" for i in range(MAX_COLLECT_PATTERNS + 1)]},
    ],
)
def test_lines_refused_for_their_shape_are_invalid(line: dict[str, Any]) -> None:
    assert isinstance(parsed(line), Refused)
    assert not valid(request_schema(), line)


@pytest.mark.parametrize(
    ("name", "event"),
    [
        ("uploaded", UploadedEvent(1, "nb", "a.bin", 3, 3)),
        ("file_chunk", ChunkEvent("d", "nb", CHUNK)),
        ("listing", ListingEvent(3, "nb", LISTING)),
        ("result", Result(id=1, exit=0, collected={"out/a.png": b"\x89PNG"}, runtime=RuntimeInfo.pool("3.11.2"),
                          left_out=(LeftOut("out/huge.png", "size", 90_000_000), LeftOut("l", "link")),
                          left_out_more=2)),
    ],
)
def test_what_the_pool_writes_is_described(name: str, event: Any) -> None:
    schemas = event_schemas()
    assert valid(schemas[name], json.loads(json.dumps(event.to_json())))
    assert not valid(schemas[name], {**event.to_json(), "id": [1]})
