"""The checkpoint plan (``pipeline/checkpoints.toml``): parsed strictly, refused loudly."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from readie_worker.bundle import AFTER_RESTORE_HOOK, MAX_SLOTS, MountPlan
from readie_policy.config import read_toml
from readie_worker.errors import ConfigError

DEFAULT_PLAN = Path(__file__).with_name("checkpoints.toml")
# Checkpoint names become directory names and pool names.
_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class CheckpointPlan:
    name: str
    preimport: tuple[str, ...]
    # Run in every sandbox woken from this checkpoint, after readie re-seeds (decision 23).
    after_restore: str = ""


@dataclass(frozen=True)
class Plan:
    requirements: tuple[str, ...]
    mounts: MountPlan
    checkpoints: tuple[CheckpointPlan, ...]

    def select(self, names: list[str] | None) -> tuple[CheckpointPlan, ...]:
        if not names:
            return self.checkpoints
        known = {c.name: c for c in self.checkpoints}
        unknown = [name for name in names if name not in known]
        if unknown:
            raise PlanError(f"no checkpoint named {', '.join(unknown)} in the plan (have {', '.join(known)})")
        return tuple(known[name] for name in dict.fromkeys(names))


def load_plan(path: Path = DEFAULT_PLAN) -> Plan:
    try:
        raw = read_toml(path)  # as the config is read: a FIFO, a huge or a deeply nested file is refused
    except ConfigError as exc:
        raise PlanError(str(exc)) from None
    where = str(path)
    _only(raw, {"site", "mounts", "checkpoints"}, where)
    site = raw.get("site", {})
    _only(site, {"requirements"}, f"{where} [site]")
    requirements = _strings(site.get("requirements", []), f"{where} [site].requirements")
    mounts_raw = raw.get("mounts", {})
    _only(mounts_raw, {"read_slots", "write_slots", "package_slots"}, f"{where} [mounts]")
    counts = {key: _slots(mounts_raw.get(key, default), f"{where} [mounts].{key}")
              for key, default in (("read_slots", 4), ("write_slots", 4), ("package_slots", 2))}
    checkpoints = []
    tables = raw.get("checkpoints", {})
    if not isinstance(tables, dict):
        raise PlanError(f"{where}: checkpoints must be a table of [checkpoints.NAME] tables")
    for name, table in tables.items():
        if not _NAME.fullmatch(name):
            raise PlanError(f"{where}: checkpoint name {name!r} must match {_NAME.pattern}")
        _only(table, {"preimport", "after_restore"}, f"{where} [checkpoints.{name}]")
        modules = _strings(table.get("preimport", []), f"{where} [checkpoints.{name}].preimport")
        bad = [m for m in modules if not _MODULE.fullmatch(m)]
        if bad:
            raise PlanError(f"{where} [checkpoints.{name}].preimport: not module names: {', '.join(bad)}")
        hook = table.get("after_restore", "")
        if not isinstance(hook, str) or (hook and not AFTER_RESTORE_HOOK.fullmatch(hook)):
            raise PlanError(
                f"{where} [checkpoints.{name}].after_restore: must name a module or module:callable, got {hook!r}"
            )
        checkpoints.append(CheckpointPlan(name, tuple(dict.fromkeys(modules)), hook))
    if not checkpoints:
        raise PlanError(f"{where}: the plan lists no checkpoints")
    return Plan(tuple(requirements), MountPlan(counts["read_slots"], counts["write_slots"], counts["package_slots"]), tuple(checkpoints))


def _only(table: object, allowed: set[str], where: str) -> None:
    if not isinstance(table, dict):
        raise PlanError(f"{where}: must be a table")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise PlanError(f"{where}: unknown key {', '.join(unknown)}")


def _strings(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise PlanError(f"{where}: must be a list of non-empty strings")
    return value


def _slots(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SLOTS:
        raise PlanError(f"{where}: must be an integer from 0 to {MAX_SLOTS}")
    return value
