"""The demo behind `make run` (until `readie pool` lands): restore pandas-ready
gVisor sandboxes from the captured checkpoint and run cloudpickled calls in them.

Each call is pickled here, runs inside a sandbox that was restored with pandas
already imported, and comes back as an envelope that only this client opens.
"""

from __future__ import annotations

import pickle
import sys
import tempfile
import time
from pathlib import Path

import cloudpickle

from readie_worker import runsc as runsc_module
from readie_worker.bundle import family_fingerprint
from readie_worker.logs import configure_logging
from readie_worker.manifest import load_checkpoints, read_manifest
from readie_worker.runsc import Runsc
from readie_worker.sandbox import checkpoint_factory

MANIFEST = Path("build/checkpoints/manifest.json")


def groupby_total():
    import sys

    import pandas as pd

    frame = pd.DataFrame({"product": ["tea", "cake", "tea", "jam"], "amount": [3, 5, 4, 2]})
    print("pandas was preloaded:", "pandas" in sys.modules)
    return frame.groupby("product").amount.sum().to_dict()


def look_at_the_host():
    import os

    return {"hostname": open("/etc/hostname").read().strip(), "sees /work": os.path.exists("/work")}


def fail():
    raise ValueError("raised inside the sandbox")


def main() -> int:
    configure_logging(level="warning")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    manifest = read_manifest(MANIFEST)
    runsc = Runsc(root=Path(tempfile.mkdtemp(prefix="readie-demo-state-")))
    loaded = load_checkpoints(
        MANIFEST,
        runsc_version=runsc_module.version(),
        spec_fingerprint=family_fingerprint(manifest.rootfs, manifest.mount_plan, runsc.flags),
        strict=True,
    )
    run_dir = Path(tempfile.mkdtemp(prefix="rdd-", dir="/tmp"))
    factory = checkpoint_factory(runsc, manifest, loaded.usable["pandas"], run_dir)
    for func in (groupby_total, look_at_the_host, fail):
        started = time.monotonic()
        sandbox = factory.create()
        try:
            envelope = pickle.loads(sandbox.call(cloudpickle.dumps({"func": func, "args": (), "kwargs": {}})))
        finally:
            sandbox.destroy()
        total_ms = (time.monotonic() - started) * 1000
        shown = {k: v for k, v in envelope.items() if k != "traceback"}
        print(f"{func.__name__}: {shown}  [{sandbox.launcher.name}, ready {sandbox.ready_ms:.0f} ms, total {total_ms:.0f} ms]")
    runsc.sweep()
    return 0


if __name__ == "__main__":
    sys.exit(main())
