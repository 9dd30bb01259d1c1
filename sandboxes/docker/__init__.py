"""The ``docker`` backend: one fresh container per attempt, through the Docker SDK."""

from sandboxes.docker.sandbox import DockerSandbox

__all__ = ["DockerSandbox"]
