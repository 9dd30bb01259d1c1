"""The sandbox's /etc files (``sandboxes.subprocess._etc``): copies of the host's few, in
one folder bound once, each made again when the host's changes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from conftest import ToolBench

from sandboxes.subprocess._etc import COPIED, SandboxEtc

READS_ETC = """
import hashlib, json, os, sys
sys.stdin.read()
seen = {}
for name in ("ld.so.cache", "mime.types", "localtime", "passwd"):
    path = "/etc/" + name
    seen[name] = hashlib.sha256(open(path, "rb").read()).hexdigest() if os.path.exists(path) else None
seen["localtime -> "] = os.path.realpath("/etc/localtime")
print(json.dumps(seen))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the hardened sandbox runs as root here")
def test_the_tool_reads_the_hosts_etc_files_as_they_are(bench: ToolBench) -> None:
    bench.tool("etc", READS_ETC)
    answer = bench.runner().handle({"toolName": "etc", "params": {}})
    assert answer["success"], answer
    seen = answer["result"]
    for name in ("ld.so.cache", "mime.types", "localtime"):
        host = Path("/etc", name)
        expected = hashlib.sha256(host.read_bytes()).hexdigest() if host.exists() else None
        assert seen[name] == expected, name
    assert seen["localtime -> "] == os.path.realpath("/etc/localtime")
    assert seen["passwd"] != hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()  # the runner's


def test_a_copy_follows_its_host_file_and_nothing_but_files_and_links_is_copied(tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    (host / "ld.so.cache").write_bytes(b"one")
    (host / "localtime").symlink_to("/usr/share/zoneinfo/Etc/UTC")
    (host / "mime.types").mkdir()  # not a file: not copied
    os.mkfifo(host / "ld.so.conf")  # never opened
    etc = SandboxEtc(tmp_path / "etc", {"passwd": "nobody\n"}, host_etc=host)
    etc.write()
    folder = tmp_path / "etc"
    assert etc.copies == {"ld.so.cache", "localtime"}
    assert (folder / "passwd").read_text() == "nobody\n"
    assert (folder / "ld.so.cache").read_bytes() == b"one"
    assert os.readlink(folder / "localtime") == "/usr/share/zoneinfo/Etc/UTC"
    assert not (folder / "mime.types").exists() and not (folder / "ld.so.conf").exists()
    assert oct((folder / "ld.so.cache").stat().st_mode & 0o777) == "0o644"

    (host / "ld.so.cache").write_bytes(b"two, longer")  # an apt install
    (host / "localtime").unlink()
    (host / "localtime").symlink_to("/usr/share/zoneinfo/Europe/Paris")
    (host / "mime.types").rmdir()
    (host / "mime.types").write_text("text/x-test t\n")
    etc.refresh()
    assert (folder / "ld.so.cache").read_bytes() == b"two, longer"
    assert os.readlink(folder / "localtime") == "/usr/share/zoneinfo/Europe/Paris"
    assert (folder / "mime.types").read_text() == "text/x-test t\n"
    (host / "ld.so.cache").unlink()
    etc.refresh()
    assert not (folder / "ld.so.cache").exists()
    assert etc.copies == {"localtime", "mime.types"}
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # no partial left
    assert set(COPIED) >= etc.copies
