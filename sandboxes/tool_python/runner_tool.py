"""The tool side of the runner's contract for Python tools: standard library only.

Every sandbox shows this folder read-only at ``/opt/runner/python`` and puts it on the
tool's ``PYTHONPATH`` (``sandboxes.view``), so ``import runner_tool`` works in every
backend without a copy in the tool's folder. A tool is then a function::

    from runner_tool import ToolError, run

    def main(params, context):
        if params["city"] not in TABLE:
            raise ToolError(f"no data for {params['city']!r}", code="NOT_FOUND")
        return TABLE[params["city"]]

    if __name__ == "__main__":
        run(main)

``run`` reads the request from stdin, calls the function with ``params`` and ``context``
(``requestId``, ``toolName``, ``attempt``) and prints its result as JSON (exit 0). A
``ToolError`` prints the error document ``{"error": {"message", "code", "retryable",
"details"}}`` on stdout and exits 1; any other exception is a bug of the tool's, the same on
every try: its last traceback line becomes the error message (not retried), and that line
with where it was raised goes to stderr; exit 1.

While it runs, a tool may tell more than its result (each call writes one event line on
stderr, which the runner takes out of the stderr text): ``progress(done, total=None,
message=None)``; ``log(level, data)`` at an MCP level (``debug`` ... ``emergency``); and
content blocks attached to the answer, after the result: ``text(str)``, ``image(bytes,
mime_type)``, ``audio(bytes, mime_type)``, ``resource(uri, *, text=None, blob=None,
mime_type=None)``. Images are ``image/png``, ``image/jpeg``, ``image/gif`` or
``image/webp``; audio ``audio/wav``, ``audio/mpeg``, ``audio/ogg`` or ``audio/webm``.
Events count toward the tool's ``max_output_bytes``; what does not fit is dropped.

``run(main, fast_exit=True)`` ends the process, once the answer is out, without Python's
own shutdown (tearing down every module and object: 2-3 ms, a third of a warm call), when
that shutdown has nothing left to do that the helper can see: no thread but the main one
and, once the ``atexit`` callbacks have run (the helper runs them), no file descriptor
open but stdin, stdout and stderr, still the ones the process started with. Otherwise it
exits the ordinary way. What it cannot see, and skips: ``__del__`` of objects still
alive, data held by a second wrapper around stdout or stderr, C-level exit work (libc
buffers, C ``atexit`` handlers of an extension), and code around ``run`` (no
``SystemExit`` is raised, so an enclosing ``finally`` does not run). Opt in only for a
tool of which none of that is true.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

# pathlib and traceback load on use: every call of a tool pays for what it imports.
if TYPE_CHECKING:
    from pathlib import Path

__all__ = [
    "ToolError",
    "audio",
    "image",
    "log",
    "progress",
    "resource",
    "run",
    "text",
    "workspace_path",
]

EXIT_OK, EXIT_FAILED = 0, 1
EVENT_MARK = "\x1e"  # U+001E: the line is an event, not stderr text
MEDIA_PIECE = 3 * 64 * 1024  # a multiple of 3: the pieces' base64 joins up without padding
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")


def _identity(fd: int) -> tuple[int, int] | None:
    """What ``fd`` is open on; None when it is not open."""
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_dev, info.st_ino


# What 0, 1 and 2 are at start: a tool that closed one and opened a file in its place
# holds a file, which only the ordinary shutdown may close.
_STANDARD_FDS = {fd: _identity(fd) for fd in (0, 1, 2)}
Handler = Callable[[dict[str, Any], dict[str, Any]], Any]


class ToolError(Exception):
    """A failure the tool reports on purpose (unknown city, file not found)."""

    def __init__(
        self,
        message: str,
        code: str | None = None,
        retryable: bool = False,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.retryable = retryable
        self.details = dict(details) if details is not None else None

    def document(self) -> dict[str, Any]:
        """The error document (``code`` and ``details`` only when given)."""
        error: dict[str, Any] = {"message": self.message}
        if self.code is not None:
            error["code"] = self.code
        error["retryable"] = self.retryable
        if self.details is not None:
            error["details"] = self.details
        return {"error": error}


def workspace_path(relative: str) -> Path:
    """The path of ``relative`` inside the granted workspace (``$WORKSPACE``).

    Raises:
        ToolError: no workspace is granted, or the path leaves it (absolute, ``..``, a
            symlink pointing out) or is the workspace itself.
    """
    root_text = os.environ.get("WORKSPACE")
    if not root_text:
        raise ToolError(
            "this tool has no workspace (set workspace: read|write in tool.yaml)", code="NO_WORKSPACE"
        )
    from pathlib import Path

    root = Path(root_text).resolve()
    target = (root / relative).resolve()
    if Path(relative).is_absolute() or not target.is_relative_to(root) or target == root:
        raise ToolError(f"path {relative!r} is outside the workspace", code="OUTSIDE_WORKSPACE")
    return target


def _event(event: dict[str, Any]) -> None:
    line = json.dumps(event, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    sys.stderr.write(f"{EVENT_MARK}{line}\n")
    sys.stderr.flush()


def progress(done: float, total: float | None = None, message: str | None = None) -> None:
    """Report progress: ``done`` (of ``total``, when known), with an optional message.

    Raises:
        ValueError: a number is not finite.
    """
    event: dict[str, Any] = {"progress": done}
    if total is not None:
        event["total"] = total
    if message is not None:
        event["message"] = message
    _event(event)


def log(level: str, data: Any) -> None:
    """A log message (any JSON value) at an MCP level, ``debug`` to ``emergency``.

    Raises:
        ValueError: an unknown level, or ``data`` is not JSON.
    """
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}")
    _event({"log": level, "data": data})


def text(value: str) -> None:
    """Attach a text block to the answer."""
    _event({"content": {"type": "text", "text": value}})


def _base64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode("ascii")


def _media(kind: str, data: bytes, mime_type: str) -> None:
    """An image or audio block, its base64 written piece by piece: a large one is never
    held twice over in the tool's memory."""
    import base64

    head = json.dumps({"type": kind, "mimeType": mime_type}, ensure_ascii=False)[:-1]
    sys.stderr.write(f'{EVENT_MARK}{{"content":{head},"data":"')
    view = memoryview(data)
    for start in range(0, len(view), MEDIA_PIECE):
        sys.stderr.write(base64.b64encode(view[start : start + MEDIA_PIECE]).decode("ascii"))
    sys.stderr.write('"}}\n')
    sys.stderr.flush()


