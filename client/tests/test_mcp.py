"""``readie mcp`` without gVisor: the tools over the real pool engine (its backend faked), session
limits, a pool that dies, and the HTTP transport's refusals and token, with the ``mcp`` package's
own client. What a real sandbox does behind the tools is test_mcp_runsc.py's.
"""

from __future__ import annotations

import base64
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import httpx2
import pytest
import readie
import structlog
from mcp import Client
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from readie._mcp import main
from readie._mcp_tools import CLOSE_TOOL_NAME, SessionLimits, build_server

from client.tests.engine_pool import PNG

HERE = Path(__file__).parent
ENGINE = [sys.executable, str(HERE / "engine_pool.py")]
FAKE = [sys.executable, str(HERE / "fake_pool.py")]
SERVER = [sys.executable, "-c", "import sys; from readie._mcp import main; sys.exit(main(['mcp', *sys.argv[1:]]))"]
READ_TIMEOUT_S = 30


def text(result) -> str:
    assert len(result.content) == 1
    return result.content[0].text


@pytest.fixture(autouse=True)
def _structlog_defaults():
    # main() points structlog at this test's (captured, soon closed) stderr; later tests must not log there.
    yield
    structlog.reset_defaults()


@pytest.fixture
def pool(tmp_path):
    with readie.Pool(command=ENGINE, cwd=tmp_path) as pool:
        yield pool


def in_memory(pool, grants=None, limits=None):
    server, tools = build_server(pool, grants, limits or SessionLimits())
    return Client(server, mode="legacy", read_timeout_seconds=READ_TIMEOUT_S), tools


def test_tools_list_and_what_the_model_reads(pool):
    async def go():
        client, _ = in_memory(pool, {"timeout": 5}, SessionLimits(max_sessions=3, session_idle_s=120))
        async with client:
            assert client.server_info.name == "readie"
            tools = {tool.name: tool for tool in (await client.list_tools()).tools}
            assert set(tools) == {"run_python", CLOSE_TOOL_NAME}
            run = tools["run_python"]
            assert run.input_schema["required"] == ["code"]
            assert set(run.input_schema["properties"]) == {"code", "session", "timeout", "files", "collect"}
            assert "At most 3 sessions may be open; one unused for 2 min is closed." in run.description
            assert "Each call may run for 5 seconds." in run.description
            assert "Every call starts from a clean interpreter: variables" not in run.description
            printed = await client.call_tool("run_python", {"code": "say hello"})
            assert (text(printed), printed.is_error) == ("hello", False)
            raised = await client.call_tool("run_python", {"code": "raise"})
            assert raised.is_error and text(raised) == "Error: ValueError: boom (line 1)"
            # The model may shorten a call, not lengthen it past the operator's limit.
            shorter = await client.call_tool("run_python", {"code": "say quick", "timeout": 2})
            assert not shorter.is_error and text(shorter) == "quick"
            longer = await client.call_tool("run_python", {"code": "say slow", "timeout": 1e9})
            assert longer.is_error and text(longer) == "Refused: timeout must be more than 0 and at most 5 seconds here"

    anyio.run(go)


