"""docs/quickstart.md, run for real: every fenced block either runs here or says why not.

* ```console`` / ```sh`` blocks: each ``$ `` line runs in bash from the repository's root,
  with the venv's bin on PATH (as the quickstart's ``export PATH`` leaves it); the lines
  after it, up to the next ``$ ``, are what it must print on stdout, line for line.
* ```python`` blocks: each runs as a script of its own under the venv's python, in an
  empty directory of its own (they write files), and must exit 0; the ```text`` block right
  after it is what it must print on stdout, line for line.
* Any other block, or one of the above that cannot run here, must be preceded by an
  ``<!-- not run: why -->`` comment. A block that is neither run nor marked fails the test,
  so the page cannot grow an example nobody checks.

Expected lines match as in test_readme_examples: ``...`` stands for anything (and the ``, ``
beside it for nothing), and a JSON line is compared as ``json.dumps`` writes it.

Both run as a user who ran ``make run`` would: no readie variable set, and a home whose
``~/.cache/readie/checkpoints`` links to the checkpoints (made by the function ``make
capture`` uses), which is how ``readie mcp``, started by an MCP client with a minimal
environment, finds them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from readie_policy.locations import link_default

from client.tests._prompts import prompt_examples
from conftest import CHECKPOINTS, REPO

QUICKSTART = Path(REPO) / "docs" / "quickstart.md"
VENV_BIN = Path(sys.executable).parent
SHELL_FENCES = {"sh", "bash", "shell", "console"}
PYTHON_FENCES = {"python", "py"}
OUTPUT_FENCES = {"text", "output"}
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")
SYSTEM_PATH = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
#: One example: a pool's start-up and a few jobs take 2-4 s here.
EXAMPLE_TIMEOUT_S = 60


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    fence: str
    body: str
    not_run: str | None  # the reason given, when marked

    @property
    def where(self) -> str:
        return f"docs/quickstart.md:{self.line}"


@dataclass(frozen=True)
class Example:
    where: str
    kind: str  # "shell" or "python"
    source: str  # a shell command line, or a Python script
    expected: tuple[str, ...]  # the stdout lines shown


def blocks(text: str) -> list[Block]:
    """Every fenced block, with the ``not run`` mark of the line before it (blank lines between allowed)."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, language = opening.groups()
        start = i
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            i += 1
        if i == len(lines):
            raise AssertionError(f"docs/quickstart.md:{start + 1}: a fence that is never closed")
        assert indent == "", f"docs/quickstart.md:{start + 1}: an indented fence; the test reads fences at column 0"
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        mark = NOT_RUN.match(lines[before].strip()) if before >= 0 else None
        found.append(Block(start + 1, language, "\n".join(lines[start + 1 : i]), mark.group(1) if mark else None))
        i += 1
    return found


def examples(text: str) -> list[Example]:
    """The examples to run, in order; raises AssertionError for a block neither run nor marked."""
    found: list[Example] = []
    unchecked: list[str] = []
    all_blocks = blocks(text)
    used_as_output: set[int] = set()
    for index, block in enumerate(all_blocks):
        if block.not_run is not None or index in used_as_output:
            continue
        if block.fence in SHELL_FENCES:
            found.extend(_shell_examples(block, unchecked))
        elif block.fence in PYTHON_FENCES:
            following = all_blocks[index + 1] if index + 1 < len(all_blocks) else None
            expected: tuple[str, ...] = ()
            if following is not None and following.fence in OUTPUT_FENCES and following.not_run is None \
                    and _only_blank_between(text, block, following):
                expected = tuple(following.body.splitlines())
                used_as_output.add(index + 1)
            else:
                unchecked.append(f"{block.where}: a python block without a ```text block of its output right after it")
            found.append(Example(block.where, "python", block.body + "\n", expected))
        else:
            unchecked.append(f"{block.where}: a ```{block.fence} block this test does not run")
    assert not unchecked, "blocks neither run nor marked `<!-- not run: why -->`:\n  " + "\n  ".join(unchecked)
    return found


