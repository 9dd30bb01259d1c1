"""Events from real tools, through the helper, in both backends, cold and warm: handed on
as they come, blocks in the answer, stderr text without them, the bounds and the scrub
held against hostile tools; a tool without events answers as before."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import ToolBench, wait_for

from runner import Runner

EVENTFUL = """
import sys, time
import runner_tool as rt

def main(params, context):
    rt.progress(1, 4, "started")
    rt.log("info", {"step": "one"})
    sys.stderr.write("plain words\\n")
    rt.text("a text block")
    rt.image(b"\\x89PNG\\r\\n", "image/png")
    rt.audio(b"RIFF....WAVE", "audio/wav")
    rt.resource("file:///notes.txt", text="notes", mime_type="text/plain")
    rt.progress(4, 4, "done")
    return {"ok": True}

rt.run(main)
"""

PLAIN = """
import sys
from runner_tool import run
sys.stderr.write("plain words\\n")
run(lambda params, context: {"ok": True})
"""

BACKENDS = ["subprocess", pytest.param("docker", marks=pytest.mark.docker)]


def attempts(bench: ToolBench) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    return [event for event in events if event["event"] == "call.attempt"]


def tool_on(bench: ToolBench, backend: str, name: str, code: str, **manifest: Any) -> None:
    extra = {"image": "runner/base:latest"} if backend == "docker" else {}
    bench.tool(name, code, sandbox=backend, **extra, **manifest)


@pytest.fixture
def warm_runner(bench: ToolBench) -> Iterator[Runner]:
    bench.policy["tools"] = {"eventful": {"pool": 1}}
    bench.policy["pool"] = {"max_idle_ms": 600000}
    with bench.runner() as runner:
        wait_for(lambda: runner.warm_sandboxes().get("eventful") == 1, 30)
        yield runner


def assert_all_events_came(result: Any, heard: list[dict[str, Any]]) -> None:
    assert result.success, result
    blocks = [event["content"] for event in heard if "content" in event]
    assert [block["type"] for block in blocks] == ["text", "image", "audio", "resource"]
    assert list(result.content) == blocks
    assert heard[0] == {"progress": 1, "total": 4, "message": "started"}
    assert heard[1] == {"log": "info", "data": {"step": "one"}}
    assert heard[-1] == {"progress": 4, "total": 4, "message": "done"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cold_calls_events_come_in_order_and_its_blocks_are_in_the_answer(
    bench: ToolBench, backend: str
) -> None:
    tool_on(bench, backend, "eventful", EVENTFUL)
    heard: list[dict[str, Any]] = []
    with bench.runner(warm_pools=False) as runner:
        result = runner.call("eventful", {}, on_event=heard.append)
    assert_all_events_came(result, heard)
    (attempt,) = attempts(bench)
    assert attempt["warm"] is False
    assert attempt["stderr"] == "plain words\n"  # event lines are not stderr text
    assert "eventsIgnored" not in attempt
    assert result.to_wire()["content"] == list(result.content)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_warm_calls_events_come_as_a_cold_ones(bench: ToolBench, backend: str) -> None:
    tool_on(bench, backend, "eventful", EVENTFUL)
    bench.policy["tools"] = {"eventful": {"pool": 1}}
    bench.policy["pool"] = {"max_idle_ms": 600000}
    heard: list[dict[str, Any]] = []
    with bench.runner() as runner:
        wait_for(lambda: runner.warm_sandboxes().get("eventful") == 1, 30)
        result = runner.call("eventful", {}, on_event=heard.append)
    assert_all_events_came(result, heard)
    assert [attempt["warm"] for attempt in attempts(bench)] == [True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tool_without_events_answers_as_before(bench: ToolBench, backend: str) -> None:
    tool_on(bench, backend, "plain", PLAIN)
    with bench.runner(warm_pools=False) as runner:
        answer = runner.handle({"toolName": "plain", "params": {}})
    assert set(answer) == {"success", "result", "error", "metadata"}
    assert answer["result"] == {"ok": True}
    (attempt,) = attempts(bench)
    assert attempt["stderr"] == "plain words\n"
    assert "eventsIgnored" not in attempt


def test_events_arrive_while_the_tool_runs_not_at_its_end(bench: ToolBench) -> None:
    bench.tool(
        "slow",
        "import time, runner_tool as rt\n"
        "def main(params, context):\n"
        "    rt.progress(1, 2)\n    time.sleep(1.5)\n    return {}\n"
        "rt.run(main)\n",
    )
    arrived: list[float] = []
    with bench.runner(warm_pools=False) as runner:
        result = runner.call("slow", {}, on_event=lambda event: arrived.append(time.monotonic()))
        ended = time.monotonic()
    assert result.success
    assert len(arrived) == 1 and ended - arrived[0] > 1.0


FLOOD = """
import sys
from runner_tool import run, log
def main(params, context):
    for n in range(3000):
        log("debug", n)
    sys.stderr.write("\\x1e{not json\\n\\x1e{\\"what\\": 1}\\n")
    return {"ok": True}
