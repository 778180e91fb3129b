"""docker-compose.yml and the images behind it, checked without a Docker engine (none runs here).

docker-compose validates the file; the commands it gives each service are
parsed by the readie CLIs' own argument parsers, and every container path they
name is one a volume, a secret or the image provides; every file the
Dockerfiles copy exists and is not excluded from the build context. The same
command lines run as processes in test_compose_processes.py.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from readie_router.cli import build_parser as router_parser
from readie_worker.cli import build_parser as worker_parser

from client.tests._compose_model import plan
from conftest import REPO

COMPOSE = Path(REPO) / "docker-compose.yml"
DOCKERFILES = [Path(REPO) / "docker" / name for name in ("worker.Dockerfile", "router.Dockerfile")]


def docker_compose(*args: str) -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is missing; scripts/setup-host.sh installs it (apt-get install docker-compose)")
        pytest.skip("docker-compose is not installed (Debian: apt-get install docker-compose)")
    completed = subprocess.run(
        [exe, "-f", str(COMPOSE), *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
        # Only the defaults this repository documents, whatever the caller's environment says.
        env={key: value for key, value in os.environ.items() if not key.startswith(("READIE_", "COMPOSE_"))},
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


@pytest.fixture(scope="module")
def config() -> dict:
    """The file as docker-compose resolves it (defaults interpolated, merge keys applied), parsed."""
    return yaml.safe_load(docker_compose("config"))


def test_the_compose_file_is_valid():
    assert docker_compose("config", "-q") == ""
    assert sorted(docker_compose("config", "--services").split()) == ["router", "worker-1", "worker-2"]


def test_every_service_command_is_accepted_by_its_cli(config):
    commands = {name: service["command"] for name, service in config["services"].items()}
    assert sorted(commands) == ["router", "worker-1", "worker-2"]
    routed = router_parser().parse_args(commands["router"][1:])
    assert routed.worker == ["worker-1:50061", "worker-2:50061"]
    assert routed.checkpoints == "/srv/readie/checkpoints"  # for Pool.Session
    # Every hop asks for the token (plaintext only within the host: --insecure).
    token = Path("/run/secrets/readie_token")
    assert (routed.token_file, routed.worker_token_file, routed.insecure) == (token, token, True)
    for name in ("worker-1", "worker-2"):
        assert commands[name][0] == "worker"
        worker = worker_parser().parse_args(commands[name][1:])
        assert worker.name == name and worker.listen == "0.0.0.0:50061"
        assert str(worker.checkpoints) == "/srv/readie/checkpoints"
        assert (worker.token_file, worker.insecure) == (token, True)
        # The container's own namespace is the network's way out (decision 36); the ceiling grants it.
        assert (worker.egress_netns, worker.egress_own_netns) == ("readie-egress", True)


def test_the_workers_get_the_checkpoints_and_the_rootfs_at_its_captured_path(config):
    services = config["services"]
    assert [name for name, service in services.items() if service.get("privileged")] == ["worker-1", "worker-2"]
    for name in ("worker-1", "worker-2"):
        assert f"{Path(REPO) / 'build' / 'checkpoints'}:/srv/readie/checkpoints:ro" in services[name]["volumes"]
        assert "/root/.cache/readie/rootfs:/root/.cache/readie/rootfs:ro" in services[name]["volumes"]


def test_every_container_path_a_command_names_is_a_volume_a_secret_or_the_images(config, tmp_path):
    """plan() raises ComposeBug for a path a container would not have (the router's checkpoints
    without their volume, say); the processes it plans are what test_compose_processes.py runs."""
    deployment = plan(config, tmp_path)
    router = deployment.services["router"]
    assert f"--checkpoints={REPO / 'build' / 'checkpoints'}" in router.argv
    assert router.argv[0] == str(REPO / ".venv" / "bin" / "readie")  # the ENTRYPOINT, from the checkout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_what_the_images_copy_exists_and_reaches_the_build_context(dockerfile):
    ignore = [line.strip() for line in Path(f"{dockerfile}.dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    sources = [
        source
        for line in dockerfile.read_text().splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for source in line.split()[1:-1]
    ]
    assert sources, "no COPY found"
    for source in sources:
        assert (Path(REPO) / source).exists(), source
        assert _included(source, ignore), f"{source} is excluded by {dockerfile.name}.dockerignore"


def _included(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore ``patterns`` (last match wins, ``!`` re-includes) let ``path`` through."""
    included = True
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern[1:] if negated else pattern
        body = body.rstrip("/")
        if body == "**" or fnmatch.fnmatch(path, body) or path.startswith(body + "/"):
            included = negated
    return included
