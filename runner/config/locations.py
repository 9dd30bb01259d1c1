"""Where the policy file and the tools are.

A flag (or an argument of ``Runner.load``) wins, then ``RUNNER_POLICIES``/``RUNNER_TOOLS``,
then the search: ``./policies.yaml``, ``$XDG_CONFIG_HOME/runner/`` (default
``~/.config/runner/``), ``/etc/runner/``. Tools default to ``tools/`` beside the policy file.
A policy file the search finds is used only when it, its folder and the ``tools/`` beside
it are this user's or root's and not writable by every user (``untrusted``); otherwise the
search goes on past it, with a warning: a folder another user controls (``/tmp``, their
checkout) must not configure this user's runner, least of all root's. Naming a file (a
flag, a variable) is the way to use one anyway.

The example tools, the starter policy and the image build contexts ship inside the
package (``runner/_bundled/``, copied there when the wheel is built); ``examples_dir``
finds them, or the repository's own copies when running from a source checkout.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

POLICY_FILE = "policies.yaml"
TOOLS_DIR = "tools"
SYSTEM_DIR = Path("/etc/runner")
_PACKAGE = Path(__file__).resolve().parents[1]  # runner/, where _bundled/ is


def search_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """The folders searched for ``policies.yaml``, in order."""
    env = os.environ if env is None else env
    config_home = env.get("XDG_CONFIG_HOME") or ""
    # The XDG rule: a relative value is invalid and ignored.
    base = Path(config_home) if Path(config_home).is_absolute() else Path.home() / ".config"
    return [Path.cwd(), base / "runner", SYSTEM_DIR]


def find_policy(explicit: str | Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The policy file to load: ``explicit``, else ``RUNNER_POLICIES``, else the search
    (which skips, with a warning on stderr, a file another user could have put there).

    Raises:
        ConfigError: none was given and the search found none.
    """
    given = _given(explicit, env)
    if given is not None:
        return given
    found, skipped = _search(env)
    for why in skipped:
        sys.stderr.write(f"runner: warning: {why}\n")
    if found is not None:
        return found
    # Imported here alone: runner exec's fast path reads this module, and runner.errors
    # brings in dataclasses and inspect, the costliest imports that path would have.
    from runner.errors import ConfigError

    looked = ", ".join(f"{folder}/" for folder in search_dirs(env))
    raise ConfigError(
        POLICY_FILE,
        f"not found (looked in {looked}); run 'runner init' to write a starter policy and "
        "example tools here, or pass --policies",
    )


def found_policy(explicit: str | Path | None = None, env: Mapping[str, str] | None = None) -> Path | None:
    """``find_policy``'s answer, None where it raises (and no warning)."""
    given = _given(explicit, env)
    return given if given is not None else _search(env)[0]


def _given(explicit: str | Path | None, env: Mapping[str, str] | None) -> Path | None:
    given = explicit or (os.environ if env is None else env).get("RUNNER_POLICIES")
    return Path(given) if given else None


def _search(env: Mapping[str, str] | None) -> tuple[Path | None, list[str]]:
    """The first policy file of the search that may be used (``untrusted``: it, its folder
    and the ``tools/`` beside it), and why each one found before it may not."""
    skipped: list[str] = []
    for folder in search_dirs(env):
        candidate = folder / POLICY_FILE
        if not candidate.is_file():
            continue
        why = untrusted(candidate) or untrusted(folder) or untrusted(folder / TOOLS_DIR)
        if why is None:
            return candidate, skipped
        skipped.append(f"{candidate} skipped: {why}, so another user could have put it there")
    return None, skipped


def untrusted(path: Path) -> str | None:
    """Why ``path`` (found, not named) is not to be used: it is another user's than this
    one's and root's, or every user may write to it (a folder: and is not sticky)."""
    try:
        info = path.stat()
    except OSError:
        return None  # nothing there: nothing planted
    if info.st_uid not in (os.getuid(), 0):
        return f"{path} belongs to uid {info.st_uid}"
    if info.st_mode & stat.S_IWOTH and not (stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX):
        return f"{path} is writable by every user"
    return None


def tool_dirs(
    explicit: str | Path | Iterable[str | Path] | None, policy: Path, env: Mapping[str, str] | None = None
) -> list[Path]:
    """The tool directories: ``explicit``, else ``RUNNER_TOOLS`` (``:``-joined), else ``tools/``
    beside the policy file."""
    env = os.environ if env is None else env
    value = explicit if explicit is not None else env.get("RUNNER_TOOLS")
    if not value:
        return [policy.parent / TOOLS_DIR]
    if isinstance(value, str):
        return [Path(part) for part in value.split(":") if part]
    if isinstance(value, Path):
        return [value]
    return [Path(part) for part in value]


def examples_dir() -> Path:
    """The shipped starter policy (``policies.yaml``), example tools (``tools/``) and image
    build contexts (``tool_images/``). Read-only: ``runner init`` copies them to use them.

    Raises:
        FileNotFoundError: the installation lacks them (a broken build).
    """
    bundled = _PACKAGE / "_bundled"
    if (bundled / POLICY_FILE).is_file():
        return bundled
    checkout = _PACKAGE.parent  # a source checkout (editable install or the repository itself)
    if (checkout / "pyproject.toml").is_file() and (checkout / POLICY_FILE).is_file():
        return checkout
    raise FileNotFoundError(f"the runner's bundled examples are missing from {bundled}")
