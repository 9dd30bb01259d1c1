"""``runner new`` and the tool-side helper ``runner_tool``: a scaffolded tool validates and
answers its sample params at once; the helper prints results and error documents."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import answer_of, installed_command

from runner.tools.scaffold import SAMPLE_FILE
from sandboxes.view import LIBRARY_SOURCE


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """``runner init`` into a folder of its own, with a home of its own."""
    folder = tmp_path / "project"
    folder.mkdir()
    (tmp_path / "home").mkdir()
    assert runner_command("init", cwd=folder).returncode == 0
    return folder


def runner_command(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNNER_") and k != "XDG_CONFIG_HOME"}
    return subprocess.run(
        [installed_command(), *args],
        cwd=cwd,
        env={**clean, "HOME": str(cwd.parent / "home")},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_new_python_tool_validates_and_answers_its_sample_params(project: Path) -> None:
    made = runner_command("new", "hello", cwd=project)
    assert made.returncode == 0, made.stderr
    folder = project / "tools" / "hello"
    assert sorted(p.name for p in folder.iterdir()) == sorted(["tool.yaml", "main.py", SAMPLE_FILE])
    manifest = yaml.safe_load((folder / "tool.yaml").read_text())
    assert manifest["name"] == "hello"
    assert manifest["sandbox"] == "subprocess"
    assert "from runner_tool import" in (folder / "main.py").read_text()
    validated = runner_command("validate", cwd=project)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "ok: hello" in validated.stdout
    done = runner_command("exec", "hello", "--params", "@tools/hello/sample.json", cwd=project)
    assert done.returncode == 0, done.stdout + done.stderr
    answer = answer_of(done)
    assert answer["result"] == {"greeting": "Hello, world!", "attempt": 1}
    assert answer["content"] == [{"type": "text", "text": "Hello, world!"}]  # its event, shown


def test_new_sh_tool_needs_nothing_but_the_contract(project: Path) -> None:
    made = runner_command("new", "shout", "--lang", "sh", cwd=project)
    assert made.returncode == 0, made.stderr
    folder = project / "tools" / "shout"
    assert sorted(p.name for p in folder.iterdir()) == sorted(["tool.yaml", "main.sh", SAMPLE_FILE])
    assert runner_command("validate", cwd=project).returncode == 0
    done = runner_command("exec", "shout", "--params", "@tools/shout/sample.json", cwd=project)
    assert done.returncode == 0, done.stdout + done.stderr
    result = answer_of(done)["result"]
    assert result["tool"] == "shout"
    assert result["request_bytes"] > 0


def test_new_docker_tool_names_its_image_and_validates(project: Path) -> None:
    made = runner_command("new", "boxed", "--docker", cwd=project)
    assert made.returncode == 0, made.stderr
    manifest = yaml.safe_load((project / "tools" / "boxed" / "tool.yaml").read_text())
    assert manifest["sandbox"] == "docker"
    assert manifest["image"] == "runner/python-tools:latest"
    assert runner_command("validate", cwd=project).returncode == 0


def test_new_refuses_an_existing_folder_and_a_bad_name(project: Path) -> None:
    assert runner_command("new", "hello", cwd=project).returncode == 0
    again = runner_command("new", "hello", cwd=project)
    assert again.returncode == 2
    assert "already exists" in again.stderr
    bad = runner_command("new", "Bad Name", cwd=project)
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1
    assert not (project / "tools" / "Bad Name").exists()


def test_new_writes_into_the_tools_folder_given(project: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "mine"
    made = runner_command("new", "hello", "--tools", str(elsewhere), cwd=project)
    assert made.returncode == 0, made.stderr
    assert (elsewhere / "hello" / "tool.yaml").is_file()
    assert not (project / "tools" / "hello").exists()


def test_exec_reads_params_from_stdin_with_at_dash(project: Path) -> None:
    done = runner_command("exec", "add_numbers", "--params", "@-", cwd=project, stdin='{"a": 2, "b": 5}')
    assert answer_of(done)["result"] == 7


# The helper itself, run as a tool is run: a request on stdin, the answer on stdout.


def run_helper_tool(
    tmp_path: Path, body: str, request: object, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "main.py").write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, "main.py"],
        cwd=tmp_path,
        # The helper where every sandbox puts it: on PYTHONPATH, not in the tool's folder.
        env={
            "PATH": os.environ.get("PATH", ""),
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(LIBRARY_SOURCE),
            **(env or {}),
        },
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=30,
    )


REQUEST = {"params": {"x": 2}, "context": {"requestId": "req_1", "toolName": "t", "attempt": 3}}


def test_helper_prints_the_result_and_exits_zero(tmp_path: Path) -> None:
    done = run_helper_tool(
        tmp_path,
        """
        from runner_tool import run
        run(lambda params, context: {"double": params["x"] * 2, "attempt": context["attempt"]})
        """,
        REQUEST,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"double": 4, "attempt": 3}


def test_helper_turns_a_tool_error_into_the_error_document_and_exit_one(tmp_path: Path) -> None:
    done = run_helper_tool(
        tmp_path,
        """
        from runner_tool import ToolError, run

        def main(params, context):
            raise ToolError("no such city", code="NOT_FOUND", retryable=True, details={"city": "x"})

        run(main)
        """,
        REQUEST,
    )
    assert done.returncode == 1
    assert json.loads(done.stdout) == {
        "error": {"message": "no such city", "code": "NOT_FOUND", "retryable": True, "details": {"city": "x"}}
    }


def test_helper_reports_any_other_exception_as_a_tool_error_and_one_line_on_stderr(tmp_path: Path) -> None:
    done = run_helper_tool(
        tmp_path,
        """
        from runner_tool import run
        run(lambda params, context: params["missing"])
        """,
        REQUEST,
    )
    assert done.returncode == 1
    error = json.loads(done.stdout)["error"]
    assert error == {
        "message": "KeyError: 'missing'",
        "retryable": False,
        "details": {"exception": "KeyError"},
    }
    assert len(done.stderr.strip().splitlines()) == 1
    assert "KeyError" in done.stderr
    assert "Traceback" not in done.stderr


def test_helper_refuses_a_result_that_is_not_json(tmp_path: Path) -> None:
    done = run_helper_tool(
        tmp_path,
        """
        from runner_tool import run
        run(lambda params, context: float("nan"))
        """,
        REQUEST,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert "not JSON" in done.stderr


def test_helper_workspace_path_refuses_paths_that_leave_the_workspace(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    body = """
        from runner_tool import run, workspace_path
        run(lambda params, context: str(workspace_path(params["path"])))
        """
    granted = {"WORKSPACE": str(workspace)}

    def call(path: str, env: dict[str, str] | None) -> subprocess.CompletedProcess[str]:
        return run_helper_tool(tmp_path, body, {"params": {"path": path}, "context": {}}, env)

    inside = call("a/b.txt", granted)
    assert inside.returncode == 0, inside.stderr
    assert json.loads(inside.stdout) == str(workspace.resolve() / "a" / "b.txt")
    for escape in ("../etc", "/etc/passwd", "."):
        refused = call(escape, granted)
        assert refused.returncode == 1
        assert json.loads(refused.stdout)["error"]["code"] == "OUTSIDE_WORKSPACE"
    ungranted = call("a.txt", None)
    assert json.loads(ungranted.stdout)["error"]["code"] == "NO_WORKSPACE"


# A global whose finalizer speaks: it is heard only when Python's own shutdown runs.
FINALIZED = """
import sys
from runner_tool import ToolError, run

