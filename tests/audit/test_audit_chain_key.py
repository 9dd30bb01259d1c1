"""A keyed and anchored audit chain: ``audit.key`` (HMAC-SHA256), ``runner audit head`` and
``runner audit verify --head``. The attacks rewrite and cut real runners' logs; every verdict
comes from the real command line in a process of its own."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ToolBench

from runner import Runner
from runner.audit import chain as audit_chain
from runner.audit.verify import verify
from runner.errors import ConfigError

CHECKOUT = Path(__file__).resolve().parents[2]
KEY_VAR = "RUNNER_TEST_CHAIN_KEY"
KEY = "k3y-0f-the-audit-chain-7c1d9e"
ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
ENVIRONMENT = "import json, os, sys\nsys.stdin.read()\njson.dump(dict(os.environ), sys.stdout)\n"


def cli(bench: ToolBench, *args: str, key: str | None = KEY) -> subprocess.CompletedProcess[str]:
    """``python -m runner`` over the bench's policy, with the chain's key in the environment
    unless ``key`` is None."""
    env = {name: value for name, value in os.environ.items() if name not in (KEY_VAR, "RUNNER_AUDIT_LOG")}
    env["PYTHONPATH"] = str(CHECKOUT)
    if key is not None:
        env[KEY_VAR] = key
    argv = [sys.executable, "-m", "runner", "--policies", str(bench.root / "policies.yaml"), *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=bench.root, timeout=60)


def keyed(bench: ToolBench, key: dict[str, str] | None = None) -> None:
    """The bench's policy: a chained log, keyed from ``KEY_VAR`` (or ``key``), a tool ``ok``
    the role may call and a tool ``rm_rf`` it may not."""
    bench.policy["audit"] = {"path": "audit.log", "chain": True, "key": key or {"env": KEY_VAR}}
    bench.policy["roles"] = {"user": {"allow": ["ok", "env"], "deny": ["rm_rf"]}}
    bench.tool("ok", ECHO)
    bench.tool("rm_rf", ECHO)
    (bench.root / "policies.yaml").write_text(yaml.safe_dump(bench.policy))


def write_calls(bench: ToolBench, monkeypatch: pytest.MonkeyPatch, tools: list[str]) -> list[bytes]:
    """A real runner calls each of ``tools`` (keyed from ``KEY_VAR``); the log's lines."""
    monkeypatch.setenv(KEY_VAR, KEY)
    runner = Runner.load(tools=bench.tools, policies=bench.root / "policies.yaml")
    try:
        for index, tool in enumerate(tools):
            runner.handle({"toolName": tool, "params": {"i": index}, "requestId": f"req_{index}"})
    finally:
        runner.close()
    return (bench.root / "audit.log").read_bytes().splitlines(keepends=True)


def rehashed(lines: list[bytes], start: int, edit: Any) -> list[bytes]:
    """What an attacker without the key writes: line ``start`` (0-based) changed by ``edit``,
    and it and every later line given a fresh SHA-256 chain, linked as a writer links."""
    out = lines[:start]
    prev = json.loads(lines[start - 1])["hash"] if start else audit_chain.GENESIS
    for index, raw in enumerate(lines[start:]):
        event = json.loads(raw)
        del event["hash"]
        if index == 0:
            edit(event)
        line = audit_chain.chained_line(event, prev)
        prev = json.loads(line)["hash"]
        out.append(line.encode("ascii") + b"\n")
    return out


