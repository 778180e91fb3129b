"""What ``report_files`` lists (``_grant_fs.ListedGrants``, ``written.py``): new or changed regular
files, links never followed, the walk bounded, and a grant moved or replaced while held reported
changed, never followed. Real directories and files; no sandbox needed for the walk itself."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from readie_protocol.events import FileInfo
from readie_worker import _grant_fs
from readie_worker._grant_fs import ListedGrants, Listing, PathIdentity, open_no_follow
from readie_worker.written import written_since


def granted(*paths: Path) -> tuple[PathIdentity, ...]:
    """What a sandbox records of its write grants when it is made (``HeldGrants.write_grants``)."""
    identities = []
    for path in paths:
        opened = open_no_follow(str(path))
        os.close(opened.fd)
        identities.append(opened.identity)
    return tuple(identities)


@contextmanager
def held(*paths: Path) -> Iterator[ListedGrants]:
    with ListedGrants(granted(*paths)) as grants:
        yield grants


def listing(*paths: Path) -> Listing:
    with held(*paths) as grants:
        return grants.listing()


def test_new_and_changed_files_are_listed_and_untouched_ones_are_not(tmp_path):
    (tmp_path / "kept.txt").write_text("same")
    (tmp_path / "edited.txt").write_text("old")
    with held(tmp_path) as grants:
        before = grants.listing()
        (tmp_path / "edited.txt").write_text("newer text")
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / "new.csv").write_text("a,b\n")
        files, truncated = written_since(before, grants.listing())
    assert files == (FileInfo(str(tmp_path / "edited.txt"), 10), FileInfo(str(tmp_path / "sub" / "new.csv"), 4))
    assert truncated is False


def test_a_single_file_grant_is_listed_when_it_changed(tmp_path):
    (tmp_path / "one.csv").write_text("a")
    (tmp_path / "other.csv").write_text("b")
    with held(tmp_path / "one.csv", tmp_path / "other.csv") as grants:
        before = grants.listing()
        (tmp_path / "one.csv").write_text("a,b")
        files, truncated = written_since(before, grants.listing())
    assert (files, truncated) == ((FileInfo(str(tmp_path / "one.csv"), 3),), False)


def test_links_are_never_followed_nor_listed(tmp_path):
    grant, outside = tmp_path / "grant", tmp_path / "outside"
    grant.mkdir()
    outside.mkdir()
    (outside / "secret").write_text("host data")
    with held(grant) as grants:
        before = grants.listing()
        (grant / "to-outside").symlink_to(outside)
        (grant / "to-secret").symlink_to(outside / "secret")
        files, _ = written_since(before, grants.listing())
    assert files == ()


def test_an_ancestor_swapped_for_a_link_to_root_is_reported_changed_and_etc_is_not_listed(tmp_path):
    """Hole 1 of issue 27: job B writes ``out/b/etc``; job A, with a grant on ``out``, renames
    ``out/b`` away and makes it a link to ``/``. The path now leads to the host's ``/etc``."""
    grant = tmp_path / "out" / "b" / "etc"
    grant.mkdir(parents=True)
    with held(grant) as grants:
        before = grants.listing()
        (grant / "mine.txt").write_text("B's own")
        (tmp_path / "out" / "b").rename(tmp_path / "out" / "b-away")
        (tmp_path / "out" / "b").symlink_to("/")
        after = grants.listing()
    assert after.changed == (str(grant),)
    assert after.files == {}, "nothing of a changed grant is listed, the held directory's files included"
    files, truncated = written_since(before, after)
    assert (files, truncated) == ((), True)


def test_a_grant_replaced_by_another_directory_is_changed_held_or_not(tmp_path):
    grant = tmp_path / "grant"
    grant.mkdir()
    identities = granted(grant)
    grant.rename(tmp_path / "away")  # kept alive: its inode is not reused below
    grant.mkdir()
    (grant / "planted").write_text("not the job's")
    with ListedGrants(identities) as grants:  # a session step after its sandbox was made
        assert grants.listing() == Listing({}, True, (str(grant),))
    grant.rename(tmp_path / "planted")
    (tmp_path / "away").rename(grant)  # the very directory, back at its path: held again
    with ListedGrants(identities) as grants:
        assert grants.listing() == Listing({}, True, ())


def test_a_grant_gone_is_changed_and_nothing_raises(tmp_path):
    grant = tmp_path / "grant"
    grant.mkdir()
    identities = granted(grant)
    grant.rmdir()
    with ListedGrants(identities) as grants:
        assert grants.listing() == Listing({}, True, (str(grant),))


def test_a_tree_past_the_walks_bounds_is_reported_truncated(tmp_path, monkeypatch):
    monkeypatch.setattr(_grant_fs, "MAX_SCANNED_ENTRIES", 10)
    with held(tmp_path) as grants:
        before = grants.listing()
        for n in range(30):
            (tmp_path / f"f{n}").write_text("x")
        files, truncated = written_since(before, grants.listing())
    assert truncated is True and len(files) <= 10

    monkeypatch.setattr(_grant_fs, "MAX_SCAN_DEPTH", 3)
    deep = tmp_path / "d"
    path = deep
    for n in range(6):
        path = path / str(n)
    path.mkdir(parents=True)
    assert listing(deep).complete is False


def test_the_list_is_cut_at_its_bound(tmp_path, monkeypatch):
    from readie_worker import written

    monkeypatch.setattr(written, "MAX_LISTED_FILES", 5)
    with held(tmp_path) as grants:
        before = grants.listing()
        for n in range(8):
            (tmp_path / f"f{n}").write_text("x")
        files, truncated = written_since(before, grants.listing())
    assert len(files) == 5 and truncated is True


def test_a_name_that_is_not_utf8_is_shown_with_replacement_characters(tmp_path):
    with held(tmp_path) as grants:
        before = grants.listing()
        with open(os.path.join(os.fsencode(tmp_path), b"bad\xffname"), "w") as out:
            out.write("x")
        files, _ = written_since(before, grants.listing())
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
        assert _grant_fs._enter(parent, "d", seen, seen.st_dev) is None
        (grant / "d").unlink()
        (grant / "other").mkdir()
        (grant / "other").rename(grant / "d")  # another directory under the name: not the one listed
        assert _grant_fs._enter(parent, "d", seen, seen.st_dev) is None
    finally:
        os.close(parent)


def test_a_write_whose_modification_time_was_set_back_is_still_listed(tmp_path):
    target = tmp_path / "data.bin"
    target.write_bytes(b"12345678")
    with held(tmp_path) as grants:
        before = grants.listing()
        info = target.stat()
        with open(target, "r+b") as out:
            out.write(b"87654321")  # same size, in place
        os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))
        files, _ = written_since(before, grants.listing())
    assert [file.path for file in files] == [str(target)]


def test_long_names_and_slow_walks_stop_at_their_bounds(tmp_path, monkeypatch):
    for n in range(20):
        (tmp_path / (f"{n:02d}" + "x" * 200)).write_text("x")
    monkeypatch.setattr(_grant_fs, "MAX_NAME_BYTES", 1000)
    assert listing(tmp_path).complete is False
    monkeypatch.setattr(_grant_fs, "MAX_NAME_BYTES", 10**6)
    monkeypatch.setattr(_grant_fs, "MAX_SCAN_SECONDS", -1.0)
    assert listing(tmp_path).complete is False
