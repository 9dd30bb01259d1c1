"""The launcher: a fixed ``/bin/sh`` script between the runner and the tool.

Setting limits from Python (``preexec_fn``) would disable vfork and cost ~20 ms per spawn
from a large parent, so the child sets them itself: it joins the attempt's cgroups,
sets the CPU rlimit, drops to the sandbox user when the runner is root, and execs
bubblewrap (or, degraded, the tool). The script is a constant; everything variable is
passed as argv or as ``RUNNER_*`` variables that it unsets before the exec, so no value
from a call is ever parsed by a shell.
"""

from __future__ import annotations

LAUNCH_SCRIPT = r"""
for f in $RUNNER_CGROUPS; do
  echo $$ > "$f" || { echo "runner-launch: cannot join cgroup" >&2; exit 125; }
done
if [ -n "$RUNNER_CPU" ]; then
  ulimit -S -t "$RUNNER_CPU" && ulimit -H -t $((RUNNER_CPU + 1)) ||
    { echo "runner-launch: cannot set CPU limit" >&2; exit 125; }
fi
if [ -n "$RUNNER_VMEM_KB" ]; then
  ulimit -v "$RUNNER_VMEM_KB" || { echo "runner-launch: cannot set memory limit" >&2; exit 125; }
fi
unset RUNNER_CGROUPS RUNNER_CPU RUNNER_VMEM_KB
exec "$@"
"""
LAUNCH_FAILED = 125
LAUNCH_FAILED_MARK = "runner-launch:"


def launcher_argv(shell: str, argv: list[str]) -> list[str]:
    return [shell, "-c", LAUNCH_SCRIPT, "runner-launch", *argv]


def drop_privileges_argv(setpriv: str, uid: int) -> list[str]:
    """Become ``uid`` with no supplementary groups before bubblewrap runs.

    A setuid from root to another uid clears every capability, and bubblewrap then
    builds the sandbox as an unprivileged user in a user namespace of its own.
    """
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
