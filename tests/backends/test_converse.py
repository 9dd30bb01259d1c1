"""Dialogues with a sandboxed tool, in both backends, cold and started ahead:
``sandboxes.testing.DIALOGUE_CONTRACT``, and what a dialogue's ``send`` meets once the
tool's stdin is closed."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest
from docker import APIClient

from sandboxes import Sandbox, plugins
from sandboxes._exchange import DialogueExchange, Stdin
from sandboxes._exec_status import new_token
from sandboxes.base import Pipe, StopReason
from sandboxes.docker._attach import Attached, SocketStdin, drain
from sandboxes.docker._frames import HEADER, STDERR, STDOUT
from sandboxes.docker._prepared import _FINISHED, PreparedContainer
from sandboxes.subprocess._process import _WriterStdin
from sandboxes.testing import DIALOGUE_CONTRACT, Harness, Lines
from sandboxes.testing import Check as ContractCheck

IDS = [check.__name__ for check in DIALOGUE_CONTRACT]
MODES = [pytest.param(False, id="cold"), pytest.param(True, id="warm")]
# A warm sandbox waits this long before its call takes it: its timeout must not count it.
WARM_IDLE_S = 1.5


@pytest.fixture(scope="module")
def subprocess_backend() -> Sandbox:
    return plugins.create("subprocess", {})


@pytest.mark.parametrize("warm", MODES)
@pytest.mark.parametrize("check", DIALOGUE_CONTRACT, ids=IDS)
def test_the_subprocess_backend_holds_dialogues(
    check: ContractCheck, warm: bool, subprocess_backend: Sandbox, tmp_path: Path
) -> None:
    harness = Harness(make=lambda: subprocess_backend, workdir=tmp_path, warm=warm, warm_idle_s=WARM_IDLE_S)
    asyncio.run(check(harness))


@pytest.mark.docker
@pytest.mark.parametrize("warm", MODES)
@pytest.mark.parametrize("check", DIALOGUE_CONTRACT, ids=IDS)
def test_the_docker_backend_holds_dialogues(
    check: ContractCheck, warm: bool, docker_client: APIClient, tmp_path: Path
) -> None:
    backend = plugins.create("docker", {})
    harness = Harness(
        make=lambda: backend,
        workdir=tmp_path,
        image="runner/python-tools:latest",
        warm=warm,
        warm_idle_s=WARM_IDLE_S,
    )
    asyncio.run(check(harness))
    assert docker_client.containers(all=True, filters={"label": f"io.runner.owner-pid={os.getpid()}"}) == []


# -- a send to a closed stdin --------------------------------------------------------


async def _sends_until_refused(stdin: Stdin) -> ConnectionError | None:
    """A dialogue's sends, through the pipe the backend gives it, until one is refused."""
    exchange = DialogueExchange(Lines(["x" * 70_000] * 20), max_output=1000)
    dialogue = exchange._dialogue
    assert isinstance(dialogue, Lines)
    exchange.stdout.close()  # the tool said nothing: no answer holds the sends back
    await asyncio.wait_for(exchange.speak(stdin, b""), 10)
    assert exchange.failure is None
    return dialogue.refused


def test_a_send_to_a_closed_stdin_pipe_is_a_connection_error() -> None:
    async def main() -> ConnectionError | None:
        loop = asyncio.get_running_loop()
        read_end, write_end = os.pipe()
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(write_end, "wb")
        )
        writer = asyncio.StreamWriter(transport, protocol, None, loop)
        os.close(read_end)  # the tool closed its stdin
        try:
            return await _sends_until_refused(_WriterStdin(writer))
        finally:
            transport.close()

    assert isinstance(asyncio.run(main()), ConnectionError)


def test_a_send_to_a_closed_attach_socket_is_a_connection_error() -> None:
    async def main() -> ConnectionError | None:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.close()  # the container is gone
        try:
            return await _sends_until_refused(SocketStdin(ours))
        finally:
            ours.close()

    assert isinstance(asyncio.run(main()), ConnectionError)


