"""A plain Anthropic Messages tool loop over the runner, run offline.

Each ``tool_use`` block goes to ``runner.handle``; its answer goes back as a
``tool_result`` block keyed by ``tool_use_id``, with ``is_error: true`` and the runner's
error object when the call failed (Anthropic's own flag for a failed tool). A recorded
model (an ``httpx2.MockTransport``) stands in for the API; with a real key, drop
``http_client``. Run it in a folder made by ``runner init``.
"""

import json

import httpx2
from anthropic import Anthropic

from runner import Runner

runner = Runner.load()  # ./policies.yaml and ./tools
tools = runner.tool_definitions("anthropic", role="user")
MODEL = "claude-sonnet-4-5"


def reply(content: list, stop: str) -> httpx2.Response:
    return httpx2.Response(200, json={"id": "msg", "type": "message", "role": "assistant", "model": MODEL,
                                      "content": content, "stop_reason": stop, "stop_sequence": None,
                                      "usage": {"input_tokens": 1, "output_tokens": 1}})


def recorded_model(request: httpx2.Request) -> httpx2.Response:
    """Answers as the model did: a call missing b, the call again, then the sum it was told."""
    sent = json.loads(request.content)["messages"]
    results = [block for m in sent if m["role"] == "user" and isinstance(m["content"], list)
               for block in m["content"] if block["type"] == "tool_result"]
    if not results:
        return reply([{"type": "tool_use", "id": "toolu_1", "name": "add_numbers", "input": {"a": 2}}],
                     "tool_use")
    if len(results) == 1:
        assert results[0]["is_error"] and json.loads(results[0]["content"])["code"] == "INVALID_PARAMS"
        call = {"type": "tool_use", "id": "toolu_2", "name": "add_numbers", "input": {"a": 2, "b": 3}}
        return reply([call], "tool_use")
    return reply([{"type": "text", "text": f"2 + 3 = {results[-1]['content']}"}], "end_turn")


recorded = httpx2.Client(transport=httpx2.MockTransport(recorded_model))
client = Anthropic(api_key="recorded", http_client=recorded)
messages: list = [{"role": "user", "content": "What is 2 + 3?"}]
while True:
    message = client.messages.create(model=MODEL, max_tokens=1024, messages=messages, tools=tools)
    blocks = [block.model_dump(exclude_none=True) for block in message.content]
    messages.append({"role": "assistant", "content": blocks})
    if message.stop_reason != "tool_use":
        break
    results = []
    for block in message.content:
        if block.type == "tool_use":
            answer = runner.handle({"toolName": block.name, "params": block.input})
            content = answer["result"] if answer["success"] else answer["error"]
            results.append({"type": "tool_result", "tool_use_id": block.id, "content": json.dumps(content),
                            "is_error": not answer["success"]})
    messages.append({"role": "user", "content": results})
print(message.content[0].text)  # => 2 + 3 = 5
