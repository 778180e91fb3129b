"""What ``report_files`` lists (written.py): new or changed regular files, links never followed,
the walk bounded. Real directories and files; no sandbox needed for the walk itself."""

from __future__ import annotations

import os

from readie_protocol.events import FileInfo
from readie_worker import written
from readie_worker.written import snapshot, written_since


def test_new_and_changed_files_are_listed_and_untouched_ones_are_not(tmp_path):
    (tmp_path / "kept.txt").write_text("same")
    (tmp_path / "edited.txt").write_text("old")
    before = snapshot([str(tmp_path)])
    (tmp_path / "edited.txt").write_text("newer text")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "new.csv").write_text("a,b\n")
    files, truncated = written_since(before, snapshot([str(tmp_path)]))
    assert files == (FileInfo(str(tmp_path / "edited.txt"), 10), FileInfo(str(tmp_path / "sub" / "new.csv"), 4))
    assert truncated is False


def test_links_are_never_followed_nor_listed(tmp_path):
    grant, outside = tmp_path / "grant", tmp_path / "outside"
    grant.mkdir()
    outside.mkdir()
    (outside / "secret").write_text("host data")
    before = snapshot([str(grant)])
    (grant / "to-outside").symlink_to(outside)
    (grant / "to-secret").symlink_to(outside / "secret")
    files, _ = written_since(before, snapshot([str(grant)]))
    assert files == ()


def test_a_tree_past_the_walks_bounds_is_reported_truncated(tmp_path, monkeypatch):
    monkeypatch.setattr(written, "MAX_SCANNED_ENTRIES", 10)
    before = snapshot([str(tmp_path)])
    for n in range(30):
        (tmp_path / f"f{n}").write_text("x")
    files, truncated = written_since(before, snapshot([str(tmp_path)]))
    assert truncated is True and len(files) <= 10

    monkeypatch.setattr(written, "MAX_SCAN_DEPTH", 3)
    deep = tmp_path / "d"
    path = deep
    for n in range(6):
        path = path / str(n)
    path.mkdir(parents=True)
    assert snapshot([str(deep)]).complete is False


def test_the_list_is_cut_at_its_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(written, "MAX_LISTED_FILES", 5)
    before = snapshot([str(tmp_path)])
    for n in range(8):
        (tmp_path / f"f{n}").write_text("x")
    files, truncated = written_since(before, snapshot([str(tmp_path)]))
    assert len(files) == 5 and truncated is True


def test_a_name_that_is_not_utf8_is_shown_with_replacement_characters(tmp_path):
    before = snapshot([str(tmp_path)])
    with open(os.path.join(os.fsencode(tmp_path), b"bad\xffname"), "w") as out:
        out.write("x")
    files, _ = written_since(before, snapshot([str(tmp_path)]))
    assert [file.path for file in files] == [str(tmp_path / "bad\ufffdname")]
    files[0].path.encode("utf-8")  # a result line can carry it


def test_a_directory_swapped_for_a_link_after_it_was_listed_is_not_entered(tmp_path):
    """The race an attacker's read won against a path-based walk: listed as a directory, then
    replaced by a link to /etc before the walk went in. Entering goes by descriptor, O_NOFOLLOW."""
    grant = tmp_path / "grant"
    (grant / "d").mkdir(parents=True)
    parent = os.open(grant, os.O_RDONLY | os.O_DIRECTORY)
    try:
        seen = os.stat(grant / "d", follow_symlinks=False)
        (grant / "d").rename(tmp_path / "kept")  # kept alive: its inode is not reused below
        (grant / "d").symlink_to("/etc")
        assert written._enter(parent, "d", seen, seen.st_dev) is None
        (grant / "d").unlink()
        (grant / "other").mkdir()
        (grant / "other").rename(grant / "d")  # another directory under the name: not the one listed
        assert written._enter(parent, "d", seen, seen.st_dev) is None
    finally:
        os.close(parent)


def test_a_write_whose_modification_time_was_set_back_is_still_listed(tmp_path):
    target = tmp_path / "data.bin"
    target.write_bytes(b"12345678")
    before = snapshot([str(tmp_path)])
    info = target.stat()
    with open(target, "r+b") as out:
        out.write(b"87654321")  # same size, in place
    os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))
    files, _ = written_since(before, snapshot([str(tmp_path)]))
    assert [file.path for file in files] == [str(target)]


def test_long_names_and_slow_walks_stop_at_their_bounds(tmp_path, monkeypatch):
    for n in range(20):
        (tmp_path / (f"{n:02d}" + "x" * 200)).write_text("x")
    monkeypatch.setattr(written, "MAX_NAME_BYTES", 1000)
    assert snapshot([str(tmp_path)]).complete is False
    monkeypatch.setattr(written, "MAX_NAME_BYTES", 10**6)
    monkeypatch.setattr(written, "MAX_SCAN_SECONDS", -1.0)
    assert snapshot([str(tmp_path)]).complete is False
