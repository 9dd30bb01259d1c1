"""The ``docker`` backend: one fresh container per attempt, through the Docker SDK."""

from sandboxes.docker._client import (
    LABEL_MANAGED,
    LABEL_OWNER,
    api_client,
    daemon_call,
    daemon_failures,
    image_exists,
)
from sandboxes.docker.sandbox import DockerConfig, DockerSandbox, create

# The daemon client and its helpers, for host-side checks of images (``runner validate``,
# ``runner images build``).
__all__ = [
    "LABEL_MANAGED",
    "LABEL_OWNER",
    "DockerConfig",
    "DockerSandbox",
    "api_client",
    "create",
    "daemon_call",
    "daemon_failures",
    "image_exists",
]
