"""Hostile tools against fork mode, through the runner: each probe's import (run once,
in the tool's template) tries to carry one call's input to a later call, to reach the
template or the calls beside it, or to keep the template running; real calls, each with
a secret of its own, then show what got through (``tests/support/fork_probes.py``).

A template whose import left a thread is refused, and its tool's calls are served by
warm sandboxes instead, said so.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ToolBench, our_cgroups, wait_for
from support.fork_probes import needs_fork_mode, running_with, write_tool

from runner import Runner
from sandboxes.testing import processes_with_env
from sandboxes.view import LIBRARY_SOURCE

pytestmark = needs_fork_mode

Found = dict[str, Any]


def _probe(bench: ToolBench, mode: str) -> str:
    """The hostile tool of ``mode``, in fork mode: its marker (found in its processes)."""
    folder = write_tool(bench.tools, mode, LIBRARY_SOURCE / "runner_tool.py")
    mark = uuid.uuid4().hex
    manifest = {
        "name": folder.name, "description": f"hostile {mode}", "command": ["python3", "main.py"],
        "parameters": {"type": "object"}, "env": {"FORK_MARK": mark},
        "limits": {"timeout_ms": 10000, "memory_mb": 128, "max_pids": 32},
    }  # fmt: skip
    (folder / "tool.yaml").write_text(yaml.safe_dump(manifest))
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    return mark


def _ready(runner: Runner, tool: str) -> None:
    wait_for(lambda: runner.warm_sandboxes().get(tool) == 1, 30.0)


def _calls(
    runner: Runner, tool: str, n: int, concurrency: int = 1, hold: float = 0
) -> list[tuple[str, Found]]:
    """``n`` calls, each with its own secret: (secret, what it answered)."""

    def one(index: int) -> tuple[str, Found]:
        secret = f"secret-{index}-{secrets.token_hex(4)}"
        answer = runner.call(tool, {"secret": secret, "hold": hold})
        assert answer.success, answer.error
        return secret, answer.result

    with ThreadPoolExecutor(concurrency) as workers:
        return list(workers.map(one, range(n)))


def _assert_no_leak(results: list[tuple[str, Found]]) -> None:
    texts = [json.dumps(found) for _, found in results]
    leaks = [
        (i, j)
        for i, text in enumerate(texts)
        for j, (secret, _) in enumerate(results)
        if i != j and secret in text
    ]
    assert not leaks, f"{len(leaks)} leaks among {len(results)} calls (i got j's secret): {leaks}"


def _one_forked_call(bench: ToolBench, tool: str, params: dict[str, Any]) -> Found:
    """What one call of ``tool`` answered, once its template is ready; the call must have
    been forked (the audit's word: its template was not refused)."""
    with bench.runner() as runner:
        _ready(runner, tool)
        answer = runner.call(tool, params)
    assert answer.success, answer.error
    attempts = [
        json.loads(line) for line in bench.audit_log.read_text().splitlines() if '"call.attempt"' in line
    ]
    assert [attempt.get("forked") for attempt in attempts] == [True]
    found: Found = answer.result
    return found


def _forked(runner: Runner, tool: str, calls: int) -> None:
    """Every one of ``calls`` was forked from the template (none started cold or warm)."""
    assert runner._pools.takes()[tool] == (calls, 0)


@pytest.mark.parametrize("mode", ["audit", "patch", "atfork", "signal", "takeover"])
def test_hooks_and_loops_left_by_the_import_carry_nothing(bench: ToolBench, mode: str) -> None:
    _probe(bench, mode)
    with bench.runner() as runner:
        _ready(runner, f"hostile_{mode}")
        results = _calls(runner, f"hostile_{mode}", 6, concurrency=2)
        _forked(runner, f"hostile_{mode}", 6)
    _assert_no_leak(results)
    assert all(found["answer"] == secret and found["carried"] == [] for secret, found in results)


def test_the_template_runs_nothing_between_calls(bench: ToolBench) -> None:
    _probe(bench, "ticks")  # its import counts in a 10 ms timer's handler
    with bench.runner() as runner:
        _ready(runner, "hostile_ticks")
        seen = []
        for _ in range(3):
            ((_, found),) = _calls(runner, "hostile_ticks", 1)
            seen.append(found["ticks"])
            time.sleep(0.1)  # ten ticks, if anything of the template runs
        _forked(runner, "hostile_ticks", 3)
    assert len(set(seen)) == 1, f"the template's count moved between calls: {seen}"


def test_shared_memory_and_sockets_made_at_import_are_gone_in_every_call(bench: ToolBench) -> None:
    _probe(bench, "shared")
    with bench.runner() as runner:
        _ready(runner, "hostile_shared")
        results = _calls(runner, "hostile_shared", 4)
        _forked(runner, "hostile_shared", 4)
    _assert_no_leak(results)
    for _, found in results:
        assert (found["mmap"], found["sysv"], found["socket"]) == ("gone", "gone", "gone"), found


def test_files_and_abstract_sockets_carry_nothing_between_calls(bench: ToolBench) -> None:
    _probe(bench, "files")
    with bench.runner() as runner:
        _ready(runner, "hostile_files")
        results = _calls(runner, "hostile_files", 6, concurrency=2, hold=0.3)
        _forked(runner, "hostile_files", 6)
    _assert_no_leak(results)


def test_a_call_reaches_neither_the_template_nor_the_calls_beside_it(bench: ToolBench) -> None:
    _probe(bench, "procs")  # pidfds of every process the import saw
    with bench.runner() as runner:
        _ready(runner, "hostile_procs")
        results = _calls(runner, "hostile_procs", 4, concurrency=2, hold=0.5)
        _forked(runner, "hostile_procs", 4)
    for _, found in results:
        assert found["reached"] == 0, found
        assert not found["kill_all"], found
        assert found["visible"] == [1], found
        # Its cgroups are the root of its cgroup namespace, as a sandbox's are: nothing of
        # where they sit, nor of the names of other calls' (the runner's pid, a count).
        assert found["cgroups"] == ["/"], found
        assert found["unshare"] == errno.ENOSYS, found


def test_the_import_cannot_reach_the_sandboxs_init_the_parent_of_every_call(bench: ToolBench) -> None:
    _probe(bench, "init")
    found = _one_forked_call(bench, "hostile_init", {"secret": "s"})
    assert found["init"] == {"mem": "EACCES", "environ": "EACCES"}, found


# A python3 of the tool's own, first on its manifest's PATH: it tries bubblewrap's init,
# notes what it found, then starts the system's with the arguments it was given.
OWN_PYTHON = """#!/bin/sh
if (exec 3<>/proc/1/mem) 2>/dev/null; then seen=opened; else seen=refused; fi
PROBE_INIT="${PROBE_INIT:+$PROBE_INIT }$seen"  # each time it runs
export PROBE_INIT
exec /usr/bin/python3 "$@"
"""
ENV_PROBE = (
    "import json, os, sys\njson.load(sys.stdin)\nprint(json.dumps({'init': os.environ['PROBE_INIT']}))\n"
)


def test_a_python3_of_the_tools_own_on_its_path_runs_after_the_domain_too(bench: ToolBench) -> None:
    folder = bench.tool("own_python", ENV_PROBE, env={"PATH": "/tool/bin:/usr/bin:/bin"})
    (folder / "bin").mkdir()
    (folder / "bin" / "python3").write_text(OWN_PYTHON)
    (folder / "bin" / "python3").chmod(0o755)
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    assert _one_forked_call(bench, "own_python", {}) == {"init": "refused"}  # run once, after the domain


# A character-set module of the tool's, which the C library loads for a locale of the
# tool's (GCONV_PATH, LOCPATH, LC_ALL in its manifest) in whatever process first decodes
# text in it: it tries bubblewrap's init, and notes what it found for the call.
GCONV_MODULE = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void probe(void) {
    int fd = open("/proc/1/mem", O_RDWR);
    char seen[128];
    snprintf(seen, sizeof seen, "%s%s%s", getenv("PROBE_INIT") ? getenv("PROBE_INIT") : "",
             getenv("PROBE_INIT") ? " " : "", fd >= 0 ? "opened" : "refused");
    if (fd >= 0) close(fd);
    setenv("PROBE_INIT", seen, 1);
}
int gconv_init(void *step) { return 1; }
int gconv(void) { return 1; }
"""


def test_variables_of_the_tools_environment_load_nothing_of_its_own_before_the_domain(
    bench: ToolBench, tmp_path: Path
) -> None:
    if not (shutil.which("gcc") and shutil.which("localedef")):
        pytest.skip("needs gcc and localedef (scripts/setup.sh installs them)")
    folder = bench.tool(
        "charset", ENV_PROBE, env={"GCONV_PATH": "/tool/gconv", "LOCPATH": "/tool/locale", "LC_ALL": "xx"}
    )
    (folder / "gconv").mkdir()
    (tmp_path / "probe.c").write_text(GCONV_MODULE)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(folder / "gconv" / "probe.so"), str(tmp_path / "probe.c")],
        check=True,
    )
    (folder / "gconv" / "gconv-modules").write_text(
        "module ISO-8859-1// INTERNAL probe 1\nmodule INTERNAL ISO-8859-1// probe 1\n"
    )
    (folder / "locale").mkdir()
    subprocess.run(["localedef", "-i", "C", "-f", "ISO-8859-1", str(folder / "locale" / "xx")], check=True)
    for path in (folder, *folder.rglob("*")):
        path.chmod(0o755 if path.is_dir() or path.suffix == ".so" else 0o644)
    bench.policy["pool"] = {"size": 1, "mode": "fork"}
    # Loaded only in the template, in the domain: never by the step before it.
    assert _one_forked_call(bench, "charset", {}) == {"init": "refused"}


def test_a_template_whose_import_left_a_thread_is_refused_and_its_calls_are_served_warm(
    bench: ToolBench, capfd: pytest.CaptureFixture[str]
) -> None:
    mark = _probe(bench, "thread")
    said: list[str] = []
    with bench.runner() as runner:

        def told() -> bool:
            said.append(capfd.readouterr().err)
            return "cannot run in fork mode" in "".join(said)

        wait_for(told, 30.0)
        results = _calls(runner, "hostile_thread", 3)
        hits, misses = runner._pools.takes()["hostile_thread"]
    assert "the tool's imports left 2 threads" in "".join(said), said
    _assert_no_leak(results)
    assert hits + misses == 3  # warm or cold, none forked: the template is gone
    wait_for(lambda: processes_with_env(f"FORK_MARK={mark}") == [], 10.0)


DIES_MID_CALL = """
import asyncio, json, sys
from runner import Runner
runner = Runner.load(tools=sys.argv[1], policies=sys.argv[2], audit_log=sys.argv[3])
runner.warm_sandboxes()
import time
while runner.warm_sandboxes().get("hostile_audit") != 1:
    time.sleep(0.05)
async def main():
    call = asyncio.ensure_future(runner.acall("hostile_audit", {"secret": "s", "hold": 600}))
    await asyncio.sleep(1.0)
    print("calling", flush=True)
    await call
asyncio.run(main())
"""


def test_a_runner_killed_mid_call_leaves_no_template_call_or_cgroup(bench: ToolBench) -> None:
    mark = _probe(bench, "audit")
    (bench.root / "policies.yaml").write_text(yaml.safe_dump(bench.policy))
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            DIES_MID_CALL,
            str(bench.tools),
            str(bench.root / "policies.yaml"),
            os.devnull,
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == b"calling\n"
        wait_for(lambda: len(running_with(mark)) == 2, 10.0)  # the template and its call
        process.send_signal(signal.SIGKILL)  # as the OOM killer would: no cleanup of its own runs
        process.wait()
        wait_for(
            lambda: processes_with_env(f"FORK_MARK={mark}") == [] and our_cgroups(process.pid) == [], 5.0
        )
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
