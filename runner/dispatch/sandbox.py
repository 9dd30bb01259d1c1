"""The ``Sandbox`` of a dispatched tool: each attempt a Ray task on a node with a free slot.

``prepare`` joins the cluster (once per process) and packs the tool folder; ``run`` submits
the task and waits for the node's outcome. The wait is the attempt's: the time a task
queues for a free slot is taken from its timeout, on the node too (``node.run_job``), and
a caller that stops waiting (its timeout, or its call cancelled) cancels the task, which
kills the sandbox on the node, and waits until the task has ended: nothing is left
queued or running. A node lost under the task is the outcome ``node_lost`` (retried by the
executor, most likely on another node: Ray itself never retries these tasks).

Not dispatched (``SandboxUnavailable``, the call fails closed): a hosted MCP server's tool
(a dialogue would need a stream between hosts), a tool granted the workspace (the
caller's folder is not on the node), a tool with a network allow-list (its egress proxy
is the caller's) and a tool with ``network: true`` (its own network with real egress: on a
node that egress would reach the cluster's private network, its GCS, raylets and object
managers). Leave these out of ``dispatch.tools``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from runner.config.dispatch import DispatchModel
from runner.dispatch.bundle import ToolBundle, pack
from runner.dispatch.cluster import join, submit
from runner.dispatch.node import NodeJob
from sandboxes import Dialogue, LaunchSpec, Limits, SandboxOutcome, SandboxUnavailable, StopReason
from sandboxes.cancellation import finish_shielded

# The node reports its own timeout (with the tool's stderr); the caller waits this much
# longer before it gives up on the node and cancels the task itself.
REPORT_GRACE_S = 1.0
# After ray.cancel, how long the node may take to kill and close the sandbox; then the
# task's worker is killed outright (the node's watchdog then sweeps the sandbox).
CANCEL_WAIT_S = 5.0
FORCE_WAIT_S = 5.0
MAX_MESSAGE = 300
MAX_TRACE = 16_000
# Ray colours the task's name in its errors' text: the operator log is a file, not a terminal.
_COLOURS = re.compile(r"\x1b\[[0-9;]*m")


class DispatchFault(RuntimeError):
    """The node task failed in the runner's own code (a fault for the operator's log); its
    text holds the node's traceback."""


class DispatchedSandbox:
    """Runs attempts of the backend ``name`` on the nodes of the cluster ``model`` names."""

    def __init__(self, name: str, config: Mapping[str, Any], model: DispatchModel, base_dir: Path) -> None:
        self.name = name  # the node's backend: what the audit's ``sandbox`` says
        self._config = dict(config)
        self._model = model
        self._base_dir = base_dir

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> DispatchedRun:
        """Join the cluster and pack the tool folder.

        Raises:
            SandboxUnavailable: the tool cannot be dispatched (see the module), its folder
                is too large or unreadable, or the cluster cannot be used.
        """
        if limits.network:
            raise SandboxUnavailable(
                "a tool with network: true is not dispatched (on a node it would reach the cluster's network)"
            )
        if spec.egress is not None:
            raise SandboxUnavailable("a tool with a network allow-list is not dispatched (its proxy is here)")
        if spec.workspace is not None:
            raise SandboxUnavailable("a tool granted the workspace is not dispatched (the workspace is here)")
        remote = await asyncio.to_thread(join, self._model, self._base_dir)
        bundle = await asyncio.to_thread(pack, spec.tool_dir, self._model.max_bundle_bytes)
        return DispatchedRun(self, remote, spec, limits, bundle)

    def job(self, spec: LaunchSpec, limits: Limits, payload: bytes, bundle: ToolBundle) -> NodeJob:
        return NodeJob(spec, limits, payload, self.name, self._config, bundle, self._model.node_cache)

    @property
    def slots_resource(self) -> str:
        return self._model.slots_resource


