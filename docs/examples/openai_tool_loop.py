"""A plain OpenAI Chat Completions tool loop over the runner, run offline.

The model's tool calls go to ``runner.handle``; each answer goes back as a ``tool``
message keyed by ``tool_call_id``: the result on success, the runner's error object on
failure (Chat Completions has no error flag: the model reads the code and message). A
recorded model (an ``httpx2.MockTransport``) stands in for the API; with a real key, drop
``http_client``. Run it in a folder made by ``runner init``.
"""

import json

import httpx2
from openai import OpenAI

from runner import Runner

runner = Runner.load()  # ./policies.yaml and ./tools
tools = runner.tool_definitions("openai", role="user")


def tool_call(call_id: str, arguments: dict) -> dict:
    function = {"name": "add_numbers", "arguments": json.dumps(arguments)}
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": call_id, "type": "function", "function": function}]}
    return {"id": "chatcmpl-" + call_id, "object": "chat.completion", "created": 0, "model": "gpt-4.1",
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}


def recorded_model(request: httpx2.Request) -> httpx2.Response:
    """Answers as the model did: a call missing b, the call again, then the sum it was told."""
    sent = json.loads(request.content)["messages"]
    results = [m for m in sent if m["role"] == "tool"]
    if not results:
        return httpx2.Response(200, json=tool_call("call_1", {"a": 2}))
    if len(results) == 1:
        assert json.loads(results[0]["content"])["code"] == "INVALID_PARAMS", results
        return httpx2.Response(200, json=tool_call("call_2", {"a": 2, "b": 3}))
    final = {"role": "assistant", "content": f"2 + 3 = {results[-1]['content']}"}
    return httpx2.Response(200, json={"id": "chatcmpl-3", "object": "chat.completion", "created": 0,
                                      "model": "gpt-4.1",
                                      "choices": [{"index": 0, "message": final, "finish_reason": "stop"}]})


recorded = httpx2.Client(transport=httpx2.MockTransport(recorded_model))
client = OpenAI(api_key="recorded", http_client=recorded)
messages: list = [{"role": "user", "content": "What is 2 + 3?"}]
while True:
    reply = client.chat.completions.create(model="gpt-4.1", messages=messages, tools=tools)
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
        break
    for call in message.tool_calls:
        params = json.loads(call.function.arguments)
        answer = runner.handle({"toolName": call.function.name, "params": params})
        content = answer["result"] if answer["success"] else answer["error"]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(content)})
print(message.content)  # => 2 + 3 = 5