def image(data: bytes, mime_type: str) -> None:
    """Attach an image (``image/png``, ``image/jpeg``, ``image/gif``, ``image/webp``)."""
    _media("image", data, mime_type)


def audio(data: bytes, mime_type: str) -> None:
    """Attach audio (``audio/wav``, ``audio/mpeg``, ``audio/ogg``, ``audio/webm``)."""
    _media("audio", data, mime_type)


def resource(
    uri: str, *, text: str | None = None, blob: bytes | None = None, mime_type: str | None = None
) -> None:
    """Attach a resource: its ``uri`` and either its ``text`` or its bytes (``blob``).

    Raises:
        ValueError: neither or both of ``text`` and ``blob``.
    """
    if (text is None) == (blob is None):
        raise ValueError("a resource has either text or blob")
    body: dict[str, Any] = {"uri": uri}
    if mime_type is not None:
        body["mimeType"] = mime_type
    if text is not None:
        body["text"] = text
    elif blob is not None:
        body["blob"] = _base64(blob)
    _event({"content": {"type": "resource", "resource": body}})


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()
    sys.exit(EXIT_FAILED)


def _exit(code: int, fast: bool) -> NoReturn:
    """End the process with ``code``; ``fast``: without Python's shutdown when it has no
    work left (see the module's text)."""
    if fast and _flushed() and _nothing_left_to_shut_down() and _flushed():
        os._exit(code)
    sys.exit(code)


def _flushed() -> bool:
    try:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):  # the shutdown reports it as it always does
        return False
    return True


def _nothing_left_to_shut_down() -> bool:
    """Do what Python's shutdown does first (wait for other threads: here, none may run;
    then the ``atexit`` callbacks, run here and cleared), and say whether what would be
    left is only freeing memory: no descriptor open but 0, 1 and 2, since a file object
    with unwritten data holds one. Anything unsure says False."""
    threading = sys.modules.get("threading")
    if threading is not None and threading.active_count() > 1:
        return False
    import atexit

    run_callbacks = getattr(atexit, "_run_exitfuncs", None)
    clear_callbacks = getattr(atexit, "_clear", None)
    if run_callbacks is None or clear_callbacks is None:
        return False
    run_callbacks()
    clear_callbacks()  # run once, even if the ordinary shutdown follows after all
    try:
        listed = [int(name) for name in os.listdir("/proc/self/fd")]  # noqa: PTH208 - no pathlib import
    except (OSError, ValueError):
        return False
    # The listing's own descriptor is in it, and closed by now.
    if any(_identity(fd) is not None for fd in listed if fd > 2):
        return False
    return all(_identity(fd) == known for fd, known in _STANDARD_FDS.items())


def _print(document: object) -> None:
    # No newline after it: a caller asking for ``format: raw`` gets exactly the document.
    sys.stdout.write(json.dumps(document, ensure_ascii=False, allow_nan=False))
    sys.stdout.flush()


def _where(exc: BaseException) -> str:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {os.path.basename(last.filename)}:{last.lineno})"  # noqa: PTH119 - no pathlib import


def _crashed(exc: Exception, fast_exit: bool) -> NoReturn:
    """An uncaught exception: its last traceback line as a tool error (not retried) on
    stdout, and that line with where it was raised on stderr for the operator."""
    try:
        text = str(exc)
    except Exception:  # an exception whose __str__ fails is still an exception of its type
        text = ""
    last_line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    sys.stderr.write(f"{last_line}{_where(exc)}\n")
    sys.stderr.flush()
    details = {"exception": type(exc).__name__}
    _print({"error": {"message": last_line, "retryable": False, "details": details}})
    _exit(EXIT_FAILED, fast_exit)


def _read_request() -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        request = json.loads(sys.stdin.read())
    except (ValueError, RecursionError) as exc:
        _fail(f"runner_tool: the request on stdin is not JSON: {exc}")
    if not isinstance(request, dict):
        _fail("runner_tool: the request on stdin is not a JSON object")
    params = request.get("params", {})
    context = request.get("context", {})
    if not isinstance(params, dict) or not isinstance(context, dict):
        _fail("runner_tool: the request's params and context must be JSON objects")
    return params, context


def run(handler: Handler, *, fast_exit: bool = False) -> NoReturn:
    """Answer one request with ``handler(params, context)`` and exit (0 success, 1 failure);
    ``fast_exit``: skip Python's shutdown when it can (see the module's text)."""
    params, context = _read_request()
    try:
        result = handler(params, context)
    except ToolError as exc:
        try:
            _print(exc.document())
        except (TypeError, ValueError) as bad:
            _fail(f"runner_tool: ToolError details are not JSON: {bad}")
        _exit(EXIT_FAILED, fast_exit)
    except Exception as exc:  # a bug in the tool: the same every time, so not worth a retry
        _crashed(exc, fast_exit)
    try:
        _print(result)
    except (TypeError, ValueError) as exc:
        _fail(f"runner_tool: the result is not JSON: {exc}")
    _exit(EXIT_OK, fast_exit)
