"""docker-compose.yml as processes on this host: what each service's container would run, with
only what Compose and Docker provide replaced by its stand-in (client/tests/test_compose_processes.py
lists the stand-ins and why).

Everything here is derived from `docker-compose config` output and the services' Dockerfiles, so a
change to either is what the processes run; nothing beside them repeats a path, port or flag.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import yaml

from conftest import REPO

COMPOSE = REPO / "docker-compose.yml"
# Where Docker puts a service's secrets, each under its target name (Compose file reference).
SECRETS_DIR = PurePosixPath("/run/secrets")
# `docker-compose config` is a parse and an interpolation; the rest is margin for a loaded host.
COMPOSE_TIMEOUT_S = 60
# Compose durations (stop_grace_period, HEALTHCHECK options): units as Go's time.ParseDuration.
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
# The container's own loopback, as a HEALTHCHECK inside it names it.
_CONTAINER_LOOPBACK = ("127.0.0.1", "localhost")
# Loopback addresses handed to services: 127.0.0.1 is the host's (published ports), so start above it.
FIRST_SERVICE_HOST = 2
LAST_SERVICE_HOST = 254


class ComposeBug(AssertionError):
    """The file asks for something a container would not have (a path no volume or secret provides)."""


def compose_config(environ: Mapping[str, str]) -> dict:
    """`docker-compose config`, parsed, with ``environ`` as the only READIE_/COMPOSE_ variables set."""
    exe = shutil.which("docker-compose")
    if exe is None:
        raise FileNotFoundError("docker-compose is missing; scripts/setup-host.sh installs it (apt-get install docker-compose)")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("READIE_", "COMPOSE_"))}
    completed = subprocess.run(
        [exe, "-f", str(COMPOSE), "config"], cwd=REPO, capture_output=True, text=True,
        timeout=COMPOSE_TIMEOUT_S, check=False, env={**env, **environ},
    )
    if completed.returncode != 0:
        raise ComposeBug(f"docker-compose config refused the file:\n{completed.stderr}")
    return yaml.safe_load(completed.stdout)


def duration_s(text: str | int | float) -> float:
    """A Compose/Docker duration (``45s``, ``1m30s``, ``500ms``) in seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)


@dataclass(frozen=True)
class Healthcheck:
    """A Dockerfile's ``HEALTHCHECK [OPTIONS] CMD [...]`` (exec form)."""

    command: tuple[str, ...]
    interval_s: float = 30.0  # Docker's defaults, where the Dockerfile names none
    timeout_s: float = 30.0
    start_period_s: float = 0.0
    retries: int = 3


@dataclass(frozen=True)
class Image:
    """What a service's Dockerfile puts in its image: the entry point, the health check, and
    which image paths hold which files of this checkout (its COPY lines and the venv uv makes)."""

    entrypoint: tuple[str, ...]
    healthcheck: Healthcheck
    stop_signal: str
    files: dict[str, Path]  # image path -> host path


def read_image(dockerfile: Path) -> Image:
    instructions = _instructions(dockerfile.read_text())
    workdir, env, files = PurePosixPath("/"), {}, {}
    entrypoint: tuple[str, ...] = ()
    healthcheck, stop_signal = None, "SIGTERM"
    for keyword, rest in instructions:
        if keyword == "WORKDIR":
            workdir = workdir / rest
        elif keyword == "ENV":
            env.update(_env_pairs(rest))
        elif keyword == "COPY" and "--from=" not in rest:
            *sources, dest = shlex.split(rest)
            target = workdir / dest
            for source in sources:
                # Into a directory (several sources, or a trailing slash, or "./"): under its own name.
                into = len(sources) > 1 or dest.endswith("/") or dest in (".", "./")
                files[str(target / Path(source).name if into else target)] = REPO / source
        elif keyword == "ENTRYPOINT":
            entrypoint = tuple(json.loads(rest))
        elif keyword == "HEALTHCHECK":
            healthcheck = _healthcheck(rest)
        elif keyword == "STOPSIGNAL":
            stop_signal = rest.strip()
    venv = env.get("UV_PROJECT_ENVIRONMENT")
    if venv is not None:  # `uv sync` made it from uv.lock: this checkout's venv is the same sync
        files[venv] = REPO / ".venv"
    if not entrypoint or healthcheck is None:
        raise ComposeBug(f"{dockerfile.name}: no ENTRYPOINT or no HEALTHCHECK")
    return Image(entrypoint, healthcheck, stop_signal, files)


def _instructions(text: str) -> list[tuple[str, str]]:
    lines, joined = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        joined += line.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        lines.append(joined)
        joined = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in lines]


def _env_pairs(rest: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in shlex.split(rest) if "=" in pair)


