"""Files in the workspace as proto messages and back (``_files_wire``, ``_convert``): pure, no server.

Covered: a request's ``files`` and ``collect`` reach the job (and a step) checked by the
protocol's own rules, each refusal naming its field; the caller's limits on what comes back
can only lower the job's; a job's collected files cross both ways; and every way a worker's
answer can break the bounds (collected files, an upload's count, a chunk, a listing) is a
PoolWorkerError before anyone reads it. The file requests' own checks on the serving side,
and refusals answered in the event with their field, through ``answer_file_request``.
"""

from __future__ import annotations

import dataclasses

import pytest

from readie_policy.jobs import CodeJob, JobOutcome
from readie_protocol.cancel import NEVER
from readie_protocol.errors import PoolWorkerError, RequestError, SandboxSetupError
from readie_protocol.workspace import (
    DOWNLOAD_CHUNK_BYTES, MAX_COLLECTED_BYTES, MAX_COLLECTED_FILES, MAX_LEFT_OUT, MAX_LISTED_ENTRIES,
    MAX_REQUEST_FILES, MAX_REQUEST_FILES_BYTES, MAX_TRANSFER_BYTES, UPLOAD_CHUNK_BYTES,
    Collected, FileChunk, FileEntry, FileListing, LeftOut,
)
from readie_rpc._client_wire import job_outcome, run_job_request, session_step_message
from readie_rpc._convert import code_job, run_job_response, session_step
from readie_rpc._files_wire import (
    answer_file_request, chunk_from_answer, download_message, file_refusal, list_message, listing_from_answer,
    received_from_answer, upload_message,
)
from readie_rpc._proto.readie.v1 import worker_pb2 as pb

OUTCOME = JobOutcome(0, "", "", False, False, None, 1, "3.11", (), None, "fake")
COLLECTING = CodeJob("base", "x", collect=("out/*.png",))


def _request(**fields) -> pb.RunJobRequest:
    return pb.RunJobRequest(checkpoint="base", code="x", **fields)


# --------------------------------------------------------------------------- a request's files and collect


def test_files_and_collect_reach_the_job_and_a_step_normalised_and_back():
    job = code_job(_request(
        files=[pb.WorkspaceFile(path="data//./orders.csv", data=b"a,b\n"), pb.WorkspaceFile(path="empty", data=b"")],
        collect=["out/*.png", "report.xlsx", "**/*.csv"],
    ), None)
    assert job.files == (("data/orders.csv", b"a,b\n"), ("empty", b""))
    assert job.collect == ("out/*.png", "report.xlsx", "**/*.csv")
    assert code_job(run_job_request(job), None) == job
    step = session_step(pb.SessionStep(code="s", files=[pb.WorkspaceFile(path="a", data=b"1")], collect=["b"]))
    assert (step.files, step.collect) == ((("a", b"1"),), ("b",))
    assert session_step(session_step_message(step)) == step


@pytest.mark.parametrize(
    ("files", "reason"),
    [
        ([("../etc/passwd", b"")], "'..'"),
        ([("/abs", b"")], "absolute"),
        ([("a\0b", b"")], "NUL"),
        ([(".", b"")], "workspace itself"),
        ([("a/b", b""), ("a//b", b"")], "another entry"),
        ([(f"f{i}", b"") for i in range(MAX_REQUEST_FILES + 1)], f"at most {MAX_REQUEST_FILES}"),
        ([("a", b"x" * MAX_REQUEST_FILES_BYTES), ("b", b"x")], "upload"),
        ([("x" * 1025, b"")], "1024 bytes"),
    ],
    ids=["dotdot", "absolute", "nul", "workspace", "duplicate", "count", "bytes", "long"],
)
def test_bad_files_are_refused_naming_the_field(files, reason):
    messages = [pb.WorkspaceFile(path=path, data=data) for path, data in files]
    with pytest.raises(RequestError, match=reason) as refused:
        code_job(_request(files=messages), None)
    assert refused.value.field == "files"
    with pytest.raises(RequestError) as in_step:
        session_step(pb.SessionStep(code="s", files=messages))
    assert in_step.value.field == "step.files"


