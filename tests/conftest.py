"""Fixtures: tool folders made on the fly, runners over them, and a /proc scan.

Hostile tools are real programs run through the real sandbox; ``make_tool`` writes one
folder per tool (``tool.yaml`` + ``main.py``) so each test states its attack in full.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from docker import APIClient

from runner import Runner
from runner.config.starter import write_starter
from sandboxes.testing import processes_with_env

# The suite runs against the installed package, from a copy of tests/ outside the
# repository (scripts/test.sh): nothing here may read the repository's own files.
# Child processes (`python -m runner`, the `runner` command) import the package the tests
# import, also when that is a source checkout rather than the installed wheel.
_IMPORTED_FROM = str(Path(sys.modules[Runner.__module__].__file__ or "").resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_IMPORTED_FROM, os.environ.get("PYTHONPATH")) if p)
DEFAULT_PARAMS: dict[str, Any] = {"type": "object", "additionalProperties": True}

BASE_POLICY: dict[str, Any] = {
    "version": 1,
    "default_role": "user",
    "whitelist": ["*"],
    "roles": {"user": {"allow": ["*"]}},
    "defaults": {"timeout_ms": 5000, "retries": 0, "retry_delay_ms": 10, "deadline_ms": 10000},
    "limits": {"timeout_ms": 30000, "memory_mb": 512, "cpu_seconds": 10, "max_pids": 64},
    "circuit_breaker": {"failure_threshold": 1000, "reset_timeout_ms": 1000},
}


# Hostile tools of both backends' limit tests: children that break the whole tool's CPU
# budget or memory limit while their parent waits (each child alone stays under its own).
SPINNING_CHILDREN = """
import os, sys
sys.stdin.read()
for _ in range(8):
    if os.fork() == 0:
        while True:
            pass
for _ in range(8):
    os.wait()
"""

HOARDING_CHILDREN = """
import os, sys, time
sys.stdin.read()
for _ in range(3):
    if os.fork() == 0:
        hoard = []
        while True:
            hoard.append(bytearray(8 * 1024 * 1024))
    time.sleep(0.2)
time.sleep(60)  # the parent itself stays well under the limit and never exits
"""


# A pooled tool for the single-use tests of both backends: everything a previous
# call could have left (a marker and a file of its own in /tmp, a child that stays alive),
# and what this call sees, as its answer (its hostname is its container's id in docker).
TRACING_TOOL = """
import json, os, socket, sys, time
request = json.load(sys.stdin)
n = request["params"].get("n", 0)
tmp_before = sorted(os.listdir("/tmp"))
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
secret = os.urandom(8).hex()
with open(f"/tmp/secret-{n}", "w") as f:
    f.write(secret)
with open(f"/tmp/secret-{n}") as f:
    read_back = f.read()
open(f"/tmp/marker-{n}", "w").close()
if os.fork() == 0:
    os.setsid()
    time.sleep(60)
    os._exit(0)
