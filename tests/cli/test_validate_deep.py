"""``runner validate [--json]`` looks deeper than the manifests: whether each command will
start in its sandbox, whether the policy's rules and grants fit the tools (issue 10.5).
Every test goes through the command line; errors exit 1, warnings alone exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from conftest import ToolBench, starter_dir
from docker import APIClient

ECHO_TOOL = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"


def validate(
    bench: ToolBench, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    bench.write_policy()
    config = ["--tools", str(bench.tools), "--policies", str(bench.root / "policies.yaml")]
    return subprocess.run(
        [sys.executable, "-m", "runner", *config, "validate", *args],
        capture_output=True,
        text=True,
        cwd=bench.root,
        timeout=60,
        env={**os.environ, "RUNNER_AUDIT_LOG": os.devnull, **(env or {})},
    )


def report(bench: ToolBench, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    done = validate(bench, "--json", env=env)
    assert done.stderr == ""
    document: dict[str, Any] = json.loads(done.stdout)  # one document, nothing else
    return done.returncode, document


def problems(document: dict[str, Any], check: str) -> list[dict[str, Any]]:
    return [problem for problem in document["problems"] if problem["check"] == check]


def test_the_shipped_tools_and_policy_validate_without_a_problem() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "runner", "--policies", str(starter_dir() / "policies.yaml"), "validate", "--json"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "RUNNER_AUDIT_LOG": os.devnull},
    )  # fmt: skip
    document = json.loads(done.stdout)
    # The docker tool's image is checked too; without a daemon that is its only problem.
    unreachable = [p for p in document["problems"] if p["check"] == "image" and "cannot check" in p["reason"]]
    assert [p for p in document["problems"] if p not in unreachable] == []
    assert done.returncode == (1 if unreachable else 0)
    assert len(document["tools"]) == 8


def test_a_command_missing_from_the_sandboxs_path_is_an_error(bench: ToolBench) -> None:
    bench.tool("ok", ECHO_TOOL)
    bench.tool("ghost", ECHO_TOOL, command=["no-such-interpreter-xyz", "main.py"])
    status, document = report(bench)
    assert status == 1
    [problem] = problems(document, "command")
    assert problem["tool"] == "ghost" and problem["severity"] == "error"
    assert problem["file"] == str(bench.tools / "ghost" / "tool.yaml")
    assert {tool["name"]: tool["ok"] for tool in document["tools"]} == {"ghost": False, "ok": True}


def test_a_program_the_sandbox_cannot_see_is_an_error_even_when_the_host_has_it(bench: ToolBench) -> None:
    # /root and /etc exist on the host but are not in the sandbox's view.
    bench.tool("hidden", ECHO_TOOL, command=[sys.executable, "main.py"], env={"PATH": "/etc:/usr/bin"})
    bench.tool("byname", ECHO_TOOL, command=["passwd-not-a-program"], env={"PATH": "/etc"})
    status, document = report(bench)
    assert status == 1
    tools = {problem["tool"] for problem in problems(document, "command")}
    assert tools == {"byname"} | ({"hidden"} if not sys.executable.startswith("/usr/") else set())


def test_a_missing_or_unreadable_script_is_an_error(bench: ToolBench) -> None:
    bench.tool("missing", ECHO_TOOL, command=["python3", "nope.py"])
    secret = bench.tool("private", ECHO_TOOL)
    (secret / "main.py").chmod(0o600)  # the sandbox user is not the owner
    closed = bench.tool("closed", ECHO_TOOL, command=["python3", "lib/main.py"])
    (closed / "lib").mkdir(mode=0o700)
    (closed / "main.py").rename(closed / "lib" / "main.py")
    (closed / "lib").chmod(0o700)
    status, document = report(bench)
    assert status == 1
    found = {problem["tool"]: problem["reason"] for problem in problems(document, "command")}
    assert set(found) == {"missing", "private", "closed"}
    assert "does not exist" in found["missing"]
    assert "o+r" in found["private"] and "o+x" in found["closed"]


def test_a_relative_program_must_be_an_executable_in_the_tool_folder(bench: ToolBench) -> None:
    folder = bench.tool("script", ECHO_TOOL, command=["./run.sh"])
    (folder / "run.sh").write_text("#!/bin/sh\nexec python3 main.py\n")
    (folder / "run.sh").chmod(0o744)  # executable by its owner only
    bench.tool("fine", ECHO_TOOL, command=["../../bin/sh", "-c", "exec python3 main.py"])
    status, document = report(bench)
    assert status == 1
    [problem] = problems(document, "command")
    assert problem["tool"] == "script"
    (folder / "run.sh").chmod(0o755)
    assert report(bench)[0] == 0


def test_rules_and_tool_settings_that_match_no_tool_are_warnings_and_exit_zero(bench: ToolBench) -> None:
    bench.tool("ok", ECHO_TOOL, tags=["read"])
    bench.policy["roles"]["user"]["allow"] = ["*", "tag:nothing", "old_tool"]
    bench.policy["roles"]["user"]["deny"] = ["ok"]
    bench.policy["tools"] = {"renamed_tool": {"timeout_ms": 100}}
    status, document = report(bench)
    assert status == 0
    reasons = sorted(problem["reason"] for problem in problems(document, "policy"))
    assert reasons == [
        "roles.user.allow: rule 'old_tool' matches no tool",
        "roles.user.allow: rule 'tag:nothing' matches no tool",
        "tools.renamed_tool: no tool of that name is loaded",
    ]
    assert all(problem["severity"] == "warning" for problem in document["problems"])
    human = validate(bench)
    assert human.returncode == 0
    assert "warning: renamed_tool: tools.renamed_tool: no tool of that name is loaded" in human.stdout
    assert "ok: ok (" in human.stdout
    assert human.stdout.rstrip().endswith("1 tools, 0 errors, 3 warnings")


def test_a_network_the_policy_never_grants_is_an_error(bench: ToolBench) -> None:
    bench.tool("online", ECHO_TOOL, network=True)
    status, document = report(bench)
    assert status == 1
    [problem] = problems(document, "network")
    assert problem["tool"] == "online" and problem["severity"] == "error"
    bench.policy["limits"]["network"] = True
    assert report(bench)[0] == 0


def test_load_problems_keep_their_invalid_lines_beside_the_deep_ones(bench: ToolBench) -> None:
    bench.tool("ok", ECHO_TOOL)
    (bench.tools / "broken").mkdir()
    (bench.tools / "broken" / "tool.yaml").write_text("name: broken\n")
    bench.tool("ghost", ECHO_TOOL, command=["no-such-interpreter-xyz"])
    done = validate(bench)
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert any(line.startswith(f"invalid: {bench.tools / 'broken' / 'tool.yaml'}: ") for line in lines)
    assert any(line.startswith("error: ghost: command 'no-such-interpreter-xyz'") for line in lines)
    assert [line for line in lines if line.startswith("ok:")] == [f"ok: ok ({bench.tools / 'ok'})"]
    _, document = report(bench)
    [manifest] = problems(document, "manifest")
    assert manifest["tool"] == "broken" and manifest["severity"] == "error"


def test_an_unreachable_docker_daemon_is_an_error_of_the_docker_tools_only(bench: ToolBench) -> None:
    bench.tool("ok", ECHO_TOOL)
    bench.tool("boxed", ECHO_TOOL, sandbox="docker", image="runner/base:latest")
    status, document = report(bench, env={"DOCKER_HOST": f"unix://{bench.root}/no-daemon.sock"})
    assert status == 1
    [problem] = document["problems"]
    assert problem["tool"] == "boxed" and problem["check"] == "image"
    assert "cannot check image runner/base:latest" in problem["reason"]


def test_a_tool_the_policy_moves_into_docker_without_an_image_is_an_error(bench: ToolBench) -> None:
    bench.tool("moved", ECHO_TOOL)
    bench.policy["tools"] = {"moved": {"sandbox": "docker"}}
    status, document = report(bench)
    assert status == 1
    [problem] = document["problems"]
    assert (problem["tool"], problem["check"], problem["severity"]) == ("moved", "image", "error")


@pytest.mark.docker
def test_a_missing_image_or_a_program_the_image_lacks_is_an_error(
    bench: ToolBench, docker_client: APIClient
) -> None:
    bench.tool("fine", ECHO_TOOL, sandbox="docker", image="runner/base:latest")
    bench.tool("noimage", ECHO_TOOL, sandbox="docker", image="runner/never-built-xyz:latest")
    bench.tool("nonode", ECHO_TOOL, sandbox="docker", image="runner/base:latest", command=["node", "main.js"])
    status, document = report(bench)
    assert status == 1
    found = {(p["tool"], p["check"]): p["reason"] for p in document["problems"]}
    assert set(found) == {("noimage", "image"), ("nonode", "command")}
    assert "runner images build" in found[("noimage", "image")]
    assert "'node' is not found in image runner/base:latest" in found[("nonode", "command")]


# Secrets: the manifest's `secrets:` and the policy's grants arrive with another branch;
# the checks read them with getattr, so here they are given as plain objects.
