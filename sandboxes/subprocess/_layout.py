"""What the hardened tool sees, as a bubblewrap argv.

The view: the system directories read-only, a handful of ``/etc`` files, the tool's own
folder read-only at ``/tool``, the tool-side helper read-only at ``/opt/runner/python``, a
size-limited tmpfs at ``/tmp`` (HOME and TMPDIR), its own ``/proc`` and a minimal ``/dev``,
and ``/workspace`` only when granted. New user, mount, PID, IPC, UTS and network
namespaces (the network one made by the runner when the tool has a network, see
``_network``); no capabilities;
``no_new_privs`` (bubblewrap always sets it); a new session, so no terminal to inject into.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sandboxes._usernet import SLIRP_DNS
from sandboxes.base import LaunchSpec, Limits, SandboxUnavailable
from sandboxes.view import INSIDE_UID, LIBRARY_MOUNT, SCRATCH_MOUNT, TOOL_MOUNT, WORKSPACE_MOUNT

# Inside its user namespace the tool is "nobody"; on the host it is a uid of its own
# (``sandboxes._identity``), never root.
SANDBOX_UID = INSIDE_UID
SYSTEM_DIRS = ("/usr", "/opt/runner-system")  # the second is a hook for vendored runtimes
MERGED_USR_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# The few /etc files ordinary programs read; nothing with secrets or host identity.
ETC_FILES = ("ld.so.cache", "ld.so.conf", "localtime", "alternatives", "mime.types")
# A tool with a network (its own, or the egress proxy) also gets these; its resolv.conf
# is the runner's, naming slirp4netns's resolver (the host's may be on its loopback).
TLS_ETC_FILES = ("hosts", "ssl", "ca-certificates")
NETWORK_ETC_FILES = (*TLS_ETC_FILES, "nsswitch.conf")
RESOLV_CONF = f"nameserver {SLIRP_DNS}\n"

PASSWD = f"nobody:x:{SANDBOX_UID}:{SANDBOX_UID}:nobody:{SCRATCH_MOUNT}:/usr/sbin/nologin\n"
GROUP = f"nogroup:x:{SANDBOX_UID}:\n"


@dataclass(frozen=True)
class Sources:
    """Host paths bubblewrap mounts: the tool's folder, the workspace, the fake /etc, the
    helper's folder."""

    tool_dir: Path
    workspace: Path | None
    etc_dir: Path
    library_dir: Path
    # Host /etc files of which ``etc_dir`` holds a copy (``_etc``): linked, not bound.
    etc_copies: frozenset[str] = frozenset()
    # Without root: a folder whose ``tmp`` and ``shm`` the launcher mounted tmpfs on,
    # bounded in entries too (``_launch.USER_TMPFS_SCRIPT``); bound, not made here.
    scratch: Path | None = None


def nul_separated(items: list[str], what: str) -> bytes:
    """``items`` as the file bubblewrap's ``--args`` reads (each ended by a NUL), or a
    list of variables so.

    Raises:
        SandboxUnavailable: an item holds a NUL: it would end there, and what follows
            would be read as items of its own (options of bubblewrap's).
    """
    if any("\0" in item for item in items):
        raise SandboxUnavailable(f"{what} hold a NUL byte (a value of the tool's environment, or a secret)")
    return b"".join(item.encode() + b"\0" for item in items)


def _etc_argv(spec: LaunchSpec, limits: Limits, src: Sources) -> list[str]:
    """The sandbox's /etc: a link into the runner's folder for each file it holds a copy
    of (one bind for them all), a read-only bind for the others."""
    etc: tuple[str, ...] = ETC_FILES
    if limits.network:
        etc += NETWORK_ETC_FILES
    elif spec.egress is not None:
        etc += TLS_ETC_FILES
    argv: list[str] = []
    for name in etc:
        if name in src.etc_copies:
            argv += ["--symlink", f"/run/runner-etc/{name}", f"/etc/{name}"]
        else:
            argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return [*argv, "--ro-bind", str(src.etc_dir), "/run/runner-etc"]


def _scratch_argv(limits: Limits, src: Sources, name: str, target: str) -> list[str]:
    """A tmpfs bounded by ``disk_mb``: the launcher's (``Sources.scratch``) without root,
    bubblewrap's as root, where the call's cgroup charges its pages and inodes."""
    if src.scratch is not None:
        return ["--bind", str(src.scratch / name), target]
    return ["--size", str(limits.disk_mb * 1024 * 1024), "--perms", "1777", "--tmpfs", target]


def bwrap_argv(
    spec: LaunchSpec,
    limits: Limits,
    src: Sources,
    env: Mapping[str, str],
    seccomp_fd: int | None = None,
    own_network: bool = False,
) -> list[str]:
    """bubblewrap's options: everything but the program name and the command.

    ``own_network``: the launcher already put it in a network namespace made for it
    (``_network``); without one, bubblewrap makes an empty one.
    """
    argv = [
        "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
        "--hostname", "sandbox",
        "--die-with-parent", "--new-session", "--cap-drop", "ALL",
        # No user namespaces inside: they would hand the tool a full capability set there.
        "--disable-userns", "--assert-userns-disabled",
        "--clearenv",
    ]  # fmt: skip
    if not own_network:
        argv.append("--unshare-net")
    for directory in SYSTEM_DIRS:
        argv += ["--ro-bind-try", directory, directory]
    for link in MERGED_USR_LINKS:
        if Path(f"/{link}").is_symlink():
            argv += ["--symlink", f"usr/{link}", f"/{link}"]
        else:
            argv += ["--ro-bind-try", f"/{link}", f"/{link}"]
    argv += _etc_argv(spec, limits, src)
    argv += ["--symlink", "/run/runner-etc/passwd", "/etc/passwd"]
    argv += ["--symlink", "/run/runner-etc/group", "/etc/group"]
    if limits.network:
        argv += ["--symlink", "/run/runner-etc/resolv.conf", "/etc/resolv.conf"]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    # --dev is a writable tmpfs; only /dev/shm stays writable, and bounded like /tmp.
    argv += _scratch_argv(limits, src, "shm", "/dev/shm")  # noqa: S108 - the sandbox's own
    argv += ["--remount-ro", "/dev"]
    argv += _scratch_argv(limits, src, "tmp", SCRATCH_MOUNT)
    argv += ["--ro-bind", str(src.tool_dir), TOOL_MOUNT]
    argv += ["--ro-bind", str(src.library_dir), LIBRARY_MOUNT]
    if src.workspace is not None:
        flag = "--bind" if spec.workspace_mode == "write" else "--ro-bind"
        argv += [flag, str(src.workspace), WORKSPACE_MOUNT]
    argv += ["--remount-ro", "/"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += ["--chdir", TOOL_MOUNT]
    return argv
