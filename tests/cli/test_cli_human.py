"""The command line for people (on a terminal) and for programs (piped), as real processes.

A terminal is a real pty: the runner decides by ``isatty`` alone, so these tests see what a
person sees. Piped output is compared with the machine formats scripts already parse.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import click
import psutil
import pytest
import yaml
from conftest import ToolBench, starter_dir

from runner.audit.follow import follow
from runner.audit.query import AuditFilter

RUNNER = [sys.executable, "-m", "runner"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
ENV_VARS = ("RUNNER_TOOLS", "RUNNER_POLICIES", "RUNNER_AUDIT_LOG", "XDG_CONFIG_HOME", "NO_COLOR")


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "COLUMNS", "LINES")}
    return {**env, "TERM": "xterm-256color", "RUNNER_AUDIT_LOG": os.devnull, **(extra or {})}


def piped(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RUNNER, *args], capture_output=True, text=True, env=_env(env), cwd=cwd or starter_dir(), timeout=60
    )


def on_terminal(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[int, str, str]:
    """Exit status, stdout (a 160-column pty, CRLF undone) and stderr of a runner command."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    with subprocess.Popen(
        [*RUNNER, *args],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=subprocess.PIPE,
        env=_env(env),
        cwd=cwd or starter_dir(),
    ) as process:
        os.close(slave)
        chunks = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        os.close(master)
        assert process.stderr is not None
        stderr = process.stderr.read().decode()
        code = process.wait(timeout=60)
    return code, b"".join(chunks).decode().replace("\r\n", "\n"), stderr


# -- terminal formats, and piped ones unchanged -----------------------------------------------


def test_list_is_a_coloured_table_on_a_terminal_and_the_same_plain_lines_when_piped() -> None:
    code, shown, _ = on_terminal("list")
    assert code == 0
    header = ANSI.sub("", shown.splitlines()[0]).split()
    assert header == ["NAME", "SANDBOX", "TAGS", "DESCRIPTION"]
    assert "\x1b[" in shown
    tools = json.loads(piped("list", "--json").stdout)["tools"]
    expected = "".join(
        f"{t['name']:<20} {t['metadata']['sandbox']:<10} [{','.join(t['metadata']['tags'])}] {t['description']}\n"
        for t in tools
    )
    assert piped("list").stdout == expected
    assert all(t["name"] in shown for t in tools)


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"NO_COLOR": ""}, {"TERM": "dumb"}])
def test_no_color_or_a_dumb_terminal_gets_the_table_without_colour(env: dict[str, str]) -> None:
    code, shown, _ = on_terminal("list", env=env)
    assert code == 0
    assert "\x1b" not in shown
    assert shown.split()[:4] == ["NAME", "SANDBOX", "TAGS", "DESCRIPTION"]


def test_exec_on_a_terminal_is_indented_readable_json_and_piped_stays_one_ascii_line() -> None:
    message = (
        "héllo 日本 \u202e \x9b[31m"  # readable letters; a bidi override and a C1 CSI that must stay inert
    )
    params = json.dumps({"message": message})
    code, shown, _ = on_terminal("exec", "echo", "--params", params, env={"NO_COLOR": "1"})
    assert code == 0
    assert "héllo 日本" in shown
    assert "\u202e" not in shown and "\x9b" not in shown
    assert "\\u202e" in shown and "\\u009b" in shown
    assert shown.startswith("{\n  ")
    answer = json.loads(shown)
    assert answer["result"]["message"] == message
    done = piped("exec", "echo", "--params", params)
    assert done.returncode == 0
    assert done.stdout.count("\n") == 1 and done.stdout.isascii()
    assert json.loads(done.stdout)["result"]["message"] == message


def test_coloured_exec_json_is_the_same_document_once_the_colours_are_removed() -> None:
    code, shown, _ = on_terminal("exec", "add_numbers", "--params", '{"a": 1, "b": 2}')
    assert code == 0
    assert "\x1b[" in shown
    answer = json.loads(ANSI.sub("", shown))
    assert answer["result"] == 3 and answer["success"] is True
    failed_code, failed, _ = on_terminal("exec", "add_numbers", "--params", '{"a": "x"}')
    assert failed_code == 1
    assert json.loads(ANSI.sub("", failed))["error"]["code"] == "INVALID_PARAMS"


