"""Third-party MCP servers as tools, with a hostile server of the tests' own
(``support/servers/stateful_mcp.py``): listing, a fresh sandbox per call, every way a server can
fail, policy by ``tag:mcp``, warm pools, and both backends. The real third-party servers
installed by ``runner mcp add`` are in ``test_mcp_add.py``."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ToolBench, assert_nothing_survives, docker_ready, runner_argv, wait_for

from runner import Runner
from runner.mcp.hosted.listing import ServerLister
from runner.tools.cache import ManifestCache
from runner.tools.manifest import load_entry

SERVER = Path(__file__).resolve().parents[2] / "support" / "servers" / "stateful_mcp.py"
NAMES = {
    "count",
    "fail",
    "refuse",
    "hang",
    "die",
    "garbage",
    "progress",
    "flood",
    "notify",
    "structured",
    "nan",
    "leak",
    "rich",
} | {"evil", "chatty"}


def add_server(bench: ToolBench, name: str = "st", **manifest: Any) -> Path:
    folder = bench.tools / name
    folder.mkdir()
    shutil.copy(SERVER, folder / "server.py")
    document = {"name": name, "kind": "mcp", "command": ["python3", "server.py"], **manifest}
    (folder / "tool.yaml").write_text(yaml.safe_dump(document))
    return folder


def docker_manifest() -> dict[str, Any]:
    why = docker_ready()
    if why is not None:
        pytest.skip(why)
    return {"sandbox": "docker", "image": "runner/python-tools:latest"}


@pytest.fixture(params=["subprocess", "docker"])
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    return {} if request.param == "subprocess" else docker_manifest()


def test_each_listed_tool_registers_as_name_tool_with_the_servers_schemas_and_tag_mcp(
    bench: ToolBench,
) -> None:
    add_server(bench, tags=["demo"], annotations={"destructive": False})
    with bench.runner(warm_pools=False) as runner:
        tools = {tool.name: tool for tool in runner.registry}
    assert set(tools) == {f"st_{name}" for name in NAMES}
    structured = tools["st_structured"]
    assert structured.hosted is not None and structured.hosted.tool == "structured"
    assert structured.manifest.tags == ["demo", "mcp"]
    assert structured.manifest.parameters["required"] == ["n"]
    assert structured.manifest.output_schema == {
        "type": "object",
        "properties": {"double": {"type": "integer"}},
    }
    # The server's hint and the manifest's own: the manifest's wins where it sets one.
    assert structured.manifest.annotations.read_only is True
    assert structured.manifest.annotations.destructive is False


def test_a_subset_with_the_servers_own_names_and_a_missing_one_reported(bench: ToolBench) -> None:
    add_server(bench, tools=["count", "structured", "nosuch"], prefix="")
    with bench.runner(warm_pools=False) as runner:
        assert [tool.name for tool in runner.registry] == ["count", "structured"]
        assert any("nosuch is not a tool of this server" in p.reason for p in runner.registry.problems)


def test_a_name_that_collides_with_another_tool_is_reported_not_shadowed(bench: ToolBench) -> None:
    bench.tool("st_count", "print('{}')")
    add_server(bench)
    with bench.runner(warm_pools=False) as runner:
        assert runner.registry.get("st_count").hosted is None  # type: ignore[union-attr]
        assert any("duplicate tool name 'st_count'" in p.reason for p in runner.registry.problems)


def test_a_server_that_cannot_be_listed_is_left_out_and_validate_reports_it(bench: ToolBench) -> None:
    add_server(bench, command=["python3", "-c", "import sys; sys.stderr.write('no key set'); sys.exit(1)"])
    with bench.runner(warm_pools=False) as runner:
        assert len(runner.registry) == 0
        [problem] = runner.registry.problems
    assert "MCP server st cannot be listed" in problem.reason and "no key set" in problem.reason
    done = subprocess.run(
        runner_argv(bench, "validate"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "cannot be listed" in done.stdout + done.stderr


def test_the_listing_is_cached_by_the_folders_content(bench: ToolBench, tmp_path: Path) -> None:
    folder = add_server(bench)
    bench.runner(warm_pools=False).close()  # writes the policy
    cache = ManifestCache.open(tmp_path / "cache")
    entry = load_entry(folder, cache)
    policy = Runner.load(tools=bench.tools, policies=bench.root / "policies.yaml", warm_pools=False)
    try:
        listed = ServerLister(policy.policy, policy._sandbox_factory)(entry, cache)  # type: ignore[arg-type]
    finally:
        policy.close()

    def no_sandbox(name: str) -> Any:
        raise AssertionError("listed again")

    assert ServerLister(policy.policy, no_sandbox)(entry, cache) == listed  # type: ignore[arg-type]
    (folder / "server.py").write_text((folder / "server.py").read_text() + "\n# changed\n")
    with pytest.raises(AssertionError, match="listed again"):
        ServerLister(policy.policy, no_sandbox)(entry, cache)  # type: ignore[arg-type]


def test_every_call_meets_a_fresh_server_no_counter_no_marker_left(
    bench: ToolBench, backend: dict[str, Any]
) -> None:
    add_server(bench, **backend)
    with bench.runner(warm_pools=False) as runner:
        for _ in range(5):
            answer = runner.call("st_count")
            assert answer.success, answer.error
            seen = json.loads(answer.result)
            assert (seen["count"], seen["markerSeen"]) == (1, False)


def test_structured_content_is_the_result_and_params_are_checked_against_the_input_schema(
    bench: ToolBench,
) -> None:
    add_server(bench)
    with bench.runner(warm_pools=False) as runner:
        assert runner.call("st_structured", {"n": 21}).result == {"double": 42}
        bad = runner.call("st_structured", {"n": "x"})
    assert bad.error is not None and bad.error.code.value == "INVALID_PARAMS"


@pytest.mark.parametrize(
    ("tool", "code", "reason", "message"),
    [
        ("fail", "EXECUTION_ERROR", "tool_error", "the weather service said no"),
        ("refuse", "EXECUTION_ERROR", "tool_error", "refused: no such thing"),
        ("die", "EXECUTION_ERROR", "exit_code", "exited with status 3"),
        ("garbage", "PARSE_ERROR", "protocol", "not JSON-RPC"),
        ("flood", "EXECUTION_ERROR", "output_limit", "output limit"),
    ],
)
def test_each_way_a_server_fails_maps_to_its_error(
    bench: ToolBench, backend: dict[str, Any], tool: str, code: str, reason: str, message: str
) -> None:
    add_server(bench, **backend)
    with bench.runner(warm_pools=False) as runner:
        answer = runner.call(f"st_{tool}", request_id=f"hosted-{tool}")
    assert answer.error is not None
    wire = answer.error.to_wire()
    assert (wire["code"], wire["details"].get("reason")) == (code, reason), wire
    assert message in wire["message"]
    assert_nothing_survives(f"hosted-{tool}")


def test_a_hanging_server_is_killed_at_the_timeout_with_nothing_left(
    bench: ToolBench, backend: dict[str, Any]
) -> None:
    add_server(bench, limits={"timeout_ms": 1500}, **backend)
    with bench.runner(warm_pools=False) as runner:
        answer = runner.call("st_hang", request_id="hosted-hang")
    assert answer.error is not None and answer.error.code.value == "TIMEOUT"
    assert answer.metadata.duration < 6000
    assert_nothing_survives("hosted-hang")


def test_policy_treats_hosted_tools_as_any_tool_tag_mcp_included(bench: ToolBench) -> None:
    add_server(bench)
    bench.policy["roles"] = {"user": {"allow": ["*"], "deny": ["tag:mcp"]}, "ops": {"allow": ["st_count"]}}
    with bench.runner(warm_pools=False) as runner:
        denied = runner.call("st_count")
        assert denied.error is not None and denied.error.code.value == "PERMISSION_DENIED"
        assert runner.call("st_count", role="ops").success
        assert [tool.name for tool in runner.callable_tools("ops")] == ["st_count"]


def test_a_warm_server_serves_one_call_and_is_never_reused(bench: ToolBench, backend: dict[str, Any]) -> None:
    add_server(bench, **backend)
    bench.policy["pool"] = {"max_total": 2}
    bench.policy["tools"] = {"st_count": {"pool": 1}}
    with bench.runner() as runner:
        wait_for(lambda: runner.warm_sandboxes().get("st_count", 0) >= 1, 30)
        for _ in range(3):
            answer = runner.call("st_count")
            assert answer.success, answer.error
            seen = json.loads(answer.result)
            assert (seen["count"], seen["markerSeen"]) == (1, False)
            wait_for(lambda: runner.warm_sandboxes().get("st_count", 0) >= 1, 30)
    attempts = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    warm = [event["warm"] for event in attempts if event["event"] == "call.attempt"]
    assert warm and all(warm), warm


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_through_runner_serve_a_client_sees_hosted_tools_next_to_ours_per_role_with_progress(
    bench: ToolBench, anyio_backend: str
) -> None:
    from mcp import Client
    from support.mcp_harness import ECHO, stdio_server

    from runner.mcp.hosted.dialogue import MAX_PROGRESS

    bench.tool("echo", ECHO)
    add_server(bench)
    bench.policy["roles"] = {
        "user": {"allow": ["echo", "st_progress", "st_structured", "st_chatty"]},
        "admin": {"inherits": ["user"], "allow": ["*"]},
    }
    async with Client(stdio_server(bench)) as client:
        listed = {tool.name for tool in (await client.list_tools()).tools}
        assert listed == {"echo", "st_progress", "st_structured", "st_chatty"}
        seen: list[tuple[float, float | None, str | None]] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            seen.append((progress, total, message))

        result = await client.call_tool("st_progress", {}, progress_callback=on_progress)
        assert not result.is_error
        assert [message for _, _, message in seen] == ["step 1", "step 2", "step 3"]
        seen.clear()
        assert not (await client.call_tool("st_chatty", {}, progress_callback=on_progress)).is_error
        # Bounded (how many arrive before the answer is the transports' race), NaN dropped.
        assert 1 <= len(seen) <= MAX_PROGRESS
        assert "step 1" not in [message for _, _, message in seen]
        structured = await client.call_tool("st_structured", {"n": 4})
        assert structured.structured_content == {"double": 8}
        denied = await client.call_tool("st_count", {})
        assert denied.is_error and denied.content[0].text.startswith("PERMISSION_DENIED")  # type: ignore[union-attr]
    async with Client(stdio_server(bench, "--role", "admin")) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
    assert names == {"echo"} | {f"st_{name}" for name in NAMES}


# -- what a hostile review of hosted servers found -------------------------------------------


def test_a_call_does_not_list_again_so_a_schema_offered_at_call_time_is_never_used(bench: ToolBench) -> None:
    """The SDK's client lists a server's tools again inside a call to check its answer
    against the schema offered *then*: never checked by the runner, and on the event loop
    (a catastrophic pattern stalled every call for seconds). The runner checks answers
    against the schema it listed and checked, itself, off the loop."""
    add_server(bench, limits={"timeout_ms": 3000})
    with bench.runner(warm_pools=False) as runner:
        evil = runner.call("st_evil", request_id="hosted-evil")
    assert evil.success, evil.error
    assert evil.result == {"s": "a" * 24 + "!"}
    assert evil.metadata.duration < 3000
    assert_nothing_survives("hosted-evil")


def test_nan_in_structured_content_is_a_parse_error_not_a_crash(bench: ToolBench) -> None:
    add_server(bench)
    with bench.runner(warm_pools=False) as runner:
        answer = runner.call("st_nan")
    assert answer.error is not None
    wire = answer.error.to_wire()
    assert (wire["code"], wire["details"]["reason"]) == ("PARSE_ERROR", "protocol"), wire
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] == "call.attempt"] == ["call.attempt"]


@pytest.mark.parametrize("where", ["error", "line"])
def test_no_part_of_a_secret_reaches_the_answer_however_long_the_text_around_it(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    secret = "sk-live-0123456789abcdefSECRETSECRET"
    monkeypatch.setenv("HOSTED_TEST_TOKEN", secret)
    add_server(bench, secrets=["API_TOKEN"], limits={"timeout_ms": 3000})
    bench.policy["secrets"] = {"API_TOKEN": {"env": "HOSTED_TEST_TOKEN"}}
    bench.policy["tools"] = {"st_leak": {"secrets": ["API_TOKEN"]}}
    with bench.runner(warm_pools=False) as runner:
        answer = runner.call("st_leak", {"where": where})
    assert answer.error is not None
    text = json.dumps(answer.to_wire())
    for cut in range(8, len(secret) + 1):
        assert secret[:cut] not in text, (cut, text)
    assert secret[:8] not in bench.audit_log.read_text()


def test_a_servers_images_resources_and_logs_pass_through_checked_and_scrubbed(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch, backend: dict[str, Any]
) -> None:
    secret = "sk-live-0123456789abcdefSECRETSECRET"
    monkeypatch.setenv("HOSTED_TEST_TOKEN", secret)
    add_server(bench, secrets=["API_TOKEN"], **backend)
    bench.policy["secrets"] = {"API_TOKEN": {"env": "HOSTED_TEST_TOKEN"}}
    bench.policy["tools"] = {"st_rich": {"secrets": ["API_TOKEN"]}}
    heard: list[dict[str, Any]] = []
    with bench.runner(warm_pools=False) as runner:
        answer = runner.call("st_rich", on_event=heard.append)
    assert answer.success, answer.error
    assert answer.result == "see the picture"
    # The text is the result; the other blocks are the answer's content, the audio block
    # of a type outside the list dropped and counted.
    assert [block["type"] for block in answer.content] == ["image", "resource"]
    assert answer.content[0] == {"type": "image", "mimeType": "image/png", "data": "iVBORw0KGgo="}
    assert answer.content[1]["resource"]["uri"] == "file:///notes.txt"
    logs = [event for event in heard if "log" in event]
    assert len(logs) == 1 and (logs[0]["log"], logs[0]["logger"]) == ("warning", "rich"), heard
    assert logs[0]["data"]["note"].startswith("token ") and secret[:8] not in json.dumps(logs)
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    attempt = [e for e in events if e["event"] == "call.attempt"][-1]
    assert attempt["eventsIgnored"] == 1
    assert secret[:8] not in json.dumps(answer.to_wire()) + bench.audit_log.read_text()


def test_a_servers_progress_reaches_on_event_in_order_and_bounded(bench: ToolBench) -> None:
    add_server(bench)
    heard: list[dict[str, Any]] = []
    with bench.runner(warm_pools=False) as runner:
        assert runner.call("st_progress", on_event=heard.append).success
        assert runner.call("st_chatty", on_event=heard.append).success
    progress = [event["progress"] for event in heard if "progress" in event]
    # progress: 1, 2, 3 of 3; chatty: a NaN (dropped), then 2..1000, of which the events'
    # cap keeps the first ones, each larger than the last.
    assert progress[:3] == [1, 2, 3] and all(event.get("total") == 3 for event in heard[:3])
    assert [event["message"] for event in heard[:3]] == ["step 1", "step 2", "step 3"]
    chatty = progress[3:]
    assert chatty[0] == 2 and chatty == sorted(set(chatty)) and len(chatty) <= 1000


def test_a_listing_sees_an_empty_read_only_workspace_never_the_real_one(bench: ToolBench) -> None:
    folder = add_server(bench, workspace="write")
    (folder / "server.py").write_text(
        "import os, sys\n"
        "if os.environ.get('REQUEST_ID', '').startswith('list-'):\n"
        "    seen = os.listdir('/workspace')\n"
        "    try:\n"
        "        open('/workspace/written-by-listing', 'w').close()\n"
        "    except OSError:\n"
        "        pass\n"
        "    sys.stderr.write(f'saw {seen}')\n"
        "    sys.exit(1)\n"
    )
    workspace = bench.root / "workspace"
    workspace.mkdir()
    (workspace / "private.txt").write_text("not for listings")
    bench.policy["workspace"] = str(workspace)
    with bench.runner(warm_pools=False) as runner:
        [problem] = runner.registry.problems
    assert "saw []" in problem.reason
    assert sorted(path.name for path in workspace.iterdir()) == ["private.txt"]


def test_two_servers_claiming_one_name_are_both_left_out(bench: ToolBench) -> None:
    add_server(bench, "a", tools=["count"], prefix="b_")
    add_server(bench, "b", tools=["count"])
    with bench.runner(warm_pools=False) as runner:
        assert runner.registry.get("b_count") is None
        reasons = " ".join(p.reason for p in runner.registry.problems)
    assert "b_count" in reasons and "more than one MCP server" in reasons


def test_a_listing_failure_is_remembered_so_other_commands_do_not_wait_for_it(bench: ToolBench) -> None:
    add_server(bench, command=["python3", "-c", "import time; time.sleep(60)"], limits={"timeout_ms": 1500})
    bench.tool("plain", "print('{}')")
    started = time.monotonic()
    with bench.runner(warm_pools=False) as runner:
        assert any("cannot be listed" in p.reason for p in runner.registry.problems)
    first = time.monotonic() - started
    started = time.monotonic()
    with bench.runner(warm_pools=False) as runner:
        assert any("cannot be listed" in p.reason for p in runner.registry.problems)
        assert runner.call("plain").success
    assert first >= 1.4
    assert time.monotonic() - started < first


def test_a_server_is_listed_with_at_most_max_tools_and_the_rest_reported(bench: ToolBench) -> None:
    from runner.tools.hosted import MAX_SERVER_TOOLS

    folder = add_server(bench)
    (folder / "server.py").write_text(
        (folder / "server.py")
        .read_text()
        .replace('result = {"tools": TOOLS + evil}', 'result = {"tools": MANY}')
        .replace(
            "CALLED = False\n",
            f"CALLED = False\nMANY = [{{'name': f't{{i}}', 'inputSchema': {{'type': 'object'}}}} for i in range({MAX_SERVER_TOOLS + 5})]\n",
        )
    )
    with bench.runner(warm_pools=False) as runner:
        assert len(runner.registry) == MAX_SERVER_TOOLS
        assert any(f"more than {MAX_SERVER_TOOLS} tools" in p.reason for p in runner.registry.problems)


def test_progress_passed_on_is_bounded_per_call_finite_and_scrubbed() -> None:
    import asyncio

    from runner.mcp.hosted.dialogue import CALL_PROGRESS, MAX_PROGRESS, HostedCall
    from runner.schema.redaction import Scrubber

    got: list[tuple[float, float | None, str | None]] = []

    async def collect(progress: float, total: float | None, message: str | None) -> None:
        got.append((progress, total, message))

    async def chatter() -> None:
        token = CALL_PROGRESS.set(collect)
        try:
            call = HostedCall("chatty", {}, Scrubber.of(["s3cr3t-value"]))
        finally:
            CALL_PROGRESS.reset(token)
        relay = call._progress
        assert relay is not None
        await relay(float("nan"), None, "not a number")
        await relay(1.0, float("inf"), "infinite total")
        for step in range(2, 1002):
            await relay(float(step), None, f"step {step} of s3cr3t-value")

    asyncio.run(chatter())
    assert len(got) == MAX_PROGRESS
    assert got[0] == (2.0, None, "step 2 of ***")
    assert all("s3cr3t" not in (message or "") for _, _, message in got)


def test_a_server_flooding_notifications_is_output_limit_audited_and_counted_by_the_breaker(
    bench: ToolBench, backend: dict[str, Any]
) -> None:
    # Each notification is a well-formed line the client session takes in; past
    # max_output_bytes the run ends and the session is torn down under the line reader,
    # which must not turn that into a fault of the runner (``internal``, a traceback, no
    # attempt on record and nothing for the breaker to count).
    add_server(bench, limits={"max_output_bytes": 65536}, **backend)
    bench.policy["circuit_breaker"]["failure_threshold"] = 3
    bench.policy["circuit_breaker"]["reset_timeout_ms"] = 60000
    bench.policy["audit"] = {"operator_log": "operator.log"}
    with bench.runner(warm_pools=False) as runner:
        wires = [runner.call("st_notify", request_id=f"notify-{n}").to_wire() for n in range(5)]
    codes = [(wire["error"]["code"], wire["error"]["details"].get("reason")) for wire in wires]
    assert codes == [("EXECUTION_ERROR", "output_limit")] * 3 + [("CIRCUIT_OPEN", None)] * 2, codes
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    attempts = [event for event in events if event["event"] == "call.attempt"]
    assert [event["requestId"] for event in attempts] == ["notify-0", "notify-1", "notify-2"]
    operator = bench.root / "operator.log"
    assert "Traceback" not in (operator.read_text() if operator.exists() else "")
    for n in range(3):
        assert_nothing_survives(f"notify-{n}")
