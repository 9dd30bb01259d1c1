"""The contract every backend keeps, as checks a backend's own tests can run.

Each check is an ``async`` function taking a ``Harness`` and raising ``AssertionError``
when the backend breaks a promise of the interface (``sandboxes.base``). They drive the
backend directly (``prepare`` -> ``run`` -> ``close``), with real tools written on the fly,
so they hold for any backend, ours or a plugin's::

    import asyncio, pytest
    from sandboxes.testing import CONTRACT, Harness
    from my_backend import create

    @pytest.mark.parametrize("check", CONTRACT, ids=lambda check: check.__name__)
    def test_my_backend_keeps_the_contract(check, tmp_path):
        asyncio.run(check(Harness(make=lambda: create({}), workdir=tmp_path)))

The tools are Python programs (``python3`` on the sandbox's PATH). ``Harness.alive`` tells
whether anything started for a request is still running; the default looks through this
host's ``/proc`` for the ``REQUEST_ID`` the harness puts in each tool's environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import textwrap
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from sandboxes.base import (
    Closable,
    Converses,
    Dialogue,
    LaunchSpec,
    Limits,
    Pipe,
    PreparedSandbox,
    PreStarts,
    Sandbox,
    SandboxOutcome,
    SandboxUnavailable,
    StopReason,
)

# How long after ``close`` (or a kill) the processes of a call may take to be reaped.
GONE_WITHIN_S = 2.0
Check = Callable[["Harness"], Coroutine[Any, Any, None]]


def processes_with_env(marker: str) -> list[int]:
    """Pids of live processes on this host whose environment holds ``marker`` (``K=V``)."""
    needle = marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def processes_alive(request_id: str) -> bool:
    """Whether any live process on this host has ``REQUEST_ID=<request_id>`` in its environment."""
    return bool(processes_with_env(f"REQUEST_ID={request_id}"))


@dataclass
class Harness:
    """What the checks need of a backend.

    ``make`` builds a working backend; ``workdir`` is a folder the backend can mount tools
    from; ``image`` is given to container backends; ``unavailable`` builds a backend whose
    ``prepare`` must raise ``SandboxUnavailable`` (None skips that check's subject: the check
    then fails, so say how your backend refuses); ``alive`` is as above.
    """

    make: Callable[[], Sandbox]
    workdir: Path
    image: str | None = None
    unavailable: Callable[[], Sandbox] | None = None
    alive: Callable[[str], bool] = processes_alive
    limits: Limits = field(default_factory=lambda: Limits(timeout_ms=20_000))
    # Dialogues only: hold them with sandboxes started ahead (``PreStarts.prestart``),
    # each left waiting ``warm_idle_s`` before its call takes it.
    warm: bool = False
    warm_idle_s: float = 0.0

    def tool(self, code: str) -> LaunchSpec:
        """A fresh tool folder holding ``code`` as ``main.py``, and its launch spec."""
        request_id = f"contract-{uuid.uuid4().hex[:12]}"
        folder = self.workdir / request_id
        folder.mkdir(parents=True)
        (folder / "main.py").write_text(textwrap.dedent(code))
        folder.chmod(0o755)
        (folder / "main.py").chmod(0o644)
        env = {"TOOL_NAME": "contract", "REQUEST_ID": request_id}
        return LaunchSpec("contract", request_id, ("python3", "main.py"), folder, env=env, image=self.image)

    async def run(self, code: str, payload: bytes = b"{}", **limits: int) -> tuple[SandboxOutcome, str]:
        """One whole attempt: prepare, run, close. Returns the outcome and the request id."""
        spec = self.tool(code)
        return await self.run_spec(spec, payload, **limits), spec.request_id

    async def run_spec(self, spec: LaunchSpec, payload: bytes = b"{}", **limits: int) -> SandboxOutcome:
        """One whole attempt of ``spec`` (e.g. ``tool``'s with another command)."""
        backend = self.make()
        prepared = await backend.prepare(spec, replace(self.limits, **cast("dict[str, Any]", limits)))
        try:
            return await prepared.run(payload)
        finally:
            await prepared.close()
            await _finish_deferred(backend)

    async def converse(self, spec: LaunchSpec, dialogue: Dialogue, **limits: int) -> SandboxOutcome:
        """One whole attempt holding ``dialogue``: prepare (or start ahead), converse, close."""
        resolved = replace(self.limits, **cast("dict[str, Any]", limits))
        backend = self.make()
        prepared: PreparedSandbox
        if self.warm:
            assert isinstance(backend, PreStarts), "the backend cannot start sandboxes ahead"
            warm = await asyncio.to_thread(backend.prestart, spec, resolved)
            warm.set_timeout(resolved.timeout_ms)
            prepared = warm
            await asyncio.sleep(self.warm_idle_s)
        else:
            prepared = await backend.prepare(spec, resolved)
        try:
            assert isinstance(prepared, Converses), "the prepared sandbox cannot hold a dialogue"
            return await prepared.converse(dialogue)
        finally:
            await prepared.close()
            await _finish_deferred(backend)

    async def gone(self, request_id: str) -> bool:
        deadline = time.monotonic() + GONE_WITHIN_S
        while self.alive(request_id):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True


async def check_success_returns_stdout(h: Harness) -> None:
    outcome, _ = await h.run(
        """
        import json, sys
        request = json.load(sys.stdin)
        print(json.dumps({"echo": request["x"]}))
        """,
        payload=b'{"x": 42}',
    )
    assert outcome.ok and outcome.reason is None, outcome
    assert outcome.exit_code == 0, outcome
    try:
        document = json.loads(outcome.stdout)
    except ValueError:
        document = None
    assert document == {"echo": 42}, outcome.stdout


async def check_exit_status_is_reported(h: Harness) -> None:
    outcome, _ = await h.run("import sys\nsys.stdin.read()\nsys.exit(3)\n")
    assert outcome.reason is StopReason.EXIT_CODE, outcome
    assert outcome.exit_code == 3, outcome


async def check_a_program_that_cannot_start_is_not_executable(h: Harness) -> None:
    """A command that cannot be started is an outcome (never an exception of ``run``),
    ``NOT_EXECUTABLE``; a tool that exits 127 itself, saying the same, is ``EXIT_CODE``."""
    spec = replace(h.tool("print('{}')\n"), command=("no-such-program-of-the-contract",))
    try:
        outcome = await h.run_spec(spec)
    except Exception as exc:
        raise AssertionError(f"run raised {exc!r} for a missing program") from exc
    assert outcome.reason is StopReason.NOT_EXECUTABLE, outcome
    forged, _ = await h.run(
        """
        import sys
        sys.stdin.read()
        sys.stderr.write("sh: 1: exec: no-such-program-of-the-contract: not found\\n")
        sys.exit(127)
        """
    )
    assert forged.reason is StopReason.EXIT_CODE, forged
    assert forged.exit_code == 127, forged


async def check_stderr_is_kept_as_a_tail(h: Harness) -> None:
    outcome, _ = await h.run(
        """
        import sys
        sys.stdin.read()
        sys.stderr.write("x" * 100000 + "the-end")
        print("{}")
        """
    )
    assert outcome.ok, outcome
    assert outcome.stderr_tail.endswith("the-end"), outcome.stderr_tail[-40:]
    assert len(outcome.stderr_tail) < 100000


async def check_a_timeout_kills_the_whole_tree(h: Harness) -> None:
    outcome, request_id = await h.run(
        """
        import os, signal, sys, time
        sys.stdin.read()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
        time.sleep(60)
        """,
        timeout_ms=1000,
    )
    assert outcome.reason is StopReason.TIMEOUT, outcome
    assert outcome.duration_ms < 10_000, outcome
    assert await h.gone(request_id), "a process of the tool outlived its timeout"


async def check_output_past_the_cap_is_an_output_limit(h: Harness) -> None:
    outcome, _ = await h.run(
        """
        import sys
        sys.stdin.read()
        while True:
            sys.stdout.write("y" * 65536)
        """,
        max_output_bytes=100_000,
    )
    assert outcome.reason is StopReason.OUTPUT_LIMIT, outcome
    assert len(outcome.stdout) <= 100_000


async def check_memory_past_the_limit_is_a_memory_limit(h: Harness) -> None:
    outcome, _ = await h.run(
        """
        import sys
        sys.stdin.read()
        hog = []
        while True:
            hog.append(bytearray(8 * 1024 * 1024))
        """,
        memory_mb=64,
    )
    assert outcome.reason is StopReason.MEMORY_LIMIT, outcome


async def check_forks_past_the_limit_are_a_pids_limit(h: Harness) -> None:
    outcome, _ = await h.run(
        """
        import os, sys, time
        sys.stdin.read()
        try:
            for _ in range(200):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
        except OSError:
            sys.exit(1)
        print("{}")
        """,
        max_pids=16,
    )
    assert outcome.reason is StopReason.PIDS_LIMIT, outcome


async def check_cpu_time_past_the_budget_is_a_cpu_limit(h: Harness) -> None:
    outcome, _ = await h.run(
        "import sys\nsys.stdin.read()\nwhile True:\n    pass\n",
        cpu_seconds=1,
        timeout_ms=20_000,
    )
    assert outcome.reason is StopReason.CPU_LIMIT, outcome
    assert outcome.duration_ms < 15_000, outcome


async def check_close_twice_is_safe(h: Harness) -> None:
    spec = h.tool("import sys\nsys.stdin.read()\nprint('{}')\n")
    prepared = await h.make().prepare(spec, h.limits)
    outcome = await prepared.run(b"{}")
    await prepared.close()
    try:
        await prepared.close()
    except Exception as exc:
        raise AssertionError(f"a second close raised {type(exc).__name__}: {exc}") from exc
    assert outcome.ok, outcome


async def check_prepare_then_close_without_run_leaves_nothing(h: Harness) -> None:
    spec = h.tool("import sys, time\nsys.stdin.read()\ntime.sleep(60)\n")
    prepared = await h.make().prepare(spec, h.limits)
    await prepared.close()
    assert await h.gone(spec.request_id), "something of a sandbox that never ran is alive"


async def check_an_unavailable_backend_raises_from_prepare(h: Harness) -> None:
    assert h.unavailable is not None, "the harness names no way to make the backend unavailable"
    spec = h.tool("print('{}')\n")
    raised = False
    try:
        prepared = await h.unavailable().prepare(spec, h.limits)
    except SandboxUnavailable as exc:
        raised = bool(exc.message)
    else:
        await prepared.close()
    assert raised, "prepare did not raise SandboxUnavailable (with a message)"


async def check_a_cancelled_run_leaves_nothing(h: Harness) -> None:
    spec = h.tool(
        """
        import os, sys, time
        sys.stdin.read()
        if os.fork() == 0:
            time.sleep(60)
        time.sleep(60)
        """
    )
    prepared = await h.make().prepare(spec, replace(h.limits, timeout_ms=5000))
    running = asyncio.ensure_future(prepared.run(b"{}"))
    deadline = time.monotonic() + 10
    while not h.alive(spec.request_id) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    await asyncio.shield(prepared.close())  # what a caller's teardown does
    assert await h.gone(spec.request_id), "the tool outlived the cancelled run"


async def check_secrets_reach_the_tool_as_environment_and_stdin_stays_the_payload(h: Harness) -> None:
    value = 'two\nlines, "quotes", \\ and ü\n'
    spec = h.tool(
        """
        import json, os, sys
        print(json.dumps({"stdin": sys.stdin.read(), "secret": os.environ.get("API_TOKEN")}))
        """
    )
    spec = replace(spec, secrets={"API_TOKEN": value})
    prepared = await h.make().prepare(spec, h.limits)
    try:
        outcome = await prepared.run(b'{"x": 1}')
    finally:
        await prepared.close()
    assert outcome.ok, outcome
    assert json.loads(outcome.stdout) == {"stdin": '{"x": 1}', "secret": value}, outcome.stdout


async def check_the_tool_side_helper_imports_and_is_read_only(h: Harness) -> None:
    """``import runner_tool`` works in every backend (``sandboxes.view.LIBRARY_MOUNT`` on
    ``PYTHONPATH``), and no tool can change what the next tool imports."""
    outcome, _ = await h.run(
        """
        import json, sys
        sys.stdin.read()
        import runner_tool
        try:
            with open(runner_tool.__file__, "a") as helper:
                helper.write("# changed by a tool")
            changed = True
        except OSError:
            changed = False
        print(json.dumps({"changed": changed}))
        """
    )
    assert outcome.ok, f"import runner_tool failed: {outcome.stderr_tail[-300:]}"
    assert json.loads(outcome.stdout) == {"changed": False}, "a tool could write to the helper"


CONTRACT: tuple[Check, ...] = (
    check_success_returns_stdout,
    check_secrets_reach_the_tool_as_environment_and_stdin_stays_the_payload,
    check_exit_status_is_reported,
    check_a_program_that_cannot_start_is_not_executable,
    check_stderr_is_kept_as_a_tail,
    check_a_timeout_kills_the_whole_tree,
    check_output_past_the_cap_is_an_output_limit,
    check_memory_past_the_limit_is_a_memory_limit,
    check_forks_past_the_limit_are_a_pids_limit,
    check_cpu_time_past_the_budget_is_a_cpu_limit,
    check_close_twice_is_safe,
    check_prepare_then_close_without_run_leaves_nothing,
    check_an_unavailable_backend_raises_from_prepare,
    check_a_cancelled_run_leaves_nothing,
    check_the_tool_side_helper_imports_and_is_read_only,
)


# -- dialogues (SPEC 12): a tool that answers more than once ---------------------------

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


async def _finish_deferred(backend: Sandbox) -> None:
    """What a backend does after a call's ``close`` (a dead container's removal, say) is
    done by its ``aclose`` at the latest: the checks look once it is (``sandboxes._deferred``)."""
    if isinstance(backend, Closable):
        await backend.aclose()
