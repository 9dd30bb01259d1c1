"""A folder to put a runner's state folder in, for tests whose calls run from it."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest


def passable_folder(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """``tmp_path`` without root; as root a folder under ``/run``, removed after the test:
    the sandbox's uid must pass every folder above a state folder, and pytest's are
    ``0700``."""
    if os.geteuid() != 0:
        return tmp_path
    home = Path("/run") / f"runner-test-state-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    home.mkdir(mode=0o755)
    home.chmod(0o755)  # whatever the umask
    request.addfinalizer(lambda: shutil.rmtree(home, ignore_errors=True))
    return home
