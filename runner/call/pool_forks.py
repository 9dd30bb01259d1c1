"""Fork mode's pools: per tool, one template, started and imported once, and each call
forked from it (``sandboxes.Forks``), instead of ``size`` warm sandboxes.

A template is started in a thread of its own (its sandbox lives in the backend's threads,
not in this one), once for all the calls to come, whatever the load: a call that comes
before it is ready starts cold. A template that ends (killed, or its sandbox died) is
discarded, audited (``pool.discarded``, reason ``ended``) and started again on the next
call after the pool's back-off; calls meanwhile start cold. A tool or machine the backend
cannot give fork mode (not a Python tool, no root or cgroups, an old kernel, an import
that leaves a thread or a filter behind) is handed back to the warm pools (``refused``),
and the operator hears why, once per policy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from runner.call.pool_calls import Ready
from runner.call.pool_health import back_off_s
from runner.call.pool_plans import PoolPlan
from sandboxes import Forks, ForkTemplate, Limits, SandboxUnavailable


@dataclass
class _Fork:
    plan: PoolPlan
    template: ForkTemplate | None = None
    starting: bool = False
    retry_at: float = 0.0
    lost: int = 0  # templates lost in a row


class ForkTemplates:
    """The templates of one runner's fork-mode pools. Thread-safe."""

    def __init__(
        self,
        warn: Callable[[str], None],
        fault: Callable[[BaseException], None],
        refused: Callable[[PoolPlan], None],
        discarded: Callable[[dict[str, Any]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``refused`` gets the plan of a tool the backend cannot give fork mode: a warm
        pool may serve it instead; ``discarded`` hears of each template that ended."""
        self._warn = warn
        self._fault = fault
        self._refused = refused
        self._discarded = discarded
        self._clock = clock
        self._lock = threading.RLock()
        self._forks: dict[str, _Fork] = {}
        self._threads: set[threading.Thread] = set()
        self._retired: list[ForkTemplate] = []  # of earlier plans: discarded at close at the latest
        self._closing = threading.Event()  # set at close: templates being made give up too

    def follow(self, plans: dict[str, PoolPlan]) -> None:
        """Keep a template for each of ``plans`` (all in fork mode), and no other: the
        templates of the last plans (made under the old rules) are discarded once their
        calls in flight have ended."""
        with self._lock:
            if self._closing.is_set():
                return
            old = [fork.template for fork in self._forks.values() if fork.template is not None]
            self._forks = {name: _Fork(plan) for name, plan in plans.items()}
            for fork in self._forks.values():
                self._start(fork)
            self._retired = [kept for kept in self._retired if kept.ended() is None] + old
        if old:  # their calls in flight finish with what they started with
            self._in_thread(self._retire, old)

    def plan(self, tool_name: str) -> PoolPlan | None:
        """The fork-mode plan of ``tool_name``; None when it has none."""
        with self._lock:
            fork = self._forks.get(tool_name)
            return fork.plan if fork is not None else None

    def take(self, tool_name: str, limits: Limits) -> Ready | None:
        """A sandbox for one call forked from the tool's template made under ``limits``
        (but the timeout); None when it has none ready."""
        with self._lock:
            fork = self._forks.get(tool_name)
            if fork is None or fork.template is None:
                if fork is not None:
                    self._start(fork)  # after its back-off
                return None
            if replace(limits, timeout_ms=fork.plan.limits.timeout_ms) != fork.plan.limits:
                return None
            template = fork.template
            ended = template.ended()
            if ended is None:
                fork.lost = 0
                try:
                    return Ready(template.call(fork.plan.limits), self._clock())
                except SandboxUnavailable:  # closed meanwhile (the runner is closing)
                    return None
            fork.template = None
            fork.lost += 1
            fork.retry_at = self._clock() + back_off_s(fork.lost)
        self._in_thread(self._discard, [template])
        self._warn(
            f"the fork-mode template of {tool_name} ended ({ended}); it is started again after a back-off"
        )
        if self._discarded is not None:
            self._discarded(
                {"toolName": tool_name, "reason": "ended", "detail": ended, "lost": fork.lost,
                 "retryAfterMs": round(back_off_s(fork.lost) * 1000)}
            )  # fmt: skip
        return None

    def counts(self) -> dict[str, int]:
        """1 by tool with a template ready, else 0."""
        with self._lock:
            templates = {name: fork.template for name, fork in self._forks.items()}
        return {name: int(kept is not None and kept.ended() is None) for name, kept in templates.items()}

    def close(self) -> None:
        """Discard every template, once those being started are (blocking: from a thread)."""
        with self._lock:
            self._closing.set()
            templates = [fork.template for fork in self._forks.values() if fork.template is not None]
            templates += self._retired  # those whose calls are still running too
            self._forks, self._retired = {}, []
        self._discard(templates)
        while True:  # templates being started or discarded: each is discarded by its thread
            with self._lock:
                threads = list(self._threads)
            if not threads:
                return
            for thread in threads:
                thread.join()

    # -- starting and discarding, each in a thread of its own ------------------------

    def _start(self, fork: _Fork) -> None:
        """Start ``fork``'s template unless one is starting or it waits out a back-off
        (under the lock)."""
        busy = fork.starting or fork.template is not None or self._closing.is_set()
        if busy or fork.retry_at > self._clock():
            return
        fork.starting = True
        self._in_thread(self._make, fork)

    def _make(self, fork: _Fork) -> None:
        plan = fork.plan
        assert isinstance(plan.backend, Forks)
        template: ForkTemplate | None = None
        refused: str | None = None
        try:
            template = plan.backend.fork_template(plan.spec, plan.limits, self._closing)
        except SandboxUnavailable as exc:
            refused = exc.message
        except Exception as exc:  # a fault of the runner: logged, the pool backs off
            self._fault(exc)
        with self._lock:
            fork.starting = False
            current = not self._closing.is_set() and self._forks.get(plan.spec.tool_name) is fork
            if template is not None and current:
                fork.template, template = template, None
            elif refused is not None and current:
                del self._forks[plan.spec.tool_name]
            elif template is None:
                fork.lost += 1
                fork.retry_at = self._clock() + back_off_s(fork.lost)
        if template is not None:
            self._discard([template])  # drained meanwhile
        if refused is not None and current:
            self._warn(
                f"{plan.spec.tool_name} cannot run in fork mode ({refused}): its pool keeps warm sandboxes"
            )
            self._refused(plan)

    def _retire(self, templates: list[ForkTemplate]) -> None:
        self._each(templates, lambda template: template.retire())

    def _discard(self, templates: list[ForkTemplate]) -> None:
        self._each(templates, lambda template: template.discard())

    def _each(self, templates: list[ForkTemplate], act: Callable[[ForkTemplate], None]) -> None:
        for template in templates:
            try:
                act(template)
            except Exception as exc:  # one failed teardown must not keep the others alive
                self._fault(exc)

    def _in_thread(self, work: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            try:
                work(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name="runner-fork-pool", daemon=True)
        with self._lock:  # re-entrant: ``_start`` holds it
            self._threads.add(thread)
        thread.start()
