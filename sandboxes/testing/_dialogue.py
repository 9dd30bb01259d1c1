"""The checks of ``DIALOGUE_CONTRACT``: a tool that answers more than once (an MCP
server), held through ``Converses.converse``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

from sandboxes.base import Pipe, StopReason
from sandboxes.testing._harness import Check, Harness

LINE_ECHO = """
import sys
for line in sys.stdin:
    sys.stdout.write("echo " + line)
    sys.stdout.flush()
"""


async def _wait_forever() -> None:
    await asyncio.Event().wait()


class Lines:
    """A dialogue by lines: ``sends`` each line and keeps its answer line in ``heard``;
    then returns, or with ``linger`` waits (for the run's end) as a dialogue must at
    the tool's end. Never raises: a refused send is kept in ``refused``."""

    def __init__(self, sends: list[str], linger: bool = False) -> None:
        self.sends = sends
        self.linger = linger
        self.heard: list[str] = []
        self.refused: ConnectionError | None = None
        self.talk_started = 0.0
        self.cancelled_after = -1.0  # seconds from the start of talk to its cancellation
        self._buffer = b""

    async def talk(self, pipe: Pipe) -> None:
        self.talk_started = time.monotonic()
        try:
            for line in self.sends:
                try:
                    await pipe.send(line.encode() + b"\n")
                except ConnectionError as exc:
                    self.refused = exc
                    break
                answer = await self._line(pipe)
                if answer is None:
                    break
                self.heard.append(answer)
            if self.linger:
                await _wait_forever()
        except asyncio.CancelledError:
            self.cancelled_after = time.monotonic() - self.talk_started
            raise

    async def _line(self, pipe: Pipe) -> str | None:
        while b"\n" not in self._buffer:
            chunk = await pipe.receive()
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


class Drain:
    """A dialogue that only receives, counting the bytes; at the end of stdout it waits."""

    def __init__(self) -> None:
        self.received = 0

    async def talk(self, pipe: Pipe) -> None:
        while chunk := await pipe.receive():
            self.received += len(chunk)
        await _wait_forever()


async def check_a_dialogue_hears_each_answer_and_its_end_kills_the_tool(h: Harness) -> None:
    spec = h.tool(
        """
        import os, sys, time
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        for line in sys.stdin:
            sys.stdout.write("echo " + line)
            sys.stdout.flush()
        """
    )
    dialogue = Lines(["one", "two", "three"])
    outcome = await h.converse(spec, dialogue)
    assert outcome.reason is None and outcome.ok, outcome
    assert dialogue.heard == ["echo one", "echo two", "echo three"], dialogue.heard
    assert outcome.stdout == b"", outcome.stdout
    assert await h.gone(spec.request_id), "the tool outlived the end of its dialogue"


async def check_a_dialogue_flooded_past_the_cap_is_an_output_limit(h: Harness) -> None:
    spec = h.tool(
        """
        import sys
        while True:
            sys.stdout.write("y" * 65536)
        """
    )
    dialogue = Drain()
    outcome = await h.converse(spec, dialogue, max_output_bytes=100_000)
    assert outcome.reason is StopReason.OUTPUT_LIMIT, outcome
    assert dialogue.received <= 100_000, dialogue.received
    assert await h.gone(spec.request_id), "the flooding tool outlived its run"


async def check_a_dialogue_with_a_hanging_tool_times_out_from_the_start_of_talk(h: Harness) -> None:
    spec = h.tool(
        """
        import os, sys, time
        line = sys.stdin.readline()
        sys.stdout.write("echo " + line)
        sys.stdout.flush()
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
        time.sleep(60)
        """
    )
    dialogue = Lines(["one"], linger=True)
    outcome = await h.converse(spec, dialogue, timeout_ms=1000)
    assert outcome.reason is StopReason.TIMEOUT, outcome
    assert dialogue.heard == ["echo one"], dialogue.heard
    # Counted from talk's start, not from the sandbox's (a warm one waited before).
    assert 0.8 <= dialogue.cancelled_after < 10, dialogue.cancelled_after
    assert await h.gone(spec.request_id), "a process of the tool outlived its timeout"


async def check_a_tool_that_exits_mid_dialogue_is_an_exit_code_even_for_zero(h: Harness) -> None:
    for status in (0, 3):
        spec = h.tool(
            f"""
            import sys
            line = sys.stdin.readline()
            sys.stdout.write("echo " + line)
            sys.stdout.flush()
            sys.exit({status})
            """
        )
        dialogue = Lines(["one", "two"], linger=True)
        outcome = await h.converse(spec, dialogue)
        assert outcome.reason is StopReason.EXIT_CODE, outcome
        assert outcome.exit_code == status, outcome
        assert dialogue.heard == ["echo one"], dialogue.heard
        assert dialogue.cancelled_after >= 0, "talk was not cancelled at the tool's exit"


async def check_a_dialogue_keeps_the_stderr_tail(h: Harness) -> None:
    spec = h.tool(
        """
        import sys
        for line in sys.stdin:
            sys.stderr.write("x" * 100000 + "said " + line)
            sys.stderr.flush()
            sys.stdout.write("echo " + line)
            sys.stdout.flush()
        """
    )
    outcome = await h.converse(spec, Lines(["one", "the-end"]))
    assert outcome.ok, outcome
    assert outcome.stderr_tail.endswith("said the-end\n"), outcome.stderr_tail[-40:]
    assert len(outcome.stderr_tail) < 100000


async def check_a_dialogue_with_a_program_that_cannot_start_is_not_executable(h: Harness) -> None:
    spec = replace(h.tool(LINE_ECHO), command=("no-such-program-of-the-contract",))
    dialogue = Lines(["one"], linger=True)
    outcome = await h.converse(spec, dialogue)
    assert outcome.reason is StopReason.NOT_EXECUTABLE, outcome
    assert dialogue.heard == [], dialogue.heard


async def check_a_cancelled_dialogue_leaves_nothing(h: Harness) -> None:
    spec = h.tool(
        """
        import os, sys, time
        if os.fork() == 0:
            time.sleep(60)
        for line in sys.stdin:
            sys.stdout.write("echo " + line)
            sys.stdout.flush()
        """
    )
    dialogue = Lines(["one"], linger=True)
    running = asyncio.ensure_future(h.converse(spec, dialogue, timeout_ms=20_000))
    deadline = time.monotonic() + 20
    while not dialogue.heard and not running.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert dialogue.heard == ["echo one"], (dialogue.heard, running)
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    assert await h.gone(spec.request_id), "the tool outlived the cancelled dialogue"


DIALOGUE_CONTRACT: tuple[Check, ...] = (
    check_a_dialogue_hears_each_answer_and_its_end_kills_the_tool,
    check_a_dialogue_flooded_past_the_cap_is_an_output_limit,
    check_a_dialogue_with_a_hanging_tool_times_out_from_the_start_of_talk,
    check_a_tool_that_exits_mid_dialogue_is_an_exit_code_even_for_zero,
    check_a_dialogue_keeps_the_stderr_tail,
    check_a_dialogue_with_a_program_that_cannot_start_is_not_executable,
    check_a_cancelled_dialogue_leaves_nothing,
)
