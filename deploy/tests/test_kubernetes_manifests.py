"""deploy/kubernetes/: every manifest validated against a pinned Kubernetes version, and every
command in it parsed by the readie CLIs' own argument parsers (no cluster runs here).

Checked, besides the schemas (strict: an unknown or misspelt field fails):

* the router's ``--worker-dns`` is the headless Service's cluster name and port,
  and the Service lists only ready pods, so a draining worker leaves the answer;
* what the commands name (the token, the ceiling, the checkpoints, the cache)
  is where the pod spec mounts it, the same path in the init container and
  the worker (an imported manifest names its rootfs by absolute path);
* probes ask gRPC health on the port the server listens on; the worker is
  privileged and on gVisor nodes, the router is not privileged;
* the ConfigMap's ceiling loads with readie's own config loader, through the
  symlinks a ConfigMap volume is made of; the Secret template holds no token,
  and an empty one stops a server from starting.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from readie.cli import SUBCOMMANDS
from readie_router._discovery import DnsName
from readie_rpc.security import SecurityError, read_token
from readie_policy.config import load_config

from conftest import REPO

MANIFESTS = Path(REPO) / "deploy" / "kubernetes"
# The oldest Kubernetes whose schemas the pinned kubernetes-validate (pyproject.toml)
# ships: a manifest that validates here uses no field a newer cluster added.
# Native gRPC probes, the newest thing used, are GA since 1.27.
KUBERNETES_VERSION = "1.34.0"
NAMESPACE = "readie"
CLUSTER_DOMAIN = "svc.cluster.local"
# The image's entrypoint (docker/*.Dockerfile): a container's args start with the subcommand.
READIE = "/opt/readie/.venv/bin/readie"


def documents() -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path, doc))
    return found


def resource(kind: str, name: str) -> dict[str, Any]:
    matches = [doc for _, doc in documents() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def pod_spec(kind: str, name: str) -> dict[str, Any]:
    return resource(kind, name)["spec"]["template"]["spec"]


def container(spec: dict[str, Any], name: str, *, init: bool = False) -> dict[str, Any]:
    (found,) = [c for c in spec["initContainers" if init else "containers"] if c["name"] == name]
    return found


def parse(argv: list[str]) -> Any:
    """``readie ARGV...`` as the real CLI would read it: the subcommand's own parser."""
    assert argv and argv[0] in SUBCOMMANDS, f"no readie subcommand {argv[:1]} (have {sorted(SUBCOMMANDS)})"
    module = importlib.import_module(SUBCOMMANDS[argv[0]].module)
    # A module that serves several subcommands (the pipeline's) parses the subcommand too.
    serves_several = sum(sub.module == module.__name__ for sub in SUBCOMMANDS.values()) > 1
    return module.build_parser().parse_args(argv if serves_several else argv[1:])


def script_commands(script: str) -> list[list[str]]:
    """Each ``readie`` command line of a shell script, as argv after the binary."""
    commands = []
    for line in script.splitlines():
        words = shlex.split(line)
        if READIE in words:
            commands.append(words[words.index(READIE) + 1 :])
    return commands


def mounts(spec: dict[str, Any], container_spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container_spec.get("volumeMounts", [])}


def env(container_spec: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container_spec.get("env", [])}


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("strict", [False, True], ids=["schema", "strict"])
def test_every_manifest_validates_against_the_pinned_kubernetes(strict):
    docs = documents()
    assert len(docs) >= 8
    for path, doc in docs:
        try:
            validated = kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=strict)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(part) for part in exc.path)
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:  # a kind this Kubernetes does not have
            pytest.fail(f"{path.name}: {exc.message}")
        assert validated == KUBERNETES_VERSION.rsplit(".", 1)[0]


def test_the_resources_are_the_ones_docs_deploy_names_all_in_one_namespace():
    kinds = sorted((doc["kind"], doc["metadata"]["name"]) for _, doc in documents())
    assert kinds == [
        ("ConfigMap", "readie-config"),
        ("DaemonSet", "readie-worker"),
        ("Deployment", "readie-router"),
        ("Namespace", NAMESPACE),
        ("NetworkPolicy", "readie-worker"),
        ("PersistentVolumeClaim", "readie-sessions"),
        ("Secret", "readie-session-key"),
        ("Secret", "readie-token"),
        ("Service", "readie-router"),
        ("Service", "readie-workers"),
    ]
    for _, doc in documents():
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]
    # Pod Security Admission lets the privileged workers in.
    assert resource("Namespace", NAMESPACE)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    # `kubectl apply -f deploy/kubernetes/` never applies a Secret template over a real token or key.
    assert [path.parent.name for path, doc in documents() if doc["kind"] == "Secret"] == ["secret", "secret"]


