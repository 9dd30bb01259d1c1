"""Warm pools: per tool, sandboxes started ahead of their calls.

A call takes a warm sandbox, feeds it, and closes it after that one call, exactly as a
cold one: the pool never gets a sandbox back. One keeper thread per runner does all the
pool's work, off every event loop and one sandbox at a time, so refilling never takes
more than one core from the calls: it starts replacements, retires sandboxes idle for
longer than ``max_idle_ms``, and discards every idle one on a policy change and on close.

The keeper is a plain thread because a warm sandbox outlives the loop of any one call
(a synchronous ``Runner.call`` runs each call on a fresh loop), and because the
subprocess backend's sandboxes die with the thread that started them (bubblewrap's
``--die-with-parent`` follows the starting thread): a long-lived thread keeps them alive
exactly as long as the runner, and no longer.

Not pooled, because what they need exists only for their call: tools granted secrets
(read per call), with a network or an egress allow-list (a proxy per call), with a
workspace (its contents at call time), and tools of a backend that cannot start its
sandboxes ahead (``PreStarts``). Those run cold; an explicit ``tools.NAME.pool`` for
one of them is reported to the operator once.

A hosted MCP server's warm sandbox is also initialized ahead when its backend
can speak to it before the call (``Primes``): the keeper holds a ``Handshake`` with it
within the tool's timeout, and only then is it ready; its call adopts the server's
``InitializeResult`` and goes straight to ``tools/call``. A server that fails its
handshake is discarded, never handed out (the operator hears of it once per pool), and
its pool backs off as after a failed start; calls meanwhile start it cold.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from runner.call.hosting import NO_HOSTED_WORK, Adopts, HeldOpening, HostedWork
from runner.call.policy import Policy
from runner.call.pool_plans import PoolPlan, pool_plans
from sandboxes import (
    Converses,
    Dialogue,
    LaunchSpec,
    Limits,
    OpeningFailed,
    PreparedSandbox,
    Primes,
    Sandbox,
    SandboxOutcome,
    SandboxUnavailable,
    WarmSandbox,
)

if TYPE_CHECKING:
    from runner.call.requests import CallOptions
    from runner.tools.registry import Registry

# After a tool's sandbox could not be started ahead, its pool waits this long before the
# next try: a machine without the isolation must not be asked twenty times a second.
RETRY_AFTER_FAILURE_S = 5.0
# A taken sandbox is replaced once its call has ended, or this long after it was taken,
# whichever comes first: a warm call is not slowed by its own replacement being
# set up beside it, and calls that come while a long one runs still find a warm sandbox.
REFILL_DEFER_S = 0.05


@dataclass(frozen=True)
class Ready:
    """An idle warm sandbox: when it was made ready, and the handshake it was primed with
    (None: not primed)."""

    warm: WarmSandbox
    made: float
    handshake: HeldOpening | None = None


@dataclass
class _Pool:
    plan: PoolPlan
    idle: deque[Ready] = field(default_factory=deque)
    preparing: int = 0
    # Taken by calls still running, by a key of their own: when each was taken.
    in_use: dict[int, float] = field(default_factory=dict)
    retry_at: float = 0.0
    warned: bool = False  # of a failed handshake: once per pool


class WarmPools:
    """The warm sandboxes of one runner, kept by one thread. Thread-safe."""

    def __init__(
        self,
        warn: Callable[[str], None],
        fault: Callable[[BaseException], None],
        clock: Callable[[], float] = time.monotonic,
        hosted: HostedWork = NO_HOSTED_WORK,
    ) -> None:
        self._warn = warn
        self._fault = fault
        self._clock = clock
        self._hosted = hosted  # says a hosted server's opening ahead
        self._cond = threading.Condition()
        self._pools: dict[str, _Pool] = {}
        self._doomed: list[WarmSandbox] = []  # to be discarded by the keeper
        self._max_idle_s = 0.0
        self._max_total = 0
        self._source: tuple[object, object] | None = None  # the policy and registry followed
        self._keeper: threading.Thread | None = None
        self._closing = False
        self._priming: Primes | None = None  # the sandbox the keeper is priming now
        self._keys = itertools.count()

    # -- the runner's side ---------------------------------------------------------

    def follow(
        self, policy: Policy, registry: Registry, backend: Callable[[str], Sandbox], no_options: CallOptions
    ) -> None:
        """Keep the pools ``policy`` asks for; a policy or registry other than the last
        one drains every pool first (its sandboxes were made under the old rules)."""
        with self._cond:
            if self._closing or self._source == (policy, registry):
                return
        plans = pool_plans(registry, policy, backend, no_options, self._warn)
        with self._cond:
            if self._closing or self._source == (policy, registry):
                return
            self._source = (policy, registry)
            for pool in self._pools.values():
                self._doomed += [ready.warm for ready in pool.idle]
            self._pools = {name: _Pool(plan) for name, plan in plans.items()}
            self._max_idle_s = policy.model.pool.max_idle_ms / 1000
            self._max_total = policy.model.pool.max_total
            if (self._pools or self._doomed) and self._keeper is None:
                self._keeper = threading.Thread(target=self._keep, name="runner-pool", daemon=True)
                self._keeper.start()
            self._cond.notify_all()

    def sandbox_for(self, tool_name: str, backend: Sandbox) -> Sandbox:
        """The backend a call of ``tool_name`` uses: ``backend`` itself, or, when the tool
        has a pool, one that takes a warm sandbox whenever one fits the call."""
        with self._cond:
            pool = self._pools.get(tool_name)
        if pool is None or id(pool.plan.backend) != id(backend):  # the very backend it fills from
            return backend
        return _PoolingSandbox(self, tool_name, backend)

    def take(self, tool_name: str, limits: Limits) -> tuple[Ready, Callable[[], None]] | None:
        """A warm sandbox of ``tool_name`` made under ``limits`` (but the timeout, which is
        the call's), now the caller's alone, and what to call once its call has ended (then
        it is replaced); None when there is none.

        The replacement waits for the call's end (at most ``REFILL_DEFER_S``): started at
        once, it would set up a sandbox (a dozen processes) and hold the GIL on the
        call's cores just while the call's own tool runs (what that cost a warm call:
        docs/performance.md, "Figures behind the code")."""
        with self._cond:
            pool = self._pools.get(tool_name)
            if pool is None or replace(limits, timeout_ms=pool.plan.limits.timeout_ms) != pool.plan.limits:
                return None
            fresh_after = self._clock() - self._max_idle_s
            taken = None
            while pool.idle and taken is None:
                ready = pool.idle.popleft()
                if ready.made > fresh_after:
                    taken = ready
                else:
                    self._doomed.append(ready.warm)
            # Stale ones to discard, an empty pool to fill, or the keeper's next wake:
            # REFILL_DEFER_S from now.
            self._cond.notify_all()
            if taken is None:
                return None
            key = next(self._keys)
            pool.in_use[key] = self._clock()
            return taken, functools.partial(self._release, pool, key)

    def _release(self, pool: _Pool, key: int) -> None:
        """The call that took a sandbox of ``pool`` has ended: the keeper replaces it."""
        with self._cond:
            pool.in_use.pop(key, None)
            self._cond.notify_all()

    def counts(self) -> dict[str, int]:
        """Idle warm sandboxes by tool (for tests and ``doctor``-like reports)."""
        with self._cond:
            return {name: len(pool.idle) for name, pool in self._pools.items()}

    def close(self) -> None:
        """Discard every warm sandbox and stop the keeper (blocking: from a thread)."""
        with self._cond:
            self._closing = True
            for pool in self._pools.values():
                self._doomed += [ready.warm for ready in pool.idle]
                pool.idle.clear()
            self._cond.notify_all()
            keeper, priming = self._keeper, self._priming
        if priming is not None:
            priming.interrupt()  # a server that never answers must not hold the close up
        if keeper is not None:
            keeper.join()
        self._discard(self._take_doomed())  # when there never was a keeper

    # -- the keeper's thread ---------------------------------------------------------

    def _keep(self) -> None:
        while True:
            with self._cond:
                job = self._next_job()
                doomed = self._take_doomed()
                closing = self._closing
                if job is None and not doomed and not closing:
                    self._cond.wait(self._next_wake())
                    continue
            self._discard(doomed)
            if closing:
                return
            if job is not None:
                self._prepare(job)

    def _next_job(self) -> _Pool | None:
        """The pool furthest below its size that may grow now (under ``max_total``)."""
        now = self._clock()
        stale_before = now - self._max_idle_s
        for pool in self._pools.values():
            while pool.idle and pool.idle[0].made <= stale_before:
                self._doomed.append(pool.idle.popleft().warm)
        if self._closing:
            return None
        total = sum(len(pool.idle) + pool.preparing for pool in self._pools.values())
        if total >= self._max_total:
            return None
        pools = self._pools.values()
        wanting = [pool for pool in pools if _held(pool, now) < pool.plan.size and pool.retry_at <= now]
        if not wanting:
            return None
        job = min(wanting, key=lambda pool: _held(pool, now) / pool.plan.size)
        job.preparing += 1
        return job

    def _next_wake(self) -> float | None:
        """Seconds until the next sandbox goes stale, a failed pool may try again, or a
        taken sandbox's replacement may start."""
        times = [ready.made + self._max_idle_s for pool in self._pools.values() for ready in pool.idle]
        times += [pool.retry_at for pool in self._pools.values() if pool.retry_at > 0]
        now = self._clock()
        # A taken sandbox still deferring its replacement stops deferring then (once past
        # it, it no longer counts, and needs no wake).
        ends = (taken + REFILL_DEFER_S for pool in self._pools.values() for taken in pool.in_use.values())
        times += [end for end in ends if end > now]
        if not times:
            return None
        return max(0.0, min(times) - now) + 0.001

    def _prepare(self, pool: _Pool) -> None:
        plan = pool.plan
        warm: WarmSandbox | None = None
        handshake: HeldOpening | None = None
        try:
            warm = plan.backend.prestart(plan.spec, plan.limits)
        except SandboxUnavailable as exc:
            self._warn(f"a warm sandbox of {plan.spec.tool_name} could not be started: {exc.message}")
        except Exception as exc:  # a fault of the runner: logged, the pool backs off
            self._fault(exc)
        if warm is not None and plan.hosted and isinstance(warm, Primes):
            handshake = self._prime(pool, warm)
            if handshake is None:
                warm = None  # discarded
        with self._cond:
            pool.preparing -= 1
            if warm is None:
                pool.retry_at = self._clock() + RETRY_AFTER_FAILURE_S
            elif self._closing or self._pools.get(plan.spec.tool_name) is not pool:
                self._doomed.append(warm)  # drained meanwhile
            else:
                pool.retry_at = 0.0
                pool.idle.append(Ready(warm, self._clock(), handshake))

    def _prime(self, pool: _Pool, warm: WarmSandbox) -> HeldOpening | None:
        """Initialize the MCP server of ``warm`` (a ``Primes``) within the tool's timeout;
        None when it failed (``warm`` is discarded then)."""
        assert isinstance(warm, Primes)
        handshake = self._hosted.opening()
        with self._cond:
            closing = self._closing
            if not closing:
                self._priming = warm
        if closing:
            self._discard([warm])
            return None
        try:
            warm.prime(handshake, pool.plan.limits.timeout_ms / 1000)
        except OpeningFailed as exc:
            with self._cond:
                # Closing: the failure is the interruption's own, nothing to report.
                quiet = pool.warned or self._closing
                pool.warned = True
            if not quiet:
                self._warn(
                    f"a warm MCP server of {pool.plan.spec.tool_name} could not be initialized ahead "
                    f"and is discarded (calls start it cold meanwhile): {exc.message}"
                )
        except Exception as exc:  # a fault of the runner: logged, the server discarded
            self._fault(exc)
        else:
            return handshake
        finally:
            with self._cond:
                self._priming = None
        self._discard([warm])
        return None

    def _take_doomed(self) -> list[WarmSandbox]:
        with self._cond:
            doomed, self._doomed = self._doomed, []
        return doomed

    def _discard(self, doomed: list[WarmSandbox]) -> None:
        for warm in doomed:
            try:
                warm.discard()
            except Exception as exc:  # one failed teardown must not keep the others alive
                self._fault(exc)


def _held(pool: _Pool, now: float) -> int:
    """What counts against a pool's size: idle, being prepared, and serving a call taken
    less than ``REFILL_DEFER_S`` ago."""
    deferring = sum(1 for taken in pool.in_use.values() if taken > now - REFILL_DEFER_S)
    return len(pool.idle) + pool.preparing + deferring


class _PoolingSandbox:
    """A call's backend that takes a warm sandbox when one fits, else prepares cold."""

    def __init__(self, pools: WarmPools, tool_name: str, backend: Sandbox) -> None:
        self.name = backend.name
        self._pools = pools
        self._tool_name = tool_name
        self._backend = backend

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedSandbox:
        if not spec.secrets and spec.egress is None:
            taken = self._pools.take(self._tool_name, limits)
            if taken is not None:
                ready, release = taken
                ready.warm.set_timeout(limits.timeout_ms)
                return _Taken(ready.warm, release, ready.handshake)
        return await self._backend.prepare(spec, limits)


class _Taken:
    """A warm sandbox serving its one call; its outcome says it was warm. A primed one
    gives its dialogue the handshake's result: its server is not initialized twice."""

    def __init__(
        self, warm: WarmSandbox, release: Callable[[], None], handshake: HeldOpening | None = None
    ) -> None:
        self._warm = warm
        self._release: Callable[[], None] | None = release
        self._handshake = handshake

    async def run(self, payload: bytes) -> SandboxOutcome:
        return replace(await self._warm.run(payload), warm=True)

    async def converse(self, dialogue: Dialogue) -> SandboxOutcome:
        if not isinstance(self._warm, Converses):
            raise SandboxUnavailable("this warm sandbox cannot host an MCP server")
        if self._handshake is not None:
            if not isinstance(dialogue, Adopts) or self._handshake.result is None:
                raise SandboxUnavailable("this warm MCP server was initialized ahead for a call only")
            dialogue.adopt(self._handshake.result)
        return replace(await self._warm.converse(dialogue), warm=True)

    async def close(self) -> None:
        try:
            await self._warm.close()
        finally:
            release, self._release = self._release, None
            if release is not None:  # once, however often close is called
                release()
