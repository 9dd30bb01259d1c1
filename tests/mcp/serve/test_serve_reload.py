"""A long-lived server follows its files: a new tool folder or policy edit is served and
announced (``notifications/tools/list_changed``), a broken policy is refused with the old
one kept, SIGHUP reloads at once. Real server process, the SDK's real client."""

from __future__ import annotations

import os
import signal

import anyio
import mcp_types as types
import pytest
from conftest import ToolBench
from mcp import Client
from mcp.client.session import IncomingMessage
from support.mcp_harness import ECHO, audit_events, server_pid, stdio_server, write_policy

pytestmark = pytest.mark.anyio
# The server looks every 0.5 s; a change is announced well within this.
ANNOUNCED_WITHIN_S = 10


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def names(listed: types.ListToolsResult) -> list[str]:
    return [tool.name for tool in listed.tools]


async def test_a_tool_folder_added_is_announced_on_a_listen_stream_and_listed(bench: ToolBench) -> None:
    bench.tool("echo", ECHO)
    async with Client(stdio_server(bench)) as client:  # 2026-07-28: subscriptions/listen
        assert names(await client.list_tools()) == ["echo"]
        async with client.listen(tools_list_changed=True) as changes:
            bench.tool("echo2", ECHO)
            with anyio.fail_after(ANNOUNCED_WITHIN_S):
                event = await changes.__anext__()
        assert "ToolsListChanged" in type(event).__name__
        assert names(await client.list_tools()) == ["echo", "echo2"]
        assert not (await client.call_tool("echo2", {"x": 1})).is_error


async def test_a_tool_folder_added_is_announced_to_a_handshake_era_client(bench: ToolBench) -> None:
    bench.tool("echo", ECHO)
    changed = anyio.Event()

    async def on_message(message: IncomingMessage) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changed.set()

    async with Client(stdio_server(bench), mode="legacy", message_handler=on_message) as client:
        assert names(await client.list_tools()) == ["echo"]
        bench.tool("echo2", ECHO)
        with anyio.fail_after(ANNOUNCED_WITHIN_S):
            await changed.wait()
        assert names(await client.list_tools()) == ["echo", "echo2"]


async def test_a_broken_policy_edit_is_refused_and_the_old_policy_kept_then_a_good_one_is_served(
    bench: ToolBench,
) -> None:
    bench.tool("echo", ECHO)
    policy = bench.root / "policies.yaml"
    async with Client(stdio_server(bench)) as client:
        assert not (await client.call_tool("echo", {})).is_error
        policy.write_text("version: 1\nroles: {user: {allow: [echo]}\n")  # not YAML: refused
        with anyio.fail_after(ANNOUNCED_WITHIN_S):
            while not audit_events(bench, event="serve.reload", accepted=False):
                await anyio.sleep(0.1)
        assert not (await client.call_tool("echo", {})).is_error  # the old policy still rules
        assert names(await client.list_tools()) == ["echo"]

        bench.policy["roles"] = {"user": {"allow": []}}  # a valid edit: echo no longer allowed
        write_policy(bench)
        with anyio.fail_after(ANNOUNCED_WITHIN_S):
            while not audit_events(bench, event="serve.reload", accepted=True):
                await anyio.sleep(0.1)
        denied = await client.call_tool("echo", {})
        assert names(await client.list_tools()) == []
    assert denied.is_error and isinstance(denied.content[0], types.TextContent)
    assert denied.content[0].text.startswith("PERMISSION_DENIED: ")
    [refused] = audit_events(bench, event="serve.reload", accepted=False)
    assert "policies.yaml" in refused["problem"]


async def test_sighup_reloads_at_once(bench: ToolBench) -> None:
    bench.tool("echo", ECHO)
    async with Client(stdio_server(bench)) as client:
        await client.list_tools()
        os.kill(server_pid(bench), signal.SIGHUP)
        with anyio.fail_after(ANNOUNCED_WITHIN_S):
            while not audit_events(bench, event="serve.reload", accepted=True):
                await anyio.sleep(0.05)
        assert not (await client.call_tool("echo", {})).is_error  # and it still serves


async def test_an_edit_of_what_only_a_start_reads_is_refused_not_taken_unenforced(bench: ToolBench) -> None:
    # The new policy was served while its audit: and sandbox: were not: audit.required
    # turned on was not required, a backend setting made stricter did not hold.
    bench.tool("echo", ECHO)
    async with Client(stdio_server(bench)) as client:
        assert not (await client.call_tool("echo", {})).is_error
        bench.policy["audit"] = {"required": True}
        bench.policy["sandbox"] = {"backends": {"subprocess": {"allow_degraded": False}}}
        bench.policy.setdefault("serve", {})["max_concurrent"] = 1
        bench.policy["roles"] = {"user": {"allow": []}}  # the rest of the edit waits too
        write_policy(bench)
        with anyio.fail_after(ANNOUNCED_WITHIN_S):
            while not audit_events(bench, event="serve.reload", accepted=False):
                await anyio.sleep(0.1)
        assert not (await client.call_tool("echo", {})).is_error  # the old policy still rules
    [refused] = audit_events(bench, event="serve.reload", accepted=False)
    assert "audit, sandbox, serve.max_concurrent changed: restart" in refused["problem"], refused