# --------------------------------------------------------------------------- commands


def test_the_router_finds_the_workers_through_the_headless_service():
    service = resource("Service", "readie-workers")
    assert service["spec"]["clusterIP"] == "None"  # headless: the name answers with pod addresses
    assert service["spec"]["publishNotReadyAddresses"] is False  # only SERVING workers are in the answer
    (port,) = service["spec"]["ports"]
    worker_labels = resource("DaemonSet", "readie-worker")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= worker_labels.items()

    router = container(pod_spec("Deployment", "readie-router"), "router")
    routed = parse(router["args"])
    assert routed.worker == []
    assert routed.worker_dns == [DnsName(f"readie-workers.{NAMESPACE}.{CLUSTER_DOMAIN}", port["port"])]
    assert routed.dns_interval == 5.0

    worker = container(pod_spec("DaemonSet", "readie-worker"), "worker")
    served = parse(worker["args"])
    assert served.listen == f"0.0.0.0:{port['port']}"
    assert {p["name"]: p["containerPort"] for p in worker["ports"]}[port["targetPort"]] == port["port"]

    front = resource("Service", "readie-router")
    assert front["spec"]["type"] == "ClusterIP"
    assert routed.listen == f"0.0.0.0:{front['spec']['ports'][0]['port']}"


def test_every_container_command_is_accepted_by_its_cli_and_names_what_is_mounted():
    token_paths = set()
    for kind, name in (("DaemonSet", "readie-worker"), ("Deployment", "readie-router")):
        spec = pod_spec(kind, name)
        for c in spec["containers"]:
            assert "command" not in c, "the image's entrypoint is readie; args start with the subcommand"
            args = parse(c["args"])
            mounted = mounts(spec, c)
            token = args.token_file
            token_paths.add(token)
            assert mounted[str(token.parent)]["secret"]["secretName"] == "readie-token"
            assert {item["path"] for item in mounted[str(token.parent)]["secret"]["items"]} == {token.name}
            assert mounted[str(args.config.parent)]["configMap"]["name"] == "readie-config"
            assert args.config.name in resource("ConfigMap", "readie-config")["data"]
            assert str(Path(args.checkpoints).parent) in mounted  # the node's cache
            assert args.insecure and args.log == "json" and args.metrics_listen
            # $(VAR) in args is the kubelet's expansion: each must be a variable of the container.
            for variable in re.findall(r"\$\((\w+)\)", " ".join(c["args"])):
                assert variable in env(c), variable
    assert len(token_paths) == 1
    router = parse(container(pod_spec("Deployment", "readie-router"), "router")["args"])
    assert router.worker_token_file == router.token_file  # the router presents the token to the workers


def test_the_workers_share_one_readwritemany_session_store_and_its_key_from_a_secret():
    """Decision 32: a session a worker hibernated resumes on any other, so every worker mounts the
    same ReadWriteMany claim at its --session-store and the MAC key from its own Secret; the router,
    which never reads images, mounts neither."""
    claim = resource("PersistentVolumeClaim", "readie-sessions")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    spec = pod_spec("DaemonSet", "readie-worker")
    args = parse(container(spec, "worker")["args"])
    mounted = mounts(spec, container(spec, "worker"))
    assert mounted[str(args.session_store)]["persistentVolumeClaim"]["claimName"] == "readie-sessions"
    key = Path(args.session_store_key)
    assert mounted[str(key.parent)]["secret"]["secretName"] == "readie-session-key"
    assert {item["path"] for item in mounted[str(key.parent)]["secret"]["items"]} == {key.name}
    assert mounted[str(key.parent)]["secret"]["defaultMode"] == 0o400
    router = pod_spec("Deployment", "readie-router")
    assert not [v for v in router["volumes"] if "persistentVolumeClaim" in v or v.get("secret", {}).get("secretName") == "readie-session-key"]


