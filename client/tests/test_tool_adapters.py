"""One readie.tool in the formats model APIs and agent frameworks take, each called once, offline.

The pool is the real engine with a scripted backend (engine_pool.py), so a
call goes through the whole protocol; LangChain's own package builds and
runs its tool, and its converter to OpenAI's format must agree with ours.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import readie
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool

ENGINE = [sys.executable, str(Path(__file__).with_name("engine_pool.py"))]


@pytest.fixture(scope="module")
def run_python(tmp_path_factory):
    with readie.Pool(command=ENGINE, cwd=tmp_path_factory.mktemp("adapters")) as pool:
        with readie.tool(pool=pool, timeout="5s") as tool:
            yield tool


def test_openai_chat_and_responses_formats(run_python):
    chat = run_python.openai_tool()
    assert chat == {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": run_python.description,
            "parameters": run_python.parameters,
            "strict": True,
        },
    }
    responses = run_python.openai_tool("responses")
    assert responses == {"type": "function", **chat["function"]}
    # Strict mode's rules: every property required, nothing else allowed.
    assert run_python.parameters["required"] == list(run_python.parameters["properties"])
    assert run_python.parameters["additionalProperties"] is False
    with pytest.raises(ValueError, match="'chat' or 'responses'"):
        run_python.openai_tool("completions")


def test_anthropic_format(run_python):
    assert run_python.anthropic_tool() == {
        "name": "run_python",
        "description": run_python.description,
        "input_schema": run_python.parameters,
    }


def test_a_call_as_each_api_delivers_its_arguments(run_python):
    # OpenAI: a JSON string; Anthropic: an object.
    assert run_python.call(json.dumps({"code": "say from openai"})) == "from openai"
    assert run_python.call({"code": "say from anthropic"}) == "from anthropic"
    assert run_python.call("{not json").startswith("Error: the arguments are not JSON")
    assert run_python.call({"code": 1}) == 'Error: this tool takes exactly one argument, {"code": "<python source>"}'
    assert run_python.call({"code": "x", "extra": 1}).startswith("Error: this tool takes exactly one argument")


def test_langchain_builds_and_runs_the_tool_and_agrees_on_openais_format(run_python):
    tool = run_python.langchain_tool()
    assert isinstance(tool, BaseTool)
    assert (tool.name, tool.description) == ("run_python", run_python.description)
    assert tool.invoke({"code": "say from langchain"}) == "from langchain"
    converted = convert_to_openai_tool(tool)
    ours = run_python.openai_tool()["function"]
    assert converted["type"] == "function"
    assert {key: converted["function"][key] for key in ("name", "description")} == {
        "name": ours["name"], "description": ours["description"]
    }
    assert converted["function"]["parameters"]["properties"] == ours["parameters"]["properties"]
    assert converted["function"]["parameters"]["required"] == ours["parameters"]["required"]
