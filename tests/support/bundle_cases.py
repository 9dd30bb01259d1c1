"""Hostile tool bundles, built the same way on any interpreter (tests/dispatch/test_dispatch_bundle.py
runs them here, tests/dispatch/test_system_python.py under the system's Python as well).

Each archive comes with the content hash its tree would have, where the tree can be
hashed at all: a bundle is then refused for what it holds, not for a hash that fails.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from runner.dispatch.bundle import ToolBundle, _Entry, _TreeHash, unpack
from sandboxes import SandboxUnavailable

# name, kind, mode, link target (or content)
Member = tuple[str, str, int, str]

_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "link": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "chr": tarfile.CHRTYPE,
    "blk": tarfile.BLKTYPE,
    "fifo": tarfile.FIFOTYPE,
}

HOSTILE: dict[str, list[Member]] = {
    "absolute": [("/tmp/evil", "file", 0o644, "x")],
    "dotdot": [("../evil", "file", 0o644, "x")],
    "nested-dotdot": [("a", "dir", 0o755, ""), ("a/../../evil", "file", 0o644, "x")],
    "link-absolute": [("out", "link", 0o777, "/etc")],
    "link-out": [("out", "link", 0o777, "../../etc")],
    # Inside by the text of its target while "here" does not exist yet; out once it does.
    "link-out-through-a-later-link": [("l1", "link", 0o777, "here/../evil"), ("here", "link", 0o777, ".")],
    "link-out-through-a-link-chain": [
        ("a", "link", 0o777, "b/c/../../.."),
        ("b", "link", 0o777, "."),
    ],
    "link-loop": [("a", "link", 0o777, "b"), ("b", "link", 0o777, "a/x")],
    "write-through-a-link": [("up", "link", 0o777, "."), ("up/evil", "file", 0o644, "x")],
    "same-name-twice": [("x", "link", 0o777, "/tmp"), ("x", "dir", 0o755, "")],
    "entry-before-its-folder": [("a/x", "file", 0o644, "x"), ("a", "dir", 0o755, "")],
    "hardlink-out": [("hard", "hardlink", 0o644, "/etc/passwd")],
    "hardlink-inside": [("f", "file", 0o644, "x"), ("hard", "hardlink", 0o644, "f")],
    "character-device": [("dev", "chr", 0o644, "")],
    "block-device": [("dev", "blk", 0o644, "")],
    "fifo": [("pipe", "fifo", 0o644, "")],
    "set-uid": [("run", "file", 0o4755, "#!/bin/sh\n")],
    "set-gid-folder": [("d", "dir", 0o2755, "")],
    "sticky-folder": [("d", "dir", 0o1777, "")],
}


def hostile_bundle(members: list[Member]) -> ToolBundle:
    """The archive of ``members``, with the content hash of the tree they describe."""
    out = io.BytesIO()
    tree = _TreeHash()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, mode, text in members:
            info = tarfile.TarInfo(name)
            info.type, info.mode = _TYPES[kind], mode
            data = None
            if kind in ("link", "hardlink"):
                info.linkname = text
            elif kind == "file":
                data = text.encode()
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    entries = [
        _Entry(name, kind, bool(mode & 0o100) and kind != "link", text.encode() if kind != "dir" else b"")
        for name, kind, mode, text in members
        if kind in ("file", "dir", "link")
    ]
    for entry in sorted(entries, key=lambda entry: entry.relative):
        tree.add(entry)
    return ToolBundle(out.getvalue(), tree.hexdigest())


def refusal(case: str, cache: Path) -> str | None:
    """How ``unpack`` answers the hostile bundle ``case``: the refusal's class and message,
    or None when it was unpacked."""
    try:
        unpack(hostile_bundle(HOSTILE[case]), cache)
    except SandboxUnavailable as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
