"""``readie mcp`` over stdio, driven by the ``mcp`` package's own client, against a real
``readie pool`` under runsc with a ceiling: initialize, tools/list, a call that prints, one that
raises, a session across calls, and refusals outside the ceiling.

One server (one pool, one worker) serves the whole module; each test is one or a few calls.
"""

from __future__ import annotations

import base64
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc

SERVER = [sys.executable, "-c", "import sys; from readie._mcp import main; sys.exit(main(['mcp', *sys.argv[1:]]))"]
#: A restore and a first job take well under a second here; a loaded CI machine may need more.
READ_TIMEOUT_S = 60
CEILING = """\
[pool]
workers = 1

[pool.limits]
allow_read = ["data"]
allow_write = []
allow_network = false
timeout = "20s"
memory = "1g"

[profiles.reader]
allow_read = ["data"]
"""


class McpServer:
    """A started ``readie mcp`` and an initialized client session, called from sync tests."""

    def __init__(self, portal: BlockingPortal, session: ClientSession, initialized: Any) -> None:
        self.portal = portal
        self.session = session
        self.initialized = initialized

    def call(self, name: str, **arguments: Any) -> Any:
        return self.portal.call(self.session.call_tool, name, arguments)

    def list_tools(self) -> Any:
        return self.portal.call(self.session.list_tools)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[McpServer]:
    project: Path = tmp_path_factory.mktemp("mcp-project")
    (project / "data").mkdir()
    (project / "data" / "orders.csv").write_text("product,amount\ntea,3\ncake,5\ntea,4\n")
    (project / "readie.toml").write_text(CEILING)
    params = StdioServerParameters(
        command=SERVER[0],
        args=[*SERVER[1:], "--config=readie.toml", f"--checkpoints={CHECKPOINTS}", "--profile=reader", "--max-sessions=2"],
        cwd=str(project),
    )

    @asynccontextmanager
    async def connected() -> AsyncIterator[tuple[ClientSession, Any]]:
        async with stdio_client(params, errlog=sys.stderr) as (read, write):
            async with ClientSession(read, write, read_timeout_seconds=READ_TIMEOUT_S) as session:
                yield session, await session.initialize()
        # Leaving ends the server's stdin: it closes its sessions, drains the pool and exits.

    # One task enters and leaves the client's context (anyio's cancel scopes ask for that).
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(connected()) as (session, initialized):
        yield McpServer(portal, session, initialized)


def text(result: Any) -> str:
    assert len(result.content) == 1
    return result.content[0].text


def test_initialize_and_tools_list(server):
    assert server.initialized.server_info.name == "readie"
    assert server.initialized.capabilities.tools is not None
    tools = {tool.name: tool for tool in server.list_tools().tools}
    assert set(tools) == {"run_python", "close_session"}
    run = tools["run_python"]
    assert run.input_schema["required"] == ["code"]
    assert "Run Python 3.11 code in an isolated sandbox" in run.description
    assert "At most 2 sessions may be open" in run.description
    assert "The pool's profile 'reader' may grant more." in run.description


def test_a_call_that_prints(server):
    result = server.call("run_python", code="import sys\nprint('hello from', sys.version_info[:2])")
    assert (result.is_error, text(result)) == (False, "hello from (3, 11)")
    read = server.call("run_python", code="print(open('data/orders.csv').read().splitlines()[1])")
    assert (read.is_error, text(read)) == (False, "tea,3")


def test_a_call_that_raises(server):
    result = server.call("run_python", code="def f():\n    raise ValueError('no such order')\nf()")
    assert result.is_error
    assert text(result).startswith("Error: ValueError: no such order (line 2)")


def test_a_session_keeps_state_across_calls(server):
    first = server.call("run_python", code="import csv\nrows = list(csv.DictReader(open('data/orders.csv')))", session="orders")
    assert (first.is_error, text(first)) == (False, "(no output)")
    second = server.call("run_python", code="print(sum(int(r['amount']) for r in rows))", session="orders")
    assert (second.is_error, text(second)) == (False, "12")
    # A plain call is a fresh interpreter: rows is not there.
    fresh = server.call("run_python", code="print(rows)")
    assert fresh.is_error and "NameError" in text(fresh)
    closed = server.call("close_session", session="orders")
    assert not closed.is_error
    gone = server.call("run_python", code="print(rows)", session="orders")
    assert gone.is_error and "NameError" in text(gone)
    server.call("close_session", session="orders")


def test_refusals_outside_the_ceiling_are_tool_errors(server):
    # 25 s: under this server's own cap (its --timeout, else the pool's 30 s default), over the ceiling's 20 s.
    over = server.call("run_python", code="print(1)", timeout=25)
    assert over.is_error
    assert text(over).startswith("Refused: ") and "exceeds the pool's [pool.limits] timeout" in text(over)
    in_session = server.call("run_python", code="print(1)", session="late", timeout=25)
    assert in_session.is_error and "exceeds the pool's [pool.limits] timeout" in text(in_session)
    # Past the server's cap, the server refuses before the pool is asked.
    capped = server.call("run_python", code="print(1)", timeout=60)
    assert capped.is_error and text(capped) == "Refused: timeout must be more than 0 and at most 30 seconds here"
    # The server and its pool carry on.
    after = server.call("run_python", code="print(2)")
    assert (after.is_error, text(after)) == (False, "2")


def test_a_png_the_code_wrote_or_displayed_comes_back_as_an_image(server):
    # The checkpoints preload no plotting library: the code writes a PNG by hand, from a CSV it was sent.
    code = (
        "import struct, zlib\n"
        "def chunk(kind, data):\n"
        "    return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))\n"
        "rows = open('in/pixels.csv').read().split()\n"
        "raw = b''.join(b'\\x00' + bytes.fromhex(row) for row in rows)\n"
        "header = struct.pack('>IIBBBBB', 2, len(rows), 8, 2, 0, 0, 0)\n"
        "png = b'\\x89PNG\\r\\n\\x1a\\n' + chunk(b'IHDR', header) + chunk(b'IDAT', zlib.compress(raw)) + chunk(b'IEND', b'')\n"
        "open('chart.png', 'wb').write(png)\n"
        "print(len(png))\n"
        "class Chart:\n"
        "    def __repr__(self):\n"
        "        return 'chart'\n"
        "    def _repr_png_(self):\n"
        "        return png\n"
        "Chart()\n"  # displayed, as a notebook shows a value
    )
    result = server.call("run_python", code=code, files={"in/pixels.csv": "ff0000ff0000\n00ff0000ff00\n"})
    assert not result.is_error, result.content
    words, displayed, saved = result.content
    size = int(words.text.split()[0])
    assert words.text == (f"{size}\nchart\nFiles:\n- the value's image/png: shown as an image\n"
                          f"- chart.png ({size} bytes): shown as an image")
    for image in (displayed, saved):
        assert image.type == "image" and image.mime_type == "image/png"
        png = base64.b64decode(image.data)
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) == size


def test_a_timeout_is_the_jobs_failure(server):
    result = server.call("run_python", code="import time\ntime.sleep(30)", timeout=1)
    assert result.is_error and "TimeoutError" in text(result)
