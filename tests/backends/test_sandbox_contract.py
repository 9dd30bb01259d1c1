"""One contract, every backend: the same behaviours through subprocess and docker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import ToolBench

BACKENDS = ["subprocess", pytest.param("docker", marks=pytest.mark.docker)]

ECHO = "import json, sys\njson.dump(json.load(sys.stdin), sys.stdout)\n"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "docker":
        request.getfixturevalue("docker_client")
    name: str = request.param
    return name


def tool(bench: ToolBench, backend: str, name: str, code: str, **manifest: object) -> None:
    if backend == "docker":
        manifest.update(sandbox="docker", image="runner/base:latest")
    bench.tool(name, code, **manifest)


def call(bench: ToolBench, name: str, **options: object) -> dict[str, Any]:
    return bench.runner().handle(
        {
            "toolName": name,
            "params": {"x": 1},
            "requestId": f"req_contract_{name}",
            "options": {"retries": 0, **options},
        }
    )


def test_success_returns_the_parsed_stdout(bench: ToolBench, backend: str) -> None:
    tool(bench, backend, "echo", ECHO)
    answer = call(bench, "echo")
    assert answer["success"] is True
    assert answer["result"] == {
        "params": {"x": 1},
        "context": {"requestId": "req_contract_echo", "toolName": "echo", "attempt": 1},
    }


def test_a_non_zero_exit_keeps_its_code_and_stderr(bench: ToolBench, backend: str) -> None:
    tool(
        bench, backend, "fails", "import sys\nsys.stdin.read()\nprint('bad', file=sys.stderr)\nsys.exit(5)\n"
    )
    answer = call(bench, "fails")
    assert answer["error"]["code"] == "EXECUTION_ERROR"
    assert answer["error"]["details"]["exitCode"] == 5
    assert answer["error"]["details"]["reason"] == "exit_code"
    assert "bad" in answer["error"]["details"]["stderr"]


def test_a_timeout_kills_the_tool(
    bench: ToolBench, backend: str, no_survivors: Callable[[str], None]
) -> None:
    tool(bench, backend, "sleepy", "import sys, time\nsys.stdin.read()\ntime.sleep(60)\n")
    answer = call(bench, "sleepy", timeout=800)
    assert answer["error"]["code"] == "TIMEOUT"
    assert answer["metadata"]["duration"] < 4000
    no_survivors("req_contract_sleepy")


def test_output_past_the_cap_is_an_output_limit(bench: ToolBench, backend: str) -> None:
    tool(
        bench,
        backend,
        "flood",
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
        limits={"max_output_bytes": 50_000},
    )
    answer = call(bench, "flood")
    assert answer["error"]["details"]["reason"] == "output_limit"


def test_memory_past_the_limit_is_a_memory_limit(bench: ToolBench, backend: str) -> None:
    tool(
        bench,
        backend,
        "hog",
        "import sys\nsys.stdin.read()\nb = [bytearray(8 << 20) for _ in range(64)]\n",
        limits={"memory_mb": 64},
    )
    answer = call(bench, "hog")
    assert answer["error"]["details"]["reason"] == "memory_limit"


def test_the_environment_is_the_minimal_set(bench: ToolBench, backend: str) -> None:
    tool(
        bench,
        backend,
        "env",
        "import json, os, sys\nsys.stdin.read()\njson.dump(dict(os.environ), sys.stdout)\n",
        env={"EXTRA": "1"},
    )
    env = call(bench, "env")["result"]
    allowed = {"PATH", "LANG", "HOME", "TMPDIR", "TOOL_NAME", "REQUEST_ID", "EXTRA", "HOSTNAME", "PYTHONPATH"}
    required = {"PATH", "LANG", "HOME", "TMPDIR", "TOOL_NAME", "REQUEST_ID", "EXTRA", "PYTHONPATH"}
    assert required <= set(env) <= allowed  # PYTHONPATH: where the tool-side helper is
    assert env["TOOL_NAME"] == "env"


def test_a_tool_that_never_reads_stdin_still_answers(bench: ToolBench, backend: str) -> None:
    tool(bench, backend, "deaf", "print('{\"ok\": 1}')\n")
    answer = bench.runner().handle({"toolName": "deaf", "params": {"blob": "z" * 2_000_000}})
    assert answer["result"] == {"ok": 1}


def test_the_root_and_tool_folder_are_read_only_and_tmp_is_writable(bench: ToolBench, backend: str) -> None:
    code = """
import json, os, sys
sys.stdin.read()
result = {}
for path in ("/tool/x", "/x", "/usr/x", os.environ["TMPDIR"] + "/x"):
    try:
        open(path, "w").write("x")
        result[path] = "written"
    except OSError as exc:
        result[path] = "refused"
json.dump(result, sys.stdout)
"""
    tool(bench, backend, "writer", code)
    result = call(bench, "writer")["result"]
    assert result.pop("/tmp/x") == "written"
    assert set(result.values()) == {"refused"}
