"""No two classes of the workspace's sources share a name (decision 0028): a name says which one.

Read with ``ast`` from every module under a member's ``src/``, nested classes
included, so a new class that takes a name already in use fails here.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

from conftest import REPO

MEMBERS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]

def class_names() -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for member in MEMBERS:
        for path in sorted((REPO / member / "src").rglob("*.py")):
            if "_proto" in path.parts:  # generated from proto/: ours subclass its servicers by design
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    found[node.name].append(f"{Path(path).relative_to(REPO)}:{node.lineno}")
    return found


def test_no_two_classes_share_a_name() -> None:
    found = class_names()
    assert {"Worker", "PoolEngine", "SandboxSetupError", "ArchiveMember"} <= found.keys()  # every member was read
    shared = {name: where for name, where in found.items() if len(where) > 1}
    assert shared == {}, shared
