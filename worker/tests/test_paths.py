"""Host paths opened without following symlinks, grants held, and removal that cannot be misled.

Real files, real mounts (in the test process's own mount namespace, which
conftest enters), no runsc: these are the pieces the gVisor tests build on.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path, PurePosixPath

import pytest

from readie_worker import _grant_fs, _mounts
from readie_worker._sandbox_dir import SandboxDir
from readie_worker.bundle import GRANT_POINT, MountPlan
from readie_worker.errors import RequestError, SandboxSetupError
from readie_worker.grants import hold_grants
from readie_worker.paths import PathKind, PathRefused, check_normal, open_no_follow, read_no_follow, remove_tree

# Mounts need root, as the worker does; CI runs as root and never skips these.
pytestmark = pytest.mark.runsc


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    (tmp_path / "dir" / "file.txt").write_text("inside")
    (tmp_path / "loose.txt").write_text("loose")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("s3cr3t")
    (tmp_path / "dir" / "link").symlink_to(tmp_path / "outside")
    (tmp_path / "dir" / "file-link").symlink_to(tmp_path / "outside" / "secret")
    (tmp_path / "alias").symlink_to(tmp_path / "dir")
    return tmp_path


# --------------------------------------------------------------------------- open_no_follow


@pytest.fixture(params=["openat2", "by components"])
def opener(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each opening test twice: with openat2, and as on a kernel without it (a syscall number
    this kernel has not: ENOSYS, as from a kernel before 5.6), one component at a time."""
    if request.param == "by components":
        monkeypatch.setattr(_grant_fs, "_SYS_OPENAT2", 100_000)
    return request.param


def test_a_directory_and_a_file_open(tree: Path, opener: str) -> None:
    opened = open_no_follow(str(tree / "dir"))
    try:
        assert opened.kind is PathKind.DIRECTORY
        assert sorted(os.listdir(f"/proc/self/fd/{opened.fd}")) == ["file-link", "file.txt", "link", "sub"]
    finally:
        os.close(opened.fd)
    opened = open_no_follow(str(tree / "dir" / "file.txt"))
    os.close(opened.fd)
    assert opened.kind is PathKind.FILE


@pytest.mark.parametrize("relative", ["dir/link", "dir/link/secret", "dir/file-link", "alias", "alias/sub"])
def test_a_symlink_anywhere_is_refused(tree: Path, relative: str, opener: str) -> None:
    with pytest.raises(PathRefused) as refused:
        open_no_follow(str(tree / relative))
    assert refused.value.reason.startswith("passes through a symbolic link")
    assert "outside" not in refused.value.reason and "secret" not in refused.value.reason


def test_proc_magic_links_are_refused(tree: Path, opener: str) -> None:
    with open(tree / "outside" / "secret") as held:
        with pytest.raises(PathRefused, match="symbolic link"):
            open_no_follow(f"/proc/self/fd/{held.fileno()}")


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("relative/path", "is not an absolute path"),
        ("/tmp/../etc", "is not a normal path"),
        ("/tmp/./x", "is not a normal path"),
        ("/tmp//x", "is not a normal path"),
        ("/tmp/x/", "is not a normal path"),
        ("/tmp/\0x", "contains a NUL byte"),
        ("/" + "a" * 5000, "is longer than 4096 bytes"),
    ],
)
def test_only_absolute_normal_paths(path: str, reason: str) -> None:
    with pytest.raises(PathRefused, match=reason.replace(".", r"\.")):
        check_normal(path)
    with pytest.raises(PathRefused):
        open_no_follow(path)


def test_what_is_neither_directory_nor_file_is_refused_before_it_is_opened(tmp_path: Path, opener: str) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for reading would block: O_PATH does not
    with pytest.raises(PathRefused, match="neither a directory nor a regular file"):
        open_no_follow(str(fifo))
    with pytest.raises(PathRefused, match="neither"):
        open_no_follow("/dev/zero")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "sock"))
    with pytest.raises(PathRefused, match="neither"):
        open_no_follow(str(tmp_path / "sock"))
    listener.close()
    with pytest.raises(PathRefused, match="does not exist"):
        open_no_follow(str(tmp_path / "missing"))
    with pytest.raises(PathRefused, match="not a directory"):
        open_no_follow(str(tmp_path / "sock" / "x"))


def test_read_no_follow_reads_the_opened_file_and_bounds_it(tree: Path) -> None:
    assert read_no_follow(str(tree / "dir" / "file.txt"), 100) == b"inside"
    with pytest.raises(PathRefused, match="has 6 bytes, more than the 5 allowed"):
        read_no_follow(str(tree / "dir" / "file.txt"), 5)
    with pytest.raises(PathRefused, match="symbolic link"):
        read_no_follow(str(tree / "dir" / "file-link"), 100)
    with pytest.raises(PathRefused, match="is not a regular file"):
        read_no_follow(str(tree / "dir"), 100)
    fifo = tree / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(PathRefused):  # never blocks
        read_no_follow(str(fifo), 100)


