"""The connection to the Ray cluster, made once per process, only to a locked cluster.

Before ``ray.init`` the cluster's GCS is asked twice, directly over gRPC: once without a
token (a cluster that answers lets anyone who reaches it run code: refused) and once with
this host's token (a cluster that refuses it is not ours to use). Only then does this
process join as a Ray client in token mode (``RAY_AUTH_MODE=token``); Ray itself would
otherwise retry a refused token for a long while before it gives up.

Ray allows one cluster per process: a second runner in the same process naming another
address is refused.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.config.dispatch import DEFAULT_TOKEN_FILE, DispatchModel, token_path
from runner.dispatch.node import NodeJob, node_task
from sandboxes import SandboxUnavailable

_lock = threading.Lock()
# address -> the remote function submitting node tasks, and the token last checked
_joined: dict[str, tuple[Any, str]] = {}


class ClusterRefused(SandboxUnavailable):
    """The cluster cannot be used: unreachable, open to anyone, or refusing our token."""


@dataclass(frozen=True)
class NodeSlots:
    """One alive node of the cluster and its slots (``runner doctor``)."""

    node_id: str
    address: str
    total: float
    free: float


def read_token(model: DispatchModel, base_dir: Path) -> str:
    """This host's token for the cluster: ``token_file``, else where Ray itself looks.

    Raises:
        ClusterRefused: there is none (the policy's load checks this first).
    """
    configured = token_path(model, base_dir)
    candidates: list[Path] = [configured] if configured is not None else []
    if configured is None:
        if from_env := os.environ.get("RAY_AUTH_TOKEN", "").strip():
            return from_env
        if named := os.environ.get("RAY_AUTH_TOKEN_PATH"):
            candidates.append(Path(named))
        candidates.append(DEFAULT_TOKEN_FILE.expanduser())
    for path in candidates:
        try:
            token = path.read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if token:
            return token
    raise ClusterRefused("there is no token for the Ray cluster on this host")


def authentication_problem(address: str, token: str | None, timeout_s: float) -> str | None:
    """Why the cluster at ``address`` may not be used with ``token``; None when it is locked
    (a client without a token is refused) and takes ``token``. ``token=None`` only asks
    whether a client without one is refused (None: it is)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    request = gcs_service_pb2.GetClusterIdRequest()
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(request, timeout=timeout_s)
        except grpc.RpcError as refused:
            code = refused.code()
            if code is not grpc.StatusCode.UNAUTHENTICATED:
                return f"the Ray cluster at {address} cannot be reached ({code.name.lower()})"
        else:
            return (
                f"the Ray cluster at {address} accepts clients without a token: start it with "
                "RAY_AUTH_MODE=token (refusing to dispatch to an open cluster)"
            )
        if token is None:
            return None
        try:
            stub.GetClusterId(request, timeout=timeout_s, metadata=(("authorization", f"Bearer {token}"),))
        except grpc.RpcError as refused:
            if refused.code() is grpc.StatusCode.UNAUTHENTICATED:
                return f"the Ray cluster at {address} refuses this host's token"
            return f"the Ray cluster at {address} cannot be reached ({refused.code().name.lower()})"
    return None


def join(model: DispatchModel, base_dir: Path) -> Any:
    """Join the cluster (once per process; blocking) and return the remote node task. A
    runner whose token differs from the one this process joined with has it checked too.

    Raises:
        ClusterRefused: Ray is not installed, there is no token, the cluster is
            unreachable, open or refuses the token, or this process joined another cluster.
    """
    try:
        import ray
    except ImportError as exc:
        raise ClusterRefused("Ray is not installed on this host (the extra `ray` of the runner)") from exc
    token = read_token(model, base_dir)
    with _lock:
        joined = _joined.get(model.address)
        if joined is not None and joined[1] == token:
            return joined[0]
        if _joined and joined is None:
            raise ClusterRefused(
                f"this process already dispatches to the Ray cluster at {next(iter(_joined))}"
            )
        problem = authentication_problem(model.address, token, model.connect_timeout_ms / 1000)
        if problem is not None:
            raise ClusterRefused(problem)
        if joined is not None:  # the same cluster, and it takes this token too
            _joined[model.address] = (joined[0], token)
            return joined[0]
        _enter_token_mode(model, base_dir)
        try:
            ray.init(
                address=model.address,
                namespace="runner",
                log_to_driver=False,  # the nodes' logs are theirs; the runner has its own
                logging_level=logging.WARNING,
                configure_logging=False,  # the host application's logging stays its own
            )
        except (ConnectionError, RuntimeError) as exc:
            raise ClusterRefused(f"cannot join the Ray cluster at {model.address}: {exc}") from exc
        remote = ray.remote(node_task)
        _joined[model.address] = (remote, token)
        return remote


def _enter_token_mode(model: DispatchModel, base_dir: Path) -> None:
    """Make this process a Ray client in token mode, with the configured token file."""
    os.environ["RAY_AUTH_MODE"] = "token"
    configured = token_path(model, base_dir)
    if configured is not None:
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(configured)
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # not in its stub

    Config.initialize("")  # Ray reads its settings once: again, with token mode on
    AuthenticationTokenLoader.instance().reset_cache()


def submit(remote: Any, job: NodeJob, slots_resource: str) -> Any:
    """Start ``job`` as a Ray task needing one slot; its ObjectRef. Never retried by Ray:
    the caller's executor decides on retries (and writes their audit events)."""
    return remote.options(
        num_cpus=0,
        resources={slots_resource: 1},
        max_retries=0,
        retry_exceptions=False,
        name=f"runner:{job.spec.tool_name}",
    ).remote(job)


def node_slots(slots_resource: str) -> list[NodeSlots]:
    """The cluster's alive nodes offering ``slots_resource``, with total and free slots
    (this process must have joined)."""
    import ray
    from ray._private import state

    free = state.available_resources_per_node()
    found = []
    for node in ray.nodes():
        total = float(node["Resources"].get(slots_resource, 0))
        if node["Alive"] and total > 0:
            node_id = node["NodeID"]
            available = float(free.get(node_id, {}).get(slots_resource, 0))
            found.append(NodeSlots(node_id, node["NodeManagerAddress"], total, available))
    return found
