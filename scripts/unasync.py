"""Generate the client's sync modules from their async source.

    uv run python scripts/unasync.py           # rewrite the generated modules (make unasync)
    uv run python scripts/unasync.py --check   # exit 1 if a generated module drifted

``readie.AsyncSession`` is written once, in ``_async_session.py``; ``readie.Session``
(``_session.py``) is that text with the asyncio spelled as its blocking twin
(docs/decisions/0029-async-written-once.md). The rewrite is line by line, a
fixed list of word substitutions (:data:`RULES`), so a reader can predict every
line of the output from the source; a rule that no longer matches anything is
an error, so the list cannot collect dead rules. The generated module is
committed, and client/tests/test_unasync_drift.py fails when it is not what
this script makes from its source.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLIENT = REPO / "client" / "src" / "readie"
#: Async source -> generated sync module, both under the client package.
PAIRS = {"_async_session.py": "_session.py"}
#: Whole words only; applied in this order to every line, docstrings included
#: (they name the async classes, and their twins are the sync ones).
RULES: list[tuple[str, str]] = [
    (r"async def", "def"),
    (r"async with", "with"),
    (r"await ", ""),
    (r"__aenter__", "__enter__"),
    (r"__aexit__", "__exit__"),
    (r"Async([A-Z]\w*)", r"\1"),
    # asyncio.Lock -> threading.Lock: a session's steps wait for each other, on a thread or a task.
    (r"asyncio", "threading"),
]
_COMPILED = [(re.compile(rf"\b{pattern}"), replacement) for pattern, replacement in RULES]


def source_header(target: str) -> str:
    """The first line of a source: its one line the generated module does not copy."""
    return f"# The source of {target}: scripts/unasync.py generates it from this file; regenerate after a change.\n"


def generated_header(source: str) -> str:
    return f"# Generated from {source} by scripts/unasync.py: do not edit; change the source and regenerate.\n"


def unasync(text: str, source: str, target: str, used: set[int]) -> str:
    """``text`` (an async module) as its sync twin; ``used`` collects the rules that matched."""
    first, _, body = text.partition("\n")
    if first + "\n" != source_header(target):
        raise SystemExit(f"{source} must begin with: {source_header(target)}")
    lines = []
    for line in body.splitlines(keepends=True):
        for index, (pattern, replacement) in enumerate(_COMPILED):
            line, count = pattern.subn(replacement, line)
            if count:
                used.add(index)
        lines.append(line)
    return generated_header(source) + "".join(lines)


def generated(package: Path = CLIENT) -> dict[Path, str]:
    """Every generated module's path under ``package`` and the text it must hold."""
    used: set[int] = set()
    texts = {
        package / target: unasync((package / source).read_text(encoding="utf-8"), source, target, used)
        for source, target in PAIRS.items()
    }
    unused = [RULES[index][0] for index in range(len(RULES)) if index not in used]
    if unused:
        raise SystemExit(f"unasync rules that matched nothing (remove them): {unused}")
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated module is not up to date")
    parser.add_argument("--package", type=Path, default=CLIENT, help="the client package (default: this repo's)")
    options = parser.parse_args(argv)
    drifted = False
    for path, text in generated(options.package).items():
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current == text:
            continue
        if options.check:
            drifted = True
            sys.stderr.writelines(difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True), path.name, f"{path.name} (generated)"
            ))
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if drifted:
        print("generated modules are out of date: run uv run python scripts/unasync.py", file=sys.stderr)
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main())
