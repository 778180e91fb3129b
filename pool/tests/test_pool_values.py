"""The value of a job's (or step's) last bare expression, through ``readie pool`` under runsc: shown as a
notebook cell shows it (``value``: its repr, and display data the object offers), with the pool's
own worker and through a router; bounded, and computed under the job's own limits."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest
from readie_executor.jobs import bounds

from pool.tests._conformance import Pool, placed_pool

pytestmark = pytest.mark.runsc

PICTURE = """
class Picture:
    def __repr__(self):
        return "Picture(1x1)"
    def _repr_png_(self):
        return b"\\x89PNG fake"
    def _repr_html_(self):
        return "<img/>"
Picture()
"""


@pytest.fixture(scope="module", params=["local", "router"])
def pool(request, checkpoints) -> Iterator[Pool]:
    with placed_pool(request.param, "rval-", "--workers", "2", "--preload", "pandas,numpy") as made:
        yield made


def test_a_last_expression_is_shown_and_a_statement_or_none_is_not(pool):
    shown = pool.process.run({"id": "v1", "code": "x = 41\nx + 1"})
    assert shown["value"] == {"text": "42", "truncated": False, "data": {}, "omitted": []}
    for rid, code in (("v2", "x = 41"), ("v3", "print('hi')"), ("v4", "None")):
        assert "value" not in pool.process.run({"id": rid, "code": code})


def test_display_data_comes_by_mime_type(pool):
    result = pool.process.run({"id": "pic", "code": PICTURE})
    value = result["value"]
    assert value["text"] == "Picture(1x1)"
    assert value["data"] == {"image/png": base64.b64encode(b"\x89PNG fake").decode(), "text/html": "<img/>"}


def test_a_dataframe_in_a_session_step_shows_its_table(pool):
    opened = pool.process.run(
        {"id": "d1", "session": "frames", "code": "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2]})"}
    )
    assert opened["exit"] == 0 and "value" not in opened, opened
    step = pool.process.run({"id": "d2", "session": "frames", "code": "df"})
    assert step["value"]["text"] == "   a\n0  1\n1  2"
    assert "<table" in step["value"]["data"]["text/html"]
    assert pool.process.run({"id": "d3", "session": "frames", "close": True})["closed"] is True


def test_values_are_bounded_and_a_display_too_large_is_named_not_cut(pool):
    code = (
        "class Huge:\n"
        "    def __repr__(self): return 'r' * 100_000\n"
        f"    def _repr_html_(self): return 'h' * {bounds.MAX_DISPLAY_BYTES + 1}\n"
        "Huge()"
    )
    value = pool.process.run({"id": "huge", "code": code})["value"]
    assert value["truncated"] is True and len(value["text"]) == bounds.MAX_VALUE_TEXT
    assert value["data"] == {} and value["omitted"] == ["text/html"]


def test_a_repr_that_raises_or_hangs_is_the_jobs_own_doing(pool):
    broken = "class B:\n    def __repr__(self): raise ValueError('no')\nB()"
    assert pool.process.run({"id": "b1", "code": broken})["value"]["text"] == "<B: repr() failed>"
    hangs = "class H:\n    def __repr__(self):\n        while True: pass\nH()"
    result = pool.process.run({"id": "b2", "code": hangs, "timeout": "1s"}, timeout=30)
    assert (result["exit"], result["error"]["type"]) == (124, "TimeoutError"), result


def test_a_scripts_last_expression_is_shown_too(pool):
    (pool.project / "last.py").write_text("x = 41\nx + 1\n")
    result = pool.process.run({"id": "s1", "script": "last.py"})
    assert result["exit"] == 0 and result["value"]["text"] == "42", result
