"""Tool folders on their way to a node: packed with their content hash on the
caller, unpacked into a private cache on the node only when the hash holds and nothing in
the archive reaches out of its folder. And the policy's ``dispatch:`` section."""

from __future__ import annotations

import ctypes
import io
import os
import tarfile
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import BASE_POLICY, ToolBench, write_tool
from support.bundle_cases import HOSTILE, refusal

from runner.call.policy import Policy
from runner.dispatch.bundle import (
    MAX_ENTRIES,
    MAX_PATH_BYTES,
    BundleTooLarge,
    ToolBundle,
    pack,
    private_cache,
    tree_hash,
    unpack,
)
from runner.errors import ConfigError
from sandboxes import SandboxUnavailable


def tool_folder(root: Path) -> Path:
    folder = write_tool(root, "t", "print('{}')\n")
    (folder / "lib").mkdir()
    (folder / "lib" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (folder / "lib" / "run.sh").chmod(0o755)
    (folder / "link").symlink_to("lib/run.sh")
    return folder


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def member(
    name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"x", link: str = ""
) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        return info, data
    return info, None


def test_a_packed_folder_unpacks_on_the_node_to_the_same_content_hash(tmp_path: Path) -> None:
    folder = tool_folder(tmp_path / "tools")
    bundle = pack(folder, 1 << 20)
    assert bundle.sha256 == tree_hash(folder)
    unpacked = unpack(bundle, tmp_path / "cache")
    assert unpacked.name == bundle.sha256
    assert (unpacked / "lib" / "run.sh").read_text() == "#!/bin/sh\necho hi\n"
    assert os.access(unpacked / "lib" / "run.sh", os.X_OK)
    assert (unpacked / "link").is_symlink()
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == "0o700"
    assert unpack(bundle, tmp_path / "cache") == unpacked  # cached by hash


@pytest.mark.parametrize("what", [".env", "private"])
def test_a_file_or_folder_others_may_not_read_is_refused_not_shipped_readable(
    tmp_path: Path, what: str
) -> None:
    # The node makes every file 0644: a key its tool could not read here (0600, as root)
    # went over the wire in the task, and was readable there.
    folder = tool_folder(tmp_path / "tools")
    hidden = folder / what
    if what == "private":
        hidden.mkdir(mode=0o700)
        (hidden / "key").write_text("k")
    else:
        hidden.write_text("TOKEN=abc\n")
        hidden.chmod(0o600)
    with pytest.raises(SandboxUnavailable, match=f"'{what}', which not every user may read"):
        pack(folder, 1 << 20)
    hidden.chmod(0o755 if what == "private" else 0o644)
    assert pack(folder, 1 << 20).sha256 == tree_hash(folder)


def test_a_changed_folder_is_another_hash_so_a_node_never_runs_a_stale_copy(tmp_path: Path) -> None:
    folder = tool_folder(tmp_path / "tools")
    before = pack(folder, 1 << 20)
    (folder / "main.py").write_text("print('[]')\n")
    after = pack(folder, 1 << 20)
    assert before.sha256 != after.sha256
    assert (unpack(after, tmp_path / "cache") / "main.py").read_text() == "print('[]')\n"


def test_an_archive_that_does_not_match_its_hash_is_refused(tmp_path: Path) -> None:
    bundle = pack(tool_folder(tmp_path / "tools"), 1 << 20)
    other = pack(write_tool(tmp_path / "other", "t", "print(1)\n"), 1 << 20)
    with pytest.raises(SandboxUnavailable, match="does not match"):
        unpack(ToolBundle(other.data, bundle.sha256), tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []


def test_an_altered_cache_entry_is_unpacked_again_not_run(tmp_path: Path) -> None:
    bundle = pack(tool_folder(tmp_path / "tools"), 1 << 20)
    unpacked = unpack(bundle, tmp_path / "cache")
    (unpacked / "main.py").write_text("import os; os.system('evil')\n")
    again = unpack(bundle, tmp_path / "cache")
    assert (again / "main.py").read_text() == "print('{}')\n"


@pytest.mark.parametrize(
    "hostile",
    [
        member("/etc/evil"),
        member("../evil"),
        member("a/../../evil"),
        member("out", tarfile.SYMTYPE, link="/etc"),
        member("out", tarfile.SYMTYPE, link="../../etc"),
        member("dev", tarfile.CHRTYPE),
        member("hard", tarfile.LNKTYPE, link="/etc/passwd"),
    ],
    ids=["absolute", "dotdot", "nested-dotdot", "link-absolute", "link-out", "device", "hardlink-out"],
)
def test_an_archive_reaching_out_of_its_folder_is_refused(
    tmp_path: Path, hostile: tuple[tarfile.TarInfo, bytes | None]
) -> None:
    data = tar_of(hostile)
    with pytest.raises(SandboxUnavailable):
        unpack(ToolBundle(data, "0" * 64), tmp_path / "cache")
    assert not (tmp_path / "evil").exists() and not (tmp_path.parent / "evil").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_archive_with_a_matching_hash_is_refused_before_anything_is_written(
    tmp_path: Path, case: str
) -> None:
    """The runner's own extraction, the same on every Python: not only a hash that fails."""
    outside = tmp_path / "outside"
    outside.mkdir()
    cache = outside / "a" / "b" / "cache"
    answer = refusal(case, cache)
    assert answer is not None and answer.startswith("UnsafeBundle: "), answer
    assert [p.name for p in cache.iterdir()] == []
    assert sorted(p.name for p in outside.rglob("*")) == ["a", "b", "cache"]


def test_links_that_stay_inside_the_folder_are_unpacked_as_links(tmp_path: Path) -> None:
    folder = tool_folder(tmp_path / "tools")
    (folder / "bin").mkdir()
    (folder / "bin" / "tool").symlink_to("../lib/run.sh")
    (folder / "bin" / "here").symlink_to("..")
    (folder / "again").symlink_to("bin/here/link")
    unpacked = unpack(pack(folder, 1 << 20), tmp_path / "cache")
    assert (unpacked / "again").read_text() == "#!/bin/sh\necho hi\n"
    assert os.readlink(unpacked / "bin" / "tool") == "../lib/run.sh"
    assert oct((unpacked / "bin").stat().st_mode & 0o7777) == "0o755"
    assert oct((unpacked / "main.py").stat().st_mode & 0o7777) == "0o644"
    assert oct((unpacked / "lib" / "run.sh").stat().st_mode & 0o7777) == "0o755"


def test_a_link_to_a_file_outside_is_never_followed_by_the_packing(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("host secret")
    folder = write_tool(tmp_path / "tools", "t", "print(1)\n")
    (folder / "peek").symlink_to(tmp_path / "secret")
    bundle = pack(folder, 1 << 20)
    assert b"host secret" not in bundle.data
    with pytest.raises(SandboxUnavailable):  # and the node refuses the link leading out
        unpack(bundle, tmp_path / "cache")


def test_a_folder_over_the_bound_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    folder = write_tool(tmp_path / "tools", "t", "print(1)\n")
    (folder / "big.bin").write_bytes(b"\0" * 4096)
    with pytest.raises(BundleTooLarge, match="max_bundle_bytes"):
        pack(folder, 1024)


def test_a_cache_folder_open_to_others_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir(mode=0o755)
    (tmp_path / "cache").chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="private"):
        private_cache(tmp_path / "cache")
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SandboxUnavailable, match="private"):
        private_cache(tmp_path / "linked")


def policy_file(tmp_path: Path, **dispatch: object) -> Path:
    document = {**BASE_POLICY, "dispatch": {"engine": "ray", "address": "127.0.0.1:6379", **dispatch}}
    path = tmp_path / "policies.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_a_policy_that_dispatches_without_a_token_does_not_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="token"):
        Policy.load(policy_file(tmp_path))
    with pytest.raises(ConfigError, match="token_file"):
        Policy.load(policy_file(tmp_path, token_file="missing"))
    (tmp_path / "token").write_text("t" * 64)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ConfigError, match="RAY_AUTH_MODE"):
        Policy.load(policy_file(tmp_path, token_file="token"))
    monkeypatch.delenv("RAY_AUTH_MODE")
    assert Policy.load(policy_file(tmp_path, token_file="token")).model.dispatch is not None


