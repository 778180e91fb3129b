"""The checkpoint plan: the shipped one loads, anything odd is refused naming file and key."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

from readie_pipeline.plan import DEFAULT_PLAN, MAX_SLOTS, CheckpointPlan, PlanError, load_plan
from readie_worker.bundle import MountPlan

MINIMAL = "[checkpoints.base]\npreimport = []\n"


@pytest.fixture
def write(tmp_path: Path):
    def write(text: str) -> Path:
        path = tmp_path / "checkpoints.toml"
        path.write_text(text)
        return path

    return write


def refused(path: Path, *fragments: str) -> str:
    with pytest.raises(PlanError) as error:
        load_plan(path)
    message = str(error.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


# --- the shipped plan ------------------------------------------------------


def test_shipped_plan_loads():
    plan = load_plan()
    assert DEFAULT_PLAN.name == "checkpoints.toml"
    assert plan.checkpoints == (
        CheckpointPlan("base", ()),
        CheckpointPlan("numpy", ("numpy",)),
        CheckpointPlan("pandas", ("pandas", "numpy")),
    )
    assert plan.mounts == MountPlan(read_slots=4, write_slots=4, package_slots=2)


def test_shipped_requirements_are_pinned_and_include_cloudpickle():
    requirements = load_plan().requirements
    assert requirements
    for requirement in requirements:
        name, sep, version = requirement.partition("==")
        assert sep and name and version, f"{requirement!r} is not pinned with =="
    names = {requirement.partition("==")[0] for requirement in requirements}
    assert {"cloudpickle", "numpy", "pandas"} <= names


def test_shipped_cloudpickle_pin_matches_the_client():
    # The sandbox unpickles what the client pickled with the workspace's cloudpickle.
    pins = dict(r.partition("==")[::2] for r in load_plan().requirements)
    assert pins["cloudpickle"] == importlib.metadata.version("cloudpickle")


def test_shipped_preimports_are_in_the_requirements():
    plan = load_plan()
    names = {requirement.partition("==")[0] for requirement in plan.requirements}
    for checkpoint in plan.checkpoints:
        for module in checkpoint.preimport:
            assert module.split(".")[0] in names, (checkpoint.name, module)


# --- a good plan -----------------------------------------------------------


def test_minimal_plan_uses_default_slots_and_no_requirements(write):
    plan = load_plan(write(MINIMAL))
    assert plan.requirements == ()
    assert plan.mounts == MountPlan(4, 4, 2)
    assert plan.checkpoints == (CheckpointPlan("base", ()),)


def test_duplicate_preimports_are_removed_keeping_order(write):
    text = '[checkpoints.sci]\npreimport = ["pandas", "numpy", "pandas", "os.path", "numpy"]\n'
    plan = load_plan(write(text))
    assert plan.checkpoints[0].preimport == ("pandas", "numpy", "os.path")


def test_checkpoint_order_follows_the_file(write):
    plan = load_plan(write("[checkpoints.zeta]\n[checkpoints.alpha]\n[checkpoints.mid-2]\n"))
    assert [c.name for c in plan.checkpoints] == ["zeta", "alpha", "mid-2"]


@pytest.mark.parametrize("count", [0, MAX_SLOTS])
def test_slot_count_bounds_are_accepted(write, count):
    mounts = f"[mounts]\nread_slots = {count}\nwrite_slots = {count}\npackage_slots = {count}\n"
    plan = load_plan(write(mounts + MINIMAL))
    assert plan.mounts == MountPlan(count, count, count)


# --- refused plans ---------------------------------------------------------


def test_unknown_top_level_key(write):
    refused(write("checkpoint = 1\n" + MINIMAL), "unknown key checkpoint")


def test_unknown_key_in_site(write):
    path = write('[site]\nrequirement = ["numpy==2"]\n' + MINIMAL)
    refused(path, "[site]", "unknown key requirement")


def test_unknown_key_in_mounts(write):
    refused(write("[mounts]\nread_slot = 2\n" + MINIMAL), "[mounts]", "unknown key read_slot")


def test_unknown_key_in_a_checkpoint_table(write):
    path = write('[checkpoints.base]\npreimport = []\nimports = ["os"]\n')
    refused(path, "[checkpoints.base]", "unknown key imports")


def test_checkpoint_that_is_not_a_table(write):
    refused(write("[checkpoints]\nbase = 1\n"), "[checkpoints.base]", "must be a table")


@pytest.mark.parametrize("name", ["Base", "9lives", "a" * 33, "with.dot", "has space", "-dash", ""])
def test_bad_checkpoint_name(write, name):
    refused(write(f'[checkpoints."{name}"]\npreimport = []\n'), f"checkpoint name {name!r}")


def test_longest_checkpoint_name_is_accepted(write):
    assert load_plan(write(f"[checkpoints.{'a' * 32}]\n")).checkpoints[0].name == "a" * 32


@pytest.mark.parametrize("value", ['"numpy"', "[1]", '[""]', "{ numpy = true }"])
def test_preimport_not_a_list_of_strings(write, value):
    path = write(f"[checkpoints.base]\npreimport = {value}\n")
    refused(path, "[checkpoints.base].preimport", "list of non-empty strings")


def test_preimport_not_module_names(write):
    message = refused(
        write(
            '[checkpoints.base]\npreimport = ["numpy", "scikit-learn", "1abc", "a..b", "os.path"]\n'
        ),
        "[checkpoints.base].preimport",
        "not module names: scikit-learn, 1abc, a..b",
    )
    assert "os.path" not in message.partition("not module names")[2]


def test_requirements_not_a_list_of_strings(write):
    refused(write('[site]\nrequirements = "numpy"\n' + MINIMAL), "[site].requirements")


@pytest.mark.parametrize("key", ["read_slots", "write_slots", "package_slots"])
@pytest.mark.parametrize("value", ["-1", str(MAX_SLOTS + 1), "true", "2.0", '"2"'])
def test_bad_slot_count(write, key, value):
    path = write(f"[mounts]\n{key} = {value}\n" + MINIMAL)
    refused(path, f"[mounts].{key}", f"from 0 to {MAX_SLOTS}")


@pytest.mark.parametrize(
    "text", ["", '[site]\nrequirements = ["numpy==2.4.6"]\n', "[checkpoints]\n"]
)
def test_no_checkpoints(write, text):
    refused(write(text), "no checkpoints")


def test_invalid_toml(write):
    refused(write("[checkpoints.base\npreimport = []\n"))


def test_a_plan_is_read_as_the_config_is(write, tmp_path):
    """Deep nesting (tomllib's RecursionError), bytes that are not UTF-8 and a FIFO (which would
    block open() for ever) are refusals naming the file, like any other bad plan."""
    refused(write("[site]\nrequirements = " + "[" * 5000 + "]" * 5000 + "\n"), "nested too deeply")
    path = tmp_path / "checkpoints.toml"
    path.write_bytes(b"[site]\nrequirements = [\"\xff\"]\n")
    refused(path, "not valid UTF-8")
    path.unlink()
    os.mkfifo(path)
    refused(path, "not a regular file (a FIFO)")


def test_missing_file(tmp_path):
    refused(tmp_path / "absent.toml", "No such file")


def test_checkpoints_that_are_not_a_table(write):
    refused(write("checkpoints = [1]\n"), "checkpoints", "must be a table")


@pytest.mark.parametrize(
    "text",
    ['[checkpoints."base\\n"]\npreimport = []\n', '[checkpoints.base]\npreimport = ["numpy\\n"]\n'],
    ids=["name", "module"],
)
def test_trailing_newline_is_refused(write, text):
    refused(write(text))


# --- select ----------------------------------------------------------------


def test_select_everything_by_default():
    plan = load_plan()
    assert plan.select(None) == plan.checkpoints
    assert plan.select([]) == plan.checkpoints


def test_select_keeps_the_requested_order():
    plan = load_plan()
    assert [c.name for c in plan.select(["pandas", "base"])] == ["pandas", "base"]


def test_select_unknown_names_are_named():
    with pytest.raises(PlanError) as error:
        load_plan().select(["nope", "base", "gone"])
    assert str(error.value) == (
        "no checkpoint named nope, gone in the plan (have base, numpy, pandas)"
    )


def test_an_after_restore_hook_is_read_per_checkpoint(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('[checkpoints.base]\nafter_restore = "mylib.hooks:reseed"\n[checkpoints.other]\n')
    assert [c.after_restore for c in load_plan(path).checkpoints] == ["mylib.hooks:reseed", ""]


@pytest.mark.parametrize("hook", ['"not a module"', '"mylib:"', "3", '["mylib"]'])
def test_an_after_restore_hook_that_is_no_name_is_refused(tmp_path, hook):
    path = tmp_path / "plan.toml"
    path.write_text(f"[checkpoints.base]\nafter_restore = {hook}\n")
    with pytest.raises(PlanError, match=r"\[checkpoints.base\].after_restore: must name a module"):
        load_plan(path)
