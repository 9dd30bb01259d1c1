"""``runner mcp add``: a PyPI or npm MCP server installed into a tool folder that OUR sandbox
runs. Real installs from the registries, one of each package per session; the
servers are then started in the subprocess (and docker) sandbox by a probe tool that speaks
MCP to them: initialize, tools/list, one tools/call."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import FILES, TIME, answer_of, installed_command, new_project, runner_command

from runner.call.policy import Policy, PolicyModel
from runner.mcp.hosted.grants import needed_grants
from runner.mcp.hosted.packages import McpAddError, check_module, node_program

# A normal tool that starts the installed server's command as its child and speaks MCP to
# it over pipes; it reports what the server listed and answered, and its peak memory.
PROBE = r"""
import json, subprocess, sys, time
params = json.load(sys.stdin)["params"]
started = time.monotonic()
server = subprocess.Popen(params["command"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)

def send(message):
    server.stdin.write(json.dumps(message) + "\n")
    server.stdin.flush()

def receive(wanted):
    for line in server.stdout:
        message = json.loads(line)
        if message.get("id") == wanted:
            return message
    raise SystemExit("the server closed stdout: " + server.stderr.read()[-2000:])

send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "probe", "version": "0"}}})
receive(1)
initialized = time.monotonic() - started
send({"jsonrpc": "2.0", "method": "notifications/initialized"})
send({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
listed = receive(2)["result"]["tools"]
send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": params["call"]})
called = receive(3)["result"]
status = dict(line.split(":", 1) for line in open(f"/proc/{server.pid}/status"))
server.stdin.close()
server.wait(10)
json.dump({"initializeMs": round(initialized * 1000), "tools": [tool["name"] for tool in listed],
           "call": called, "peakRssKb": int(status["VmHWM"].split()[0]),
           "threads": int(status["Threads"])}, sys.stdout)
"""


def _report(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def _manifest(folder: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((folder / "tool.yaml").read_text())
    return manifest


def _leftovers(tools: Path) -> list[str]:
    return sorted(path.name for path in tools.iterdir() if path.name.startswith("."))


@pytest.mark.registry
@pytest.mark.slow
def test_pip_server_gets_a_venv_of_the_system_python_and_a_kind_mcp_manifest(
    installed: dict[str, Any],
) -> None:
    report = _report(installed["time"])
    folder = installed["project"] / "tools" / "time"
    assert report["manifest"] == str(folder / "tool.yaml")
    manifest = _manifest(folder)
    assert manifest["name"] == "time"
    assert manifest["kind"] == "mcp"
    assert manifest["sandbox"] == "subprocess"
    assert manifest["command"] == ["venv/bin/python3", "-m", "mcp_server_time", "--local-timezone=UTC"]
    assert TIME in manifest["description"]
    assert manifest["limits"]["memory_mb"] >= 128
    # The sandbox runs /usr/bin/python3: the venv must be made with it, not the runner's python.
    assert (folder / "venv" / "bin" / "python3").resolve() == Path("/usr/bin/python3").resolve()
    assert "home = /usr/bin" in (folder / "venv" / "pyvenv.cfg").read_text()
    # The registry loaded after the install lists the server's tools through the sandbox.
    assert {tool["name"] for tool in report["tools"]} == {"time_get_current_time", "time_convert_time"}
    assert report["problems"] == []
    # Each tool by its name: time_* would grant a server named time_more too.
    assert "time_get_current_time" in report["grantsYaml"] and "time_*" not in report["grantsYaml"]
    assert set(report["grants"]["roles"]["user"]["allow"]) == {"time_get_current_time", "time_convert_time"}


@pytest.mark.registry
@pytest.mark.slow
def test_npm_server_runs_node_on_its_bin_file_inside_the_folder(installed: dict[str, Any]) -> None:
    report = _report(installed["files"])
    folder = installed["project"] / "tools" / "files"
    manifest = _manifest(folder)
    assert manifest["kind"] == "mcp"
    assert manifest["command"] == ["node", f"node_modules/{FILES}/dist/index.js", "/tmp"]
    program = folder / manifest["command"][1]
    assert program.is_file()
    assert program.resolve().is_relative_to(folder.resolve())
    assert not (folder / "stale.txt").exists(), "--force replaces the folder, it does not merge"
    assert report["command"] == manifest["command"]
    assert {"files_read_text_file", "files_list_directory"} <= {tool["name"] for tool in report["tools"]}
    assert report["problems"] == []
    assert _leftovers(installed["project"] / "tools") == []


def _merge(policy: dict[str, Any], grants: dict[str, Any]) -> None:
    for key, value in grants.items():
        if isinstance(value, dict):
            _merge(policy.setdefault(key, {}), value)
        elif isinstance(value, list):
            policy[key] = [*policy.get(key, []), *value]
        else:
            policy[key] = value


@pytest.mark.registry
@pytest.mark.slow
def test_the_printed_grants_are_all_the_policy_needs_to_call_the_servers_tools(
    installed: dict[str, Any],
) -> None:
    project: Path = installed["project"]
    tools = str(project / "tools")
    refused = runner_command("exec", "time_get_current_time", "--params", '{"timezone": "UTC"}', cwd=project)
    assert answer_of(refused)["error"]["code"] == "PERMISSION_DENIED"
    policy = yaml.safe_load((project / "policies.yaml").read_text())
    for added in ("time", "files"):
        _merge(policy, _report(installed[added])["grants"])
    (project / "granted.yaml").write_text(yaml.safe_dump(policy))
    for tool, params in (
        ("time_get_current_time", {"timezone": "UTC"}),
        ("files_list_allowed_directories", {}),
    ):
        done = runner_command(
            "exec",
            tool,
            "--params",
            json.dumps(params),
            "--policies",
            "granted.yaml",
            "--tools",
            tools,
            cwd=project,
        )
        answer = answer_of(done)
        assert answer["success"], answer


@pytest.mark.registry
@pytest.mark.slow
def test_installed_files_are_readable_by_the_sandbox_user(installed: dict[str, Any]) -> None:
    for name in ("time", "files"):
        for directory, subdirs, files in os.walk(installed["project"] / "tools" / name):
            for entry in (*subdirs, *files):
                path = Path(directory, entry)
                if not path.is_symlink():
                    assert path.stat().st_mode & 0o004, path


def _probe(installed: dict[str, Any], name: str, call: dict[str, Any], **sandbox: str) -> dict[str, Any]:
    """Run the probe in a copy of the installed folder, in the sandbox asked for."""
    project: Path = installed["project"]
    folder = project / "probes" / f"{name}_{sandbox.get('sandbox', 'subprocess')}"
    if not folder.exists():
        shutil.copytree(project / "tools" / name, folder, symlinks=True)
        (folder / "probe.py").write_text(PROBE)
        manifest = {
            "name": folder.name,
            "description": f"start {name}'s server and speak MCP to it",
            "tags": ["read"],  # the starter policy lets role user call tag:read tools
            "command": ["python3", "probe.py"],
            "sandbox": "subprocess",
            "parameters": {"type": "object"},
            "limits": _manifest(project / "tools" / name)["limits"] | {"retries": 0},
            **sandbox,
        }
        (folder / "tool.yaml").write_text(yaml.safe_dump(manifest))
    params = {"command": _manifest(project / "tools" / name)["command"], "call": call}
    done = runner_command(
        "exec",
        folder.name,
        "--tools",
        str(folder.parent),
        "--params",
        json.dumps(params),
        cwd=project,
        timeout=120,
    )
    answer = answer_of(done)
    assert answer["success"], answer
    result: dict[str, Any] = answer["result"]
    return result


@pytest.mark.registry
@pytest.mark.slow
def test_pip_server_starts_and_answers_in_the_subprocess_sandbox(installed: dict[str, Any]) -> None:
    result = _probe(installed, "time", {"name": "get_current_time", "arguments": {"timezone": "UTC"}})
    assert {"get_current_time", "convert_time"} <= set(result["tools"])
    assert result["call"].get("isError") is not True, result["call"]
    assert "UTC" in json.dumps(result["call"])
    assert result["peakRssKb"] < 256 * 1024  # what the manifest's memory_mb allows


@pytest.mark.registry
@pytest.mark.slow
def test_npm_server_starts_and_answers_in_the_subprocess_sandbox(installed: dict[str, Any]) -> None:
    result = _probe(installed, "files", {"name": "list_allowed_directories", "arguments": {}})
    assert {"read_text_file", "list_directory"} <= set(result["tools"])
    assert "/tmp" in json.dumps(result["call"])
    # node starts ~11 threads and max_pids counts threads: the manifest leaves room.
    assert result["threads"] < _manifest(installed["project"] / "tools" / "files")["limits"]["max_pids"]


@pytest.mark.registry
@pytest.mark.slow
@pytest.mark.docker
def test_pip_server_starts_and_answers_in_the_docker_sandbox(
    installed: dict[str, Any], docker_client: object
) -> None:
    # runner/python-tools has /usr/bin/python3 3.11 like the host (the venv's python); it
    # has no node, so npm servers run in the subprocess sandbox only.
    result = _probe(
        installed,
        "time",
        {"name": "get_current_time", "arguments": {"timezone": "Europe/Paris"}},
        sandbox="docker",
        image="runner/python-tools:latest",
    )
    assert "get_current_time" in result["tools"]
    assert "Europe/Paris" in json.dumps(result["call"])


@pytest.mark.registry
@pytest.mark.slow
def test_module_check_finds_the_module_without_importing_it(installed: dict[str, Any]) -> None:
    venv = installed["project"] / "tools" / "time" / "venv"
    (site,) = (venv / "lib").glob("python3*/site-packages")
    check_module(site, "mcp_server_time")
    with pytest.raises(McpAddError) as wrong:
        check_module(site, "mcp_server_clock")
    assert wrong.value.reason == "no_module"
    assert "--module" in wrong.value.message
    assert "mcp_server_time" in wrong.value.message  # the runnable packages it found instead
    with pytest.raises(McpAddError) as no_main:
        check_module(site, "anyio")  # a package without __main__: python -m cannot run it
    assert no_main.value.reason == "no_module"


@pytest.mark.registry
@pytest.mark.slow
def test_bin_is_taken_from_the_installed_package_json(installed: dict[str, Any]) -> None:
    folder = installed["project"] / "tools" / "files"
    chosen = node_program(folder, FILES, "mcp-server-filesystem")
    assert chosen == f"node_modules/{FILES}/dist/index.js"
    with pytest.raises(McpAddError) as unknown:
        node_program(folder, FILES, "no-such-bin")
    assert unknown.value.reason == "no_bin"
    assert "mcp-server-filesystem" in unknown.value.message


@pytest.mark.registry
@pytest.mark.slow
def test_unknown_packages_fail_clearly_and_leave_no_folder(registries: None, tmp_path: Path) -> None:
    project = new_project(tmp_path / "project")
    for flag, package in (
        ("--pip", "runner-mcp-add-no-such-package-7f3a"),
        ("--npm", "runner-mcp-add-no-such-7f3a"),
    ):
        done = runner_command("mcp", "add", "ghost", flag, package, cwd=project)
        assert done.returncode == 2, done.stdout
        assert "failed" in done.stderr and package in done.stderr
        assert "Traceback" not in done.stderr
        assert not (project / "tools" / "ghost").exists()
        assert _leftovers(project / "tools") == []


# -- refused before anything is installed (no registry needed) ------------------------------


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return new_project(tmp_path / "project")


def test_no_python_run_by_mcp_add_imports_a_module_planted_in_the_current_folder(
    project: Path, tmp_path: Path
) -> None:
    # The probe (python3 -c "import venv, ensurepip"), python3 -m venv and the venv's pip
    # ran with the caller's folder first on sys.path: a venv.py planted there ran as root.
    planted = tmp_path / "planted"
    planted.mkdir()
    ran = tmp_path / "ran"
    for module in ("venv", "ensurepip", "pip"):
        (planted / f"{module}.py").write_text(
            f"open({str(ran)!r}, 'a').write({module!r})\nraise SystemExit(0)\n"
        )
    done = runner_command(
        "--policies",
        str(project / "policies.yaml"),
        "--tools",
        str(project / "tools"),
        "mcp",
        "add",
        "ghost",
        "--pip",
        "runner-mcp-add-no-such-package-7f3a",
        cwd=planted,
    )
    assert "Traceback" not in done.stderr
    assert not ran.exists(), f"{ran.read_text()} ran from the current folder"


@pytest.mark.parametrize("name", ["Time", "1time", "a/b", "..", "x" * 65, "t\u00e9", ""])
def test_a_bad_name_is_refused(project: Path, name: str) -> None:
    before = sorted(p.name for p in (project / "tools").iterdir())
    done = runner_command("mcp", "add", name, "--pip", TIME, cwd=project)
    assert done.returncode == 2
    assert "must match" in done.stderr
    assert sorted(p.name for p in (project / "tools").iterdir()) == before


@pytest.mark.parametrize(
    "flags",
    [
        ["--pip", "--index-url=https://example.invalid/simple"],
        ["--pip", "./local-folder"],
        ["--pip", "git+https://example.invalid/x.git"],
        ["--pip", "https://example.invalid/x-1.0.tar.gz"],
        ["--npm", "file:../x"],
        ["--npm", "../x"],
        ["--npm", "git+ssh://git@example.invalid/x.git"],
        ["--npm", "x@http://example.invalid/x.tgz"],
        ["--pip", TIME, "--module", "os; import sys"],
    ],
)
def test_a_package_that_is_not_a_registry_name_is_refused(project: Path, flags: list[str]) -> None:
    done = runner_command("mcp", "add", "srv", *flags, cwd=project)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert not (project / "tools" / "srv").exists()
    assert _leftovers(project / "tools") == []


def test_an_existing_folder_is_kept_without_force(project: Path) -> None:
    folder = project / "tools" / "add_numbers"
    before = sorted(p.name for p in folder.iterdir())
    done = runner_command("mcp", "add", "add_numbers", "--pip", TIME, cwd=project)
    assert done.returncode == 2
    assert "--force" in done.stderr
    assert sorted(p.name for p in folder.iterdir()) == before


@pytest.mark.parametrize(
    "flags",
    [[], ["--pip", TIME, "--npm", FILES], ["--pip", TIME, "--bin", "x"], ["--npm", FILES, "--module", "x"]],
)
def test_exactly_one_source_with_its_own_options(project: Path, flags: list[str]) -> None:
    done = runner_command("mcp", "add", "srv", *flags, cwd=project)
    assert done.returncode == 2
    assert done.stderr.startswith("runner: ")
    assert not (project / "tools" / "srv").exists()


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue  # it exited meanwhile
    return found


def test_sigterm_during_the_install_kills_it_and_leaves_no_folder(project: Path) -> None:
    tools = project / "tools"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNNER_")}
    with subprocess.Popen(
        [installed_command(), "mcp", "add", "stopped", "--pip", TIME],
        cwd=project,
        env={**clean, "HOME": str(project.parent / "home")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as adding:
        deadline = time.monotonic() + 60
        staging: list[Path] = []
        while not staging and time.monotonic() < deadline and adding.poll() is None:
            staging = [path for path in tools.glob(".stopped.*") if (path / "venv").exists()]
            time.sleep(0.01)
        assert staging, "the install never got as far as making its virtual environment"
        assert _processes_mentioning(staging[0].name), "nothing was installing when the signal came"
        adding.send_signal(signal.SIGTERM)
        _, stderr = adding.communicate(timeout=60)
    assert adding.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    assert _leftovers(tools) == []
    assert not (tools / "stopped").exists()
    assert _processes_mentioning(staging[0].name) == []


# -- the bin choice and symlinks, on package folders made here ----------------------------


def _package(folder: Path, bins: object, files: tuple[str, ...] = ("cli.js",)) -> Path:
    package = folder / "node_modules" / "@acme" / "srv"
    package.mkdir(parents=True)
    (package / "package.json").write_text(json.dumps({"name": "@acme/srv", "bin": bins}))
    for name in files:
        (package / name).write_text("console.log('hi')\n")
    return package


def test_one_bin_is_taken_several_need_bin(tmp_path: Path) -> None:
    one = tmp_path / "one"
    _package(one, "./cli.js")
    assert node_program(one, "@acme/srv", None) == "node_modules/@acme/srv/cli.js"
    several = tmp_path / "several"
    _package(several, {"srv-a": "cli.js", "srv-b": "other.js"}, ("cli.js", "other.js"))
    with pytest.raises(McpAddError) as choose:
        node_program(several, "@acme/srv", None)
    assert choose.value.reason == "bin_choice"
    assert "srv-a" in choose.value.message and "srv-b" in choose.value.message
    assert node_program(several, "@acme/srv", "srv-b") == "node_modules/@acme/srv/other.js"


@pytest.mark.parametrize("bins", [None, {}, [], {"x": 1}, "missing.js"])
def test_a_package_without_a_usable_bin_is_refused(tmp_path: Path, bins: object) -> None:
    _package(tmp_path, bins)
    with pytest.raises(McpAddError) as refused:
        node_program(tmp_path, "@acme/srv", None)
    assert refused.value.reason == "no_bin"


def test_a_bin_symlinked_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "tool"
    package = _package(folder, "evil.js")
    (tmp_path / "outside.js").write_text("")
    (package / "evil.js").symlink_to(tmp_path / "outside.js")
    with pytest.raises(McpAddError) as refused:
        node_program(folder, "@acme/srv", None)
    assert refused.value.reason == "bin_outside"


def test_a_package_folder_symlinked_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    _package(elsewhere, "cli.js")
    folder = tmp_path / "tool"
    (folder / "node_modules").mkdir(parents=True)
    (folder / "node_modules" / "@acme").symlink_to(elsewhere / "node_modules" / "@acme")
    with pytest.raises(McpAddError) as refused:
        node_program(folder, "@acme/srv", None)
    assert refused.value.reason == "bin_outside"


def test_a_bin_climbing_out_with_dots_is_refused(tmp_path: Path) -> None:
    _package(tmp_path / "tool", "../../../../outside.js")
    (tmp_path / "outside.js").write_text("")
    with pytest.raises(McpAddError) as refused:
        node_program(tmp_path / "tool", "@acme/srv", None)
    assert refused.value.reason == "bin_outside"


# -- what the policy must grant -----------------------------------------------------------


def _policy(tmp_path: Path, **model: Any) -> Policy:
    base = {"version": 1, "default_role": "user", "roles": {"user": {"allow": ["add_numbers"]}}}
    return Policy(PolicyModel.model_validate(base | model), tmp_path)


def test_grants_name_the_whitelist_and_the_role_when_both_refuse(tmp_path: Path) -> None:
    grants = needed_grants(_policy(tmp_path, whitelist=["add_numbers"]), "time", [], {})
    assert grants.additions == {"whitelist": ["time_*"], "roles": {"user": {"allow": ["time_*"]}}}
    assert grants.yaml_lines() == ["whitelist: [time_*]", "roles:", "  user:", "    allow: [time_*]"]


def test_grants_are_empty_when_the_policy_already_allows_the_mcp_tag(tmp_path: Path) -> None:
    policy = _policy(tmp_path, whitelist=["*"], roles={"user": {"allow": ["tag:mcp"]}})
    grants = needed_grants(policy, "time", [], {})
    assert grants.additions == {}
    assert grants.removals == ()


def test_grants_add_the_workspace_and_network_the_manifest_asks_for(tmp_path: Path) -> None:
    manifest = {"workspace": "read", "network": {"allow": ["api.example.com:443"]}}
    grants = needed_grants(_policy(tmp_path, whitelist=["*"]), "files", [], manifest)
    assert grants.additions["workspace"] == "./workspace"
    assert grants.additions["limits"] == {"network": True}
    assert grants.additions["tools"] == {"files_tool": {"network": {"allow": ["api.example.com:443"]}}}


def test_a_deny_rule_is_reported_as_something_to_remove(tmp_path: Path) -> None:
    policy = _policy(tmp_path, whitelist=["*"], roles={"user": {"allow": ["*"], "deny": ["time_*"]}})
    grants = needed_grants(policy, "time", [], {})
    assert grants.additions == {}
    assert len(grants.removals) == 1
    assert "time_*" in grants.removals[0]


# -- hostile wheels, installed offline from a folder of wheels made here --------------------


def _wheel(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    """A hand-made wheel ``name``-1.0 (no build backend: nothing of ours runs to make it)."""
    info = f"{name}-1.0.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def digest(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = [f"{path},{digest(data)},{len(data)}" for path, data in files.items()]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    folder.mkdir(exist_ok=True)
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            entry = zipfile.ZipInfo(path)
            entry.external_attr = (0o100755 if ".data/" in path else 0o100644) << 16
            archive.writestr(entry, data)
    return wheel


def _add_offline(project: Path, wheels: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``runner mcp add`` with pip reading only ``wheels`` (no index, no network)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RUNNER_", "PIP_"))}
    offline = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "HOME": str(project.parent / "home")}
    return subprocess.run(
        [installed_command(), "mcp", "add", *args],
        cwd=project,
        env={**clean, **offline},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "planted",
    [
        "scripts/python3",  # replaces the symlink the manifest's command and the old module check ran
        "scripts/python",  # the symlink python3 points to: python3 itself is left as venv made it
        "data/bin/python3.11",  # through the data scheme (the venv's prefix) rather than scripts
    ],
)
def test_a_wheel_that_replaces_the_venvs_interpreter_is_refused_and_never_runs(
    project: Path, tmp_path: Path, planted: str
) -> None:
    marker = tmp_path / "pwned"
    script = f'#!/bin/sh\necho "uid=$(id -u) $*" >> {marker}\nexec /usr/bin/python3 "$@"\n'
    wheels = tmp_path / "wheels"
    _wheel(
        wheels,
        "evilmcp",
        {
            "evilmcp/__init__.py": b"",
            "evilmcp/__main__.py": b"print('hi')\n",
            f"evilmcp-1.0.data/{planted}": script.encode(),
        },
    )
    done = _add_offline(project, wheels, "evil", "--pip", "evilmcp")
    assert not marker.exists(), f"the package's script ran on the host: {marker.read_text()}"
    assert done.returncode == 2, done.stdout + done.stderr
    assert "replaced the virtual environment's interpreter" in done.stderr
    assert Path(planted).name in done.stderr
    assert "Traceback" not in done.stderr
    assert not (project / "tools" / "evil").exists()
    assert _leftovers(project / "tools") == []


# A hand-rolled MCP server over stdio (the sandbox's python has no SDK): its tool's
# description, and the name of a second tool, carry escapes that would drive a terminal.
HOSTILE_SERVER = r"""
import json, sys
TOOLS = [
    {"name": "clock", "description": "Tells the time\x1b]0;HACKED\x07 now\x1b[2J",
     "inputSchema": {"type": "object"}},
    {"name": "bad\x1b[2Jname", "description": "x", "inputSchema": {"type": "object"}},
]
for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message:
        continue
    if message["method"] == "initialize":
        result = {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "hostile", "version": "1.0"}}
    elif message["method"] == "tools/list":
        result = {"tools": TOOLS}
    else:
        result = {}
    print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
"""


@pytest.mark.slow
def test_the_report_escapes_what_the_server_says(project: Path, tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    _wheel(
        wheels,
        "hostilemcp",
        {"hostilemcp/__init__.py": b"", "hostilemcp/__main__.py": HOSTILE_SERVER.encode()},
    )
    done = _add_offline(project, wheels, "hostile", "--pip", "hostilemcp")
    assert done.returncode == 0, done.stdout + done.stderr
    # The module check (the system's python reading the venv) found it; the venv is intact.
    venv = project / "tools" / "hostile" / "venv"
    assert (venv / "bin" / "python3").readlink() == Path("/usr/bin/python3")
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "Tells the time\\x1b]0;HACKED\\x07 now\\x1b[2J" in done.stdout
    # The tool whose name the registry refused is a load problem, printed as inert too
    # (the registry already shows the server's name as its repr).
    assert "bad\\\\x1b[2Jname" in done.stdout and "is not a valid tool name" in done.stdout


# Like the official filesystem server: refuses to start unless its folder argument is there.
DIRECTORY_SERVER = r"""
import json, os, sys
folder = sys.argv[1]
if not os.path.isdir(folder):
    sys.exit(f"Error: None of the specified directories are accessible: {folder}")
for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message:
        continue
    if message["method"] == "initialize":
        result = {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "dirs", "version": "1.0"}}
    elif message["method"] == "tools/list":
        result = {"tools": [{"name": "list_files", "description": "Lists the folder",
                             "inputSchema": {"type": "object"}}]}
    else:
        names = sorted(os.listdir(folder))
        result = {"content": [{"type": "text", "text": json.dumps(names)}]}
    print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