def test_doctor_is_a_table_on_a_terminal_and_the_same_lines_when_piped() -> None:
    code, shown, _ = on_terminal("doctor")
    layers = json.loads(piped("doctor", "--json").stdout)
    assert code == (0 if all(layer["ok"] for layer in layers) else 1)
    assert ANSI.sub("", shown).split()[:4] == ["STATUS", "BACKEND", "LAYER", "DETAIL"]
    lines = piped("doctor").stdout.splitlines()
    assert len(lines) == len(layers)
    for line, layer in zip(lines, layers, strict=True):
        assert line.startswith("ok     " if layer["ok"] else "MISSING")


def _audit_log(tmp_path: Path) -> Path:
    events = [
        {
            "event": "policy.decision",
            "timestamp": "2026-01-01T00:00:00.000Z",
            "requestId": "req_a",
            "toolName": "echo",
            "role": "user",
            "decision": "allow",
            "reason": "allowed",
        },
        {
            "event": "policy.decision",
            "timestamp": "2026-01-01T00:00:01.000Z",
            "requestId": "req_b",
            "toolName": "evil\x1b[2J",
            "role": "user",
            "decision": "deny",
            "reason": "not_allowed",
        },
        {
            "event": "call.finished",
            "timestamp": "2026-01-01T00:00:02.000Z",
            "requestId": "req_a",
            "toolName": "echo",
            "role": "user",
            "success": True,
            "attempts": 1,
            "duration": 12,
        },
        {
            "event": "call.finished",
            "timestamp": "2026-01-01T00:00:03.000Z",
            "requestId": "req_c",
            "toolName": "slow",
            "role": "user",
            "success": False,
            "code": None,
            "reason": None,
            "attempts": 1,
            "duration": 40,
            "cancelled": True,
        },
    ]
    log = tmp_path / "audit.log"
    log.write_text("".join(json.dumps(event) + "\n" for event in events))
    return log


def test_audit_is_a_coloured_table_on_a_terminal_with_hostile_values_escaped(tmp_path: Path) -> None:
    log = _audit_log(tmp_path)
    code, shown, _ = on_terminal("audit", "--log", str(log))
    assert code == 0
    plain = ANSI.sub("", shown).splitlines()
    assert plain[0].split() == ["TIMESTAMP", "EVENT", "REQUESTID", "TOOLNAME", "ROLE", "OUTCOME"]
    assert len(plain) == 5
    assert "None" not in shown and plain[4].endswith("cancelled attempts=1 40ms")  # a cancelled call
    assert "\x1b[2J" not in shown and "evil\\x1b[2J" in shown
    assert "\x1b[31m" in shown  # the denial in red
    piped_table = piped("audit", "--log", str(log)).stdout.splitlines()
    assert "None" not in piped_table[4]
    assert piped_table[0].split() == ["timestamp", "event", "requestId", "toolName", "role", "outcome"]
    assert "\x1b[" not in "".join(piped_table[1:]).replace("\\x1b[", "")


# -- runner show ----------------------------------------------------------------------------


def test_show_gives_schemas_resolved_limits_and_the_roles_the_policy_lets_call_it() -> None:
    sheet = json.loads(piped("show", "write_file", "--json").stdout)
    assert sheet["name"] == "write_file"
    assert sheet["paramsSchema"]["required"] == ["path", "content"]
    assert sheet["outputSchema"]["required"] == ["path", "bytes"]
    assert sheet["command"] == ["python3", "main.py"]
    assert sheet["asks"] == {"network": False, "workspace": "write", "secrets": [], "secretsGranted": []}
    assert sheet["roles"]["user"] == {"allowed": False, "reason": "not_allowed", "rule": None}
    assert sheet["roles"]["admin"] == {"allowed": True, "reason": "allowed", "rule": "tag:write"}
    policy = yaml.safe_load((starter_dir() / "policies.yaml").read_text())
    assert sheet["metadata"]["limits"]["timeoutMs"] <= policy["limits"]["timeout_ms"]
    assert sheet["runsIn"]["sandbox"] == "subprocess"
    assert piped("show", "write_file").stdout == piped("show", "write_file", "--json").stdout  # piped: JSON


