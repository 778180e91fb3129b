"""The digest of the executor's own source: what a checkpoint froze, and what a worker must match.

A checkpoint holds this package as it was when it was captured, frozen in a
running interpreter. A worker whose own copy differs speaks, in small ways,
another executor: a job field the frozen one refuses, a result field it does
not write. So the pipeline writes this digest into the manifest, and a
worker refuses a manifest whose digest is not its own, before any job runs,
rather than fail every job with an error that blames the request.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["source_digest"]


@functools.cache
def source_digest() -> str:
    """sha256 over this package's files (names and bytes, in order), bytecode caches left out."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return "sha256:" + digest.hexdigest()
