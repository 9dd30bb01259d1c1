"""The policy file: whitelist, disabled, roles, inheritance, globs, tags, ceilings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench

from runner import ConfigError, Runner

OK = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"


@pytest.fixture
def tools(bench: ToolBench) -> ToolBench:
    bench.tool("calc.add", OK, tags=["math"])
    bench.tool("files.read", OK, tags=["read"])
    bench.tool("files.write", OK, tags=["write"])
    bench.tool("legacy", OK)
    bench.policy.update(
        whitelist=["calc.*", "tag:read", "files.write", "legacy"],
        disabled=["legacy"],
        roles={
            "user": {"allow": ["tag:math", "files.read"]},
            "admin": {"inherits": ["user"], "allow": ["tag:write", "legacy"]},
            "auditor": {"inherits": ["admin"], "deny": ["tag:write"]},
        },
    )
    return bench


def reason(answer: dict[str, Any]) -> str | None:
    return answer["error"]["details"]["reason"] if answer["error"] else None


def test_allowed_by_glob_and_tag_for_the_default_role(tools: ToolBench) -> None:
    runner = tools.runner()
    assert runner.handle({"toolName": "calc.add"})["success"] is True
    assert runner.handle({"toolName": "files.read"})["success"] is True


def test_a_role_without_an_allow_rule_is_denied(tools: ToolBench) -> None:
    answer = tools.runner().handle({"toolName": "files.write", "role": "user"})
    assert answer["error"]["code"] == "PERMISSION_DENIED"
    assert reason(answer) == "not_allowed"


def test_inherited_roles_get_their_parents_rules(tools: ToolBench) -> None:
    runner = tools.runner()
    assert runner.handle({"toolName": "files.write", "role": "admin"})["success"] is True
    assert runner.handle({"toolName": "calc.add", "role": "admin"})["success"] is True


def test_deny_wins_over_an_inherited_allow(tools: ToolBench) -> None:
    answer = tools.runner().handle({"toolName": "files.write", "role": "auditor"})
    assert reason(answer) == "denied_by_role"


def test_a_disabled_tool_is_denied_even_when_allowed(tools: ToolBench) -> None:
    answer = tools.runner().handle({"toolName": "legacy", "role": "admin"})
    assert answer["error"]["code"] == "PERMISSION_DENIED"
    assert reason(answer) == "disabled"


def test_a_tool_outside_the_whitelist_never_runs(tools: ToolBench) -> None:
    tools.tool("stray", OK, tags=["math"])
    answer = tools.runner().handle({"toolName": "stray", "role": "admin"})
    assert reason(answer) == "not_whitelisted"


def test_an_unknown_role_is_denied(tools: ToolBench) -> None:
    answer = tools.runner().handle({"toolName": "calc.add", "role": "root"})
    assert reason(answer) == "unknown_role"


def test_without_a_default_role_a_call_must_name_one(tools: ToolBench) -> None:
    tools.policy.pop("default_role")
    runner = tools.runner()
    assert reason(runner.handle({"toolName": "calc.add"})) == "no_role"
    assert runner.handle({"toolName": "calc.add", "role": "user"})["success"] is True


def test_a_tool_asking_for_network_is_refused_when_the_policy_gives_none(tools: ToolBench) -> None:
    tools.tool("fetcher", OK, network=True)
    tools.policy["whitelist"].append("fetcher")
    tools.policy["roles"]["user"]["allow"].append("fetcher")
    answer = tools.runner().handle({"toolName": "fetcher"})
    assert reason(answer) == "network"


def test_ceilings_cap_what_the_call_and_manifest_ask_for(bench: ToolBench) -> None:
    bench.tool("greedy", OK, limits={"memory_mb": 4096, "timeout_ms": 999999})
    bench.policy["limits"] = {"memory_mb": 100, "timeout_ms": 1500, "max_pids": 16}
    tools = bench.runner().discover()
    limits = tools[0]["metadata"]["limits"]
    assert limits["memoryMb"] == 100
    assert limits["timeoutMs"] == 1500
    assert limits["maxPids"] == 16


def test_per_tool_policy_overrides_beat_the_manifest(bench: ToolBench) -> None:
    bench.tool("slow", OK, limits={"timeout_ms": 1000})
    bench.policy["tools"] = {"slow": {"timeout_ms": 2500}}
    assert bench.runner().discover()[0]["metadata"]["limits"]["timeoutMs"] == 2500


@pytest.mark.parametrize(
    "text",
    [
        "version: 1\nroles: {a: {inherits: [b]}, b: {inherits: [a]}}\n",
        "version: 1\nroles: {a: {inherits: [ghost]}}\n",
        "version: 1\nwhitelist: [\n",
        "version: 2\n",
        "version: 1\nsurprise: true\n",
        "version: 1\ndefault_role: nobody\n",
        "- just a list\n",
    ],
)
def test_a_broken_policy_file_stops_the_runner_with_a_clear_message(tmp_path: Path, text: str) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        Runner.load(tools=tmp_path, policies=path, audit_log=tmp_path / "a.log")
    assert str(path) in str(caught.value)


def test_a_missing_policy_file_stops_the_runner(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        Runner.load(tools=tmp_path, policies=tmp_path / "absent.yaml", audit_log=tmp_path / "a.log")


@pytest.mark.parametrize(
    ("socket", "problem"),
    [
        ({"uids": {1001: "nobody-role"}}, "serve.socket.uids: uid 1001 has role 'nobody-role'"),
        ({"max_open": 0}, "max_open"),
        ({"read_timeout_ms": 10}, "read_timeout_ms"),
        ({"uid": {1001: "user"}}, "uid"),
    ],
)
def test_serve_socket_settings_are_checked(tools: ToolBench, socket: dict[str, Any], problem: str) -> None:
    tools.policy["serve"] = {"socket": socket}
    with pytest.raises(ConfigError, match=problem):
        tools.runner()


def test_serve_socket_admits_a_uid_with_a_defined_role(tools: ToolBench) -> None:
    tools.policy["serve"] = {"socket": {"uids": {1001: "user"}}}
    assert tools.runner().policy.model.serve.socket.uids == {1001: "user"}


@pytest.mark.parametrize("name", ["cpu_seconds", "max_pids", "disk_mb", "memory_mb", "timeout_ms"])
def test_a_limit_no_sandbox_can_set_is_refused_where_it_is_written(bench: ToolBench, name: str) -> None:
    # 10**26 passed `runner validate`; every call then failed with the sandbox's own words
    # ("Illegal number", "Numerical result out of range").
    huge = 10**26
    bench.tool("big", OK, limits={name: huge})
    answer = bench.runner().handle({"toolName": "big"})
    assert answer["error"]["details"]["reason"] == "invalid_manifest", answer["error"]
    bench.policy["limits"][name] = huge
    with pytest.raises(ConfigError, match=name):
        bench.runner()
