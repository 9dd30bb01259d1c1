"""The checks of ``CONTRACT``: one payload in, one outcome out, under the limits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import replace

from sandboxes.base import SandboxUnavailable, StopReason
from sandboxes.testing._harness import Check, Harness


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
