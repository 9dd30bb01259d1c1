"""One call from the command line that Ctrl-C (or SIGTERM) ends cleanly (SPEC 6).

asyncio's own SIGINT handling cancels the call on the first Ctrl-C but raises
``KeyboardInterrupt`` straight into the event loop on the second, which would abandon the
sandbox's teardown half way. Here every such signal only cancels the call (once): the
cancellation runs the shielded teardown, ``call.finished`` is written with
``cancelled: true``, the runner is closed (backends included), and only then does the
caller learn which signal ended it.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from runner.api import Runner

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """The call was stopped by ``signum``; its sandbox is gone and the runner closed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def handle_interruptibly(runner: Runner, request: object) -> dict[str, Any]:
    """``runner.handle(request)`` on a fresh event loop, closing ``runner`` afterwards.

    Raises:
        Interrupted: SIGINT or SIGTERM arrived; raised after the sandbox is gone.
    """
    return asyncio.run(_serve(runner, request))


async def _serve(runner: Runner, request: object) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    call = asyncio.ensure_future(runner.ahandle(request))
    received: list[int] = []

    def stop(signum: int) -> None:
        if not received:  # later signals wait for the same teardown
            call.cancel()
        received.append(signum)

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop, signum)
    try:
        try:
            return await call
        except asyncio.CancelledError:
            if not received:
                raise
            raise Interrupted(received[0]) from None
        finally:
            await runner.aclose()
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
