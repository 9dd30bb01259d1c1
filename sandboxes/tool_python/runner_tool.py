"""The tool side of the contract (SPEC 2) for Python tools: standard library only.

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
"details"}}`` on stdout and exits 1; any other exception prints one line on stderr and
exits 1.
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

__all__ = ["ToolError", "run", "workspace_path"]

EXIT_OK, EXIT_FAILED = 0, 1
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
        """The SPEC 2 error document (``code`` and ``details`` only when given)."""
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


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()
    sys.exit(EXIT_FAILED)


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


def run(handler: Handler) -> NoReturn:
    """Answer one request with ``handler(params, context)`` and exit (0 success, 1 failure)."""
    params, context = _read_request()
    try:
        result = handler(params, context)
    except ToolError as exc:
        try:
            _print(exc.document())
        except (TypeError, ValueError) as bad:
            _fail(f"runner_tool: ToolError details are not JSON: {bad}")
        sys.exit(EXIT_FAILED)
    except Exception as exc:  # any bug in the tool becomes one line on stderr
        _fail(f"{type(exc).__name__}: {exc}{_where(exc)}")
    try:
        _print(result)
    except (TypeError, ValueError) as exc:
        _fail(f"runner_tool: the result is not JSON: {exc}")
    sys.exit(EXIT_OK)
