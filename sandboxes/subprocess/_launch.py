"""The launcher: a fixed ``/bin/sh`` script between the runner and the tool.

Setting limits from Python (``preexec_fn``) would disable vfork and cost ~20 ms per spawn
from a large parent, so the child sets them itself. In order, as the runner's user:

1. join the attempt's cgroups (by its own thread: ``CallCgroup.join_files``), then make
   sure the runner is still alive (see ``sandboxes._watchdog``), and set the CPU rlimit
   (inherited by everything after);
2. open fd 3 on the runner's "started" pipe (through ``/proc/$PPID/fd``, so no extra
   descriptor is inherited by the tool);
3. when the runner is root, inside a private mount namespace made by ``unshare``:
   bind the tool's folder and workspace onto fixed staging points under the state
   directory, so the unprivileged sandbox user needs no search right on their real
   paths (a tool may live under ``/root``);
4. exec ``setpriv`` (drop to the sandbox user) and bubblewrap, or, degraded, the tool.

Inside the sandbox a second constant script writes one byte on fd 3, closes it and
execs the tool: that byte is how the runner tells "the sandbox could not be set up"
from "the tool failed". Before the exec it arms ``sandboxes._exec_status``'s guard, which
tells "the tool's program could not be started" from "the tool ran and failed".
No value from a call is ever parsed by a shell: the scripts are constants and variable
parts arrive as argv or ``RUNNER_*`` variables.
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path

from sandboxes._exec_status import EXEC_GUARD

LAUNCH_SCRIPT = r"""
fail() { echo "runner-launch: $1" >&2; exit 125; }
for f in $RUNNER_CGROUPS; do
  echo 0 > "$f" || fail "cannot join cgroup"
done
if [ -n "$RUNNER_PID" ]; then
  # Joined first, checked second: a runner that died before the join is seen here, one
  # that dies after it finds us in its cgroup, which its watchdog kills.
  read -r _ _ _ parent _ < /proc/$$/stat || fail "cannot read its own status"
  [ "$parent" = "$RUNNER_PID" ] || fail "the runner is gone"
fi
umask 002
if [ -n "$RUNNER_CPU" ]; then
  ulimit -S -t "$RUNNER_CPU" && ulimit -H -t $((RUNNER_CPU + 1)) || fail "cannot set CPU limit"
fi
if [ -n "$RUNNER_VMEM_KB" ]; then
  ulimit -v "$RUNNER_VMEM_KB" || fail "cannot set memory limit"
fi
if [ -n "$RUNNER_FSIZE_BLOCKS" ]; then
  ulimit -f "$RUNNER_FSIZE_BLOCKS" && ulimit -n "$RUNNER_NOFILE" || fail "cannot set file limits"
fi
if [ -n "$RUNNER_STARTED_FD" ]; then
  exec 3>"/proc/$PPID/fd/$RUNNER_STARTED_FD" || fail "cannot open the started pipe"
fi
if [ -n "$RUNNER_STAGE" ]; then
  mount --bind "$RUNNER_TOOL_DIR" "$RUNNER_STAGE/tool" || fail "cannot stage the tool folder"
  if [ -n "$RUNNER_WORKSPACE_DIR" ]; then
    mount --bind "$RUNNER_WORKSPACE_DIR" "$RUNNER_STAGE/workspace" || fail "cannot stage the workspace"
  fi
fi
if [ -n "$RUNNER_CHDIR" ]; then
  cd "$RUNNER_CHDIR" || fail "cannot enter the tool folder"
fi
unset RUNNER_CGROUPS RUNNER_CPU RUNNER_VMEM_KB RUNNER_FSIZE_BLOCKS RUNNER_NOFILE RUNNER_STARTED_FD \
  RUNNER_STAGE RUNNER_TOOL_DIR RUNNER_WORKSPACE_DIR RUNNER_PID RUNNER_CHDIR
