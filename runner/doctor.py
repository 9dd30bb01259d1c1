"""``runner doctor``: which isolation layers work here, each checked for real."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROBE_TIMEOUT_S = 10


@dataclass(frozen=True)
class Layer:
    name: str
    ok: bool
    detail: str
    hint: str = ""


def _run(argv: list[str]) -> tuple[bool, str]:
    try:
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, type(exc).__name__
    output = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode == 0, (output[-1] if output else "")[:120]


def user_namespaces() -> Layer:
    limit = Path("/proc/sys/user/max_user_namespaces")
    value = limit.read_text().strip() if limit.exists() else "?"
    ok, detail = _run(["unshare", "--user", "--map-root-user", "true"])
    return Layer(
        "user namespaces",
        ok,
        f"max_user_namespaces={value} {detail}".strip(),
        "sysctl -w user.max_user_namespaces=15000 (and kernel.unprivileged_userns_clone=1 where it exists)",
    )


def bubblewrap() -> Layer:
    bwrap = os.environ.get("RUNNER_BWRAP") or shutil.which("bwrap")
    hint = "apt-get install bubblewrap"
    if not bwrap or not os.access(bwrap, os.X_OK):
        return Layer("bubblewrap", False, "not found", hint)
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64",
            "--proc", "/proc", "--dev", "/dev", "--", "/bin/true"]  # fmt: skip
    if os.geteuid() == 0 and (setpriv := shutil.which("setpriv")):
        argv = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--", *argv]
    ok, detail = _run(argv)
    version = _run([bwrap, "--version"])[1]
    return Layer("bubblewrap", ok, version if ok else detail, hint)


def cgroups() -> list[Layer]:
    from sandboxes.subprocess._cgroup import CgroupFactory, CgroupUnavailable

    try:
        factory = CgroupFactory()
        group = factory.create(memory_mb=64, max_pids=8)
        group.remove()
    except (CgroupUnavailable, OSError) as exc:
        return [Layer("cgroups", False, str(exc)[:160], "run as root, or in a delegated cgroup v2 subtree")]
    controllers = "memory, pids, cpuacct" if factory.version == 1 else "memory, pids, cpu"
    return [Layer(f"cgroup v{factory.version}", True, f"per-call cgroups with {controllers}")]


def docker() -> list[Layer]:
    try:
        import docker as docker_sdk
        from docker.errors import DockerException
    except ImportError:
        return [Layer("docker", False, "the docker Python package is missing", "pip install docker")]
    try:
        client = docker_sdk.from_env(timeout=3)
        info = client.info()
    except DockerException as exc:
        return [Layer("docker", False, str(exc).splitlines()[0][:120], "start dockerd (see README)")]
    layers = [
        Layer("docker", True, f"server {info.get('ServerVersion')}, cgroup v{info.get('CgroupVersion')}")
    ]
    try:
        client.images.get("runner/base:latest")
        layers.append(Layer("docker base image", True, "runner/base:latest"))
    except DockerException:
        layers.append(Layer("docker base image", False, "runner/base:latest missing", "runner images build"))
    runtimes = info.get("Runtimes", {})
    layers.append(
        Layer(
            "gVisor (runsc)",
            "runsc" in runtimes,
            "registered as docker runtime 'runsc'" if "runsc" in runtimes else "not registered",
            "apt-get install runsc; add it to /etc/docker/daemon.json runtimes (see README)",
        )
    )
    return layers


CHECKS: list[Callable[[], Layer | list[Layer]]] = [user_namespaces, bubblewrap, cgroups, docker]


def check_layers() -> list[Layer]:
    layers: list[Layer] = []
    for check in CHECKS:
        found = check()
        layers.extend(found if isinstance(found, list) else [found])
    return layers
