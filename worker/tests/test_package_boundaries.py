"""No package imports another package's private modules: each one's public API is what others use.

Read with ``ast`` from every source and test file of the workspace, so an
import inside a function, or one spelled ``from pkg._x import y``, counts.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

from conftest import REPO

# Workspace member dir -> the import package it ships, from the workspace itself:
# a member added later is checked without anyone remembering to list it here.
PACKAGES = {
    member: package.name
    for member in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]
    for package in (REPO / member / "src").iterdir()
    if package.is_dir() and (package / "__init__.py").exists()
}
OURS = frozenset(PACKAGES.values())
# Trees outside the members that are their own code: the bench and the adversarial suite use public APIs too.
OTHER_TREES = ("bench", "adversarial", "fixtures")


def imported_modules(tree: ast.AST) -> list[str]:
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg._x import y`` names pkg._x; ``from pkg import _x`` names pkg._x too.
            modules += [node.module] if is_private(node.module) else [f"{node.module}.{a.name}" for a in node.names]
    return modules


def is_private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split(".")[1:])


def private_imports(path: Path, own: str | None) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return sorted(
        {
            module
            for module in imported_modules(tree)
            if module.split(".")[0] in OURS and module.split(".")[0] != own and is_private(module)
        }
    )


def sources() -> list[tuple[Path, str | None]]:
    found = [(path, package) for member, package in PACKAGES.items() for path in (REPO / member).rglob("*.py")]
    found += [(path, None) for tree in OTHER_TREES for path in (REPO / tree).rglob("*.py")]
    return [(path, own) for path, own in found if "_pb2" not in path.name and ".venv" not in path.parts]


def test_no_package_imports_another_package_s_private_modules():
    offenders = {str(path.relative_to(REPO)): bad for path, own in sources() if (bad := private_imports(path, own))}
    assert offenders == {}


def test_the_check_sees_private_imports_in_every_spelling(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import readie_worker._mounts\n"
        "from readie_pool._events import result_line\n"
        "def f():\n    from readie_executor import _calls\n"
        "from readie_worker.jobs import CodeJob\n"  # public: fine
        "from ._x import y\n"  # relative: the package's own
    )
    assert private_imports(sample, "readie") == [
        "readie_executor._calls",
        "readie_pool._events",
        "readie_worker._mounts",
    ]
    assert private_imports(sample, "readie_worker") == ["readie_executor._calls", "readie_pool._events"]


def test_every_workspace_member_is_checked() -> None:
    assert set(PACKAGES.values()) >= {"readie_protocol", "readie_executor", "readie_worker", "readie_pool", "readie_router", "readie"}


#: What readie_protocol may import beside the standard library: the
#: host-function JSON codec, whose rules (function names, reply sizes, deep
#: values without recursion) request checks must share with the sandbox, and
#: the job bounds the sandbox's runner enforces (``max_output``'s ceiling).
#: Both are standard library only (they run in the sandbox's python3).
PROTOCOL_MAY_IMPORT = ("readie_executor.hostwire", "readie_executor.jobs")


def test_the_pool_protocol_needs_only_the_standard_library() -> None:
    """Any client may depend on readie_protocol: it must not pull in grpc, the worker, or anyone's packages."""
    for path in (REPO / "protocol" / "src").rglob("*.py"):
        for module in imported_modules(ast.parse(path.read_text())):
            top = module.split(".")[0]
            allowed = top in sys.stdlib_module_names or top in ("", "readie_protocol") or ".".join(module.split(".")[:2]) in PROTOCOL_MAY_IMPORT
            assert allowed, (path, module)
    executor = REPO / "executor" / "src" / "readie_executor"
    for path in (executor / "hostwire.py", *(executor / "jobs").glob("*.py")):
        for module in imported_modules(ast.parse(path.read_text())):
            assert module.split(".")[0] in sys.stdlib_module_names or module.startswith("readie_executor"), (path, module)


#: A module a reader can hold in their head; past it, a module is two ideas
#: (the issue that split the pool engine, the sandbox and the big test files).
MAX_MODULE_LINES = 500


