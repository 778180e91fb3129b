"""The checkpoint manifest: round trip, atomic writes, and every loading rule."""

from __future__ import annotations

import dataclasses

import json
import os
from pathlib import Path

import pytest

from readie_executor.digest import source_digest
from readie_executor.framing import PROTOCOL_VERSION
from readie_worker import manifest as manifest_module
from readie_worker.bundle import MountPlan
from readie_worker.errors import CheckpointUnusable, ManifestError
from readie_worker.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Checkpoint,
    Manifest,
    file_sha256,
    image_files,
    load_checkpoints,
    protocol_mismatch_message,
    read_manifest,
    verify_image,
    write_manifest,
)

RUNSC = "runsc version release-20250101.0"
FINGERPRINT = "sha256:" + "ab" * 32


def make_checkpoint(out: Path, name: str, data: bytes, pages: bytes | None = None) -> Checkpoint:
    """One compressed file, or with ``pages`` the three of an uncompressed runsc 2024 image."""
    image_dir = out / "images" / name
    image_dir.mkdir(parents=True)
    (image_dir / "checkpoint.img").write_bytes(data)
    if pages is not None:
        (image_dir / "pages.img").write_bytes(pages)
        (image_dir / "pages_meta.img").write_bytes(b"meta" + pages[:16])
    return Checkpoint(
        name=name,
        preimport=(name,) if name != "base" else (),
        image_path=image_dir,
        files=image_files(image_dir),
        restore_p50_ms=12.5,
        cold_start_p50_ms=800.0,
        restore_to_socket_p50_ms=20.25,
    )


def make_manifest(out: Path, **overrides: object) -> Manifest:
    checkpoints = {
        "base": make_checkpoint(out, "base", b"base image bytes \x00\x01\x02"),
        "numpy": make_checkpoint(out, "numpy", b"numpy image bytes " * 100, pages=os.urandom(3 * 4096)),
    }
    fields: dict[str, object] = dict(
        executor_protocol=PROTOCOL_VERSION,
        runsc_version=RUNSC,
        runsc_flags=("--network=none", "--overlay2=root:memory"),
        spec_fingerprint=FINGERPRINT,
        rootfs=Path("/var/lib/readie/rootfs/abc"),
        rootfs_fingerprint="sha256:" + "cd" * 32,
        python="3.11.9",
        executor_argv=("/usr/bin/python3", "-u", "-m", "readie_executor"),
        mount_plan=MountPlan(read_slots=3, write_slots=2, package_slots=1),
        created_at="2025-01-01T00:00:00+00:00",
        checkpoints=checkpoints,
    )
    fields.update(overrides)
    return Manifest(**fields)  # type: ignore[arg-type]


@pytest.fixture
def out(tmp_path: Path) -> Path:
    # Resolved, so that paths resolved on load compare equal to the originals.
    return tmp_path.resolve()


@pytest.fixture
def written(out: Path) -> tuple[Path, Manifest]:
    manifest = make_manifest(out)
    path = out / MANIFEST_NAME
    write_manifest(manifest, path)
    return path, manifest


def load(path: Path, **kwargs: object):
    options: dict[str, object] = {"runsc_version": RUNSC, "spec_fingerprint": FINGERPRINT}
    options.update(kwargs)
    return load_checkpoints(path, **options)  # type: ignore[arg-type]