exec "$@"
"""
# Without root, before bubblewrap, in a user and mount namespace of the launcher's own
# (``unshare --map-root-user``), the sandbox's /tmp and /dev/shm: tmpfs mounts bounded in
# size and in entries (bubblewrap's own --tmpfs takes a size only, and without a cgroup
# nothing else counts the kernel memory each empty file costs), mounted on the call's
# folders ``tmp`` and ``shm`` and handed to bubblewrap as binds. The options are the
# ones bubblewrap's --tmpfs gets (nosuid, nodev); a kernel that refuses fails the launch.
USER_TMPFS_SCRIPT = r"""
scratch=$1 size=$2 inodes=$3
shift 3
for point in tmp shm; do
  mount -t tmpfs -o "size=$size,nr_inodes=$inodes,mode=1777,nosuid,nodev" tmpfs "$scratch/$point" || {
    echo "runner-launch: cannot mount the sandbox's /tmp and /dev/shm bounded in entries (nr_inodes)" \
      "in a user namespace of its own (Ubuntu 24.04 refuses it to unshare unless" \
      "kernel.apparmor_restrict_unprivileged_userns=0; runner doctor checks it)" >&2
    exit 125
  }
done
"""
# There too, when a workspace is granted write: the workspace bound onto the stage's
# ``lower`` and an overlay of it mounted on ``merged``, its upper layer a folder of the
# runner's, which the runner applies once the sandbox is gone
# (``sandboxes._staging.UserStagedWorkspace``).
# The runner applies to the folder it opened, and the bind goes by path (a descriptor of
# the runner's cannot be bound from this namespace): a path that leads elsewhere by now
# fails the launch, so the tool never reads one folder while its writes go to another.
USER_OVERLAY_SCRIPT = r"""
stage=$1 workspace=$2 opened=$3
shift 3
mount --bind "$workspace" "$stage/lower" || {
  echo "runner-launch: cannot stage the workspace" >&2
  exit 125
}
[ "$(stat -c %d:%i "$stage/lower")" = "$opened" ] || {
  echo "runner-launch: cannot stage the workspace: its path leads to another folder than the one opened" >&2
  exit 125
}
mount -t overlay -o "lowerdir=$stage/lower,upperdir=$stage/upper,workdir=$stage/work,userxattr" \
    overlay "$stage/merged" || {
  echo "runner-launch: cannot stage the workspace (an overlay in a user namespace needs Linux 5.11)" >&2
  exit 125
}
"""
# A degraded run has no bubblewrap to hand the tool its environment: it travels through
# the root launcher as RUNNER_TOOLENV_NAME variables (listed in RUNNER_TOOLENV), which
# no program run as root reads; the shim, already the tool's user, exports them under
# their own names. Only a checked name (``ENV_NAME``) is ever spliced into ``eval``; a
# value is only expanded, never parsed.
TOOL_ENV_PREFIX = "RUNNER_TOOLENV_"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
LAUNCHER_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
UNPACK_TOOL_ENV = (
    'for runner_name in $RUNNER_TOOLENV; do eval "export \\"$runner_name=\\${RUNNER_TOOLENV_$runner_name}\\"'
    '; unset RUNNER_TOOLENV_$runner_name"; done; unset RUNNER_TOOLENV runner_name'
)
# Runs inside the sandbox, as the tool's own first instructions.
STARTED_SHIM = (
    f"printf s >&3; exec 3>&-; unset PWD OLDPWD; {UNPACK_TOOL_ENV}; {EXEC_GUARD}; "
    'exec "$@"'  # sh exports PWD itself
)


# Rootless without a cgroup, the process cap is RLIMIT_NPROC set inside the sandbox: the
# kernel counts it per uid *per user namespace*, so it counts this sandbox's processes
# only (set outside, it would count every process of the user on the host). The tool
# then runs as a child, not by exec, so that once it exits the shim can still see (from
# its own /proc, by a glob: no fork) whether the tool's processes filled the cap, and say
# so with a ``p`` on the started pipe, before the pid namespace is torn down. The tool's
# environment reaches the shim carried (``carried_env``) and is unpacked in the subshell
# only: the shim, which stays, is not one more process with the tool's variables.
ROOTLESS_SHIM = (
    'runner_cap=$1; shift; ulimit -p "$runner_cap" || exit 125; '
    "printf s >&3; unset PWD OLDPWD; "
    f'({UNPACK_TOOL_ENV}; {EXEC_GUARD}; exec "$@") 3>&-; runner_status=$?; '
    'set -- /proc/[0-9]*; [ "$#" -ge $((runner_cap - 1)) ] && printf p >&3; exit "$runner_status"'
)
PIDS_CAPPED = b"p"
# Open files a rootless sandbox may hold (no cgroup bounds the kernel memory they cost).
ROOTLESS_NOFILE = 1024
# Its address-space rlimit, in memory limits: the sum of resident memory is polled (``_tree``).
ROOTLESS_VMEM_FACTOR = 2


def carried_env(env: dict[str, str]) -> dict[str, str]:
    """The tool's environment as the launcher passes it on untouched (see ``TOOL_ENV_PREFIX``),
    with the launcher's own fixed PATH: what the root part of a degraded run sees.

    Raises:
        ValueError: a name the shim could not export.
    """
    if bad := [name for name in env if not ENV_NAME.fullmatch(name)]:
        raise ValueError(f"{bad[0]!r} is not an environment variable name")
    carried = {TOOL_ENV_PREFIX + name: value for name, value in env.items()}
    return carried | {"RUNNER_TOOLENV": " ".join(env), "PATH": LAUNCHER_PATH}


def launcher_argv(shell: str, argv: list[str], unshare: str | None) -> list[str]:
    launch = [shell, "-c", LAUNCH_SCRIPT, "runner-launch", *argv]
    if unshare is None:
        return launch
    return [unshare, "--mount", "--propagation", "private", "--", *launch]


@dataclass(frozen=True)
class UserTmpfs:
    """The call's folder holding ``tmp`` and ``shm``, and the bounds of the tmpfs on each."""

    folder: Path
    size_bytes: int
    inodes: int