class Speaks:
    def __del__(self):
        sys.stderr.write("finalized\\n")

KEEP = Speaks()
"""
ATEXIT = "import atexit\natexit.register(lambda: sys.stderr.write('atexit ran\\n'))\n"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("run(lambda params, context: params['x'] + 1, fast_exit=True)", 0),
        ("def fail(params, context):\n    raise ToolError('no', code='NO')\nrun(fail, fast_exit=True)", 1),
        (ATEXIT + "run(lambda params, context: params['x'] + 1, fast_exit=True)", 0),
    ],
)
def test_helper_with_fast_exit_skips_pythons_shutdown_when_it_has_nothing_to_do(
    tmp_path: Path, body: str, code: int
) -> None:
    done = run_helper_tool(tmp_path, FINALIZED + body, REQUEST)
    assert done.returncode == code, done.stderr
    assert json.loads(done.stdout) in (3, {"error": {"message": "no", "code": "NO", "retryable": False}})
    assert "finalized" not in done.stderr  # the objects were left to the kernel, not torn down
    # The atexit callbacks (logging's flush, say) still run, once.
    assert done.stderr.count("atexit ran") == (1 if "atexit" in body else 0)


@pytest.mark.parametrize(
    ("setup", "proof"),
    [
        # A file object that still holds unwritten data: only the shutdown writes it.
        ("LOG = open('log.txt', 'w')\nLOG.write('kept')", "log"),
        # The same, on the descriptor that was stdin's: still a file, not the standard stream.
        ("", "log"),
        (
            "import threading, time\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), sys.stderr.write('thread done\\n'))).start()",
            "thread done",
        ),
    ],
)
def test_helper_with_fast_exit_keeps_pythons_shutdown_when_the_tool_left_work_for_it(
    tmp_path: Path, setup: str, proof: str
) -> None:
    body = FINALIZED + (f"{setup}\nrun(lambda params, context: 1, fast_exit=True)" if setup else CLOSES_STDIN)
    done = run_helper_tool(tmp_path, body, REQUEST)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "1"
    assert "finalized" in done.stderr
    if proof == "log":
        assert (tmp_path / "log.txt").read_text() == "kept"
    else:
        assert proof in done.stderr


# The tool's own code closes stdin (already read) and opens a file, which takes fd 0.
CLOSES_STDIN = """
import os

def main(params, context):
    global LOG
    os.close(0)
    LOG = open("log.txt", "w")
    assert LOG.fileno() == 0
    LOG.write("kept")
    return 1

run(main, fast_exit=True)
"""


def test_helper_without_fast_exit_exits_the_ordinary_way(tmp_path: Path) -> None:
    # SystemExit is raised, so code around run() (a finally, a test harness) still runs.
    body = (
        FINALIZED
        + "try:\n    run(lambda params, context: 1)\nfinally:\n    sys.stderr.write('finally ran\\n')"
    )
    done = run_helper_tool(tmp_path, body, REQUEST)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "1"
    assert "finally ran" in done.stderr
    assert "finalized" in done.stderr