run(main)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tool_flooding_events_gets_a_thousand_through_and_the_rest_counted(
    bench: ToolBench, backend: str
) -> None:
    tool_on(bench, backend, "flood", FLOOD)
    heard: list[dict[str, Any]] = []
    with bench.runner(warm_pools=False) as runner:
        result = runner.call("flood", {}, on_event=heard.append)
    assert result.success, result
    assert len(heard) == 1000
    (attempt,) = attempts(bench)
    assert attempt["eventsIgnored"] == 2002


HUGE_IMAGE = """
from runner_tool import run, image, text
def main(params, context):
    image(bytes(50 * 1024 * 1024), "image/png")
    text("after the image")
    return {"ok": True}
run(main)
"""


def test_a_50_mb_image_past_the_output_limit_is_dropped_and_the_call_succeeds(bench: ToolBench) -> None:
    bench.tool("huge", HUGE_IMAGE, limits={"timeout_ms": 20000, "deadline_ms": 25000})
    with bench.runner(warm_pools=False) as runner:
        result = runner.call("huge", {})
    assert result.success, result
    assert list(result.content) == [{"type": "text", "text": "after the image"}]
    (attempt,) = attempts(bench)
    assert attempt["eventsIgnored"] == 1


def test_events_count_toward_the_output_limit_shared_with_the_result(bench: ToolBench) -> None:
    bench.tool(
        "greedy",
        "from runner_tool import run, text\n"
        "def main(params, context):\n    text('x' * 600_000)\n    return 'y' * 600_000\n"
        "run(main)\n",
    )
    with bench.runner(warm_pools=False) as runner:
        result = runner.call("greedy", {})
    assert not result.success
    assert result.error is not None and result.error.details["reason"] == "output_limit"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_secret_in_a_log_line_a_text_block_or_a_message_is_scrubbed(
    bench: ToolBench, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cr3t-event-value-77"
    monkeypatch.setenv("EVENT_SECRET", secret)
    tool_on(
        bench,
        backend,
        "leaky",
        "import os\nfrom runner_tool import run, log, text, progress\n"
        "def main(params, context):\n"
        "    key = os.environ['API_TOKEN']\n"
        "    log('warning', {'using': key})\n    text('key ' + key)\n    progress(1, message=key)\n"
        "    return {'ok': True}\n"
        "run(main)\n",
        secrets=["API_TOKEN"],
    )
    bench.policy["secrets"] = {"API_TOKEN": {"env": "EVENT_SECRET"}}
    bench.policy["tools"] = {"leaky": {"secrets": ["API_TOKEN"]}}
    heard: list[dict[str, Any]] = []
    with bench.runner(warm_pools=False) as runner:
        result = runner.call("leaky", {}, on_event=heard.append)
    assert result.success, result
    assert len(heard) == 3
    assert secret not in json.dumps(heard)
    assert secret not in json.dumps(result.to_wire())
    assert heard[0] == {"log": "warning", "data": {"using": "***"}}
