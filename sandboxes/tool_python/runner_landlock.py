"""The first step of a tool's template in fork mode, before any code of the tool's:

    /usr/bin/python3 -I -S /opt/runner/python/runner_landlock.py ENV_FD \
        python3 /opt/runner/python/runner_fork.py main.py

It enters a Landlock domain of its own, then execs the rest of its argv (the template)
with the environment the descriptor ``ENV_FD`` holds (the tool's, ``NAME=VALUE`` each
ended by a NUL). The domain goes with the template and with every call cloned from it,
and Landlock keeps a process from tracing any process outside its domain, and from
reading or writing its memory (``/proc/PID/mem``). So the tool's imports cannot reach
bubblewrap's init, which runs as the same uid, is never frozen and is the parent of
every call: taken over, it would run on between calls and read theirs. The domain
handles no file or network access (one that did would forbid the calls' mounts); it
scopes signals, so that none reaches a process outside it (init) either.

Nothing of the tool's runs before the domain: the step is the system's interpreter, by
its full path, isolated (``-I -S``), with an empty environment (the C library acts on
some variables: a ``GCONV_PATH`` or ``LOCPATH`` of the tool's would load its code). The
template (the tool's ``python3``, found on the tool's own ``PATH``) starts in the
domain. Exits 125 where the kernel refuses the domain (the runner checks first that it
has Landlock).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_RESTRICT_SELF = 444, 446  # x86-64, as fork mode
SCOPE_SIGNAL = 1 << 1  # Landlock's ABI 6
PR_SET_NO_NEW_PRIVS = 38


def _environment(fd: int) -> dict[bytes, bytes]:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return dict(item.split(b"=", 1) for item in data.split(b"\0") if item)


def main() -> None:
    env = _environment(int(sys.argv[1]))  # read only: the runner's descriptor
    libc = ctypes.CDLL(None, use_errno=True)
    attributes = struct.pack("QQQ", 0, 0, SCOPE_SIGNAL)  # file and network accesses: none handled
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, attributes, len(attributes), 0)
    if (
        ruleset < 0
        or libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0  # bubblewrap's already: asked again
        or libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0
    ):
        sys.stderr.write(f"runner-fork: cannot enter a Landlock domain: {os.strerror(ctypes.get_errno())}\n")
        sys.exit(125)
    os.close(ruleset)
    os.execvpe(sys.argv[2], sys.argv[2:], env)  # noqa: S606 - the template, as the runner gave it


if __name__ == "__main__":
    main()
