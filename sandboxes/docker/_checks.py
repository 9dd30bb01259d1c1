"""``runner doctor`` for the docker backend: the daemon, the base image, gVisor."""

from __future__ import annotations

import os

from sandboxes._netns import NamespaceError, listen_inside
from sandboxes.base import Check, SandboxUnavailable
from sandboxes.docker._client import api_client, image_exists, reach_fix
from sandboxes.docker.images import BASE_IMAGE

TCP_V1_PROBLEM = (
    "on cgroup v1 a container's TCP buffers are counted apart from memory_mb and only root "
    "can cap them (the daemon must be local and the runner root, or the host on cgroup v2)"
)


def _limits_check(cgroup_version: str) -> Check:
    """Whether the runner can give a container every limit: on a v1 daemon it caps the
    TCP buffers itself, which needs root."""
    name = "docker limits"
    if cgroup_version == "1" and os.geteuid() != 0:
        return Check(name, False, f"not root: {TCP_V1_PROBLEM}", TCP_V1_FIX)
    return Check(name, True, "memory, pids, CPU" + (", TCP buffers" if cgroup_version == "1" else ""))


TCP_V1_FIX = "run the runner as root, or use a host on cgroup v2 (systemd.unified_cgroup_hierarchy=1)"


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
        return [Check("docker", False, exc.message.split(";")[0][:160], reach_fix(exc.__cause__))]
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
        checks.append(_limits_check(str(info.get("CgroupVersion", "1"))))
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
