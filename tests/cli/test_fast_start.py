"""The command line starts fast without cutting a corner: each command imports only what it
uses, a manifest's schemas are checked once (then remembered by the bytes of its file, in a
cache only its owner can vouch for), and the watchdog starts beside the loading.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ToolBench, starter_dir, watchdogs_of, write_tool

from runner.tools.cache import CACHE_FILE, ManifestCache
from runner.tools.manifest import ManifestError, load_tool
from runner.tools.registry import Registry

HEAVY = ("pydantic", "jsonschema", "structlog", "docker", "psutil", "yaml", "asyncio")
# Prints the top-level packages a command imported, after running it in this process.
_IMPORTS_OF = """
import json, sys
from runner.cli import main
try:
    main()
except SystemExit:
    pass
sys.stdout.flush()
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})), file=sys.stderr)
"""


def _imports_of(args: list[str], cwd: Path, env: dict[str, str]) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS_OF, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        check=False,
    )
    loaded: list[str] = json.loads(done.stderr.strip().splitlines()[-1])
    return set(loaded)


def test_help_imports_none_of_the_heavy_libraries(tmp_path: Path) -> None:
    loaded = _imports_of(["--help"], tmp_path, dict(os.environ))
    assert "runner" in loaded
    assert loaded.isdisjoint(HEAVY), loaded & set(HEAVY)


def test_list_with_checked_manifests_imports_no_jsonschema_docker_or_psutil(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "RUNNER_AUDIT_LOG": os.devnull}
    first = _imports_of(["list"], starter_dir(), env)  # checks every schema, fills the cache
    assert "jsonschema" in first
    again = _imports_of(["list"], starter_dir(), env)
    assert again.isdisjoint({"jsonschema", "docker", "psutil"}), again


def test_a_manifest_is_checked_once_then_taken_from_the_cache_by_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_tool(tmp_path / "tools", "adder", "print(1)")
    cache = ManifestCache.open(tmp_path / "cache")
    first = load_tool(folder, cache)
    cache.save()
    assert (tmp_path / "cache" / CACHE_FILE).stat().st_mode & 0o077 == 0

    checked: list[object] = []
    monkeypatch.setattr("runner.schema.compiled.check_schema", checked.append)
    again = load_tool(folder, ManifestCache.open(tmp_path / "cache"))
    assert checked == []
    assert again == first
    assert again.params_validator.is_valid({}) and again.sensitive_params == frozenset()


@pytest.mark.parametrize("plant", ["linked folder", "open folder", "another's folder"])
def test_the_cache_is_never_written_through_a_link_or_in_a_folder_others_could_change(
    tmp_path: Path, plant: str
) -> None:
    # As root with a user's $HOME (su without -), ~/.cache/runner linked to a folder of
    # the user's choosing had root replace manifests.json there.
    folder = write_tool(tmp_path / "tools", "adder", "print(1)")
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (target / CACHE_FILE).write_text("old")
    cache_folder = tmp_path / "cache"
    if plant == "linked folder":
        cache_folder.symlink_to(target, target_is_directory=True)
    else:
        cache_folder.mkdir(mode=0o700)
        if plant == "open folder":
            cache_folder.chmod(0o777)
        elif os.geteuid() == 0:
            os.chown(cache_folder, 65534, 65534)
        else:
            pytest.skip("needs root, to give the folder to another user")
    cache = ManifestCache.open(cache_folder)
    load_tool(folder, cache)
    cache.save()  # quietly not written: checking from scratch next time
    assert (target / CACHE_FILE).read_text() == "old"
    if plant != "linked folder":
        assert not (cache_folder / CACHE_FILE).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, with another user's HOME")
def test_root_with_another_users_home_keeps_no_cache_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # su without -: ~/.cache a link of the user's to a folder of their choosing, where root
    # made runner/ and wrote manifests.json.
    home, target = tmp_path / "home", tmp_path / "target"
    home.mkdir()
    target.mkdir(mode=0o700)
    (home / ".cache").symlink_to(target, target_is_directory=True)
    for path in (home, home / ".cache"):
        os.lchown(path, 65534, 65534)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    cache = ManifestCache.open()
    load_tool(write_tool(tmp_path / "tools", "adder", "print(1)"), cache)
    cache.save()
    assert cache.path is None and list(target.iterdir()) == []


def test_a_changed_manifest_is_checked_again(tmp_path: Path) -> None:
    folder = write_tool(tmp_path / "tools", "adder", "print(1)")
    cache = ManifestCache.open(tmp_path / "cache")
    load_tool(folder, cache)
    cache.save()
    manifest = folder / "tool.yaml"
    manifest.write_text(manifest.read_text().replace("additionalProperties: true", "minProperties: -1"))
    with pytest.raises(ManifestError, match="minProperties"):
        load_tool(folder, ManifestCache.open(tmp_path / "cache"))


def test_an_invalid_manifest_is_never_cached(tmp_path: Path) -> None:
    write_tool(
        tmp_path / "tools", "bad", "", parameters={"type": "object", "properties": {"a": {"type": "nope"}}}
    )
    for _ in range(2):
        registry = Registry.load([tmp_path / "tools"], cache=ManifestCache.open(tmp_path / "cache"))
        assert len(registry) == 0 and len(registry.problems) == 1
    assert not (tmp_path / "cache" / CACHE_FILE).exists()


@pytest.mark.parametrize("foreign", ["group_writable", "other_owner"])
def test_a_cache_file_others_could_write_vouches_for_nothing(tmp_path: Path, foreign: str) -> None:
    # Someone who can write the cache plants the digest of a manifest with an invalid
    # schema; it must still be checked, and refused.
    folder = write_tool(tmp_path / "tools", "bad", "", parameters={"type": "object", "minProperties": -1})
    planted = yaml_document(folder)
    cache_file = tmp_path / "cache" / CACHE_FILE
    honest = ManifestCache.open(tmp_path / "cache")
    (tmp_path / "cache").mkdir()
    cache_file.write_text(json.dumps({"key": honest.key, "entries": {digest_of(folder): planted}}))
    if foreign == "group_writable":
        cache_file.chmod(0o664)
    else:
        cache_file.chmod(0o600)
        os.chown(cache_file, 65534, 65534)
    with pytest.raises(ManifestError, match="minProperties"):
        load_tool(folder, ManifestCache.open(tmp_path / "cache"))
    # The same file, owned by this user and private, is trusted (what the two cases prove).
    os.chown(cache_file, os.geteuid(), os.getegid())
    cache_file.chmod(0o600)
    assert load_tool(folder, ManifestCache.open(tmp_path / "cache")).name == "bad"


def yaml_document(folder: Path) -> object:
    from runner.config.yaml_files import load_yaml_file

    return load_yaml_file(folder / "tool.yaml")


def digest_of(folder: Path) -> str:
    from runner.tools.cache import digest

    return digest((folder / "tool.yaml").read_bytes())


def test_a_cache_made_by_other_checking_code_is_ignored(tmp_path: Path) -> None:
    folder = write_tool(tmp_path / "tools", "bad", "", parameters={"type": "object", "minProperties": -1})
    (tmp_path / "cache").mkdir()
    stale = {"key": "made-by-an-older-jsonschema", "entries": {digest_of(folder): yaml_document(folder)}}
    (tmp_path / "cache" / CACHE_FILE).write_text(json.dumps(stale))
    (tmp_path / "cache" / CACHE_FILE).chmod(0o600)
    with pytest.raises(ManifestError):
        load_tool(folder, ManifestCache.open(tmp_path / "cache"))


def test_a_corrupt_or_unwritable_cache_only_means_checking_from_scratch(tmp_path: Path) -> None:
    write_tool(tmp_path / "tools", "adder", "print(1)")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / CACHE_FILE).write_text("{not json")
    (tmp_path / "cache" / CACHE_FILE).chmod(0o600)
    assert len(Registry.load([tmp_path / "tools"], cache=ManifestCache.open(tmp_path / "cache"))) == 1
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    assert len(Registry.load([tmp_path / "tools"], cache=ManifestCache.open(blocked))) == 1


def test_a_watchdog_started_for_a_call_that_never_ran_ends_with_the_runner(bench: ToolBench) -> None:
    # runner exec starts the watchdog before it knows the tool; an unknown tool ends the
    # command before any sandbox, and the watchdog must not outlive it.
    (bench.root / "policies.yaml").write_text(json.dumps({"version": 1, "whitelist": ["*"]}))
    done = subprocess.Popen(
        [sys.executable, "-m", "runner", "exec", "no_such_tool", "--tools", str(bench.tools),
         "--policies", str(bench.root / "policies.yaml"), "--audit-log", os.devnull],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    time.sleep(0.05)
    seen = watchdogs_of(done.pid)
    out, err = done.communicate(timeout=30)
    assert json.loads(out)["error"]["code"] == "TOOL_NOT_FOUND", err
    deadline = time.monotonic() + 10
    while watchdogs_of(done.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watchdogs_of(done.pid) == [], f"watchdog outlived its runner (seen while running: {seen})"