def test_show_limits_are_those_a_call_gets(bench: ToolBench) -> None:
    bench.tool("capped", "print(1)\n", limits={"timeout_ms": 99999, "memory_mb": 64})
    bench.policy["limits"]["timeout_ms"] = 3000
    bench.policy["tools"] = {"capped": {"memory_mb": 32, "retries": 2}}
    bench.runner()
    env = {"RUNNER_TOOLS": str(bench.tools), "RUNNER_POLICIES": str(bench.root / "policies.yaml")}
    sheet = json.loads(piped("show", "capped", env=env).stdout)
    assert sheet["metadata"]["limits"]["timeoutMs"] == 3000  # capped by the ceiling
    assert sheet["metadata"]["limits"]["memoryMb"] == 32  # the policy's tools override wins
    assert sheet["calls"]["retries"] == 2


def test_show_names_the_secrets_asked_and_granted_and_the_policy_refuses_the_rest(bench: ToolBench) -> None:
    bench.tool("keyed", "print(1)\n", secrets=["A_KEY", "B_KEY"])
    bench.policy["secrets"] = {"A_KEY": {"env": "HOST_A_KEY"}}
    bench.policy["tools"] = {"keyed": {"secrets": ["A_KEY"]}}
    bench.runner()
    env = {
        "RUNNER_TOOLS": str(bench.tools),
        "RUNNER_POLICIES": str(bench.root / "policies.yaml"),
        "HOST_A_KEY": "value-never-shown",
    }
    done = piped("show", "keyed", env=env)
    sheet = json.loads(done.stdout)
    assert sheet["asks"]["secrets"] == ["A_KEY", "B_KEY"]
    assert sheet["asks"]["secretsGranted"] == ["A_KEY"]
    assert sheet["roles"]["user"]["allowed"] is False and sheet["roles"]["user"]["reason"] == "secret"
    assert "value-never-shown" not in done.stdout
    code, shown, _ = on_terminal("show", "keyed", env={**env, "NO_COLOR": "1"})
    assert code == 0
    assert "A_KEY (granted), B_KEY (NOT granted)" in shown


def test_show_on_a_terminal_reads_as_a_sheet() -> None:
    code, shown, _ = on_terminal("show", "write_file", env={"NO_COLOR": "1"})
    assert code == 0
    assert shown.startswith("write_file\n")
    assert re.search(r"may call\s+admin\n", shown)
    assert re.search(r"may not\s+user \(not_allowed\)", shown)
    assert "params schema" in shown and '"content"' in shown


def test_show_of_an_unknown_tool_says_so_in_one_line_and_exits_one() -> None:
    done = piped("show", "no_such_tool")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and "no_such_tool" in done.stderr and "Traceback" not in done.stderr


# -- help -------------------------------------------------------------------------------------


def _commands(
    group: click.Group, prefix: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], click.Command]]:
    found: list[tuple[tuple[str, ...], click.Command]] = []
    for name, command in group.commands.items():
        found.append(((*prefix, name), command))
        if isinstance(command, click.Group):
            found += _commands(command, (*prefix, name))
    return found


def test_every_option_of_every_command_has_help_and_every_command_names_its_environment() -> None:
    from runner.cli import cli

    commands = _commands(cli)
    assert {"list", "show", "exec", "audit", "doctor", "validate"} <= {path[0] for path, _ in commands}
    for path, command in [((), cli), *commands]:
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"runner {' '.join(path)} {param.opts[0]} has no help"
        assert command.epilog and "Environment" in command.epilog, path


def test_help_of_exec_describes_each_option_and_the_variables_it_reads() -> None:
    done = piped("exec", "--help")
    assert done.returncode == 0
    for option in (
        "--params",
        "--role",
        "--timeout",
        "--retries",
        "--retry-delay",
        "--deadline",
        "--format",
        "--request-id",
        "--step-id",
        "--tools",
        "--policies",
        "--audit-log",
    ):
        assert option in done.stdout
    for variable in ENV_VARS:
        assert variable in done.stdout
    assert all(variable in piped("--help").stdout for variable in ENV_VARS)