def test_a_held_descriptor_keeps_its_directory_when_the_path_becomes_a_symlink(tree: Path, opener: str) -> None:
    opened = open_no_follow(str(tree / "dir"))
    try:
        os.rename(tree / "dir", tree / "moved")
        (tree / "dir").symlink_to(tree / "outside")
        held = os.listdir(f"/proc/self/fd/{opened.fd}")
        assert "file.txt" in held and "secret" not in held
        with pytest.raises(PathRefused, match="symbolic link"):
            open_no_follow(str(tree / "dir"))
    finally:
        os.close(opened.fd)


# --------------------------------------------------------------------------- grants


def test_grants_fill_slots_and_refuse_what_they_must(tree: Path) -> None:
    plan = MountPlan(read_slots=2, write_slots=1, package_slots=1)
    with hold_grants(plan, allow_read=[str(tree / "dir"), str(tree / "loose.txt")], allow_write=[str(tree / "outside")]) as held:
        assert [(g.slot, g.is_file, g.writable) for g in held.grants] == [
            (PurePosixPath("/readie/grants/read-0"), False, False),
            (PurePosixPath("/readie/grants/read-1"), True, False),
            (PurePosixPath("/readie/grants/write-0"), False, True),
        ]
        assert [link["target"] for link in held.links] == [
            "/readie/grants/read-0/grant",
            "/readie/grants/read-1/grant/loose.txt",
            "/readie/grants/write-0/grant",
        ]
    cases = [
        (dict(allow_read=[str(tree / "dir")] * 3), "allow_read", "3 paths asked for, but sandboxes have 2 such slots"),
        (dict(allow_write=[str(tree / "dir" / "link")]), "allow_write", "passes through a symbolic link"),
        (dict(package_dirs=[str(tree / "dir" / "file.txt")]), "package_dirs", "is not a directory"),
        (dict(allow_read=["dir"]), "allow_read", "'dir' is not an absolute path"),
        (dict(allow_read=[str(tree / "missing")]), "allow_read", "does not exist"),
        (dict(allow_read=[str(tree / "dir" / "sub")], private=[tree / "dir"]), "allow_read", "overlaps a directory the worker keeps for itself"),
        (dict(allow_read=[str(tree)], private=[tree / "dir"]), "allow_read", "overlaps"),
        (dict(allow_write=[str(tree / "dir")], read_only=[tree / "dir" / "sub"]), "allow_write", "overlaps"),
        (dict(allow_read=[str(tree / "dir" / "sub")], allow_write=[str(tree / "dir")]), "allow_read", "lies in another grant"),
        (dict(allow_read=[str(tree / "dir"), str(tree / "dir")]), "allow_read", "lies in another grant"),
    ]
    for kwargs, field, message in cases:
        with pytest.raises(RequestError) as refused:
            hold_grants(plan, **kwargs)  # type: ignore[arg-type]
        assert refused.value.field == field and message in str(refused.value), kwargs
    # Reading what sandboxes are made from is harmless; only writing it is refused.
    with hold_grants(plan, allow_read=[str(tree / "dir")], read_only=[tree / "dir"]):
        pass