def _healthcheck(rest: str) -> Healthcheck:
    options, _, command = rest.partition("CMD")
    if not command.strip().startswith("["):
        raise ComposeBug(f"HEALTHCHECK wants the exec form CMD [...]: {rest}")
    values = dict(option.lstrip("-").split("=", 1) for option in options.split())
    return Healthcheck(
        command=tuple(json.loads(command)),
        interval_s=duration_s(values.get("interval", "30s")),
        timeout_s=duration_s(values.get("timeout", "30s")),
        start_period_s=duration_s(values.get("start-period", "0s")),
        retries=int(values.get("retries", 3)),
    )


@dataclass
class Service:
    """One service's container as a process: argv, environment, working dir, where it listens."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    runtime_dir: Path  # its private /tmp's readie runtime dir (READIE_RUNTIME_DIR)
    healthcheck: Healthcheck
    stop_grace_s: float
    depends_on_healthy: list[str]
    listens: dict[int, str] = field(default_factory=dict)  # container port -> where the process listens
    mounts: dict[str, Path] = field(default_factory=dict)  # container path -> host path


@dataclass
class Deployment:
    services: dict[str, Service]
    published: dict[str, str]  # "service:port" -> the host address Compose publishes it on
    secrets: dict[str, Path]  # secret name -> its file on the host

    def published_address(self, service: str) -> str:
        """Where a client on the host reaches ``service``: its one published port."""
        found = [address for key, address in self.published.items() if key.split(":")[0] == service]
        if len(found) != 1:
            raise ComposeBug(f"{service} publishes {len(found)} ports, not one: {self.published}")
        return found[0]


def plan(config: dict, base: Path) -> Deployment:
    """Every service of ``config`` (`docker-compose config`, parsed) as a :class:`Service`, with
    stand-ins for what Compose provides under ``base``; :class:`ComposeBug` for what it would not."""
    services = config["services"]
    secrets = {name: Path(spec["file"]) for name, spec in (config.get("secrets") or {}).items()}
    named_volumes = {name: base / "volumes" / name for name in (config.get("volumes") or {})}
    hosts = _service_hosts(services)
    deployment = Deployment({}, {}, secrets)
    for name, spec in services.items():
        home = base / name
        mounts = _mounts(name, spec, named_volumes, secrets)
        image = read_image(Path(spec["build"]["context"]) / spec["build"]["dockerfile"])
        published = dict(_published(spec))
        listens: dict[int, str] = {}
        resolve = _Resolver(name, mounts, image.files, hosts, published, listens)
        argv = [resolve.path(image.entrypoint[0], "ENTRYPOINT"), *image.entrypoint[1:], *map(resolve.argument, spec["command"])]
        # A container's own network namespace is not emulated: on the host, --egress-own-netns
        # would name the host's and turn its ip_forward on (worker/tests/test_egress_net.py proves it).
        argv = [arg for arg in argv if not arg.startswith(("--egress-netns=", "--egress-own-netns"))]
        service_env = {key: resolve.env(key, value) for key, value in _environment(spec).items()}
        for port, address in published.items():
            deployment.published[f"{name}:{port}"] = address
        # The container's own filesystem: an empty working dir, HOME and /tmp of its own.
        runtime_dir = home / "tmp" / "readie"
        for directory in (home / "workdir", home / "root", runtime_dir.parent):
            directory.mkdir(parents=True, exist_ok=True)
        health = image.healthcheck
        service = Service(
            name=name,
            argv=argv,
            env={
                "PATH": os.environ["PATH"], "HOME": str(home / "root"),
                "READIE_RUNTIME_DIR": str(runtime_dir), **service_env,
            },
            cwd=home / "workdir",
            runtime_dir=runtime_dir,
            healthcheck=Healthcheck(
                tuple(resolve.health(part) for part in health.command),
                health.interval_s, health.timeout_s, health.start_period_s, health.retries,
            ),
            stop_grace_s=duration_s(spec.get("stop_grace_period", "10s")),  # Docker's default
            depends_on_healthy=[
                dep for dep, how in _depends_on(spec).items() if how.get("condition") == "service_healthy"
            ],
            listens=listens,
            mounts=mounts,
        )
        if image.stop_signal != "SIGTERM" or spec.get("stop_signal", "SIGTERM") != "SIGTERM":
            raise ComposeBug(f"{name}: stops with {image.stop_signal}, the drain answers SIGTERM")
        deployment.services[name] = service
    for directory in named_volumes.values():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return deployment


def _service_hosts(services: Mapping[str, dict]) -> dict[str, str]:
    """A loopback address per service, free on every port any of them listens on or exposes."""
    ports = set()
    for spec in services.values():
        ports.update(int(str(port).split("/")[0]) for port in spec.get("expose", ()))
        ports.update(target for target, _ in _published(spec))
    hosts, candidate = {}, FIRST_SERVICE_HOST + os.getpid() % 100  # another run of this test picks others
    for name in services:
        while not all(_free(f"127.0.0.{candidate}", port) for port in ports):
            candidate += 1
            if candidate > LAST_SERVICE_HOST:
                raise OSError(f"no loopback address with ports {sorted(ports)} free")
        hosts[name] = f"127.0.0.{candidate}"
        candidate += 1
    return hosts


def _free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _mounts(name: str, spec: dict, named: dict[str, Path], secrets: dict[str, Path]) -> dict[str, Path]:
    mounts: dict[str, Path] = {}
    for volume in spec.get("volumes", ()):
        if isinstance(volume, str):  # docker-compose 1.x: SOURCE:TARGET[:MODE]
            source, target = volume.split(":")[:2]
        else:  # Compose v2: {type, source, target, read_only}
            source, target = volume["source"], volume["target"]
        if source in named:
            mounts[target] = named[source]
        elif source.startswith("/"):
            mounts[target] = Path(source)
        else:
            raise ComposeBug(f"{name}: volume source {source!r} is neither a host path nor a named volume")
    for secret in spec.get("secrets", ()):
        source = secret if isinstance(secret, str) else secret["source"]
        target = source if isinstance(secret, str) else secret.get("target", source)
        if source not in secrets:
            raise ComposeBug(f"{name}: secret {source!r} is not defined at the top level")
        mounts[str(SECRETS_DIR / target)] = secrets[source]
    return mounts


def _published(spec: dict) -> list[tuple[int, str]]:
    """(container port, host address) of each published port."""
    published = []
    for port in spec.get("ports", ()):
        if isinstance(port, str):  # 1.x: [HOST_IP:]HOST_PORT:CONTAINER_PORT[/PROTO]
            *host, target = port.split("/")[0].split(":")
            host_ip, host_port = (host if len(host) == 2 else ["0.0.0.0", *host])
        else:  # v2: {target, published, host_ip}
            target, host_ip, host_port = port["target"], port.get("host_ip", "0.0.0.0"), port["published"]
        # Published on every host interface: the test still listens on loopback only (it dials that).
        host_ip = "127.0.0.1" if host_ip in ("", "0.0.0.0") else host_ip
        published.append((int(target), f"{host_ip}:{host_port}"))
    return published


def _environment(spec: dict) -> dict[str, str]:
    env = spec.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def _depends_on(spec: dict) -> dict[str, dict]:
    deps = spec.get("depends_on") or {}
    return {dep: {} for dep in deps} if isinstance(deps, list) else deps


def lookup(mounts: Mapping[str, Path], path: str) -> Path | None:
    """The host path behind container ``path`` by the deepest of ``mounts`` holding it, or None."""
    for inside in sorted(mounts, key=len, reverse=True):
        if path == inside:
            return mounts[inside]
        if path.startswith(inside.rstrip("/") + "/"):
            return mounts[inside] / os.path.relpath(path, inside)
    return None


@dataclass
class _Resolver:
    """Container paths and addresses of one service, as its process on this host sees them."""

    service: str
    mounts: dict[str, Path]
    image_files: dict[str, Path]
    hosts: dict[str, str]
    published: dict[int, str]
    listens: dict[int, str]

    def argument(self, arg: str) -> str:
        flag, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        return f"{flag}{equals}{self.value(value, arg)}"

    def env(self, key: str, value: str) -> str:
        return self.value(value, f"environment {key}={value}")

    def value(self, value: str, where: str) -> str:
        if value.startswith("/"):
            return self.path(value, where)
        host, colon, port = value.rpartition(":")
        if not colon or not port.isdigit():
            return value
        if host == "0.0.0.0":  # listening on every interface of the container
            address = self.published.get(int(port), f"{self.hosts[self.service]}:{port}")
            self.listens[int(port)] = address
            return address
        if host in self.hosts:  # another service, by the name Compose's DNS answers
            return f"{self.hosts[host]}:{port}"
        if re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", host):  # a bare name is a service's or nothing
            raise ComposeBug(f"{self.service}: {where} names {host!r}, which is no service (have {sorted(self.hosts)})")
        return value

    def health(self, part: str) -> str:
        if part.startswith("/"):
            return self.path(part, "HEALTHCHECK")
        host, _, port = part.rpartition(":")
        if host in _CONTAINER_LOOPBACK and port.isdigit():
            if int(port) not in self.listens:
                raise ComposeBug(f"{self.service}: the HEALTHCHECK asks port {port}, the command listens on {sorted(self.listens)}")
            return self.listens[int(port)]
        return part

    def path(self, path: str, where: str) -> str:
        """The host path behind ``path`` in this container: a volume, a secret, else the image's files."""
        for table in (self.mounts, self.image_files):
            found = lookup(table, path)
            if found is not None:
                return str(found)
        raise ComposeBug(
            f"{self.service}: {where} names {path}, which no volume, secret or image file of the service provides "
            f"(volumes and secrets: {sorted(self.mounts)})"
        )
