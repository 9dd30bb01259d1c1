"""Third-party MCP servers hosted as sandboxed tools."""
