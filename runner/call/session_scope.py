"""Which session a call is made in, and ``Session``: a session of the Python API.

The session travels with the call as context (``CURRENT``), as the audit's client does:
a call made inside ``Session.acall`` (or ``runner serve``'s handler of an MCP session)
finds it when its sandbox is chosen, and every audit event of the call carries its
``sessionId``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Protocol

from runner.audit.log import AUDIT_SESSION
from runner.call.answers import AnswerMetadata, CallResult, ErrorInfo
from runner.call.sessions import CURRENT, NOTE, CallSession, SessionNote


@contextmanager
def in_session(session: CallSession) -> Iterator[SessionNote]:
    """Make the calls of this context ones of ``session``; what they learn is noted."""
    note = SessionNote()
    tokens = (CURRENT.set(session), NOTE.set(note), AUDIT_SESSION.set(session.id))
    try:
        yield note
    finally:
        CURRENT.reset(tokens[0])
        NOTE.reset(tokens[1])
        AUDIT_SESSION.reset(tokens[2])


@contextmanager
def no_session() -> Iterator[SessionNote]:
    """What ``Session.calls`` gives, for calls made in no session: a note nothing writes."""
    yield SessionNote()


def restarted_result(result: CallResult) -> CallResult:
    """``result`` saying that its session sandbox was opened anew (``sessionRestarted``)."""
    meta = result.metadata
    metadata = AnswerMetadata(
        meta.duration,
        meta.attempts,
        meta.tool_name,
        meta.timestamp,
        meta.request_id,
        meta.trace_id,
        {**meta.extra, "sessionRestarted": True},
    )
    error = result.error
    if error is not None:
        error = ErrorInfo(
            error.code, error.message, {**error.details, "sessionRestarted": True}, error.retryable
        )
    return CallResult(result.success, result.result, error, metadata)


def restarted_wire(answer: dict[str, Any]) -> dict[str, Any]:
    """``restarted_result`` for a wire answer."""
    answer["metadata"]["sessionRestarted"] = True
    if answer.get("error") is not None:
        answer["error"]["details"]["sessionRestarted"] = True
    return answer


class Calls(Protocol):
    async def acall(
        self, tool_name: str, params: Mapping[str, Any] | None = None, **options: Any
    ) -> CallResult: ...


class Session:
    """A session of the Python API: ``async with runner.session() as s: await s.acall(...)``.

    Calls of session tools made through it share one sandbox per tool, kept until the
    session ends (or expires, or a call breaks a limit); other tools' calls run as always.
    """

    def __init__(self, runner: Calls, session: CallSession) -> None:
        self._runner = runner
        self._session = session

    @property
    def id(self) -> str:
        """The session's id: ``sessionId`` in the audit trail."""
        return self._session.id

    async def __aenter__(self) -> Session:
        return self.start()

    def start(self) -> Session:
        """Register the session with its runner (``async with`` does it); the caller closes it."""
        self._session.start()
        return self

    @contextmanager
    def calls(self) -> Iterator[SessionNote]:
        """Make the calls of this context ones of this session (``runner serve``'s handler).

        Raises:
            RuntimeError: the session is closed.
        """
        if self._session.closed:
            raise RuntimeError("this session is closed")
        with in_session(self._session) as note:
            yield note

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def acall(
        self, tool_name: str, params: Mapping[str, Any] | None = None, **options: Any
    ) -> CallResult:
        """``Runner.acall`` in this session; ``metadata.sessionRestarted`` is true when the
        tool's session sandbox had ended (its state is gone) and was opened anew.

        Raises:
            RuntimeError: the session (or the runner) is closed.
            asyncio.CancelledError: as ``Runner.acall``.
        """
        with self.calls() as note:
            result = await self._runner.acall(tool_name, params, **options)
        return restarted_result(result) if note.restarted else result

    async def aclose(self) -> None:
        """End the session: its sandboxes are killed and released. Safe to call twice."""
        await self._session.aclose()
