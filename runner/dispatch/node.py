"""What a Ray task runs on its node: one attempt, through the node's own backend.

No Ray here either: the task (``cluster.submit``) calls ``run_job`` and adds its node's id.
The node unpacks the shipped tool folder (``bundle.unpack``: checked against the caller's
content hash), builds the backend the plan names from the policy's settings shipped with
the job, and runs the attempt as the caller's executor would (``run_attempt``: prepared,
run, closed on every path). A ``ray.cancel`` arrives as a KeyboardInterrupt, which
``asyncio.run`` turns into the cancellation of the attempt: its sandbox is killed and
closed before the task ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from runner.dispatch.bundle import ToolBundle, unpack
from sandboxes import (
    BackendConfigError,
    Closable,
    LaunchSpec,
    Limits,
    SandboxOutcome,
    SandboxUnavailable,
    StopReason,
    plugins,
)


@dataclass(frozen=True)
class NodeJob:
    """Everything one dispatched attempt needs on its node (pickled into the Ray task)."""

    spec: LaunchSpec  # its tool_dir is the caller's; the node's unpacked copy replaces it
    limits: Limits
    payload: bytes
    backend: str
    backend_config: Mapping[str, Any]
    bundle: ToolBundle
    cache_root: str
    # The caller's wall clock when it submitted the task: the wait for a slot is taken
    # from the attempt's timeout (clocks of a cluster agree to well under the caller's grace).
    submitted_at: float = field(default_factory=time.time)


def run_job(job: NodeJob) -> SandboxOutcome:
    """Run ``job``'s attempt here and return its outcome; never raises for the attempt's
    own failures (they are outcomes: ``sandbox_unavailable``, ``timeout``, ...).

    Raises:
        KeyboardInterrupt: the task was cancelled (``ray.cancel``); the sandbox is gone.
    """
    waited_ms = max(0.0, (time.time() - job.submitted_at) * 1000)
    left_ms = int(job.limits.timeout_ms - waited_ms)
    if left_ms < 1:
        return SandboxOutcome.never_ran(
            StopReason.TIMEOUT, "the attempt waited for a free slot until its timeout"
        )
    try:
        tool_dir = unpack(job.bundle, Path(job.cache_root))
        backend = plugins.create(job.backend, job.backend_config)
    except SandboxUnavailable as exc:
        return SandboxOutcome.never_ran(StopReason.SANDBOX_UNAVAILABLE, exc.message)
    except (plugins.UnknownBackend, BackendConfigError) as exc:
        problem = f"this node has no usable {job.backend!r} backend: {exc}"
        return SandboxOutcome.never_ran(StopReason.SANDBOX_UNAVAILABLE, problem)
    spec = replace(job.spec, tool_dir=tool_dir)
    return asyncio.run(_attempt(backend, spec, replace(job.limits, timeout_ms=left_ms), job.payload))


async def _attempt(backend: Any, spec: LaunchSpec, limits: Limits, payload: bytes) -> SandboxOutcome:
    from runner.call.executor import run_attempt

    try:
        return await run_attempt(backend, spec, limits, payload)
    finally:
        if isinstance(backend, Closable):
            await backend.aclose()


def node_task(job: NodeJob) -> SandboxOutcome:
    """The Ray task's body (``cluster.submit``): ``run_job``, its outcome naming this node."""
    import ray  # on the node, inside a Ray worker

    return replace(run_job(job), node=ray.get_runtime_context().get_node_id())