def test_a_refused_grant_leaves_no_descriptor_open(tree: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(RequestError):
        hold_grants(MountPlan(), allow_read=[str(tree / "dir"), str(tree / "dir" / "link")])
    assert len(os.listdir("/proc/self/fd")) == before


# --------------------------------------------------------------------------- the sandbox dir


def test_a_sandbox_dir_mounts_what_was_held_and_nothing_else_is_writable(tree: Path, short_tmp: Path) -> None:
    plan = MountPlan(read_slots=2, write_slots=2, package_slots=0)
    with hold_grants(plan, allow_read=[str(tree / "dir"), str(tree / "loose.txt")]) as held:
        sandbox = SandboxDir.create(short_tmp, held.grants, private=True, grant_slots=plan.grant_slots())
    try:
        # A write grant arrives later, as it does in a warm sandbox (decision 0034).
        with hold_grants(plan, allow_write=[str(tree / "outside")]) as later:
            sandbox.attach(later.grants)
            with pytest.raises(SandboxSetupError, match="already holds a grant"):
                sandbox.attach(later.grants)
        # The paths change after the open; the mounts do not.
        os.rename(tree / "dir", tree / "moved")
        (tree / "dir").symlink_to(tree / "outside")
        read_dir = sandbox.sources[plan.read_slot(0)] / GRANT_POINT
        assert sorted(os.listdir(read_dir)) == ["file-link", "file.txt", "link", "sub"]
        with pytest.raises(OSError, match="Read-only file system"):
            (read_dir / "new").write_text("x")
        read_file_dir = sandbox.sources[plan.read_slot(1)] / GRANT_POINT
        assert (read_file_dir / "loose.txt").read_text() == "loose"
        with pytest.raises(OSError, match="Read-only file system"):
            (read_file_dir / "other").write_text("x")  # the file's own dir
        (sandbox.sources[plan.write_slot(0)] / GRANT_POINT / "written").write_text("ok")
        assert (tree / "outside" / "written").read_text() == "ok"
        # An unfilled write slot, and every slot beside its grant point, is read-only at the host.
        for unwritable in (sandbox.sources[plan.write_slot(1)] / GRANT_POINT, sandbox.sources[plan.write_slot(0)], sandbox.unused_slots):
            with pytest.raises(OSError, match="Read-only file system"):
                (unwritable / "x").write_text("x")
        (sandbox.executor_dir / "executor.sock").write_text("the executor's to write")
    finally:
        assert sandbox.remove()
    assert not sandbox.path.exists()
    # Removal unmounted the grants and never touched their contents.
    assert sorted(os.listdir(tree / "moved")) == ["file-link", "file.txt", "link", "sub"]
    assert (tree / "outside" / "secret").read_text() == "s3cr3t"
    assert not [m for m in _mounts.mounts_beneath(short_tmp)]


def test_a_mount_that_arrives_beneath_a_grant_before_it_is_sealed_is_refused(
    tree: Path, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A host mount made under a granted directory in the instant between the bind and the cut
    # from the host's peer groups would come into the sandbox with the grant, writable.
    from readie_worker import _sandbox_dir

    cut = _sandbox_dir.make_private

    def mount_arrives_first(staged: Path) -> None:
        _mounts.mount_tmpfs(staged / "sub", size_bytes=4096, inodes=16)
        cut(staged)

    monkeypatch.setattr(_sandbox_dir, "make_private", mount_arrives_first)
    plan = MountPlan(read_slots=1, write_slots=1)
    sandbox = SandboxDir.create(short_tmp, private=True, grant_slots=plan.grant_slots())
    try:
        with hold_grants(plan, allow_read=[str(tree / "dir")]) as held:
            with pytest.raises(SandboxSetupError, match="a mount appeared beneath grant"):
                sandbox.attach(held.grants)
    finally:
        assert sandbox.remove()
        _mounts.unmount_beneath(tree)  # the copy the host's peer group got
    assert sorted(os.listdir(tree / "dir")) == ["file-link", "file.txt", "link", "sub"]


def test_the_sandbox_dir_is_bounded_in_bytes_and_inodes(short_tmp: Path) -> None:
    sandbox = SandboxDir.create(short_tmp, private=True)
    try:
        with pytest.raises(OSError, match="No space left on device"):
            for index in range(1000):
                (sandbox.executor_dir / f"f{index}").write_bytes(b"x" * 4096)
    finally:
        assert sandbox.remove()


# --------------------------------------------------------------------------- remove_tree


def test_remove_tree_survives_a_deep_tree_and_follows_no_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("keep")
    top = tmp_path / "doomed"
    top.mkdir()
    # Deeper than recursion, a descriptor per level or one path would survive;
    # with a symlink to a victim and files on the way down.
    fd = os.open(top, os.O_RDONLY)
    for depth in range(3000):
        if depth % 500 == 0:
            os.symlink(victim, "escape", dir_fd=fd)
            os.close(os.open("file", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
        os.mkdir("d", dir_fd=fd)
        next_fd = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = next_fd
    os.close(fd)
    assert remove_tree(top)
    assert not top.exists()
    assert (victim / "keep").read_text() == "keep"


def test_remove_tree_never_enters_a_mount(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data").write_text("data")
    top = tmp_path / "t\\o p"
    # The kernel escapes a space and a backslash in mountinfo (\040, \134): found all the same.
    points = [top / "mnt", top / "a b\\c"]
    fd = os.open(precious, os.O_PATH)
    try:
        for point in points:
            point.mkdir(parents=True)
            _mounts.bind_descriptor(fd, point, writable=True)
    finally:
        os.close(fd)
    assert sorted(_mounts.mounts_beneath(top)) == sorted(points)
    assert remove_tree(top)  # unmounts first, then removes an empty mount point
    assert (precious / "data").read_text() == "data"
    assert remove_tree(tmp_path / "never-existed")
    assert remove_tree(tmp_path / "precious" / "data")  # a file is removed too


def test_mount_points_are_read_from_the_fifth_field_of_the_lines_that_name_the_path() -> None:
    table = (
        b"22 1 0:21 / / rw - ext4 /dev/vda rw\n"
        b"30 22 0:40 / /run/rd-1 rw - tmpfs tmpfs rw\n"
        b"31 30 0:40 /run/rd-1 /run/rd-1/run rw - tmpfs tmpfs rw\n"  # the path in the root field too
        b"32 22 0:41 / /run/rd-10 rw - tmpfs tmpfs rw\n"  # a sibling whose name starts with it
        b"33 22 0:41 /run/rd-1/x /elsewhere rw - tmpfs tmpfs rw\n"  # the path in the root field only
        b"34 30 0:42 / /run/rd-1/a\\040b\\134c rw - tmpfs tmpfs rw\n"  # a space and a backslash, escaped
        b"35 30 0:43 / /run/rd-1/slots/last rw - tmpfs tmpfs rw"  # no newline at the end
    )
    assert _mounts._mount_points_beneath(table, b"/run/rd-1") == [
        Path("/run/rd-1/slots/last"), Path("/run/rd-1/run"), Path("/run/rd-1/a b\\c"), Path("/run/rd-1"),
    ]
    assert _mounts._mount_points_beneath(table, b"/run/rd-1 x") == []