def test_files_go_in_and_what_the_code_saved_or_showed_comes_back(pool):
    async def go():
        client, _ = in_memory(pool)
        async with client:
            files = {"in.csv": "a,b\n1,2", "raw.bin": {"base64": base64.b64encode(b"\x00\x01").decode()}}
            called = await client.call_tool("run_python", {
                "code": "cat in.csv\npng out/chart.png\nwrite notes.txt total 12\nwrite table.xlsx PK\nshow",
                "files": files,
            })
            assert not called.is_error
            first, *rest = called.content
            assert first.text.startswith("a,b\n1,2\n<image>\nFiles:\n")
            assert "- notes.txt (8 bytes): shown as text" in first.text and "xlsx" not in first.text  # not collected
            assert [(c.type, getattr(c, "mime_type", None)) for c in rest] == [
                ("image", "image/png"), ("image", "image/png"), ("text", None)]
            assert base64.b64decode(rest[1].data) == PNG and rest[2].text == "--- notes.txt ---\ntotal 12"
            # collect names its own; [] brings nothing back, and a bad base64 is refused before the pool.
            asked = await client.call_tool("run_python", {"code": "png table.xlsx", "collect": ["*.xlsx"]})
            assert text(asked) == f"(no output)\nFiles:\n- table.xlsx ({len(PNG)} bytes): not text, not shown"
            nothing = await client.call_tool("run_python", {"code": "png a.png", "collect": []})
            assert text(nothing) == "(no output)"
            bad = await client.call_tool("run_python", {"code": "say x", "files": {"a": {"base64": "%"}}})
            assert bad.is_error and text(bad) == "Refused: files: 'a': is not valid base64"
            outside = await client.call_tool("run_python", {"code": "say x", "files": {"../a": "x"}})
            assert outside.is_error and text(outside).startswith("Refused: files: '../a': must not contain '..'")

    anyio.run(go)


def test_sessions_are_bounded_and_closed(pool):
    async def go():
        client, tools = in_memory(pool, limits=SessionLimits(max_sessions=1))
        async with client:
            first = await client.call_tool("run_python", {"code": "say a", "session": "one"})
            assert not first.is_error and tools.sessions.names("") == ["one"]
            refused = await client.call_tool("run_python", {"code": "say b", "session": "two"})
            assert refused.is_error
            assert text(refused).startswith("Refused: 1 of at most 1 sessions are open (here: one); call close_session")
            closed = await client.call_tool(CLOSE_TOOL_NAME, {"session": "one"})
            assert not closed.is_error and "closed" in text(closed) and len(tools.sessions) == 0
            unknown = await client.call_tool(CLOSE_TOOL_NAME, {"session": "one"})
            assert not unknown.is_error and text(unknown).startswith("No session named 'one' is open")
            again = await client.call_tool("run_python", {"code": "say b", "session": "two"})
            assert not again.is_error and text(again) == "b"
            bad = await client.call_tool("run_python", {"code": "say c", "session": "no spaces"})
            assert bad.is_error and "pattern" in text(bad)

    anyio.run(go)


def test_an_ended_session_frees_its_place(pool):
    async def go():
        client, tools = in_memory(pool, limits=SessionLimits(max_sessions=1))
        async with client:
            ended = await client.call_tool("run_python", {"code": "exit", "session": "one"})
            assert "[The session ended" in text(ended)
            assert len(tools.sessions) == 0

    anyio.run(go)


def test_idle_sessions_are_closed(pool):
    async def go():
        client, tools = in_memory(pool, limits=SessionLimits(session_idle_s=0.2))
        async with client:
            await client.call_tool("run_python", {"code": "say a", "session": "one"})
            await tools.close_idle()
            assert tools.sessions.names("") == ["one"]
            await anyio.sleep(0.3)
            await tools.close_idle()
            assert len(tools.sessions) == 0

    anyio.run(go)


def test_disabled_sessions_say_so(pool):
    async def go():
        client, _ = in_memory(pool, limits=SessionLimits(max_sessions=0))
        async with client:
            tool = (await client.list_tools()).tools[0]
            assert "sessions are disabled on this server" in tool.description
            refused = await client.call_tool("run_python", {"code": "say a", "session": "one"})
            assert refused.is_error and "--max-sessions=0" in text(refused)

    anyio.run(go)


def test_a_refusal_is_a_tool_error_with_the_pools_words(pool):
    async def go():
        client, _ = in_memory(pool, {"profile": "nope"})
        async with client:
            refused = await client.call_tool("run_python", {"code": "say a"})
            assert refused.is_error and re.match(r"Refused: .*unknown profile 'nope'", text(refused))
            in_session = await client.call_tool("run_python", {"code": "say a", "session": "s"})
            assert in_session.is_error and "unknown profile 'nope'" in text(in_session)
            # The server lives on.
            assert len((await client.list_tools()).tools) == 2

    anyio.run(go)