def test_the_workers_own_pod_namespace_is_the_networks_way_out():
    """Decision 36: the pod's own network namespace, named by the worker, is its egress; never the
    node's (no hostNetwork, whose ip_forward readie would turn on)."""
    spec = pod_spec("DaemonSet", "readie-worker")
    args = parse(container(spec, "worker")["args"])
    assert (args.egress_netns, args.egress_own_netns) == ("readie-egress", True)
    assert not spec.get("hostNetwork")


def test_the_init_container_imports_then_verifies_into_the_cache_the_worker_reads():
    spec = pod_spec("DaemonSet", "readie-worker")
    init = container(spec, "checkpoints", init=True)
    worker = container(spec, "worker")
    assert init["command"][:2] == ["/bin/sh", "-c"]
    commands = script_commands(init["command"][2])
    assert [argv[:2] for argv in commands] == [["checkpoints", "import"], ["checkpoints", "verify"]]
    imported, verified = (parse(argv) for argv in commands)
    cache = Path(env(init)["READIE_CACHE"])
    assert imported.into == cache and imported.archive.parent == cache / "incoming"
    assert not imported.no_host_check  # a set this node cannot restore is refused before it is installed
    served = parse(worker["args"])
    assert verified.checkpoints == served.checkpoints == cache / "checkpoints"
    assert env(worker)["READIE_CACHE"] == str(cache)
    # The same host directory at the same path in both: the imported manifest's rootfs path holds in the worker.
    assert mounts(spec, init)[str(cache)] == mounts(spec, worker)[str(cache)]
    assert mounts(spec, worker)[str(cache)]["hostPath"]["path"] == str(cache)
    assert not init["securityContext"]["privileged"]  # neither import nor verify runs a sandbox


def test_probes_ask_grpc_health_and_drains_fit_the_grace_period():
    for kind, name, container_name in (("DaemonSet", "readie-worker", "worker"), ("Deployment", "readie-router", "router")):
        spec = pod_spec(kind, name)
        c = container(spec, container_name)
        args = parse(c["args"])
        port = int(args.listen.rsplit(":", 1)[1])
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port}, (name, probe)  # health needs no token; plaintext (--insecure)
        # Liveness waits minutes: NOT_SERVING (a drain, no healthy worker) is not a dead process.
        assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] >= 300
        assert spec["terminationGracePeriodSeconds"] > args.drain_grace + args.drain_notice
        assert spec["automountServiceAccountToken"] is False  # nothing here talks to the Kubernetes API


def test_only_the_workers_are_privileged_and_they_run_on_gvisor_nodes():
    workers = pod_spec("DaemonSet", "readie-worker")
    assert container(workers, "worker")["securityContext"]["privileged"] is True
    assert workers["nodeSelector"]["readie/gvisor"] == "true"
    assert "runtimeClassName" not in workers  # the worker runs runsc itself, never inside gVisor
    router = pod_spec("Deployment", "readie-router")
    assert container(router, "router")["securityContext"]["privileged"] is False
    (cache,) = [v for v in router["volumes"] if "hostPath" in v]
    assert [m for m in container(router, "router")["volumeMounts"] if m["name"] == cache["name"]][0]["readOnly"] is True


# --------------------------------------------------------------------------- config and secret


def test_the_configmap_ceiling_loads_through_a_configmap_volumes_symlinks(tmp_path):
    """A ConfigMap volume is ``KEY -> ..data/KEY``, ``..data -> ..<timestamp>/``; readie reads it there."""
    data = resource("ConfigMap", "readie-config")["data"]
    volume = tmp_path / "etc-readie"
    stamped = volume / "..2026_12_01_00_00_00.000000001"
    stamped.mkdir(parents=True)
    for key, text in data.items():
        (stamped / key).write_text(text)
        (volume / key).symlink_to(Path("..data") / key)
    (volume / "..data").symlink_to(stamped.name)
    config = load_config(volume / "readie.toml")
    limits = config.network_limits
    assert limits.allow_read == () and limits.allow_write == () and not limits.allow_network
    assert limits.timeout_ms == 60_000 and limits.max_output == 1024 * 1024


def test_the_secret_template_holds_no_token_and_an_empty_one_is_refused(tmp_path):
    secret = resource("Secret", "readie-token")
    assert secret["stringData"] == {"token": ""}, "never commit a real token"
    empty = tmp_path / "token"
    empty.write_text(secret["stringData"]["token"])
    with pytest.raises(SecurityError, match="printable characters"):
        read_token(empty)
