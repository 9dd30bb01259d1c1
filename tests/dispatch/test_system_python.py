"""The runner on the Python the system ships (Debian 12: 3.11.2), the oldest it supports.

``requires-python = ">=3.11"``: a feature of a later 3.11 patch release (tarfile's
extraction filters came in 3.11.4) breaks it there. These tests run the bundle round
trip, the hostile bundles and a dispatched call on a Ray cluster under ``/usr/bin/python3``:
on it directly when the suite runs there (scripts/test-system-python.sh, which installs
the wheel and its extras for it), else in a virtual environment made from it that sees
this interpreter's packages (this runner imported through ``PYTHONPATH``, as conftest
sets it).
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import write_tool
from support.bundle_cases import HOSTILE, refusal
from support.ray_cluster import RayCluster

SYSTEM_PYTHON = Path("/usr/bin/python3")
TESTS = Path(__file__).resolve().parents[1]  # where `support` is

pytestmark = [pytest.mark.slow]


def _describe(python: str) -> dict[str, Any]:
    code = "import json, sys; print(json.dumps({'prefix': sys.base_prefix, 'version': sys.version}))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    described: dict[str, Any] = json.loads(done.stdout)
    return described


@pytest.fixture(scope="session")
def system_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Python of the system's interpreter that imports this runner and its requirements."""
    if not SYSTEM_PYTHON.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{SYSTEM_PYTHON} is required in CI: the oldest Python the runner supports")
        pytest.skip(f"{SYSTEM_PYTHON} is absent: the system's Python cannot be tested here")
    system = _describe(str(SYSTEM_PYTHON))
    if (sys.base_prefix, sys.version) == (system["prefix"], system["version"]):
        return sys.executable  # the suite itself runs on it
    # Else a virtual environment of it that sees this interpreter's packages (the same
    # 3.11 ABI) through a .pth file: the system's standard library with this runner's
    # requirements, without installing them again (the system-python CI run installs them).
    venv = tmp_path_factory.mktemp("system-python") / "venv"
    subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    purelib = run_on(python, "import json, sysconfig; print(json.dumps(sysconfig.get_path('purelib')))")
    packages = [path for path in site.getsitepackages() if Path(path).is_dir()]
    (Path(purelib) / "this-pythons-packages.pth").write_text("".join(f"{path}\n" for path in packages))
    return python


def run_on(python: str, code: str, *args: str) -> Any:
    done = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, timeout=300, cwd=TESTS)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


ROUND_TRIP = """
import json, os, sys
from pathlib import Path
from runner.dispatch.bundle import pack, tree_hash, unpack
folder, cache = Path(sys.argv[1]), Path(sys.argv[2])
bundle = pack(folder, 1 << 20)
unpacked = unpack(bundle, cache)
print(json.dumps({
    "version": list(sys.version_info[:3]),
    "hashes": [bundle.sha256, tree_hash(unpacked), tree_hash(folder)],
    "link": os.readlink(unpacked / "bin" / "tool"),
    "executable": os.access(unpacked / "lib" / "run.sh", os.X_OK),
}))
"""


