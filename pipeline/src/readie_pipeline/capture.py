"""``make capture``: freeze executors with their imports done, and time them.

For each planned checkpoint: start the executor in capture mode under runsc,
wait for its announcement, check the template (one OS thread, no descriptors
beyond stdio), ``runsc checkpoint`` it, then time restores (measure mode, and
to a serving socket) against cold starts with the same imports.
"""

from __future__ import annotations

import datetime
import json
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from readie_executor import READY_MARKER
from readie_executor.digest import source_digest
from readie_executor.framing import PROTOCOL_VERSION
from readie_worker import runsc as runsc_module
from readie_worker.bundle import EXECUTOR_ARGV, SandboxSpec, capture_env, family_fingerprint, serve_env
from readie_worker.errors import SandboxSetupError
from readie_worker.manifest import (
    MANIFEST_NAME,
    Checkpoint,
    Manifest,
    ManifestError,
    image_files,
    read_manifest,
    verify_image,
    write_manifest,
)
from readie_worker.errors import CheckpointUnusable
from readie_worker.runsc import STDERR_SETTLE_S, Launched, Runsc
from readie_worker.launchers import RunscCold, RunscRestore
from readie_worker.sandbox import SandboxDir, hand_over, launch
from readie_worker import enter_mount_namespace
from readie_worker.paths import remove_tree
from readie_worker.state_dir import scratch_dir

from .plan import CheckpointPlan, Plan
from .rootfs import Rootfs, ensure_rootfs

log = structlog.get_logger("readie.capture")

# Pre-importing pandas takes ~1 s under systrap (~2-3 s under ptrace); a minute means something hangs.
CAPTURE_POINT_TIMEOUT_S = 120.0
# A template may hold stdin, stdout and stderr, nothing else: any other
# descriptor would be shared by every sandbox restored from it.
ALLOWED_FDS = frozenset({0, 1, 2})
MAX_TEMPLATE_THREADS = 1


class CaptureError(RuntimeError):
    pass


@dataclass(frozen=True)
class CaptureOptions:
    output: Path
    runs: int = 3
    only: tuple[str, ...] = ()
    force: bool = False  # recapture even checkpoints that are up to date
    runsc: str = "runsc"  # the binary: its version and features shape the images


Report = Callable[[str], None]


def capture(plan: Plan, options: CaptureOptions, report: Report) -> Manifest:
    selected = plan.select(list(options.only))
    enter_mount_namespace()  # sandbox dirs are tmpfs mounts (readie_worker._sandbox_dir)
    rootfs = ensure_rootfs(plan, report)
    runsc = Runsc(root=options.output / ".runsc-state", binary=options.runsc)
    runsc.sweep()
    version = runsc_module.features(runsc.binary).version
    fingerprint = family_fingerprint(rootfs.path, plan.mounts, runsc.family_flags)
    previous = _previous_entries(options.output, version, fingerprint, rootfs.fingerprint)
    captured: dict[str, Checkpoint] = {}
    with _scratch_dir() as scratch:
        for checkpoint in selected:
            if not options.force and _up_to_date(previous.get(checkpoint.name), checkpoint):
                report(f"[{checkpoint.name}] up to date (rootfs, runsc and spec unchanged; --force recaptures)")
                continue
            captured[checkpoint.name] = capture_one(checkpoint, plan, rootfs, runsc, options, scratch, report)
    manifest = Manifest(
        executor_protocol=PROTOCOL_VERSION,
        executor_digest=source_digest(),
        runsc_version=version,
        runsc_flags=runsc.family_flags,
        spec_fingerprint=fingerprint,
        rootfs=rootfs.path,
        rootfs_fingerprint=rootfs.fingerprint,
        python=rootfs.python,
        executor_argv=EXECUTOR_ARGV,
        mount_plan=plan.mounts,
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        checkpoints={**previous, **captured},
    )
    write_manifest(manifest, options.output / MANIFEST_NAME)
    return manifest