"""


def _runner_offline(project: Path, wheels: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """This checkout's command line (not an installed one), pip reading only ``wheels``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RUNNER_", "PIP_"))}
    offline = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "HOME": str(project.parent / "home")}
    return subprocess.run(
        [sys.executable, "-m", "runner", *args],
        cwd=project,
        env={**clean, **offline},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def directory_wheel(tmp_path: Path) -> Path:
    wheels = tmp_path / "wheels"
    _wheel(wheels, "dirmcp", {"dirmcp/__init__.py": b"", "dirmcp/__main__.py": DIRECTORY_SERVER.encode()})
    return wheels


@pytest.mark.slow
def test_a_server_that_lists_no_tools_fails_with_the_fix_and_workspace_and_grant_make_it_work(
    project: Path, directory_wheel: Path
) -> None:
    failed = _runner_offline(
        project, directory_wheel, "mcp", "add", "files", "--pip", "dirmcp", "--", "/workspace"
    )
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "tools: none registered" in failed.stdout
    # What the policy needs, as paths into it: nothing to paste that clashes with roles.user.
    assert 'roles.user.allow: add ["files_*"]' in failed.stdout
    assert "--grant user does it" in failed.stdout
    assert "files registered no tools" in failed.stderr and "--workspace read|write" in failed.stderr
    assert "installing dirmcp from PyPI" in failed.stderr  # progress while pip runs
    assert "Traceback" not in failed.stderr
    assert "workspace" not in _manifest(project / "tools" / "files")

    policy_before = (project / "policies.yaml").read_text()
    done = _runner_offline(
        project,
        directory_wheel,
        "mcp",
        "add",
        "files",
        "--pip",
        "dirmcp",
        "--workspace",
        "read",
        "--grant",
        "user",
        "--force",
        "--",
        "/workspace",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert _manifest(project / "tools" / "files")["workspace"] == "read"
    policy_after = (project / "policies.yaml").read_text()
    assert policy_after.startswith(policy_before.splitlines()[0])  # its comments are kept
    assert policy_after.count("# ") == policy_before.count("# ")
    granted = yaml.safe_load(policy_after)["roles"]["user"]["allow"]
    assert "files_list_files" in granted and "files_*" not in granted  # each tool by its name
    (project / "workspace" / "seen.txt").write_text("x")
    answer = answer_of(
        _runner_offline(project, directory_wheel, "exec", "files_list_files", "--role", "user")
    )
    assert answer["success"], answer
    assert "seen.txt" in json.dumps(answer["result"])


@pytest.mark.slow
def test_mcp_list_shows_installed_servers_and_remove_takes_only_a_servers_folder(
    project: Path, directory_wheel: Path, tmp_path: Path
) -> None:
    added = _runner_offline(
        project,
        directory_wheel,
        "mcp",
        "add",
        "files",
        "--pip",
        "dirmcp",
        "--workspace",
        "read",
        "--",
        "/workspace",
    )
    assert added.returncode == 0, added.stdout + added.stderr
    listed = _runner_offline(project, directory_wheel, "mcp", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    servers = json.loads(listed.stdout)["servers"]
    assert [(s["name"], s["tools"], s["workspace"]) for s in servers] == [
        ("files", ["files_list_files"], "read")
    ]
    # A plain tool is not a server; a symlink named like one is never followed.
    refused = _runner_offline(project, directory_wheel, "mcp", "remove", "add_numbers")
    assert refused.returncode == 1 and "no MCP server named 'add_numbers'" in refused.stderr
    outside = tmp_path / "outside"
    shutil.copytree(project / "tools" / "files", outside)
    (project / "tools" / "linked").symlink_to(outside)
    assert _runner_offline(project, directory_wheel, "mcp", "remove", "linked").returncode == 1
    assert (outside / "tool.yaml").exists()
    (project / "tools" / "linked").unlink()
    removed = _runner_offline(project, directory_wheel, "mcp", "remove", "files")
    assert removed.returncode == 0, removed.stderr
    assert not (project / "tools" / "files").exists()
    after = _runner_offline(project, directory_wheel, "mcp", "list", "--json")
    assert json.loads(after.stdout)["servers"] == []