# -- Ctrl-C --------------------------------------------------------------------------------------

SLOW_TOOL = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole foreground group
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a child to outlive it
sys.stdin.read()
time.sleep(60)
"""


def _tool_processes(request_id: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get("REQUEST_ID") == request_id and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


@pytest.mark.parametrize("presses", [1, 3])
def test_ctrl_c_during_exec_exits_130_after_the_sandbox_is_gone_and_audits_the_cancel(
    bench: ToolBench, presses: int
) -> None:
    bench.tool("slow", SLOW_TOOL, limits={"timeout_ms": 30000})
    bench.runner()
    request_id = f"req_ctrl_c_{presses}"
    env = {**_env(None), "RUNNER_AUDIT_LOG": str(bench.audit_log)}
    argv = [
        *RUNNER,
        "--tools",
        str(bench.tools),
        "--policies",
        str(bench.root / "policies.yaml"),
        "exec",
        "slow",
        "--request-id",
        request_id,
        "--retries",
        "0",
        "--deadline",
        "30000",
    ]
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=bench.root, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 20
        while len(_tool_processes(request_id)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_tool_processes(request_id)) >= 2, "the tool and its child never started"
        for _ in range(presses):  # as a terminal does: to the whole foreground process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGINT)
            time.sleep(0.01)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        _stop(process)
    assert process.returncode == 130, (stdout, stderr)
    assert b"Traceback" not in stderr
    # Nothing else either, but for a rare warning of asyncio's child watcher (a race of the
    # subprocess sandbox's reaping under cancellation, not of the CLI; see the branch notes).
    assert all(b"Unknown child process pid" in line for line in stderr.splitlines()), stderr
    assert stdout == b""
    assert _tool_processes(request_id) == []
    finished = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    finished = [e for e in finished if e["event"] == "call.finished" and e["requestId"] == request_id]
    assert len(finished) == 1
    assert finished[0]["cancelled"] is True and finished[0]["success"] is False


# -- audit --follow --------------------------------------------------------------------------------


class Lines:
    """Lines of a child's stdout as they come, each waited for at most ``timeout_s``."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        self._fd = process.stdout.fileno()
        self._buffer = b""

    def next(self, timeout_s: float = 10.0) -> str:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._fd], [], [], max(deadline - time.monotonic(), 0))
            assert ready, f"no line in time (so far {self._buffer!r})"
            chunk = os.read(self._fd, 65536)
            assert chunk, "the output ended"
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
    for stream in (process.stdout, process.stderr):  # else left to a later test's collector
        if stream is not None:
            stream.close()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _where_it_waits(pid: int) -> str:
    """What a process that did not end is doing: its state and the kernel call it waits in."""
    try:
        state = next(
            row for row in Path(f"/proc/{pid}/status").read_text().splitlines() if row.startswith("State")
        )
        return f"{state}, waiting in {Path(f'/proc/{pid}/wchan').read_text() or 'nothing'}"
    except (OSError, StopIteration):
        return "gone"