def test_dispatch_covers_the_tools_its_rules_match(tmp_path: Path) -> None:
    from runner.dispatch import covers
    from runner.tools.manifest import load_tool

    (tmp_path / "token").write_text("t" * 64)
    policy = Policy.load(policy_file(tmp_path, token_file="token", tools=["web_*", "tag:heavy"]))
    web = load_tool(write_tool(tmp_path / "tools", "web_fetch", "print(1)\n"))
    heavy = load_tool(write_tool(tmp_path / "tools", "crunch", "print(1)\n", tags=["heavy"]))
    local = load_tool(write_tool(tmp_path / "tools", "add", "print(1)\n"))
    assert [covers(policy.model.dispatch, t) for t in (web, heavy, local)] == [True, True, False]


RENAME_EXCHANGE = 2
AT_FDCWD = -100


def test_a_folder_swapped_for_a_link_while_packed_never_ships_what_is_outside(tmp_path: Path) -> None:
    """The reviewer's race: a thread exchanges a subfolder with a link to a folder holding
    a 0600 file (renameat2 RENAME_EXCHANGE), many packs run meanwhile; none may hold it."""
    libc = ctypes.CDLL(None, use_errno=True)
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    (secret_dir / "shadow").write_text("ROOT-ONLY SECRET\n")
    (secret_dir / "shadow").chmod(0o600)
    folder = write_tool(tmp_path / "tools", "t", "print(1)\n")
    for i in range(1000):  # a longer walk: a wider window between listing and reading
        (folder / f"pad{i:04d}").write_text("x")
    (folder / "sub").mkdir()
    (folder / "sub" / "shadow").write_text("decoy\n")
    (folder / "alt").symlink_to(secret_dir)
    stop, swaps = threading.Event(), [0]

    def flip() -> None:
        a, b = str(folder / "sub").encode(), str(folder / "alt").encode()
        while not stop.is_set():
            if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) == 0:
                swaps[0] += 1

    swapper = threading.Thread(target=flip)
    swapper.start()
    packed, refused = 0, 0
    try:
        deadline = time.monotonic() + 20
        while packed + refused < 150 and time.monotonic() < deadline:
            try:
                bundle = pack(folder, 1 << 24)
            except SandboxUnavailable:
                refused += 1  # the swap seen: refused, which is fine
                continue
            packed += 1
            assert b"SECRET" not in bundle.data
    finally:
        stop.set()
        swapper.join()
    assert swaps[0] > 100 and packed > 0, (swaps[0], packed, refused)