class DispatchedRun:
    """One attempt's Ray task: submitted by ``run``, cancelled and waited for when cut short."""

    def __init__(
        self, sandbox: DispatchedSandbox, remote: Any, spec: LaunchSpec, limits: Limits, bundle: ToolBundle
    ) -> None:
        self._sandbox = sandbox
        self._remote = remote
        self._spec = spec
        self._limits = limits
        self._bundle = bundle
        self._pending: Any = None  # the ObjectRef of a task not known to have ended

    async def run(self, payload: bytes) -> SandboxOutcome:
        """Run the attempt on a node and return the node's outcome (naming the node).

        Raises:
            asyncio.CancelledError: the call was cancelled; the task is over by then.
            DispatchFault: the node task failed in the runner's own code.
        """
        import ray.exceptions as rex

        lost_node = (rex.NodeDiedError, rex.WorkerCrashedError, rex.ObjectLostError, rex.LocalRayletDiedError)
        job = replace(
            self._sandbox.job(self._spec, self._limits, payload, self._bundle), submitted_at=time.time()
        )
        started = time.monotonic()
        ref = submit(self._remote, job, self._sandbox.slots_resource)
        self._pending = ref
        try:
            async with asyncio.timeout(self._limits.timeout_ms / 1000 + REPORT_GRACE_S):
                outcome: SandboxOutcome = await asyncio.wrap_future(ref.future())
        except TimeoutError:
            await finish_shielded(self._cancel())
            return _stopped(StopReason.TIMEOUT, "", started)
        except asyncio.CancelledError:
            await finish_shielded(self._cancel())
            raise
        except lost_node as lost:
            self._pending = None
            return _stopped(StopReason.NODE_LOST, _first_line(lost), started)
        except rex.TaskCancelledError as cancelled:  # by someone else: the operator, Ray
            self._pending = None
            message = f"the task was cancelled on the cluster: {_first_line(cancelled)}"
            return _stopped(StopReason.NODE_LOST, message, started)
        except rex.RayError as fault:
            self._pending = None
            # Ray's text of the error is the node's traceback: the operator log gets it
            # once, uncoloured (the answer names the fault's type only).
            node_trace = _COLOURS.sub("", str(fault)).strip()[:MAX_TRACE]
            raise DispatchFault(f"the node task of {self._spec.tool_name} failed: {node_trace}") from None
        self._pending = None
        return outcome

    async def converse(self, dialogue: Dialogue) -> SandboxOutcome:
        """Refused: a hosted MCP server is not dispatched.

        Raises:
            SandboxUnavailable: always.
        """
        raise SandboxUnavailable("a hosted MCP server's tool is not dispatched")

    async def close(self) -> None:
        """Cancel the task if it may still run (safe to call twice)."""
        if self._pending is not None:
            await self._cancel()

    async def _cancel(self) -> None:
        """Cancel the task and wait until it has ended: the node kills the sandbox first
        (a KeyboardInterrupt in the task); a task that does not end in time loses its
        worker process, whose watchdog sweeps what it started."""
        import ray

        ref, self._pending = self._pending, None
        if ref is None:
            return
        for force, wait_s in ((False, CANCEL_WAIT_S), (True, FORCE_WAIT_S)):
            with contextlib.suppress(Exception):  # the task may have ended meanwhile
                ray.cancel(ref, force=force)
            try:
                async with asyncio.timeout(wait_s):
                    await asyncio.wrap_future(ref.future())
            except TimeoutError:
                continue
            except Exception:  # noqa: S110 - ended by the cancel (TaskCancelledError) or else: ended
                pass
            return


def _first_line(error: BaseException) -> str:
    text = _COLOURS.sub("", str(error)).strip().splitlines()
    return text[0][:MAX_MESSAGE] if text else type(error).__name__


def _stopped(reason: StopReason, message: str, started: float) -> SandboxOutcome:
    elapsed_ms = (time.monotonic() - started) * 1000
    return dataclasses.replace(SandboxOutcome.never_ran(reason, message), duration_ms=elapsed_ms)