def capture_one(
    checkpoint: CheckpointPlan,
    plan: Plan,
    rootfs: Rootfs,
    runsc: Runsc,
    options: CaptureOptions,
    scratch: Path,
    report: Report,
) -> Checkpoint:
    name = checkpoint.name
    image_dir = options.output / name
    staging = options.output / f".{name}.new"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with _step(report, name, "capture point"):
        sandbox = SandboxDir.create(scratch, private=True)
        try:
            spec = SandboxSpec(
                rootfs=rootfs.path,
                executor_dir=sandbox.executor_dir,
                env=capture_env(plan.mounts, checkpoint.preimport, checkpoint.after_restore),
                plan=plan.mounts,
                unused_slot_source=sandbox.unused_slots,
            )
            spec.write(sandbox.path)
            launched = runsc.start_detached(["run", "--detach", "--bundle", str(sandbox.path), sandbox.id])
            try:
                try:
                    announced = runsc_module.wait_for_line(
                        launched.process.stdout, READY_MARKER.encode(), CAPTURE_POINT_TIMEOUT_S  # type: ignore[arg-type]
                    )
                except SandboxSetupError as exc:
                    raise CaptureError(f"checkpoint {name!r}: {exc}: {_tail(launched)}") from None
                verify_template(name, json.loads(announced))
                with _step(report, name, "checkpoint"):
                    runsc.checkpoint(sandbox.id, staging)
            finally:
                runsc.destroy(sandbox.id)
                launched.close()
        finally:
            sandbox.remove()
    staged = Checkpoint(
        name=name,
        preimport=checkpoint.preimport,
        after_restore=checkpoint.after_restore,
        image_path=staging.resolve(),
        files=image_files(staging),
        restore_p50_ms=0.0,
        cold_start_p50_ms=0.0,
        restore_to_socket_p50_ms=0.0,
    )
    base_env = capture_env(plan.mounts, checkpoint.preimport, checkpoint.after_restore)
    common = dict(runsc=runsc, rootfs=rootfs.path, plan=plan.mounts, base_env=base_env)
    restore = RunscRestore(image_path=staged.image_path, **common)  # type: ignore[arg-type]
    try:
        with _step(report, name, f"restore x{options.runs} (measure mode)"):
            restore_ms = [_time_measure_restore(restore, scratch) for _ in range(options.runs)]
        with _step(report, name, f"restore to socket x{options.runs}"):
            restored = [_time_to_socket(restore, scratch, checkpoint.preimport) for _ in range(options.runs)]
        with _step(report, name, f"cold start to socket x{options.runs}"):
            cold = [_time_to_socket(RunscCold(**common), scratch, checkpoint.preimport) for _ in range(options.runs)]  # type: ignore[arg-type]
    except SandboxSetupError as exc:
        # E.g. an after-restore hook that fails at every wake-up: no sandbox of this image would serve.
        shutil.rmtree(staging, ignore_errors=True)
        raise CaptureError(f"checkpoint {name!r}: a sandbox made from it does not serve: {exc}") from None
    shutil.rmtree(image_dir, ignore_errors=True)
    staging.rename(image_dir)
    return replace(
        staged,
        image_path=image_dir.resolve(),
        restore_p50_ms=round(statistics.median(restore_ms), 1),
        cold_start_p50_ms=round(statistics.median(ms for ms, _ in cold), 1),
        restore_to_socket_p50_ms=round(statistics.median(ms for ms, _ in restored), 1),
        idle_memory_bytes=_median_memory(restored),
    )


def verify_template(name: str, census: dict[str, list[dict[str, object]]]) -> None:
    """Refuse a template that would carry extra threads or descriptors into every sandbox."""
    threads = census.get("threads")
    fds = census.get("fds")
    if not isinstance(threads, list) or not isinstance(fds, list) or not threads:
        raise CaptureError(f"checkpoint {name!r}: the executor's census lacks its threads or descriptors")
    problems = []
    if len(threads) > MAX_TEMPLATE_THREADS:
        names = ", ".join(f"{t.get('name')} (tid {t.get('tid')})" for t in threads[1:])
        problems.append(f"{len(threads) - 1} thread(s) beyond the main one: {names}")
    extra = [fd for fd in fds if fd.get("fd") not in ALLOWED_FDS]
    if extra:
        names = ", ".join(f"fd {fd.get('fd')} -> {fd.get('target')}" for fd in extra)
        problems.append(f"open descriptor(s) beyond stdio: {names}")
    if problems:
        raise CaptureError(f"checkpoint {name!r} rejected: the template has " + "; ".join(problems))