def test_audit_follow_prints_appended_events_as_they_come_and_ends_on_ctrl_c(tmp_path: Path) -> None:
    log = _audit_log(tmp_path)
    process = subprocess.Popen(
        [*RUNNER, "audit", "--follow", "--json", "--log", str(log), "--tool", "echo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(None),
        start_new_session=True,
        # Ctrl-C as a terminal delivers it, whatever the test's parent ignores: a process
        # started with SIGINT ignored (a background job of a script) keeps ignoring it.
        preexec_fn=_default_sigint,  # noqa: PLW1509 - one signal call
    )
    lines = Lines(process)
    try:
        assert json.loads(lines.next())["requestId"] == "req_a"
        assert json.loads(lines.next())["event"] == "call.finished"
        new = {
            "event": "call.finished",
            "timestamp": "2026-01-01T00:00:09.000Z",
            "requestId": "req_new",
            "toolName": "echo",
            "role": "user",
            "success": False,
            "code": "TIMEOUT",
        }
        text = json.dumps(new) + "\n"
        with log.open("a") as writer:  # half a line first: it must wait for the rest
            writer.write(text[:20])
            writer.flush()
            time.sleep(0.5)
            writer.write(text[20:])
            writer.write(json.dumps({**new, "requestId": "req_other", "toolName": "other"}) + "\n")
        assert json.loads(lines.next()) == new
        os.killpg(process.pid, signal.SIGINT)
        try:
            rest, stderr = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 10 s after SIGINT: {_where_it_waits(process.pid)}")
    finally:
        _stop(process)
    assert process.returncode == 0
    assert rest == b"" and stderr == b""


def test_audit_follow_ends_quietly_when_its_reader_goes_away(tmp_path: Path) -> None:
    log = _audit_log(tmp_path)
    process = subprocess.Popen(
        [*RUNNER, "audit", "--follow", "--log", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(None),
    )
    try:
        assert Lines(process).next().split()[0] == "timestamp"
        assert process.stdout is not None
        process.stdout.close()  # `| head -1`: no new event will ever be written to find out
        assert process.wait(timeout=10) == 0
        assert process.stderr is not None
        assert process.stderr.read() == b""
        process.stderr.close()
    finally:
        _stop(process)


def _rotate(log: Path, event: dict[str, str]) -> None:
    log.rename(log.with_suffix(".log.1"))
    log.write_text(json.dumps(event) + "\n")


def test_follow_reads_a_truncated_or_rotated_log_again_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    first = {"event": "call.finished", "requestId": "req_1", "pad": "so that the truncated log is shorter"}
    log.write_text(json.dumps(first) + "\n")
    steps: list[Callable[[], object]] = [
        lambda: None,  # nothing new: the follower waits
        lambda: log.write_text(
            json.dumps({"event": "call.finished", "requestId": "req_2"}) + "\n"
        ),  # truncated
        lambda: _rotate(log, {"event": "call.finished", "requestId": "req_3"}),
    ]
    sleeps = iter(steps)
    seen: list[str] = []

    def sleep(_: float) -> None:
        step = next(sleeps, None)
        if step is None:
            raise AssertionError(f"no more changes to the log, and only {seen} seen")
        step()

    for event in follow(log, AuditFilter(), lambda: len(seen) >= 3, sleep):
        seen.append(event["requestId"])
    assert seen == ["req_1", "req_2", "req_3"]


# -- messages ---------------------------------------------------------------------------------------


def test_bad_json_is_reported_by_line_and_column_never_by_a_python_name() -> None:
    cases = [
        piped("exec", "add_numbers", "--params", '{"a": 1,\n "b": }'),
        subprocess.run(
            [*RUNNER, "exec", "-"],
            input='{"toolName": "echo"\n\n  x}',
            capture_output=True,
            text=True,
            env=_env(None),
            cwd=starter_dir(),
            timeout=60,
        ),
    ]
    for done, where in zip(cases, ("line 2, column 7", "line 3, column 3"), strict=True):
        assert done.returncode == 2
        assert where in done.stderr, done.stderr
        assert "Error" not in done.stderr and "Traceback" not in done.stderr


def test_a_call_without_a_role_is_refused_in_words_not_as_role_none(bench: ToolBench) -> None:
    bench.tool("plain", "print(1)\n")
    del bench.policy["default_role"]
    bench.runner()
    env = {"RUNNER_TOOLS": str(bench.tools), "RUNNER_POLICIES": str(bench.root / "policies.yaml")}
    answer = json.loads(piped("exec", "plain", env=env).stdout)
    assert answer["error"]["code"] == "PERMISSION_DENIED"
    assert "None" not in answer["error"]["message"]
    listed = piped("list", env=env)
    assert listed.returncode == 2 and "None" not in listed.stderr


def test_invalid_params_lists_every_failing_field_bounded_and_keeps_the_first_errors_keys(
    bench: ToolBench,
) -> None:
    fields = {f"f{i:02d}": {"type": "integer"} for i in range(30)}
    schema = {"type": "object", "properties": {**fields, "a_token": {"type": "integer", "x-sensitive": True}}}
    bench.tool("many", "print(1)\n", parameters=schema)
    with bench.runner() as runner:
        answer = runner.handle(
            {"toolName": "many", "params": {**dict.fromkeys(fields, "x"), "a_token": "hunter2"}}
        )
        details = answer["error"]["details"]
        assert answer["error"]["code"] == "INVALID_PARAMS"
        assert {"field", "problem", "validator"} <= set(details)  # as before, the first error
        assert details["field"] == "a_token"
        assert details["errors"][0] == {"path": details["field"], "message": details["problem"]}
        assert len(details["errors"]) == 20 and details["moreErrors"] == 31 - 20
        assert [error["path"] for error in details["errors"][1:]] == [f"f{i:02d}" for i in range(19)]
        assert "hunter2" not in json.dumps(answer)  # every listed field is masked as the first was
        few = runner.handle({"toolName": "many", "params": {"f03": "z", "f04": 4, "a_token": "s3cr3t-value"}})
        assert [e["path"] for e in few["error"]["details"]["errors"]] == ["a_token", "f03"]
        assert "moreErrors" not in few["error"]["details"]


# -- the first hour: what a newcomer tripped on ----------------------------------------------


def test_show_works_for_every_shipped_tool_piped_and_on_a_terminal() -> None:
    names = [tool["name"] for tool in json.loads(piped("list", "--json").stdout)["tools"]]
    assert "get_weather" in names  # the one with an egress allow-list
    for name in names:
        done = piped("show", name)
        assert done.returncode == 0, (name, done.stderr)
        sheet = json.loads(done.stdout)
        code, shown, err = on_terminal("show", name, env={"NO_COLOR": "1"})
        assert code == 0 and "Traceback" not in err, (name, err)
        assert name in shown
    weather = json.loads(piped("show", "get_weather").stdout)
    assert weather["asks"]["network"] == {"allow": ["api.openweathermap.org:443"]}
    _, shown, _ = on_terminal("show", "get_weather", env={"NO_COLOR": "1"})
    assert "only api.openweathermap.org:443" in shown
    assert sheet  # the last one parsed as JSON too


def _calls(bench: ToolBench, count: int) -> None:
    bench.tool("adder", "import json, sys\nprint(json.load(sys.stdin)['params'].get('n', 0))\n")
    runner = bench.runner()
    for n in range(count):
        assert runner.handle({"toolName": "adder", "params": {"n": n}, "requestId": f"req-{n}"})["success"]
    runner.close()


def test_audit_last_shows_the_newest_events_newest_last(bench: ToolBench) -> None:
    _calls(bench, 5)
    done = piped("audit", "--last", "2", "--json", "--log", str(bench.audit_log))
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [e["requestId"] for e in events] == ["req-4", "req-4"]  # the attempt, then the finish
    assert events[-1]["event"] == "call.finished"
    everything = [
        json.loads(line)
        for line in piped("audit", "--json", "--log", str(bench.audit_log)).stdout.splitlines()
    ]
    assert everything[-2:] == events  # the same two, in the log's order
    oldest = piped("audit", "--limit", "1", "--json", "--log", str(bench.audit_log))
    assert json.loads(oldest.stdout)["requestId"] == everything[0]["requestId"]  # --limit: unchanged


def test_a_piped_audit_report_never_cuts_its_last_column(bench: ToolBench) -> None:
    bench.tool("adder", "import json, sys\nprint(json.load(sys.stdin)['params'].get('n', 0))\n")
    bench.tool("broken", "import sys\nsys.exit(3)\n")
    runner = bench.runner()
    for request in (
        {"toolName": "adder", "params": {"n": "not a number", "extra": 1}},
        {"toolName": "nothing_by_that_name"},
        {"toolName": "broken", "options": {"retries": 0}},
        {"toolName": "adder", "params": {"n": 1}, "role": "nobody_has_this_role"},
    ):
        runner.handle(request)
    runner.close()
    done = piped("audit", "report", "--log", str(bench.audit_log), env={"COLUMNS": "60"})
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout and "..." not in done.stdout
    for reason in ("EXECUTION_ERROR exit_code 1", "PERMISSION_DENIED unknown_role 1", "TOOL_NOT_FOUND - 1"):
        assert reason in done.stdout


def test_mistyped_names_get_the_closest_valid_ones(bench: ToolBench, tmp_path: Path) -> None:
    bench.tool("adder", "print(1)\n", limts={"timeout_ms": 100})
    bench.tool("typed", "print(1)\n", parameters={"type": "object", "properties": {"n": {"type": "strng"}}})
    bench.tool("broken_yaml", "print(1)\n")
    (bench.tools / "broken_yaml" / "tool.yaml").write_text("name: broken_yaml\ntags: [a, b\n")
    bench.tool("fine", "print(1)\n")
    bench.runner().close()
    done = piped("validate", "--tools", str(bench.tools), "--policies", str(bench.root / "policies.yaml"))
    assert "limts: Extra inputs are not permitted (did you mean limits?)" in done.stdout
    assert "'strng' is not valid under any of the given schemas (did you mean string?)" in done.stdout
    assert "the types are array, boolean, integer, null, number, object, string" in done.stdout
    assert "<unicode string>" not in done.stdout and "in tool.yaml, line 2" in done.stdout
    policy = yaml.safe_load((bench.root / "policies.yaml").read_text())
    policy["defualt_role"] = policy.pop("default_role", "user")
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(policy))
    done = piped("validate", "--tools", str(bench.tools), "--policies", str(tmp_path / "typo.yaml"))
    assert (
        "defualt_role: Extra inputs are not permitted (did you mean default_role" in done.stderr + done.stdout
    )
    answer = json.loads(
        piped(
            "exec", "fin", "--tools", str(bench.tools), "--policies", str(bench.root / "policies.yaml")
        ).stdout
    )
    assert answer["error"]["code"] == "TOOL_NOT_FOUND"
    assert "(did you mean fine?)" in answer["error"]["message"]


def test_a_tool_name_is_suggested_only_among_the_tools_the_role_may_call(bench: ToolBench) -> None:
    bench.tool("secret_admin_tool", "print(1)\n")
    bench.policy["whitelist"] = ["secret_admin_tool"]
    bench.policy["roles"] = {"user": {"allow": []}, "admin": {"allow": ["secret_admin_tool"]}}
    runner = bench.runner()
    refused = runner.handle({"toolName": "secret_admin_too", "role": "user"})
    assert "did you mean" not in refused["error"]["message"]
    offered = runner.handle({"toolName": "secret_admin_too", "role": "admin"})
    assert "(did you mean secret_admin_tool?)" in offered["error"]["message"]
    runner.close()


def test_validate_warns_about_a_scaffold_placeholder_description(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    assert piped("init", cwd=project).returncode == 0
    assert piped("new", "hello", cwd=project).returncode == 0
    done = piped("validate", cwd=project)
    assert "warning: hello: the description is still runner new's placeholder" in done.stdout


def test_a_hanging_tool_is_reported_in_plain_words(bench: ToolBench) -> None:
    bench.tool("hangs", "import time\ntime.sleep(60)\n")
    answer = bench.runner().handle({"toolName": "hangs", "options": {"timeout": 300, "retries": 0}})
    assert answer["error"]["code"] == "TIMEOUT"
    assert answer["error"]["message"] == "hangs did not finish within its timeout of 300 ms, so it was killed"


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_runner_completion_prints_a_script_and_the_commands_complete(shell: str) -> None:
    done = piped("completion", shell)
    assert done.returncode == 0, done.stderr
    assert "_RUNNER_COMPLETE" in done.stdout
    completed = subprocess.run(
        RUNNER,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **_env(None),
            "_RUNNER_COMPLETE": "bash_complete",
            "COMP_WORDS": "runner mcp re",
            "COMP_CWORD": "2",
        },
    )
    assert completed.stdout.split() == ["plain,remove"], completed.stdout + completed.stderr
