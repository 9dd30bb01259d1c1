"""Fork-mode templates closed at awkward moments, and nothing left of them.

- Closed while calls ask it for their processes: every ask ends, with a process or
  with "closed". Drives the template of a real runner's pool (``FrozenTemplate``)
  directly, so that the asks and the close race as closely as the tracer's queue allows.
- A runner closed while its template is still being made (an import that takes ten
  minutes, or one that leaves the template where it cannot be stopped): the close does
  not wait for it.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench, wait_for
from support.fork_probes import needs_fork_mode, running_with

from runner import Runner
from sandboxes.subprocess import _fork_mode, _frozen
from sandboxes.subprocess._cgroup import CallCgroup, CgroupFactory
from sandboxes.subprocess._fork_mode import ToolTemplate
from sandboxes.subprocess._frozen_calls import Cloned
from sandboxes.subprocess._frozen_checks import TemplateRefused
from sandboxes.subprocess._ptrace import TraceError
from sandboxes.subprocess.sandbox import SubprocessSandbox

pytestmark = needs_fork_mode

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


# Imports that keep a template from being frozen: for ten minutes, or for ever once it
# has said ready (a vfork whose child never execs nor exits: the template cannot be
# stopped until it is killed).
SLOW_IMPORT = "import time\ntime.sleep(600)\n"
STUCK_IMPORT = """
import ctypes, os
os.write(1, b"r")  # ready, by its own word
if ctypes.CDLL(None).syscall(58) == 0:  # vfork
    ctypes.CDLL(None).pause()
"""


def _recording_cgroups(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders of every cgroup the subprocess backend makes from now on."""
    made: list[Path] = []
    create = CgroupFactory.create

    def recording(self: CgroupFactory, *args: Any) -> CallCgroup:
        group = create(self, *args)
        made.extend(group.dirs)
        return group

    monkeypatch.setattr(CgroupFactory, "create", recording)
    return made


@pytest.mark.parametrize(
    ("imported", "processes"), [(SLOW_IMPORT, 1), (STUCK_IMPORT, 2)], ids=["slow", "stuck"]
)
def test_a_runner_closed_while_its_template_is_made_closes_at_once_and_leaves_nothing(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch, imported: str, processes: int
) -> None:
    mark = uuid.uuid4().hex
    bench.tool("slow", "import json, sys\nimport slow_import\nprint('{}')\n", env={"FORK_MARK": mark})
    (bench.tools / "slow" / "slow_import.py").write_text(imported)
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    cgroups = _recording_cgroups(monkeypatch)
    names: list[str] = []  # of the folders the backend makes (the template's among them)
    next_name = SubprocessSandbox.next_name

    def recording_name(self: SubprocessSandbox) -> str:
        names.append(next_name(self))
        return names[-1]

    monkeypatch.setattr(SubprocessSandbox, "next_name", recording_name)
    # Not ``bench.runner()``, which in the fork-mode suite waits for the pool to be ready.
    runner = Runner.load(tools=bench.tools, policies=bench.write_policy(), audit_log=bench.audit_log)
    try:
        # The template's processes (the import, and its vfork child), not yet frozen.
        wait_for(lambda: len(running_with(mark)) == processes, 15.0)
        scratch = runner._sandbox_factory("subprocess").scratch_root  # type: ignore[attr-defined]
        time.sleep(0.5)  # a stuck template's tracer is in its wait by now
        assert runner.warm_sandboxes().get("slow") == 0
        folders = [scratch / name for name in names]
        assert [folder for folder in folders if folder.exists()]  # the template's
    finally:
        closing = threading.Thread(target=runner.close, daemon=True)
        started = time.monotonic()
        closing.start()
        closing.join(20)
    closed_s = time.monotonic() - started
    assert not closing.is_alive(), "the runner's close waits on the template for ever"
    assert closed_s < 5.0, f"the runner's close waited {closed_s:.1f} s for the template"
    wait_for(lambda: running_with(mark) == [], 10.0)
    assert cgroups and not [folder for folder in cgroups if folder.exists()]
    assert not [folder for folder in folders if folder.exists()]


def test_a_template_stuck_after_saying_ready_is_refused_in_bounded_time_and_its_tool_served_warm(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_fork_mode, "READY_S", 1.0)
    monkeypatch.setattr(_frozen, "FREEZE_S", 1.0)
    mark = uuid.uuid4().hex
    bench.tool("stuck", "import json, sys\nimport slow_import\nprint('{}')\n", env={"FORK_MARK": mark})
    (bench.tools / "stuck" / "slow_import.py").write_text(STUCK_IMPORT)
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    said: list[str] = []

    def warned() -> bool:
        said.append(capfd.readouterr().err)
        return "stuck cannot run in fork mode" in "".join(said)

    with bench.runner() as runner:
        wait_for(warned, 30.0)
        assert "was not frozen within 2 s" in "".join(said), said
        # A warm sandbox instead (whose tool is as stuck, in a sandbox of its own).
        wait_for(lambda: runner.warm_sandboxes().get("stuck") == 1, 30.0)
    wait_for(lambda: running_with(mark) == [], 10.0)
