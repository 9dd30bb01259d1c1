"""Cutting a call's secrets out of what its tool produced, before anything else reads it.

Done on the sandbox's outcome itself, first thing after each attempt: the result, the
tool's error document, the stderr tail in error details and audit events are all made
from it, and some of them cut the text short (a message at 300 characters, a tail at
2000), which could otherwise leave half a secret standing.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

from runner.schema import strict_json
from runner.schema.redaction import Scrubber
from sandboxes import SandboxOutcome
from sandboxes.view import STDERR_TAIL_BYTES


def scrub_outcome(
    outcome: SandboxOutcome, scrubber: Scrubber, output_format: Literal["json", "raw"]
) -> SandboxOutcome:
    """``outcome`` with every secret of ``scrubber`` replaced by ``***`` in its stdout, its
    stderr tail and its message."""
    if not scrubber:
        return outcome
    tail = outcome.stderr_tail
    # A backend keeps the last STDERR_TAIL_BYTES; decoded, that is at least a quarter as
    # many characters. A shorter tail is the whole stream: its start was not cut.
    cut = len(tail) * 4 >= STDERR_TAIL_BYTES
    return dataclasses.replace(
        outcome,
        stdout=scrub_stdout(outcome.stdout, scrubber, output_format),
        stderr_tail=scrubber.scrub_cut_text(tail) if cut else scrubber.scrub_text(tail),
        message=scrubber.scrub_text(outcome.message),
    )


def scrub_stdout(stdout: bytes, scrubber: Scrubber, output_format: Literal["json", "raw"]) -> bytes:
    """Raw text, and JSON that cannot be parsed, are scrubbed as text (the JSON-escaped forms
    of a value included). A JSON document is looked at as the parser will see it: a
    backslash may spell any character (``\\u0073``) and another encoding (UTF-16) hides it
    from a text search, so unless neither can be the case, it is parsed, and when a secret
    is in it, scrubbed (keys, strings, and numbers that spell one) and written again."""
    # surrogateescape: bytes that are not UTF-8 come back out exactly as they were.
    text = stdout.decode("utf-8", errors="surrogateescape")
    scrubbed = scrubber.scrub_text(text)
    plain = b"\\" not in stdout and json.detect_encoding(stdout) == "utf-8"
    if output_format == "raw" or (plain and scrubbed == text):
        return scrubbed.encode("utf-8", errors="surrogateescape")
    try:
        document = strict_json.loads(stdout)
    except strict_json.JsonProblem:
        return scrubbed.encode("utf-8", errors="surrogateescape")
    # Every string as JSON writes it back holds each secret in its escaped form, if at all.
    canonical = json.dumps(document, ensure_ascii=False, allow_nan=False)
    if scrubber.scrub_text(canonical) == canonical:
        return stdout
    # ASCII: a lone surrogate the tool wrote as \ud800 is written back the same way.
    return json.dumps(scrubber.scrub(document, numbers=True), allow_nan=False).encode("ascii")
