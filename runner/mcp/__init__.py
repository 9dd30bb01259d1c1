"""MCP on both sides: ``serve`` (the runner as a server) and ``hosted`` (third-party servers as tools)."""
