"""Warm pools: per tool, sandboxes started ahead of their calls.

A call takes a warm sandbox, feeds it, and closes it after that one call, exactly as a
cold one: the pool never gets a sandbox back. One keeper thread per runner does all the
pool's work, off every event loop and one sandbox at a time, so refilling never takes
more than one core from the calls: it starts replacements, retires sandboxes idle for
longer than ``max_idle_ms``, and discards every idle one on a policy change and on close.

Refilling yields to the calls: while the runner serves more calls than the machine has
cores, the keeper starts no replacement (a warm sandbox costs what a cold start does, so
under load it only takes CPU from calls already waiting for it), and looks again every
``REFILL_DEFER_S``. A call that finds its pool empty never waits for a refill: it starts
cold at once. Each take is counted, hit or miss, by tool (``takes``). Fork mode keeps one
template per tool instead (``runner.call.pool_forks``).

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
can speak to it before the call (``Primes``): the keeper holds an opening (``HeldOpening``) with it
within the tool's timeout, and only then is it ready; its call adopts the server's
``InitializeResult`` and goes straight to ``tools/call``. A server that fails its
handshake is discarded, never handed out (the operator hears of it once per pool), and
its pool backs off as after a failed start; calls meanwhile start it cold.

A warm sandbox whose tool ends before its call (a limit killed it while it waited, it
exited: ``Waits``), or that has used half its ``cpu_seconds`` while it waits, is found by
the keeper within ``CHECK_EVERY_S``, or by the call about to take it, and discarded, never
handed out (``runner.call.pool_health``). Each sandbox a pool loses before its call (one that
could not be started, failed its handshake, ended, or was busy) doubles the pool's wait
before its next refill, from 5 s up to 300 s; a taken sandbox, or one that waited out its
``max_idle_ms`` quietly, ends the streak (one still busy then is lost too). So a tool that
spins before reading its input costs an idle pool about ``size`` times half its
``cpu_seconds`` per back-off, not two cores for ever. Each sandbox lost that way is
audited (``pool.discarded``, with the reason), and the operator hears of it once per pool.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from runner.call.hosting import NO_HOSTED_WORK, HeldOpening, HostedWork
from runner.call.pool_calls import PoolingSandbox, Ready
from runner.call.pool_forks import ForkTemplates
from runner.call.pool_health import CHECK_EVERY_S, MAX_BACKOFF_S, back_off_s, lost_why
from runner.call.pool_plans import PoolPlan, pool_plans
from sandboxes import (
    Limits,
    OpeningFailed,
    Primes,
    Sandbox,
    SandboxUnavailable,
    Waits,
    WarmSandbox,
)

if TYPE_CHECKING:
    from runner.call.policy import Policy
    from runner.call.requests import CallOptions
    from runner.tools.registry import Registry

__all__ = ["REFILL_DEFER_S", "PoolPlan", "Ready", "WarmPools"]

# A taken sandbox is replaced once its call has ended, or this long after it was taken,
# whichever comes first: a warm call (~7 ms) is not slowed by its own replacement being
# set up beside it, and calls that come while a long one runs still find a warm sandbox.
REFILL_DEFER_S = 0.05


@dataclass
class _Pool:
    plan: PoolPlan
    idle: deque[Ready] = field(default_factory=deque)
    preparing: int = 0
    # Taken by calls still running, by a key of their own: when each was taken.
    in_use: dict[int, float] = field(default_factory=dict)
    retry_at: float = 0.0
    lost: int = 0  # sandboxes lost before their call, in a row
    warned: bool = False  # of a sandbox lost ahead: once per pool


class WarmPools:
    """The warm sandboxes of one runner, kept by one thread. Thread-safe."""

    def __init__(
        self,
        warn: Callable[[str], None],
        fault: Callable[[BaseException], None],
        clock: Callable[[], float] = time.monotonic,
        discarded: Callable[[dict[str, Any]], None] | None = None,
        hosted: HostedWork = NO_HOSTED_WORK,
        busy: Callable[[], int] = lambda: 0,
        cores: int | None = None,
    ) -> None:
        """``discarded`` hears of each warm sandbox lost before its call (the fields of
        a ``pool.discarded`` audit event), from the keeper's or a call's thread;
        ``hosted`` says a hosted server's opening ahead; ``busy()`` is the number of calls
        the runner serves now: above ``cores`` (the machine's), no refill starts."""
        self._warn = warn
        self._busy = busy
        self._cores = cores if cores is not None else os.cpu_count() or 1
        self._takes: dict[str, tuple[int, int]] = {}  # (hits, misses) by tool, over every policy
        self._hosted = hosted
        self._fault = fault
        self._clock = clock
        self._discarded = discarded
        self._notes: list[tuple[dict[str, Any], str | None]] = []  # said outside the lock
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
        self._forks = ForkTemplates(warn, fault, self._unfork, discarded, clock)

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
            self._pools = {name: _Pool(plan) for name, plan in plans.items() if not plan.fork}
            self._max_idle_s = policy.model.pool.max_idle_ms / 1000
            self._max_total = policy.model.pool.max_total
            self._keep_on()
        self._forks.follow({name: plan for name, plan in plans.items() if plan.fork})

    def _keep_on(self) -> None:
        """Start the keeper if there is work for it, and wake it (under the lock)."""
        if (self._pools or self._doomed) and self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, name="runner-pool", daemon=True)
            self._keeper.start()
        self._cond.notify_all()

    def _unfork(self, plan: PoolPlan) -> None:
        """A tool the backend cannot give fork mode: warm sandboxes serve it instead."""
        with self._cond:
            if not self._closing and plan.spec.tool_name not in self._pools:
                self._pools[plan.spec.tool_name] = _Pool(replace(plan, fork=False))
                self._keep_on()

    def sandbox_for(self, tool_name: str, backend: Sandbox) -> Sandbox:
        """The backend a call of ``tool_name`` uses: ``backend`` itself, or, when the tool
        has a pool, one that takes a warm sandbox whenever one fits the call."""
        with self._cond:
            pool = self._pools.get(tool_name)
        plan = pool.plan if pool is not None else self._forks.plan(tool_name)
        if plan is None or id(plan.backend) != id(backend):  # the very backend it fills from
            return backend
        return PoolingSandbox(self, tool_name, backend)

    def take(self, tool_name: str, limits: Limits) -> tuple[Ready, Callable[[], None]] | None:
        """A warm sandbox of ``tool_name`` made under ``limits`` (but the timeout, which is
        the call's), now the caller's alone, and what to call once its call has ended (then
        it is replaced); None when there is none. In fork mode: a call forked from the
        tool's template.

        The replacement waits for the call's end (at most ``REFILL_DEFER_S``): started at
        once, it would set up a sandbox (a dozen processes, ~10 ms of CPU) and hold the
        GIL on the call's two cores just while the call's own tool runs. Measured, that
        cost a warm call ~1 ms."""
        if self._forks.plan(tool_name) is not None:
            forked = self._forks.take(tool_name, limits)
            with self._cond:
                hits, misses = self._takes.get(tool_name, (0, 0))
                self._takes[tool_name] = (hits + 1, misses) if forked is not None else (hits, misses + 1)
            return (forked, lambda: None) if forked is not None else None  # the template stays
        with self._cond:
            pool = self._pools.get(tool_name)
            if pool is None or replace(limits, timeout_ms=pool.plan.limits.timeout_ms) != pool.plan.limits:
                return None
            fresh_after = self._clock() - self._max_idle_s
            taken = None
            while pool.idle and taken is None:
                ready = pool.idle.popleft()
                lost = lost_why(ready.warm, ready.cpu, pool.plan.limits, self._clock())
                if lost is not None:
                    self._lose(pool, ready.warm, *lost)
                elif ready.made > fresh_after:
                    taken = ready
                else:
                    self._doomed.append(ready.warm)
            # Stale ones to discard, an empty pool to fill, or the keeper's next wake:
            # REFILL_DEFER_S from now.
            self._cond.notify_all()
            hits, misses = self._takes.get(tool_name, (0, 0))
            self._takes[tool_name] = (hits + 1, misses) if taken is not None else (hits, misses + 1)
            if taken is not None:
                pool.lost = 0  # this one serves its call
                key = next(self._keys)
                pool.in_use[key] = self._clock()
        self._say()
        if taken is None:
            return None
        return taken, functools.partial(self._release, pool, key)

    def _release(self, pool: _Pool, key: int) -> None:
        """The call that took a sandbox of ``pool`` has ended: the keeper replaces it."""
        with self._cond:
            pool.in_use.pop(key, None)
            self._cond.notify_all()

    def counts(self) -> dict[str, int]:
        """Idle warm sandboxes (a ready template: 1) by tool (for tests and reports)."""
        with self._cond:
            return self._forks.counts() | {name: len(pool.idle) for name, pool in self._pools.items()}

    def takes(self) -> dict[str, tuple[int, int]]:
        """By tool since the runner started: calls that took a warm sandbox (hits) and
        that started cold because none was ready (misses)."""
        with self._cond:
            return dict(self._takes)

    def _loaded(self) -> bool:
        """More calls being served than there are cores: a refill would only slow them."""
        return self._busy() > self._cores

    def close(self) -> None:
        """Discard every warm sandbox and template, stop the keeper (blocking: from a thread)."""
        self._forks.close()
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
            self._say()
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
            for ready in list(pool.idle):
                lost = lost_why(ready.warm, ready.cpu, pool.plan.limits, self._clock())
                if lost is not None:
                    pool.idle.remove(ready)
                    self._lose(pool, ready.warm, *lost)
            while pool.idle and pool.idle[0].made <= stale_before:
                ready = pool.idle.popleft()
                busy = ready.cpu.busy(ready.made)
                if busy is not None:
                    self._lose(pool, ready.warm, "busy", busy)
                else:
                    self._doomed.append(ready.warm)
                    pool.lost = 0  # it waited all its idle life: the tool does wait
        if self._closing:
            return None
        total = sum(len(pool.idle) + pool.preparing for pool in self._pools.values())
        if total >= self._max_total:
            return None
        pools = self._pools.values()
        wanting = [pool for pool in pools if _held(pool, now) < pool.plan.size and pool.retry_at <= now]
        if not wanting or self._loaded():
            return None
        job = min(wanting, key=lambda pool: _held(pool, now) / pool.plan.size)
        job.preparing += 1
        return job

    def _next_wake(self) -> float | None:
        """Seconds until the next sandbox goes stale, a failed pool may try again, or a
        taken sandbox's replacement may start."""
        now = self._clock()
        times = [ready.made + self._max_idle_s for pool in self._pools.values() for ready in pool.idle]
        times += [pool.retry_at for pool in self._pools.values() if pool.retry_at > now]
        if any(isinstance(ready.warm, Waits) for pool in self._pools.values() for ready in pool.idle):
            times.append(now + CHECK_EVERY_S)
        if self._loaded() and any(_held(pool, now) < pool.plan.size for pool in self._pools.values()):
            times.append(now + REFILL_DEFER_S)  # held back by the load: look again soon
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
        failed: str | None = None  # why the handshake failed
        try:
            warm = plan.backend.prestart(plan.spec, plan.limits)
        except SandboxUnavailable as exc:
            self._warn(f"a warm sandbox of {plan.spec.tool_name} could not be started: {exc.message}")
        except Exception as exc:  # a fault of the runner: logged, the pool backs off
            self._fault(exc)
        if warm is not None and plan.hosted and isinstance(warm, Primes):
            handshake, failed = self._prime(pool, warm)
        with self._cond:
            pool.preparing -= 1
            if warm is None:
                self._back_off(pool)
            elif self._closing or self._pools.get(plan.spec.tool_name) is not pool:
                self._doomed.append(warm)  # drained meanwhile
            elif failed is not None:
                self._lose(pool, warm, "handshake", failed, quiet=True)  # _prime warned
            else:
                pool.idle.append(Ready(warm, self._clock(), handshake))
        self._say()

    def _back_off(self, pool: _Pool) -> float:
        """One more sandbox ``pool`` lost ahead: its next refill waits (under the lock)."""
        pool.lost += 1
        wait = back_off_s(pool.lost)
        pool.retry_at = max(pool.retry_at, self._clock() + wait)
        return wait

    def _lose(self, pool: _Pool, warm: WarmSandbox, reason: str, why: str, quiet: bool = False) -> None:
        """Discard ``warm``, lost before its call, back off, and note it for the audit trail
        and, once per pool, the operator (under the lock; ``_say`` says it)."""
        self._doomed.append(warm)
        wait = self._back_off(pool)
        tool = pool.plan.spec.tool_name
        fields = {
            "toolName": tool,
            "reason": reason,
            "detail": why,
            "lost": pool.lost,
            "retryAfterMs": round(wait * 1000),
        }
        warning = None
        if not (quiet or pool.warned or self._closing):
            pool.warned = True
            warning = (
                f"a warm sandbox of {tool} is discarded before its call ({why}); its pool "
                f"waits {wait:g} s before the next, longer after each one lost (up to {MAX_BACKOFF_S:g} s)"
            )
        self._notes.append((fields, warning))

    def _say(self) -> None:
        """Write what ``_lose`` noted (outside the lock: the audit trail is a file)."""
        with self._cond:
            notes, self._notes = self._notes, []
        for fields, warning in notes:
            if warning is not None:
                self._warn(warning)
            if self._discarded is not None:
                try:
                    self._discarded(fields)
                except Exception as exc:  # the keeper must live on
                    self._fault(exc)

    def _prime(self, pool: _Pool, warm: WarmSandbox) -> tuple[HeldOpening | None, str | None]:
        """Initialize the MCP server of ``warm`` (a ``Primes``) within the tool's timeout:
        the handshake, or why it failed (``warm`` is then the caller's to discard)."""
        assert isinstance(warm, Primes)
        handshake = self._hosted.opening()
        with self._cond:
            closing = self._closing
            if not closing:
                self._priming = warm
        if closing:
            return None, "the runner is closing"
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
            return None, exc.message
        except Exception as exc:  # a fault of the runner: logged, the server discarded
            self._fault(exc)
            return None, f"a fault of the runner ({type(exc).__name__})"
        else:
            return handshake, None
        finally:
            with self._cond:
                self._priming = None

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
