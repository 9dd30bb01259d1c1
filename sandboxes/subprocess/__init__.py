"""The hardened ``subprocess`` backend (bubblewrap + cgroups).

Its names load on first use, so that the runner's watchdog, which needs only the cgroup
code, starts in milliseconds.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # not typing's: see sandboxes/__init__.py
if TYPE_CHECKING:
    from sandboxes.subprocess.sandbox import PreparedSubprocess, SubprocessConfig, SubprocessSandbox, create

__all__ = ["PreparedSubprocess", "SubprocessConfig", "SubprocessSandbox", "create"]


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(importlib.import_module("sandboxes.subprocess.sandbox"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
