"""Restore every captured checkpoint under real runsc and talk to its executor."""

from __future__ import annotations

import dataclasses
import pickle
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from structlog.testing import capture_logs

from readie_worker.manifest import LoadedCheckpoints
from readie_worker.runsc import Runsc
from readie_worker.sandbox import Sandbox, checkpoint_factory

pytestmark = pytest.mark.runsc

# Set only at restore time; the executor must see it.
RESTORE_ONLY = {"READIE_TEST_RESTORE_ONLY": "restored"}


def call(sandbox: Sandbox, func, *args):
    """Play the client: pickle a call, unpickle the envelope (only a client may)."""
    # Test modules are not importable inside the sandbox: ship the code itself.
    cloudpickle.register_pickle_by_value(sys.modules[func.__module__])
    request = cloudpickle.dumps({"func": func, "args": args, "kwargs": {}})
    envelope = pickle.loads(sandbox.call(request, timeout=30))
    assert envelope["ok"], envelope
    return envelope["value"]


def report_state():
    import os
    import sys

    # Looked up before anything here imports: what the template brought along.
    preloaded = sorted(name for name in ("numpy", "pandas") if name in sys.modules)
    return {"preloaded": preloaded, "environ": dict(os.environ), "pid": os.getpid()}


def restore(runsc: Runsc, checkpoints: LoadedCheckpoints, name: str, run_dir: Path, **env: str) -> Sandbox:
    factory = checkpoint_factory(runsc, checkpoints.manifest, checkpoints.usable[name], run_dir)
    factory = dataclasses.replace(factory, env={**factory.env, **env})
    return factory.create()


@pytest.mark.parametrize("name", ["base", "numpy", "pandas"])
def test_restored_executor_has_its_preimports_and_the_new_environment(runsc, checkpoints, short_tmp, name):
    sandbox = restore(runsc, checkpoints, name, short_tmp, **RESTORE_ONLY)
    try:
        assert sandbox.launcher.name == "runsc-restore"
        state = call(sandbox, report_state)
    finally:
        sandbox.destroy()
    assert state["preloaded"] == sorted(checkpoints.usable[name].preimport)
    environ = state["environ"]
    assert environ["READIE_TEST_RESTORE_ONLY"] == "restored"
    assert environ["EXECUTOR_MODE"] == "sandbox"
    # Set in the capture environment only: gone after the restore's re-read.
    assert "OPENBLAS_NUM_THREADS" not in environ
    assert "PYTHONPATH" not in environ


def test_each_restore_is_a_fresh_copy_of_the_template(runsc, checkpoints, short_tmp):
    def remember():
        import builtins

        seen = getattr(builtins, "_readie_seen", None)
        builtins._readie_seen = "dirty"
        return seen

    first = restore(runsc, checkpoints, "base", short_tmp)
    second = restore(runsc, checkpoints, "base", short_tmp)
    try:
        assert call(first, remember) is None
        assert call(first, remember) == "dirty"  # same sandbox keeps state
        assert call(second, remember) is None  # another restore does not
    finally:
        first.destroy()
        second.destroy()


def test_sandbox_sees_its_own_rootfs_not_the_hosts(runsc, checkpoints, short_tmp):
    marker = short_tmp / "host-only-marker"
    marker.write_text("secret")

    def look(paths):
        import os

        return {path: os.path.exists(path) for path in paths} | {"hostname": open("/etc/hostname").read()}

    repo = str(Path(__file__).resolve().parents[2])
    sandbox = restore(runsc, checkpoints, "base", short_tmp)
    try:
        seen = call(sandbox, look, [str(marker), repo, str(Path(repo) / "pyproject.toml"), "/root/.cache"])
    finally:
        sandbox.destroy()
    assert seen == {
        str(marker): False,
        repo: False,
        str(Path(repo) / "pyproject.toml"): False,
        "/root/.cache": False,
        "hostname": "readie\n",
    }


def test_a_failed_restore_falls_back_to_a_cold_start(runsc, checkpoints, short_tmp):
    broken = dataclasses.replace(checkpoints.usable["numpy"], image_path=short_tmp / "no-such-image")
    factory = checkpoint_factory(runsc, checkpoints.manifest, broken, short_tmp)
    with capture_logs() as logs:
        sandbox = factory.create()
    try:
        assert sandbox.launcher.name == "runsc-cold"
        assert call(sandbox, report_state)["preloaded"] == ["numpy"]
    finally:
        sandbox.destroy()
    [fallback] = [entry for entry in logs if entry["event"] == "sandbox start failed; falling back"]
    assert fallback["fallback"] == "runsc-cold"
    assert fallback["error"].startswith("sandbox restore exited")
    # The host facts (command line, runsc's stderr) are in the log, not in the error.
    [failed] = [entry for entry in logs if entry["event"] == "runsc failed" and " restore " in entry["command"]]
    assert "no-such-image" in failed["command"] + failed["stderr"] and "no-such-image" not in fallback["error"]


def test_destroy_is_fast_and_leaves_nothing(runsc, checkpoints, short_tmp):
    sandbox = restore(runsc, checkpoints, "base", short_tmp)
    started = time.monotonic()
    sandbox.destroy()
    elapsed = time.monotonic() - started
    assert sandbox.id not in runsc.list_ids()
    assert not sandbox.dir.path.exists()
    # ~25 ms when we reap our own sandboxes, ~1.7 s (or 5 s) when nobody does.
    assert elapsed < 1.5, f"destroy took {elapsed:.2f} s: are orphans being reaped?"


def test_sweep_removes_containers_left_by_an_earlier_worker(checkpoints, short_tmp):
    state = Runsc(root=short_tmp / "state")
    (short_tmp / "run").mkdir()
    orphan = restore(state, checkpoints, "base", short_tmp / "run")
    try:
        assert state.list_ids() == [orphan.id]
        assert state.sweep() == [orphan.id]
        assert state.list_ids() == []
    finally:
        orphan.destroy()  # already gone from runsc: only its pipes and dir remain
