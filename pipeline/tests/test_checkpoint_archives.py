"""Checkpoint archives as hostile input: each bad archive is refused with its typed error and installs nothing.

The archives are built here with tarfile and json directly, not with the
exporter, so the reader is tested against bytes it did not write.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from readie_pipeline import archive_format
from readie_pipeline.archive_format import (
    ArchiveError,
    ArchiveFormatError,
    ArchiveTooLarge,
    DigestMismatch,
    HostMismatch,
    ArchiveMember,
    MissingMember,
    UnlistedMember,
    UnsafeMember,
    parse_digest,
)
from readie_pipeline.archive_tree import TreeWriter
from readie_pipeline.checkpoint_import import import_checkpoints
from readie_worker.bundle import MountPlan, family_fingerprint
from readie_executor.framing import PROTOCOL_VERSION
from readie_worker.manifest import Manifest, load_checkpoints, platform_of, write_manifest

FINGERPRINT = "sha256:" + "5e" * 32
FLAGS = ["--platform=systrap", "--network=none", "--overlay2=root:memory"]
CAPTURED_ROOTFS = "/build-host/cache/rootfs/5e5e5e5e5e5e5e5e/rootfs"
HOST = {
    "executor_protocol": PROTOCOL_VERSION,
    "executor_digest": None,
    "runsc_version": "runsc version test",
    "runsc_flags": FLAGS,
    "rootfs": CAPTURED_ROOTFS,
    "rootfs_fingerprint": FINGERPRINT,
    "spec_fingerprint": family_fingerprint(Path(CAPTURED_ROOTFS), MountPlan(), FLAGS),
}
MANIFEST = json.dumps({
    **HOST, "python": "3.11.2", "executor_argv": ["/usr/bin/python3"], "mount_plan": MountPlan().to_json(),
    "created_at": "2026-12-01T00:00:00+00:00", "checkpoints": [],
}).encode()
HELLO = b"hello from the rootfs\n"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def entry(path: str, kind: str = "dir", data: bytes = b"", target: str | None = None) -> dict:
    out: dict = {"path": path, "type": kind, "mode": 0o755, "mtime_ns": 1_700_000_000_123_456_789}
    if kind == "file":
        out.update(size=len(data), sha256=sha(data))
    if kind == "symlink":
        out["target"] = target
    return out


def good_listing() -> list[dict]:
    return [
        entry("set"), entry("set/manifest.json", "file", MANIFEST),
        entry("rootfs"), entry("rootfs/usr"), entry("rootfs/bin", "symlink", target="usr/bin"),
        entry("rootfs/usr/hello", "file", HELLO),
    ]


def tar_member(name: str, kind: bytes = tarfile.DIRTYPE, data: bytes = b"", target: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname, info.mode = kind, len(data), target, 0o755
    return info, data


def good_members() -> list[tuple[tarfile.TarInfo, bytes]]:
    return [
        tar_member("set"), tar_member("set/manifest.json", tarfile.REGTYPE, MANIFEST),
        tar_member("rootfs"), tar_member("rootfs/usr"), tar_member("rootfs/bin", tarfile.SYMTYPE, target="usr/bin"),
        tar_member("rootfs/usr/hello", tarfile.REGTYPE, HELLO),
    ]


def write_archive(path: Path, listing: list[dict], members: list[tuple[tarfile.TarInfo, bytes]], **digest: object) -> Path:
    raw = {"format": "readie-checkpoints", "format_version": 1, "created_at": "", "host": HOST, "members": listing, **digest}
    data = json.dumps(raw).encode()
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        first = tarfile.TarInfo("readie-checkpoints.json")
        first.size = len(data)
        tar.addfile(first, io.BytesIO(data))
        for info, content in members:
            tar.addfile(info, io.BytesIO(content) if info.type in (tarfile.REGTYPE, tarfile.AREGTYPE) else None)
    return path


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def refused(tmp_path: Path, cache: Path, listing, members, error: type[Exception], match: str, **digest) -> None:
    archive = write_archive(tmp_path / "hostile.tar", listing, members, **digest)
    with pytest.raises(error, match=match):
        import_checkpoints(archive, cache, check_host=False)
    assert os.listdir(cache) == [], "a refused archive left something in the cache"


def test_a_good_archive_installs_and_names_this_caches_rootfs(tmp_path, cache):
    archive = write_archive(tmp_path / "good.tar", good_listing(), good_members())
    imported = import_checkpoints(archive, cache, check_host=False)
    # Named by its content, never by the fingerprint it claims: a capture here builds its own.
    (layer,) = (cache / "rootfs").iterdir()
    assert layer.name.startswith("imported-") and "5e5e5e5e" not in layer.name
    rootfs = layer / "rootfs"
    assert imported.rootfs == rootfs.resolve() and not imported.rootfs_reused
    assert (rootfs / "usr" / "hello").read_bytes() == HELLO
    assert os.readlink(rootfs / "bin") == "usr/bin"
    assert (rootfs / "usr" / "hello").stat().st_mtime_ns == 1_700_000_000_123_456_789  # exact, from the digest
    manifest = json.loads((cache / "checkpoints" / "manifest.json").read_text())
    assert manifest["rootfs"] == str(rootfs.resolve())
    assert manifest["spec_fingerprint"] == family_fingerprint(rootfs.resolve(), MountPlan(), FLAGS)
    assert os.path.realpath(cache / "checkpoints") == str(imported.set_dir)
    assert sorted(os.listdir(cache)) == ["checkpoints", "rootfs", "sets"]  # no staging left behind


def test_a_symlink_then_a_member_through_it_is_refused_by_the_listing(tmp_path, cache):
    listing = [*good_listing(), entry("rootfs/evil", "symlink", target="/etc"), entry("rootfs/evil/passwd", "file", b"x")]
    members = [*good_members(), tar_member("rootfs/evil", tarfile.SYMTYPE, target="/etc"),
               tar_member("rootfs/evil/passwd", tarfile.REGTYPE, b"x")]
    refused(tmp_path, cache, listing, members, UnsafeMember, "parent is not a directory")


def test_a_member_through_a_symlink_not_in_the_listing_is_refused(tmp_path, cache):
    listing = [*good_listing(), entry("rootfs/evil", "symlink", target=str(tmp_path))]
    members = [*good_members(), tar_member("rootfs/evil", tarfile.SYMTYPE, target=str(tmp_path)),
               tar_member("rootfs/evil/planted", tarfile.REGTYPE, b"x")]
    refused(tmp_path, cache, listing, members, UnlistedMember, "not in the digest manifest")
    assert not (tmp_path / "planted").exists()


def test_the_writer_never_writes_through_a_symlink(tmp_path):
    # The last line of defence, below the listing's rules: descriptors opened O_NOFOLLOW.
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    with TreeWriter(root) as writer:
        writer.symlink(ArchiveMember("rootfs", "symlink", target=str(outside)))
        with pytest.raises(UnsafeMember, match="is a symlink or not a directory"):
            writer.write_file(ArchiveMember("rootfs/passwd", "file", 0o644, 0, 1, sha(b"x")), io.BytesIO(b"x").read)
        with pytest.raises(UnsafeMember):
            writer.mkdir(ArchiveMember("rootfs/sub", "dir"))
    assert os.listdir(outside) == []


@pytest.mark.parametrize("name", ["rootfs/../../escaped", "rootfs/./x", "rootfs//x", "elsewhere/x"])
def test_an_abnormal_or_foreign_name_is_refused(tmp_path, cache, name):
    refused(tmp_path, cache, good_listing(), [*good_members(), tar_member(name, tarfile.REGTYPE, b"x")], UnsafeMember, "member")


def test_an_absolute_name_is_refused(tmp_path, cache):
    refused(tmp_path, cache, good_listing(), [*good_members(), tar_member("/tmp/escaped", tarfile.REGTYPE, b"x")],
            UnsafeMember, "absolute name")
    assert not Path("/tmp/escaped").exists()


def test_dot_dot_in_the_listing_is_refused_before_anything_is_read(tmp_path, cache):
    refused(tmp_path, cache, [*good_listing(), entry("rootfs/../x", "file", b"x")], good_members(), UnsafeMember, "normal relative")


@pytest.mark.parametrize(
    ("kind", "what"),
    [(tarfile.CHRTYPE, "character device"), (tarfile.BLKTYPE, "block device"), (tarfile.FIFOTYPE, "fifo"), (tarfile.LNKTYPE, "hard link")],
)
def test_special_members_are_refused(tmp_path, cache, kind, what):
    info, _ = tar_member("rootfs/usr/special", kind, target="rootfs/usr/hello")
    info.devmajor, info.devminor = 1, 3  # /dev/null
    refused(tmp_path, cache, good_listing(), [*good_members(), (info, b"")], UnsafeMember, what)


def test_an_unlisted_member_is_refused(tmp_path, cache):
    refused(tmp_path, cache, good_listing(), [*good_members(), tar_member("rootfs/usr/extra", tarfile.REGTYPE, b"x")],
            UnlistedMember, "not in the digest manifest")


def test_a_member_twice_is_refused(tmp_path, cache):
    refused(tmp_path, cache, good_listing(), [*good_members(), tar_member("rootfs/usr/hello", tarfile.REGTYPE, HELLO)],
            UnlistedMember, "appears twice")


def test_a_listed_member_missing_from_the_tar_is_refused(tmp_path, cache):
    refused(tmp_path, cache, good_listing(), good_members()[:-1], MissingMember, "lacks 1 listed member")


def test_a_changed_byte_is_refused(tmp_path, cache):
    members = good_members()
    members[-1] = tar_member("rootfs/usr/hello", tarfile.REGTYPE, HELLO.replace(b"h", b"j", 1))
    refused(tmp_path, cache, good_listing(), members, DigestMismatch, "corrupt: sha256")


def test_a_file_of_another_size_is_refused(tmp_path, cache):
    members = good_members()
    members[-1] = tar_member("rootfs/usr/hello", tarfile.REGTYPE, HELLO + b"more")
    refused(tmp_path, cache, good_listing(), members, DigestMismatch, "bytes in the tar")


def test_a_symlink_pointing_elsewhere_than_listed_is_refused(tmp_path, cache):
    members = good_members()
    members[4] = tar_member("rootfs/bin", tarfile.SYMTYPE, target="/etc")
    refused(tmp_path, cache, good_listing(), members, DigestMismatch, "points at '/etc'")


def test_symlinks_are_refused_in_the_set(tmp_path, cache):
    listing = [*good_listing(), entry("set/base", "symlink", target="/etc")]
    refused(tmp_path, cache, listing, good_members(), UnsafeMember, "only in the rootfs")


def test_a_manifest_naming_an_image_outside_the_set_is_refused(tmp_path, cache):
    manifest = json.loads(MANIFEST)
    manifest["checkpoints"] = [{"name": "base", "image_path": "/etc"}]
    data = json.dumps(manifest).encode()
    listing, members = good_listing(), good_members()
    listing[1], members[1] = entry("set/manifest.json", "file", data), tar_member("set/manifest.json", tarfile.REGTYPE, data)
    refused(tmp_path, cache, listing, members, UnsafeMember, "image outside the set")


def test_total_bytes_over_the_limit_are_refused_from_the_listing(tmp_path, cache):
    listing = [*good_listing(), {**entry("rootfs/big", "file", b""), "size": archive_format.MAX_TOTAL_BYTES + 1}]
    refused(tmp_path, cache, listing, good_members(), ArchiveTooLarge, "over the limit")


def test_more_members_than_the_limit_are_refused(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(archive_format, "MAX_MEMBERS", 5)
    refused(tmp_path, cache, good_listing(), good_members(), ArchiveTooLarge, "lists 6 members, over the limit of 5")


def test_a_name_over_the_limit_is_refused(tmp_path, cache):
    long = "rootfs/" + "/".join(["d" * 200] * 6)
    refused(tmp_path, cache, [*good_listing(), entry(long, "file", b"")], good_members(), ArchiveTooLarge, "over the limit of 1024")


@pytest.mark.parametrize(
    ("kind", "size", "error", "match"),
    [
        # A long name claiming 100 MB: tarfile would allocate it whole.
        (tarfile.GNUTYPE_LONGNAME, 100 * 1024 * 1024, ArchiveTooLarge, "long-name header"),
        (tarfile.GNUTYPE_LONGNAME, 64 * 1024, ArchiveTooLarge, "long-name header"),
        # Any pax header: tarfile parses its records with a quadratic regex (CVE-2024-6232)
        # and copies a global one into every later member (the attacker read's H1, H2).
        (tarfile.XHDTYPE, 64 * 1024, ArchiveFormatError, "pax headers"),
        (tarfile.XGLTYPE, 100, ArchiveFormatError, "pax headers"),
        (tarfile.GNUTYPE_SPARSE, 0, ArchiveFormatError, "sparse"),
    ],
)
def test_a_costly_tar_header_is_refused_before_it_is_parsed(tmp_path, cache, kind, size, error, match):
    header = tarfile.TarInfo("././@LongLink")
    header.type, header.size = kind, size
    block = header.tobuf(format=tarfile.USTAR_FORMAT)
    (tmp_path / "costly.tar").write_bytes(block + b"1" * min(size, 70_000) + b"\0" * 4096)
    started = time.monotonic()
    with pytest.raises(error, match=match):
        import_checkpoints(tmp_path / "costly.tar", cache, check_host=False)
    assert time.monotonic() - started < 2  # a 64 KiB pax record took tarfile 25 s
    assert os.listdir(cache) == []


@pytest.mark.parametrize("name", ["rootfs/a\nb", "rootfs/\x1b[31mred", "rootfs/del\x7f"])
def test_a_control_character_in_a_name_is_refused(tmp_path, cache, name):
    listing = [*good_listing(), entry(name, "file", b"x")]
    refused(tmp_path, cache, listing, [*good_members(), tar_member(name, tarfile.REGTYPE, b"x")], UnsafeMember, "control character")


def test_a_rootfs_changed_where_a_listing_does_not_look_is_not_reused(tmp_path, cache):
    archive = write_archive(tmp_path / "good.tar", good_listing(), good_members())
    first = import_checkpoints(archive, cache, check_host=False)
    os.chmod(first.rootfs / "usr" / "hello", 0o4755)  # setuid: the listing masks modes with 0755
    with pytest.raises(ArchiveError, match="changed since it was imported.*mode"):
        import_checkpoints(archive, cache, check_host=False)
    os.chmod(first.rootfs / "usr" / "hello", 0o755)
    os.link(first.rootfs / "usr" / "hello", tmp_path / "outside")
    with pytest.raises(ArchiveError, match="2 links"):
        import_checkpoints(archive, cache, check_host=False)


def test_a_mount_plan_past_its_bound_is_refused(tmp_path):
    with pytest.raises(ValueError, match="integer from 0 to"):
        MountPlan.from_json({"read": 10**8, "write": 4, "packages": 2})
    with pytest.raises(ValueError):
        MountPlan.from_json({"read": True, "write": "4", "packages": 2})
    assert MountPlan.from_json({"read": 4, "write": 4, "packages": 2}) == MountPlan()


def test_not_a_tar_and_not_our_format_are_refused(tmp_path, cache):
    (tmp_path / "junk.tar").write_bytes(os.urandom(4096))
    with pytest.raises(ArchiveFormatError):
        import_checkpoints(tmp_path / "junk.tar", cache, check_host=False)
    with tarfile.open(tmp_path / "other.tar", "w") as tar:
        info = tarfile.TarInfo("README")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(ArchiveFormatError, match="first member is 'README'"):
        import_checkpoints(tmp_path / "other.tar", cache, check_host=False)
    refused(tmp_path, cache, good_listing(), good_members(), ArchiveFormatError, "format version 99", format_version=99)


def test_an_archive_that_is_not_a_regular_file_is_refused_before_it_is_opened_for_reading(tmp_path, cache):
    """A FIFO once blocked `readie checkpoints import` in open() for ever, waiting for a writer."""
    import subprocess

    from readie_worker.testing import readie_command

    fifo = tmp_path / "set.tar"
    os.mkfifo(fifo)
    started = time.monotonic()
    done = subprocess.run(
        [*readie_command(), "checkpoints", "import", str(fifo), "--into", str(cache)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 1 and time.monotonic() - started < 30
    assert f"{fifo}: not a regular file (a FIFO)" in done.stderr and "Traceback" not in done.stderr
    assert os.listdir(cache) == []
    with pytest.raises(ArchiveFormatError, match=r"not a regular file \(a directory\)"):
        import_checkpoints(tmp_path, cache, check_host=False)


def test_parse_digest_refuses_malformed_entries():
    good = {"format": "readie-checkpoints", "format_version": 1, "host": HOST, "members": good_listing()}
    assert len(parse_digest(json.dumps(good).encode()).members) == 6
    for bad in ({"path": "rootfs/x", "type": "file", "size": -1, "sha256": sha(b"")},
                {"path": "rootfs/x", "type": "file", "size": 0, "sha256": "md5:00"},
                {"path": "rootfs/x", "type": "socket"},
                {"path": 7, "type": "dir"}):
        with pytest.raises((ArchiveFormatError, UnsafeMember)):
            parse_digest(json.dumps({**good, "members": [*good_listing(), bad]}).encode())
    with pytest.raises(UnlistedMember, match="twice"):
        parse_digest(json.dumps({**good, "members": [*good_listing(), entry("rootfs/usr")]}).encode())


def test_setuid_and_group_write_bits_are_dropped_on_install(tmp_path, cache):
    listing, members = good_listing(), good_members()
    listing[-1]["mode"] = 0o6777
    archive = write_archive(tmp_path / "modes.tar", listing, members)
    imported = import_checkpoints(archive, cache, check_host=False)
    assert (imported.rootfs / "usr" / "hello").stat().st_mode & 0o7777 == 0o755


def test_platform_is_read_from_either_flag_spelling():
    assert platform_of(["--network=none", "--platform=ptrace"]) == "ptrace"
    assert platform_of(["-platform=systrap"]) == "systrap"
    assert platform_of(["--network=none"]) is None


def test_the_worker_names_a_platform_mismatch_even_when_the_fingerprint_matches(tmp_path):
    # The platform is in no fingerprint: before this rule a ptrace set loaded on a systrap host.
    ptrace = ("--platform=ptrace", "--network=none", "--overlay2=root:memory")
    systrap = ("--platform=systrap", *ptrace[1:])
    fingerprint = family_fingerprint(tmp_path / "rootfs", MountPlan(), ptrace)
    assert fingerprint == family_fingerprint(tmp_path / "rootfs", MountPlan(), systrap)
    manifest = Manifest(
        executor_protocol=PROTOCOL_VERSION, runsc_version="runsc version test", runsc_flags=ptrace, spec_fingerprint=fingerprint,
        rootfs=tmp_path / "rootfs", rootfs_fingerprint=FINGERPRINT, python="3.11.2", executor_argv=("/usr/bin/python3",),
        mount_plan=MountPlan(), created_at="", checkpoints={},
    )
    write_manifest(manifest, tmp_path / "manifest.json")
    load = lambda flags: load_checkpoints(  # noqa: E731
        tmp_path / "manifest.json", runsc_version="runsc version test", spec_fingerprint=fingerprint, runsc_flags=flags
    )
    assert "captured with platform ptrace, this host runs systrap" in load(systrap).problems["*"]
    assert load(ptrace).problems == {}


def test_a_truncated_archive_is_refused(tmp_path, cache):
    archive = write_archive(tmp_path / "cut.tar", good_listing(), good_members())
    data = archive.read_bytes()
    end = data.rindex(HELLO) + 5  # inside the last member's data
    archive.write_bytes(data[:end])
    with pytest.raises((ArchiveFormatError, DigestMismatch, MissingMember)):
        import_checkpoints(archive, cache, check_host=False)
    assert os.listdir(cache) == []


def test_the_same_archive_twice_reuses_the_rootfs_and_refuses_a_changed_one(tmp_path, cache):
    archive = write_archive(tmp_path / "good.tar", good_listing(), good_members())
    first = import_checkpoints(archive, cache, check_host=False)
    second = import_checkpoints(archive, cache, check_host=False)
    assert second.rootfs_reused and second.set_dir == first.set_dir
    (first.rootfs / "usr" / "hello").write_bytes(b"changed on this host\n")
    with pytest.raises(ArchiveError, match="changed since it was imported"):
        import_checkpoints(archive, cache, check_host=False)


def test_a_set_for_another_runsc_is_refused_before_anything_is_written(tmp_path, cache):
    # The digest's facts say "runsc version test": no host runs that (and one without runsc cannot run any).
    archive = write_archive(tmp_path / "good.tar", good_listing(), good_members())
    with pytest.raises(HostMismatch, match="this host cannot restore the set: .*runsc"):
        import_checkpoints(archive, cache)
    assert os.listdir(cache) == []
