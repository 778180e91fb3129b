"""OCI configs, the spec fingerprint a restore must match, and executor environments."""

from __future__ import annotations

import copy
import json
from pathlib import Path, PurePosixPath

import pytest

from readie_worker.bundle import (
    EXECUTOR_ARGV,
    EXECUTOR_DIR,
    SINGLE_THREAD_ENV,
    MountPlan,
    SandboxSpec,
    capture_env,
    family_fingerprint,
    serve_env,
    spec_fingerprint,
)

FLAGS = ("--network=none", "--overlay2=root:memory")
PLAN = MountPlan(read_slots=2, write_slots=3, package_slots=1)
ROOTFS = Path("/var/lib/readie/rootfs/abc")


def spec(**overrides: object) -> SandboxSpec:
    fields: dict[str, object] = dict(
        rootfs=ROOTFS,
        executor_dir=Path("/srv/sandboxes/s1/run"),
        env={"PATH": "/usr/bin", "LANG": "C.UTF-8"},
        plan=PLAN,
        sources={},
        unused_slot_source=Path("/srv/sandboxes/s1/unused"),
    )
    fields.update(overrides)
    return SandboxSpec(**fields)  # type: ignore[arg-type]


def binds(config: dict) -> dict[str, dict]:
    return {m["destination"]: m for m in config["mounts"] if m["type"] == "bind"}


def fingerprint(config: dict, flags=FLAGS) -> str:
    return spec_fingerprint(config, flags)


# --- oci_config ------------------------------------------------------------


def test_every_slot_is_a_bind_mount_with_the_right_access():
    config = spec().oci_config()
    mounts = binds(config)
    expected = {
        "/readie/run": "rw",
        "/readie/grants/read-0": "ro",
        "/readie/grants/read-1": "ro",
        "/readie/grants/write-0": "rw",
        "/readie/grants/write-1": "rw",
        "/readie/grants/write-2": "rw",
        "/readie/packages/0": "ro",
    }
    assert {dest: m["options"] for dest, m in mounts.items()} == {
        dest: ["rbind", access] for dest, access in expected.items()
    }
    # Same order as MountPlan.slots(), right after the executor dir: the shape is fixed.
    bind_order = [m["destination"] for m in config["mounts"] if m["type"] == "bind"]
    assert bind_order == [str(EXECUTOR_DIR)] + [str(dest) for dest, _ in PLAN.slots()]


def test_executor_dir_is_bound_from_the_host_side():
    config = spec().oci_config()
    assert binds(config)[str(EXECUTOR_DIR)]["source"] == "/srv/sandboxes/s1/run"


def test_granted_slots_use_their_sources_and_unused_ones_the_placeholder():
    granted = {
        PurePosixPath("/readie/grants/read-1"): Path("/data/in"),
        PurePosixPath("/readie/grants/write-0"): Path("/data/out"),
    }
    mounts = binds(spec(sources=granted).oci_config())
    assert mounts["/readie/grants/read-1"]["source"] == "/data/in"
    assert mounts["/readie/grants/write-0"]["source"] == "/data/out"
    unused = [
        dest for dest in mounts if dest != str(EXECUTOR_DIR) and PurePosixPath(dest) not in granted
    ]
    assert len(unused) == 4
    for dest in unused:
        assert mounts[dest]["source"] == "/srv/sandboxes/s1/unused", dest


def test_placeholder_defaults_to_a_sibling_of_the_executor_dir():
    mounts = binds(spec(unused_slot_source=None).oci_config())
    assert mounts["/readie/grants/write-2"]["source"] == "/srv/sandboxes/s1/unused"


def test_zero_slots_leaves_only_the_executor_dir_bound():
    mounts = binds(spec(plan=MountPlan(0, 0, 0)).oci_config())
    assert list(mounts) == [str(EXECUTOR_DIR)]


def test_env_is_rendered_sorted_as_key_value():
    config = spec(env={"ZED": "last", "ALPHA": "a=b", "MID": ""}).oci_config()
    assert config["process"]["env"] == ["ALPHA=a=b", "MID=", "ZED=last"]


def test_process_root_and_hostname():
    config = spec().oci_config()
    assert config["process"]["args"] == list(EXECUTOR_ARGV)
    assert config["process"]["noNewPrivileges"] is True
    assert config["root"] == {"path": str(ROOTFS), "readonly": False}
    assert config["hostname"] == "readie"


def test_memory_limit_appears_only_when_set():
    assert "resources" not in spec().oci_config()["linux"]
    limited = spec(memory_limit_bytes=256 * 1024 * 1024).oci_config()
    assert limited["linux"]["resources"] == {"memory": {"limit": 256 * 1024 * 1024}}


def test_written_bundle_is_the_config(tmp_path):
    path = spec().write(tmp_path / "bundle")
    assert path == tmp_path / "bundle" / "config.json"
    assert json.loads(path.read_text()) == spec().oci_config()


