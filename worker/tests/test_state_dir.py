"""The state dir is readie's own (issue 27, decision 0025): made 0700, refused when another
local user could have planted or could change it, emptied and removed by descriptor."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from readie_worker.errors import ConfigError
from readie_worker.paths import remove_tree
from readie_worker.state_dir import IMAGES, RUN, RUNSC, RUNTIME_ROOT, STORE, StateDir, StateDirRefused

# Not this process's uid (root in these tests): stands for another local user.
OTHER_UID = 4242


def tree(root: Path) -> dict[str, bytes | None]:
    """Every entry beneath ``root`` (not followed), with a file's bytes."""
    return {
        str(path.relative_to(root)): path.read_bytes() if path.is_file() and not path.is_symlink() else None
        for path in sorted(root.rglob("*"))
    }


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A directory of someone else's that a planted link points at."""
    made = tmp_path / "victim"
    (made / RUNSC).mkdir(parents=True)
    (made / "precious.txt").write_text("not readie's\n")
    (made / RUNSC / "also-precious").write_text("nor this\n")
    return made


def test_a_missing_state_dir_is_made_0700_with_its_layout_and_removed_at_close(short_tmp):
    state = StateDir.claim(short_tmp / "a" / "state")
    assert state.made and state.path == short_tmp / "a" / "state"
    assert stat.S_IMODE(state.path.stat().st_mode) == 0o700
    state.prepare()
    assert sorted(os.listdir(state.path)) == sorted([IMAGES, RUN, RUNSC, STORE])
    assert all(stat.S_IMODE((state.path / name).stat().st_mode) == 0o700 for name in (IMAGES, RUN, RUNSC, STORE))
    state.close()
    assert not state.path.exists()
    state.close()  # again: nothing to do


def test_an_existing_state_dir_is_emptied_at_start_and_at_close_but_kept(short_tmp):
    named = short_tmp / "state"
    (named / "run" / "rd-0123").mkdir(parents=True)
    (named / "left-by-an-earlier-run").write_text("x")
    state = StateDir.claim(named)
    assert not state.made and (named / "left-by-an-earlier-run").exists()  # claiming touches nothing
    state.prepare()
    assert sorted(os.listdir(named)) == sorted([IMAGES, RUN, RUNSC, STORE])
    (named / RUN / "rd-4567").mkdir()
    state.close()
    assert named.is_dir() and os.listdir(named) == []


def test_without_a_name_the_state_dir_is_a_new_one_under_the_per_user_runtime_root():
    state = StateDir.claim(None)
    try:
        assert state.made and state.path.parent == Path(os.path.realpath(RUNTIME_ROOT))
        assert stat.S_IMODE(state.path.stat().st_mode) == 0o700
        assert not str(RUNTIME_ROOT).startswith("/tmp/")  # never a shared place by default
    finally:
        state.close()
    assert not state.path.exists()


def refused(path: Path) -> str:
    with pytest.raises(StateDirRefused) as caught:
        StateDir.claim(path)
    assert isinstance(caught.value, ConfigError)  # the commands exit 2 for it
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    return message


def test_a_planted_link_is_refused_and_what_it_points_at_untouched(tmp_path, victim):
    before = tree(victim)
    link = tmp_path / "state"
    link.symlink_to(victim)
    assert "is a symbolic link" in refused(link)
    assert tree(victim) == before and link.is_symlink()


def test_a_dangling_planted_link_is_refused_and_nothing_made_where_it_points(tmp_path):
    link = tmp_path / "state"
    link.symlink_to(tmp_path / "would-be-made")
    assert "is a symbolic link" in refused(link)
    assert not (tmp_path / "would-be-made").exists()


@pytest.mark.parametrize("mode", [0o770, 0o707])  # its group's write bit, others'
def test_a_state_dir_others_can_write_is_refused(tmp_path, mode):
    named = tmp_path / "state"
    named.mkdir()
    (named / "theirs").write_text("x")
    named.chmod(mode)
    assert "writable by its group or others" in refused(named)
    assert os.listdir(named) == ["theirs"]


def test_a_state_dir_of_another_user_is_refused(tmp_path):
    named = tmp_path / "state"
    named.mkdir(mode=0o700)
    (named / "theirs").write_text("x")
    os.chown(named, OTHER_UID, -1)
    assert f"belongs to uid {OTHER_UID}" in refused(named)
    assert os.listdir(named) == ["theirs"]


def test_a_state_dir_that_is_not_a_directory_is_refused(tmp_path):
    named = tmp_path / "state"
    named.write_text("a file\n")
    assert "not a directory" in refused(named)
    assert named.read_text() == "a file\n"


def test_a_parent_others_could_rename_it_in_is_refused_unless_sticky(short_tmp):
    shared = short_tmp / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # another user could rename our state dir away and plant their own
    assert "writable by others and not sticky" in refused(shared / "state")
    assert os.listdir(shared) == []
    shared.chmod(0o1777)  # as /tmp: only an entry's owner may rename it
    state = StateDir.claim(shared / "state")
    state.close()
    assert os.listdir(shared) == []


def test_a_parent_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, -1)
    assert f"parent directory belongs to uid {OTHER_UID}" in refused(theirs / "state")
    assert os.listdir(theirs) == []


def test_a_state_dir_too_long_for_its_sockets_is_refused_and_not_left_made(tmp_path):
    named = tmp_path / ("d" * (108 - len(str(tmp_path))))
    assert "too long" in refused(named)
    assert not named.exists()


def test_remove_tree_by_name_beneath_a_descriptor_follows_no_link(tmp_path, victim):
    before = tree(victim)
    holder = tmp_path / "holder"
    (holder / "tree" / "deep").mkdir(parents=True)
    (holder / "tree" / "deep" / "file").write_text("x")
    (holder / "tree" / "link").symlink_to(victim)
    (holder / "link").symlink_to(victim)
    fd = os.open(holder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert remove_tree("tree", dir_fd=fd) and remove_tree("link", dir_fd=fd)
    finally:
        os.close(fd)
    assert os.listdir(holder) == [] and tree(victim) == before
