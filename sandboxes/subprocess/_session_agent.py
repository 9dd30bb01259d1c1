"""The program a subprocess session sandbox runs in place of its tool: the agent.

Started once, as the sandbox's tool would be (inside bubblewrap, as the sandbox user,
in the session's cgroup, under its seccomp filter and rlimits), it waits on a control
socket the runner holds the other end of. For each call the runner sends ``run`` with
three descriptors (the call's stdin, stdout and stderr pipes); the agent forks, the child
takes those as its 0, 1 and 2 and execs the tool's command through the exec guard's
constant shell line, and the agent sends back the child's exit status (a negative number
for a signal). So every call is a new process inside the very sandbox of the session,
inheriting everything of it, and dies with it.

Python, not a shell: only it can receive descriptors (SCM_RIGHTS) among what every
sandbox has; ``-I -S`` keeps the tool's ``PYTHON*`` variables and site out of it.
"""

from __future__ import annotations

from sandboxes._exec_status import EXEC_GUARD

AGENT_PYTHON = "/usr/bin/python3"
AGENT_MESSAGE_BYTES = 32
READY = b"ready"
RUN = b"run"

# A constant program; every variable part arrives as argv: the control socket's
# descriptor, the call shim, then the tool's command.
AGENT = r"""
import os, signal, socket, sys
control = socket.socket(fileno=int(sys.argv[1]))
os.set_inheritable(control.fileno(), False)
shim, command = sys.argv[2], sys.argv[3:]
control.send(b"ready")
while True:
    try:
        message, fds, _, _ = socket.recv_fds(control, 32, 3)
    except OSError:
        break
    if message != b"run" or len(fds) != 3:
        break
    pid = os.fork()
    if pid == 0:
        try:
            # Python ignores these; a tool must get them as any process does.
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                os.close(fd)
            os.execv("/bin/sh", ["runner-exec", "-c", shim, "runner-exec", *command])
        finally:
            os._exit(125)
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    control.send(str(os.waitstatus_to_exitcode(status)).encode())
"""

# Each call's first instructions: the exec guard reads the call's own token off stdin.
CALL_SHIM = f'{EXEC_GUARD}; exec "$@"'


def agent_command(control_fd: int, command: tuple[str, ...]) -> tuple[str, ...]:
    """The agent's command line, in place of the tool's ``command``."""
    return (AGENT_PYTHON, "-I", "-S", "-c", AGENT, str(control_fd), CALL_SHIM, *command)
