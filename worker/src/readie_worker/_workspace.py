"""Files in a sandbox's workspace, from the worker (decision 31): a job's ``collect`` after it ran,
and a session's uploads, downloads and listings.

Each is one pickled call of the trusted in-sandbox functions (``readie_executor.jobs``' collect,
upload_chunk, download_chunk, list_files), answered in raw bytes that are bounded before they
are received and checked by :mod:`._workspace_answers` before anything reads them. A job's own
``files`` need no call: they ride in its spec (``jobs.runner_call``).

The caller holds the sandbox (a job's, or an idle session's); a PoolWorkerError from here means
the sandbox broke or lied, and it is not trusted again. A RequestError is the request's: the
session goes on.
"""

from __future__ import annotations

from typing import Any

import cloudpickle
import structlog

from readie_executor import jobs as executor_jobs
from readie_policy.jobs import CodeJob
from readie_protocol.cancel import NEVER, Cancellation
from readie_protocol.workspace import (
    DOWNLOAD_CHUNK_BYTES,
    MAX_LEFT_OUT,
    MAX_LISTED_ENTRIES,
    MAX_WORKSPACE_PATH_BYTES,
    UPLOAD_CHUNK_BYTES,
    Collected,
    FileChunk,
    FileListing,
    workspace_dir,
    workspace_path,
)

from ._workspace_answers import (
    collect_budget,
    download_budget,
    listing_budget,
    parse_chunk,
    parse_collected,
    parse_listing,
    parse_uploaded,
    upload_budget,
)
from .errors import RequestError, shown
from .sandbox import Sandbox

__all__ = ["FILES_CALL_TIMEOUT_S", "collect", "download_chunk", "list_files", "spec_files", "upload_chunk"]

log = structlog.get_logger("readie.worker")

# A collect walks at most 100,000 entries and reads at most 32 MiB from the sandbox's memory; a
# chunk is a megabyte. Seconds at most even under gVisor: past this the sandbox is wedged.
FILES_CALL_TIMEOUT_S = 30.0


def spec_files(job: CodeJob) -> list[list[Any]]:
    """A job's ``files`` as its spec carries them to the sandbox's runner: ``[path, bytes]`` pairs."""
    return [[path, data] for path, data in job.files]


def collect(sandbox: Sandbox, job: CodeJob, cancel: Cancellation = NEVER) -> Collected:
    """What ``job.collect`` matches in ``sandbox``'s workspace now, within the job's limits."""
    limits = (job.collect_files, job.collect_bytes, MAX_LEFT_OUT, MAX_WORKSPACE_PATH_BYTES)
    raw = _call(sandbox, executor_jobs.collect, (job.cwd, list(job.collect), *limits), collect_budget(job.collect_bytes), cancel)
    collected, walk_cut = parse_collected(raw, job.collect, job.collect_files, job.collect_bytes)
    if walk_cut:
        log.warning("collect stopped at its walk's bound: some matches were not looked at", sandbox=sandbox.id)
    return collected


def upload_chunk(
    sandbox: Sandbox, job: CodeJob, path: str, offset: int, data: bytes, size: int, cancel: Cancellation = NEVER
) -> int:
    """Write ``data`` at ``offset`` of the ``size``-byte upload of ``path``; the bytes it holds now.

    Refused (RequestError, field ``upload``) before the sandbox is asked: a bad path, a size past
    ``job.transfer_bytes``, a chunk outside the upload or past UPLOAD_CHUNK_BYTES, and at offset 0
    a size past the memory the sandbox has left (its files live in its memory).
    """
    path = _checked(workspace_path, path, "upload")
    if not 0 <= size <= job.transfer_bytes:
        raise RequestError(f"{path}: {size} bytes; at most {job.transfer_bytes} may be uploaded (transfer_bytes)", field="upload")
    if len(data) > UPLOAD_CHUNK_BYTES:
        raise RequestError(f"{path}: a chunk of {len(data)} bytes; at most {UPLOAD_CHUNK_BYTES} go in one", field="upload")
    if offset < 0 or offset + len(data) > size:
        raise RequestError(f"{path}: bytes {offset}..{offset + len(data)} are outside the {size}-byte upload", field="upload")
    if offset == 0:
        left = sandbox.memory_left()
        if left is not None and size > left:
            raise RequestError(
                f"{path}: {size} bytes, but the session's sandbox has {left} bytes of memory left and its files "
                f"live in its memory; free some, or open the session with more 'memory'",
                field="upload",
            )
    raw = _call(sandbox, executor_jobs.upload_chunk, (job.cwd, path, offset, size, data), upload_budget(), cancel)
    return parse_uploaded(raw, path, offset, len(data))


def download_chunk(
    sandbox: Sandbox, job: CodeJob, path: str, offset: int, length: int, cancel: Cancellation = NEVER
) -> FileChunk:
    """At most ``length`` (and DOWNLOAD_CHUNK_BYTES) bytes of ``path`` from ``offset``; a file past
    ``job.transfer_bytes`` is refused (RequestError, field ``download``)."""
    path = _checked(workspace_path, path, "download")
    if offset < 0 or length < 0:
        raise RequestError(f"{path}: offset and length must not be negative", field="download")
    length = min(length, DOWNLOAD_CHUNK_BYTES)
    raw = _call(sandbox, executor_jobs.download_chunk, (job.cwd, path, offset, length), download_budget(length), cancel)
    return parse_chunk(raw, path, offset, length, job.transfer_bytes)


def list_files(sandbox: Sandbox, job: CodeJob, path: str, cancel: Cancellation = NEVER) -> FileListing:
    """The entries of directory ``path`` (``"."``: the workspace), sorted, at most MAX_LISTED_ENTRIES."""
    path = _checked(workspace_dir, path, "list")
    raw = _call(sandbox, executor_jobs.list_files, (job.cwd, path, MAX_LISTED_ENTRIES), listing_budget(), cancel)
    return parse_listing(raw, path, MAX_LISTED_ENTRIES)


def _call(sandbox: Sandbox, func: Any, args: tuple[Any, ...], budget: int, cancel: Cancellation) -> bytes:
    # A reference to the trusted function and plain data: the trusted side pickles, never unpickles.
    request = cloudpickle.dumps({"func": func, "args": args, "kwargs": {}})
    with cancel.stopping(sandbox.interrupt):
        return sandbox.call(request, timeout=FILES_CALL_TIMEOUT_S, max_response=budget)


def _checked(check: Any, path: Any, field: str) -> str:
    try:
        return check(path)
    except ValueError as exc:  # readie_protocol's Invalid
        raise RequestError(f"{shown(str(path))}: {exc}", field=field) from None