def test_a_bundle_packs_and_unpacks_on_the_system_python(system_python: str, tmp_path: Path) -> None:
    folder = write_tool(tmp_path / "tools", "t", "print('{}')\n")
    (folder / "lib").mkdir()
    (folder / "lib" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (folder / "lib" / "run.sh").chmod(0o755)
    (folder / "bin").mkdir()
    (folder / "bin" / "tool").symlink_to("../lib/run.sh")
    found = run_on(system_python, ROUND_TRIP, str(folder), str(tmp_path / "cache"))
    assert found["version"] == list(map(int, _describe(str(SYSTEM_PYTHON))["version"].split()[0].split(".")))
    assert len(set(found["hashes"])) == 1, found
    assert found["link"] == "../lib/run.sh" and found["executable"]


HOSTILE_RUN = """
import json, sys
from pathlib import Path
from support.bundle_cases import HOSTILE, refusal
root = Path(sys.argv[1])
print(json.dumps({case: refusal(case, root / case / "cache") for case in sorted(HOSTILE)}))
"""


def test_hostile_bundles_are_refused_on_the_system_python_exactly_as_here(
    system_python: str, tmp_path: Path
) -> None:
    there = run_on(system_python, HOSTILE_RUN, str(tmp_path / "there"))
    here = {case: refusal(case, tmp_path / "here" / case / "cache") for case in sorted(HOSTILE)}
    assert there == here
    assert all(answer is not None and answer.startswith("UnsafeBundle: ") for answer in here.values()), here
    for side in ("here", "there"):
        left = sorted(str(p.relative_to(tmp_path / side)) for p in (tmp_path / side).rglob("*"))
        assert left == sorted([*HOSTILE, *(f"{case}/cache" for case in HOSTILE)])


SLEEPER = """
import json, os, sys
request = json.load(sys.stdin)
print(json.dumps({"cwd": os.getcwd(), "sum": request["params"]["a"] + request["params"]["b"]}))
"""


@pytest.fixture(scope="module")
def cluster(system_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """A Ray cluster (a head and one node) and the runner client, all on the system's Python;
    the runner's standard error kept in ``stderr.log`` beside it."""
    workdir = tmp_path_factory.mktemp("ray-system")
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("Ray is required in CI (the extra `ray`)")
        pytest.skip("Ray is not installed (the extra `ray`)")
    cluster = RayCluster(workdir, "locked-1", python=system_python, stderr=workdir / "stderr.log")
    try:
        yield cluster
    finally:
        cluster.close()
        assert cluster.pids() == [], "processes of the test cluster survived"


def load(cluster: RayCluster, root: Path) -> None:
    write_tool(root / "tools", "dadd", SLEEPER)
    document = cluster.policy(root / "policies.yaml")
    document["audit"] = {"operator_log": "operator.log"}
    (root / "policies.yaml").write_text(yaml.safe_dump(document))
    cluster.ask(
        "load", tools=str(root / "tools"), policy=str(root / "policies.yaml"), audit=str(root / "a.log")
    )


def call(cluster: RayCluster, request_id: str) -> dict[str, Any]:
    request = {"toolName": "dadd", "params": {"a": 2, "b": 3}, "requestId": request_id}
    cluster.ask("call", id=request_id, request=request)
    answer: dict[str, Any] = cluster.ask("result", id=request_id, timeout=90)["answer"]
    return answer


@pytest.mark.ray
def test_a_dispatched_call_runs_on_a_cluster_of_the_system_python(
    cluster: RayCluster, system_python: str, tmp_path: Path
) -> None:
    assert cluster.ask("python")["version"] == run_on(
        system_python, "import json, sys; print(json.dumps(list(sys.version_info[:3])))"
    )
    load(cluster, tmp_path)
    answer = call(cluster, "req_system_python")
    assert answer["success"], answer
    assert answer["result"] == {"cwd": "/tool", "sum": 5}


@pytest.mark.ray
def test_a_node_task_that_fails_answers_internal_and_its_trace_goes_to_the_operator_log_only(
    cluster: RayCluster, tmp_path: Path
) -> None:
    load(cluster, tmp_path)
    stderr = cluster.workdir / "stderr.log"
    before = stderr.stat().st_size
    cluster.ask("break_node_jobs", broken=True)
    try:
        answer = call(cluster, "req_node_fault")
    finally:
        cluster.ask("break_node_jobs", broken=False)
    assert answer["error"]["code"] == "EXECUTION_ERROR", answer
    assert answer["error"]["details"] == {"reason": "internal"}
    assert answer["error"]["message"] == "internal error in the runner: DispatchFault"
    log = (tmp_path / "operator.log").read_text()
    assert "req_node_fault" in log and "Traceback (most recent call last)" in log
    assert "ValueError: embedded null byte" in log  # the node's own traceback
    assert "\x1b[" not in log
    with stderr.open("rb") as err:
        err.seek(before)
        written = err.read().decode(errors="replace")
    assert "Traceback" not in written and "failed" not in written, written
    assert call(cluster, "req_after_fault")["success"]