def rewrite_json(path: Path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


# --- round trip and writing ------------------------------------------------


def test_round_trip_stores_image_paths_relative_and_loads_them_absolute(written):
    path, manifest = written
    raw = json.loads(path.read_text())
    assert [c["image_path"] for c in raw["checkpoints"]] == ["images/base", "images/numpy"]
    assert raw["executor_protocol"] == PROTOCOL_VERSION

    loaded = read_manifest(path)
    assert loaded == manifest
    for checkpoint in loaded.checkpoints.values():
        assert checkpoint.image_path.is_absolute()
        assert checkpoint.image_path == path.parent / "images" / checkpoint.name


def test_manifest_directory_can_move_with_its_images(written, out):
    path, _ = written
    moved = out / "elsewhere"
    moved.mkdir()
    os.rename(out / "images", moved / "images")
    os.rename(path, moved / MANIFEST_NAME)
    loaded = load(moved / MANIFEST_NAME)
    assert loaded.problems == {}
    assert loaded.usable["numpy"].image_path == moved / "images" / "numpy"


def test_write_replaces_an_existing_manifest_and_leaves_no_temp_files(written, out):
    path, manifest = written
    newer = make_manifest(out / "v2", created_at="2025-02-02T00:00:00+00:00")
    write_manifest(newer, path)
    assert read_manifest(path).created_at == "2025-02-02T00:00:00+00:00"
    assert list(out.glob(".manifest-*.tmp")) == []


def test_failed_write_keeps_the_old_manifest_and_removes_the_temp_file(written, out, monkeypatch):
    path, manifest = written
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(manifest_module.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk on fire"):
        write_manifest(make_manifest(out / "v2"), path)
    assert path.read_bytes() == before
    assert list(out.glob(".manifest-*.tmp")) == []


def test_write_creates_the_parent_directory(out):
    path = out / "deep" / "er" / MANIFEST_NAME
    write_manifest(make_manifest(out), path)
    assert read_manifest(path).checkpoints["base"].image_path == out / "images" / "base"


# --- loading rules ---------------------------------------------------------


def test_no_manifest_means_cold_starts_only(out):
    path = out / MANIFEST_NAME
    loaded = load(path)
    assert loaded.manifest is None
    assert loaded.usable == {}
    assert list(loaded.problems) == ["*"]
    assert "cold starts only" in loaded.problems["*"]
    assert str(path) in loaded.problems["*"]


def test_good_manifest_makes_every_checkpoint_usable(written):
    path, manifest = written
    loaded = load(path, strict=True)
    assert loaded.problems == {}
    assert loaded.usable == manifest.checkpoints
    assert loaded.manifest == manifest


def test_manifest_without_executor_protocol_counts_as_1_and_is_refused(written):
    path, _ = written
    rewrite_json(path, lambda raw: raw.pop("executor_protocol"))
    with pytest.raises(ManifestError) as refused:
        load(path)
    assert str(refused.value) == protocol_mismatch_message(path, 1)
    assert str(refused.value) == (
        f"{path}: checkpoints were built for executor protocol 1, but this worker speaks "
        f"executor protocol 2; rebuild them with the current pipeline (make capture)"
    )


def test_checkpoints_of_another_executor_source_are_refused_before_any_job(out):
    """The frozen executor would refuse this worker's job fields (or miss its result fields): the
    worker says so at start, instead of answering every job with an error that blames the request."""
    path = out / MANIFEST_NAME
    manifest = make_manifest(out)
    for digest, usable in (("sha256:" + "0" * 64, False), (source_digest(), True), (None, True)):  # None: older
        write_manifest(dataclasses.replace(manifest, executor_digest=digest), path)
        if usable:
            assert load(path).manifest.executor_digest == digest
            continue
        with pytest.raises(ManifestError, match=r"captured with another executor .*recapture them \(make capture\)"):
            load(path)


def test_manifest_from_a_newer_protocol_is_refused(out):
    path = out / MANIFEST_NAME
    write_manifest(make_manifest(out, executor_protocol=3), path)
    with pytest.raises(ManifestError) as refused:
        load(path)  # not strict: still refused, never a hang later
    assert str(refused.value) == protocol_mismatch_message(path, 3)
    assert str(refused.value) == (
        f"{path}: checkpoints were built for executor protocol 3, but this worker speaks "
        f"executor protocol 2; rebuild them with the current pipeline (make capture)"
    )


def test_protocol_is_checked_before_the_rest_of_the_manifest(out):
    # An old manifest of a different shape still gets the version message, not "malformed".
    path = out / MANIFEST_NAME
    path.write_text(json.dumps({"checkpoints": {"base": "/old/layout"}}))
    with pytest.raises(ManifestError) as refused:
        read_manifest(path)
    assert str(refused.value) == protocol_mismatch_message(path, 1)


def test_runsc_version_mismatch_drops_all_checkpoints(written):
    path, manifest = written
    loaded = load(path, runsc_version="runsc version release-20990101.0")
    assert loaded.manifest == manifest
    assert loaded.usable == {}
    assert list(loaded.problems) == ["*"]
    problem = loaded.problems["*"]
    assert RUNSC in problem
    assert "release-20990101.0" in problem
    assert "make capture" in problem


def test_runsc_version_mismatch_is_refused_when_strict(written):
    path, _ = written
    with pytest.raises(ManifestError, match="release-20990101.0"):
        load(path, runsc_version="runsc version release-20990101.0", strict=True)


def test_spec_fingerprint_mismatch_drops_all_checkpoints(written):
    path, _ = written
    other = "sha256:" + "ef" * 32
    loaded = load(path, spec_fingerprint=other)
    assert loaded.usable == {}
    assert list(loaded.problems) == ["*"]
    assert FINGERPRINT in loaded.problems["*"]
    assert other in loaded.problems["*"]


def test_spec_fingerprint_mismatch_is_refused_when_strict(written):
    path, _ = written
    other = "sha256:" + "ef" * 32
    with pytest.raises(ManifestError, match=other):
        load(path, spec_fingerprint=other, strict=True)


def test_missing_image_makes_only_that_checkpoint_unusable(written, out):
    path, manifest = written
    (out / "images" / "base" / "checkpoint.img").unlink()
    loaded = load(path)
    assert list(loaded.usable) == ["numpy"]
    assert list(loaded.problems) == ["base"]
    assert "missing" in loaded.problems["base"]
    with pytest.raises(CheckpointUnusable, match=r"'base'.*\(missing \['checkpoint.img'\]"):
        verify_image(loaded.manifest.checkpoints["base"])


def test_missing_image_is_not_fatal_even_when_strict(written, out):
    # strict is about the manifest as a whole; one bad image stays a per-checkpoint problem.
    path, _ = written
    (out / "images" / "base" / "checkpoint.img").unlink()
    loaded = load(path, strict=True)
    assert list(loaded.usable) == ["numpy"]
    assert list(loaded.problems) == ["base"]


@pytest.mark.parametrize("name", ["checkpoint.img", "pages.img", "pages_meta.img"])
def test_a_corrupt_file_of_an_image_names_it_and_both_digests(written, out, name):
    path, manifest = written
    image = out / "images" / "numpy" / name
    data = bytearray(image.read_bytes())
    data[len(data) // 2] ^= 0x01
    image.write_bytes(bytes(data))
    actual = file_sha256(image)
    [expected] = [f.sha256 for f in manifest.checkpoints["numpy"].files if f.name == name]
    assert actual != expected

    loaded = load(path)
    assert list(loaded.usable) == ["base"]
    problem = loaded.problems["numpy"]
    assert f"{name} is corrupt" in problem
    assert actual in problem
    assert expected in problem


def test_an_image_file_of_another_size_is_refused_before_hashing(written, out):
    path, _ = written
    with open(out / "images" / "numpy" / "pages.img", "ab") as pages:
        pages.write(b"appended")
    assert "pages.img is 12296 bytes, the manifest says 12288" in load(path).problems["numpy"]


def test_a_file_added_to_an_image_dir_is_refused(written, out):
    # runsc reads what it finds in an image dir: an unrecorded file there is not trusted.
    path, _ = written
    (out / "images" / "base" / "pages.img").write_bytes(b"planted")
    assert "unexpected ['pages.img']" in load(path).problems["base"]


def test_an_image_file_swapped_for_a_symlink_is_refused(written, out):
    path, _ = written
    pages = out / "images" / "numpy" / "pages.img"
    (out / "copy").write_bytes(pages.read_bytes())
    pages.unlink()
    pages.symlink_to(out / "copy")
    assert "pages.img is not a regular file" in load(path).problems["numpy"]


def test_a_flags_mismatch_names_both_flag_sets(written):
    # A systrap image under ptrace is not refused by runsc (the job segfaults): the worker must.
    path, _ = written
    flags = ("--platform=ptrace", "--network=none", "--overlay2=root:memory")
    problem = load(path, spec_fingerprint="sha256:" + "ef" * 32, runsc_flags=flags).problems["*"]
    assert "captured with flags --network=none --overlay2=root:memory" in problem
    assert "this host uses --platform=ptrace --network=none --overlay2=root:memory" in problem


def test_images_are_not_hashed_when_verification_is_off(written, out):
    path, _ = written
    (out / "images" / "base" / "checkpoint.img").write_bytes(b"tampered")
    loaded = load(path, verify_images=False)
    assert sorted(loaded.usable) == ["base", "numpy"]
    assert loaded.problems == {}


def test_file_sha256_is_prefixed_hex_of_the_whole_file(out):
    import hashlib

    # More than one hash block, so every block must be fed in.
    data = os.urandom(manifest_module._HASH_BLOCK + 123)
    (out / "blob").write_bytes(data)
    assert file_sha256(out / "blob") == "sha256:" + hashlib.sha256(data).hexdigest()


# --- malformed manifests ---------------------------------------------------


def test_invalid_json_is_a_manifest_error(out):
    path = out / MANIFEST_NAME
    path.write_text('{"executor_protocol": 2,')
    with pytest.raises(ManifestError, match="cannot read the checkpoint manifest") as refused:
        load(path)
    assert str(path) in str(refused.value)


def test_json_that_is_not_an_object_is_a_manifest_error(out):
    path = out / MANIFEST_NAME
    path.write_text("[1, 2, 3]")
    with pytest.raises(ManifestError, match="not a JSON object"):
        read_manifest(path)


@pytest.mark.parametrize("key", ["runsc_version", "spec_fingerprint", "mount_plan", "checkpoints"])
def test_missing_top_level_key_is_a_manifest_error(written, key):
    path, _ = written
    rewrite_json(path, lambda raw: raw.pop(key))
    with pytest.raises(ManifestError, match="malformed checkpoint manifest") as refused:
        read_manifest(path)
    assert key in str(refused.value)
    assert str(path) in str(refused.value)


def test_missing_checkpoint_key_is_a_manifest_error(written):
    path, _ = written
    rewrite_json(path, lambda raw: raw["checkpoints"][1].pop("files"))
    with pytest.raises(ManifestError, match="malformed checkpoint manifest: KeyError: 'files'"):
        read_manifest(path)


def test_wrongly_typed_field_is_a_manifest_error(written):
    path, _ = written
    rewrite_json(path, lambda raw: raw["checkpoints"][0]["files"][0].update(size_bytes="big"))
    with pytest.raises(ManifestError, match="malformed checkpoint manifest: ValueError"):
        read_manifest(path)


def test_oversize_manifest_is_refused_without_parsing(out):
    path = out / MANIFEST_NAME
    path.write_bytes(b" " * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(ManifestError) as refused:
        load(path)
    message = str(refused.value)
    assert f"{MAX_MANIFEST_BYTES + 1} bytes is not a manifest" in message
    assert f"limit {MAX_MANIFEST_BYTES}" in message


def test_manifest_at_the_size_limit_is_still_read(written):
    path, manifest = written
    data = path.read_bytes()
    path.write_bytes(data + b" " * (MAX_MANIFEST_BYTES - len(data)))
    assert read_manifest(path) == manifest


def test_deeply_nested_json_is_a_manifest_error(out):
    path = out / MANIFEST_NAME
    path.write_text("[" * 100_000 + "]" * 100_000)  # well under MAX_MANIFEST_BYTES
    with pytest.raises(ManifestError):
        read_manifest(path)


def test_non_finite_number_is_a_manifest_error(written):
    path, _ = written
    # json.dumps writes Infinity, which json.loads accepts.
    rewrite_json(path, lambda raw: raw["checkpoints"][0]["files"][0].update(size_bytes=float("inf")))
    with pytest.raises(ManifestError):
        read_manifest(path)


def test_a_checkpoint_that_lists_a_file_twice_is_a_manifest_error(written):
    path, _ = written
    rewrite_json(path, lambda raw: raw["checkpoints"][0]["files"].append(dict(raw["checkpoints"][0]["files"][0])))
    with pytest.raises(ManifestError, match="lists a file twice"):
        read_manifest(path)


def test_an_after_restore_hook_round_trips_and_a_manifest_without_one_has_none(written):
    path, _ = written
    rewrite_json(path, lambda raw: raw["checkpoints"][0].update(after_restore="mylib.hooks:reseed"))
    rewrite_json(path, lambda raw: raw["checkpoints"][1].pop("after_restore"))  # as manifests before decision 23
    loaded = read_manifest(path)
    assert [c.after_restore for c in loaded.checkpoints.values()] == ["mylib.hooks:reseed", ""]


@pytest.mark.parametrize("hook", ["x; rm -rf /", "mylib:", ":f", "a b", 7, ["mylib"], "mylib:f\nEVIL=1"])
def test_an_after_restore_hook_that_is_no_name_is_a_manifest_error(written, hook):
    # It becomes part of every sandbox's environment: an imported manifest must not choose more.
    path, _ = written
    rewrite_json(path, lambda raw: raw["checkpoints"][0].update(after_restore=hook))
    with pytest.raises(ManifestError, match="after_restore must name a module"):
        read_manifest(path)
