"""Secrets: granted, not granted, without a value, and a hostile tool that tries every way
out of the sandbox with its secret (result, error document, stderr, a crash, a timeout, a
flood of output). The value must appear in no answer, no audit event and nothing the
runner writes on its own standard error, whichever backend ran the tool.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ToolBench, answer_of, wait_for
from docker import APIClient

from runner.call.policy import Policy
from runner.errors import ConfigError
from sandboxes.base import LaunchSpec, Limits
from sandboxes.docker import DockerSandbox

RUNNER = [sys.executable, "-m", "runner"]
HOST_VARIABLE = "RUNNER_TEST_SECRET_SOURCE"
# Quotes, a backslash and non-ASCII: its JSON-escaped forms differ from the value itself.
SECRET = f'sk-"q"\\b-ünï-{secrets.token_hex(12)}-end'

SHOW_SECRET = """
import hashlib, json, os, sys
sys.stdin.read()
value = os.environ["API_TOKEN"]
json.dump({"sha256": hashlib.sha256(value.encode()).hexdigest(), "env": sorted(os.environ)}, sys.stdout)
"""

# Every way out of the sandbox, one per mode; params: {"mode": ...}.
EXFILTRATOR = r"""
import json, os, signal, sys, time
mode = json.load(sys.stdin)["params"]["mode"]
s = os.environ["API_TOKEN"]
b = s.encode()

def err(data):
    sys.stderr.buffer.write(data)
    sys.stderr.flush()

if mode == "result":  # the value as a string, inside a string, as a key, escaped (ensure_ascii)
    print(json.dumps({"plain": s, "inside": "<" + s + ">", s: [s, {s: 1}]}))
elif mode == "escapes":  # every character as \uXXXX, and a lone surrogate for good measure
    print('{"v": "' + "".join(f"\\u{ord(c):04x}" for c in s) + '", "bad": "\\ud800"}')
elif mode == "utf16":  # JSON may come in UTF-16: a search of the bytes as UTF-8 finds nothing
    sys.stdout.buffer.write(json.dumps({"v": s}, ensure_ascii=False).encode("utf-16"))
elif mode == "raw":  # format raw: the value as such and as JSON writes it
    print(s, json.dumps(s), json.dumps(s, ensure_ascii=False))
