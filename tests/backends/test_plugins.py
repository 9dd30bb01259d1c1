"""A backend shipped as a distribution of its own serves a manifest's ``sandbox:`` with no
change to this repository: the test builds and installs one into a virtual environment."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import ToolBench

PLUGIN_PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "runner-tagged-backend"
version = "0.1"

[project.entry-points."runner.sandboxes"]
tagged = "runner_tagged_backend:create"

[tool.setuptools]
py-modules = ["runner_tagged_backend"]
"""

# The plugin's whole code: its own config model, and the hardened backend underneath
# (a real plugin would bring its own isolation; this one tags what it serves).
PLUGIN_MODULE = """
import dataclasses
from sandboxes import BackendConfigError, plugins


class Tagged:
    name = "tagged"

    def __init__(self, tag):
        self.tag = tag
        self.inner = plugins.create("subprocess", {})

    async def prepare(self, spec, limits):
        spec = dataclasses.replace(spec, env={**spec.env, "SERVED_BY": self.tag})
        return await self.inner.prepare(spec, limits)

    def tool_problems(self, tool):
        return [] if tool.command[0] == "python3" else ["command: the tagged backend runs python3 only"]


def create(config):
    unknown = set(config) - {"tag"}
    if unknown:
        raise BackendConfigError(f"sandbox.backends.tagged: unknown keys {sorted(unknown)}")
    return Tagged(config.get("tag", "tagged"))
"""


@pytest.fixture(scope="module")
def venv_with_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plugin")
    source = root / "src"
    source.mkdir()
    (source / "pyproject.toml").write_text(PLUGIN_PYPROJECT)
    (source / "runner_tagged_backend.py").write_text(PLUGIN_MODULE)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, str(source)], check=True, capture_output=True)
    return venv


def test_a_backend_from_another_distribution_serves_its_tools(
    bench: ToolBench, venv_with_plugin: Path
) -> None:
    bench.tool(
        "served",
        "import json, os, sys\nsys.stdin.read()\nprint(json.dumps({'by': os.environ.get('SERVED_BY')}))\n",
        sandbox="tagged",
    )
    bench.tool("shell", "", sandbox="tagged", command=["sh", "-c", "echo {}"])
    bench.policy["sandbox"] = {"backends": {"tagged": {"tag": "the-plugin"}}}
    (bench.root / "policies.yaml").write_text(yaml.safe_dump(bench.policy))  # unusable here: no plugin
    script = textwrap.dedent(
        """
        import json, sys
        from runner import Runner
        runner = Runner.load(tools=sys.argv[1], policies=sys.argv[2], audit_log="/dev/null")
        answer = runner.handle({"toolName": "served"})
        problems = {p.path.parent.name: p.reason for p in runner.registry.problems}
        print(json.dumps({"answer": answer, "problems": problems}))
        """
    )
    python = str(venv_with_plugin / "bin" / "python")
    done = subprocess.run(
        [python, "-c", script, str(bench.tools), str(bench.root / "policies.yaml")],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    report = json.loads(done.stdout)
    assert report["answer"]["success"] is True, report
    assert report["answer"]["result"] == {"by": "the-plugin"}
    assert "python3 only" in report["problems"]["shell"]  # the plugin's own manifest rule


def test_without_the_plugin_its_tools_are_reported_not_run(bench: ToolBench) -> None:
    bench.tool("served", "print('{}')\n", sandbox="tagged")
    runner = bench.runner()
    assert runner.registry.get("served") is None
    (problem,) = runner.registry.problems
    assert "tagged" in problem.reason


def test_a_bad_backend_setting_stops_the_load_naming_the_file(bench: ToolBench) -> None:
    from runner.errors import ConfigError

    bench.policy["sandbox"] = {"backends": {"subprocess": {"no_such_setting": 1}}}
    with pytest.raises(ConfigError) as raised:
        bench.runner()
    assert "policies.yaml" in str(raised.value)
    assert "no_such_setting" in str(raised.value)
