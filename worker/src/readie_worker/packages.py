"""Per-call ``packages``: installed once per requirement set on the worker host, mounted read-only.

The sandbox never needs the network for its packages: uv installs them here,
into a cache keyed by the exact requirement set, and the directory is mounted
into one of the package slots planned at capture (already on ``sys.path``).
Only wheels are accepted: building an sdist would run its setup code on the
trusted host.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from readie_policy.jobs import validate_requirements

from . import _reaper
from .errors import RequestError, SandboxSetupError

# A cold install of a few wheels takes seconds; minutes mean a stuck index.
INSTALL_TIMEOUT_S = 300.0
STAMP = "readie-packages.json"


def package_cache() -> Path:
    return Path(os.environ.get("READIE_CACHE") or Path.home() / ".cache" / "readie") / "packages"


def ensure_packages(requirements: Sequence[str], cache: Path | None = None) -> Path:
    """The directory holding exactly ``requirements``, installing them on first use."""
    wanted = validate_requirements(requirements)
    key = hashlib.sha256(json.dumps({"python": sys.version_info[:2], "requirements": wanted}).encode()).hexdigest()[:20]
    root = cache or package_cache()
    target = root / key
    root.mkdir(parents=True, exist_ok=True)
    # One install per requirement set, across threads and worker processes alike.
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / STAMP).exists():
            return target / "site"
        staging = root / f".{key}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            completed = _reaper.run(
                ["uv", "pip", "install", "--quiet", "--only-binary", ":all:", "--python", sys.executable,
                 "--target", str(staging / "site"), *wanted],
                timeout=INSTALL_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise SandboxSetupError(f"installing {', '.join(wanted)} failed: {exc}") from None
        if completed.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise RequestError(f"cannot install {', '.join(wanted)}: {completed.stderr.strip()[-500:]}", field="packages")
        (staging / STAMP).write_text(json.dumps({"requirements": wanted}))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target / "site"
