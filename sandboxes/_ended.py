"""How a tool started ahead ended before its call, said for the operator."""

from __future__ import annotations

import contextlib
import os
import signal

from sandboxes._kernel import signal_from_init_status


def process_ended(pid: int, init_reports_signals: bool) -> str | None:
    """How process ``pid`` (a child of ours, not reaped: it stays so) ended; None while it
    runs. With ``init_reports_signals``, an exit status 128 + N is read as signal N killing
    the tool under an init process (bubblewrap's)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return "it ended (reaped elsewhere)"
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        sig = signal_from_init_status(info.si_status) if init_reports_signals else None
        if sig is None:
            return f"it exited with status {info.si_status}"
    else:
        sig = info.si_status
    return f"it was killed by {signal_name(sig)}" + (" (its CPU limit)" if sig == signal.SIGXCPU else "")


def signal_name(number: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(number).name
    return f"signal {number}"
