"""``readie pool`` start-up: flags, configuration and checkpoint choice, refused before any sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog
from readie_executor.framing import PROTOCOL_VERSION
from readie_pool._backend import CHECKPOINT_PLAN, choose_checkpoint, manifest_path
from readie_worker.errors import SandboxSetupError
from readie_pool.cli import main


@pytest.fixture(autouse=True)
def _structlog_defaults():
    # main() points structlog at this test's (captured, soon closed) stderr.
    yield
    structlog.reset_defaults()


def write_manifest(directory: Path, checkpoints: dict[str, list[str]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "manifest.json"
    entry = {
        "files": [{"name": "checkpoint.img", "size_bytes": 1, "sha256": "sha256:0"}],
        "restore_p50_ms": 1.0,
        "cold_start_p50_ms": 1.0,
        "restore_to_socket_p50_ms": 1.0,
    }
    path.write_text(
        json.dumps(
            {
                "executor_protocol": PROTOCOL_VERSION,
                "runsc_version": "runsc version test",
                "runsc_flags": [],
                "spec_fingerprint": "sha256:0",
                "rootfs": "/nonexistent",
                "rootfs_fingerprint": "sha256:0",
                "python": "3.11.2",
                "executor_argv": ["python3"],
                "mount_plan": {"read": 4, "write": 4, "packages": 2},
                "created_at": "now",
                "checkpoints": [
                    {"name": name, "preimport": pre, "image_path": name, **entry}
                    for name, pre in checkpoints.items()
                ],
            }
        )
    )
    return path


@pytest.fixture
def manifest(tmp_path) -> Path:
    return write_manifest(
        tmp_path / "checkpoints", {"base": [], "numpy": ["numpy"], "pandas": ["pandas", "numpy"]}
    )


@pytest.mark.parametrize(
    ("preload", "name"),
    [
        ((), "base"),
        (("numpy",), "numpy"),
        (("numpy", "pandas"), "pandas"),
        (("pandas", "numpy"), "pandas"),
    ],
)
def test_the_checkpoint_is_the_one_preloading_exactly_the_set(manifest, preload, name):
    assert choose_checkpoint(manifest, preload)[1].name == name


def test_no_matching_checkpoint_says_how_to_capture_one(manifest):
    with pytest.raises(SandboxSetupError) as refused:
        choose_checkpoint(manifest, ("pandas",))
    message = str(refused.value)
    assert "preloads exactly [pandas]" in message
    assert "have: base []; numpy [numpy]; pandas [pandas, numpy]" in message
    assert (
        CHECKPOINT_PLAN in message and '[checkpoints.NAME]\n    preimport = ["pandas"]' in message
    )
    assert "make capture" in message


def test_checkpoints_may_name_the_manifest_or_its_directory(manifest):
    assert manifest_path(manifest) == manifest
    assert manifest_path(manifest.parent) == manifest


def pool(capsys, *args: str) -> tuple[int, str]:
    code = main(["pool", *args])
    return code, capsys.readouterr().err



def test_a_bad_config_is_a_usage_error_naming_file_and_key(capsys, tmp_path, monkeypatch):
    (tmp_path / "readie.toml").write_text("[pool]\nworkers = 'many'\n")
    monkeypatch.chdir(tmp_path)
    code, err = pool(capsys, "--config", "readie.toml")
    assert code == 2
    assert f"{tmp_path / 'readie.toml'}: pool.workers: expected an integer, got a string" in err


def test_flags_are_checked_like_the_config(capsys, manifest):
    code, err = pool(capsys, "--workers", "0", "--checkpoints", str(manifest))
    assert code == 2 and "--workers: must be from 1 to 256, got 0" in err
    code, err = pool(capsys, "--max-sessions", "-1", "--checkpoints", str(manifest))
    assert code == 2 and "--max-sessions: must be from 0 to 4096, got -1" in err
    code, err = pool(capsys, "--session-idle", "0s", "--checkpoints", str(manifest))
    assert code == 2 and "--session-idle: must be greater than zero" in err


def test_missing_checkpoints_say_how_to_build_them(capsys, tmp_path):
    code, err = pool(capsys, "--checkpoints", str(tmp_path / "nowhere"))
    assert code == 1 and "make capture" in err


def test_without_a_name_the_pool_looks_here_then_in_the_per_user_default(capsys, tmp_path, monkeypatch):
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.delenv("READIE_CHECKPOINTS", raising=False)
    monkeypatch.delenv("READIE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    code, err = pool(capsys)
    assert code == 1 and "no checkpoints found; looked, in order, at:" in err
    assert f"./build/checkpoints: {elsewhere}/build/checkpoints does not exist" in err
    assert f"~/.cache/readie/checkpoints: {home}/.cache/readie/checkpoints does not exist" in err
    found = write_manifest(home / ".cache" / "readie" / "checkpoints", {"base": []})
    code, err = pool(capsys, "--preload", "scipy")
    assert code == 1 and f"no checkpoint in {found} preloads exactly [scipy]" in err


def test_the_env_variable_names_the_checkpoints(capsys, tmp_path, monkeypatch, manifest):
    monkeypatch.setenv("READIE_CHECKPOINTS", str(manifest.parent))
    code, err = pool(capsys, "--preload", "scipy")
    assert code == 1 and f"no checkpoint in {manifest} preloads exactly [scipy]" in err


def test_package_dirs_must_exist_and_fit_the_slots(capsys, tmp_path, manifest):
    code, err = pool(
        capsys, "--checkpoints", str(manifest), "--package-dir", str(tmp_path / "missing")
    )
    assert code == 1 and "not an existing directory" in err
    dirs = [tmp_path / f"site{i}" for i in range(3)]
    for path in dirs:
        path.mkdir()
    code, err = pool(capsys, "--checkpoints", str(manifest), *(f"--package-dir={p}" for p in dirs))
    assert code == 1 and "3 package dirs, but sandboxes have 2 package slots" in err


def test_a_deeply_nested_config_is_a_config_error_in_a_real_process(tmp_path):
    """tomllib's RecursionError once ended `readie pool` in a traceback with exit 1: now, as any
    bad config, one line naming the file, and exit 2, before anything starts."""
    import subprocess

    from readie_worker.testing import readie_command

    nested = tmp_path / "nested.toml"
    nested.write_text("[pool]\npreload = " + "[" * 100_000 + "]" * 100_000 + "\n")
    done = subprocess.run(
        [*readie_command(), "pool", "--config", str(nested)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stdout == ""  # no ready event
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [f"readie pool: {nested}: nested too deeply: arrays or inline tables "
                                        "within each other, deeper than a TOML reader follows"]


def test_session_store_flags_are_checked_like_the_config(capsys, manifest):
    code, err = pool(capsys, "--session-store", "store", "--checkpoints", str(manifest))
    assert code == 2 and "pool.session_store_key: required with session_store" in err
    with pytest.raises(SystemExit):
        pool(capsys, "--session-checkpoint", "always", "--checkpoints", str(manifest))


def test_several_routers_are_given_by_repeating_the_flag_or_by_a_list():
    from readie_pool.cli import _routers, build_parser

    args = build_parser().parse_args(["--router", "a:1,b:2", "--router", " c:3 ", "--router", "a:1"])
    assert _routers(args.router) == ("a:1", "b:2", "c:3")
    assert _routers(None) == ()


def pool_worker_config(monkeypatch, *args: str):
    """The WorkerConfig ``readie pool`` would start its worker with; stdio is not claimed, nothing served."""
    from readie_pool import cli

    seen = []

    async def serve(setup, worker_config, *rest, **options):
        seen.append(worker_config)
        return 0

    monkeypatch.setattr(cli, "enter_mount_namespace", lambda: None)
    monkeypatch.setattr(cli, "_claim_stdio", lambda: (0, 1))
    monkeypatch.setattr(cli, "_serve", serve)
    assert main(["pool", *args]) == 0
    (config,) = seen
    return config


def test_the_egress_settings_reach_the_worker_and_flags_replace_the_files(monkeypatch, tmp_path, manifest):
    config = tmp_path / "readie.toml"
    config.write_text('[pool]\negress_netns = "from-file"\negress_dns = ["192.0.2.53"]\n')
    given = pool_worker_config(monkeypatch, "--checkpoints", str(manifest), "--config", str(config))
    assert (given.egress_netns, given.egress_dns) == ("from-file", ("192.0.2.53",))
    flagged = pool_worker_config(monkeypatch, "--checkpoints", str(manifest), "--config", str(config),
                                 "--egress-netns", "from-flag", "--egress-dns", "198.51.100.1,198.51.100.2")
    assert (flagged.egress_netns, flagged.egress_dns) == ("from-flag", ("198.51.100.1", "198.51.100.2"))
    unset = pool_worker_config(monkeypatch, "--checkpoints", str(manifest))
    assert (unset.egress_netns, unset.egress_dns) == (None, None)


def test_egress_flags_are_checked_like_the_config(capsys, manifest):
    code, err = pool(capsys, "--egress-netns", "../x", "--checkpoints", str(manifest))
    assert code == 2 and "command line: --egress-netns: '../x' is not a network namespace's name" in err
    code, err = pool(capsys, "--egress-dns", "192.0.2.53,dns.example", "--checkpoints", str(manifest))
    assert code == 2 and "command line: --egress-dns[1]: 'dns.example' is not an IPv4 address" in err


def test_session_pause_reaches_the_worker_from_the_file_or_the_flag(monkeypatch, tmp_path, manifest):
    config = tmp_path / "readie.toml"
    config.write_text('[pool]\nsession_pause = "1m"\n')
    assert pool_worker_config(monkeypatch, "--checkpoints", str(manifest)).session_pause_s == 10.0
    assert pool_worker_config(monkeypatch, "--checkpoints", str(manifest), "--config", str(config)).session_pause_s == 60.0
    off = pool_worker_config(monkeypatch, "--checkpoints", str(manifest), "--config", str(config), "--session-pause", "0")
    assert off.session_pause_s == 0


def test_a_session_pause_that_is_not_a_duration_is_refused(capsys, manifest):
    code, err = pool(capsys, "--session-pause", "soon", "--checkpoints", str(manifest))
    assert code == 2 and "--session-pause" in err