def _shell_examples(block: Block, unchecked: list[str]) -> list[Example]:
    lines = [line for line in block.body.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("$ "):
        unchecked.append(f"{block.where}: a shell block whose first line is not a `$ ` command")
        return []
    return [Example(block.where, "shell", command, tuple(expected)) for command, expected in prompt_examples(lines)]


def _only_blank_between(text: str, first: Block, second: Block) -> bool:
    lines = text.splitlines()
    closing = first.line + len(first.body.splitlines())  # 0-based index of first's closing fence
    return all(not line.strip() for line in lines[closing + 1 : second.line - 1])


def matches(expected: str, actual: str) -> bool:
    """``actual`` against ``expected``, where ``...`` stands for anything and the ``, `` beside
    it for nothing; a JSON object or array is compared as ``json.dumps`` writes it."""
    shown = actual
    try:
        value = json.loads(actual)
    except ValueError:
        pass
    else:
        if isinstance(value, (dict, list)):
            shown = json.dumps(value)
    pattern = ".*".join(re.escape(part) for part in re.split(r"(?:, )?\.\.\.(?:, )?", expected))
    return re.fullmatch(pattern, shown) is not None


def check_output(example: Example, stdout: str) -> None:
    printed = stdout.splitlines()
    shown = "\n".join(example.expected)
    assert len(printed) == len(example.expected), (
        f"{example.where}: printed {len(printed)} lines, the doc shows {len(example.expected)}\n"
        f"--- printed\n{stdout}--- shown\n{shown}"
    )
    for want, got in zip(example.expected, printed, strict=True):
        assert matches(want, got), f"{example.where}:\n  documented: {want}\n  printed:    {got}"


# ---------------------------------------------------------------------------- no gVisor needed


def test_every_block_is_run_or_marked():
    found = examples(QUICKSTART.read_text())
    kinds = [example.kind for example in found]
    assert kinds.count("shell") >= 3 and kinds.count("python") >= 7, kinds
    marked = [block for block in blocks(QUICKSTART.read_text()) if block.not_run is not None]
    assert {block.fence for block in marked} >= {"sh", "json"}, marked  # make run, the MCP client config


def test_the_blocks_not_run_still_parse():
    for block in blocks(QUICKSTART.read_text()):
        if block.not_run is None:
            continue
        if block.fence == "json":
            json.loads(block.body)
        elif block.fence in PYTHON_FENCES:
            compile(block.body, block.where, "exec")
        elif block.fence in SHELL_FENCES:
            checked = subprocess.run(["bash", "-n", "-c", block.body], capture_output=True, text=True, timeout=10)
            assert checked.returncode == 0, f"{block.where}: {checked.stderr}"


def test_an_unmarked_block_fails():
    page = "Some text.\n\n```toml\n[pool]\n```\n"
    with pytest.raises(AssertionError, match=r"```toml block this test does not run"):
        examples(page)
    assert examples("<!-- not run: an operator's file -->\n```toml\n[pool]\n```\n") == []
    with pytest.raises(AssertionError, match="without a ```text block"):
        examples("```python\nprint(1)\n```\n\nprose\n\n```text\n1\n```\n")
    with pytest.raises(AssertionError, match="not a `\\$ ` command"):
        examples("```sh\nmake run\n```\n")


def test_the_matcher():
    assert matches('{"id": "t1", "exit": 0, ..., "policy": {..., "backend": "gvisor:x"}}',
                   '{"id": "t1", "exit": 0, "stdout": "", "policy": {"network": "deny", "backend": "gvisor:x"}}')
    assert not matches('{"id": "t1", "exit": 1, ...}', '{"id": "t1", "exit": 0}')
    assert matches("42", "42") and not matches("42", "420")
    assert matches("True Error: ... (line 1)", "True Error: ZeroDivisionError: division by zero (line 1)")


# ---------------------------------------------------------------------------- run for real


def _examples() -> list[Example]:
    try:
        return examples(QUICKSTART.read_text())
    except AssertionError:
        return []  # test_every_block_is_run_or_marked says why


@pytest.fixture(scope="module")
def user_env(tmp_path_factory, checkpoints) -> dict[str, str]:
    """The environment of a user after ``make run``: a home linking the checkpoints, the venv on PATH."""
    home = tmp_path_factory.mktemp("quickstart-home")
    home.chmod(0o700)
    link_default(CHECKPOINTS, {"HOME": str(home)})
    return {
        "HOME": str(home),
        "PATH": os.pathsep.join([str(VENV_BIN), *SYSTEM_PATH]),
        "LANG": "C.UTF-8",
    }


@pytest.mark.runsc
@pytest.mark.parametrize("example", _examples(), ids=lambda example: f"{example.where}:{example.kind}")
def test_the_example_prints_what_the_doc_shows(example, user_env, tmp_path):
    if example.kind == "shell":
        argv, cwd = ["bash", "-o", "pipefail", "-c", example.source], REPO
    else:
        script = tmp_path / "example.py"
        script.write_text(example.source)
        argv, cwd = [str(VENV_BIN / "python"), str(script)], tmp_path
    ran = subprocess.run(
        argv, cwd=cwd, env=user_env, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S, check=False,
    )
    assert ran.returncode == 0, f"{example.where}: exit {ran.returncode}\n{example.source}\n{ran.stderr[-3000:]}"
    check_output(example, ran.stdout)
