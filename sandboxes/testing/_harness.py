"""What the contract checks need of a backend (``Harness``), and how they tell that
nothing of a call is left alive."""

from __future__ import annotations

import asyncio
import textwrap
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from sandboxes.base import (
    Closable,
    Converses,
    Dialogue,
    LaunchSpec,
    Limits,
    PreparedSandbox,
    PreStarts,
    Sandbox,
    SandboxOutcome,
)

# How long after ``close`` (or a kill) the processes of a call may take to be reaped.
GONE_WITHIN_S = 2.0
Check = Callable[["Harness"], Coroutine[Any, Any, None]]


def processes_with_env(marker: str) -> list[int]:
    """Pids of live processes on this host whose environment holds ``marker`` (``K=V``)."""
    needle = marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def processes_alive(request_id: str) -> bool:
    """Whether any live process on this host has ``REQUEST_ID=<request_id>`` in its environment."""
    return bool(processes_with_env(f"REQUEST_ID={request_id}"))


@dataclass
class Harness:
    """What the checks need of a backend.

    ``make`` builds a working backend; ``workdir`` is a folder the backend can mount tools
    from; ``image`` is given to container backends; ``unavailable`` builds a backend whose
    ``prepare`` must raise ``SandboxUnavailable`` (None skips that check's subject: the check
    then fails, so say how your backend refuses); ``alive`` is as above.
    """

    make: Callable[[], Sandbox]
    workdir: Path
    image: str | None = None
    unavailable: Callable[[], Sandbox] | None = None
    alive: Callable[[str], bool] = processes_alive
    limits: Limits = field(default_factory=lambda: Limits(timeout_ms=20_000))
    # Dialogues only: hold them with sandboxes started ahead (``PreStarts.prestart``),
    # each left waiting ``warm_idle_s`` before its call takes it.
    warm: bool = False
    warm_idle_s: float = 0.0

    def tool(self, code: str) -> LaunchSpec:
        """A fresh tool folder holding ``code`` as ``main.py``, and its launch spec."""
        request_id = f"contract-{uuid.uuid4().hex[:12]}"
        folder = self.workdir / request_id
        folder.mkdir(parents=True)
        (folder / "main.py").write_text(textwrap.dedent(code))
        folder.chmod(0o755)
        (folder / "main.py").chmod(0o644)
        env = {"TOOL_NAME": "contract", "REQUEST_ID": request_id}
        return LaunchSpec("contract", request_id, ("python3", "main.py"), folder, env=env, image=self.image)

    async def run(self, code: str, payload: bytes = b"{}", **limits: int) -> tuple[SandboxOutcome, str]:
        """One whole attempt: prepare, run, close. Returns the outcome and the request id."""
        spec = self.tool(code)
        return await self.run_spec(spec, payload, **limits), spec.request_id

    async def run_spec(self, spec: LaunchSpec, payload: bytes = b"{}", **limits: int) -> SandboxOutcome:
        """One whole attempt of ``spec`` (e.g. ``tool``'s with another command)."""
        backend = self.make()
        prepared = await backend.prepare(spec, replace(self.limits, **cast("dict[str, Any]", limits)))
        try:
            return await prepared.run(payload)
        finally:
            await prepared.close()
            await finish_deferred(backend)

    async def converse(self, spec: LaunchSpec, dialogue: Dialogue, **limits: int) -> SandboxOutcome:
        """One whole attempt holding ``dialogue``: prepare (or start ahead), converse, close."""
        resolved = replace(self.limits, **cast("dict[str, Any]", limits))
        backend = self.make()
        prepared: PreparedSandbox
        if self.warm:
            assert isinstance(backend, PreStarts), "the backend cannot start sandboxes ahead"
            warm = await asyncio.to_thread(backend.prestart, spec, resolved)
            warm.set_timeout(resolved.timeout_ms)
            prepared = warm
            await asyncio.sleep(self.warm_idle_s)
        else:
            prepared = await backend.prepare(spec, resolved)
        try:
            assert isinstance(prepared, Converses), "the prepared sandbox cannot hold a dialogue"
            return await prepared.converse(dialogue)
        finally:
            await prepared.close()
            await finish_deferred(backend)

    async def gone(self, request_id: str) -> bool:
        # Absent on two looks apart: a process in the middle of its exec shows an empty
        # environment for a moment, and one look could miss it.
        deadline = time.monotonic() + GONE_WITHIN_S
        absent = 0
        while absent < 2:
            if self.alive(request_id):
                absent = 0
                if time.monotonic() > deadline:
                    return False
            else:
                absent += 1
            await asyncio.sleep(0.05)
        return True


async def finish_deferred(backend: Sandbox) -> None:
    """What a backend does after a call's ``close`` (a dead container's removal, say) is
    done by its ``aclose`` at the latest: the checks look once it is (``sandboxes._deferred``)."""
    if isinstance(backend, Closable):
        await backend.aclose()
