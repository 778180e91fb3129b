"""``readie sessions``: an operator lists a store's entries and removes one, or every expired one."""

from __future__ import annotations

import json
import os
import time

import pytest
import structlog
from readie_protocol.errors import ConfigError
from readie_worker.core import Worker, WorkerConfig
from readie_worker.jobs import CodeJob
from readie_worker.session_store import SessionStore, entry_name, new_session_key
from readie_worker.sessions_cli import main

JOB = CodeJob(checkpoint="base", code="x = 1")


def test_entries_are_listed_by_hash_and_state_and_removed_by_an_operator(tmp_path, capsys):
    key_file = tmp_path / "store.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    store = SessionStore(tmp_path / "store", key_file.read_bytes(), worker="w1")
    try:
        image = tmp_path / "image"
        image.mkdir()
        (image / "checkpoint.img").write_bytes(b"m" * 2048)
        stored, held, old = new_session_key(), new_session_key(), new_session_key()
        for key in (stored, held, old):
            store.hold(key, lambda: None)  # kept fresh by the store's lease beat
            store.save(key, image, job=JOB, memory_limit=None, step=2)
        store.let_go(stored)
        store.let_go(old)
        flags = ["sessions", f"--session-store={store.root}", f"--session-store-key={key_file}"]
        assert main([*flags, "--json"]) == 0
        listed = {line["entry"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
        assert {entry: line["state"] for entry, line in listed.items()} == {
            entry_name(stored): "stored", entry_name(old): "stored", entry_name(held): "leased",
        }
        time.sleep(1.1)
        flags.append("--session-store-ttl=1s")
        assert main([*flags, "--json"]) == 0
        listed = {line["entry"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
        assert {entry: line["state"] for entry, line in listed.items()} == {
            entry_name(stored): "expired", entry_name(old): "expired", entry_name(held): "leased",
        }
        assert all(line["worker"] == "w1" and line["bytes"] > 2048 for line in listed.values())
        for key in (stored, held, old):
            assert key not in str(listed)
        assert main(flags) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0].split() == ["ENTRY", "STATE", "WORKER", "SIZE", "AGE"] and len(table) == 4
        assert main([*flags, "remove", entry_name(held)[:12]]) == 2  # leased: its worker's to close
        assert "held live by w1" in capsys.readouterr().err
        assert main([*flags, "remove", entry_name(stored)[:12]]) == 0
        assert not (store.root / entry_name(stored)).exists()
        assert main([*flags, "remove", "--expired"]) == 0
        assert sorted(os.listdir(store.root)) == [".lock", entry_name(held)]
        assert main([*flags, "remove", "0123"]) == 2  # too short a prefix to be sure
        key_file.chmod(0o644)
        assert main(flags) == 2 and "readable by others" in capsys.readouterr().err
    finally:
        store.close()


def test_readie_worker_takes_the_store_flags_with_units():
    from readie_worker.cli import build_parser

    args = build_parser().parse_args([
        "--session-store=/srv/sessions", "--session-store-key=/etc/readie/store.key",
        "--session-store-ttl=2h", "--session-store-bytes=20g", "--session-store-entries=64",
    ])
    assert (str(args.session_store), str(args.session_store_key)) == ("/srv/sessions", "/etc/readie/store.key")
    assert (args.session_store_ttl, args.session_store_bytes, args.session_store_entries) == (7200.0, 20 * 1024**3, 64)
    defaults = build_parser().parse_args([])
    assert defaults.session_store is None and defaults.session_store_ttl == 24 * 3600


def test_readie_worker_hands_session_pause_to_its_worker_0_for_never(monkeypatch, tmp_path):
    from readie_worker import cli

    seen = []
    monkeypatch.setattr(cli, "enter_mount_namespace", lambda: None)
    monkeypatch.setattr(cli, "_serve", lambda config, args, stop: seen.append(config.session_pause_s) or 0)
    try:
        for flags in ((), ("--session-pause=1m",), ("--session-pause=0",)):
            assert cli.main(["worker", "--checkpoints", str(tmp_path), *flags]) == 0
    finally:
        structlog.reset_defaults()  # main() pointed structlog at this test's stderr
    assert seen == [10.0, 60.0, 0.0]


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf")])
def test_a_session_pause_that_is_not_0_or_seconds_stops_the_worker_before_it_touches_anything(seconds, tmp_path):
    worker = Worker(WorkerConfig.in_temp(tmp_path / "manifest.json", session_pause_s=seconds))
    with pytest.raises(ConfigError, match="session_pause"):
        worker.start()
    assert worker.state is None
