"""What a tool sees from inside, whatever the backend: one definition for all of them.

A tool written against this view runs unchanged in the subprocess sandbox, in a
container and in a plugin's backend: its folder read-only at ``/tool`` (the working
directory), a private scratch ``/tmp`` (``HOME`` and ``TMPDIR``), ``/workspace`` when
granted, the tool-side Python helper ``runner_tool`` read-only at ``/opt/runner/python``
(on ``PYTHONPATH``), the user ``nobody`` (65534) as it appears inside, and exactly the
environment ``tool_env`` builds.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from sandboxes.base import LaunchSpec

TOOL_MOUNT = "/tool"
SCRATCH_MOUNT = "/tmp"  # noqa: S108 - the sandbox's own private scratch, never the host's
WORKSPACE_MOUNT = "/workspace"
INSIDE_UID = 65534  # "nobody", as the tool sees itself (its host uid is its own)
# Not under /usr: the subprocess sandbox binds the host's /usr, where bubblewrap could not
# make the mount point; /opt is its own in every backend.
LIBRARY_MOUNT = "/opt/runner/python"
# What LIBRARY_MOUNT shows: a folder holding only the helper (stdlib-only, no secrets).
LIBRARY_SOURCE = Path(__file__).resolve().parent / "tool_python"
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
DEFAULT_LANG = "C.UTF-8"

# How the backends read a tool's output: in chunks of READ_CHUNK, keeping the last
# STDERR_TAIL_BYTES of stderr (the runner shows at most the last 2000 characters).
READ_CHUNK = 64 * 1024
STDERR_TAIL_BYTES = 8 * 1024


def tool_env(
    spec: LaunchSpec,
    home: str = SCRATCH_MOUNT,
    workspace: str | None = None,
    library: str = LIBRARY_MOUNT,
) -> dict[str, str]:
    """The tool's environment but its secrets: the contract's minimal set and the manifest's env.

    ``spec.secrets`` are added by each backend in a way that keeps them out of sight of
    anyone but the tool (the subprocess backend: bubblewrap's arguments through a sealed
    descriptor; docker: on the gate's stdin, never in the container's config).

    ``home``, ``workspace`` and ``library`` are where the backend put the scratch, the
    workspace and the helper; all are the mounts above except in a degraded run, which
    has no mount namespace. The helper comes after a manifest's own ``PYTHONPATH``.
    """
    env = {"PATH": DEFAULT_PATH, "LANG": DEFAULT_LANG, **spec.env, "HOME": home, "TMPDIR": home}
    env["PYTHONPATH"] = ":".join(part for part in (spec.env.get("PYTHONPATH"), library) if part)
    if workspace is not None:
        env["WORKSPACE"] = workspace
    return env


def search_path(env: Mapping[str, str]) -> list[str]:
    """The folders the sandbox searches for a bare command name, in order: the ``PATH``
    of the tool's manifest ``env``, else ``DEFAULT_PATH``."""
    return [part for part in env.get("PATH", DEFAULT_PATH).split(":") if part.startswith("/")]
