"""The shell examples of README.md and docs/*.md: every one is valid shell, and the
``$ ``-prompted ones run for real, from a directory other than the checkout, with
no readie variable set, and print what the document shows (``...`` elides)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from readie_policy.locations import link_default

from client.tests._prompts import prompt_examples
from conftest import CHECKPOINTS, REPO

DOCUMENTS = [Path(REPO) / "README.md", *sorted((Path(REPO) / "docs").glob("*.md")), Path(REPO) / "client" / "README.md"]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
# A fenced block without a language is shell when every line reads as a command line.
SHELL_START = re.compile(r"^(\$ |make |readie |docker-compose |docker compose |head |uv |READIE_\w+=|#)")
SHELL_FENCES = {"sh", "bash", "shell", "console"}
EXAMPLE_TIMEOUT_S = 180


def shell_blocks() -> list[tuple[str, list[str]]]:
    """(where, lines) of each shell block, prompts stripped from the command lines."""
    blocks = []
    for path in DOCUMENTS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            fence, body = match.groups()
            lines = [line for line in body.splitlines() if line.strip()]
            if not lines or fence not in SHELL_FENCES | {""}:
                continue
            if fence == "" and not all(SHELL_START.match(line) for line in lines if not _output(lines, line)):
                continue
            where = f"{path.relative_to(REPO)}:{text[: match.start()].count(chr(10)) + 2}"
            blocks.append((where, lines))
    return blocks


def _output(lines: list[str], line: str) -> bool:
    # In a block with prompts, the lines without one are what the command printed.
    return any(other.startswith("$ ") for other in lines) and not line.startswith("$ ")


def examples() -> list[tuple[str, str, list[str]]]:
    """(where, command, expected output lines) of each ``$ `` line."""
    return [(where, command, expected) for where, lines in shell_blocks() for command, expected in prompt_examples(lines)]


def commands() -> list[tuple[str, str]]:
    return [
        (where, line[2:] if line.startswith("$ ") else line)
        for where, lines in shell_blocks()
        for line in lines
        if not _output(lines, line)
    ]


def test_the_headline_example_is_found():
    assert any(command.endswith("| readie pool --preload=pandas,numpy") for _, command, _ in examples())


@pytest.mark.parametrize(("where", "command"), commands(), ids=[where for where, _ in commands()])
def test_every_shell_example_is_valid_shell(where, command):
    checked = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True, timeout=10, check=False)
    assert checked.returncode == 0, f"{where}: {command}\n{checked.stderr}"


def matches(expected: str, actual: str) -> bool:
    """``actual`` (a JSON line) re-encoded as the docs write JSON, against ``expected`` where
    ``...`` stands for anything (and the ``, `` beside it for nothing)."""
    try:
        shown = json.dumps(json.loads(actual))
    except ValueError:
        shown = actual
    pattern = ".*".join(re.escape(part) for part in re.split(r"(?:, )?\.\.\.(?:, )?", expected))
    return re.fullmatch(pattern, shown) is not None


def test_the_matcher():
    line = '{"id": "t1", "exit": 0, "stdout": "True\\n", "policy": {"network": "deny", "backend": "gvisor:x"}}'
    assert matches('{"id": "t1", "exit": 0, ..., "policy": {..., "backend": "gvisor:x"}}', line)
    assert not matches('{"id": "t1", "exit": 1, ...}', line)


@pytest.mark.runsc
@pytest.mark.parametrize(("where", "command", "expected"), examples(), ids=[where for where, _, _ in examples()])
def test_the_prompted_examples_run_from_anywhere(where, command, expected, tmp_path):
    # A user who ran `make capture` in the checkout: the per-user default links to its
    # checkpoints, made by the function `make capture` uses, under a home of the test's own.
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    link_default(CHECKPOINTS, {"HOME": str(home)})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {
        "HOME": str(home),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]),
        "LANG": "C.UTF-8",
    }
    ran = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S, check=False,
    )
    assert ran.returncode == 0, f"{where}: {command}\n{ran.stderr[-3000:]}"
    printed = ran.stdout.splitlines()
    assert len(printed) == len(expected), f"{where}: printed\n{ran.stdout}"
    for want, got in zip(expected, printed, strict=True):
        assert matches(want, got), f"{where}:\n  documented: {want}\n  printed:    {got}"
