"""The first step of a tool's template in fork mode, before any code of the tool's:

    /usr/bin/python3 -I -S /opt/runner/python/runner_landlock.py \
        python3 /opt/runner/python/runner_fork.py main.py

It enters a Landlock domain of its own, then execs the rest of its argv (the template).
The domain goes with the template and with every call cloned from it, and Landlock keeps
a process from tracing any process outside its domain, and from reading or writing its
memory (``/proc/PID/mem``). So the tool's imports cannot reach bubblewrap's init, which
runs as the same uid, is never frozen and is the parent of every call: taken over, it
would run on between calls and read theirs. The domain handles no file or network
access (one that did would forbid the calls' mounts); it scopes signals, so that none
reaches a process outside it (init) either.

Run by the system's interpreter, by its full path, and isolated (``-I -S``: no variable
of the tool's environment, no ``site``), so nothing of the tool's runs before the domain
does; the template (the tool's ``python3``, found on its own ``PATH``) then starts with
the tool's own environment, in the domain. Exits 125 where the kernel refuses the domain
(the runner checks first that it has Landlock).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_RESTRICT_SELF = 444, 446  # x86-64, as fork mode
SCOPE_SIGNAL = 1 << 1  # Landlock's ABI 6
PR_SET_NO_NEW_PRIVS = 38


def main() -> None:
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
    os.execvp(sys.argv[1], sys.argv[1:])  # noqa: S606 - the template, as the runner gave it


if __name__ == "__main__":
    main()
