"""The installed package on a first run: ``runner init``, where the policy is looked for,
location flags anywhere, ``--version``; run with the installed ``runner`` command."""

from __future__ import annotations

import json
import os
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from conftest import answer_of, installed_command

import runner
from runner.config.locations import find_policy, search_dirs, tool_dirs

ADD = ("exec", "add_numbers", "--params", '{"a": 1, "b": 2}')


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home of its own, so the machine's ~/.config/runner never answers for the test."""
    folder = tmp_path / "home"
    folder.mkdir()
    return folder


def runner_command(
    *args: str, cwd: Path, home: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNNER_") and k != "XDG_CONFIG_HOME"}
    return subprocess.run(
        [installed_command(), *args],
        cwd=cwd,
        env={**clean, "HOME": str(home), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_init_in_an_empty_folder_then_exec_from_it_answers_three(tmp_path: Path, home: Path) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    init = runner_command("init", cwd=folder, home=home)
    assert init.returncode == 0, init.stderr
    assert (folder / "tools" / "add_numbers" / "tool.yaml").is_file()
    assert (folder / "workspace").is_dir()
    done = runner_command(*ADD, cwd=folder, home=home)
    assert done.returncode == 0, done.stderr
    assert answer_of(done)["result"] == 3
    # audit.path of the starter policy is relative to it: the event lands beside it
    events = [json.loads(line) for line in (folder / "audit.log").read_text().splitlines()]
    assert {event["event"] for event in events} >= {"policy.decision", "call.finished"}


def test_init_writes_a_policy_with_an_audit_path_and_a_workspace_into_the_folder_named(
    tmp_path: Path, home: Path
) -> None:
    done = runner_command("init", "nested/project", cwd=tmp_path, home=home)
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "nested" / "project"
    policy = yaml.safe_load((folder / "policies.yaml").read_text())
    assert policy["audit"]["path"]
    assert (folder / policy["workspace"]).is_dir()
    assert sorted(p.name for p in (folder / "tools").iterdir()) == sorted(
        p.name for p in (runner.examples_dir() / "tools").iterdir() if p.name != "__pycache__"
    )


def test_init_refuses_to_overwrite_existing_files_unless_forced(tmp_path: Path, home: Path) -> None:
    (tmp_path / "policies.yaml").write_text("# mine\n")
    refused = runner_command("init", cwd=tmp_path, home=home)
    assert refused.returncode == 2
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "--force" in refused.stderr
    assert (tmp_path / "policies.yaml").read_text() == "# mine\n"
    assert not (tmp_path / "tools").exists()  # nothing written at all
    forced = runner_command("init", "--force", cwd=tmp_path, home=home)
    assert forced.returncode == 0, forced.stderr
    assert "whitelist" in (tmp_path / "policies.yaml").read_text()


def test_init_writes_nothing_through_a_planted_link_or_into_a_folder_others_control(
    tmp_path: Path, home: Path
) -> None:
    # As root in a folder another user could write to, a tools link planted there had the
    # example tools written where it led.
    folder, target = tmp_path / "shared", tmp_path / "target"
    folder.mkdir()
    target.mkdir(mode=0o700)
    (folder / "tools").symlink_to(target, target_is_directory=True)
    if os.getuid() == 0:
        os.lchown(folder / "tools", 65534, 65534)
        linked = runner_command("init", cwd=folder, home=home)
        assert linked.returncode != 0 and "another user's symbolic link" in linked.stderr, linked.stderr
        assert list(target.iterdir()) == [] and sorted(p.name for p in folder.iterdir()) == ["tools"]
        assert "Traceback" not in linked.stderr
        os.lchown(folder / "tools", 0, 0)
    own = runner_command("init", cwd=folder, home=home)  # one's own link (dotfiles) is followed
    assert own.returncode == 0 and (target / "add_numbers" / "tool.yaml").is_file(), own.stderr
    folder.chmod(0o777)
    opened = runner_command("init", "--force", cwd=folder, home=home)
    assert opened.returncode != 0 and "writable by every user" in opened.stderr, opened.stderr
    if os.getuid() == 0:  # a sticky folder: another user's tools/ in it
        sticky = tmp_path / "sticky"
        sticky.mkdir()
        sticky.chmod(0o1777)
        (sticky / "tools").mkdir()
        os.chown(sticky / "tools", 65534, 65534)
        theirs = runner_command("init", cwd=sticky, home=home)
        assert theirs.returncode != 0 and "belongs to uid 65534" in theirs.stderr, theirs.stderr
        assert list((sticky / "tools").iterdir()) == [] and not (sticky / "policies.yaml").exists()


def test_the_policy_in_xdg_config_home_is_used_with_the_tools_beside_it(tmp_path: Path, home: Path) -> None:
    config = tmp_path / "xdg"
    assert runner_command("init", str(config / "runner"), cwd=tmp_path, home=home).returncode == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = runner_command(*ADD, cwd=elsewhere, home=home, env={"XDG_CONFIG_HOME": str(config)})
    assert answer_of(done)["result"] == 3
    assert (config / "runner" / "audit.log").is_file()


def test_without_xdg_config_home_the_policy_is_looked_for_in_dot_config(tmp_path: Path, home: Path) -> None:
    assert runner_command("init", str(home / ".config" / "runner"), cwd=tmp_path, home=home).returncode == 0
    assert answer_of(runner_command(*ADD, cwd=tmp_path, home=home))["result"] == 3


def test_the_current_folder_wins_over_the_config_folder(tmp_path: Path, home: Path) -> None:
    config = tmp_path / "xdg"
    here = tmp_path / "here"
    for folder in (config / "runner", here):
        assert runner_command("init", str(folder), cwd=tmp_path, home=home).returncode == 0
    # the config folder's policy disables the tool: used, it would refuse the call
    policy = yaml.safe_load((config / "runner" / "policies.yaml").read_text())
    policy["disabled"] = ["add_numbers"]
    (config / "runner" / "policies.yaml").write_text(yaml.safe_dump(policy))
    env = {"XDG_CONFIG_HOME": str(config)}
    assert answer_of(runner_command(*ADD, cwd=here, home=home, env=env))["result"] == 3
    refused = answer_of(runner_command(*ADD, cwd=tmp_path, home=home, env=env))
    assert refused["error"]["code"] == "PERMISSION_DENIED"


def test_the_search_order_is_here_then_the_config_folder_then_etc(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    assert search_dirs(env) == [Path.cwd(), tmp_path / "xdg" / "runner", Path("/etc/runner")]
    # a relative XDG_CONFIG_HOME is invalid by the XDG rules: the default applies
    assert search_dirs({"XDG_CONFIG_HOME": "relative"})[1] == Path.home() / ".config" / "runner"
    assert find_policy("given.yaml", {"RUNNER_POLICIES": "env.yaml"}) == Path("given.yaml")
    assert find_policy(None, {"RUNNER_POLICIES": "env.yaml"}) == Path("env.yaml")
    policy = tmp_path / "conf" / "policies.yaml"
    assert tool_dirs(None, policy, {}) == [tmp_path / "conf" / "tools"]
    assert tool_dirs(None, policy, {"RUNNER_TOOLS": "a:b"}) == [Path("a"), Path("b")]


def test_location_flags_are_accepted_after_the_command(tmp_path: Path, home: Path) -> None:
    project = tmp_path / "project"
    assert runner_command("init", str(project), cwd=tmp_path, home=home).returncode == 0
    audit = tmp_path / "elsewhere.log"
    done = runner_command(
        *ADD, "--policies", str(project / "policies.yaml"), "--audit-log", str(audit), cwd=tmp_path, home=home
    )
    assert answer_of(done)["result"] == 3
    assert audit.is_file()
    listed = runner_command(
        "list",
        "--json",
        "--tools",
        str(project / "tools"),
        "--policies",
        str(project / "policies.yaml"),
        cwd=tmp_path,
        home=home,
    )
    assert "add_numbers" in {tool["name"] for tool in json.loads(listed.stdout)["tools"]}
    # a flag after the command wins over the same flag before it
    before_and_after = runner_command(
        "--policies",
        str(tmp_path / "missing.yaml"),
        *ADD,
        "--policies",
        str(project / "policies.yaml"),
        cwd=tmp_path,
        home=home,
    )
    assert answer_of(before_and_after)["result"] == 3


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to hand the folder to another user")
def test_a_policy_or_tools_found_in_a_folder_of_another_users_are_not_used(
    tmp_path: Path, home: Path
) -> None:
    # Root ran a planted ./policies.yaml: its backend settings name the programs root runs
    # (runner doctor) and its workspace the folder a planted tool may write.
    folder = tmp_path / "shared"
    folder.mkdir()
    assert runner_command("init", cwd=folder, home=home).returncode == 0
    planted = [folder, folder / "policies.yaml", folder / "tools"]
    for path in planted:
        os.chown(path, 65534, 65534)
    for owned_by_root in (None, *planted):
        if owned_by_root is not None:
            os.chown(owned_by_root, 0, 0)
        done = runner_command(*ADD, cwd=folder, home=home)
        if owned_by_root != folder / "tools":  # skipped, with a warning, and none found after it
            assert done.returncode == 2 and "another user could have put it there" in done.stderr, done.stderr
            assert "not found" in done.stderr and "Traceback" not in done.stderr
    assert done.returncode == 0 and answer_of(done)["result"] == 3  # all root's again
    os.chmod(folder / "tools", 0o777)
    done = runner_command(*ADD, cwd=folder, home=home)
    assert done.returncode == 2 and "writable by every user" in done.stderr, done.stderr
    # Skipped, the search goes on: the user's own configuration answers.
    init = runner_command("init", str(home / ".config" / "runner"), cwd=folder, home=home)
    assert init.returncode == 0, init.stderr
    own = runner_command(*ADD, cwd=folder, home=home)
    assert own.returncode == 0 and answer_of(own)["result"] == 3, own.stderr
    assert "skipped" in own.stderr
    named = runner_command("--policies", str(folder / "policies.yaml"), *ADD, cwd=folder, home=home)
    assert named.returncode == 0 and answer_of(named)["result"] == 3  # named: the user's choice


@pytest.mark.skipif(Path("/etc/runner/policies.yaml").exists(), reason="this machine has a system policy")
def test_finding_no_policy_says_where_it_looked_and_suggests_init(tmp_path: Path, home: Path) -> None:
    for command in (ADD, ("list",), ("validate",)):
        done = runner_command(*command, cwd=tmp_path, home=home, env={"XDG_CONFIG_HOME": str(tmp_path / "x")})
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert "runner init" in lines[0]
        for folder in (tmp_path, tmp_path / "x" / "runner", Path("/etc/runner")):
            assert f"{folder}/" in lines[0]


def test_version_prints_the_installed_distribution_version(tmp_path: Path, home: Path) -> None:
    done = runner_command("--version", cwd=tmp_path, home=home)
    assert done.returncode == 0
    assert version("sandboxed-tool-runner") in done.stdout


def test_the_installed_package_carries_every_subpackage_and_the_examples() -> None:
    import sandboxes.docker.sandbox
    import sandboxes.subprocess.sandbox

    assert sandboxes.subprocess.sandbox and sandboxes.docker.sandbox
    examples = runner.examples_dir()
    for shipped in ("policies.yaml", "tools/add_numbers/tool.yaml", "tool_images/python-tools/Dockerfile"):
        assert (examples / shipped).is_file(), shipped
    checkout = Path(runner.__file__).resolve().parent.parent
    if not (checkout / "pyproject.toml").is_file():  # installed from a wheel: its own copies
        assert examples == Path(runner.__file__).resolve().parent / "_bundled"
