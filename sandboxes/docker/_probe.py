"""Questions to the Docker daemon about images (``ProbesImages``: ``runner validate``),
one stopped container per image. Nothing is ever started."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from sandboxes.docker._client import daemon_call, daemon_failures, image_exists, owner_labels
from sandboxes.docker._container import BUILD_HINT
from sandboxes.view import TOOL_MOUNT, search_path

if TYPE_CHECKING:
    from docker import APIClient


class DaemonImageProbe:
    """An ``ImageProbe`` on the daemon ``client``; ``close`` removes the containers it
    made and closes the client."""

    def __init__(self, client: APIClient) -> None:
        self._client = client
        self._containers: dict[str, str] = {}

    def image_problem(self, image: str) -> str | None:
        """Why ``image`` cannot be used, or None.

        Raises:
            SandboxUnavailable: the daemon could not say.
        """
        if not image_exists(self._client, image):
            return f"image {image} does not exist; {BUILD_HINT}"
        return None

    def command_problem(self, image: str, command: Sequence[str], env: Mapping[str, str]) -> str | None:
        """Why ``command[0]`` is not in ``image`` (the tool's folder is checked on the host).

        Raises:
            SandboxUnavailable: the daemon could not say.
        """
        program = command[0]
        if "/" not in program:
            candidates = [f"{folder}/{program}" for folder in search_path(env)]
        elif program.startswith("/") and not PurePosixPath(program).is_relative_to(TOOL_MOUNT):
            candidates = [program]
        else:
            return None  # in the tool's folder: checked there
        if any(self._exists(image, path) for path in candidates):
            return None
        where = f"on its PATH ({':'.join(search_path(env))})" if "/" not in program else ""
        return f"command {program!r} is not found in image {image} {where}".rstrip()

    def _exists(self, image: str, path: str) -> bool:
        with daemon_call("look into the image"):
            container = self._container(image)
            # HEAD of the archive endpoint: the path's stat without copying a byte.
            url = f"{self._client.base_url}/v{self._client.api_version}/containers/{container}/archive"
            answer = self._client.head(url, params={"path": path})
        return answer.status_code == 200

    def _container(self, image: str) -> str:
        if image not in self._containers:
            created = self._client.create_container(
                image,
                command=["/bin/true"],
                network_disabled=True,
                labels=owner_labels(),  # swept if we die
            )
            self._containers[image] = str(created["Id"])
        return self._containers[image]

    def close(self) -> None:
        for container in self._containers.values():
            with contextlib.suppress(*daemon_failures()):
                self._client.remove_container(container, v=True, force=True)
        self._containers.clear()
        self._client.close()
