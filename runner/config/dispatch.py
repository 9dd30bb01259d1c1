"""The policy's ``dispatch:`` section: its model and the check of the cluster's token.

No Ray here: a policy with a ``dispatch:`` section loads (and is checked) on a host
without the extra; only a dispatched call needs Ray (``runner.dispatch``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Ray's own places for a client's token, read by Ray itself when ``token_file`` is unset.
TOKEN_VARIABLES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")
# A tool folder larger than this is refused rather than copied with every attempt.
DEFAULT_MAX_BUNDLE_BYTES = 16 * 1024 * 1024


class DispatchModel(BaseModel):
    """``dispatch:`` in the policy file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["ray"]
    # host:port of the cluster's head (its GCS); a ray:// client address is not supported.
    address: str = Field(pattern=r"^[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$")
    slots_resource: str = Field(default="runner_sandbox", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    tools: list[str] = Field(default_factory=lambda: ["*"])  # names, globs, tag:TAG
    # The cluster's token (Ray's token authentication), relative to the policy file; when
    # unset, where Ray itself looks: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token.
    token_file: str | None = None
    max_bundle_bytes: int = Field(default=DEFAULT_MAX_BUNDLE_BYTES, gt=0, le=512 * 1024 * 1024)
    # Where a node unpacks tool folders (root-owned, 0700), by content hash.
    node_cache: str = "/var/cache/runner/dispatch"
    # How long connecting to the cluster (and checking its authentication) may take.
    connect_timeout_ms: int = Field(default=10000, gt=0, le=120000)


def token_problem(model: DispatchModel, base_dir: Path) -> str | None:
    """Why this host has no token for the cluster; None when it has one (a file to read, or
    one of Ray's variables). Checked when the policy loads: no dispatch without a token."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        return "RAY_AUTH_MODE is set to something other than token: dispatch needs Ray's token authentication"
    if model.token_file is not None:
        path = token_path(model, base_dir)
        if path is None or not path.is_file():
            return f"dispatch.token_file: {model.token_file} is not a readable file"
        return None
    if any(os.environ.get(name) for name in TOKEN_VARIABLES) or DEFAULT_TOKEN_FILE.expanduser().is_file():
        return None
    return (
        "dispatch needs the cluster's token (Ray token authentication): set dispatch.token_file, "
        "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH"
    )


def token_path(model: DispatchModel, base_dir: Path) -> Path | None:
    """The configured token file as an absolute path (None when Ray's own lookup is used)."""
    if model.token_file is None:
        return None
    return base_dir / Path(model.token_file).expanduser()
