"""``runner serve``: the runner as an MCP server, and the tool definitions it hands out."""
