"""``Pool.session`` and ``readie.tool`` against the stand-in pool process: what goes on the wire. No gVisor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import readie
from readie_protocol.events import Result

FAKE = [sys.executable, str(Path(__file__).with_name("fake_pool.py"))]
ENGINE = [sys.executable, str(Path(__file__).with_name("engine_pool.py"))]


@pytest.fixture
def pool(tmp_path):
    with readie.Pool(command=FAKE, cwd=tmp_path) as pool:
        yield pool


def sent(result: Result) -> dict:
    return json.loads(result.stdout)


def test_the_first_step_carries_the_grants_and_later_steps_only_code(pool):
    with pool.session("nb", allow_read=["data"], env={"K": "v"}, timeout=5, memory="512m") as session:
        assert not session.open
        first = session.run("request", name="one.py")
        assert sent(first) == {
            "id": first.id, "session": "nb", "code": "request", "name": "one.py", "allow_read": ["data"],
            "env": {"K": "v"}, "timeout": "5s", "memory": 512 * 1024**2,  # 5 and "512m", as the protocol writes them
        }
        assert (first.session, first.step, first.session_ended, session.open) == ("nb", 1, False, True)
        second = session.run("request", args=["a"], timeout=0.25, max_output=100)
        assert sent(second) == {
            "id": second.id, "session": "nb", "code": "request", "args": ["a"], "timeout": "250ms", "max_output": 100,
        }
        assert second.step == 2
    assert not session.open


def test_an_ended_session_starts_again_with_its_grants(pool):
    session = pool.session(allow_write=["out"])
    assert session.name.startswith("session-")
    session.run("say hi")
    ended = session.run("exit")
    assert ended.session_ended and not session.open
    again = session.run("request")
    assert again.step == 1 and sent(again)["allow_write"] == ["out"]
    session.close()
    session.close()  # closing twice does nothing


def test_a_refused_step_raises_request_error_with_the_result(pool, monkeypatch):
    session = pool.session("r")
    session.run("say one")
    # Force a later step to carry a setup field, as a buggy client would.
    session.setup = {"env": {"A": "b"}}
    monkeypatch.setattr(session, "_open", False)
    with pytest.raises(readie.RequestError, match="env: session 'r' is open") as caught:
        session.run("say two")
    assert caught.value.result.session == "r"


def test_session_arguments_are_checked_before_sending(pool):
    with pytest.raises(TypeError, match=r"allow_read=\['data'\]"):
        pool.session(allow_read="data")
    with pytest.raises(TypeError, match="name"):
        pool.session(7)


def test_a_stateless_tool_runs_jobs_with_its_grants_and_describes_them(pool):
    tool = readie.tool(pool=pool, allow_read=["data"], allow_write=["/srv/out"], timeout="10s", memory="512m")
    assert tool.name == "run_python" and tool.session is None
    assert tool.parameters == {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source to run. Use print() to see values."}},
        "required": ["code"],
        "additionalProperties": False,
    }
    assert tool.spec() == {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    description = tool.description
    assert description.startswith("Run Python 3.11 code in an isolated sandbox")
    assert "clean interpreter" in description and "persist" not in description
    assert "read files under data/ (read-only)" in description
    assert "read and write files under /srv/out/" in description
    assert "Relative paths are relative to the working directory." in description
    assert "There is no network access." in description
    assert "Each call may run for 10s and use 512m of memory." in description
    assert tool("say hello") == "hello"
    assert tool("raise") == "Error: ValueError: boom (line 1)"
    assert tool("") == "(no output)"


def test_a_session_tool_keeps_state_and_says_when_it_ends(pool):
    with readie.tool(pool=pool, session=True, allow_read=["data"]) as tool:
        assert "persist between calls" in tool.description
        assert sent(tool.run("request"))["allow_read"] == ["data"]
        assert tool("exit") == "[The session ended: its variables are gone; the next call starts from a clean interpreter.]"
        session = tool.session
    assert session is not None and not session.open


def test_a_tool_over_a_given_session_leaves_it_to_its_owner(pool):
    session = pool.session("mine", allow_read=["data"])
    tool = readie.tool(pool=pool, session=session)
    tool("say x")
    tool.close()
    assert session.open
    session.close()
    with pytest.raises(TypeError, match="grants belong to the Session"):
        readie.tool(pool=pool, session=session, allow_read=["other"])


def search(query: str, limit: int = 10) -> list[str]:
    """Search the index.

    Returns at most ``limit`` titles.
    """
    return [f"{query} {n}" for n in range(1, limit + 1)]


def test_describe_functions_gives_each_signature_and_docstring():
    assert readie.describe_functions({"search": search}) == (
        "Functions of the host you can call (from readie_host import search):\n"
        "- search(query: str, limit: int = 10) -> list[str]\n"
        "    Search the index.\n"
        "\n"
        "    Returns at most ``limit`` titles."
    )


def test_a_tool_with_functions_describes_and_runs_them(tmp_path):
    """Through the real engine's call and reply handling (the stand-in only shows what was sent)."""
    with readie.Pool(command=ENGINE, cwd=tmp_path) as pool:
        tool = readie.tool(pool=pool, functions={"search": search}, timeout="5s")
        assert tool.description.endswith(readie.describe_functions({"search": search}))
        assert tool('call search ["readie"] {"limit":2}') == '{"result": ["readie 1", "readie 2"]}'


def test_a_session_tool_declares_its_functions_with_the_first_step(pool):
    with readie.tool(pool=pool, session=True, functions={"search": search}) as tool:
        assert "from readie_host import search" in tool.description
        assert sent(tool.run("request"))["functions"] == ["search"]
        assert "functions" not in sent(tool.run("request"))
        assert tool.session.functions == {"search": search}


def test_a_given_session_brings_its_own_functions(pool):
    session = pool.session("fs", functions={"search": search})
    tool = readie.tool(pool=pool, session=session)
    assert "search(query: str" in tool.description
    with pytest.raises(TypeError, match="functions"):
        readie.tool(pool=pool, session=session, functions={"search": search})
