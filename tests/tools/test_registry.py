"""Loading tool directories: bad manifests are reported and left out, good ones stay."""

from __future__ import annotations

from pathlib import Path

from conftest import ToolBench, write_tool

from runner.tools.registry import Registry


def test_bad_manifests_are_reported_with_path_and_reason_and_the_rest_load(bench: ToolBench) -> None:
    bench.tool("good", "print(1)")
    bad = bench.tools / "bad_yaml"
    bad.mkdir()
    (bad / "tool.yaml").write_text("name: [unclosed\n")
    bench.tool("unknown_key", "", color="blue")
    bench.tool("bad_schema", "", parameters={"type": "object", "properties": {"a": {"type": "nope"}}})
    bench.tool("not_object", "", parameters={"type": "string"})
    bench.tool("BadName", "")
    bench.tool("no_command", "", command=[])
    bench.tool("docker_no_image", "", sandbox="docker")
    bench.tool("env_clash", "", env={"HOME": "/root"})
    bench.tool("no_such_backend", "", sandbox="nsjail")
    registry = bench.runner().registry  # with the installed backends' own rules
    assert [tool.name for tool in registry] == ["good"]
    reasons = {problem.path.parent.name: problem.reason for problem in registry.problems}
    assert set(reasons) == {
        "bad_yaml",
        "unknown_key",
        "bad_schema",
        "not_object",
        "BadName",
        "no_command",
        "docker_no_image",
        "env_clash",
        "no_such_backend",
    }
    assert "color" in reasons["unknown_key"]
    assert "image" in reasons["docker_no_image"]
    assert "nsjail" in reasons["no_such_backend"]
    assert all(str(problem.path).endswith("tool.yaml") for problem in registry.problems)


def test_a_duplicate_name_across_directories_keeps_the_first(tmp_path: Path) -> None:
    write_tool(tmp_path / "a", "dup", "print(1)")
    write_tool(tmp_path / "b", "dup", "print(2)")
    registry = Registry.load([tmp_path / "a", tmp_path / "b"])
    assert len(registry) == 1
    kept = registry.get("dup")
    assert kept is not None
    assert kept.directory == (tmp_path / "a" / "dup").resolve()
    assert "duplicate" in registry.problems[0].reason


def test_remote_refs_are_never_fetched(bench: ToolBench) -> None:
    bench.tool(
        "remote_ref",
        "import sys\nsys.stdin.read()\nprint(1)\n",
        parameters={"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:9/schema.json"}}},
    )
    answer = bench.runner().handle({"toolName": "remote_ref", "params": {"a": 1}})
    assert answer["success"] is False
    assert answer["error"]["code"] == "INVALID_PARAMS"
    assert answer["metadata"]["attempts"] == 0


def test_a_manifest_s_variable_cannot_hold_a_nul_byte(bench: ToolBench) -> None:
    # In the file of bubblewrap's arguments, where each ends at a NUL, what follows one
    # would be read as options of its own: a bind of a host folder, the filter dropped.
    bench.tool("injects", "", env={"Z": "x\0--bind\0/\0/tool"})
    registry = Registry.load([bench.tools])
    assert len(registry) == 0
    (problem,) = registry.problems
    assert problem.path.parent.name == "injects" and "NUL" in str(problem), problem


def test_a_manifest_cannot_set_the_launcher_s_variables(bench: ToolBench) -> None:
    bench.tool("steer", "", env={"RUNNER_STAGE": "/"})
    bench.tool("preload", "", env={"LD_PRELOAD": "/tmp/x.so"})
    registry = Registry.load([bench.tools])
    assert len(registry) == 0
    assert {p.path.parent.name for p in registry.problems} == {"steer", "preload"}
