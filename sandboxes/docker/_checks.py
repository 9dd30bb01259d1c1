"""``runner doctor`` for the docker backend: the daemon, the base image, gVisor."""

from __future__ import annotations

import os

from sandboxes._netns import NamespaceError, listen_inside
from sandboxes.base import Check, SandboxUnavailable
from sandboxes.docker._client import START_DOCKER_HINT, api_client, image_exists
from sandboxes.docker.images import BASE_IMAGE


def _egress_check() -> Check:
    """Allow-lists need the runner to enter a container's namespace: root, local daemon."""
    name, hint = "docker egress network", "run the runner as root, beside the daemon"
    if os.geteuid() != 0:
        return Check(name, False, "the runner is not root", hint)
    try:
        listen_inside("/proc/self/ns/net", 0).close()
    except NamespaceError as exc:
        return Check(name, False, f"cannot enter a namespace: {exc.strerror}", hint)
    return Check(name, True, "network: none, the proxy on the container's loopback")


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
        checks.append(_egress_check())
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
