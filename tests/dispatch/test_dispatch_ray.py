"""Dispatch on a real Ray cluster, inside a network namespace with only loopback.

A head (the control node, no sandbox slots; the runner's client attaches there) and two
worker nodes with two ``runner_sandbox`` slots each, token authentication on, started once
for the module by tests/support/ray_agent.py. The runner client runs in that namespace too; the
tests see the cluster's processes (same PID namespace) and kill a node's raylet from here.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_nothing_survives, wait_for, write_tool
from support.ray_cluster import RayCluster

from sandboxes.testing import processes_with_env

pytestmark = [pytest.mark.ray, pytest.mark.slow]

try:
    import ray  # noqa: F401

    RAY_PROBLEM = None
except ImportError:
    RAY_PROBLEM = "Ray is not installed (the extra `ray`)"

SLEEPER = """
import json, os, sys, time
request = json.load(sys.stdin)
params = request["params"]
if request["context"]["attempt"] <= params.get("sleep_attempts", 1):
    time.sleep(params.get("sleep", 0))
print(json.dumps({"cwd": os.getcwd(), "uid": os.getuid(), "attempt": request["context"]["attempt"]}))
"""


def _cluster(tmp_path_factory: pytest.TempPathFactory, mode: str) -> Iterator[RayCluster]:
    if RAY_PROBLEM is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Ray is required in CI: {RAY_PROBLEM}")
        pytest.skip(RAY_PROBLEM)
    cluster = RayCluster(tmp_path_factory.mktemp(f"ray-{mode}"), mode)
    try:
        yield cluster
    finally:
        cluster.close()
        assert cluster.pids() == [], "processes of the test cluster survived"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    yield from _cluster(tmp_path_factory, "locked")


@pytest.fixture(scope="module")
def dispatching(cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A runner in the cluster's namespace over a sleeper tool, every tool dispatched."""
    root = tmp_path_factory.mktemp("dispatch-tools")
    write_tool(root / "tools", "sleeper", SLEEPER)
    cluster.policy(root / "policies.yaml")
    cluster.ask(
        "load", tools=str(root / "tools"), policy=str(root / "policies.yaml"), audit=str(root / "audit.log")
    )
    return root


def attempts(root: Path, request_id: str) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in (root / "audit.log").read_text().splitlines()]
    return [e for e in events if e["event"] == "call.attempt" and e["requestId"] == request_id]


