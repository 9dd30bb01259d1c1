"""What a tool sees from inside, whatever the backend: one definition for all of them.

A tool written against this view runs unchanged in the subprocess sandbox, in a
container and in a plugin's backend: its folder read-only at ``/tool`` (the working
directory), a private scratch ``/tmp`` (``HOME`` and ``TMPDIR``), ``/workspace`` when
granted, the user ``nobody`` (65534) as it appears inside, and exactly the environment
``tool_env`` builds.
"""

from __future__ import annotations

from sandboxes.base import LaunchSpec

TOOL_MOUNT = "/tool"
SCRATCH_MOUNT = "/tmp"  # noqa: S108 - the sandbox's own private scratch, never the host's
WORKSPACE_MOUNT = "/workspace"
INSIDE_UID = 65534  # "nobody", as the tool sees itself (its host uid is its own)
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
DEFAULT_LANG = "C.UTF-8"

# How the backends read a tool's output: in chunks of READ_CHUNK, keeping the last
# STDERR_TAIL_BYTES of stderr (the runner shows at most the last 2000 characters).
READ_CHUNK = 64 * 1024
STDERR_TAIL_BYTES = 8 * 1024


def tool_env(spec: LaunchSpec, home: str = SCRATCH_MOUNT, workspace: str | None = None) -> dict[str, str]:
    """The tool's environment but its secrets: the SPEC's minimal set and the manifest's env.

    ``spec.secrets`` are added by each backend in a way that keeps them out of sight of
    anyone but the tool (the subprocess backend: bubblewrap's arguments through a sealed
    descriptor; docker: on the gate's stdin, never in the container's config).

    ``home`` and ``workspace`` are where the backend put the scratch and the workspace;
    both are the mounts above except in a degraded run, which has no mount namespace.
    """
    env = {"PATH": DEFAULT_PATH, "LANG": DEFAULT_LANG, **spec.env, "HOME": home, "TMPDIR": home}
    if workspace is not None:
        env["WORKSPACE"] = workspace
    return env
