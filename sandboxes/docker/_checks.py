"""``runner doctor`` for the docker backend: the daemon, the base image, gVisor."""

from __future__ import annotations

from sandboxes.base import Check, SandboxUnavailable
from sandboxes.docker._client import START_DOCKER_HINT, api_client, image_exists
from sandboxes.docker.images import BASE_IMAGE


def daemon_checks() -> list[Check]:
    try:
        client = api_client()
    except SandboxUnavailable as exc:
        return [Check("docker", False, exc.message[:160], START_DOCKER_HINT)]
    try:
        info = client.info()
        checks = [
            Check("docker", True, f"server {info.get('ServerVersion')}, cgroup v{info.get('CgroupVersion')}")
        ]
        try:
            present = image_exists(client, BASE_IMAGE)
        except SandboxUnavailable:
            present = False
        if present:
            checks.append(Check("docker base image", True, BASE_IMAGE))
        else:
            checks.append(Check("docker base image", False, f"{BASE_IMAGE} missing", "runner images build"))
        runtimes = info.get("Runtimes", {})
        checks.append(
            Check(
                "gVisor (runsc)",
                "runsc" in runtimes,
                "registered as docker runtime 'runsc'" if "runsc" in runtimes else "not registered",
                "apt-get install runsc; add it to /etc/docker/daemon.json runtimes (see README)",
            )
        )
        return checks
    finally:
        client.close()