def call(cluster: RayCluster, request_id: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
    options = params.pop("options", {"timeout": 20000, "deadline": 30000, "retries": 0})
    request = {"toolName": "sleeper", "params": params, "requestId": request_id, "options": options}
    cluster.ask("call", id=request_id, request=request)
    return cluster.ask("result", id=request_id, timeout=timeout)["answer"]  # type: ignore[no-any-return]


def start(cluster: RayCluster, request_id: str, **params: Any) -> None:
    options = params.pop("options", {"timeout": 20000, "deadline": 30000, "retries": 0})
    request = {"toolName": "sleeper", "params": params, "requestId": request_id, "options": options}
    cluster.ask("call", id=request_id, request=request)


def running(request_id: str) -> list[int]:
    return processes_with_env(f"REQUEST_ID={request_id}")


def test_calls_land_on_both_nodes_in_real_sandboxes(cluster: RayCluster, dispatching: Path) -> None:
    ids = [f"req_spread_{i}" for i in range(8)]
    for request_id in ids:  # 8 calls at once on 4 slots: the scheduler fills both nodes
        start(cluster, request_id, sleep=0.5)
    answers = [cluster.ask("result", id=request_id)["answer"] for request_id in ids]
    assert all(answer["success"] for answer in answers), answers
    # The subprocess sandbox of the node: the tool folder at /tool, an unprivileged uid.
    assert {answer["result"]["cwd"] for answer in answers} == {"/tool"}
    assert all(answer["result"]["uid"] != 0 for answer in answers)
    nodes = {event["node"] for request_id in ids for event in attempts(dispatching, request_id)}
    assert nodes == set(cluster.raylets()) - {head_node(cluster)}


def head_node(cluster: RayCluster) -> str:
    slots = {node["node_id"] for node in cluster.ask("slots")["nodes"]}
    (head,) = set(cluster.raylets()) - slots
    return head


def test_doctor_reports_the_cluster_its_nodes_and_free_slots(cluster: RayCluster, dispatching: Path) -> None:
    layers = cluster.ask("doctor", policy=str(dispatching / "policies.yaml"))["layers"]
    assert layers[0]["name"] == "ray cluster" and layers[0]["ok"], layers
    assert "2 node(s)" in layers[0]["detail"] and "4 of 4 slots free" in layers[0]["detail"]
    assert len(layers) == 3


def test_cancelling_a_call_leaves_nothing_on_the_node(cluster: RayCluster, dispatching: Path) -> None:
    start(cluster, "req_cancel", sleep=60)
    wait_for(lambda: bool(running("req_cancel")), timeout_s=20)
    assert cluster.node_of(running("req_cancel")[0]) in cluster.raylets()
    cluster.ask("cancel", id="req_cancel")
    assert cluster.ask("result", id="req_cancel")["raised"] == "CancelledError"
    assert_nothing_survives("req_cancel", grace_s=5)
    wait_for(lambda: bool(attempts(dispatching, "req_cancel")), timeout_s=10)
    assert attempts(dispatching, "req_cancel")[0]["cancelled"] is True
    wait_for(lambda: sum(n["free"] for n in cluster.ask("slots")["nodes"]) == 4, timeout_s=10)


def test_a_call_waiting_for_a_slot_past_its_timeout_times_out_and_leaves_nothing_queued(
    cluster: RayCluster, dispatching: Path
) -> None:
    blockers = [f"req_block_{i}" for i in range(4)]
    for request_id in blockers:
        start(cluster, request_id, sleep=6)
    wait_for(lambda: all(running(r) for r in blockers), timeout_s=30)
    began = time.monotonic()
    answer = call(cluster, "req_queued", options={"timeout": 1000, "deadline": 5000, "retries": 0})
    assert answer["error"]["code"] == "TIMEOUT", answer
    assert time.monotonic() - began < 5
    for request_id in blockers:
        assert cluster.ask("result", id=request_id)["answer"]["success"]
    time.sleep(1)  # a task left queued would start now that the slots are free
    assert running("req_queued") == []
    wait_for(lambda: sum(n["free"] for n in cluster.ask("slots")["nodes"]) == 4, timeout_s=10)


def test_a_client_without_the_token_is_refused(cluster: RayCluster, tmp_path: Path) -> None:
    # A plain Ray client, no token: the cluster does not let it join.
    plain = cluster.ask("ray_init_without_token", timeout=120)
    assert plain["returncode"] == 3, plain
    # The GCS itself, asked without a token and with a wrong one.
    assert cluster.ask("probe", token=None)["problem"] is None  # None: refused without a token
    assert "refuses this host's token" in cluster.ask("probe", token="0" * 64)["problem"]
    # A runner holding a wrong token: the call fails closed, nothing runs.
    write_tool(tmp_path / "tools", "sleeper", SLEEPER)
    (tmp_path / "wrong").write_text("f" * 64)
    cluster.policy(tmp_path / "policies.yaml", token_file=str(tmp_path / "wrong"))
    cluster.ask(
        "load",
        tools=str(tmp_path / "tools"),
        policy=str(tmp_path / "policies.yaml"),
        audit=str(tmp_path / "a.log"),
    )
    answer = call(cluster, "req_wrong_token")
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"
    assert "refuses this host's token" in answer["error"]["message"]


def test_a_node_lost_in_the_middle_of_a_call_is_retried_on_the_other_node(
    cluster: RayCluster, tmp_path: Path
) -> None:
    write_tool(tmp_path / "tools", "sleeper", SLEEPER)
    cluster.policy(tmp_path / "policies.yaml")
    cluster.ask(
        "load",
        tools=str(tmp_path / "tools"),
        policy=str(tmp_path / "policies.yaml"),
        audit=str(tmp_path / "audit.log"),
    )
    options = {"timeout": 20000, "deadline": 60000, "retries": 2, "retryDelay": 100}
    start(cluster, "req_node_lost", sleep=60, options=options)
    wait_for(lambda: bool(running("req_node_lost")), timeout_s=20)
    lost = cluster.node_of(running("req_node_lost")[0])
    assert lost is not None
    os.kill(cluster.raylets()[lost], 9)
    try:
        answer = cluster.ask("result", id="req_node_lost", timeout=90)["answer"]
        assert answer["success"], answer
        assert answer["metadata"]["attempts"] == 2
        first, second = attempts(tmp_path, "req_node_lost")
        assert first["reason"] == "node_lost" and first["code"] == "EXECUTION_ERROR"
        assert second["reason"] is None and second["node"] != lost
        assert_nothing_survives("req_node_lost", grace_s=15)  # the lost node's sandbox too
    finally:
        cluster.ask("add_node", timeout=120)  # the next test (if any) has two nodes again


@pytest.fixture(scope="module")
def open_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    yield from _cluster(tmp_path_factory, "open")


def test_a_cluster_without_authentication_is_refused(open_cluster: RayCluster, tmp_path: Path) -> None:
    write_tool(tmp_path / "tools", "sleeper", SLEEPER)
    open_cluster.policy(tmp_path / "policies.yaml")
    open_cluster.ask(
        "load",
        tools=str(tmp_path / "tools"),
        policy=str(tmp_path / "policies.yaml"),
        audit=str(tmp_path / "a.log"),
    )
    answer = call(open_cluster, "req_open")
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable", answer
    assert "accepts clients without a token" in answer["error"]["message"]
    assert running("req_open") == []
