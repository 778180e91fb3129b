"""scripts/setup-host.sh on a real fresh Debian 12: a debootstrap minbase bookworm chroot.

The README promises that ``make run`` sets up a fresh Debian 12 machine with
Debian's own python3 and no pip. A minbase is the least such a machine can
be (no python3, no make, no CA bundle), so the script runs in one, as root,
and then everything it promises is checked inside: uv, both runsc binaries,
debootstrap, make, the test tools, Python 3.11 for uv, no pip in the system
Python and nothing outside dpkg in its site-packages. A second run, through
``make setup``, must install nothing.

The minbase is built once per fingerprint of what made it (suite, variant,
mirror, architecture, debootstrap's version, recipe) into a tarball under
``$READIE_CACHE/setup-chroot`` (decision 3's rules: staged, stamped last,
renamed into place; the stamp also holds the tarball's sha256, checked before
every use). The chroot's apt archives are a bind mount of
``$READIE_CACHE/apt-archives``, so a rerun downloads only the package lists
and what install-runsc.sh and pip fetch (apt re-checks every cached .deb
against the signed indexes, so the cache is not trusted either).

Needs root, debootstrap, chroot, mount and the network to Debian and PyPI: in
CI a missing one fails the test; elsewhere it is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO
from readie_pipeline.rootfs import cache_dir

SUITE = "bookworm"
VARIANT = "minbase"
MIRROR = "http://deb.debian.org/debian"
# Bump when the way the tarball is made changes in a way the inputs do not show.
RECIPE = 1
STAMP = "readie-layer.json"
TARBALL = "minbase.tar"
# debootstrap of a minbase fetches ~40 MB of .debs; a slow mirror takes minutes.
DEBOOTSTRAP_TIMEOUT_S = 20 * 60
# A cold setup downloads ~130 MB (.debs, package lists, uv's wheel) and
# unpacks ~425 packages; warm it took 2 min on a quiet 2-core VM, 5 on a loaded one.
SETUP_TIMEOUT_S = 25 * 60
# One command's check inside the chroot: each answers at once, or is broken.
CHECK_TIMEOUT_S = 120
# What the chroot's commands see: nothing of the host's environment (its PATH
# holds pyenv's uv and python, which would hide what the script installed).
CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
}
SRC = "opt/readie-src"  # where the repo's setup files go inside the chroot
UV_VERSION = "0.13.9"
RUNSC_VERSION = "0.0~20240729.0"
# Every place the system python3 imports installed packages from, root's user site included.
SITE_DIRS = "import json, site; print(json.dumps(site.getsitepackages() + [site.getusersitepackages()]))"
OLD_RUNSC = "/usr/local/lib/readie/runsc-0.0~20221219.0/runsc"

pytestmark = pytest.mark.timeout(DEBOOTSTRAP_TIMEOUT_S + SETUP_TIMEOUT_S + 10 * 60)


def _missing_prerequisite() -> str | None:
    if os.geteuid() != 0:
        return "not root (a chroot, mounts and apt need it)"
    for tool in ("debootstrap", "chroot", "mount", "umount", "tar"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make setup installs debootstrap)"
    return None


@pytest.fixture(scope="module")
def minbase_tarball() -> Path:
    missing = _missing_prerequisite()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"the setup-host chroot test must run in CI, but: {missing}")
        pytest.skip(missing)
    return _cached_minbase(cache_dir() / "setup-chroot")


def _fingerprint() -> str:
    inputs = {
        "suite": SUITE,
        "variant": VARIANT,
        "mirror": MIRROR,
        "arch": _run_text(["dpkg", "--print-architecture"]),
        "debootstrap": _run_text(["dpkg-query", "-W", "-f=${Version}", "debootstrap"]),
        "recipe": RECIPE,
    }
    return "sha256:" + hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _cached_minbase(root: Path) -> Path:
    """The minbase tarball for the current fingerprint, built if missing or not exactly as stamped."""
    fingerprint = _fingerprint()
    directory = root / fingerprint[7:23]
    if _verified(directory, fingerprint):
        return directory / TARBALL
    shutil.rmtree(directory, ignore_errors=True)  # half-built, foreign or altered: never trusted
    staging = root / f".staging-{directory.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        tree = staging / "tree"
        _run_logged(
            ["debootstrap", f"--variant={VARIANT}", SUITE, str(tree), MIRROR],
            staging / "debootstrap.log",
            DEBOOTSTRAP_TIMEOUT_S,
        )
        # A fresh machine has no .debs lying about; the test's own cache is mounted there.
        for deb in (tree / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        _run_logged(
            ["tar", "--numeric-owner", "--xattrs", "-C", str(tree), "-cf", str(staging / TARBALL), "."],
            staging / "tar.log",
            DEBOOTSTRAP_TIMEOUT_S,
        )
        shutil.rmtree(tree)
        stamp = {"fingerprint": fingerprint, "sha256": _sha256(staging / TARBALL), "built_at": time.time()}
        (staging / STAMP).write_text(json.dumps(stamp))
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory / TARBALL


def _verified(directory: Path, fingerprint: str) -> bool:
    try:
        stamp = json.loads((directory / STAMP).read_text())
        return stamp["fingerprint"] == fingerprint and stamp["sha256"] == _sha256(directory / TARBALL)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@pytest.fixture
def chroot(minbase_tarball: Path) -> Iterator[Path]:
    """A fresh minbase unpacked in a tmp dir with /proc, /sys, /dev and the apt cache mounted."""
    tmp = Path(tempfile.mkdtemp(prefix="readie-setup-chroot-"))
    root = tmp / "root"
    root.mkdir()
    mounted: list[Path] = []
    try:
        untar = ["tar", "--numeric-owner", "--xattrs", "-C", str(root), "-xpf", str(minbase_tarball)]
        _run_logged(untar, tmp / "untar.log", DEBOOTSTRAP_TIMEOUT_S)
        shutil.copyfile("/etc/resolv.conf", root / "etc/resolv.conf")
        # The machine's own trust anchors, as an admin would have put them on a
        # fresh host behind a TLS-inspecting egress proxy (this CI's): the
        # ca-certificates package that setup installs adds them to its bundle.
        local_cas = root / "usr/local/share/ca-certificates"
        local_cas.mkdir(parents=True, exist_ok=True)
        for ca in Path("/usr/local/share/ca-certificates").glob("*.crt"):
            shutil.copyfile(ca, local_cas / ca.name)
        # The chroot is thrown away: dpkg's fsync of each of ~30,000 files buys
        # it nothing and, on a loaded machine, doubles the setup's time.
        (root / "etc/dpkg/dpkg.cfg.d/readie-test-unsafe-io").write_text("force-unsafe-io\n")
        archives = cache_dir() / "apt-archives"
        (archives / "partial").mkdir(parents=True, exist_ok=True)
        for args, target in (
            (["-t", "proc", "proc"], "proc"),
            (["-t", "sysfs", "sysfs"], "sys"),
            (["--bind", "/dev"], "dev"),
            (["--bind", "/dev/pts"], "dev/pts"),  # apt logs dpkg's output through a pty
            (["--bind", str(archives)], "var/cache/apt/archives"),
        ):
            _run_text(["mount", *args, str(root / target)])
            mounted.append(root / target)
        source = root / SRC
        (source / "scripts").mkdir(parents=True)
        for name in ("scripts/setup-host.sh", "scripts/install-runsc.sh", "Makefile"):
            shutil.copy2(REPO / name, source / name)
        yield root
    finally:
        _kill_processes_in(root)
        for target in reversed(mounted):
            if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(target)], capture_output=True)
        still = _mounts_under(tmp)
        # Removing the tree through a live bind of /dev would delete the host's device nodes.
        assert not still, f"still mounted, {tmp} left in place: {still}"
        shutil.rmtree(tmp)


def test_setup_host_installs_everything_on_a_minbase_without_pip(chroot: Path) -> None:
    timings: dict[str, float] = {}
    packages_before = _installed_packages(chroot)

    started = time.monotonic()
    first = _in_chroot(chroot, ["bash", f"/{SRC}/scripts/setup-host.sh"], SETUP_TIMEOUT_S)
    timings["setup"] = time.monotonic() - started
    assert first.returncode == 0, f"setup-host.sh failed in the minbase chroot:\n{first.stdout[-4000:]}"

    checks = {
        ("uv", "--version"): f"uv {UV_VERSION}",
        ("runsc", "--version"): f"runsc version {RUNSC_VERSION}",
        (OLD_RUNSC, "--version"): "runsc version 0.0~20221219.0",
        ("debootstrap", "--version"): "debootstrap",
        ("make", "--version"): "GNU Make",
        ("ip", "-V"): "iproute2",
        ("node", "--version"): "v",
        ("npm", "--version"): ".",
        ("docker-compose", "version"): "docker-compose version",
        ("uv", "python", "find", "3.11"): "/usr/bin/python3.11",
        ("apt-mark", "showhold"): "runsc",
    }
    for command, expected in checks.items():
        done = _in_chroot(chroot, list(command), CHECK_TIMEOUT_S)
        assert done.returncode == 0 and expected in done.stdout, f"{' '.join(command)} in the chroot: {done.stdout}"

    # Debian's python3 still has no pip, and nothing but dpkg wrote into its site-packages.
    pip = _in_chroot(chroot, ["python3", "-m", "pip", "--version"], CHECK_TIMEOUT_S)
    assert pip.returncode != 0 and "No module named pip" in pip.stdout, pip.stdout
    where = _in_chroot(chroot, ["python3", "-c", SITE_DIRS], CHECK_TIMEOUT_S)
    assert where.returncode == 0, where.stdout
    site_dirs = json.loads(where.stdout.split("] ", 1)[1])
    assert "/usr/lib/python3/dist-packages" in site_dirs, site_dirs
    assert _not_from_dpkg(chroot, site_dirs) == [], "the system Python got packages dpkg does not know"
    # trixie never enters the machine's own sources (install-runsc.sh).
    sources = [p.read_text() for p in (chroot / "etc/apt").rglob("*.list")]
    assert sources and not any("trixie" in text for text in sources), sources

    started = time.monotonic()
    second = _in_chroot(chroot, ["make", "-C", f"/{SRC}", "setup"], SETUP_TIMEOUT_S)
    timings["make setup again"] = time.monotonic() - started
    assert second.returncode == 0, second.stdout[-4000:]
    assert "setup:" not in second.stdout, f"a second setup installed something:\n{second.stdout}"

    added = _installed_packages(chroot).keys() - packages_before.keys()
    installed_kb = sum(_installed_packages(chroot)[name] for name in added)
    # Seen with -s (pytest's capture off): what a run costs, for the README and the CI budget.
    print(
        f"\nsetup in a minbase chroot: {timings['setup']:.0f} s, second run {timings['make setup again']:.1f} s; "
        f"{len(added)} packages added, {installed_kb / 1024:.0f} MB installed\n{first.stdout}"
    )


def _in_chroot(root: Path, command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Runs ``command`` as root chrooted into ``root``, stdout and stderr together, each line
    prefixed with the seconds since start; its process group dies on timeout."""
    started = time.monotonic()
    lines: list[str] = []
    process = subprocess.Popen(
        ["chroot", str(root), "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in CHROOT_ENV.items()), *command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    # A reader thread, so the deadline holds even while the command prints nothing.
    reader = threading.Thread(
        target=lambda: lines.extend(f"[{time.monotonic() - started:6.1f}] {line}" for line in process.stdout),
        daemon=True,
    )
    reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        reader.join(CHECK_TIMEOUT_S)
        pytest.fail(f"{' '.join(command)} in the chroot did not finish in {timeout:.0f} s:\n{''.join(lines)[-4000:]}")
    reader.join(CHECK_TIMEOUT_S)
    return subprocess.CompletedProcess(command, process.returncode, "".join(lines), "")


def _installed_packages(root: Path) -> dict[str, int]:
    """Package -> installed size in KiB, from the chroot's dpkg status."""
    status = (root / "var/lib/dpkg/status").read_text(errors="replace")
    packages = {}
    for stanza in status.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line)
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            packages[fields["Package"]] = int(fields.get("Installed-Size", "0") or 0)
    return packages


def _not_from_dpkg(root: Path, site_dirs: list[str]) -> list[str]:
    """Entries of the system Python's site dirs (and root's user site) that no installed package ships."""
    owned = set()
    for listing in (root / "var/lib/dpkg/info").glob("*.list"):
        owned.update(line.strip() for line in listing.read_text(errors="replace").splitlines())
    strays = []
    for site in site_dirs:
        directory = root / site.lstrip("/")
        if directory.is_dir():
            for entry in directory.iterdir():
                path = "/" + str(entry.relative_to(root))
                if path not in owned and entry.name != "__pycache__":
                    strays.append(path)
    return sorted(strays)


def _mounts_under(directory: Path) -> list[str]:
    prefix = str(directory.resolve()) + "/"
    with open("/proc/self/mountinfo") as mountinfo:
        points = [line.split()[4] for line in mountinfo]
    return [point for point in points if point.startswith(prefix)]


def _kill_processes_in(root: Path) -> None:
    """Kills what our chroot commands left running there (a daemon a package started)."""
    wanted = str(root.resolve())
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "root") == wanted:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue


def _run_text(args: list[str]) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout.strip()


def _run_logged(args: list[str], log_path: Path, timeout: float) -> None:
    with open(log_path, "wb") as log:
        done = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(args[:3])} … exited {done.returncode}:\n{tail}")
