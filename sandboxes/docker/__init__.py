"""The ``docker`` backend: one fresh container per attempt, through the Docker SDK."""

from sandboxes.docker.sandbox import DockerConfig, DockerSandbox, create

__all__ = ["DockerConfig", "DockerSandbox", "create"]
