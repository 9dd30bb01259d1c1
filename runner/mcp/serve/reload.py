"""Watching the policy file and the tool folders: a change reloads them.

Polling, not inotify: a handful of ``stat`` calls a second, works on every filesystem
(bind mounts, NFS, overlay) and needs no extra dependency. A new policy that does not
load is refused: the runner keeps the old one, the operator log and the audit trail say
why, and the clients are not told of a change that did not happen.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import anyio

from runner.api import Runner
from runner.errors import ConfigError
from runner.tools.manifest import MANIFEST_FILE

# How often the files are looked at; a change is served within about this long.
POLL_INTERVAL_S = 0.5
Fingerprint = tuple[tuple[str, int, int, int], ...]


class Reloader:
    """Reloads ``runner`` when ``policy`` or anything under ``tool_dirs`` changes, then
    calls ``on_change`` (which tells the clients)."""

    def __init__(
        self,
        runner: Runner,
        policy: Path,
        tool_dirs: Sequence[Path],
        on_change: Callable[[], Awaitable[None]],
    ) -> None:
        self._runner = runner
        self._policy = policy
        self._tool_dirs = list(tool_dirs)
        self._on_change = on_change
        self._seen = self.fingerprint()
        self._lock = anyio.Lock()

    def fingerprint(self) -> Fingerprint:
        """What is looked at: the policy file, each tools folder, each tool's folder and
        manifest (a tool's program is read afresh by every call anyway)."""
        paths = [self._policy]
        for root in self._tool_dirs:
            paths.append(root)
            try:
                entries = list(os.scandir(root))
                folders = sorted(entry.path for entry in entries if entry.is_dir(follow_symlinks=False))
            except OSError:
                continue
            for folder in folders:
                paths += [Path(folder), Path(folder) / MANIFEST_FILE]
        return tuple(_stat(path) for path in paths)

    async def watch(self) -> None:
        """Poll until cancelled."""
        while True:
            await anyio.sleep(POLL_INTERVAL_S)
            if self.fingerprint() != self._seen:
                await self.reload()

    async def reload(self) -> bool:
        """Reload now; whether the new configuration was taken."""
        async with self._lock:
            self._seen = self.fingerprint()
            audit = self._runner.audit
            try:
                await anyio.to_thread.run_sync(self._runner.reload, self._tool_dirs, self._policy)
            except ConfigError as exc:
                problem = " ".join(str(exc).split())
                audit.operator.warn(f"serve: the new policy is refused, the old one is kept: {problem}")
                audit.emit("serve.reload", accepted=False, problem=problem)
                return False
            registry = self._runner.registry
            audit.emit("serve.reload", accepted=True, tools=len(registry), problems=len(registry.problems))
        await self._on_change()
        return True


def _stat(path: Path) -> tuple[str, int, int, int]:
    try:
        info = path.stat()
    except OSError:
        return (str(path), -1, -1, -1)
    return (str(path), info.st_mtime_ns, info.st_size, info.st_ino)