time.sleep(request["params"].get("sleep", 0))
print(json.dumps({
    "tmp_before": tmp_before,
    "pids": pids,
    "me": os.getpid(),
    "parent": os.getppid(),
    "host": socket.gethostname(),
    "own_file_ok": read_back == secret,
    "pidns": os.readlink("/proc/self/ns/pid"),
    "cgroupns": os.readlink("/proc/self/ns/cgroup"),
    "env": sorted(os.environ),
    "context": request["context"],
}))
"""


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def write_tool(root: Path, name: str, code: str, **manifest: Any) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "main.py").write_text(textwrap.dedent(code))
    document = {
        "name": name,
        "description": manifest.pop("description", f"test tool {name}"),
        "command": manifest.pop("command", ["python3", "main.py"]),
        "parameters": manifest.pop("parameters", DEFAULT_PARAMS),
        **manifest,
    }
    (folder / "tool.yaml").write_text(yaml.safe_dump(document))
    return folder


# RUNNER_TEST_POOL_MODE=fork: every runner a ToolBench builds keeps each tool it may pool in
# fork mode, and waits until the pools are ready (``scripts/test-fork-mode.sh`` runs the
# isolation, limit, kill-guarantee and hostile tests so).
FORK_SUITE = os.environ.get("RUNNER_TEST_POOL_MODE") == "fork"
FORK_READY_S = 10.0


class ToolBench:
    """A tool directory and policy of one test, and runners built over them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tools = root / "tools"
        self.tools.mkdir()
        self.policy: dict[str, Any] = yaml.safe_load(yaml.safe_dump(BASE_POLICY))
        if FORK_SUITE:
            self.policy["pool"] = {"size": 1, "mode": "fork"}

        self.audit_log = root / "audit.log"
        self.runners: list[Runner] = []  # closed at the test's end, should the test not

    def tool(self, name: str, code: str, **manifest: Any) -> Path:
        return write_tool(self.tools, name, code, **manifest)

    def write_policy(self) -> Path:
        policy_path = self.root / "policies.yaml"
        policy_path.write_text(yaml.safe_dump(self.policy))
        return policy_path

    def runner(self, **kwargs: Any) -> Runner:
        runner = Runner.load(
            tools=self.tools, policies=self.write_policy(), audit_log=self.audit_log, **kwargs
        )
        self.runners.append(runner)
        if FORK_SUITE and self.policy.get("pool", {}).get("mode") == "fork":
            # Each pool ready (a template, or warm sandboxes where fork mode is refused),
            # or as many as are after a bound: a tool whose sandbox cannot start has none.
            deadline = time.monotonic() + FORK_READY_S
            while min(runner.warm_sandboxes().values(), default=1) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        return runner

    def spawn_runner(self, tool: str, request_id: str) -> subprocess.Popen[bytes]:
        """A runner in a process of its own, calling ``tool`` with a 30 s timeout, to be killed."""
        return subprocess.Popen(self.runner_argv(tool, request_id), cwd=self.root)

    def runner_argv(self, tool: str, request_id: str) -> list[str]:
        """The command line of ``spawn_runner``'s process."""
        self.write_policy()
        script = (
            "import sys\nfrom runner import Runner\n"
            "runner = Runner.load(tools=sys.argv[1], policies=sys.argv[2], audit_log=sys.argv[3])\n"
            "runner.handle({'toolName': sys.argv[4], 'requestId': sys.argv[5],"
            " 'options': {'timeout': 30000, 'retries': 0}})\n"
        )
        argv = [sys.executable, "-c", script, str(self.tools), str(self.root / "policies.yaml")]
        return [*argv, str(self.audit_log), tool, request_id]


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[ToolBench]:
    made = ToolBench(tmp_path)
    yield made
    # A runner a test left open (``bench.runner().handle(...)``) would keep its pools, in
    # the fork-mode suite its template, until the test process ends.
    faults: list[BaseException] = []
    closer = threading.Thread(target=_close_all, args=(made.runners, faults), daemon=True)
    closer.start()
    closer.join(CLOSE_BOUND_S)
    if closer.is_alive():  # a hung close would hang the whole suite
        faults.append(TimeoutError(f"the runners the test left open did not close within {CLOSE_BOUND_S} s"))
    if faults:
        raise faults[0]


CLOSE_BOUND_S = 120


def _close_all(runners: list[Runner], faults: list[BaseException]) -> None:
    for runner in list(runners):  # a second close does nothing; one that raises stops no other
        try:
            runner.close()
        except BaseException as exc:  # told by the fixture, not lost in this thread
            faults.append(exc)