elif mode == "error":  # an error document whose message is cut at 300 characters mid-secret
    message = "m" * (300 - len(s) // 2) + s
    print(json.dumps({"error": {"message": message, "code": s, "details": {s: s}}}))
    sys.exit(3)
elif mode == "stderr":  # the backend keeps the last 8 KiB: cut it right in the middle of a copy
    half = len(s[: len(s) // 2].encode())
    copies = (8192 - (len(b) - half) - 4) // len(b) - 1
    pad = 8192 - (len(b) - half) - copies * len(b) - 4
    err(b * 40 + b[:half] + b[half:] + b * copies + b"z" * pad + b"END\n")
    sys.exit(1)
elif mode == "crash":
    err(b"dying with " + b + b"\n")
    os.kill(os.getpid(), signal.SIGSEGV)
elif mode == "timeout":
    err(b + b"\n")
    print(s, flush=True)
    time.sleep(60)
elif mode == "flood":  # past max_output_bytes, with the value all over stdout and stderr
    err(b + b"\n")
    while True:
        sys.stdout.write(s * 100)
"""
MODES = ["result", "escapes", "utf16", "raw", "error", "stderr", "crash", "timeout", "flood"]


SUCCEEDS = ("result", "escapes", "utf16", "raw")


def forms(value: str) -> list[str]:
    """The value, its JSON-escaped forms, and every 8-character piece of it: none may show."""
    whole = {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}
    pieces = {value[i : i + 8] for i in range(len(value) - 7)}
    return sorted(whole | pieces)


def assert_nowhere(*texts: str) -> None:
    for text in texts:
        leaked = [form for form in forms(SECRET) if form in text]
        assert leaked == [], f"secret pieces {leaked} in {text[:300]!r}"


def setup(bench: ToolBench, name: str, code: str, *, grant: bool = True, **manifest: Any) -> None:
    bench.tool(name, code, secrets=["API_TOKEN"], **manifest)
    bench.policy["secrets"] = {"API_TOKEN": {"env": HOST_VARIABLE}}
    if grant:
        bench.policy.setdefault("tools", {})[name] = {"secrets": ["API_TOKEN"]}


def docker_manifest(backend: str) -> dict[str, Any]:
    return {"sandbox": "docker", "image": "runner/base:latest"} if backend == "docker" else {}


@pytest.fixture(params=["subprocess", "docker"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "docker":
        request.getfixturevalue("docker_client")
    return str(request.param)


# -- granted, not granted, no value ---------------------------------------------------


def test_a_granted_secret_reaches_the_tool_as_its_environment_variable(
    bench: ToolBench, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_VARIABLE, SECRET)
    setup(bench, "shows", SHOW_SECRET, **docker_manifest(backend))
    answer = bench.runner().handle({"toolName": "shows", "options": {"timeout": 20000}})
    assert answer["success"], answer
    assert answer["result"]["sha256"] == hashlib.sha256(SECRET.encode()).hexdigest()
    assert HOST_VARIABLE not in answer["result"]["env"]  # the source variable itself is not passed


def test_a_secret_with_newlines_from_a_file_reaches_a_container_whole(
    bench: ToolBench, docker_client: APIClient, tmp_path: Path
) -> None:
    value = "-----BEGIN KEY-----\nline two\\n\n\nlast\n"
    (tmp_path / "key.pem").write_text(value + "\n")  # one trailing newline is dropped
    setup(bench, "pem", SHOW_SECRET, sandbox="docker", image="runner/base:latest")
    bench.policy["secrets"] = {"API_TOKEN": {"file": "key.pem"}}
    answer = bench.runner().handle({"toolName": "pem", "options": {"timeout": 20000}})
    assert answer["result"]["sha256"] == hashlib.sha256(value.encode()).hexdigest(), answer


def test_a_listed_secret_the_policy_does_not_grant_denies_the_call(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_VARIABLE, SECRET)
    setup(bench, "ungranted", SHOW_SECRET, grant=False)
    runner = bench.runner()
    answer = runner.handle({"toolName": "ungranted"})
    assert answer["error"]["code"] == "PERMISSION_DENIED"
    assert answer["error"]["details"]["reason"] == "secret"
    assert answer["metadata"]["attempts"] == 0
    assert runner.discover(role="user") == []  # a tool it cannot call is not offered


def test_a_granted_secret_without_a_value_is_secret_unavailable_and_not_retried(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(HOST_VARIABLE, raising=False)
    setup(bench, "unset", SHOW_SECRET)
    answer = bench.runner().handle({"toolName": "unset", "options": {"retries": 3}})
    error = answer["error"]
    assert (error["code"], error["details"]["reason"], error["retryable"]) == (
        "EXECUTION_ERROR",
        "secret_unavailable",
        False,
    )
    assert answer["metadata"]["attempts"] == 0
    assert "API_TOKEN" in error["message"] and HOST_VARIABLE in error["message"]
    assert "API_TOKEN" in capsys.readouterr().err  # the operator is told too


def test_a_missing_secret_file_is_named_to_the_operator_but_its_path_never_to_the_caller(
    bench: ToolBench, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setup(bench, "nofile", SHOW_SECRET)
    bench.policy["secrets"] = {"API_TOKEN": {"file": "missing/secret.txt"}}
    answer = bench.runner().handle({"toolName": "nofile"})
    assert answer["error"]["details"]["reason"] == "secret_unavailable"
    assert str(tmp_path) not in json.dumps(answer)
    assert "missing/secret.txt" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["fifo", "world_writable", "empty", "directory", "too_large"])
def test_a_secret_file_that_is_not_a_plain_private_value_is_refused_without_hanging(
    bench: ToolBench, tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "secret"
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading would wait for a writer forever
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_text({"empty": "", "too_large": "x" * 20000}.get(kind, "value"))
        if kind == "world_writable":
            path.chmod(0o666)
    setup(bench, "badfile", SHOW_SECRET)
    bench.policy["secrets"] = {"API_TOKEN": {"file": str(path)}}
    answer = bench.runner().handle({"toolName": "badfile", "options": {"deadline": 3000}})
    assert answer["error"]["details"]["reason"] == "secret_unavailable"


def test_a_symlinked_secret_file_is_followed_as_kubernetes_mounts_it(
    bench: ToolBench, tmp_path: Path
) -> None:
    (tmp_path / "..data").mkdir()
    (tmp_path / "..data" / "token").write_text(SECRET)
    (tmp_path / "token").symlink_to("..data/token")
    setup(bench, "linked", SHOW_SECRET)
    bench.policy["secrets"] = {"API_TOKEN": {"file": str(tmp_path / "token")}}
    answer = bench.runner().handle({"toolName": "linked"})
    assert answer["success"], answer


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to make a link of another user's")
def test_a_secret_file_reached_through_another_users_link_is_refused(
    bench: ToolBench, tmp_path: Path
) -> None:
    # A link another user planted had the runner, as root, read a file that user may not
    # (the tool then let it out transformed, past the mask).
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "key").write_text("root only")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "token").symlink_to(private / "key")
    os.lchown(shared / "token", 65534, 65534)
    setup(bench, "linked", SHOW_SECRET)
    bench.policy["secrets"] = {"API_TOKEN": {"file": str(shared / "token")}}
    answer = bench.runner().handle({"toolName": "linked"})
    assert not answer["success"] and answer["error"]["details"]["reason"] == "secret_unavailable", answer
    assert "a symbolic link of another user's" in answer["error"]["message"]
    assert "root only" not in json.dumps(answer) and str(shared) not in json.dumps(answer)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to swap links as another user")
def test_a_link_swapped_between_the_check_and_the_open_never_yields_the_file_it_led_to() -> None:
    # The walk approved the path, then the open looked it up again: another user swapping
    # a link there in a loop had root read a root-only file about one time in ten.
    from runner.secrets.sources import _read_file

    if not Path("/usr/bin/python3").is_file():
        pytest.skip("needs a python3 another uid can run")
    base = Path(tempfile.mkdtemp(prefix="runner-swap-"))
    base.chmod(0o711)  # the other user reaches its own folder in it
    private = base / "private"
    private.mkdir(mode=0o700)
    (private / "key").write_text("ROOT ONLY")
    shared = base / "shared"
    shared.mkdir()
    (shared / "mine").write_text("the user's own")
    os.chown(shared, 65534, 65534)
    os.chown(shared / "mine", 65534, 65534)
    swapper = (
        "import os, sys\n"
        "folder, target = sys.argv[1], sys.argv[2]\n"
        "evil, good, sec = (os.path.join(folder, name) for name in ('evil', 'good', 'sec'))\n"
        "while True:\n"  # the link to the private file, then a file of the user's own, by turns
        "    for path in (evil, good):\n"
        "        try: os.unlink(path)\n"
        "        except OSError: pass\n"
        "    os.symlink(target, evil)\n"
        "    os.replace(evil, sec)\n"
        "    os.link(os.path.join(folder, 'mine'), good)\n"
        "    os.replace(good, sec)\n"
    )
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", swapper]
    values: list[str] = []
    with subprocess.Popen([*argv, str(shared), str(private / "key")]) as process:
        try:
            wait_for((shared / "sec").exists, 30.0)
            until = time.monotonic() + 3.0
            while time.monotonic() < until:
                try:
                    values.append(_read_file(shared / "sec"))
                except Exception as exc:  # refused, or caught mid-swap: never the value
                    values.append(type(exc).__name__)
        finally:
            process.kill()
            shutil.rmtree(base)
    assert "ROOT ONLY" not in values
    assert "the user's own" in values  # the swaps ran while the file was read


# -- validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("secrets_list", "env"),
    [(["lower"], {}), (["PATH"], {}), (["RUNNER_X"], {}), (["A", "A"], {}), (["A"], {"A": "1"})],
)
def test_a_manifest_with_a_bad_secret_name_is_left_out(
    bench: ToolBench, secrets_list: list[str], env: dict[str, str]
) -> None:
    bench.tool("bad", SHOW_SECRET, secrets=secrets_list, env=env)
    runner = bench.runner()
    assert runner.registry.get("bad") is None
    assert len(runner.registry.problems) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"tools": {"t": {"secrets": ["NO_SOURCE"]}}},
        {"secrets": {"A": {"env": "X", "file": "y"}}},
        {"secrets": {"A": {}}},
        {"secrets": {"HOME": {"env": "X"}}},
        {"secrets": {"A": {"env": "X=1"}}},
    ],
)
def test_a_policy_with_a_bad_secret_setting_does_not_load(tmp_path: Path, change: dict[str, Any]) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(yaml.safe_dump({"version": 1, **change}))
    with pytest.raises(ConfigError):
        Policy.load(path)


# -- the hostile tool -----------------------------------------------------------------


def hostile(bench: ToolBench, backend: str) -> None:
    setup(bench, "exfil", EXFILTRATOR, limits={"max_output_bytes": 65536}, **docker_manifest(backend))


def request(mode: str) -> dict[str, Any]:
    options: dict[str, Any] = {
        "timeout": 1500 if mode == "timeout" else 20000,
        "retries": 0,
        "deadline": 25000,
    }
    if mode == "raw":
        options["format"] = "raw"
    return {"toolName": "exfil", "params": {"mode": mode}, "options": options}


@pytest.mark.parametrize("mode", MODES)
def test_the_hostile_tool_gets_its_secret_out_through_no_answer_or_log_of_the_api(
    bench: ToolBench,
    backend: str,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(HOST_VARIABLE, SECRET)
    hostile(bench, backend)
    with bench.runner() as runner:
        answer = runner.handle(request(mode))
    assert answer["success"] == (mode in SUCCEEDS), answer
    if mode == "result":
        assert answer["result"]["plain"] == "***"
    captured = capsys.readouterr()
    assert_nowhere(json.dumps(answer), json.dumps(answer, ensure_ascii=False), bench.audit_log.read_text())
    assert_nowhere(captured.out, captured.err)


@pytest.mark.parametrize("mode", MODES)
def test_the_hostile_tool_gets_its_secret_out_through_nothing_the_cli_prints(
    bench: ToolBench, mode: str
) -> None:
    hostile(bench, "subprocess")
    bench.runner().close()  # writes the policy file
    done = subprocess.run(
        [*RUNNER, "exec", "-", "--tools", str(bench.tools), "--policies", str(bench.root / "policies.yaml")],
        input=json.dumps(request(mode)),
        capture_output=True,
        text=True,
        env={**os.environ, HOST_VARIABLE: SECRET, "RUNNER_AUDIT_LOG": str(bench.audit_log)},
        timeout=60,
    )
    answer = answer_of(done)
    assert answer["success"] == (mode in SUCCEEDS), answer
    assert_nowhere(done.stdout, done.stderr, bench.audit_log.read_text())


def test_a_runner_fault_that_quotes_a_secret_leaves_it_out_of_the_operator_log(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(HOST_VARIABLE, SECRET)
    setup(bench, "shows", SHOW_SECRET)

    def broken(*args: object) -> object:
        raise RuntimeError(f"a bug that quotes {os.environ[HOST_VARIABLE]}")

    monkeypatch.setattr("runner.call.executor.parse_result", broken)
    answer = bench.runner().handle({"toolName": "shows"})
    assert answer["error"]["details"]["reason"] == "internal"
    err = capsys.readouterr().err
    assert "a bug that quotes ***" in err
    assert_nowhere(err, json.dumps(answer), bench.audit_log.read_text())


def test_runner_validate_never_prints_a_secret(bench: ToolBench) -> None:
    setup(bench, "shows", SHOW_SECRET)
    bench.runner().close()
    done = subprocess.run(
        [*RUNNER, "validate", "--tools", str(bench.tools), "--policies", str(bench.root / "policies.yaml")],
        capture_output=True,
        text=True,
        env={**os.environ, HOST_VARIABLE: SECRET, "RUNNER_AUDIT_LOG": os.devnull},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert_nowhere(done.stdout, done.stderr)


def test_a_containers_config_shows_no_secret_to_docker_inspect(
    bench: ToolBench, docker_client: APIClient
) -> None:
    value = SECRET + "\nsecond line"
    folder = bench.tool(
        "inspected", "import os, sys\nsys.stdin.read()\nprint(os.environ['API_TOKEN'], end='')\n"
    )
    spec = LaunchSpec(
        tool_name="inspected",
        request_id="req_secret_inspect",
        command=("python3", "main.py"),
        tool_dir=folder,
        image="runner/base:latest",
        secrets={"API_TOKEN": value},
    )
    assert value not in repr(spec)

    async def attempt() -> tuple[bytes, dict[str, Any]]:
        prepared = await DockerSandbox().prepare(spec, Limits(timeout_ms=20000))
        try:
            before = await asyncio.to_thread(docker_client.inspect_container, prepared.container_id)
            outcome = await prepared.run(b"{}")
            return outcome.stdout, before
        finally:
            await prepared.close()

    stdout, inspected = asyncio.run(attempt())
    assert stdout.decode() == value  # the tool had it, whole
    assert_nowhere(json.dumps(inspected), json.dumps(inspected, ensure_ascii=False))
    assert not any(entry.startswith("API_TOKEN=") for entry in inspected["Config"]["Env"])


def test_runner_validate_warns_of_ungranted_and_unavailable_secrets(bench: ToolBench) -> None:
    setup(bench, "unset", SHOW_SECRET)
    setup(bench, "ungranted", SHOW_SECRET, grant=False)
    bench.runner().close()
    done = subprocess.run(
        [*RUNNER, "validate", "--tools", str(bench.tools), "--policies", str(bench.root / "policies.yaml")],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != HOST_VARIABLE} | {"RUNNER_AUDIT_LOG": os.devnull},
        timeout=60,
    )
    # Not granted: every call is refused (an error, exit 1); no value here: a warning.
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(errors) == 1 and "ungranted" in errors[0] and "not granted" in errors[0], done.stdout
    assert len(warnings) == 1 and "unset" in warnings[0] and HOST_VARIABLE in warnings[0], done.stdout


def test_a_secret_changed_during_a_session_opens_its_sandbox_anew_and_the_old_value_stays_masked(
    bench: ToolBench, tmp_path: Path
) -> None:
    # The session's sandbox keeps the environment of its first call; a later call's scrub
    # knew only the value read for it, so a rotated secret's old value went out in clear.
    source = tmp_path / "token"
    source.write_text("OLDSECRETVALUE-1234")
    source.chmod(0o600)
    code = "import json, os, sys\nsys.stdin.read()\nprint(json.dumps({'key': os.environ['API_TOKEN']}))\n"
    bench.tool("keeps", code, secrets=["API_TOKEN"], session=True)
    bench.policy["secrets"] = {"API_TOKEN": {"file": str(source)}}
    bench.policy["tools"] = {"keeps": {"secrets": ["API_TOKEN"]}}

    async def calls() -> list[Any]:
        async with bench.runner() as runner, runner.session() as session:
            first = await session.acall("keeps", {})
            source.write_text("NEWSECRETVALUE-5678")
            return [first, await session.acall("keeps", {})]

    first, second = asyncio.run(calls())
    assert (first.result, second.result) == ({"key": "***"}, {"key": "***"})
    assert second.metadata.extra["sessionRestarted"] is True
    closed = [
        e for e in map(json.loads, bench.audit_log.read_text().splitlines()) if e["event"] == "session.closed"
    ]
    assert [e["reason"] for e in closed] == ["secrets", "ended"]
    assert "SECRETVALUE" not in bench.audit_log.read_text()
