"""Scenario 12: moving a file into and out of a session's workspace (issue 29).

A file of 1, 16 and 128 MiB (random bytes) goes up with ``Session.upload`` and
comes back with ``Session.download`` through ``readie.Pool``, the client a
user has, in chunks (``UPLOAD_CHUNK_BYTES`` up, ``DOWNLOAD_CHUNK_BYTES``
down). Two arms take turns at each size: ``local``, a ``readie pool`` with its
worker in-process, and ``routed``, a ``readie pool --router`` in front of one
``readie worker`` on loopback (``start_cluster``). Next to them, a ``cp`` of
the same bytes between two files on the host, the limit of what moving bytes
costs here. Figures are MB/s (10^6 bytes a second) and each arm's fraction of
the ``cp`` rate; every transfer is checked byte-exact.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import readie
from readie_rpc.testing import start_cluster

from .._bench import Bench

ARMS = ("local", "routed")
SIZES_MIB = (1, 16, 128)
SMOKE_SIZES_MIB = (1,)
# The 128 MiB file lives in the sandbox's memory, twice while the upload replaces it.
SESSION_MEMORY = "512m"


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    name = bench.names[0]
    if bench.pools.get(name) is None:
        return {"transfers": {"available": False, "reason": bench.pool_problems.get(name, "no readie pool")}}
    preload = bench.checkpoint(name).preimport
    sizes = SMOKE_SIZES_MIB if bench.smoke else SIZES_MIB
    cluster = start_cluster(bench.scratch / "transfers-cluster", bench.manifest_path, workers=1, warm=f"{name}=1",
                            slots=bench.settings.slots)
    try:
        with readie.Pool(workers=1, preload=preload, checkpoints=bench.manifest_path) as local, \
                readie.Pool(workers=1, preload=preload, checkpoints=bench.manifest_path,
                            router=cluster.address) as routed:
            pools = {"local": local, "routed": routed}
            entry = _measure(bench, pools, sizes)
    finally:
        cluster.stop()
    return {"transfers": {
        "available": True,
        "what": "Session.upload then Session.download of random bytes through readie.Pool: its in-process "
        "worker (local) vs readie pool --router in front of one readie worker (routed), taking turns; cp of "
        "the same bytes on the host as the limit. MB/s = 10^6 bytes/s",
        "checkpoint": name,
        **entry,
    }}


def _measure(bench: Bench, pools: dict[str, readie.Pool], sizes: tuple[int, ...]) -> dict[str, Any]:
    sessions = {arm: pools[arm].session(f"bench-transfers-{arm}", memory=SESSION_MEMORY) for arm in ARMS}
    by_size: dict[str, Any] = {}
    try:
        for arm in ARMS:
            sessions[arm].run("pass")  # open it: its restore is not a transfer's cost
        for index, mib in enumerate(sizes):
            data = os.urandom(mib * 2**20)
            digest = hashlib.sha256(data).hexdigest()
            entry: dict[str, Any] = {"cp_mb_s": _cp_rate(bench.scratch, data)}
            for arm in ARMS if index % 2 == 0 else ARMS[::-1]:
                bench.settle()
                entry[arm] = _round_trip(sessions[arm], data, digest, f"bench-{mib}.bin")
            for arm in ARMS:
                for way in ("upload", "download"):
                    entry[arm][f"{way}_over_cp"] = round(entry[arm][f"{way}_mb_s"] / entry["cp_mb_s"], 3)
            by_size[f"{mib}MiB"] = entry
    finally:
        for session in sessions.values():
            session.close()
    return {"sizes": by_size}


def _round_trip(session: readie.Session, data: bytes, digest: str, path: str) -> dict[str, Any]:
    started = time.perf_counter()
    session.upload(path, data)
    upload_s = time.perf_counter() - started
    checked = session.run(
        f"import hashlib\nprint(hashlib.sha256(open({path!r}, 'rb').read()).hexdigest())\n"
    ).raise_for_error()
    if checked.stdout.strip() != digest:
        raise AssertionError(f"{path}: the sandbox holds other bytes than were uploaded")
    started = time.perf_counter()
    back = session.download(path)
    download_s = time.perf_counter() - started
    if back != data:
        raise AssertionError(f"{path}: the download differs from the upload")
    return {
        "upload_s": round(upload_s, 4),
        "download_s": round(download_s, 4),
        "upload_mb_s": round(len(data) / upload_s / 1e6, 1),
        "download_mb_s": round(len(data) / download_s / 1e6, 1),
    }


def _cp_rate(scratch: Path, data: bytes) -> float:
    """MB/s of ``cp`` copying ``data`` between two files here (the source written and synced first)."""
    source, target = scratch / "cp-source.bin", scratch / "cp-target.bin"
    source.write_bytes(data)
    try:
        started = time.perf_counter()
        subprocess.run(["cp", str(source), str(target)], check=True)
        elapsed = time.perf_counter() - started
    finally:
        source.unlink(missing_ok=True)
        target.unlink(missing_ok=True)
    return round(len(data) / elapsed / 1e6, 1)