def test_an_archive_is_bounded_by_its_own_size_not_only_its_files(tmp_path: Path) -> None:
    """Links with long targets and long folder names cost no file bytes but archive bytes."""
    folder = write_tool(tmp_path / "tools", "t", "print(1)\n")
    for i in range(200):
        (folder / f"l{i:03d}").symlink_to("x" * 1000)
    with pytest.raises(BundleTooLarge, match="max_bundle_bytes"):
        pack(folder, 64 * 1024)
    assert len(pack(folder, 1 << 20).data) > 64 * 1024  # the same folder, under a larger bound


def test_too_many_entries_or_too_long_a_name_or_link_is_refused(tmp_path: Path) -> None:
    many = write_tool(tmp_path / "many", "t", "print(1)\n")
    for i in range(MAX_ENTRIES):
        (many / f"e{i}").symlink_to("x")
    with pytest.raises(BundleTooLarge, match=f"more than {MAX_ENTRIES} entries"):
        pack(many, 1 << 29)
    deep = write_tool(tmp_path / "deep", "t", "print(1)\n")
    (deep / "/".join(["d" * 200] * 6)).mkdir(parents=True)
    with pytest.raises(BundleTooLarge, match=f"path longer than {MAX_PATH_BYTES}"):
        pack(deep, 1 << 29)
    far = write_tool(tmp_path / "far", "t", "print(1)\n")
    (far / "link").symlink_to("x/" * MAX_PATH_BYTES)
    with pytest.raises(BundleTooLarge, match="link target longer"):
        pack(far, 1 << 29)


def test_a_tool_with_a_network_of_its_own_is_not_dispatched(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a node, ``network: true`` would reach the cluster's private network (GCS,
    raylets): the call fails closed before the cluster is even joined, and nothing runs."""
    (bench.root / "token").write_text("t" * 64)
    marker = bench.root / "ran"
    bench.tool("net", f"open({str(marker)!r}, 'w').close()\nprint('{{}}')\n", network=True)
    bench.policy["limits"]["network"] = True
    bench.policy["dispatch"] = {"engine": "ray", "address": "127.0.0.1:1", "token_file": "token"}
    joined: list[object] = []
    monkeypatch.setattr("runner.dispatch.sandbox.join", lambda *args: joined.append(args))
    answer = bench.runner().handle({"toolName": "net", "requestId": "req_net", "options": {"retries": 0}})
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable", answer
    assert "network: true is not dispatched" in answer["error"]["message"]
    assert joined == [] and not marker.exists()
