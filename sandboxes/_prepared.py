"""What a prepared sandbox of either backend shares: its stage, and its one run.

A prepared sandbox goes through these stages, each once, in this order (a stage may be
skipped; ``Stage.CLOSED`` may come at any point)::

    PREPARED --start_waiting--> WAITING --prime--> PRIMED
        \\                          \\                 \\
         run / converse (cold)       run / converse    converse (warm)
                 \\___________________\\_________________\\__> RAN --close--> CLOSED

``run`` and ``converse`` are written once, here: both hand an ``Exchange``
(``sandboxes._exchange``) to the backend's ``_exchange``, which starts the tool when the
sandbox was not started ahead (cold) and lets the exchange speak with it under the limits.
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod

from sandboxes._exchange import DialogueExchange, Exchange, PayloadExchange
from sandboxes._priming import Opened, PrimingPipe, prime_with
from sandboxes.base import Dialogue, Limits, Opening, OpeningFailed, SandboxOutcome, SandboxUnavailable
from sandboxes.events import EventSink


class Stage(enum.Enum):
    """Where a prepared sandbox is in its life."""

    PREPARED = "prepared"  # made; its run starts the tool (a cold run)
    WAITING = "waiting"  # started ahead of its call: the tool waits on stdin (warm)
    PRIMED = "primed"  # started ahead and its opening held: it waits for its dialogue
    RAN = "ran"  # its one run has begun: it serves no other
    CLOSED = "closed"  # closed or discarded: it serves no run


class OneRun(ABC):
    """A prepared sandbox that serves one ``run`` or one ``converse``.

    A backend's prepared sandbox subclasses it with ``_start_ahead`` (start the tool and
    leave it waiting on stdin, blocking), ``_opening_pipe`` (the started tool's pipes, as
    an opening speaks through them) and ``_exchange`` (the run itself).
    """

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._stage = Stage.PREPARED
        self._opened: Opened | None = None  # PRIMED: what the opening left for the dialogue
        self._events: EventSink | None = None  # where the run's events go (``stream_events``)

    @property
    def stage(self) -> Stage:
        return self._stage

    async def run(self, payload: bytes) -> SandboxOutcome:
        """Feed ``payload`` on stdin and wait for the outcome under the limits.

        Raises:
            SandboxUnavailable: the tool could not be started in the required isolation,
                the sandbox is primed (it holds a dialogue), or it served its run already.
        """
        if self._stage is Stage.PRIMED:
            raise SandboxUnavailable("a primed sandbox holds a dialogue, not a payload")
        exchange = PayloadExchange(payload, self._limits.max_output_bytes, self._events)
        outcome = await self._hold(exchange, self._begin_run())
        exchange.stderr.close()  # a last event line that lacks its newline
        return outcome

    def stream_events(self, sink: EventSink) -> None:
        """Send the events of the coming ``run`` to ``sink`` (``StreamsEvents``)."""
        self._events = sink

    async def converse(self, dialogue: Dialogue) -> SandboxOutcome:
        """Hold ``dialogue`` with the tool under the limits (``Converses.converse``).

        Raises:
            SandboxUnavailable: as ``run``.
            Exception: what the dialogue's ``talk`` raised (a bug of the dialogue), once
                the tool is dead.
        """
        exchange = DialogueExchange(dialogue, self._limits.max_output_bytes, self._opened)
        outcome = await self._hold(exchange, self._begin_run())
        exchange.raise_failure()
        return outcome

    def _begin_run(self) -> Stage:
        """Mark the one run begun; the stage it begins from.

        Raises:
            SandboxUnavailable: the sandbox has served its run already, or is closed.
        """
        stage = self._stage
        if stage in (Stage.RAN, Stage.CLOSED):
            raise SandboxUnavailable(f"a prepared sandbox serves one run; this one is {stage.value}")
        self._stage = Stage.RAN
        return stage

    # -- started ahead of the call (warm pools) ------------------------------------------

    def start_waiting(self) -> None:
        """Start the tool now, waiting on stdin for the payload ``run`` writes (blocking:
        the pool's thread).

        Raises:
            SandboxUnavailable: the tool could not be started.
        """
        self._start_ahead()
        self._stage = Stage.WAITING

    def prime(self, opening: Opening, timeout_s: float) -> None:
        """Hold ``opening`` with the tool started ahead (blocking: the pool's thread).

        Raises:
            OpeningFailed: as ``Primes.prime`` says; the caller discards this sandbox.
        """
        if self._stage is not Stage.WAITING:
            raise OpeningFailed("only a sandbox started ahead, and not primed yet, can be primed")
        self._opened = prime_with(opening, self._opening_pipe(timeout_s))
        self._stage = Stage.PRIMED

    def set_timeout(self, timeout_ms: int) -> None:
        self._limits = dataclasses.replace(self._limits, timeout_ms=timeout_ms)

    @abstractmethod
    def _start_ahead(self) -> None:
        """Start the tool, left waiting on stdin (blocking)."""

    @abstractmethod
    def _opening_pipe(self, timeout_s: float) -> PrimingPipe:
        """The started tool's stdin and stdout, as an ``Opening`` speaks through them."""

    @abstractmethod
    async def _hold(self, exchange: Exchange, begun_at: Stage) -> SandboxOutcome:
        """Start the tool unless ``begun_at`` says it was started ahead, and let
        ``exchange`` speak with it until the run ends.

        Raises:
            SandboxUnavailable: the tool could not be started, or its sandbox was lost.
        """
