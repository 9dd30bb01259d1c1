"""Whether a warm sandbox still waits for its call, and how long a pool that keeps losing
its sandboxes before their calls waits before its next refill."""

from __future__ import annotations

from sandboxes import Limits, Waits, WarmSandbox, WatchedWhileWaiting

# After a tool's sandbox could not be made ready ahead, or ended before its call, its pool
# waits this long before the next try, doubled for each further one lost in a row up to
# MAX_BACKOFF_S: a machine without the isolation must not be asked twenty times a second,
# and a tool that dies while it waits must not be restarted as fast as it dies.
RETRY_AFTER_FAILURE_S = 5.0
MAX_BACKOFF_S = 300.0
# How often the keeper looks whether the idle warm sandboxes' tools still wait.
CHECK_EVERY_S = 0.5
# A warm sandbox that has used this share of its CPU limit before its call is discarded:
# its call would run short of CPU, and a tool spinning as it waits must not burn it all.
BUSY_SHARE = 0.5
# One retired after max_idle_ms while still using this share of a core counts as lost,
# when read past its start-up (a tool's imports): from START_GRACE_S after it was ready.
BUSY_RATE = 0.1
MIN_SPAN_S = 0.2
START_GRACE_S = 1.0


def back_off_s(lost: int) -> float:
    """The wait before a pool's next refill after ``lost`` sandboxes lost in a row."""
    return min(MAX_BACKOFF_S, RETRY_AFTER_FAILURE_S * 2.0 ** min(lost - 1, 32))


class CpuReadings:
    """The last two readings of an idle warm sandbox's CPU time, at least ``MIN_SPAN_S``
    apart: how busy it was lately. Read after its ``max_idle_ms``, long past any start-up,
    a tool waiting on its input uses next to none; one spinning below its CPU limit, and
    replaced before it reaches it, would otherwise cost its pool CPU for ever."""

    def __init__(self) -> None:
        self._readings: list[tuple[float, float]] = []

    def add(self, now: float, used: float) -> None:
        if self._readings and now - self._readings[-1][0] < MIN_SPAN_S:
            return
        self._readings = [*self._readings[-1:], (now, used)]

    def busy(self, made: float) -> str | None:
        """Why a sandbox ready since ``made`` counts as lost when retired: busy for
        ``BUSY_RATE`` of a core between the last two readings; None when it waited, or
        was not read twice past its start-up."""
        if len(self._readings) < 2 or self._readings[0][0] < made + START_GRACE_S:
            return None
        (before, used_before), (after, used) = self._readings
        rate = (used - used_before) / (after - before)
        if rate < BUSY_RATE:
            return None
        return f"it was still using {rate:.0%} of a core after waiting max_idle_ms for a call"


def lost_why(warm: WarmSandbox, cpu: CpuReadings, limits: Limits, now: float) -> tuple[str, str] | None:
    """Why an idle warm sandbox can serve no call: its tool ended (``ended``), its processes
    together passed a limit no kernel holds for them (``limit``), or it has used
    ``BUSY_SHARE`` of its CPU limit while it waits (``busy``), with what happened;
    None: it waits, or the backend cannot say. Notes its CPU time in ``cpu``."""
    if not isinstance(warm, Waits):
        return None
    try:
        why = warm.ended()
        watched = warm if isinstance(warm, WatchedWhileWaiting) and why is None else None
        broken = watched.limit_broken_while_waiting() if watched is not None else None
        used = warm.used_cpu_seconds() if why is None and broken is None else None
    except Exception:  # a backend's bug must not stop the keeper: taken as still waiting
        return None
    if why is not None:
        return "ended", why
    if broken is not None:
        return "limit", broken
    if used is None:
        return None
    cpu.add(now, used)
    if used >= BUSY_SHARE * limits.cpu_seconds:
        return "busy", f"it used {used:.1f} of its {limits.cpu_seconds} CPU seconds before its call"
    return None
