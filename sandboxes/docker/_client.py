"""Reaching the Docker daemon, with every wait bounded and every failure named."""

from __future__ import annotations

import os
from typing import Any

from sandboxes.base import SandboxUnavailable

# A daemon that does not answer a ping in this long is treated as unreachable.
CONNECT_TIMEOUT_S = 2.0
# API calls (create, start, inspect, remove) on a healthy daemon take milliseconds.
API_TIMEOUT_S = 15.0
LABEL_MANAGED = "io.runner.managed"
LABEL_REQUEST = "io.runner.request-id"
LABEL_OWNER = "io.runner.owner-pid"
START_DOCKER_HINT = "start the Docker daemon (dockerd) or set DOCKER_HOST"


def api_client() -> Any:
    """A low-level client (``docker.APIClient``) that has answered a ping.

    Raises:
        SandboxUnavailable: the SDK is missing or the daemon cannot be reached.
    """
    try:
        import docker
        from docker.errors import DockerException
    except ImportError as exc:
        raise SandboxUnavailable("the docker Python package is not installed") from exc
    base_url = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        client = docker.APIClient(base_url=base_url, version="auto", timeout=CONNECT_TIMEOUT_S)
        client.ping()
    except (DockerException, OSError) as exc:
        raise SandboxUnavailable(f"cannot reach the Docker daemon; {START_DOCKER_HINT}") from exc
    client.timeout = API_TIMEOUT_S
    return client
