"""An agent tool on readie.Pool: a model's Python runs in a fresh gVisor sandbox per call.

    uv run python examples/agent_tool.py

``run_python`` is what you hand a model as a tool (its docstring is the
description the model reads). It runs each call as a job of one long-lived
``readie pool``, with read access to the project's ``data/`` and write
access to its ``out/``, and turns the result into the text the model sees
next: what the code printed, and the error if it failed. Nothing the code
does outlives the call except files written under ``out/``.

Run as a script, it sets up a small project in a temp dir and makes the
tool calls a model might make, printing each one's output. It needs the
checkpoints from ``make capture`` (found through $READIE_CHECKPOINTS, else
build/checkpoints of this repository) and runs offline.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path

import readie

REPO = Path(__file__).resolve().parent.parent
# What the model's code may touch, relative to the project dir.
READ_DIRS = ["data"]
WRITE_DIRS = ["out"]
# Per call: enough for real analysis, short enough that a stuck loop costs little.
TIMEOUT = "10s"
MEMORY = "512m"
# What the model reads back is cut here: its context is precious, and the pool
# already caps each stream at max_output (this is per stream).
MAX_OUTPUT = 16 * 1024

_pool: readie.Pool | None = None
_pool_lock = threading.Lock()
_project: Path | None = None


def run_python(code: str) -> str:
    """Run Python 3.11 code in a fresh, isolated sandbox and return what it printed.

    Use print() to see results: only stdout and stderr come back, not the
    value of the last expression. Every call starts from a clean interpreter,
    so variables and imports do not carry over between calls; import what you
    need each time. The working directory is the project: read input files
    under data/ (read-only) and write any files you want to keep under out/.
    Nothing else on the machine is readable or writable, there is no network,
    and starting processes is not allowed. Each call may run for 10 seconds
    and use 512 MB of memory. The standard library is available.

    Returns stdout, then stderr, then a line describing the error if the code
    failed (for example "PermissionError: ... (line 3)").
    """
    result = pool().run(
        code,
        name="tool_call.py",
        allow_read=READ_DIRS,
        allow_write=WRITE_DIRS,
        timeout=TIMEOUT,
        memory=MEMORY,
        max_output=MAX_OUTPUT,
    )
    return format_result(result)


def format_result(result: readie.Result) -> str:
    """The text a model reads back: output first, then what went wrong, stated plainly."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n") + ("\n[stdout truncated]" if result.stdout_truncated else ""))
    if result.stderr and result.error is None:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.error is not None:
        line = f" (line {result.error.line})" if result.error.line else ""
        parts.append(f"Error: {result.error.type}: {result.error.message}{line}")
        if result.error.hint:
            parts.append(f"Hint: {result.error.hint}")
    elif result.exit != 0:
        parts.append(f"Exited with status {result.exit}")
    return "\n".join(parts) if parts else "(no output)"


def pool() -> readie.Pool:
    """The one pool every tool call shares, started on first use, closed at exit."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = readie.Pool(workers=2, cwd=project(), checkpoints=_checkpoints())
            atexit.register(_pool.close)
        return _pool


def project() -> Path:
    """The project the tool works on: $AGENT_PROJECT, else a demo project in a temp dir."""
    global _project
    if _project is None:
        given = os.environ.get("AGENT_PROJECT")
        _project = Path(given) if given else _demo_project()
        for name in READ_DIRS + WRITE_DIRS:
            (_project / name).mkdir(parents=True, exist_ok=True)
    return _project


def _demo_project() -> Path:
    path = Path(tempfile.mkdtemp(prefix="agent-project-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    (path / "data").mkdir()
    (path / "data" / "orders.csv").write_text("product,amount\ntea,3\ncake,5\ntea,4\njam,2\n")
    return path


def _checkpoints() -> Path | None:
    if os.environ.get("READIE_CHECKPOINTS"):
        return None  # readie pool reads it itself
    built = REPO / "build" / "checkpoints"
    return built if built.is_dir() else None


# What a model might send, one tool call each.
DEMO_CALLS = [
    (
        "sum the orders by product",
        (
            "import csv\n"
            "from collections import Counter\n"
            "totals = Counter()\n"
            "for row in csv.DictReader(open('data/orders.csv')):\n"
            "    if row['product'] != 'jam':\n"
            "        totals[row['product']] += int(row['amount'])\n"
            "print(dict(sorted(totals.items())))\n"
        ),
    ),
    (
        "save a summary",
        (
            "import csv, json\n"
            "rows = list(csv.DictReader(open('data/orders.csv')))\n"
            "json.dump({'orders': len(rows)}, open('out/summary.json', 'w'))\n"
            "print('wrote out/summary.json')\n"
        ),
    ),
    ("a variable from the previous call is gone", "print(rows)\n"),
    ("write outside the grants", "open('/etc/motd', 'w').write('hi')\n"),
]


def main() -> None:
    for title, code in DEMO_CALLS:
        print(f"--- {title}")
        print(run_python(code))
    kept = sorted(str(p.relative_to(project())) for p in (project() / "out").iterdir())
    print(f"--- files kept in out/: {kept}")
    pool().close()


if __name__ == "__main__":
    main()