def _time_measure_restore(restore: RunscRestore, scratch: Path) -> float:
    sandbox = SandboxDir.create(scratch, private=True)
    try:
        started = time.monotonic()
        launched = restore.start(sandbox, {})
        try:
            process = launched.process
            hand_over(process, {**serve_env(()), "EXECUTOR_DIR": restore.executor_dir(sandbox), "EXECUTOR_MODE": "measure"})
            assert process.stdout is not None
            if process.stdout.read():  # measure mode prints nothing and exits: EOF is the end of the restore
                raise CaptureError(f"measure-mode executor printed to stdout: {_tail(launched)}")
            return (time.monotonic() - started) * 1000
        finally:
            restore.destroy(sandbox, launched.process)
            launched.close()
    finally:
        sandbox.remove()


def _time_to_socket(launcher: RunscRestore | RunscCold, scratch: Path, preimport: tuple[str, ...]) -> tuple[float, int | None]:
    """Milliseconds until a sandbox's socket answers, and its memory cgroup's usage then."""
    sandbox = launch(launcher, scratch, serve_env(preimport))
    try:
        return sandbox.ready_ms, launcher.memory_usage(sandbox.dir)
    finally:
        sandbox.destroy()


def _median_memory(runs: list[tuple[float, int | None]]) -> int | None:
    measured = [usage for _, usage in runs if usage is not None]
    return int(statistics.median(measured)) if measured else None


def _up_to_date(previous: Checkpoint | None, planned: CheckpointPlan) -> bool:
    if previous is None or (previous.preimport, previous.after_restore) != (planned.preimport, planned.after_restore):
        return False
    try:
        verify_image(previous)
    except CheckpointUnusable:
        return False
    return True


def _previous_entries(output: Path, version: str, fingerprint: str, rootfs_fingerprint: str) -> dict[str, Checkpoint]:
    """Checkpoints of an earlier run that stay valid beside the ones captured now."""
    try:
        old = read_manifest(output / MANIFEST_NAME)
    except ManifestError:
        return {}
    if (old.runsc_version, old.spec_fingerprint, old.rootfs_fingerprint) != (version, fingerprint, rootfs_fingerprint):
        return {}
    return dict(old.checkpoints)


@contextmanager
def _scratch_dir() -> Iterator[Path]:
    # Socket paths are limited to 107 bytes, so sandboxes live under a short temp dir.
    path = scratch_dir("rdc-")
    try:
        yield path
    finally:
        remove_tree(path)


@contextmanager
def _step(report: Report, checkpoint: str, step: str) -> Iterator[None]:
    report(f"[{checkpoint}] {step} …")
    started = time.monotonic()
    yield
    report(f"[{checkpoint}] {step}: {time.monotonic() - started:.2f} s")


def _tail(launched: Launched) -> str:
    return launched.stderr.text(wait_s=STDERR_SETTLE_S)[-1500:].strip()


def format_table(manifest: Manifest) -> str:
    rows = [("checkpoint", "preimport", "image MB", "restore ms", "restore→socket ms", "cold→socket ms", "cold/restore")]
    for c in manifest.checkpoints.values():
        ratio = c.cold_start_p50_ms / c.restore_to_socket_p50_ms if c.restore_to_socket_p50_ms else float("nan")
        rows.append((
            c.name,
            ",".join(c.preimport) or "-",
            f"{c.size_bytes / 1e6:.1f}",
            f"{c.restore_p50_ms:.0f}",
            f"{c.restore_to_socket_p50_ms:.0f}",
            f"{c.cold_start_p50_ms:.0f}",
            f"{ratio:.1f}x",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)

