"""A fork-mode template closed while calls ask it for their processes: every ask ends,
with a process or with "closed", and nothing is left of either.

Drives the template of a real runner's pool (``FrozenTemplate``) directly, so that the
asks and the close race as closely as the tracer's queue allows.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from concurrent.futures import Future, wait
from typing import Any

import pytest
from conftest import ToolBench, wait_for
from support.fork_probes import running_with

from sandboxes.subprocess._fork_mode import ToolTemplate
from sandboxes.subprocess._forked import exit_status_known
from sandboxes.subprocess._frozen_calls import Cloned
from sandboxes.subprocess._frozen_checks import TemplateRefused
from sandboxes.subprocess._ptrace import TraceError
from sandboxes.subprocess.sandbox import SubprocessSandbox

pytestmark = pytest.mark.skipif(
    not (os.geteuid() == 0 and os.uname().machine == "x86_64" and exit_status_known()),
    reason="fork mode needs root, x86-64 and Linux 6.15+",
)

ASKERS = 6
ASKING_S = 0.3  # asks made before the close, and as long after it


def _recording_templates(monkeypatch: pytest.MonkeyPatch) -> list[ToolTemplate]:
    """Every tool template the subprocess backend makes from now on."""
    made: list[ToolTemplate] = []
    fork_template = SubprocessSandbox.fork_template

    def recording(self: SubprocessSandbox, *args: Any) -> ToolTemplate:
        template = fork_template(self, *args)
        made.append(template)
        return template

    monkeypatch.setattr(SubprocessSandbox, "fork_template", recording)
    return made


@pytest.mark.parametrize("round_", range(3))
def test_asks_for_a_calls_process_as_its_template_closes_each_end_and_leave_nothing(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch, round_: int
) -> None:
    mark = uuid.uuid4().hex
    bench.tool("closing", "import json, sys\njson.load(sys.stdin)\nprint('{}')\n", env={"FORK_MARK": mark})
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    asks: list[Future[Cloned]] = []
    made = _recording_templates(monkeypatch)
    with bench.runner() as runner:
        wait_for(lambda: runner.warm_sandboxes().get("closing") == 1, 30.0)
        (template,) = made
        frozen = template._template
        assert frozen is not None
        stop = threading.Event()

        def ask() -> None:
            while not stop.is_set():
                asks.append(frozen.clone())  # queued for the tracer, or refused at once
                time.sleep(0.005)

        askers = [threading.Thread(target=ask) for _ in range(ASKERS)]
        for asker in askers:
            asker.start()
        try:
            time.sleep(ASKING_S)
            frozen.close()  # while the queue holds asks, some made after it is closed
            time.sleep(ASKING_S)
        finally:
            stop.set()
            for asker in askers:
                asker.join()
        _, pending = wait(asks, timeout=30)
        assert not pending, f"{len(pending)} of {len(asks)} asks never ended"
        forked = refused = 0
        for done in asks:
            try:
                cloned = done.result()
            except (TemplateRefused, TraceError):
                refused += 1
            else:
                forked += 1
                cloned.drop()
        assert forked and refused, (forked, refused)  # the close came while asks were served
    wait_for(lambda: running_with(mark) == [], 10.0)


def test_a_runner_closed_while_a_template_imports_closes_at_once_and_leaves_nothing(
    bench: ToolBench,
) -> None:
    mark = uuid.uuid4().hex
    bench.tool("slow", "import json, sys\nimport slow_import\nprint('{}')\n", env={"FORK_MARK": mark})
    (bench.tools / "slow" / "slow_import.py").write_text("import time\ntime.sleep(25)\n")
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    runner = bench.runner()
    try:
        wait_for(lambda: running_with(mark) != [], 15.0)  # its import under way
        started = time.monotonic()
    finally:
        runner.close()
    closed_s = time.monotonic() - started
    assert closed_s < 5.0, f"the runner's close waited {closed_s:.1f} s for the template's import"
    wait_for(lambda: running_with(mark) == [], 10.0)
