"""Tools: manifests, the registry of tool folders, definitions for agents, new folders."""
