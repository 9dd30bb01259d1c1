"""Learning an MCP server's tools at load: the server started in a sandbox of its own,
``initialize`` and ``tools/list``, the sandbox destroyed; the answer cached.

The cache key is the manifest's bytes and a fingerprint of the tool folder (every entry's
path, type, size and modification time, symlinks not followed): installing another
version of the server, or editing it, lists it again. What the listing gives is only the
tools' names, descriptions and schemas, checked as a manifest would be; a stale entry
could never widen what a call may do, since every call starts the server afresh under the
policy of that moment.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.call.plan import launch_spec, resolve_plan
from runner.call.policy import Policy
from runner.call.requests import CallOptions
from runner.tools.cache import ManifestCache
from runner.tools.hosted import ListingFailed, server_as_tool
from runner.tools.manifest import ServerEntry
from runner.tools.tool_errors import one_line
from sandboxes import Converses, LaunchSpec, Limits, Sandbox, SandboxOutcome, SandboxUnavailable

if TYPE_CHECKING:
    from runner.mcp.hosted.session import ListTools, Spoken

# A folder with more entries than this is listed afresh at every load (not fingerprinted).
MAX_FINGERPRINT_ENTRIES = 200_000
CACHE_PREFIX = "mcp-tools:"
# A server that could not be listed is not tried again for this long (same folder, same
# manifest): a broken or hanging server must not make every command wait for its timeout.
FAILURE_MEMORY_S = 60.0
FAILED_SUFFIX = ":failed"


class ServerLister:
    """Lists servers' tools for a registry load, through the runner's own backends."""

    def __init__(self, policy: Policy, sandboxes: Callable[[str], Sandbox]) -> None:
        self._policy = policy
        self._sandboxes = sandboxes

    def __call__(self, entry: ServerEntry, cache: ManifestCache) -> list[dict[str, Any]]:
        """The server's tools, each as ``tools/list`` gives it (by alias, no nulls).

        Raises:
            ListingFailed: the server could not be started, or did not answer as MCP says.
        """
        key = _cache_key(entry)
        known = cache.get(key) if key is not None else None
        if isinstance(known, list):
            return known
        failed = cache.get(key + FAILED_SUFFIX) if key is not None else None
        if isinstance(failed, dict) and 0 <= time.time() - failed.get("at", 0) < FAILURE_MEMORY_S:
            ago = round(time.time() - failed["at"])
            raise ListingFailed(f"{failed.get('why', '')} (remembered from {ago} s ago)")
        # Its own loop in its own thread: a registry loads from synchronous code and from
        # code running an event loop (``runner serve`` reloading) alike.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="runner-list") as thread:
            try:
                listed = thread.submit(asyncio.run, self._list(entry)).result()
            except ListingFailed as exc:
                if key is not None:
                    cache.remember(key + FAILED_SUFFIX, {"why": str(exc), "at": time.time()})
                raise
        if key is not None:
            cache.put(key, listed)
        return listed

    async def _list(self, entry: ServerEntry) -> list[dict[str, Any]]:
        from runner.mcp.hosted.session import ListTools

        tool = server_as_tool(entry)
        plan = resolve_plan(tool, self._policy, CallOptions())
        spec = launch_spec(tool, f"list-{uuid.uuid4().hex[:12]}", self._policy, plan.runtime)
        limits = replace(plan.limits, network=False)  # listing needs no network
        dialogue = ListTools()
        # Never the policy's workspace: a listing runs whatever the policy says of the
        # server's tools. A server that checks its folder at start (the filesystem
        # server) finds one, empty and read-only.
        with tempfile.TemporaryDirectory(prefix="runner-list-") as empty:
            os.chmod(empty, 0o755)  # noqa: PTH101, S103 - empty; the sandbox user must open it
            if spec.workspace_mode != "none":
                spec = replace(spec, workspace=Path(empty), workspace_mode="read")
            return await self._list_in(dialogue, plan.sandbox, spec, limits)

    async def _list_in(
        self, dialogue: ListTools, backend: str, spec: LaunchSpec, limits: Limits
    ) -> list[dict[str, Any]]:
        try:
            prepared = await self._sandboxes(backend).prepare(spec, limits)
            try:
                if not isinstance(prepared, Converses):
                    raise ListingFailed(f"the {backend} backend cannot host MCP servers")
                outcome = await prepared.converse(dialogue)
            finally:
                await prepared.close()
        except SandboxUnavailable as exc:
            raise ListingFailed(f"cannot start it: {exc.message}") from exc
        spoken = dialogue.spoken
        if outcome.ok and spoken.tools is not None:
            return [tool.model_dump(by_alias=True, exclude_none=True, mode="json") for tool in spoken.tools]
        raise ListingFailed(_why(outcome, spoken, limits.timeout_ms))


def _why(outcome: SandboxOutcome, spoken: Spoken, timeout_ms: int) -> str:
    """Why a listing failed, one printable line (the server's words end up on terminals)."""
    return one_line(_reason(outcome, spoken, timeout_ms), 400)


def _reason(outcome: SandboxOutcome, spoken: Spoken, timeout_ms: int) -> str:
    if spoken.broken is not None:
        evidence = f": {spoken.evidence[:120]!r}" if spoken.evidence else ""
        return f"it broke the MCP protocol: {spoken.broken}{evidence}"
    if spoken.refused is not None:
        return f"it refused to list its tools: {spoken.refused}"
    stderr = outcome.stderr_tail.strip().splitlines()
    last = f" (stderr: {stderr[-1][:200]})" if stderr else ""
    reason = outcome.reason.value if outcome.reason is not None else "no answer"
    if reason == "timeout":
        return f"it did not list its tools within {timeout_ms} ms{last}"
    if reason == "exit_code":
        return f"it exited with status {outcome.exit_code} before listing its tools{last}"
    return f"it did not list its tools: {reason} {outcome.message}".rstrip() + last


def _cache_key(entry: ServerEntry) -> str | None:
    fingerprint = folder_fingerprint(entry.directory)
    if fingerprint is None:
        return None
    return CACHE_PREFIX + hashlib.sha256(f"{entry.key}\n{fingerprint}".encode()).hexdigest()


def folder_fingerprint(folder: Path) -> str | None:
    """A digest of every entry under ``folder`` (path, type, size, mtime), or None when
    there are too many to be worth it. Symlinks are recorded, never followed."""
    digest = hashlib.sha256()
    count = 0
    for top, dirs, files in os.walk(folder, followlinks=False):
        dirs.sort()
        for name in sorted(files) + dirs:
            count += 1
            if count > MAX_FINGERPRINT_ENTRIES:
                return None
            path = os.path.join(top, name)  # noqa: PTH118 - plain strings: node_modules is big
            try:
                info = os.lstat(path)
            except OSError:
                continue
            relative = os.path.relpath(path, folder)
            digest.update(f"{relative}\0{info.st_mode}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()