class _Flood:
    """Sends after the tool's one answer, until refused or cancelled: never anything else."""

    def __init__(self) -> None:
        self.ended_by: str = "nothing"

    async def talk(self, pipe: Pipe) -> None:
        await pipe.send(b"one\n")
        while await pipe.receive() == b"":
            pass
        try:
            while True:
                await pipe.send(b"z" * 65536)
        except ConnectionError:
            self.ended_by = "refused"
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.ended_by = "cancelled"
            raise


@pytest.mark.parametrize("backend", ["subprocess", pytest.param("docker", marks=pytest.mark.docker)])
def test_sending_to_a_tool_gone_is_refused_or_cut_short_and_the_run_says_it_exited(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # The sandbox's init holds the tool's stdin too: only the tool's exit closes it, and
    # that exit ends the run; which the dialogue meets first is a race, both are fine.
    image = None
    if backend == "docker":
        request.getfixturevalue("docker_client")
        image = "runner/python-tools:latest"
    harness = Harness(make=lambda: plugins.create(backend, {}), workdir=tmp_path, image=image)
    spec = harness.tool("import sys\nsys.stdin.readline()\nprint('bye', flush=True)\nsys.exit(4)\n")
    dialogue = _Flood()
    outcome = asyncio.run(harness.converse(spec, dialogue))
    assert outcome.reason is StopReason.EXIT_CODE and outcome.exit_code == 4, outcome
    assert dialogue.ended_by in ("refused", "cancelled")


# -- the rest of stderr after a container's last answer --------------------------------


class _OneAnswer:
    async def talk(self, pipe: Pipe) -> None:
        await pipe.send(b"hi\n")
        await pipe.receive()


async def _stderr_after_the_last_answer(turns: int, goodbye: bytes = b"") -> str:
    """A container's dialogue over a socket pair standing for the daemon's attach stream:
    the answer on stdout, then after ``turns`` turns of the loop ``goodbye`` on stdout and
    a stderr line, then the stream's end (the kill). Returns the stderr tail the run keeps."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    # Only the attach stream is used: no container, so none of what its set-up makes.
    prepared = PreparedContainer.__new__(PreparedContainer)
    prepared.cgroup_shows_processes = False
    attached = Attached(ours, new_token())
    exchange = DialogueExchange(_OneAnswer(), max_output=1000)

    async def daemon() -> None:
        await loop.sock_recv(theirs, 100)
        await loop.sock_sendall(theirs, HEADER.pack(STDOUT, 5) + b"echo\n")
        for _ in range(turns):
            await asyncio.sleep(0)
        if goodbye:
            await loop.sock_sendall(theirs, HEADER.pack(STDOUT, len(goodbye)) + goodbye)
        await loop.sock_sendall(theirs, HEADER.pack(STDERR, 5) + b"said\n")

    talking = asyncio.ensure_future(daemon())
    try:
        assert await prepared._exchange(attached, exchange, b"", exchange.stderr) is _FINISHED
        await talking
        theirs.close()
        await drain(attached)
    finally:
        attached.close()
        theirs.close()
    return exchange.stderr.text()


@pytest.mark.parametrize("turns", range(8))
def test_what_came_on_stderr_as_a_dialogue_ended_is_kept(turns: int) -> None:
    # A read cancelled at the dialogue's end, just as its bytes had come, dropped them: the
    # rest of stderr the daemon had sent was lost (once in a while in the suite, there
    # with a real container; here the turn that lost it every time).
    assert asyncio.run(_stderr_after_the_last_answer(turns)) == "said\n"


@pytest.mark.parametrize("turns", range(8))
def test_stdout_past_the_cap_as_a_dialogue_ends_never_costs_the_rest_of_stderr(turns: int) -> None:
    # Past the end it is in no answer, and the cap (1000 bytes here) is passed at the end
    # or just before: either way the stream is read on. Its overflow ended the reading
    # before the stderr line that followed.
    assert asyncio.run(_stderr_after_the_last_answer(turns, b"x" * 2000)) == "said\n"
