"""Traces of calls: a ``runner.call`` span per call with a ``runner.attempt``
child per attempt, the caller's W3C ``traceparent`` as parent, and the answer's
``traceId`` the span's. In-process runners over real sandboxes, the SDK's in-memory
exporter; then ``runner serve`` (stdio with the SDK's console exporter, HTTP without any
SDK set up) with ``_meta.traceparent`` and the ``traceparent`` header."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx2
import mcp_types as types
import pytest
from conftest import ToolBench
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.mcp_harness import ECHO, HttpServer, add_token, audit_events, server_argv

from runner.mcp.serve.app import TRACE_ID_META
from runner.telemetry.tracing import active_tracer

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
HEX32 = re.compile(r"^[0-9a-f]{32}$")
# Fails its first attempt (exit 1), answers on the second.
FLAKY = """
import json, sys
request = json.load(sys.stdin)
if request["context"]["attempt"] == 1:
    sys.exit(1)
json.dump({"attempt": request["context"]["attempt"]}, sys.stdout)
"""


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """An SDK tracer provider for this test only, exporting to memory.

    The API allows one global provider per process and no public reset; like the
    OpenTelemetry project's own test utilities, the global is set and put back by hand.
    """
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trace, "_TRACER_PROVIDER", provider)
        yield exporter
    provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def hex_trace(span: ReadableSpan) -> str:
    assert span.context is not None
    return trace.format_trace_id(span.context.trace_id)


def test_a_call_is_a_span_with_a_child_per_attempt_and_the_answer_carries_its_trace_id(
    bench: ToolBench, spans: InMemorySpanExporter
) -> None:
    bench.tool("flaky", FLAKY, limits={"retries": 1, "retry_delay_ms": 0})
    with bench.runner() as runner:
        answer = runner.handle({"toolName": "flaky", "options": {"retries": 1, "retryDelay": 0}})
    assert answer["success"], answer
    [call] = named(spans, "runner.call")
    attempts = sorted(named(spans, "runner.attempt"), key=lambda span: span.start_time or 0)
    assert call.attributes is not None
    assert {k: call.attributes[k] for k in ("tool", "role", "code", "attempts")} == {
        "tool": "flaky",
        "role": "user",
        "code": "OK",
        "attempts": 2,
    }
    assert call.status.status_code is trace.StatusCode.UNSET
    assert [dict(span.attributes or {}) for span in attempts] == [
        {"backend": "subprocess", "warm": False, "reason": "exit_code"},
        {"backend": "subprocess", "warm": False, "reason": "ok"},
    ]
    assert call.context is not None
    assert all(span.parent is not None and span.parent.span_id == call.context.span_id for span in attempts)
    assert attempts[0].status.status_code is trace.StatusCode.ERROR
    assert call.parent is None  # no caller's trace: a trace of its own
    assert answer["metadata"]["traceId"] == hex_trace(call)
    events = audit_events(bench, requestId=answer["metadata"]["requestId"])
    assert {e["event"] for e in events} == {"policy.decision", "call.attempt", "call.finished"}
    assert {e["traceId"] for e in events} == {hex_trace(call)}


def test_a_callers_traceparent_makes_the_call_a_child_of_the_callers_trace(
    bench: ToolBench, spans: InMemorySpanExporter
) -> None:
    bench.tool("echo", ECHO)
    with bench.runner() as runner:
        answer = runner.call("echo", {"x": 1}, metadata={"traceparent": TRACEPARENT, "userId": "u1"})
    assert answer.success
    [call] = named(spans, "runner.call")
    assert call.parent is not None and call.parent.is_remote
    assert format(call.parent.span_id, "016x") == CALLER_SPAN
    assert hex_trace(call) == CALLER_TRACE == answer.metadata.trace_id
    [attempt] = named(spans, "runner.attempt")
    assert hex_trace(attempt) == CALLER_TRACE


def test_the_hosts_current_span_is_the_parent_when_the_request_names_none(
    bench: ToolBench, spans: InMemorySpanExporter
) -> None:
    bench.tool("echo", ECHO)
    tracer = trace.get_tracer("the-host")
    with bench.runner() as runner, tracer.start_as_current_span("host.work") as host:
        answer = runner.call("echo", {})
    [call] = named(spans, "runner.call")
    assert call.parent is not None and call.parent.span_id == host.get_span_context().span_id
    assert answer.metadata.trace_id == trace.format_trace_id(host.get_span_context().trace_id)


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        f"00-{'0' * 32}-{CALLER_SPAN}-01",  # an all-zero trace id is invalid
        f"00-{CALLER_TRACE}-{'0' * 16}-01",  # so is an all-zero parent id
        f"ff-{CALLER_TRACE}-{CALLER_SPAN}-01",  # version ff is forbidden
        f"00-{CALLER_TRACE.upper()}-{CALLER_SPAN}-01",  # upper-case hex is not W3C
        TRACEPARENT + "-" + "x" * 2000,
        7,
        None,
        {"nested": TRACEPARENT},
    ],
)
def test_an_invalid_traceparent_is_ignored_and_the_call_starts_a_trace_of_its_own(
    bench: ToolBench, spans: InMemorySpanExporter, traceparent: object
) -> None:
    bench.tool("echo", ECHO)
    with bench.runner() as runner:
        answer = runner.handle({"toolName": "echo", "metadata": {"traceparent": traceparent}})
    assert answer["success"], answer
    [call] = named(spans, "runner.call")
    assert call.parent is None
    assert HEX32.match(answer["metadata"]["traceId"]) and answer["metadata"]["traceId"] != CALLER_TRACE
    assert answer["metadata"]["traceId"] == hex_trace(call)


def test_a_denied_call_and_an_unknown_tool_are_error_spans_without_attempts(
    bench: ToolBench, spans: InMemorySpanExporter
) -> None:
    bench.tool("secret", ECHO)
    bench.policy["roles"] = {"user": {"allow": []}}
    with bench.runner() as runner:
        denied = runner.handle({"toolName": "secret"})
        unknown = runner.handle({"toolName": "nope", "metadata": {"traceparent": TRACEPARENT}})
    calls = {(span.attributes or {})["tool"]: span for span in named(spans, "runner.call")}
    assert (calls["secret"].attributes or {})["code"] == "PERMISSION_DENIED"
    assert (calls["nope"].attributes or {})["code"] == "TOOL_NOT_FOUND"
    assert all((span.attributes or {})["attempts"] == 0 for span in calls.values())
    assert all(span.status.status_code is trace.StatusCode.ERROR for span in calls.values())
    assert named(spans, "runner.attempt") == []
    assert denied["metadata"]["traceId"] == hex_trace(calls["secret"])
    assert unknown["metadata"]["traceId"] == CALLER_TRACE


def test_without_a_tracer_provider_no_span_is_made_yet_the_traceparent_still_joins(bench: ToolBench) -> None:
    assert active_tracer() is None, "a tracer provider was left set by another test"
    bench.tool("echo", ECHO)
    with bench.runner() as runner:
        joined = runner.handle({"toolName": "echo", "metadata": {"traceparent": TRACEPARENT}})
        first, second = runner.handle({"toolName": "echo"}), runner.handle({"toolName": "echo"})
        invalid = runner.handle({"toolName": "echo", "metadata": {"traceparent": "00-nope"}})
    assert joined["metadata"]["traceId"] == CALLER_TRACE
    ids = [answer["metadata"]["traceId"] for answer in (first, second, invalid)]
    assert all(HEX32.match(value) for value in ids) and len(set(ids)) == 3
    assert CALLER_TRACE in {e["traceId"] for e in audit_events(bench, event="call.finished")}


def console_spans(text: str) -> list[dict[str, Any]]:
    """The spans the SDK's console exporter wrote (indented JSON objects) amid other lines."""
    decoder = json.JSONDecoder()
    found = []
    for match in re.finditer(r'^\{\s*\n\s*"name"', text, re.MULTILINE):
        span, _ = decoder.raw_decode(text, match.start())
        found.append(span)
    return found


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_runner_serve_stdio_exports_the_call_under_the_callers_meta_traceparent(
    bench: ToolBench, tmp_path: Path
) -> None:
    bench.tool("echo", ECHO)
    argv = server_argv(bench, "--stdio")
    env = {
        "PYTHONPATH": os.environ["PYTHONPATH"],
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_SERVICE_NAME": "runner-test",
    }
    params = StdioServerParameters(command=argv[0], args=argv[1:], cwd=str(bench.root), env=env)
    errors = tmp_path / "stderr.txt"
    with errors.open("w") as errlog:
        async with Client(stdio_client(params, errlog=errlog)) as client:
            meta = cast(types.RequestParamsMeta, {"traceparent": TRACEPARENT})
            result = await client.call_tool("echo", {"x": 1}, meta=meta)
    assert not result.is_error
    assert result.meta is not None and result.meta[TRACE_ID_META] == CALLER_TRACE
    exported = console_spans(errors.read_text())
    by_name = {span["name"]: span for span in exported}
    call, attempt, request = by_name["runner.call"], by_name["runner.attempt"], by_name["tools/call echo"]
    assert {span["context"]["trace_id"] for span in (call, attempt, request)} == {"0x" + CALLER_TRACE}
    # The MCP SDK's span of the request is the child of the caller's; the call nests under it.
    assert request["parent_id"] == "0x" + CALLER_SPAN
    assert call["parent_id"] == request["context"]["span_id"]
    assert attempt["parent_id"] == call["context"]["span_id"]
    assert call["attributes"]["tool"] == "echo" and call["attributes"]["code"] == "OK"
    assert call["resource"]["attributes"]["service.name"] == "runner-test"
    assert {e["traceId"] for e in audit_events(bench, toolName="echo")} == {CALLER_TRACE}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_runner_serve_http_joins_the_traceparent_header_without_any_sdk_set_up(
    bench: ToolBench,
) -> None:
    bench.tool("echo", ECHO)
    token = add_token(bench, "agent", "user")
    server = HttpServer(bench)
    try:
        headers = {"Authorization": f"Bearer {token}", "traceparent": TRACEPARENT}
        async with (
            httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(60.0)) as http,
            Client(streamable_http_client(server.url, http_client=http)) as client,
        ):
            by_header = await client.call_tool("echo", {})
            other = f"00-{'1' * 32}-{CALLER_SPAN}-01"
            meta = cast(types.RequestParamsMeta, {"traceparent": other})
            by_meta = await client.call_tool("echo", {}, meta=meta)  # _meta wins over the header
    finally:
        assert server.stop() == 0
    assert by_header.meta is not None and by_header.meta[TRACE_ID_META] == CALLER_TRACE
    assert by_meta.meta is not None and by_meta.meta[TRACE_ID_META] == "1" * 32
    assert {e["traceId"] for e in audit_events(bench, event="call.finished")} == {CALLER_TRACE, "1" * 32}


def test_a_hostile_tracestate_is_dropped_and_never_reaches_the_operators_terminal(bench: ToolBench) -> None:
    """OpenTelemetry logs each ``tracestate`` member it rejects, raw, on stderr: a caller's
    escape sequences and a forged log line. The runner drops such a header first; the
    caller's ``traceparent`` still joins the trace."""
    import subprocess
    import sys

    bench.tool("echo", ECHO)
    bench.runner().close()  # writes the policy
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    request = {
        "toolName": "echo",
        "params": {},
        "metadata": {
            "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01",
            "tracestate": "x=\x1b[2J\x1b[31mFAKE\nrunner: serving MCP at http://evil/",
        },
    }
    done = subprocess.run(
        [sys.executable, "-m", "runner", "--tools", str(bench.tools), "--policies", str(bench.root / "policies.yaml"),
         "--audit-log", str(bench.audit_log), "exec", "-"],
        input=json.dumps(request), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    answer = json.loads(done.stdout)
    assert answer["success"], answer
    assert answer["metadata"]["traceId"] == trace_id
    assert "\x1b" not in done.stderr and "evil" not in done.stderr, done.stderr
