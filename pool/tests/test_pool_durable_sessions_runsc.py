"""A session outlives its ``readie pool`` (decision 32): real pools over pipes, real gVisor sandboxes, one
session store on disk shared by the pools one after another.

The session holds a pandas DataFrame and a counter. Its first pool is SIGTERMed (the signal
detaches it into the store); a second pool, a client library's ``readie.Pool`` configured through
``[pool] session_store``, attaches to it by name and key and finds the state, with ``resumed_ms``;
that pool is SIGTERMed in turn, and a third attaches again. A wrong key and an unknown one get the
same refusal. Three pool starts in all, one after another: the engine's rules are
test_pool_durable_engine.py's, with fakes.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import readie

from conftest import CHECKPOINTS
from pool.tests.test_pool_sessions import Pool

pytestmark = pytest.mark.runsc

STATE = "import pandas as pd\ndf = pd.DataFrame({'x': range(200_000)})\ncounter = 1\nprint(counter, len(df))"
NEXT = "counter += 1\nprint(counter, len(df))"


@pytest.fixture(scope="module")
def store(checkpoints) -> Iterator[tuple[Path, Path]]:
    base = Path(tempfile.mkdtemp(prefix="rds-", dir="/tmp"))
    store, key = base / "store", base / "store.key"
    store.mkdir(mode=0o700)
    key.write_bytes(secrets.token_bytes(32))
    key.chmod(0o600)
    yield store, key
    leftovers = sorted(path.name for path in store.iterdir() if path.name != ".lock")  # the store's own lock
    shutil.rmtree(base, ignore_errors=True)
    assert leftovers == [], f"closed sessions left entries in the store: {leftovers}"


def store_pool(store: tuple[Path, Path]) -> Pool:
    return Pool("--workers", "1", "--preload", "pandas,numpy", "--log=json",
                "--session-store", str(store[0]), "--session-store-key", str(store[1]))


def sigterm(pool: Pool) -> str:
    """SIGTERM the pool, wait for it, check its sandboxes are gone; its stderr."""
    pool.process.signal(signal.SIGTERM)
    status = pool.process.finish()
    stderr = pool.process.stderr_text()
    pool.cleanup()
    assert status == 0, stderr[-4000:]
    return stderr


def test_a_session_moves_between_pools_through_the_store_by_its_key(store, tmp_path):
    first = store_pool(store)
    try:
        opened = first.process.run({"id": 1, "session": "nb", "code": STATE})
        assert (opened["stdout"], opened["step"], opened["exit"]) == ("1 200000\n", 1, 0), opened
        key = opened["session_key"]
        assert len(key) >= 43
        assert "session_key" not in first.process.run({"id": 2, "session": "nb", "code": NEXT})
    finally:
        stderr = sigterm(first)
    assert key not in stderr, "keys are never logged"
    assert any(store[0].iterdir()), "the signal detached the session into the store"

    # The client library, configured through the file: attach under a name of its own.
    config = tmp_path / "readie.toml"
    config.write_text(f"[pool]\nworkers = 1\npreload = ['pandas', 'numpy']\n"
                      f"session_store = {json.dumps(str(store[0]))}\nsession_store_key = {json.dumps(str(store[1]))}\n")
    with readie.Pool(config=config, checkpoints=CHECKPOINTS, cwd=tmp_path) as pool:
        with pytest.raises(readie.RequestError, match="^attach: ") as wrong:
            pool.attach("moved", key[:-2] + ("AA" if not key.endswith("AA") else "BB"))
        with pytest.raises(readie.RequestError, match="^attach: ") as unknown:
            pool.attach("moved", secrets.token_urlsafe(32))
        assert str(wrong.value) == str(unknown.value)
        session = pool.attach("moved", key)
        assert (session.key, session.last_step) == (key, 2)
        resumed = session.run(NEXT)
        assert (resumed.stdout, resumed.step, resumed.exit) == ("3 200000\n", 3, 0), resumed
        assert resumed.resumed_ms is not None and resumed.resumed_ms > 0
        os.kill(pool.pid, signal.SIGTERM)  # a signal, not EOF: the session is detached
        assert pool._process.status(60) == 0  # before the context's close: its EOF would close it

    third = store_pool(store)
    try:
        attached = third.process.run({"id": "a", "session": "nb", "attach": key})
        assert attached == {"id": "a", "session": "nb", "attached": True, "step": 3}
        again = third.process.run({"id": 4, "session": "nb", "code": NEXT})
        assert (again["stdout"], again["step"], again["session_ended"]) == ("4 200000\n", 4, False), again
        assert again["resumed_ms"] > 0
        assert third.process.run({"id": 5, "session": "nb", "close": True})["closed"] is True
    finally:
        assert third.process.close() == 0
        third.cleanup()
