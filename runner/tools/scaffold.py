"""``runner new``: a tool folder that validates and answers its sample params at once.

A Python tool gets ``main.py``, which imports the tool-side helper ``runner_tool``: every
sandbox shows it on the tool's ``PYTHONPATH`` (``sandboxes.view``), so nothing is copied; a
shell tool gets ``main.sh``, which needs nothing but the contract.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")
LANGUAGES = ("python", "sh")
SAMPLE_FILE = "sample.json"
IMAGES = {"python": "runner/python-tools:latest", "sh": "runner/base:latest"}
# In every scaffolded description until its author writes a real one (runner validate warns:
# the description is what a model reads to choose the tool).
PLACEHOLDER = "(scaffolded by runner new; describe what it does)"

_PYTHON_MANIFEST = """\
name: {name}
description: Greet someone by name {placeholder}
version: "0.1.0"
tags: [read]                   # the starter policy lets role user call tag:read tools
command: ["python3", "main.py"]
{sandbox}parameters:
  type: object
  properties:
    name: {{type: string, minLength: 1, maxLength: 100}}
  required: [name]
  additionalProperties: false
output_schema:
  type: object
  properties:
    greeting: {{type: string}}
    attempt: {{type: integer}}
  required: [greeting]
limits:
  timeout_ms: 2000
"""

_PYTHON_MAIN = '''\
"""{name}: reads {{"params", "context"}} on stdin, prints one JSON result."""

from runner_tool import ToolError, log, progress, run, text


def main(params, context):
    name = params["name"].strip()
    if not name:
        # A failure on purpose: {{"error": {{...}}}} on stdout, exit status 1.
        raise ToolError("name is blank", code="BLANK_NAME", details={{"given": params["name"]}})
    # Events reach the caller while the tool runs: progress, log lines (MCP levels) and
    # content blocks attached to the answer (text, image, audio, resource).
    progress(0, 1, "greeting")
    log("info", {{"greeting": name}})
    text(f"Hello, {{name}}!")
    progress(1, 1)
    return {{"greeting": f"Hello, {{name}}!", "attempt": context.get("attempt", 1)}}


if __name__ == "__main__":
    run(main)
'''

_SH_MANIFEST = """\
name: {name}
description: Report the size of its request {placeholder}
version: "0.1.0"
tags: [read]                   # the starter policy lets role user call tag:read tools
command: ["sh", "main.sh"]
{sandbox}parameters:
  type: object
  properties:
    text: {{type: string, maxLength: 10000}}
  additionalProperties: false
output_schema:
  type: object
  properties:
    tool: {{type: string}}
    request_bytes: {{type: integer}}
  required: [tool, request_bytes]
limits:
  timeout_ms: 2000
"""

_SH_MAIN = """\
#!/bin/sh
# {name}: one JSON request on stdin, one JSON document on stdout, exit 0.
# To fail on purpose: print {{"error": {{"message": "..."}}}} and exit 1.
set -eu
request=$(cat)
printf '{{"tool": "%s", "request_bytes": %d}}\\n' "$TOOL_NAME" "${{#request}}"
"""

_SAMPLES = {"python": {"name": "world"}, "sh": {"text": "hello"}}


class ScaffoldError(ValueError):
    """The tool cannot be scaffolded (bad name or language, folder already there)."""


@dataclass(frozen=True)
class Scaffold:
    """What ``new_tool`` wrote."""

    folder: Path
    written: tuple[Path, ...]
    sample: Path


def new_tool(tools_dir: Path, name: str, *, lang: str = "python", docker: bool = False) -> Scaffold:
    """Write ``tools_dir/name/``: ``tool.yaml``, the program and ``sample.json``.

    Raises:
        ScaffoldError: the name or language is not valid, or the folder exists.
        OSError: the folder cannot be written.
    """
    if not NAME.fullmatch(name):
        raise ScaffoldError(f"tool name {name!r} must match [a-z][a-z0-9_-]{{0,63}}")
    if lang not in LANGUAGES:
        raise ScaffoldError(f"language {lang!r} is not one of {', '.join(LANGUAGES)}")
    folder = tools_dir / name
    if folder.exists():
        raise ScaffoldError(f"{folder} already exists")
    sandbox = f"sandbox: docker\nimage: {IMAGES[lang]}\n" if docker else "sandbox: subprocess\n"
    files: dict[str, str]
    if lang == "python":
        files = {
            "tool.yaml": _PYTHON_MANIFEST.format(name=name, sandbox=sandbox, placeholder=PLACEHOLDER),
            "main.py": _PYTHON_MAIN.format(name=name),
        }
    else:
        files = {
            "tool.yaml": _SH_MANIFEST.format(name=name, sandbox=sandbox, placeholder=PLACEHOLDER),
            "main.sh": _SH_MAIN.format(name=name),
        }
    files[SAMPLE_FILE] = json.dumps(_SAMPLES[lang], indent=2) + "\n"
    folder.mkdir(parents=True)
    folder.chmod(0o755)  # whatever the umask: the sandbox's user reads the tool
    written = []
    for filename, text in files.items():
        path = folder / filename
        path.write_text(text, encoding="utf-8")
        path.chmod(0o644)
        written.append(path)
    return Scaffold(folder, tuple(written), folder / SAMPLE_FILE)