@pytest.mark.parametrize("collect", [["../x"], ["/x"], ["a", "./a"], ["p"] * 17, [""]])
def test_bad_collect_patterns_are_refused_naming_the_field(collect):
    with pytest.raises(RequestError) as refused:
        code_job(_request(collect=collect), None)
    assert refused.value.field == "collect"


def test_the_callers_limits_only_lower_what_comes_back():
    default = code_job(_request(), None)
    assert (default.collect_bytes, default.collect_files, default.transfer_bytes) == (
        MAX_COLLECTED_BYTES, MAX_COLLECTED_FILES, MAX_TRANSFER_BYTES
    )
    lowered = code_job(_request(collect_bytes=0, collect_files=3, transfer_bytes=1024), None)
    assert (lowered.collect_bytes, lowered.collect_files, lowered.transfer_bytes) == (0, 3, 1024)
    with pytest.raises(RequestError) as refused:
        code_job(_request(collect_bytes=MAX_COLLECTED_BYTES + 1), None)
    assert refused.value.field == "collect_bytes"


# --------------------------------------------------------------------------- collected files


def _collected(**fields) -> pb.RunJobResponse:
    return pb.RunJobResponse(exit=0, collected=pb.CollectedFiles(**fields))


def test_collected_files_cross_both_ways():
    collected = Collected(
        {"out/a.png": b"\x89PNG", "report.xlsx": b"PK"},
        (LeftOut("out/huge.png", "size", 90_000_000), LeftOut("out/l", "link")),
        left_out_more=3,
    )
    outcome = job_outcome(run_job_response(dataclasses.replace(OUTCOME, collected=collected)), COLLECTING)
    assert outcome.collected == collected
    assert job_outcome(run_job_response(OUTCOME), COLLECTING).collected is None  # the code did not get that far


def _file(path: str, data: bytes = b"") -> pb.WorkspaceFile:
    return pb.WorkspaceFile(path=path, data=data)


