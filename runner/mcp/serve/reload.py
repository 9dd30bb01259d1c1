"""Watching the policy file and the tool folders: a change reloads them.

Polling, not inotify: a handful of ``stat`` calls a second, works on every filesystem
(bind mounts, NFS, overlay) and needs no extra dependency. A new policy that does not
load is refused: the runner keeps the old one, the operator log and the audit trail say
why, and the clients are not told of a change that did not happen.

Except for revocation, which fails closed: a token whose digest is no longer in the new
file's ``serve.tokens`` stops working at this reload even when the rest of the file is
refused (a revocation must not wait for an unrelated typo to be fixed). When even that
list cannot be read (the file is gone, is not YAML, or ``serve``/``serve.tokens`` is not
a mapping/list), every token stops working until a policy that loads is in place: the
runner cannot tell which tokens the operator meant to keep. Additions and every other
change still wait for a policy that loads. Each revocation is audited (``serve.revoke``).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import anyio

from runner.api import Runner
from runner.config.yaml_files import YamlFileError, load_yaml_file
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
            before = self._runner.policy.model.serve.tokens
            try:
                await anyio.to_thread.run_sync(self._runner.reload, self._tool_dirs, self._policy)
            except ConfigError as exc:
                problem = " ".join(str(exc).split())
                audit.operator.warn(f"serve: the new policy is refused, the old one is kept: {problem}")
                audit.emit("serve.reload", accepted=False, problem=problem)
                kept = await anyio.to_thread.run_sync(tokens_in_file, self._policy)
                revoked = revoke_tokens(self._runner, kept)
                self._report_revoked(revoked, accepted=False, readable=kept is not None)
                return False
            registry = self._runner.registry
            audit.emit("serve.reload", accepted=True, tools=len(registry), problems=len(registry.problems))
            after = {entry.sha256 for entry in self._runner.policy.model.serve.tokens}
            self._report_revoked([entry.name for entry in before if entry.sha256 not in after], accepted=True)
        await self._on_change()
        return True

    def _report_revoked(self, names: list[str], *, accepted: bool, readable: bool = True) -> None:
        if not names:
            return
        audit = self._runner.audit
        if not accepted:
            why = "are not in its serve.tokens" if readable else "its serve.tokens cannot be read"
            audit.operator.warn(
                f"serve: the refused policy still revokes these tokens ({why}): {', '.join(names)}"
            )
        reason = "removed" if readable else "unreadable_policy"
        audit.emit("serve.revoke", tokens=names, reason=reason, accepted=accepted)


def tokens_in_file(path: Path) -> set[str] | None:
    """The ``sha256`` of each entry of the file's ``serve.tokens``, read as leniently as
    can be (the rest of the file may be invalid); None when that list cannot be read."""
    try:
        raw = load_yaml_file(path)
    except (OSError, YamlFileError):
        return None
    if not isinstance(raw, dict):
        return None
    serve = raw.get("serve") or {}
    if not isinstance(serve, dict):
        return None
    tokens = serve.get("tokens") or []
    if not isinstance(tokens, list):
        return None
    digests = (entry.get("sha256") for entry in tokens if isinstance(entry, dict))
    return {digest for digest in digests if isinstance(digest, str)}


def revoke_tokens(runner: Runner, kept: set[str] | None) -> list[str]:
    """Drop from the live policy every token whose digest is not in ``kept`` (None: every
    token); the names of those dropped. Nothing else of the live policy changes."""
    policy = runner.policy
    live = policy.model.serve.tokens
    remaining = [entry for entry in live if kept is not None and entry.sha256 in kept]
    if len(remaining) == len(live):
        return []
    serve = policy.model.serve.model_copy(update={"tokens": remaining})
    # The same Policy with only its model's token list changed: whatever follows the policy
    # by identity (the warm pools) sees no new policy, as none was taken.
    policy.model = policy.model.model_copy(update={"serve": serve})
    return [entry.name for entry in live if entry not in remaining]


def _stat(path: Path) -> tuple[str, int, int, int]:
    try:
        info = path.stat()
    except OSError:
        return (str(path), -1, -1, -1)
    return (str(path), info.st_mtime_ns, info.st_size, info.st_ino)
