"""No worker module but ``_grant_fs`` reaches a host path by its string unless it is one of the
worker's own (decision 24): the next reader of a grant cannot bring back issue 27's hole 1.

Read with ``ast`` from the worker package's source. Every call (or reference:
a realpath handed on as a default counts) of a function that opens, lists,
stats, links, changes or removes a file by name (``os``, ``os.path``,
``shutil``, ``glob``, ``tempfile``, ``open``, the ``Path`` methods that
touch the disk, libc through ctypes) is found, with the function it sits
in. Outside ``_grant_fs.py`` each must be on :data:`ALLOWED`, a function at
a time, with the reason its paths are never a grant's or the workspace's; an
entry nothing uses any more fails too, so the list stays exact. A new use
fails the test until it goes through ``_grant_fs`` or is added here with its
reason, for a reviewer to read.

Not seen: a path handed to a subprocess (runsc is handed the worker's own
sandbox and state dirs only), and a method named like a ``Path`` method on
another type (``str.replace`` is why ``replace`` is not looked for;
``rename`` is).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass

from conftest import REPO

PACKAGE = REPO / "worker" / "src" / "readie_worker"
OWNER = "_grant_fs.py"

_OS = (
    "open", "scandir", "listdir", "walk", "fwalk", "stat", "lstat", "access", "unlink", "remove", "rmdir",
    "removedirs", "rename", "renames", "replace", "link", "symlink", "readlink", "chmod", "lchmod", "chown",
    "lchown", "chdir", "chroot", "mkdir", "makedirs", "mkfifo", "mknod", "truncate", "utime", "statvfs",
)
_OS_PATH = (
    "exists", "lexists", "isdir", "isfile", "islink", "ismount", "getsize", "getmtime", "getatime", "getctime",
    "realpath", "samefile",
)
#: Functions that reach a file by its name (dotted as imported).
BY_NAME = frozenset(
    [f"os.{name}" for name in _OS] + [f"os.path.{name}" for name in _OS_PATH]
    + ["builtins.open", "io.open", "ctypes.CDLL"]  # libc: mount(2) and the like take path strings too
)
#: Modules whose every function takes paths.
BY_NAME_MODULES = frozenset({"shutil", "glob", "tempfile"})
#: ``Path`` methods that touch the disk, called on anything that is not a module.
PATH_METHODS = frozenset({
    "iterdir", "glob", "rglob", "walk", "stat", "lstat", "exists", "is_dir", "is_file", "is_symlink", "is_mount",
    "open", "read_text", "read_bytes", "write_text", "write_bytes", "unlink", "rmdir", "mkdir", "touch", "chmod",
    "lchmod", "rename", "resolve", "readlink", "symlink_to", "hardlink_to", "samefile",
})

_PROC = "the kernel's own view of this process (/proc), not a file anyone else names"
_RUNSC = "runsc's state dir, the worker's own (private dirs: no grant may reach it)"
_CGROUP = "the sandbox's cgroup files (cgroupfs), the worker's own"
_CHECKPOINTS = (
    "the checkpoint cache and its manifest: the operator's and the pipeline's, never a request's "
    "(no grant may write them: template dirs are read-only to grants)"
)
_OPERATOR = "the operator's paths (config file, flags), trusted and resolved once (decision 10)"
_STORE = "the session store beneath its root's descriptor: private to the workers (no grant may reach it), each path opened O_NOFOLLOW by dir_fd"
_OWN = "a directory of the worker's own (run dir, sandbox dir tmpfs, images, scratch): private, no grant may reach it"

#: Module -> function (``Class.method``; ``<module>`` for module level) -> why its paths are never a grant's.
ALLOWED: Mapping[str, Mapping[str, str]] = {
    "_mounts.py": {
        "<module>": "libc's mount(2)/umount2(2): sources are descriptors (/proc/self/fd/N) or the worker's own dirs",
        "enter_mount_namespace": _PROC,
        "mounts_beneath": f"{_PROC}; realpath of the sandbox dir, the worker's own (mount points are reported resolved)",
    },
    "_socket_wait.py": {
        "connect_executor": f"{_OWN}: the executor's socket in the sandbox dir, opened O_PATH|O_NOFOLLOW",
    },
    "_reaper.py": {
        "become_subreaper": "libc's prctl(2): no path",
        "_orphans": _PROC,
        "_parent": _PROC,
    },
    "_sandbox_dir.py": {
        "SandboxDir.create": _OWN,
        "_plain": _OWN,
        "_populate": f"{_OWN}; grants are mounted from descriptors, never opened here",
        "_attach": f"{_OWN}: a slot's grant point in the sandbox dir tmpfs",
        "_mount_grant": f"{_OWN}; grants are mounted from descriptors, never opened here",
    },
    # Egress (decision 36): the kernel's network namespace files and sysctls, and the host's resolv.conf.
    "_nft.py": {
        "<module>": "the type of the loaded libnftables, named in an annotation: no call",
        "_libnftables": "libnftables, loaded by its soname: it speaks netlink and is handed no path",
    },
    "_netns.py": {
        "<module>": "libc's setns(2): takes a descriptor, no path",
        "enter": "a network namespace's file: ip's in /var/run/netns (root's) or this process's in /proc",
        "identity": "a network namespace's file in /var/run/netns (root's): its inode, nothing read",
        "write_sysctls.write": "/proc/sys/net as the namespace readie made sees it: the kernel's, not a file anyone names",
        "present": "ip's namespace files in /var/run/netns (root's)",
        "names": "ip's namespace files in /var/run/netns (root's)",
        "attach_own": "the calling thread's own network namespace in /proc: its inode, nothing read",
        "_stale_name": "ip's namespace file in /var/run/netns (root's): its type, size and mount, nothing read",
    },
    "egress_net.py": {"host_nameservers": "the host's /etc/resolv.conf: the operator's, read for the default egress_dns"},
    "bundle.py": {"SandboxSpec.write": "the OCI bundle in the sandbox's own dir"},
    "launchers.py": {"_RunscLauncher.hold_mounts": f"{_RUNSC}; {_PROC}", "LocalProcess.cpu_ns": _PROC},
    "cli.py": {"_manifest": f"whether --checkpoints names a directory: {_OPERATOR}"},
    "core.py": {
        "Worker._hold_grants": "realpath of the package cache dir ensure_packages made: the worker's own",
    },
    "hibernation.py": {"SessionImages._private": f"{_OWN}: a fresh dir for an image on its way into or out of the store"},
    # The session store (decision 32): the operator's dir, private to the worker (no grant may
    # reach it), hostile within (shared with other workers' volumes): every path beneath its
    # root is opened by descriptor, O_NOFOLLOW, and checked (_store_files).
    "_store_files.py": {
        "make_dir": _STORE, "copy_hashing": _STORE, "write_new": _STORE,
        "regular_sizes": _STORE, "_open": _STORE,
    },
    "_store_leases.py": {"lease_state": _STORE, "write_lease": _STORE, "LeaseKeeper._touch": _STORE},
    "_store_meta.py": {"read_store_key": f"{_OPERATOR}: --session-store-key, opened O_NOFOLLOW and checked (regular, 0600)"},
    "session_store.py": {
        "SessionStore.share": _STORE, "SessionStore._publish": _STORE, "SessionStore.let_go": _STORE,
        "SessionStore.copy_image": f"{_OWN}: the private dir an image is copied into",
    },
    "_store_layout.py": {
        "open_root": f"{_OPERATOR}: --session-store, opened O_NOFOLLOW and checked",
        "entry_names": _STORE, "generation_numbers": _STORE, "entry_bytes": _STORE, "last_touched": _STORE,
        "store_locked": _STORE,
    },
    "manifest.py": {
        "_parse": _CHECKPOINTS,
        "_sha256_no_follow": _CHECKPOINTS,
        "checkpoints_for": _CHECKPOINTS,
        "file_sha256": _CHECKPOINTS,
        "image_files": _CHECKPOINTS,
        "load_checkpoints": _CHECKPOINTS,
        "read_manifest": _CHECKPOINTS,
        "verify_image": _CHECKPOINTS,
        "write_manifest": _CHECKPOINTS,
    },
    "packages.py": {"ensure_packages": "the package cache: the worker's own, read-only to every grant"},
    "paths.py": {
        "remove_tree": f"{_OWN}: mounts beneath are detached first and never crossed, so no grant is entered",
        "_remove": "remove_tree's walk (by descriptor below its top, which is the worker's own)",
        "_first_subdirectory_emptying": "remove_tree's walk, by descriptor (dir_fd)",
        "remove_beneath": "empties a directory the caller holds by descriptor (the state dir: decision 25)",
        "canonical_dirs": "the worker's own and the operator's dirs, resolved once to guard them from grants",
        "code_dirs": "what the worker runs as root (its Python, sys.path, runsc), guarded from write grants",
    },
    "state_dir.py": {
        "StateDir.claim": f"{_OWN}: the state dir, checked (owner, mode, no link) and held by descriptor (decision 25)",
        "StateDir.prepare": f"{_OWN}: made beneath the state dir's descriptor",
        "StateDir.close": f"{_OWN}: the state dir this process made, removed at exit",
        "runtime_root": f"{_OWN}: the per-user runtime dir (0700, checked)",
        "_default_runtime_root": "whether /run exists, for root's default runtime dir (checked by runtime_root)",
        "scratch_dir": f"{_OWN}: a new dir under runtime_root",
        "_open_parent": f"{_OWN}: the state dir's parent, checked before the state dir is",
        "_make": f"{_OWN}: made 0700 beneath a held descriptor",
        "_open_own": f"{_OWN}: opened O_NOFOLLOW and checked to be this user's alone",
    },
    "runsc.py": {
        "available": "shutil.which: the runsc binary on $PATH",
        "Runsc.run": f"{_RUNSC}; an anonymous temp file for runsc's stderr",
        "Runsc.list_ids": _RUNSC,
        "Runsc.sweep": _RUNSC,
        "Runsc.release_paused": _RUNSC,
    },
    "cgroups.py": {
        "limit_memory": _CGROUP,
        "memory_usage": _CGROUP,
        "cpu_usage_ns": _CGROUP,
        "memory_limit": _CGROUP,
        "oom_killed": _CGROUP,
        "freeze": _CGROUP,
    },
    "_sentry.py": {
        "signal_sandbox_process": "runsc's pid file in the sandbox's own dir",
        "signal_sentry_pid": _PROC,
    },
    "testing.py": {
        "thread_count": _PROC, "_proc_stat": _PROC, "stopped": f"{_PROC}; {_CGROUP}",
    },
}


@dataclass(frozen=True, slots=True)
class Use:
    """One place a module reaches a file by its name."""

    module: str
    function: str
    reaches: str  # what it calls: "os.scandir", "Path.iterdir", "builtins.open"...
    line: int

    def __str__(self) -> str:
        return f"{self.module}:{self.line} in {self.function}: {self.reaches}"


class _Finder(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.names = {"open": "builtins.open"}  # local name -> what it was imported as
        self.scope: list[str] = []
        self.found: list[Use] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.names[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.names[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.level == 0:
            for alias in node.names:
                self.names[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Name(self, node: ast.Name) -> None:
        imported = self.names.get(node.id)
        if isinstance(node.ctx, ast.Load) and imported is not None and _by_name(imported):
            self._found(imported, node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = self._dotted(node)
        if dotted is None:
            self.generic_visit(node)
        elif _by_name(dotted):
            self._found(dotted, node)

    def visit_Call(self, node: ast.Call) -> None:
        called = node.func
        if isinstance(called, ast.Attribute) and called.attr in PATH_METHODS and self._dotted(called) is None:
            self._found(f"Path.{called.attr}", called)
        self.generic_visit(node)

    def _dotted(self, node: ast.expr) -> str | None:
        """``os.path.realpath`` as imported, when ``node`` is an attribute of an imported name."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.names:
            return None
        return ".".join([self.names[node.id], *reversed(parts)])

    def _found(self, reaches: str, node: ast.expr) -> None:
        self.found.append(Use(self.module, ".".join(self.scope) or "<module>", reaches, node.lineno))


