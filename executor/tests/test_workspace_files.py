"""The workspace's files from inside the sandbox (decision 31), against a real directory.

Writing a job's files, a session's uploads, downloads and listings, and collect: every path is
reached without following a link, so a link the code planted (to a "grant" outside the
workspace, here a sibling directory) is refused or reported, and nothing outside is written
or read. Pure functions of descriptors: they run in this process. The answers are split here
by hand, not by the worker's parser.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from readie_executor.filewire import HEADER_LENGTH_BYTES, pattern_matches
from readie_executor.jobs import collect, download_chunk, list_files, upload_chunk
from readie_executor.jobs import _collect
from readie_executor.jobs._workspace import WorkspaceError, read_regular, write_files


def split(answer: bytes | bytearray) -> tuple[dict[str, Any], bytes]:
    length = int.from_bytes(answer[:HEADER_LENGTH_BYTES], "big")
    return json.loads(bytes(answer[HEADER_LENGTH_BYTES : HEADER_LENGTH_BYTES + length])), bytes(answer[HEADER_LENGTH_BYTES + length :])


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path]:
    """A workspace, and a directory beside it standing for a write grant the code may link to."""
    workspace, outside = tmp_path / "ws", tmp_path / "grant"
    workspace.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"host secret")
    return workspace, outside


def collected(workspace: Path, patterns: list[str], max_files: int = 64, max_bytes: int = 1 << 20, max_left_out: int = 64):
    header, data = split(collect(str(workspace), patterns, max_files, max_bytes, max_left_out, 1024))
    files, offset = {}, 0
    for entry in header["files"]:
        files[entry["path"]] = data[offset : offset + entry["size"]]
        offset += entry["size"]
    assert offset == len(data)
    return files, [(e["path"], e["reason"]) for e in header["left_out"]], header


# --------------------------------------------------------------------------- a job's files


def test_files_are_written_with_their_directories_and_replace_what_is_there(places):
    workspace, _ = places
    (workspace / "old.txt").write_bytes(b"old bytes, longer than the new")
    os.link(workspace / "old.txt", workspace / "other-name")
    write_files(str(workspace), (("data/in/orders.csv", b"a,b\n1,2\n"), ("old.txt", b"\x00new")))
    assert (workspace / "data/in/orders.csv").read_bytes() == b"a,b\n1,2\n"
    assert (workspace / "old.txt").read_bytes() == b"\x00new"
    assert (workspace / "other-name").read_bytes() == b"old bytes, longer than the new"  # replaced, not written through


@pytest.mark.parametrize("path", ["grant/new.txt", "grant", "deep/../x", "/etc/passwd", "a//b"])
def test_files_never_go_through_a_link_or_outside(places, path):
    workspace, outside = places
    (workspace / "grant").symlink_to(outside)
    with pytest.raises(WorkspaceError):
        write_files(str(workspace), ((path, b"planted"),))
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]


def test_a_workspace_reached_through_a_link_is_refused(places, tmp_path):
    workspace, _ = places
    (tmp_path / "via").symlink_to(workspace)
    with pytest.raises(WorkspaceError, match="symbolic link"):
        write_files(str(tmp_path / "via"), (("x", b"1"),))


# --------------------------------------------------------------------------- a session's calls


def test_an_upload_in_chunks_then_a_download_in_chunks(places):
    workspace, _ = places
    blob = os.urandom(10_000)
    for offset in range(0, len(blob), 4096):
        header, _ = split(upload_chunk(str(workspace), "up/blob.bin", offset, len(blob), blob[offset : offset + 4096]))
        assert header == {"received": min(offset + 4096, len(blob))}
    assert (workspace / "up/blob.bin").read_bytes() == blob
    parts, offset = [], 0
    while offset < len(blob):
        header, data = split(download_chunk(str(workspace), "up/blob.bin", offset, 3000))
        assert (header["offset"], header["size"]) == (offset, len(blob))
        parts.append(data)
        offset += len(data)
    assert b"".join(parts) == blob


def test_an_upload_that_skips_or_repeats_a_chunk_is_refused(places):
    workspace, _ = places
    split(upload_chunk(str(workspace), "f", 0, 6, b"abc"))
    assert "holds 3 bytes, not the 5" in split(upload_chunk(str(workspace), "f", 5, 6, b"x"))[0]["refused"]
    assert "outside the 6-byte upload" in split(upload_chunk(str(workspace), "f", 3, 6, b"defg"))[0]["refused"]
    assert "no upload under way" in split(upload_chunk(str(workspace), "g", 3, 6, b"def"))[0]["refused"]


def test_uploads_downloads_and_listings_never_go_through_a_planted_link(places):
    workspace, outside = places
    (workspace / "grant").symlink_to(outside)
    (workspace / "secret").symlink_to(outside / "secret")
    assert "symbolic link" in split(upload_chunk(str(workspace), "grant/evil", 0, 4, b"evil"))[0]["refused"]
    assert "symbolic link" in split(upload_chunk(str(workspace), "secret", 0, 4, b"evil"))[0]["refused"]
    assert "symbolic link" in split(download_chunk(str(workspace), "secret", 0, 100))[0]["refused"]
    assert "symbolic link" in split(download_chunk(str(workspace), "grant/secret", 0, 100))[0]["refused"]
    assert "symbolic link" in split(list_files(str(workspace), "grant", 10))[0]["refused"]
    assert sorted(p.name for p in outside.iterdir()) == ["secret"] and (outside / "secret").read_bytes() == b"host secret"


def test_a_fifo_is_not_downloaded_and_does_not_hang(places):
    workspace, _ = places
    os.mkfifo(workspace / "pipe")
    assert "not a regular file" in split(download_chunk(str(workspace), "pipe", 0, 10))[0]["refused"]
    assert "normalised" in split(download_chunk(str(workspace), "../ws/pipe", 0, 10))[0]["refused"]


def test_a_listing_is_sorted_bounded_and_says_what_each_entry_is(places):
    workspace, outside = places
    (workspace / "b.txt").write_bytes(b"12345")
    (workspace / "a-dir").mkdir()
    (workspace / "link").symlink_to(outside)
    os.mkfifo(workspace / "pipe")
    (workspace / os.fsdecode(b"bad-\xff")).write_bytes(b"")  # not UTF-8: no request can name it
    header, data = split(list_files(str(workspace), ".", 10))
    assert data == b"" and header["truncated"] is False
    assert [(e["name"], e["kind"]) for e in header["entries"]] == [("a-dir", "dir"), ("b.txt", "file"), ("link", "link"), ("pipe", "other")]
    assert header["entries"][1]["size"] == 5
    header, _ = split(list_files(str(workspace), ".", 2))
    assert [e["name"] for e in header["entries"]] == ["a-dir", "b.txt"] and header["truncated"] is True


# --------------------------------------------------------------------------- collect


@pytest.mark.parametrize(
    ("path", "pattern", "matches"),
    [
        ("out/chart.png", "out/*.png", True),
        ("out/sub/chart.png", "out/*.png", False),
        ("chart.png", "**/*.png", True),
        ("a/b/c/chart.png", "**/*.png", True),
        ("out/x/y", "out/**", True),
        ("out", "out/**", False),
        ("a/b", "a/**/b", True),
        ("a/x/y/b", "a/**/**/b", True),
        (".hidden", "*", True),
        ("report.xlsx", "report.xlsx", True),
        ("data-7.csv", "data-[0-9].csv", True),
        ("data-x.csv", "data-[0-9].csv", False),
    ],
)
def test_what_a_pattern_matches(path, pattern, matches):
    assert pattern_matches(path, pattern) is matches


def test_collect_brings_back_matches_byte_exact_and_says_what_it_left_out(places):
    workspace, outside = places
    png = bytes(range(256)) * 4
    (workspace / "out/sub").mkdir(parents=True)
    (workspace / "out/chart.png").write_bytes(png)
    (workspace / "out/sub/deep.png").write_bytes(b"deep")
    (workspace / "out/grant").symlink_to(outside)
    (workspace / "out/secret.png").symlink_to(outside / "secret")
    os.mkfifo(workspace / "out/pipe.png")
    files, left_out, header = collected(workspace, ["**/*.png", "out/chart.png", "missing.xlsx", "out/grant/secret", "out"])
    assert files == {"out/chart.png": png, "out/sub/deep.png": b"deep"}  # matched twice, taken once
    assert sorted(left_out) == [
        ("missing.xlsx", "unreadable"),
        ("out", "not_file"),
        ("out/grant/secret", "link"),
        ("out/pipe.png", "not_file"),
        ("out/secret.png", "link"),
    ]
    assert header["left_out_more"] == 0 and header["walk_cut"] is False


def test_collect_stops_at_the_jobs_files_and_bytes_and_bounds_what_it_lists(places):
    workspace, _ = places
    for index in range(6):
        (workspace / f"f{index}").write_bytes(b"x" * 10)
    files, left_out, header = collected(workspace, ["f*"], max_files=2, max_bytes=1000, max_left_out=3)
    assert list(files) == ["f0", "f1"] and left_out == [("f2", "count"), ("f3", "count"), ("f4", "count")]
    assert header["left_out_more"] == 1 and header["left_out"][0]["size"] == 10
    files, left_out, _ = collected(workspace, ["f*"], max_bytes=25)
    assert list(files) == ["f0", "f1"] and left_out[0] == ("f2", "size")


def test_a_file_that_grows_while_it_is_read_is_changed(places):
    workspace, _ = places
    (workspace / "growing").write_bytes(b"12345")
    for looked_at, read in ((4, None), (6, None), (5, b"12345")):  # grew, shrank, as it was
        fd = os.open(workspace / "growing", os.O_RDONLY)
        try:
            assert read_regular(fd, looked_at) == read
        finally:
            os.close(fd)


def test_collect_walks_no_further_than_its_bound(places, monkeypatch):
    workspace, _ = places
    for index in range(20):
        (workspace / f"f{index:02}").write_bytes(b"x")
    monkeypatch.setattr(_collect, "MAX_WALK_ENTRIES", 5)
    files, _, header = collected(workspace, ["*"])
    assert len(files) <= 5 and header["walk_cut"] is True


def test_collect_in_a_workspace_that_is_gone_leaves_exact_paths_out(tmp_path):
    files, left_out, _ = collected(tmp_path / "gone", ["report.xlsx", "*.png"])
    assert files == {} and left_out == [("report.xlsx", "unreadable")]
