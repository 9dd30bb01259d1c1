"""A langchain-mcp-adapters client of `runner serve`, run by the Python of its own
environment (it needs the mcp SDK 1.x; the runner, 2.x). argv[1]: the connection as JSON.
Prints what it saw as one JSON line: the tools, a good call's result, and a bad call as
a ToolMessage (the default: status "error") and as a ToolException (handle_tool_errors=False)."""

import asyncio
import json
import sys
from typing import Any

from langchain_core.tools import ToolException
from langchain_mcp_adapters.client import MultiServerMCPClient

BAD = {"type": "tool_call", "id": "call_1", "name": "add", "args": {"a": 2, "b": "three"}}


async def main(connection: dict[str, Any]) -> None:
    tools = {tool.name: tool for tool in await MultiServerMCPClient({"runner": connection}).get_tools()}
    ok = await tools["add"].ainvoke({"a": 2, "b": 3})
    message = await tools["add"].ainvoke(BAD)
    strict = MultiServerMCPClient({"runner": connection}, handle_tool_errors=False)
    raised = None
    try:
        await (await strict.get_tools())[0].ainvoke(BAD["args"])
    except ToolException as exc:
        raised = str(exc)
    print(
        json.dumps(
            {
                "tools": sorted(tools),
                "ok": [part["text"] for part in ok],
                "status": message.status,
                "message": str(message.content),
                "raised": raised,
            }
        )
    )


asyncio.run(main(json.loads(sys.argv[1])))