def user_namespace_argv(
    unshare: str, shell: str, tmpfs: UserTmpfs | None, overlay: tuple[Path, Path, int] | None
) -> list[str]:
    """What mounts, in one user and mount namespace of its own, the bounded tmpfs
    (``USER_TMPFS_SCRIPT``) and the workspace's overlay (``USER_OVERLAY_SCRIPT``, over
    ``(stage, workspace, opened)``: the folder the runner has open as ``opened``); the
    command to start there follows."""
    namespaces = [unshare, "--user", "--map-root-user", "--mount", "--propagation=private", "--"]
    script, args = "", []
    if tmpfs is not None:
        script += USER_TMPFS_SCRIPT
        args += [str(tmpfs.folder), str(tmpfs.size_bytes), str(tmpfs.inodes)]
    if overlay is not None:
        stage, workspace, opened = overlay
        info = os.fstat(opened)
        script += USER_OVERLAY_SCRIPT
        args += [str(stage), str(workspace), f"{info.st_dev}:{info.st_ino}"]
    return [*namespaces, shell, "-c", script + 'exec "$@"\n', "runner-mounts", *args]


def user_overlay_argv(unshare: str, shell: str, stage: Path, workspace: Path, opened: int) -> list[str]:
    """The workspace's overlay alone (``runner doctor``'s probe)."""
    return user_namespace_argv(unshare, shell, None, (stage, workspace, opened))


def started_shim_argv(shell: str, command: list[str], process_cap: int | None = None) -> list[str]:
    """The shim's argv; ``process_cap``: the rootless shim's, with that RLIMIT_NPROC."""
    if process_cap is None:
        return [shell, "-c", STARTED_SHIM, "runner-exec", *command]
    # No higher than this user may go (the shim's `ulimit` would fail): stricter, never looser.
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    cap = process_cap if hard == resource.RLIM_INFINITY else min(process_cap, hard)
    return [shell, "-c", ROOTLESS_SHIM, "runner-exec", str(cap), *command]


def drop_privileges_argv(setpriv: str, uid: int, gid: int) -> list[str]:
    """Become ``uid``/``gid`` with no supplementary groups before bubblewrap (or, degraded,
    the tool) runs.

    A setuid from root to another uid clears every capability, and bubblewrap then
    builds the sandbox as an unprivileged user in a user namespace of its own.
    """
    return [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--no-new-privs", "--"]
