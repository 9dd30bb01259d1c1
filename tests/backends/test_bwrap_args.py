"""The file of bubblewrap's arguments: each ends at a NUL, so an argument holding one
would end early and what follows would be read as options of bubblewrap's own (a bind
of a host folder, the filter dropped). The manifest refuses such a value first
(``tests/tools/test_registry.py``); this is the sandbox's own refusal, for whatever
else reaches it (a secret's value)."""

from __future__ import annotations

import fcntl
import os

import pytest

from sandboxes.base import SandboxUnavailable
from sandboxes.subprocess._layout import nul_separated
from sandboxes.subprocess._seccomp import sealed_memfd


def test_arguments_are_written_each_ended_by_a_nul() -> None:
    assert nul_separated(["--setenv", "A", "x=y é"], "args") == "--setenv\0A\0x=y é\0".encode()


def test_an_argument_holding_a_nul_is_refused_not_split() -> None:
    with pytest.raises(SandboxUnavailable, match="NUL"):
        nul_separated(["--setenv", "Z", "x\0--bind\0/\0/tool"], "the sandbox's arguments")


def test_the_file_of_arguments_is_sealed_readable_never_changed() -> None:
    fd = sealed_memfd("runner-test", b"--ro-bind\0/usr\0/usr\0")
    try:
        sealed = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == sealed
        changes = (
            lambda: os.write(fd, b"--bind\0/\0/\0"),
            lambda: os.ftruncate(fd, 0),
            lambda: os.ftruncate(fd, 1 << 20),
            lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0),  # F_SEAL_SEAL: none taken off, none added
        )
        for change in changes:
            with pytest.raises(PermissionError):
                change()
        assert os.read(fd, 100) == b"--ro-bind\0/usr\0/usr\0"
    finally:
        os.close(fd)