@pytest.mark.parametrize(
    "collected",
    [
        {"files": [_file(f"f{i}") for i in range(MAX_COLLECTED_FILES + 1)]},
        {"files": [_file("a", b"x" * (MAX_COLLECTED_BYTES // 2)), _file("b", b"x" * (MAX_COLLECTED_BYTES // 2 + 1))]},
        {"files": [_file("../../etc/shadow")]},
        {"files": [_file("/etc/shadow")]},
        {"files": [_file("a//b")]},
        {"files": [_file("a"), _file("a")]},
        {"left_out": [pb.LeftOut(path="a", reason="because")]},
        {"left_out": [pb.LeftOut(path="a", reason="size", size=-1)]},
        {"left_out": [pb.LeftOut(path="../a", reason="size")]},
        {"left_out": [pb.LeftOut(path="a", reason="count")] * (MAX_LEFT_OUT + 1)},
    ],
    ids=["count", "bytes", "dotdot", "absolute", "unnormalised", "twice", "reason", "size", "left-out-path", "left-out-count"],
)
def test_collected_files_past_what_a_worker_sends_are_a_worker_error(collected):
    with pytest.raises(PoolWorkerError, match="the worker answered"):
        job_outcome(_collected(**collected), COLLECTING)


def test_collected_files_are_held_to_what_the_job_let_come_back():
    job = CodeJob("base", "x", collect=("*",), collect_files=1, collect_bytes=4)
    assert job_outcome(_collected(files=[_file("a", b"1234")]), job).collected == Collected({"a": b"1234"})
    with pytest.raises(PoolWorkerError, match="over the 4 asked"):
        job_outcome(_collected(files=[_file("a", b"12345")]), job)
    with pytest.raises(PoolWorkerError, match="over the 1 asked"):
        job_outcome(_collected(files=[_file("a"), _file("b")]), job)
    with pytest.raises(PoolWorkerError, match="asked for none"):
        job_outcome(_collected(files=[_file("a")]), CodeJob("base", "x"))


# --------------------------------------------------------------------------- a session's files: answers


def test_an_upload_answer_must_say_where_the_chunk_ended():
    assert received_from_answer(pb.ChunkUploaded(received=7), 4, b"abc") == 7
    for received in (0, 6, 8, MAX_TRANSFER_BYTES):
        with pytest.raises(PoolWorkerError, match="received"):
            received_from_answer(pb.ChunkUploaded(received=received), 4, b"abc")


def _chunk(**fields) -> pb.ChunkDownloaded:
    return pb.ChunkDownloaded(**{"path": "a", "offset": 0, "size": 10, "modified_ns": 5, "data": b"x" * 4, **fields})


def test_a_chunk_is_the_one_asked_for():
    assert chunk_from_answer(_chunk(), "a", 0, 4) == FileChunk("a", 0, 10, 5, b"xxxx")
    assert chunk_from_answer(_chunk(offset=10, data=b""), "a", 10, 4).last  # the end of the file
    assert chunk_from_answer(_chunk(size=0, data=b""), "a", 0, 4) == FileChunk("a", 0, 0, 5, b"")


@pytest.mark.parametrize(
    "lie",
    [
        {"path": "b"},
        {"offset": 1},
        {"data": b"x" * 5},  # more than asked
        {"size": 3},  # past the file's end
        {"data": b""},  # nothing, mid-file: a download that never ends
        {"size": MAX_TRANSFER_BYTES + 1},
        {"modified_ns": -1},
    ],
    ids=["path", "offset", "long", "past-size", "stalls", "huge", "mtime"],
)
def test_a_chunk_out_of_bounds_is_a_worker_error(lie):
    with pytest.raises(PoolWorkerError, match="the worker answered"):
        chunk_from_answer(_chunk(**lie), "a", 0, 4)


def test_a_listing_is_held_to_a_workers_own():
    entries = [pb.FileEntry(name="a", size=1, kind=pb.FILE_KIND_FILE), pb.FileEntry(name="d", kind=pb.FILE_KIND_DIR)]
    listing = listing_from_answer(pb.FilesListed(entries=entries, truncated=True), ".")
    assert listing == FileListing(".", (FileEntry("a", 1, "file"), FileEntry("d", 0, "dir")), truncated=True)


@pytest.mark.parametrize(
    "entries",
    [
        [pb.FileEntry(name="a/b", kind=pb.FILE_KIND_FILE)],
        [pb.FileEntry(name="..", kind=pb.FILE_KIND_DIR)],
        [pb.FileEntry(name="", kind=pb.FILE_KIND_FILE)],
        [pb.FileEntry(name="x" * 256, kind=pb.FILE_KIND_FILE)],
        [pb.FileEntry(name="a", kind=pb.FILE_KIND_UNSPECIFIED)],
        [pb.FileEntry(name="a", size=-1, kind=pb.FILE_KIND_FILE)],
        [pb.FileEntry(name="b", kind=pb.FILE_KIND_FILE), pb.FileEntry(name="a", kind=pb.FILE_KIND_FILE)],
        [pb.FileEntry(name="a", kind=pb.FILE_KIND_FILE)] * 2,
        [pb.FileEntry(name=f"{i:05}", kind=pb.FILE_KIND_FILE) for i in range(MAX_LISTED_ENTRIES + 1)],
    ],
    ids=["slash", "dotdot", "empty", "long", "kind", "size", "unsorted", "twice", "count"],
)
def test_a_listing_out_of_bounds_is_a_worker_error(entries):
    with pytest.raises(PoolWorkerError, match="the worker answered"):
        listing_from_answer(pb.FilesListed(entries=entries), ".")


# --------------------------------------------------------------------------- a session's files: the serving side


class _Refusing:
    """A session whose file methods record what they were asked, or raise ``error``."""

    def __init__(self, error: Exception | None = None, ends: bool = False) -> None:
        self.error = error
        self.ends = ends  # the error ends the session
        self.ended = False
        self.asked: list[tuple] = []

    def upload_chunk(self, path, offset, data, size, *, cancel):
        return self._answer(("upload", path, offset, data, size), offset + len(data))

    def download_chunk(self, path, offset, length, *, cancel):
        return self._answer(("download", path, offset, length), FileChunk(path, offset, 3, 9, b"abc"[offset : offset + length]))

    def list_files(self, path, *, cancel):
        return self._answer(("list", path), FileListing(path, (FileEntry("a", 3, "file"),)))

    def _answer(self, asked, answer):
        self.asked.append(asked)
        if self.error is not None:
            self.ended = self.ends
            raise self.error
        return answer


def test_file_requests_are_answered_by_the_session():
    session = _Refusing()
    uploaded = answer_file_request(session, upload_message("a//b", 0, b"abc", 3), NEVER)
    assert uploaded.uploaded == pb.ChunkUploaded(received=3)
    downloaded = answer_file_request(session, download_message("a/b", 1, 2), NEVER)
    assert chunk_from_answer(downloaded.downloaded, "a/b", 1, 2) == FileChunk("a/b", 1, 3, 9, b"bc")
    listed = answer_file_request(session, pb.InteractRequest(list_files=pb.ListFiles()), NEVER)
    assert listing_from_answer(listed.listed, ".").entries == (FileEntry("a", 3, "file"),)
    assert session.asked == [("upload", "a/b", 0, b"abc", 3), ("download", "a/b", 1, 2), ("list", ".")]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (upload_message("../x", 0, b"", 0), "upload.path"),
        (upload_message("x", 0, b"", MAX_TRANSFER_BYTES + 1), "upload.size"),
        (upload_message("x", 0, b"x" * (UPLOAD_CHUNK_BYTES + 1), UPLOAD_CHUNK_BYTES + 1), "upload.data"),
        (upload_message("x", 2, b"abc", 4), "upload.offset"),
        (upload_message("x", -1, b"", 4), "upload.offset"),
        (download_message("/etc/passwd", 0, 1), "download.path"),
        (download_message("x", -1, 1), "download.offset"),
        (download_message("x", 0, 0), "download.length"),
        (download_message("x", 0, DOWNLOAD_CHUNK_BYTES + 1), "download.length"),
        (list_message("a/../.."), "list_files.path"),
    ],
)
def test_a_bad_file_request_is_refused_in_its_answer_naming_the_field(request_, field):
    session = _Refusing()
    event = answer_file_request(session, request_, NEVER)
    answer = getattr(event, event.WhichOneof("kind"))
    refused = file_refusal(answer)
    assert isinstance(refused, RequestError) and refused.field == field, refused
    assert str(refused).startswith(f"{field}: ") and str(refused).count(field) == 1
    assert session.asked == []  # the session never saw it


def test_the_sessions_refusals_are_answered_and_anything_else_raised():
    refused = answer_file_request(_Refusing(RequestError("past the memory left", field="upload.size")), upload_message("x", 0, b"", 9), NEVER)
    error = file_refusal(refused.uploaded)
    assert isinstance(error, RequestError) and error.field == "upload.size" and "memory" in str(error)
    not_a_dir = answer_file_request(_Refusing(RequestError("x: not a directory", field="list")), list_message("x"), NEVER)
    assert file_refusal(not_a_dir.listed).field == "list_files"  # the pool protocol's name, as the proto spells it
    no_resume = answer_file_request(_Refusing(SandboxSetupError("restore failed")), list_message("."), NEVER)
    assert isinstance(file_refusal(no_resume.listed), SandboxSetupError)
    with pytest.raises(PoolWorkerError):
        answer_file_request(_Refusing(PoolWorkerError("the sandbox lied"), ends=True), download_message("x", 0, 1), NEVER)
    with pytest.raises(SandboxSetupError):  # its resume failed, and the session ended
        answer_file_request(_Refusing(SandboxSetupError("restore failed"), ends=True), list_message("."), NEVER)
    strange = file_refusal(pb.FilesListed(error_type="KeyError", error_message="m"))
    assert isinstance(strange, PoolWorkerError)
