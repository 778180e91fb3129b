"""What /proc says about our sandboxes: CPU seconds, memory, and when things are quiet.

All of it reads /proc directly (no psutil: the bench adds no dependencies).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterable
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# settle(): a window this long with less CPU than QUIET_CPU_S in our process
# tree counts as quiet. CPU times come in 10 ms ticks, so this allows one tick
# (idle sentries' timers), while a restore or a destroy burns a core: 5 ticks.
SETTLE_WINDOW_S = 0.05
QUIET_CPU_S = 0.015
# A refill restore of pandas takes ~0.6 s here, ~2 s on a loaded machine; past
# this the machine is busy with someone else's work and we go on (counted).
SETTLE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    comm: str
    cpu_s: float  # utime + stime of the process itself (not its reaped children)
    reaped_cpu_s: float  # cutime + cstime: every descendant it has waited for


def processes() -> dict[int, Proc]:
    """A snapshot of every process: pid, parent, name, CPU seconds so far."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                raw = file.read()
        except OSError:
            continue  # exited between listdir and open
        comm = raw[raw.index(b"(") + 1 : raw.rindex(b")")].decode(errors="replace")
        fields = raw[raw.rindex(b")") + 2 :].split()
        table[int(entry)] = Proc(
            int(entry),
            int(fields[1]),
            comm,
            (int(fields[11]) + int(fields[12])) / CLOCK_TICKS,
            (int(fields[13]) + int(fields[14])) / CLOCK_TICKS,
        )
    return table


def descendants(table: dict[int, Proc], roots: Iterable[int]) -> set[int]:
    """The roots' descendants (not the roots), following parent links in ``table``."""
    children: dict[int, list[int]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read()
    except OSError:
        return b""


def sandbox_pids(sandbox_id: str, table: dict[int, Proc] | None = None) -> set[int]:
    """runsc-sandbox and runsc-gofer whose command line names the sandbox, plus their
    descendants: the sentry's stub processes (systrap and ptrace alike; empty cmdline)
    hold the application's address space, so leaving them out undercounts memory."""
    table = processes() if table is None else table
    marker = sandbox_id.encode()
    named = {pid for pid in table if marker in cmdline(pid)}
    return named | descendants(table, named)


def cpu_s(pids: Iterable[int], table: dict[int, Proc] | None = None) -> float:
    table = processes() if table is None else table
    return sum(table[pid].cpu_s for pid in pids if pid in table)


def tree_cpu_split(root: int) -> dict[str, float]:
    """All CPU ever used by ``root`` and its descendants, dead or alive, in three
    parts: ``root``'s own (the bench's clients), its child processes' own
    (``readie pool``'s Python: the engine and the worker), and the rest (the
    sandboxes and every runsc command, which the pool reaps).

    A process that has exited and been reaped lives on in its reaper's
    cutime/cstime; one still running counts its own. So the sum over the live
    tree of own + reaped CPU never loses a process and never counts one twice,
    and the difference of two readings is the tree's CPU in between.
    """
    table = processes()
    tree = descendants(table, [root]) | {root}
    total = sum(table[pid].cpu_s + table[pid].reaped_cpu_s for pid in tree if pid in table)
    bench = table[root].cpu_s if root in table else 0.0
    python = sum(proc.cpu_s for proc in table.values() if proc.ppid == root)
    return {"bench": bench, "pool_python": python, "sandboxes": total - bench - python}


def children_cpu_s() -> float:
    """CPU seconds of every reaped descendant. The worker's reaper adopts the
    sandbox and gofer (child subreaper), so a destroyed sandbox lands here."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def memory_kb(pids: Iterable[int]) -> dict[str, int]:
    """Rss and Pss summed from smaps_rollup. PSS splits shared pages (the runsc
    binary, the image's page cache) among the processes mapping them, so PSS
    sums across sandboxes; RSS would count shared pages once per sandbox."""
    total = {"rss_kb": 0, "pss_kb": 0}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as file:
                for line in file:
                    if line.startswith("Rss:"):
                        total["rss_kb"] += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        total["pss_kb"] += int(line.split()[1])
        except OSError:
            continue
    return total


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies over all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as file:
        values = [int(v) for v in file.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return float(sum(values) - idle), float(sum(values))


def busy_fraction(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """Share of all cores busy between two machine_cpu() readings (anyone's work)."""
    total = after[1] - before[1]
    return round((after[0] - before[0]) / total, 3) if total > 0 else None


class Settler:
    """Waits until our own process tree is quiet before an arm is timed.

    A warm pool refills in the background after every job, and a destroy may
    still be reaping; timing the next arm on top of that would charge one arm
    for another's work. Only our descendants count (the machine is shared);
    a runsc command still running always means "not yet".
    """

    def __init__(self, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.timeouts = 0
        self.waited_s = 0.0

    def __call__(self) -> None:
        if self.timeout_s <= 0:  # settling switched off (a smoke run)
            return
        started = time.monotonic()
        me = os.getpid()
        before = self._tree_cpu(me)
        while True:
            time.sleep(SETTLE_WINDOW_S)
            table = processes()
            tree = descendants(table, [me])
            now = cpu_s(tree, table)
            busy_command = any(table[pid].comm == "runsc" for pid in tree)
            # A process that exited in the window takes its CPU with it, so a
            # negative delta is "something ended": not quiet yet.
            if 0 <= now - before < QUIET_CPU_S and not busy_command:
                break
            if time.monotonic() - started > self.timeout_s:
                self.timeouts += 1
                break
            before = now
        self.waited_s += time.monotonic() - started

    @staticmethod
    def _tree_cpu(me: int) -> float:
        table = processes()
        return cpu_s(descendants(table, [me]), table)
