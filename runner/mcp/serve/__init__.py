"""``runner serve``: the runner as an MCP server (the server side), in front of one ``Runner``."""