@functools.cache
def starter_dir() -> Path:
    """A folder made by ``runner init`` (the shipped policy and example tools), one per session."""
    root = Path(tempfile.mkdtemp(prefix="runner-starter-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    write_starter(root)
    return root


def installed_command() -> str:
    """The ``runner`` console script of the Python running the tests (a venv's own first)."""
    beside = Path(sys.executable).parent / "runner"
    found = str(beside) if beside.is_file() else shutil.which("runner")
    assert found, "the runner command is not installed"
    return found


@pytest.fixture
def shipped(tmp_path: Path) -> Iterator[Runner]:
    """A runner over the shipped tools and policy (``runner init`` into a folder of its own)."""
    write_starter(tmp_path)
    runner = Runner.load(tools=tmp_path / "tools", policies=tmp_path / "policies.yaml", audit_log=os.devnull)
    yield runner


def call_cgroups() -> bool:
    """Whether the subprocess backend makes a cgroup per call here (not rootless on v1)."""
    from sandboxes.subprocess._cgroup import CgroupFactory, CgroupUnavailable

    try:
        CgroupFactory()
    except (CgroupUnavailable, OSError):
        return False
    return True


def our_cgroups(pid: int) -> list[Path]:
    """The subprocess backend's cgroups made by the runner of process ``pid`` (none where
    it makes none: ``call_cgroups``)."""
    from sandboxes.subprocess._cgroup import CgroupFactory

    if not call_cgroups():
        return []
    return [
        child
        for parent in CgroupFactory().parents
        if parent.is_dir()
        for child in parent.iterdir()
        if child.name.startswith(f"{pid}-")
    ]


def watchdogs_of(pid: int) -> list[int]:
    """The live watchdog processes of the runner ``pid`` (a dead one, a zombie, has no
    command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"from sandboxes._reaper import main" in b" ".join(argv) and argv[-2:-1] == [
                str(pid).encode()
            ]:
                found.append(int(entry.name))
    return found


def runner_argv(bench: ToolBench, *args: str) -> list[str]:
    """``python -m runner`` over the bench's tools and policy file, then ``args``."""
    return [sys.executable, "-m", "runner", "--tools", str(bench.tools), "--policies",
            str(bench.root / "policies.yaml"), *args]  # fmt: skip


def assert_nothing_survives(request_id: str, grace_s: float = 2.0) -> None:
    """No process started for ``request_id`` is alive (after a short grace for reaping)."""
    marker = f"REQUEST_ID={request_id}"
    deadline = time.monotonic() + grace_s
    while (alive := processes_with_env(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive == [], f"processes of {request_id} survived: {alive}"


@pytest.fixture
def no_survivors() -> Callable[[str], None]:
    return assert_nothing_survives


def answer_of(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The answer shell a `runner exec` printed (exit 0 or 1)."""
    assert done.returncode in (0, 1), done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def docker_ready() -> str | None:
    """None when a daemon and the base image are there, else why not."""
    try:
        from sandboxes.docker._client import api_client, image_exists

        if not image_exists(api_client(), "runner/base:latest"):
            return "runner/base:latest is missing (runner images build)"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="session")
def docker_client() -> Iterator[APIClient]:
    """The Docker API client; in CI a missing daemon or image fails instead of skipping."""
    problem = docker_ready()
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Docker is required in CI: {problem}")
        pytest.skip(f"no Docker here: {problem}")
    from sandboxes.docker._client import api_client

    client = api_client()
    yield client
    from sandboxes.docker._client import LABEL_MANAGED

    # Another runner alive on this machine (a second test session) may own containers
    # right now; ours are those of this process or of a process that is gone.
    def leftovers() -> list[dict[str, Any]]:
        return [
            container
            for container in client.containers(all=True, filters={"label": f"{LABEL_MANAGED}=true"})
            if not _alive_elsewhere(container["Labels"].get("io.runner.owner-pid", ""))
        ]

    # A dead container is removed just after its call (``sandboxes._deferred``), also by a
    # runner a test never closed: the last test's may still be on its way.
    with contextlib.suppress(AssertionError):
        wait_for(lambda: leftovers() == [], 10.0)
    assert leftovers() == [], f"containers of ours survived the tests: {leftovers()}"


def _alive_elsewhere(owner: str) -> bool:
    """True when ``owner`` is the pid of a live process other than this test session."""
    if not owner.isdigit() or int(owner) == os.getpid():
        return False
    import psutil

    return psutil.pid_exists(int(owner))


# -- third-party MCP servers installed by `runner mcp add`, one of each per session

TIME = "mcp-server-time"
FILES = "@modelcontextprotocol/server-filesystem"
REGISTRIES = (("pypi.org", 443), ("registry.npmjs.org", 443))


def runner_command(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNNER_") and k != "XDG_CONFIG_HOME"}
    return subprocess.run(
        [installed_command(), *args],
        cwd=cwd,
        env={**clean, "HOME": str(cwd.parent / "home")},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _registries_reachable() -> str | None:
    for host, port in REGISTRIES:
        try:
            socket.create_connection((host, port), timeout=10).close()
        except OSError as exc:
            return f"{host}:{port}: {exc}"
    return None


@pytest.fixture(scope="session")
def registries() -> None:
    """PyPI and npm reachable; in CI an unreachable one fails instead of skipping."""
    problem = _registries_reachable()
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the package registries are required in CI: {problem}")
        pytest.skip(f"the package registries are out of reach: {problem}")


def new_project(folder: Path) -> Path:
    folder.mkdir()
    (folder.parent / "home").mkdir(exist_ok=True)
    assert runner_command("init", cwd=folder).returncode == 0
    return folder


@pytest.fixture(scope="session")
def installed(registries: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One project with both example servers added (one install of each package): time by
    --pip, files by --npm over a stale folder of that name, with --force."""
    project = new_project(tmp_path_factory.mktemp("mcp") / "project")
    time_added = runner_command(
        "mcp", "add", "time", "--pip", TIME, "--json", "--", "--local-timezone=UTC", cwd=project
    )
    stale = project / "tools" / "files"
    stale.mkdir()
    (stale / "stale.txt").write_text("from before")
    files_added = runner_command(
        "mcp", "add", "files", "--npm", FILES, "--force", "--json", "--", "/tmp", cwd=project
    )
    yield {"project": project, "time": time_added, "files": files_added}


def checkout() -> Path | None:
    """The repository the suite was copied from (scripts/test.sh names it in RUNNER_CHECKOUT;
    a suite run inside the checkout finds it beside tests/), for what the wheel does not
    ship: the README, docs/, deploy/. None when neither says."""
    named = os.environ.get("RUNNER_CHECKOUT")
    found = Path(named) if named else Path(__file__).resolve().parent.parent
    return found if (found / "README.md").is_file() and (found / "docs").is_dir() else None
