"""The official MCP conformance suite (``@modelcontextprotocol/conformance``, installed by
``scripts/setup.sh``) against ``runner serve --http`` serving a tool set written with the
helper (``tests/support/conformance``). The suite cannot send a bearer token: a loopback
proxy adds one. ``tools-call-sampling`` is left out: it needs a tool that drives the
client's model, which a sandboxed tool does not reach."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ToolBench
from support.bearer_proxy import BearerProxy
from support.mcp_harness import HttpServer, add_token

CONFORMANCE = Path(
    os.environ.get("RUNNER_CONFORMANCE", "/opt/runner-conformance"), "node_modules/.bin/conformance"
)
FIXTURE = Path(__file__).resolve().parents[2] / "support" / "conformance"
SCENARIOS = [
    "server-initialize",
    "tools-list",
    "tools-call-simple-text",
    "tools-call-image",
    "tools-call-audio",
    "tools-call-embedded-resource",
    "tools-call-mixed-content",
    "tools-call-with-logging",
    "tools-call-error",
    "tools-call-with-progress",
    "json-schema-2020-12",
    "logging-set-level",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CONFORMANCE.exists() and os.environ.get("CI") != "true",
        reason="the conformance suite is installed by scripts/setup.sh",
    ),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HttpServer, str]]:
    bench = ToolBench(tmp_path_factory.mktemp("conformance"))
    shutil.rmtree(bench.tools)
    shutil.copytree(FIXTURE, bench.tools)
    token = add_token(bench, "conformance", "user")
    server = HttpServer(bench)
    yield server, token
    assert server.stop() == 0


async def _run(server: HttpServer, token: str, scenario: str) -> tuple[int, str]:
    port = int(server.url.rsplit(":", 1)[1].split("/", 1)[0])
    proxy = BearerProxy(port, token)
    await proxy.start()
    # The suite writes a results/ folder where it runs: a throwaway one, not the caller's.
    folder = tempfile.TemporaryDirectory(prefix="conformance-")
    try:
        suite = await asyncio.create_subprocess_exec(
            str(CONFORMANCE),
            "server",
            "--url",
            f"http://127.0.0.1:{proxy.port}/mcp",
            "--scenario",
            scenario,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            cwd=folder.name,
        )
        output, _ = await asyncio.wait_for(suite.communicate(), 120)
        return await suite.wait(), output.decode(errors="replace")
    finally:
        await proxy.close()
        folder.cleanup()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_official_conformance_scenario_passes(served: tuple[HttpServer, str], scenario: str) -> None:
    server, token = served
    status, output = asyncio.run(_run(server, token, scenario))
    assert status == 0, output
    assert "Failed: 0" in output or "FAILURE" not in output, output
