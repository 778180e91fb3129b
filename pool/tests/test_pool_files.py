"""``"report_files": true`` through ``readie pool`` under runsc, with the pool's own worker and through
a router: the result lists what the job created or changed in its write grants, by host path and size."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pool.tests._conformance import Pool, placed_pool

pytestmark = pytest.mark.runsc

WRITER = """
import os
os.makedirs("out/charts", exist_ok=True)
open("out/report.csv", "w").write("a,b\\n1,2\\n")
open("out/charts/one.svg", "w").write("<svg/>")
os.symlink("/etc/passwd", "out/link")
"""


@pytest.fixture(scope="module", params=["local", "router"])
def pool(request, checkpoints) -> Iterator[Pool]:
    with placed_pool(request.param, "rfil-", "--workers", "2") as made:
        yield made


def test_the_files_a_job_wrote_to_its_grant_are_listed(pool):
    out = (pool.project / "out").resolve()
    (out / "old.txt").write_text("untouched")
    result = pool.process.run({"id": "w1", "code": WRITER, "allow_write": ["out"], "report_files": True})
    assert result["exit"] == 0, result
    assert result["files"] == [
        {"path": str(out / "charts" / "one.svg"), "size": 6},
        {"path": str(out / "report.csv"), "size": 8},
    ]  # not the link, not the file it did not touch
    assert result["files_truncated"] is False


def test_without_asking_there_is_no_list_and_a_session_step_asks_for_its_own(pool):
    result = pool.process.run({"id": "w2", "code": "open('out/x', 'w').write('1')", "allow_write": ["out"]})
    assert result["exit"] == 0 and "files" not in result, result
    opened = pool.process.run({"id": "w3", "session": "writer", "code": "n = 0", "allow_write": ["out"]})
    assert opened["exit"] == 0 and "files" not in opened, opened
    step = pool.process.run(
        {"id": "w4", "session": "writer", "code": "open('out/step.txt', 'w').write('step')", "report_files": True}
    )
    assert [Path(file["path"]).name for file in step["files"]] == ["step.txt"], step
    assert pool.process.run({"id": "w5", "session": "writer", "close": True})["closed"] is True
