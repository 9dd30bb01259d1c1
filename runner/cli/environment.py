"""The environment each command reads, written under its ``--help``.

One table for every command, so that a command added later gets its paragraph by naming
the variables it reads here rather than by copying text.
"""

from __future__ import annotations

from collections.abc import Mapping

import click

ENVIRONMENT = {
    "RUNNER_TOOLS": "tool directories, joined with ':' (what --tools gives)",
    "RUNNER_POLICIES": "the policy file (what --policies gives)",
    "RUNNER_AUDIT_LOG": "where audit events go (what --audit-log gives)",
    "XDG_CONFIG_HOME": "the policy file is searched in $XDG_CONFIG_HOME/runner/ (default ~/.config/runner/)",
    "XDG_RUNTIME_DIR": "runner serve --socket listens, and runner exec looks, in $XDG_RUNTIME_DIR/runner/ "
    "(when it is the user's own, writable by no one else; else /run/user/UID/runner/, "
    "else $TMPDIR/runner-UID/)",
    "RUNNER_SOCKET": "runner exec: the socket of runner serve --socket to send calls to",
    "NO_COLOR": "set to anything: no colour on a terminal (so does TERM=dumb)",
    "DOCKER_HOST": "the Docker daemon to use (default unix:///var/run/docker.sock)",
    "OTEL_TRACES_EXPORTER": "with the OpenTelemetry SDK: export spans (otlp, console; other OTEL_* too)",
}
_LOCATIONS = ("RUNNER_TOOLS", "RUNNER_POLICIES", "RUNNER_AUDIT_LOG", "XDG_CONFIG_HOME")
# Commands missing here read the locations: every command that loads the tools does.
READS: Mapping[str, tuple[str, ...]] = {
    "init": (),
    "new": ("RUNNER_TOOLS", "RUNNER_POLICIES", "XDG_CONFIG_HOME"),
    "list": (*_LOCATIONS, "NO_COLOR"),
    "show": (*_LOCATIONS, "NO_COLOR"),
    "exec": (*_LOCATIONS, "NO_COLOR", "XDG_RUNTIME_DIR", "RUNNER_SOCKET"),
    "doctor": ("RUNNER_POLICIES", "XDG_CONFIG_HOME", "NO_COLOR", "DOCKER_HOST"),
    "audit": ("RUNNER_POLICIES", "RUNNER_AUDIT_LOG", "XDG_CONFIG_HOME", "NO_COLOR"),
    "verify": ("RUNNER_POLICIES", "RUNNER_AUDIT_LOG", "XDG_CONFIG_HOME", "NO_COLOR"),  # audit verify
    "report": ("RUNNER_POLICIES", "RUNNER_AUDIT_LOG", "XDG_CONFIG_HOME", "NO_COLOR"),  # audit report
    "images": ("DOCKER_HOST",),
    "build": ("DOCKER_HOST",),
    "serve": (*_LOCATIONS, "OTEL_TRACES_EXPORTER", "XDG_RUNTIME_DIR"),
}


def environment_epilog(names: tuple[str, ...]) -> str:
    """The ``Environment:`` paragraph, one variable a line (``\\b`` keeps click from rewrapping)."""
    if not names:
        return "Environment: reads no variables of its own."
    width = max(17, *(len(name) for name in names))
    lines = [f"  {name:<{width}} {ENVIRONMENT[name]}" for name in names]
    return "\b\nEnvironment:\n" + "\n".join(lines)


def document_environment(group: click.Group) -> None:
    """Give every command of ``group`` (and of its subgroups) its ``Environment:`` paragraph."""
    for name, command in group.commands.items():
        command.epilog = environment_epilog(READS.get(name, _LOCATIONS))
        if isinstance(command, click.Group):
            document_environment(command)
