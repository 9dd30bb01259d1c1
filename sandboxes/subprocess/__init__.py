"""The hardened ``subprocess`` backend (bubblewrap + cgroups)."""

from sandboxes.subprocess.sandbox import PreparedSubprocess, SubprocessConfig, SubprocessSandbox, create

__all__ = ["PreparedSubprocess", "SubprocessConfig", "SubprocessSandbox", "create"]