def verdict_of(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert "Traceback" not in done.stderr, done.stderr
    verdict: dict[str, Any] = json.loads(done.stdout)
    return verdict


def allow_instead(event: dict[str, Any]) -> None:
    assert event["event"] == "policy.decision" and event["decision"] == "deny"
    event["decision"], event["reason"] = "allow", "allowed"


# -- keyed: a rewrite without the key never verifies --------------------------------------


def test_a_deny_turned_allow_with_every_later_line_rehashed_is_caught_with_the_key(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyed(bench)
    lines = write_calls(bench, monkeypatch, ["rm_rf", "rm_rf", "rm_rf"])
    log = bench.root / "audit.log"
    intact = cli(bench, "audit", "verify", "--json")
    assert intact.returncode == 0, intact.stdout + intact.stderr
    assert verdict_of(intact)["keyed"] is True
    denial = next(i for i, raw in enumerate(lines) if b'"decision":"deny"' in raw and b"req_1" in raw)
    log.write_bytes(b"".join(rehashed(lines, denial, allow_instead)))
    assert b'"decision":"allow"' in log.read_bytes()

    caught = cli(bench, "audit", "verify", "--json")
    assert caught.returncode == 1
    verdict = verdict_of(caught)
    first = verdict["problems"][0]
    assert (first["line"], first["kind"]) == (denial + 1, "changed")
    assert verdict["problemCount"] == len(lines) - denial  # the edited line and every rehashed one
    human = cli(bench, "audit", "verify")
    assert human.returncode == 1
    assert human.stdout.startswith(f"NOT intact: {log}: line {denial + 1}: changed:")


def test_the_same_rewrite_of_an_unkeyed_chain_verifies_which_is_what_the_key_is_for(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyed(bench)
    bench.policy["audit"] = {"path": "audit.log", "chain": True}
    (bench.root / "policies.yaml").write_text(yaml.safe_dump(bench.policy))
    lines = write_calls(bench, monkeypatch, ["rm_rf", "rm_rf", "rm_rf"])
    denial = next(i for i, raw in enumerate(lines) if b'"decision":"deny"' in raw and b"req_1" in raw)
    (bench.root / "audit.log").write_bytes(b"".join(rehashed(lines, denial, allow_instead)))
    passed = cli(bench, "audit", "verify", "--json")
    assert passed.returncode == 0
    assert verdict_of(passed)["keyed"] is False
    assert "unkeyed: SHA-256" in cli(bench, "audit", "verify").stdout


def test_verify_with_a_wrong_key_fails_and_says_the_key_is_the_likely_cause(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyed(bench)
    lines = write_calls(bench, monkeypatch, ["ok", "rm_rf"])
    wrong = cli(bench, "audit", "verify", "--json", key=KEY + "x")
    assert wrong.returncode == 1
    verdict = verdict_of(wrong)
    assert verdict["chained"] == 0
    assert verdict["problemCount"] == len(lines)
    assert {problem["kind"] for problem in verdict["problems"]} == {"changed"}
    human = cli(bench, "audit", "verify", key=KEY + "x")
    assert human.returncode == 1
    assert "the wrong key" in human.stdout
    # Checked as plain SHA-256 (no policy, no key given), a keyed log fails too.
    unkeyed = subprocess.run(
        [sys.executable, "-m", "runner", "audit", "verify", "--log", str(bench.root / "audit.log")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(CHECKOUT)},
        cwd=bench.tools,  # no policies.yaml here
        timeout=60,
    )
    assert unkeyed.returncode == 1, unkeyed.stdout
    assert "unkeyed SHA-256" in unkeyed.stdout


def test_an_auditor_without_the_policy_gives_the_key_with_key_env_or_key_file(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyed(bench)
    write_calls(bench, monkeypatch, ["ok", "rm_rf"])
    elsewhere = bench.root / "auditor"
    elsewhere.mkdir()
    (elsewhere / "copy.key").write_text(KEY + "\n")
    (elsewhere / "copy.key").chmod(0o600)
    log = str(bench.root / "audit.log")
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT), "COPY_OF_KEY": KEY}
    env.pop("RUNNER_POLICIES", None)
    verdicts = []
    for given in (["--key-env", "COPY_OF_KEY"], ["--key-file", "copy.key"], ["--key-env", "NOT_SET_HERE"]):
        argv = [sys.executable, "-m", "runner", "audit", "verify", "--log", log, *given]
        verdicts.append(
            subprocess.run(argv, capture_output=True, text=True, env=env, cwd=elsewhere, timeout=60)
        )
    assert [done.returncode for done in verdicts] == [0, 0, 2], [done.stderr for done in verdicts]
    assert "keyed: HMAC-SHA256 with the key from environment variable COPY_OF_KEY" in verdicts[0].stdout
    assert verdicts[2].stderr == "runner: --key-env: environment variable NOT_SET_HERE is not set\n"


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_a_key_missing_from_the_environment_is_a_clear_error_never_an_unkeyed_verify(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    keyed(bench)
    write_calls(bench, monkeypatch, ["ok"])
    done = cli(bench, "audit", "verify", "--json", key=value)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stdout == ""  # no verdict at all, intact or not
    said = "is not set" if value is None else "is empty"
    assert f"audit.key: environment variable {KEY_VAR} {said}" in done.stderr


def test_a_runner_without_its_key_refuses_to_load_and_writes_nothing(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyed(bench)
    monkeypatch.delenv(KEY_VAR, raising=False)
    with pytest.raises(ConfigError) as refused:
        Runner.load(tools=bench.tools, policies=bench.root / "policies.yaml")
    assert f"environment variable {KEY_VAR} is not set" in str(refused.value)
    done = cli(bench, "--tools", str(bench.tools), "exec", "ok", "--params", "{}", key=None)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"{KEY_VAR} is not set" in done.stderr
    assert not (bench.root / "audit.log").exists()


def test_the_key_reaches_no_log_event_answer_or_tool(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyed(bench, {"file": "chain.key"})
    key_file = bench.root / "chain.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    bench.tool("env", ENVIRONMENT)
    bench.policy["audit"]["operator_log"] = "faults.log"
    (bench.root / "policies.yaml").write_text(yaml.safe_dump(bench.policy))
    monkeypatch.setenv(KEY_VAR, KEY)  # a tool must not get the variable a key could come from either
    runner = Runner.load(tools=bench.tools, policies=bench.root / "policies.yaml")
    try:
        answers = [runner.handle({"toolName": tool, "params": {}}) for tool in ("env", "rm_rf", "nope")]
    finally:
        runner.close()
    assert answers[0]["success"] is True and answers[0]["result"]
    done = [cli(bench, "audit", *args) for args in (["verify"], ["head"], [])]
    assert [command.returncode for command in done] == [0, 0, 0]
    said = [json.dumps(answers), *(command.stdout + command.stderr for command in done)]
    written = [(bench.root / name).read_bytes().decode() for name in ("audit.log", "faults.log")]
    assert not [text for text in [*said, *written] if KEY in text]
    key_file.chmod(0o640)  # refused: the message names the file and the mode, never the key
    refused = cli(bench, "audit", "verify")
    assert refused.returncode == 2 and "chmod 600" in refused.stderr
    assert KEY not in refused.stderr + refused.stdout


# -- the key file ------------------------------------------------------------------------


def _plant_link(root: Path) -> str:
    (root / "real.key").write_text(KEY)
    (root / "real.key").chmod(0o600)
    (root / "chain.key").symlink_to(root / "real.key")
    return "symbolic link"


def _plant_linked_folder(root: Path) -> str:
    (root / "keys").mkdir()
    (root / "keys" / "chain.key").write_text(KEY)
    (root / "keys" / "chain.key").chmod(0o600)
    (root / "linked").symlink_to(root / "keys")
    return "symbolic link"


def _plant_readable(root: Path) -> str:
    (root / "chain.key").write_text(KEY)
    (root / "chain.key").chmod(0o644)
    return "open to group or others (mode 0644)"


def _plant_fifo(root: Path) -> str:
    os.mkfifo(root / "chain.key", 0o600)
    return "not a regular file"


def _plant_short(root: Path) -> str:
    (root / "chain.key").write_text("short\n")
    (root / "chain.key").chmod(0o600)
    return "holds 5 bytes: a chain key needs at least 16"


def _plant_other_owner(root: Path) -> str:
    (root / "chain.key").write_text(KEY)
    (root / "chain.key").chmod(0o600)
    os.chown(root / "chain.key", 65534, 65534)
    return "belongs to uid 65534"


@pytest.mark.parametrize(
    "plant",
    [_plant_link, _plant_linked_folder, _plant_readable, _plant_fifo, _plant_short, _plant_other_owner],
    ids=["symlink", "symlinked-folder", "world-readable", "fifo", "short", "other-owner"],
)
def test_a_key_file_that_is_not_a_private_plain_file_of_ours_is_refused_naming_why(
    tmp_path: Path, plant: Any
) -> None:
    if plant is _plant_other_owner and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    from runner.audit.key import ChainKeyError, ChainKeySource, read_chain_key  # new: fails alone before

    said = plant(tmp_path)
    name = "linked/chain.key" if plant is _plant_linked_folder else "chain.key"
    result: list[BaseException] = []

    def read() -> None:
        try:
            read_chain_key(ChainKeySource(file=name), tmp_path)
        except BaseException as exc:  # any outcome is checked below
            result.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)  # a FIFO opened blocking would hang here
    assert not reader.is_alive()
    assert len(result) == 1 and isinstance(result[0], ChainKeyError), result
    assert said in str(result[0])
    assert KEY not in str(result[0])


def test_a_private_key_file_is_read_with_one_trailing_newline_dropped(tmp_path: Path) -> None:
    from runner.audit.key import ChainKeySource, read_chain_key

    (tmp_path / "chain.key").write_text(KEY + "\n")
    (tmp_path / "chain.key").chmod(0o600)
    key = read_chain_key(ChainKeySource(file="chain.key"), tmp_path)
    assert key.secret == KEY.encode()
    assert KEY not in repr(key)


@pytest.mark.parametrize(
    "audit",
    [
        {"path": "audit.log", "key": {"env": KEY_VAR}},
        {"path": "audit.log", "chain": True, "key": {"env": KEY_VAR, "file": "k"}},
        {"path": "audit.log", "chain": True, "key": {}},
    ],
    ids=["key-without-chain", "both-sources", "no-source"],
)
def test_a_key_the_policy_cannot_use_stops_the_load(bench: ToolBench, audit: dict[str, Any]) -> None:
    bench.policy["audit"] = audit
    with pytest.raises(ConfigError):
        bench.runner()


# -- anchored: runner audit head and verify --head ------------------------------------------


@pytest.mark.parametrize("with_key", [True, False], ids=["keyed", "unkeyed"])
def test_a_cut_tail_verifies_but_not_against_the_head_recorded_before_the_cut(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch, with_key: bool
) -> None:
    keyed(bench)
    if not with_key:
        bench.policy["audit"] = {"path": "audit.log", "chain": True}
        (bench.root / "policies.yaml").write_text(yaml.safe_dump(bench.policy))
    write_calls(bench, monkeypatch, ["rm_rf", "rm_rf"])
    recorded = cli(bench, "audit", "head", "--json")
    assert recorded.returncode == 0, recorded.stderr
    head = json.loads(recorded.stdout)
    assert cli(bench, "audit", "head").stdout == f"{head['head']} {head['lines']}\n"
    lines = write_calls(bench, monkeypatch, ["rm_rf", "rm_rf"])  # the log grows past the anchor
    anchored = cli(bench, "audit", "verify", "--head", head["head"].upper(), "--json")
    assert anchored.returncode == 0, anchored.stdout
    assert verdict_of(anchored)["anchor"] == {"hash": head["head"], "line": head["lines"]}

    log = bench.root / "audit.log"
    log.write_bytes(b"".join(lines[: head["lines"] - 1]))  # the anchored line and all after it cut
    assert cli(bench, "audit", "verify").returncode == 0  # a shorter chain is still a chain
    cut = cli(bench, "audit", "verify", "--head", head["head"], "--json")
    assert cut.returncode == 1
    verdict = verdict_of(cut)
    assert verdict["anchor"] == {"hash": head["head"], "line": None}
    assert [problem["kind"] for problem in verdict["problems"]] == ["cut"]
    human = cli(bench, "audit", "verify", "--head", head["head"])
    assert human.returncode == 1
    assert f"NOT intact: {log}: line {head['lines']}: cut:" in human.stdout


def test_a_plain_chain_rewritten_whole_verifies_but_not_against_its_recorded_head(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyed(bench)
    bench.policy["audit"] = {"path": "audit.log", "chain": True}
    (bench.root / "policies.yaml").write_text(yaml.safe_dump(bench.policy))
    lines = write_calls(bench, monkeypatch, ["rm_rf", "rm_rf", "rm_rf"])
    head = json.loads(cli(bench, "audit", "head", "--json").stdout)["head"]
    denial = next(i for i, raw in enumerate(lines) if b'"decision":"deny"' in raw and b"req_1" in raw)
    (bench.root / "audit.log").write_bytes(b"".join(rehashed(lines, denial, allow_instead)))
    assert cli(bench, "audit", "verify").returncode == 0
    anchored = cli(bench, "audit", "verify", "--head", head, "--json")
    assert anchored.returncode == 1
    assert [problem["kind"] for problem in verdict_of(anchored)["problems"]] == ["cut"]


def test_an_edited_anchor_line_is_named_changed_and_not_found(
    bench: ToolBench, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyed(bench)
    lines = write_calls(bench, monkeypatch, ["rm_rf"])
    head = json.loads(cli(bench, "audit", "head", "--json").stdout)["head"]
    assert b'"requestId":"req_0"' in lines[-1]
    lines[-1] = lines[-1].replace(b'"requestId":"req_0"', b'"requestId":"req_9"')
    (bench.root / "audit.log").write_bytes(b"".join(lines))
    done = cli(bench, "audit", "verify", "--head", head, "--json")
    assert done.returncode == 1
    assert [problem["kind"] for problem in verdict_of(done)["problems"]] == ["changed", "cut"]


def test_head_of_an_empty_or_torn_log_is_exit_1_and_a_bad_head_is_misuse(bench: ToolBench) -> None:
    keyed(bench)
    log = bench.root / "audit.log"
    log.touch()
    empty = cli(bench, "audit", "head")
    assert (empty.returncode, empty.stdout) == (1, "")
    assert "it is empty" in empty.stderr
    assert json.loads(cli(bench, "audit", "head", "--json").stdout) == {"head": None, "lines": 0}
    log.write_text('{"event":"x"}\n{"event":"torn"')
    torn = cli(bench, "audit", "head", "--json")
    assert torn.returncode == 1
    assert json.loads(torn.stdout) == {"head": None, "lines": 2}
    for bad in ("abc", "g" * 64, hashlib.sha256().hexdigest() + "0"):
        misuse = cli(bench, "audit", "verify", "--head", bad)
        assert misuse.returncode == 2, bad
        assert "Traceback" not in misuse.stderr


def test_an_empty_log_does_not_pass_against_a_recorded_head(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    log.touch()
    verdict = verify(log, anchor="ab" * 32)
    assert not verdict.intact
    assert [problem.kind for problem in verdict.problems] == ["cut"]


def test_a_runner_appending_to_a_chain_its_key_cannot_verify_warns_the_operator(tmp_path: Path) -> None:
    from runner.audit.faults import OperatorLog
    from runner.audit.log import AuditLog

    log, faults = tmp_path / "audit.log", tmp_path / "faults.log"
    for key in (
        b"the first key of the chain",
        b"the first key of the chain",
        b"a new key, a new chain?",
        None,
    ):
        operator = OperatorLog.open(faults)
        audit = AuditLog(log, chain=True, key=key, operator=operator)
        audit.emit("call.finished", toolName="t", requestId="req_0")
        audit.close()
    warnings = faults.read_text().splitlines()
    assert len(warnings) == 2  # the new key, then no key: the same key again is no warning
    assert "does not verify with audit.key" in warnings[0]
    assert "does not verify as unkeyed SHA-256" in warnings[1]
    assert all("start a new log file" in line and "first key" not in line for line in warnings)
