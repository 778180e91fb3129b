"""Where the checkpoints are: the search order, its error, the ownership rule and the default's link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from readie_policy.locations import (
    CheckpointsNotFound,
    UnsafeCheckpoints,
    default_checkpoints,
    link_default,
    locate_checkpoints,
)

NOBODY = 65534


def checkpoint_dir(path: Path) -> Path:
    path.mkdir(parents=True, mode=0o755)
    (path / "manifest.json").write_text("{}")
    return path


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    return home


def test_the_flag_wins_then_the_variable(tmp_path, home):
    flagged, named = checkpoint_dir(tmp_path / "a"), checkpoint_dir(tmp_path / "b")
    env = {"HOME": str(home), "READIE_CHECKPOINTS": str(named)}
    found = locate_checkpoints(flagged, cwd=tmp_path, environ=env)
    assert (found.manifest, found.source) == (flagged / "manifest.json", "--checkpoints")
    found = locate_checkpoints(None, cwd=tmp_path, environ=env)
    assert (found.manifest, found.source) == (named / "manifest.json", "$READIE_CHECKPOINTS")
    # a manifest named directly, and a path relative to the working directory
    assert locate_checkpoints("a/manifest.json", cwd=tmp_path, environ=env).manifest == flagged / "manifest.json"


def test_a_name_that_finds_nothing_is_an_error_not_a_fallback(tmp_path, home):
    checkpoint_dir(tmp_path / "build" / "checkpoints")
    env = {"HOME": str(home), "READIE_CHECKPOINTS": str(tmp_path / "typo")}
    with pytest.raises(CheckpointsNotFound, match=r"no checkpoint manifest at .*/typo \(named by \$READIE_CHECKPOINTS\).*make capture"):
        locate_checkpoints(None, cwd=tmp_path, environ=env)


def test_the_working_directory_then_the_per_user_default(tmp_path, home):
    env = {"HOME": str(home)}
    default = checkpoint_dir(home / ".cache" / "readie" / "checkpoints")
    assert default == default_checkpoints(env)
    found = locate_checkpoints(None, cwd=tmp_path, environ=env)
    assert (found.manifest, found.source) == (default / "manifest.json", "~/.cache/readie/checkpoints")
    local = checkpoint_dir(tmp_path / "build" / "checkpoints")
    assert locate_checkpoints(None, cwd=tmp_path, environ=env).manifest == local / "manifest.json"
    # READIE_CACHE moves the default with the rootfs cache
    moved = checkpoint_dir(tmp_path / "cache" / "checkpoints")
    found = locate_checkpoints(None, cwd=home, environ={**env, "READIE_CACHE": str(tmp_path / "cache")})
    assert found.manifest == moved / "manifest.json"


def test_nothing_found_lists_every_place_looked(tmp_path, home):
    os.makedirs(home / ".cache" / "readie")
    os.symlink(tmp_path / "gone", home / ".cache" / "readie" / "checkpoints")
    with pytest.raises(CheckpointsNotFound) as raised:
        locate_checkpoints(None, cwd=tmp_path, environ={"HOME": str(home)})
    message = str(raised.value)
    assert message.splitlines()[1:5] == [
        "  --checkpoints: not given",
        "  $READIE_CHECKPOINTS: not set",
        f"  ./build/checkpoints: {tmp_path}/build/checkpoints does not exist",
        f"  ~/.cache/readie/checkpoints: a dangling link to {tmp_path}/gone",
    ]
    assert "make capture" in message


def test_the_found_manifest_is_resolved_so_later_reads_do_not_follow_the_link(tmp_path, home):
    real = checkpoint_dir(tmp_path / "checkout" / "build" / "checkpoints")
    assert link_default(real, {"HOME": str(home)}) == home / ".cache" / "readie" / "checkpoints"
    found = locate_checkpoints(None, cwd=tmp_path, environ={"HOME": str(home)})
    assert found.manifest == real / "manifest.json" and not found.manifest.parent.is_symlink()


@pytest.mark.parametrize("where", ["directory", "manifest", "parent"])
def test_writable_by_others_is_refused(tmp_path, home, where):
    parent = tmp_path / "p"
    parent.mkdir(mode=0o755)
    directory = checkpoint_dir(parent / "checkpoints")
    target = {"directory": directory, "manifest": directory / "manifest.json", "parent": parent}[where]
    os.chmod(target, 0o777 if where != "manifest" else 0o666)
    with pytest.raises(UnsafeCheckpoints, match=rf"{target} is writable by others"):
        locate_checkpoints(directory, environ={"HOME": str(home)})


def test_a_sticky_directory_higher_up_is_fine(tmp_path, home):
    sticky = tmp_path / "shared"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp
    directory = checkpoint_dir(sticky / "mine" / "checkpoints")
    assert locate_checkpoints(directory, environ={"HOME": str(home)}).directory == directory
    os.chmod(directory, 0o1777)  # but not on the checkpoints themselves: others could add images
    with pytest.raises(UnsafeCheckpoints, match="is writable by others"):
        locate_checkpoints(directory, environ={"HOME": str(home)})


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file away")
def test_someone_elses_link_or_directory_is_refused(tmp_path, home):
    real = checkpoint_dir(tmp_path / "real")
    link = tmp_path / "link"
    os.symlink(real, link)
    os.lchown(link, NOBODY, NOBODY)  # their link could be re-pointed at any time
    with pytest.raises(UnsafeCheckpoints, match=rf"{link} belongs to uid {NOBODY}"):
        locate_checkpoints(link, environ={"HOME": str(home)})
    os.chown(real, NOBODY, NOBODY)
    with pytest.raises(UnsafeCheckpoints, match=rf"{real} belongs to uid {NOBODY}"):
        locate_checkpoints(real, environ={"HOME": str(home)})


def test_link_default_replaces_a_link_but_never_a_directory(tmp_path, home):
    env = {"HOME": str(home)}
    first, second = checkpoint_dir(tmp_path / "one"), checkpoint_dir(tmp_path / "two")
    link = link_default(first, env)
    assert link is not None and os.readlink(link) == str(first)
    assert link_default(first, env) is None  # already there
    link_default(second, env)
    assert os.readlink(link) == str(second)
    assert sorted(os.listdir(link.parent)) == ["checkpoints"]  # no temporary left behind
    os.unlink(link)
    checkpoint_dir(link)
    with pytest.raises(UnsafeCheckpoints, match="is a directory of its own"):
        link_default(first, env)
