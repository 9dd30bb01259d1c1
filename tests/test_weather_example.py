"""The shipped ``get_weather``: a real tool's shape with real sandboxes.

Offline (no key configured) it answers from its bundled table; an unknown city is a
``tool_error`` that is neither retried nor counted by the breaker. With a key it asks a
weather service through the runner's egress proxy; the service here is one the test
starts on 127.0.0.1 (nothing else is contacted), put in the manifest's place.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from conftest import starter_dir

from runner import Runner

KEY = "owm-key-5f1e9c0b7a3d"  # the test's fake API key: it must appear nowhere but the service


class FakeWeatherService(http.server.BaseHTTPRequestHandler):
    """OpenWeatherMap's current-weather endpoint, as much of it as the tool uses."""

    keys_seen: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        self.keys_seen.append(query.get("appid", [""])[0])
        city = query.get("q", [""])[0]
        if query.get("appid") != [KEY]:
            self._answer(401, {"cod": 401, "message": "Invalid API key"})
        elif city.lower() != "reykjavik":
            self._answer(404, {"cod": "404", "message": "city not found"})
        else:
            self._answer(
                200, {"name": "Reykjavík", "main": {"temp": -3.5}, "weather": [{"description": "snow"}]}
            )

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def service() -> Iterator[int]:
    FakeWeatherService.keys_seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeWeatherService)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def starter_copy(root: Path, port: int | None = None) -> tuple[Path, Path]:
    """The shipped tools and policy; with ``port``, get_weather's service is ours on it."""
    shutil.copytree(starter_dir() / "tools", root / "tools")
    policy_path = root / "policies.yaml"
    shutil.copy(starter_dir() / "policies.yaml", policy_path)
    if port is not None:
        destination = f"127.0.0.1:{port}"
        manifest_path = root / "tools" / "get_weather" / "tool.yaml"
        manifest = yaml.safe_load(manifest_path.read_text())
        manifest["env"]["WEATHER_API_URL"] = f"http://{destination}/data/2.5/weather"
        manifest["network"] = {"allow": [destination]}
        manifest_path.write_text(yaml.safe_dump(manifest))
        policy = yaml.safe_load(policy_path.read_text())
        policy["tools"]["get_weather"]["network"] = {"allow": [destination]}
        policy_path.write_text(yaml.safe_dump(policy))
    return root / "tools", policy_path


def weather(runner: Runner, city: str) -> dict[str, Any]:
    return runner.handle(
        {"toolName": "get_weather", "params": {"city": city}, "options": {"retries": 2, "retryDelay": 0}}
    )


def test_without_a_key_it_answers_from_its_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENWEATHER_API_KEY", raising=False)
    tools, policies = starter_copy(tmp_path)
    with Runner.load(tools=tools, policies=policies, audit_log=tmp_path / "audit.log") as runner:
        answer = weather(runner, "London")
    assert answer["success"], answer
    assert answer["result"] == {"city": "London", "temperature": 9, "unit": "celsius", "condition": "rain"}


def test_unknown_cities_are_tool_errors_that_never_open_the_breaker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENWEATHER_API_KEY", raising=False)
    tools, policies = starter_copy(tmp_path)
    with Runner.load(tools=tools, policies=policies, audit_log=tmp_path / "audit.log") as runner:
        for _ in range(6):  # more than the breaker's threshold of 5
            answer = weather(runner, "Atlantis")
            assert answer["error"]["code"] == "EXECUTION_ERROR", answer
            assert answer["error"]["details"]["reason"] == "tool_error"
            assert answer["error"]["details"]["toolCode"] == "NOT_FOUND"
            assert answer["error"]["retryable"] is False
            assert answer["metadata"]["attempts"] == 1
        assert weather(runner, "Tokyo")["success"], "a model's mistakes opened the breaker"


def test_with_a_key_it_asks_the_service_through_the_proxy_and_never_shows_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, service: int
) -> None:
    monkeypatch.setenv("OPENWEATHER_API_KEY", KEY)
    tools, policies = starter_copy(tmp_path, port=service)
    audit = tmp_path / "audit.log"
    with Runner.load(tools=tools, policies=policies, audit_log=audit) as runner:
        found = weather(runner, "Reykjavik")
        unknown = weather(runner, "Atlantis")
    assert found["success"], found
    assert found["result"] == {
        "city": "Reykjavík",
        "temperature": -3.5,
        "unit": "celsius",
        "condition": "snow",
    }
    assert unknown["error"]["details"]["toolCode"] == "NOT_FOUND", unknown
    assert FakeWeatherService.keys_seen == [KEY, KEY], (
        "the key did not reach the service as the tool's secret"
    )
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    connects = [e for e in events if e["event"] == "network.connect"]
    assert [(e["decision"], e["port"]) for e in connects] == [("allow", service), ("allow", service)]
    assert KEY not in json.dumps([found, unknown]) + audit.read_text()


def test_a_wrong_key_is_a_tool_error_and_the_key_stays_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, service: int
) -> None:
    monkeypatch.setenv("OPENWEATHER_API_KEY", "wrong-key-0c9d8e7f")
    tools, policies = starter_copy(tmp_path, port=service)
    with Runner.load(tools=tools, policies=policies, audit_log=tmp_path / "audit.log") as runner:
        answer = weather(runner, "Reykjavik")
    assert answer["error"]["details"]["toolCode"] == "UNAUTHORIZED", answer
    assert "wrong-key-0c9d8e7f" not in json.dumps(answer) + (tmp_path / "audit.log").read_text()


def test_an_optional_secret_forgives_only_an_absent_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``optional: true`` runs the tool without the variable when the source is not there;
    a source that is there but refused (any user may write the file) still fails the call."""
    monkeypatch.delenv("OPENWEATHER_API_KEY", raising=False)
    tools, policies = starter_copy(tmp_path)
    policy = yaml.safe_load(policies.read_text())
    key_file = tmp_path / "weather.key"
    policy["secrets"]["WEATHER_API_KEY"] = {"file": str(key_file), "optional": True}
    policies.write_text(yaml.safe_dump(policy))
    with Runner.load(tools=tools, policies=policies, audit_log=os.devnull) as runner:
        assert weather(runner, "London")["success"]
    key_file.write_text("planted\n")
    key_file.chmod(0o666)
    with Runner.load(tools=tools, policies=policies, audit_log=os.devnull) as runner:
        refused = weather(runner, "London")
    assert refused["error"]["details"]["reason"] == "secret_unavailable", refused
    assert "writable by any user" in refused["error"]["message"]