def _by_name(dotted: str) -> bool:
    module, _, name = dotted.partition(".")
    return dotted in BY_NAME or (module in BY_NAME_MODULES and bool(name))


def uses(source: str, module: str) -> list[Use]:
    """Every place in ``source`` (the module file ``module``) that reaches a file by its name."""
    finder = _Finder(module)
    finder.visit(ast.parse(source, filename=module))
    return finder.found


def violations(sources: Mapping[str, str], allowed: Mapping[str, Mapping[str, str]] = ALLOWED) -> list[Use]:
    """The uses in ``sources`` (module file -> its text) outside the owner and the allow-list."""
    return [
        use
        for module, source in sorted(sources.items())
        if module != OWNER
        for use in uses(source, module)
        if use.function not in allowed.get(module, {})
    ]


def package_sources() -> dict[str, str]:
    return {path.relative_to(PACKAGE).as_posix(): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def test_only_the_owner_reaches_a_host_path_by_its_name():
    found = violations(package_sources())
    assert not found, (
        "worker modules reach files by name outside _grant_fs (decision 24): go through it, or, for a "
        "path that is the worker's own, add the function to ALLOWED with the reason:\n"
        + "\n".join(map(str, found))
    )


def test_every_allowed_function_still_reaches_a_file_by_name():
    sources = package_sources()
    used = {(use.module, use.function) for module, source in sources.items() for use in uses(source, module)}
    stale = [f"{module}: {function}" for module, functions in ALLOWED.items() for function in functions
             if (module, function) not in used]
    assert not stale, f"ALLOWED names functions that no longer reach a file by name (remove them): {stale}"
    assert OWNER in sources and uses(sources[OWNER], OWNER), "the owner is where the opening is"


# A reader added the way hole 1 was: by path, in a module that is not the owner.
_NEW_READER = '''
import os, shutil
from os import scandir as entries_of
from os.path import realpath
from pathlib import Path


def report(job, grant):
    names = [entry.name for entry in entries_of(job.allow_write[0])]
    names += [child.name for child in Path(grant).iterdir()]
    for _root, _dirs, files in os.walk(grant):
        names += files
    size = os.stat(grant + "/out.csv").st_size
    with open(os.path.join(grant, "out.csv")) as file:
        file.read()
    shutil.rmtree(grant)
    return names, size, realpath


class Files:
    def measure(self):
        return self.grant.stat().st_size
'''


def test_the_check_fails_on_a_reader_added_by_path():
    found = violations({"jobs.py": _NEW_READER})
    assert {(use.function, use.reaches) for use in found} == {
        ("report", "os.scandir"),
        ("report", "Path.iterdir"),
        ("report", "os.walk"),
        ("report", "os.stat"),
        ("report", "builtins.open"),
        ("report", "shutil.rmtree"),
        ("report", "os.path.realpath"),
        ("Files.measure", "Path.stat"),
    }, found
    assert violations({OWNER: _NEW_READER}) == []  # the owner may


def test_the_check_fails_when_the_real_package_gains_one():
    sources = package_sources()
    sources["jobs.py"] += _NEW_READER
    sources["paths.py"] += "\n\ndef sneak(grant):\n    return os.listdir(grant)\n"
    found = {(use.module, use.function) for use in violations(sources)}
    assert found == {("jobs.py", "report"), ("jobs.py", "Files.measure"), ("paths.py", "sneak")}
