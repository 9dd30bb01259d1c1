"""One call from the command line that Ctrl-C (or SIGTERM) ends cleanly.

asyncio's own SIGINT handling cancels the call on the first Ctrl-C but raises
``KeyboardInterrupt`` straight into the event loop on the second, which would abandon the
sandbox's teardown half way. Here the first such signal cancels the call and makes the
process ignore the rest (at the OS level: a key held down cannot slip in between two
Python statements); the cancellation runs the shielded teardown, ``call.finished`` is
written with ``cancelled: true``, the runner is closed (backends included), and only then
does the caller learn which signal ended it.
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType
from typing import Any

from runner.api import Runner
from runner.call.events import EventListener

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """The call was stopped by ``signum``; its sandbox is gone and the runner closed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def handle_interruptibly(
    runner: Runner, request: object, on_event: EventListener | None = None
) -> dict[str, Any]:
    """``runner.handle(request)`` on a fresh event loop (the tool's events to
    ``on_event``), closing ``runner`` afterwards.

    Raises:
        Interrupted: SIGINT or SIGTERM arrived; raised after the sandbox is gone.
    """
    return asyncio.run(_serve(runner, request, on_event))


async def _serve(runner: Runner, request: object, on_event: EventListener | None) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    call = asyncio.ensure_future(runner.ahandle(request, on_event))
    received: list[int] = []

    def stop(signum: int, _frame: FrameType | None) -> None:
        # A Python-level handler, not loop.add_signal_handler: the loop would put its own
        # handlers back (default ones) when it closes, while the teardown may still run.
        for each in STOP_SIGNALS:
            signal.signal(each, signal.SIG_IGN)
        received.append(signum)
        loop.call_soon_threadsafe(call.cancel)

    before = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        return await call
    except asyncio.CancelledError:
        if not received:
            raise
        raise Interrupted(received[0]) from None
    finally:
        await runner.aclose()
        if not received:  # else they stay ignored: the process is on its way out
            for signum, handler in before.items():
                signal.signal(signum, handler)
