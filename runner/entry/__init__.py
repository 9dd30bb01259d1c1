"""The ``runner`` command's entry point: ``runner exec`` through a local server, when one
serves the same tools, else the full command line.

Standard library only until it falls through: the forwarding path must not pay for click,
pydantic and the rest (``runner.entry.forward``).
"""

from __future__ import annotations

import sys


def main() -> None:
    """Run ``runner`` with ``sys.argv``."""
    args = sys.argv[1:]
    if args[:1] == ["exec"]:
        from runner.entry.forward import forward

        forward(args[1:])  # returns only when the call is to run here
    from runner.cli import main as cli_main

    cli_main()
