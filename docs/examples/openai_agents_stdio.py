"""An openai-agents Agent using the runner's tools through ``runner serve --stdio``, offline.

A scripted model stands in for a real one (with a key, leave out ``model=``): it calls
add_numbers with a bad ``b``, reads the runner's INVALID_PARAMS, calls again, and answers
with the sum. Two settings matter with the runner: a client timeout longer than the
policy's deadlines (the default, 5 s, is the runner's default deadline), and a
``failure_error_function`` that gives the model the runner's error text. Run it in a
folder made by ``runner init``.
"""

import asyncio
import json
import os
import sys

from agents import Agent, Runner, set_tracing_disabled
from agents.items import ModelResponse
from agents.mcp import MCPServerStdio
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText


class ScriptedModel(Model):
    async def get_response(self, system_instructions, input, *args, **kwargs):
        told = [item["output"] for item in input if item.get("type") == "function_call_output"]
        told = [out if isinstance(out, str) else "".join(part["text"] for part in out) for out in told]
        if len(told) < 2:
            assert not told or told[0].startswith("INVALID_PARAMS"), told
            arguments = {"a": 2, "b": "three"} if not told else {"a": 2, "b": 3}
            call = ResponseFunctionToolCall(id=f"fc_{len(told)}", call_id=f"call_{len(told)}",
                                            type="function_call", name="add_numbers",
                                            arguments=json.dumps(arguments))
            return ModelResponse(output=[call], usage=Usage(), response_id=None)
        text = ResponseOutputText(type="output_text", text=f"2 + 3 = {told[-1]}", annotations=[])
        message = ResponseOutputMessage(id="msg", type="message", role="assistant", status="completed",
                                        content=[text])
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args, **kwargs):
        raise NotImplementedError


def runner_error_text(context, error):
    return str(getattr(error, "message", None) or error)  # "INVALID_PARAMS: ..."


async def main() -> None:
    set_tracing_disabled(True)  # traces go to OpenAI's API only with a key
    server = MCPServerStdio(
        # `runner` of this Python; the server gets this environment (RUNNER_* included).
        params={"command": sys.executable, "args": ["-m", "runner", "serve", "--stdio"],
                "env": dict(os.environ)},
        client_session_timeout_seconds=60,
        failure_error_function=runner_error_text,
    )
    async with server:
        agent = Agent(name="adder", instructions="Add with the tools.", model=ScriptedModel(),
                      mcp_servers=[server])
        result = await Runner.run(agent, "What is 2 + 3?")
    print(result.final_output)  # => 2 + 3 = 5


asyncio.run(main())