def serve_stdio(*flags: str, cwd: Path):
    params = StdioServerParameters(command=SERVER[0], args=[*SERVER[1:], *flags], cwd=str(cwd))
    return stdio_client(params, errlog=sys.stderr)


def test_a_pool_that_dies_is_reported_over_stdio_and_nothing_hangs(tmp_path):
    async def go():
        async with serve_stdio(f"--readie-command={' '.join(FAKE)}", cwd=tmp_path) as (read, write):
            async with ClientSession(read, write, read_timeout_seconds=READ_TIMEOUT_S) as session:
                init = await session.initialize()
                assert init.server_info.name == "readie"
                ok = await session.call_tool("run_python", {"code": "say fine"})
                assert (text(ok), ok.is_error) == ("fine", False)
                died = await session.call_tool("run_python", {"code": "die"})
                assert died.is_error and "The sandbox pool has failed" in text(died)
                assert "exited with status 7" in text(died) and "dying as asked" in text(died)
                started = time.monotonic()
                later = await session.call_tool("run_python", {"code": "say again", "session": "s"})
                assert later.is_error and text(later) == text(died)
                assert time.monotonic() - started < 5

    anyio.run(go)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--http", "0.0.0.0:8765"], "refusing to serve 0.0.0.0:8765 to anyone who can reach it: pass --token-file"),
        (["--http", "0.0.0.0:8765", "--token-file", "{token}"], "in plaintext on 0.0.0.0:8765: pass --tls-cert"),
        (["--http", "8765"], "expected HOST:PORT"),
        # Loopback, but not a name the SDK's rebinding check knows: a token is needed.
        (["--http", "127.0.0.2:8765"], "refusing to serve 127.0.0.2:8765"),
        (["--http", "127.0.0.1:8765", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["--session-idle", "soon"], "duration"),
    ],
)
def test_refused_flags_exit_2_before_any_pool_starts(flags, message, tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    argv = ["mcp", *(flag.format(token=token) for flag in flags), "--readie-command=/nonexistent"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_http_on_loopback_with_a_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    server = subprocess.Popen(
        [*SERVER, "--http=127.0.0.1:0", f"--token-file={token}", f"--readie-command={' '.join(ENGINE)}"],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    found = threading.Event()

    def read_stderr() -> None:
        for line in server.stderr:
            lines.append(line)
            if "serving MCP" in line:
                found.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        assert found.wait(30), "".join(lines)
        url = re.search(r"url=(\S+)", next(line for line in lines if "serving MCP" in line)).group(1)
        assert url.startswith("http://127.0.0.1:") and url.endswith("/mcp")
        assert httpx2.post(url, json={}).status_code == 401
        assert httpx2.post(url, json={}, headers={"authorization": "Bearer wrong"}).status_code == 401

        async def call():
            from mcp.client.streamable_http import streamable_http_client

            async with httpx2.AsyncClient(headers={"authorization": "Bearer s3cret"}, timeout=READ_TIMEOUT_S) as http:
                async with streamable_http_client(url, http_client=http) as (read, write):
                    async with ClientSession(read, write, read_timeout_seconds=READ_TIMEOUT_S) as session:
                        await session.initialize()
                        one = await session.call_tool("run_python", {"code": "say a", "session": "s"})
                        two = await session.call_tool("run_python", {"code": "say b", "session": "s"})
                        return text(one), text(two)

        assert anyio.run(call) == ("a", "b")
    finally:
        server.terminate()
        assert server.wait(30) == 0, "".join(lines)


def test_sigterm_on_stdio_drains_the_pool_and_exits_0(tmp_path):
    server = subprocess.Popen(
        [*SERVER, f"--readie-command={' '.join(ENGINE)}"],
        cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # The pool is started before the server reads its first message: wait for its log line.
        for line in server.stderr:
            if "pool ready" in line:
                break
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0, server.stderr.read()
    finally:
        server.kill()
        server.wait()