# --- spec_fingerprint ------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(dict(env={"OTHER": "env"}), id="env"),
        pytest.param(
            dict(sources={PurePosixPath("/readie/grants/read-0"): Path("/x")}), id="sources"
        ),
        pytest.param(dict(executor_dir=Path("/elsewhere/run")), id="executor-dir"),
        pytest.param(dict(unused_slot_source=Path("/elsewhere/unused")), id="placeholder"),
        pytest.param(dict(rootfs=Path("/other/rootfs")), id="rootfs"),
    ],
)
def test_fingerprint_ignores_what_may_differ_at_restore(variant):
    assert fingerprint(spec(**variant).oci_config()) == fingerprint(spec().oci_config())


def test_fingerprint_ignores_unrelated_runsc_flags():
    config = spec().oci_config()
    assert fingerprint(config, (*FLAGS, "--debug", "--platform=systrap")) == fingerprint(config)


def _set_args(config):
    config["process"]["args"] = [*config["process"]["args"], "--extra"]


def _move_mount(config):
    config["mounts"][-1]["destination"] = "/readie/packages/moved"


def _loosen_mount(config):
    read_slot = next(m for m in config["mounts"] if m["destination"] == "/readie/grants/read-0")
    read_slot["options"] = ["rbind", "rw"]


def _readonly_root(config):
    config["root"]["readonly"] = True


def _drop_namespace(config):
    config["linux"]["namespaces"] = config["linux"]["namespaces"][:-1]


def _cwd(config):
    config["process"]["cwd"] = "/tmp"


@pytest.mark.parametrize(
    "mutate",
    [_set_args, _move_mount, _loosen_mount, _readonly_root, _drop_namespace, _cwd],
    ids=["args", "mount-destination", "mount-option", "root-readonly", "namespaces", "cwd"],
)
def test_fingerprint_changes_with_the_shape(mutate):
    config = spec().oci_config()
    changed = copy.deepcopy(config)
    mutate(changed)
    assert fingerprint(changed) != fingerprint(config)


@pytest.mark.parametrize(
    "plan",
    [MountPlan(3, 3, 1), MountPlan(2, 4, 1), MountPlan(2, 3, 2)],
    ids=["read", "write", "packages"],
)
def test_fingerprint_changes_with_slot_counts(plan):
    assert fingerprint(spec(plan=plan).oci_config()) != fingerprint(spec().oci_config())


@pytest.mark.parametrize(
    "flags",
    [
        ("--network=host", "--overlay2=root:memory"),
        ("--overlay2=root:memory",),
        ("--network=none", "--overlay2=none"),
        ("--network=none",),
    ],
    ids=["network-value", "network-absent", "overlay-value", "overlay-absent"],
)
def test_fingerprint_changes_with_network_and_overlay_flags(flags):
    config = spec().oci_config()
    assert fingerprint(config, flags) != fingerprint(config)


def test_fingerprint_is_prefixed_sha256():
    value = fingerprint(spec().oci_config())
    assert value.startswith("sha256:")
    assert len(value) == len("sha256:") + 64


def test_family_fingerprint_matches_a_real_sandbox_of_the_family():
    real = spec(
        env=capture_env(PLAN, ("numpy",)),
        sources={PurePosixPath("/readie/grants/write-1"): Path("/data/out")},
        memory_limit_bytes=1 << 30,
    )
    real_fingerprint = spec_fingerprint(real.oci_config(), FLAGS)
    assert family_fingerprint(ROOTFS, PLAN, FLAGS) == real_fingerprint
    assert family_fingerprint(ROOTFS, MountPlan(), FLAGS) != real_fingerprint


# --- environments ----------------------------------------------------------


def test_capture_env():
    env = capture_env(MountPlan(package_slots=3), ("numpy", "pandas"))
    assert env["EXECUTOR_MODE"] == "capture"
    assert env["EXECUTOR_DIR"] == str(EXECUTOR_DIR)
    assert env["PYTHONPATH"] == (
        "/opt/readie/site:/readie/packages/0:/readie/packages/1:/readie/packages/2"
    )
    assert env["READIE_PREIMPORT"] == "numpy,pandas"
    for key in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        assert env[key] == "1", key
    assert serve_env(("numpy", "pandas")).items() <= env.items()
    # Every capture draws its own string-hash seed (decision 23); no hook unless the plan names one.
    assert "PYTHONHASHSEED" not in env and "READIE_AFTER_RESTORE" not in env


def test_capture_env_hands_the_after_restore_hook_to_the_executor():
    env = capture_env(MountPlan(), (), "mylib.hooks:reseed")
    assert env["READIE_AFTER_RESTORE"] == "mylib.hooks:reseed"


def test_capture_env_without_package_slots_has_only_the_site():
    assert capture_env(MountPlan(package_slots=0), ())["PYTHONPATH"] == "/opt/readie/site"


def test_serve_env_has_no_capture_settings():
    env = serve_env(("numpy",))
    assert env["READIE_PREIMPORT"] == "numpy"
    forbidden = {"EXECUTOR_MODE", "EXECUTOR_DIR", "PYTHONPATH", *SINGLE_THREAD_ENV}
    assert forbidden.isdisjoint(env), forbidden & set(env)
    assert serve_env(())["READIE_PREIMPORT"] == ""


def test_mount_plan_json_round_trip():
    plan = MountPlan(read_slots=1, write_slots=0, package_slots=7)
    assert plan.to_json() == {"read": 1, "write": 0, "packages": 7}
    assert MountPlan.from_json(plan.to_json()) == plan