def test_no_module_is_over_the_line_limit_outside_generated_code() -> None:
    skipped = {".venv", ".git", "build", "node_modules"}  # not ours, or made by the build
    modules = [
        path
        for path in REPO.rglob("*.py")
        if not skipped & set(path.relative_to(REPO).parts) and not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    ]
    long = {str(path.relative_to(REPO)): n for path in modules if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert len(modules) > 200 and long == {}, long


def test_the_worker_has_no_grpc_the_rpc_layer_does():
    """The worker is a library any front end drives; gRPC and protobuf are readie_rpc's alone. Only
    its command line (``readie worker``, cli.py) serves it through readie_rpc, which imports nothing
    of the worker (decision 27)."""
    cli = REPO / "worker" / "src" / "readie_worker" / "cli.py"
    for path in (REPO / "worker" / "src").rglob("*.py"):
        tops = {module.split(".")[0] for module in imported_modules(ast.parse(path.read_text()))}
        assert not tops & {"grpc", "grpc_health", "grpc_reflection", "google"}, path
        assert "readie_rpc" not in tops or path == cli, path
    assert "readie_rpc" in {module.split(".")[0] for module in imported_modules(ast.parse(cli.read_text()))}
    assert "readie_worker" not in package_imports()["readie_rpc"]


def test_the_client_imports_nothing_from_the_worker():
    """The client package talks to workers through readie_rpc and shares only readie_protocol's and
    readie_policy's values with them: a worker's internals can change without the client noticing."""
    for path in (REPO / "client" / "src").rglob("*.py"):
        for module in imported_modules(ast.parse(path.read_text())):
            assert module.split(".")[0] != "readie_worker", (path, module)


def package_imports() -> dict[str, set[str]]:
    """Each workspace package -> the other workspace packages its sources import, anywhere in them."""
    found: dict[str, set[str]] = {package: set() for package in OURS}
    for member, package in PACKAGES.items():
        for path in (REPO / member / "src").rglob("*.py"):
            if "_pb2" in path.name:
                continue
            tops = {module.split(".")[0] for module in imported_modules(ast.parse(path.read_text()))}
            found[package] |= (tops & OURS) - {package}
    return found


def test_no_two_packages_import_each_other():
    """A package per program, layered (docs/architecture.md): the imports between packages form no cycle,
    counting imports inside functions and TYPE_CHECKING blocks, so each package can be read, tested
    and shipped on top of the ones below it."""
    imports = package_imports()

    def below(package: str) -> set[str]:
        seen: set[str] = set()
        todo = [package]
        while todo:
            for other in imports[todo.pop()] - seen:
                seen.add(other)
                todo.append(other)
        return seen

    assert [package for package in sorted(OURS) if package in below(package)] == []
    assert "readie_pool" in imports["readie_router"] and "readie_router" not in below("readie_pool")


def test_every_package_declares_the_workspace_packages_it_imports():
    """A package installed on its own (a Docker image, a wheel) must bring what it imports."""
    imports = package_imports()
    undeclared = {}
    for member, package in PACKAGES.items():
        project = tomllib.loads((REPO / member / "pyproject.toml").read_text())["project"]
        declared = {re.split(r"[\[<>=~ ;]", requirement)[0].replace("-", "_") for requirement in project["dependencies"]}
        if missing := imports[package] - declared:
            undeclared[package] = sorted(missing)
    assert undeclared == {}


def workspace_modules(src_dirs: list[Path]) -> dict[str, Path]:
    """Every module under ``src_dirs`` by its dotted name; a package is its ``__init__.py``."""
    modules = {}
    for src in src_dirs:
        for path in src.rglob("*.py"):
            if "_pb2" in path.name:
                continue
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports anywhere in it (in a function, under TYPE_CHECKING).

    ``from pkg import x`` names ``pkg.x`` when that is a module, and ``pkg``
    itself: importing from a package runs its ``__init__``, so a submodule
    that does it while the ``__init__`` imports that submodule is a cycle.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            named += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            named += [base] + [f"{base}.{alias.name}" for alias in node.names]
    found = set()
    for module in named:
        while module and module not in modules:  # a name imported from a module: the module
            module = module.rpartition(".")[0]
        if module and module != name:
            found.add(module)
    return found


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """The sets of modules that import each other, directly or around a loop (Tarjan's strongly
    connected components), each sorted; none when the imports are layered."""
    graph = {name: module_imports(name, path, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in graph[name]:
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while (top := stack.pop()) != name:
                component.append(top)
            if component:
                cycles.append(sorted([name, *component]))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(cycles)


def test_no_two_modules_import_each_other():
    """Modules are split by concept, so their imports are layered too: no module-level cycle, counting
    imports inside functions and TYPE_CHECKING blocks (docs/decisions/0030-no-import-cycles.md)."""
    modules = workspace_modules([REPO / member / "src" for member in PACKAGES])
    assert len(modules) > 100
    assert import_cycles(modules) == []


def test_the_cycle_check_sees_cycles_in_every_spelling(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    sources = {
        "__init__.py": "from ._a import A\nfrom ._c import C\n",
        "_a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import B\n",
        "_b.py": "def f():\n    from pkg._a import A\n",  # inside a function, absolute
        "_c.py": "from . import _d\n",  # imports the package, whose __init__ imports _c
        "_d.py": "import os\n",
        "_e.py": "from ._d import x\nimport pkg._c\n",  # imports others, nobody imports it
    }
    for file, text in sources.items():
        (package / file).write_text(text)
    assert import_cycles(workspace_modules([tmp_path])) == [["pkg", "pkg._c"], ["pkg._a", "pkg._b"]]
