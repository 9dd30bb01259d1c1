"""The tool-side helper ``runner_tool`` is in every sandbox without the author copying it:
read-only at ``sandboxes.view.LIBRARY_MOUNT``, on ``PYTHONPATH`` after the manifest's own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import ToolBench
from docker import APIClient

from sandboxes.view import LIBRARY_MOUNT

# Uses the helper, then tries to change it (the mounted copy and, by its real path, the
# file that was imported) and reports what happened.
HELPER_USER = """
import os, runner_tool
from runner_tool import run

def attempt(path):
    try:
        with open(path, "a") as handle:
            handle.write("# poisoned")
        return "written"
    except OSError as exc:
        return type(exc).__name__

def main(params, context):
    return {
        "attempt": context["attempt"],
        "helper": os.path.realpath(runner_tool.__file__),
        "pythonpath": os.environ["PYTHONPATH"],
        "bytecode": os.path.isfile(runner_tool.__cached__),
        "write": attempt(runner_tool.__file__),
        "create": attempt(os.path.join(os.path.dirname(runner_tool.__file__), "extra.py")),
    }

if __name__ == "__main__":
    run(main)
"""


def assert_helper_worked_and_stayed_intact(answer: dict[str, object], library: str) -> None:
    assert answer["success"] is True, answer
    result = answer["result"]
    assert isinstance(result, dict)
    assert result["attempt"] == 1
    assert result["helper"] == f"{library}/runner_tool.py"
    assert result["write"] != "written"
    assert result["create"] != "written"


def test_a_python_tool_imports_the_helper_in_the_subprocess_sandbox_and_cannot_change_it(
    bench: ToolBench,
) -> None:
    bench.tool("helped", HELPER_USER)
    answer = bench.runner().handle({"toolName": "helped", "params": {}})
    assert_helper_worked_and_stayed_intact(answer, LIBRARY_MOUNT)
    assert answer["result"]["bytecode"] is True  # compiled once by the runner, not per call


def test_the_manifests_own_pythonpath_comes_first_and_the_helper_after_it(bench: ToolBench) -> None:
    bench.tool("helped", HELPER_USER, env={"PYTHONPATH": "/tool/lib"})
    answer = bench.runner().handle({"toolName": "helped", "params": {}})
    assert answer["result"]["pythonpath"] == f"/tool/lib:{LIBRARY_MOUNT}"


@pytest.mark.skipif(os.geteuid() != 0, reason="degraded runs drop to another uid only as root")
def test_a_degraded_run_finds_the_helper_by_its_host_copy_which_the_tool_cannot_change(
    bench: ToolBench,
) -> None:
    # No bubblewrap: the tool sees the host, and PYTHONPATH names the backend's copy.
    bench.policy["sandbox"] = {"backends": {"subprocess": {"allow_degraded": True, "bwrap": "/nonexistent"}}}
    bench.tool("helped", HELPER_USER)
    answer = bench.runner().handle({"toolName": "helped", "params": {}})
    assert answer["success"] is True, answer
    library = answer["result"]["pythonpath"]
    assert library != LIBRARY_MOUNT and os.path.isabs(library)
    assert_helper_worked_and_stayed_intact(answer, library)
    assert "poisoned" not in Path(library, "runner_tool.py").read_text()


@pytest.mark.docker
def test_a_python_tool_imports_the_helper_in_a_container_and_cannot_change_it(
    bench: ToolBench, docker_client: APIClient
) -> None:
    bench.tool("helped", HELPER_USER, sandbox="docker", image="runner/base:latest")
    answer = bench.runner().handle({"toolName": "helped", "params": {}})
    assert_helper_worked_and_stayed_intact(answer, LIBRARY_MOUNT)


# Its finalizer is heard only when Python's own shutdown runs (``run(..., fast_exit=True)``
# skips it when nothing but 0, 1 and 2 is open: true in every sandbox, which leaks no
# descriptor to the tool).
FINALIZED = """
import json, os, sys
from runner_tool import run

class Speaks:
    def __del__(self):
        sys.stderr.write("finalized\\n")

KEEP = Speaks()
run(lambda params, context: sorted(os.listdir("/proc/self/fd")), fast_exit=True)
"""


def attempt_stderr(bench: ToolBench) -> str:
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    return str(next(event["stderr"] for event in events if event["event"] == "call.attempt"))


@pytest.mark.parametrize("backend", ["subprocess", pytest.param("docker", marks=pytest.mark.docker)])
def test_a_python_tool_with_fast_exit_ends_without_pythons_shutdown_in_every_sandbox(
    bench: ToolBench, backend: str
) -> None:
    extra = {"image": "runner/base:latest"} if backend == "docker" else {}
    bench.tool("speaks", FINALIZED, sandbox=backend, **extra)
    with bench.runner() as runner:
        answer = runner.handle({"toolName": "speaks", "params": {}})
    assert answer["success"] is True, answer
    assert answer["result"][:3] == ["0", "1", "2"]  # and the listing's own, closed since
    assert len(answer["result"]) == 4
    assert "finalized" not in attempt_stderr(bench)


CRASHES = """
from runner_tool import run

def main(params, context):
    return {"ratio": params["n"] / 0}

if __name__ == "__main__":
    run(main)
"""


def test_an_uncaught_exception_is_a_tool_error_with_its_last_line_and_is_not_retried(
    bench: ToolBench,
) -> None:
    bench.tool("crashy", CRASHES)
    answer = bench.runner().handle(
        {"toolName": "crashy", "params": {"n": 1}, "options": {"retries": 3, "retryDelay": 1000}}
    )
    error = answer["error"]
    assert error["code"] == "EXECUTION_ERROR"
    assert error["message"] == "ZeroDivisionError: division by zero"
    assert error["details"]["reason"] == "tool_error"
    assert error["details"]["toolDetails"] == {"exception": "ZeroDivisionError"}
    assert error["retryable"] is False
    assert answer["metadata"]["attempts"] == 1  # the same bug every time: no retry, no waiting
    assert "main.py:" in error["details"]["stderr"]  # where it was raised, for the operator


def test_an_uncaught_exception_quoting_a_secret_reaches_the_answer_scrubbed(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cr3t-value-that-must-not-leak"
    monkeypatch.setenv("LEAKY_HOST_VARIABLE", secret)
    bench.tool(
        "leaky",
        "import os\nfrom runner_tool import run\n"
        "def main(params, context):\n    raise RuntimeError('key is ' + os.environ['API_TOKEN'])\n"
        "run(main)\n",
        secrets=["API_TOKEN"],
    )
    bench.policy["secrets"] = {"API_TOKEN": {"env": "LEAKY_HOST_VARIABLE"}}
    bench.policy.setdefault("tools", {})["leaky"] = {"secrets": ["API_TOKEN"]}
    answer = bench.runner().handle({"toolName": "leaky", "params": {}})
    assert answer["error"]["details"]["reason"] == "tool_error", answer
    assert answer["error"]["message"].startswith("RuntimeError: key is ")
    assert secret not in json.dumps(answer)
    assert secret not in bench.audit_log.read_text()
