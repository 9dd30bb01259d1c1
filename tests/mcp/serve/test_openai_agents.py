"""`openai-agents` drives the real `runner serve` (stdio and streamable HTTP): a full Agent
run whose model is scripted (no network), its tool calls answered by the runner.

The script: first a call whose ``b`` is not a number (the runner answers INVALID_PARAMS; a
call missing a required parameter never leaves openai-agents, which checks ``required``
itself), then a good call, then the sum it was told as the final answer. openai-agents
turns an MCP ``isError`` result into an exception for its ``failure_error_function``,
whose default tells the model only "An error occurred while running the tool": the
tests pass one that gives the model the runner's own text, as docs/serve.md advises.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from agents import Agent, Runner
from agents.items import ModelResponse
from agents.mcp import MCPServerStdio, MCPServerStreamableHttp
from agents.models.interface import Model
from agents.usage import Usage
from conftest import ToolBench
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
from support.mcp_harness import HttpServer, add_token, server_argv

ADD = """
import json, sys
p = json.load(sys.stdin)["params"]
json.dump(p["a"] + p["b"], sys.stdout)
"""
ADD_PARAMS = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
# Longer than any deadline of these tests: the client's default (5 s) would cut a slow
# sandbox start on a busy host, and the model would never see the runner's answer.
CLIENT_TIMEOUT_S = 60


class ScriptedModel(Model):
    """Answers from what the run has seen so far; records each tool output it was given."""

    def __init__(self) -> None:
        self.outputs: list[str] = []

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        items = kwargs.get("input", args[1] if len(args) > 1 else [])
        outputs = [item["output"] for item in items if item.get("type") == "function_call_output"]
        # A tool's output is its text, or a list of content parts (MCP content).
        self.outputs = [
            out if isinstance(out, str) else "".join(part["text"] for part in out) for out in outputs
        ]
        if len(outputs) < 2:
            arguments = {"a": 2, "b": "three"} if not outputs else {"a": 2, "b": 3}
            call = ResponseFunctionToolCall(
                id=f"fc_{len(outputs)}", call_id=f"call_{len(outputs)}", type="function_call",
                name="add", arguments=json.dumps(arguments), status="completed",
            )  # fmt: skip
            return ModelResponse(output=[call], usage=Usage(), response_id=None)
        text = ResponseOutputText(type="output_text", text=f"2 + 3 = {self.outputs[-1]}", annotations=[])
        message = ResponseOutputMessage(
            id="msg_1", type="message", role="assistant", status="completed", content=[text]
        )
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the scripted model does not stream")


def runner_error_text(_context: Any, error: Exception) -> str:
    """What the model sees of a failed call: the runner's own text ("CODE: message"), not
    openai-agents' default "An error occurred while running the tool"."""
    return str(getattr(error, "message", None) or error)


async def run_agent(server: MCPServerStdio | MCPServerStreamableHttp) -> tuple[str, list[str]]:
    model = ScriptedModel()
    async with server:
        agent = Agent(name="adder", instructions="Add with the tool.", model=model, mcp_servers=[server])
        result = await Runner.run(agent, "What is 2 + 3?")
    return str(result.final_output), model.outputs


def assert_the_run(final: str, outputs: list[str]) -> None:
    assert outputs[0].startswith("INVALID_PARAMS"), outputs
    assert "b" in outputs[0]
    assert json.loads(outputs[1]) == 5
    assert final == "2 + 3 = 5"


@pytest.fixture
def adder(bench: ToolBench) -> ToolBench:
    bench.tool("add", ADD, parameters=ADD_PARAMS)
    return bench


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_openai_agents_run_over_runner_serve_stdio(adder: ToolBench) -> None:
    argv = server_argv(adder, "--stdio")
    params: Any = {"command": argv[0], "args": argv[1:], "env": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
    server = MCPServerStdio(
        params=params, client_session_timeout_seconds=CLIENT_TIMEOUT_S, name="runner",
        failure_error_function=runner_error_text,
    )  # fmt: skip
    assert_the_run(*await run_agent(server))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_openai_agents_run_over_runner_serve_http_with_a_token(adder: ToolBench) -> None:
    token = add_token(adder, "agent", "user")
    http = HttpServer(adder)
    try:
        params: Any = {"url": http.url, "headers": {"Authorization": f"Bearer {token}"}, "timeout": 30}
        server = MCPServerStreamableHttp(
            params=params, client_session_timeout_seconds=CLIENT_TIMEOUT_S, name="runner",
            failure_error_function=runner_error_text,
        )  # fmt: skip
        assert_the_run(*await run_agent(server))
    finally:
        assert http.stop() == 0
