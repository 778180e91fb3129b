"""Files in and out of a sandbox through ``readie pool`` under runsc (decision 31): a job's files and
collect, a session's upload, download and list, byte for byte; bad paths, oversize files and links
refused or left out, with the pool serving on and no container left."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from typing import Any

import pytest

from pool.tests._conformance import Pool, placed_pool

pytestmark = pytest.mark.runsc

# Every byte value, in an order no codec keeps by accident.
BLOB = bytes(range(256)) * 1200 + hashlib.sha256(b"readie").digest()
ORDERS = b"product,amount\ntea,3\ncake,5\ntea,4\n"
LIMITS = "[pool.limits]\ntransfer_bytes = \"2m\"\ncollect_files = 3\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def pool(checkpoints, tmp_path_factory) -> Iterator[Pool]:
    config = tmp_path_factory.mktemp("cfg") / "readie.toml"
    config.write_text(LIMITS)
    with placed_pool("local", "rxfer-", "--workers", "2", "--config", str(config)) as made:
        yield made


def ok(result: dict[str, Any]) -> dict[str, Any]:
    assert result.get("error") is None and result.get("exit", 0) == 0, result
    return result


JOB = """
import csv, os
rows = list(csv.DictReader(open("data/orders.csv")))
os.makedirs("out", exist_ok=True)
open("out/total.txt", "w").write(str(sum(int(row["amount"]) for row in rows)))
open("out/blob.rev", "wb").write(open("data/blob.bin", "rb").read()[::-1])
os.symlink("/etc/passwd", "out/link")
"""


def test_a_job_gets_its_files_and_brings_back_what_it_wrote_byte_for_byte(pool):
    result = ok(pool.process.run({
        "id": "j1", "code": JOB, "files": {"data/orders.csv": b64(ORDERS), "data/blob.bin": b64(BLOB)},
        "collect": ["out/*", "missing.txt"],
    }, timeout=60))
    collected = {path: base64.b64decode(text) for path, text in result["collected"].items()}
    assert collected == {"out/total.txt": b"12", "out/blob.rev": BLOB[::-1]}
    reasons = {entry["path"]: entry["reason"] for entry in result["left_out"]}
    assert reasons == {"out/link": "link", "missing.txt": "unreadable"}


def test_a_session_uploads_steps_lists_and_downloads_in_chunks(pool):
    process = pool.process
    ok(process.run({"id": "s1", "session": "files", "code": "import hashlib"}, timeout=60))
    size, chunk = len(BLOB) * 3, 512 * 1024
    whole = BLOB * 3
    for number, offset in enumerate(range(0, size, chunk)):
        answer = process.run({"id": f"u{number}", "session": "files", "upload": "in/big.bin", "size": size,
                              "offset": offset, "data": b64(whole[offset : offset + chunk])})
        assert answer == {"id": f"u{number}", "event": "uploaded", "session": "files", "path": "in/big.bin",
                          "received": min(size, offset + chunk), "size": size}, answer
    step = ok(process.run({"id": "s2", "session": "files", "code":
                           "data = open('in/big.bin', 'rb').read()\nprint(hashlib.sha256(data).hexdigest())\n"
                           "open('out.bin', 'wb').write(data[::-1] * 2)"}, timeout=60))
    assert step["stdout"].strip() == hashlib.sha256(whole).hexdigest()
    listing = process.run({"id": "l1", "session": "files", "list": "."})
    assert {(entry["name"], entry["kind"]) for entry in listing["entries"]} >= {("in", "dir"), ("out.bin", "file")}
    expected, got, offset = whole[::-1] * 2, b"", 0
    while True:
        answer = process.run({"id": f"d{offset}", "session": "files", "download": "out.bin", "offset": offset})
        assert answer["event"] == "file_chunk" and answer["size"] == len(expected), {**answer, "data": "..."}
        data = base64.b64decode(answer["data"])
        got, offset = got + data, offset + len(data)
        if offset >= answer["size"]:
            break
    assert got == expected
    assert process.run({"id": "c", "session": "files", "close": True})["closed"] is True


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ({"upload": "../escape", "size": 1, "offset": 0, "data": b64(b"x")}, "upload"),
        ({"upload": "/tmp/abs", "size": 1, "offset": 0, "data": b64(b"x")}, "upload"),
        ({"upload": "big", "size": 3 * 1024 * 1024, "offset": 0, "data": b64(b"x")}, "size"),  # past transfer_bytes
        ({"download": "nowhere.txt"}, "download"),
        ({"download": "link"}, "download"),  # a link is never followed
        ({"list": "a\u0000b"}, "list"),
    ],
)
def test_bad_transfers_are_refused_and_the_session_goes_on(pool, line, field):
    process = pool.process
    ok(process.run({"id": "h1", "session": "hostile", "code": "import os\nos.symlink('/etc/passwd', 'link')"},
                   timeout=60))
    refused = process.run({"id": "h2", "session": "hostile", **line})
    assert refused["error"]["type"] == "RequestError" and refused["error"]["message"].startswith(field), refused
    assert refused.get("session_ended", False) is False  # a line the parser refused names no session
    ok(process.run({"id": "h3", "session": "hostile", "code": "print('still here')"}))
    assert process.run({"id": "h4", "session": "hostile", "close": True})["closed"] is True


def test_too_many_files_bad_paths_and_the_ceiling_are_refused_or_left_out(pool):
    process = pool.process
    for files, words in (({f"f{i}": "" for i in range(65)}, "at most 64"), ({"a/../../x": ""}, "'..'"),
                         ({"a": "!!"}, "base64")):
        refused = process.run({"id": "f", "code": "pass", "files": files})
        assert refused["error"]["type"] == "RequestError" and words in refused["error"]["message"], refused
    result = ok(process.run({"id": "n", "code": "for i in range(5): open(f'w{i}', 'w').write(str(i))",
                             "collect": ["w*"]}, timeout=60))
    assert len(result["collected"]) == 3  # the ceiling's collect_files
    assert sorted(entry["reason"] for entry in result["left_out"]) == ["count", "count"]
