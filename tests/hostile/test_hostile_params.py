"""Hostile params and schemas: secrets quoted by parent keywords, catastrophic patterns,
validations slower than the deadline, NaN and Infinity. Real tools, real sandboxes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import ToolBench

from runner import Runner
from runner.call.guard import VALIDATION_GRACE_S
from runner.schema.strict_json import depth

ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
SECRET = "s3cr3t-TOKEN-1f9d"
EVIL = "^(a+)+$"
EVIL_INPUT = "a" * 27 + "!"  # 6.9 s with a backtracking engine


def secret_schema(**extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"user": {"type": "string"}, "token": {"type": "string", "x-sensitive": True}},
        **extra,
    }


# -- x-sensitive values (issue 8, item 5) ---------------------------------------------


@pytest.mark.parametrize(
    ("schema", "params"),
    [
        (secret_schema(maxProperties=1), {"user": "ann", "token": SECRET}),
        (secret_schema(minProperties=3), {"user": "ann", "token": SECRET}),
        (
            {
                "type": "object",
                "oneOf": [{"required": ["user"]}, {"required": ["token"]}],
                "properties": {"token": {"x-sensitive": True}},
            },
            {"user": "ann", "token": SECRET},
        ),
        (
            {"type": "object", "not": {"required": ["token"]}, "additionalProperties": {"x-sensitive": True}},
            {"token": SECRET},
        ),
    ],
    ids=["maxProperties", "minProperties", "oneOf", "not-over-additionalProperties"],
)
def test_a_secret_quoted_by_a_failing_parent_keyword_stays_out_of_the_answer_and_the_log(
    bench: ToolBench, schema: dict[str, Any], params: dict[str, Any]
) -> None:
    bench.tool("login", ECHO, parameters=schema)
    answer = bench.runner().handle({"toolName": "login", "params": params})
    assert answer["error"]["code"] == "INVALID_PARAMS"
    assert SECRET not in json.dumps(answer)
    assert SECRET not in bench.audit_log.read_text()


def test_a_sensitive_number_quoted_by_a_parent_keyword_stays_out_of_the_answer(bench: ToolBench) -> None:
    schema = {
        "type": "object",
        "maxProperties": 1,
        "properties": {"pin": {"type": "integer", "x-sensitive": True}, "user": {"type": "string"}},
    }
    bench.tool("pin", ECHO, parameters=schema)
    answer = bench.runner().handle({"toolName": "pin", "params": {"pin": 73195524, "user": "ann"}})
    assert answer["error"]["code"] == "INVALID_PARAMS"
    assert "73195524" not in json.dumps(answer)
    assert "73195524" not in bench.audit_log.read_text()


@pytest.mark.parametrize(
    ("schema", "params"),
    [
        (
            {"type": "object", "additionalProperties": {"type": "string", "x-sensitive": True}},
            {"token": SECRET},
        ),
        (
            {"type": "object", "patternProperties": {"^tok": {"x-sensitive": True}}},
            {"token": SECRET},
        ),
        (
            {
                "type": "object",
                "properties": {"pair": {"type": "array", "prefixItems": [{}, {"x-sensitive": True}]}},
            },
            {"pair": ["user", SECRET]},
        ),
        (
            {
                "type": "object",
                "if": {"required": ["kind"]},
                "then": {"properties": {"token": {"x-sensitive": True}}},
            },
            {"kind": "bearer", "token": SECRET},
        ),
    ],
    ids=["additionalProperties", "patternProperties", "prefixItems", "if-then"],
)
def test_a_secret_marked_under_any_applicator_never_reaches_the_log(
    bench: ToolBench, schema: dict[str, Any], params: dict[str, Any]
) -> None:
    bench.tool("login", ECHO, parameters=schema)
    answer = bench.runner().handle({"toolName": "login", "params": params})
    assert answer["success"] is True
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    assert [e["event"] for e in events] == ["policy.decision", "call.attempt", "call.finished"]
    assert SECRET not in json.dumps(events)
    assert "***" in json.dumps(events[0]["params"])


def test_a_secret_a_failing_tool_echoes_is_scrubbed_from_the_answer_and_every_event(
    bench: ToolBench,
) -> None:
    code = (
        "import json, sys\n"
        "token = json.load(sys.stdin)['params']['creds']['token']\n"
        "print('login failed for', token, file=sys.stderr)\n"
        "print(json.dumps({'error': {'message': 'bad token ' + token, 'retryable': True}}))\n"
        "sys.exit(3)\n"
    )
    schema = {"type": "object", "additionalProperties": {"type": "object", "x-sensitive": True}}
    bench.tool("leaky", code, parameters=schema)
    answer = bench.runner().handle(
        {"toolName": "leaky", "params": {"creds": {"token": SECRET}}, "options": {"retries": 1}}
    )
    assert answer["error"]["code"] == "RETRY_EXHAUSTED"
    assert SECRET not in json.dumps(answer)
    events = [json.loads(line) for line in bench.audit_log.read_text().splitlines()]
    assert [e["event"] for e in events] == [
        "policy.decision",
        "call.attempt",
        "call.attempt",
        "call.finished",
    ]
    assert SECRET not in json.dumps(events)
    assert "***" in events[1]["stderr"]


def test_a_sensitive_number_a_failing_tool_echoes_is_scrubbed_from_the_answer_events_and_log(
    bench: ToolBench,
) -> None:
    # A PIN is a number: it was kept out of the log where it stood, but not cut out of
    # the text the tool wrote around it.
    code = (
        "import json, sys\n"
        "pin = json.load(sys.stdin)['params']['pin']\n"
        "print('bad pin', pin, file=sys.stderr)\n"
        "print('\\x1e' + json.dumps({'log': 'info', 'data': f'pin is {pin}'}), file=sys.stderr)\n"
        "print('\\x1e' + json.dumps({'content': {'type': 'text', 'text': f'pin is {pin}'}}), file=sys.stderr)\n"
        "print(json.dumps({'error': {'message': f'bad pin {pin}'}}))\n"
        "sys.exit(3)\n"
    )
    schema = {"type": "object", "properties": {"pin": {"type": "integer", "x-sensitive": True}}}
    bench.tool("pin", code, parameters=schema)
    heard: list[dict[str, Any]] = []
    result = bench.runner().call("pin", {"pin": 48151623}, on_event=heard.append)
    assert not result.success
    assert len(heard) == 2
    assert "48151623" not in json.dumps([result.to_wire(), heard])
    assert "48151623" not in bench.audit_log.read_text()
    assert "bad pin ***" in bench.audit_log.read_text()


# -- patterns and validation time (issue 8, item 6) -----------------------------------


def test_a_catastrophic_pattern_answers_at_once_and_does_not_stall_a_concurrent_call(
    bench: ToolBench,
) -> None:
    bench.tool("evil", ECHO, parameters={"type": "object", "properties": {"s": {"pattern": EVIL}}})
    bench.tool("ok", ECHO)
    runner = bench.runner()

    async def both() -> tuple[dict[str, Any], dict[str, Any], float]:
        started = time.monotonic()
        evil = asyncio.ensure_future(
            runner.ahandle(
                {
                    "toolName": "evil",
                    "params": {"s": EVIL_INPUT},
                    "options": {"timeout": 100, "deadline": 100},
                }
            )
        )
        ok = await runner.ahandle({"toolName": "ok", "params": {"i": 1}})
        ok_after = time.monotonic() - started
        return await evil, ok, ok_after

    started = time.monotonic()
    evil, ok, ok_after = asyncio.run(both())
    assert time.monotonic() - started < 2.0
    assert evil["error"]["code"] == "INVALID_PARAMS"
    assert ok["result"] == {"i": 1}
    assert ok_after < 2.0


def test_a_catastrophic_pattern_property_name_answers_at_once(bench: ToolBench) -> None:
    schema = {"type": "object", "patternProperties": {EVIL: {}}, "additionalProperties": False}
    bench.tool("evil", ECHO, parameters=schema)
    runner = bench.runner()
    started = time.monotonic()
    answer = runner.handle({"toolName": "evil", "params": {EVIL_INPUT: 1}, "options": {"deadline": 100}})
    assert time.monotonic() - started < 1.0
    assert answer["error"]["code"] == "INVALID_PARAMS"
    assert runner.handle({"toolName": "evil", "params": {"aaa": 1}})["success"] is True


@pytest.mark.parametrize("pattern", ["^(?=a)a$", r"^(a)\1$", "(?<!x)y"])
def test_a_pattern_re2_cannot_compile_leaves_the_tool_out_with_a_reason(
    bench: ToolBench, pattern: str
) -> None:
    bench.tool("lookaround", ECHO, parameters={"type": "object", "properties": {"s": {"pattern": pattern}}})
    bench.tool("keyed", ECHO, parameters={"type": "object", "patternProperties": {pattern: {}}})
    bench.tool("ok", ECHO)
    bench.runner()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner",
            "--tools",
            str(bench.tools),
            "--policies",
            str(bench.root / "policies.yaml"),
            "validate",
        ],
        capture_output=True,
        text=True,
        cwd=bench.root,
        timeout=60,
        env={**os.environ, "RUNNER_AUDIT_LOG": os.devnull},
    )
    assert done.returncode == 1
    invalid = [line for line in done.stdout.splitlines() if line.startswith("invalid:")]
    assert len(invalid) == 2
    assert all("tool.yaml" in line for line in invalid)
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("ok:")] == ["ok"]
    assert done.stderr == ""  # RE2 does not print its complaints


def test_a_regex_param_that_breaks_pythons_regex_compiler_is_invalid_params(bench: ToolBench) -> None:
    schema = {"type": "object", "properties": {"expr": {"type": "string", "format": "regex"}}}
    bench.tool("grep", ECHO, parameters=schema)
    runner = bench.runner()
    for expr in ["(" * 5000, "(?=lookahead)", "a[", "x{2,1}"]:
        answer = runner.handle({"toolName": "grep", "params": {"expr": expr}})
        assert answer["error"]["code"] == "INVALID_PARAMS", expr
    assert runner.handle({"toolName": "grep", "params": {"expr": "^a+$"}})["success"] is True


def _slow_to_validate(bench: ToolBench) -> None:
    item = {"type": "string", "minLength": 1, "maxLength": 5}
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": item}}}
    bench.tool("slow", ECHO, parameters=schema)


SLOW_PARAMS = {"xs": ["ab"] * 400_000}  # 2.4 MB; about 4 s of jsonschema here


DEADLINE_MS = 200


def _timed(runner: Runner, tool: str) -> tuple[float, dict[str, Any]]:
    started = time.monotonic()
    answer = runner.handle({"toolName": tool, "params": SLOW_PARAMS, "options": {"deadline": DEADLINE_MS}})
    return time.monotonic() - started, answer


@pytest.mark.slow
def test_a_validation_slower_than_the_deadline_answers_timeout_on_time(bench: ToolBench) -> None:
    # Parsing, redacting and auditing 2.4 MB of params take their own time, which a loaded
    # machine stretches: that floor is measured here, in turns with the slow call, as the
    # same params sent to a tool with nothing slow to check (denied after validation: no
    # sandbox). Waiting for the slow validation may add the deadline and its grace on top,
    # and up to the floor again (a second redaction of the params while the expired one
    # finishes, load that changes between the turns); never the validation's own time,
    # which is many times the floor and grows with the load alike.
    _slow_to_validate(bench)
    bench.tool("quick", ECHO, parameters={"type": "object"})
    bench.policy["roles"] = {"user": {"allow": ["slow"]}}
    runner = bench.runner()
    floors, slows = [], []
    for _ in range(3):
        floor, denied = _timed(runner, "quick")
        assert denied["error"]["code"] == "PERMISSION_DENIED"
        slow, answer = _timed(runner, "slow")
        assert answer["error"]["code"] == "TIMEOUT"
        assert answer["metadata"]["attempts"] == 0
        floors.append(floor)
        slows.append(slow)
    floor, slow = min(floors), min(slows)
    assert slow - floor < DEADLINE_MS / 1000 + VALIDATION_GRACE_S + floor, (floors, slows)


@pytest.mark.slow
def test_validation_runs_off_the_event_loop(bench: ToolBench) -> None:
    _slow_to_validate(bench)
    bench.tool("ok", ECHO)
    runner = bench.runner()
    # About 8 s of validation: the quick call is slowed meanwhile (the validating thread
    # holds the GIL between its switches), but ends long before that; validated on the
    # loop, it could not start before.
    slow_params = {"xs": SLOW_PARAMS["xs"] * 2}

    async def both() -> tuple[dict[str, Any], float]:
        started = time.monotonic()
        slow = asyncio.ensure_future(
            runner.ahandle({"toolName": "slow", "params": slow_params, "options": {"deadline": 30_000}})
        )
        await asyncio.sleep(0)  # the slow call starts validating first
        ok = await runner.ahandle({"toolName": "ok", "params": {"i": 1}})
        ok_after = time.monotonic() - started
        await slow
        return ok, ok_after

    ok, ok_after = asyncio.run(both())
    assert ok["result"] == {"i": 1}
    assert ok_after < 4.0


# -- NaN and Infinity in (issue 8, item 9) --------------------------------------------


def _cli(bench: ToolBench, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    bench.write_policy()
    argv = [
        sys.executable,
        "-m",
        "runner",
        "--tools",
        str(bench.tools),
        "--policies",
        str(bench.root / "policies.yaml"),
    ]
    return subprocess.run(
        [*argv, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=bench.root,
        timeout=60,
        env={**os.environ, "RUNNER_AUDIT_LOG": str(bench.audit_log)},
    )


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} printed")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_nan_and_infinity_params_from_the_command_line_are_invalid_params(
    bench: ToolBench, number: str
) -> None:
    bench.tool("ok", ECHO)
    by_flag = _cli(bench, "exec", "ok", "--params", f'{{"a": {number}}}')
    by_stdin = _cli(bench, "exec", "-", stdin=f'{{"toolName": "ok", "params": {{"a": [{number}]}}}}')
    for done in (by_flag, by_stdin):
        assert done.returncode == 1, done.stderr
        answer = _strict(done.stdout)
        assert answer["error"]["code"] == "INVALID_PARAMS"
        assert answer["metadata"]["attempts"] == 0


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_infinity_floats_handed_to_handle_are_invalid_params(bench: ToolBench, value: float) -> None:
    bench.tool("ok", ECHO)
    runner = bench.runner()
    for params in ({"a": value}, {"deep": {"list": [1, value]}}):
        answer = runner.handle({"toolName": "ok", "params": params})
        assert answer["error"]["code"] == "INVALID_PARAMS"
        assert answer["metadata"]["attempts"] == 0
    assert runner.handle({"toolName": "ok", "params": {}, "metadata": {"x": value}})["error"]["code"] == (
        "INVALID_PARAMS"
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1), ([], 1), ({}, 1), ([1], 2), ({"a": {}}, 2), ({"a": {"b": [1, [2, [3]]]}}, 6), ([[[[]]]], 4)],
)
def test_the_depth_of_params_counts_a_leaf_as_a_level_and_walks_containers_only(
    value: object, expected: int
) -> None:
    # Only containers are walked: a flat array of millions of numbers is checked quickly.
    assert depth(value) == expected
    assert depth([0] * 100_000 + [[[]]]) == 3


def _exponential_for_null(levels: int) -> dict[str, Any]:
    """A property whose schema takes null, but only after 2**levels failing branches."""

    def refs(to: int) -> list[dict[str, str]]:
        return [{"$ref": f"#/$defs/n{to}"} for _ in range(2)]

    defs: dict[str, Any] = {f"n{i}": {"anyOf": refs(i + 1)} for i in range(1, levels)}
    defs["n0"] = {"anyOf": [*refs(1), {"type": "null"}]}
    defs[f"n{levels}"] = {"type": "string"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/n0"}}, "$defs": defs}


def test_a_null_slow_to_validate_answers_timeout_and_lets_the_runner_end(bench: ToolBench) -> None:
    # A null for an optional property was first walked (is it to count as left out?) with
    # no stop time: the call answered at its deadline, but its thread ran on, and
    # `runner exec` waited for it at exit (2**24 branches: hours).
    bench.tool("slowval", ECHO, parameters=_exponential_for_null(24))
    policy = bench.write_policy()
    argv = [sys.executable, "-m", "runner", "--policies", str(policy), "exec", "slowval"]
    started = time.monotonic()
    done = subprocess.run(
        [*argv, "--deadline", "500", "--params", '{"a": null}'],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=bench.root,
    )
    answer = json.loads(done.stdout)
    assert answer["error"]["code"] == "TIMEOUT", answer
    assert time.monotonic() - started < 60


def test_a_huge_integer_against_a_fractional_multiple_of_is_judged_not_an_internal_error(
    bench: ToolBench,
) -> None:
    # jsonschema divides it as a float: OverflowError, an internal error of the runner.
    halves, tenths = {"multipleOf": 0.5}, {"multipleOf": 0.1}
    bench.tool("mult", ECHO, parameters={"type": "object", "properties": {"half": halves, "tenth": tenths}})
    runner = bench.runner()
    huge = int("9" * 400)
    assert runner.handle({"toolName": "mult", "params": {"half": huge}})["result"] == {"half": huge}
    refused = runner.handle({"toolName": "mult", "params": {"tenth": huge}})  # 0.1 is not exact
    assert refused["error"]["code"] == "INVALID_PARAMS", refused["error"]


def test_a_sensitive_value_stays_out_of_the_audit_when_validation_is_cut_short(bench: ToolBench) -> None:
    # Cut short, validation had not marked the token, and the schema's static walk gave up
    # in the $refs first: the policy.decision event held the token in clear.
    levels = 40  # an anyOf of two $refs each: a value of no branch's type is 2**40 steps
    defs: dict[str, Any] = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"} for _ in range(2)]} for i in range(levels)
    }
    defs[f"d{levels}"] = {"type": "string"}
    token = {"type": "string", "x-sensitive": True}
    # "z" after "token": the schema's static walk gives up in the $refs before it finds the mark.
    properties: dict[str, Any] = {"token": token, "z": {"$ref": "#/$defs/d0"}}
    schema = {"type": "object", "properties": properties, "$defs": defs}
    bench.tool("sens", ECHO, parameters=schema)
    runner = bench.runner()
    for z in (None, 5):  # the null's walk cut short; the validation cut short
        answer = runner.handle(
            {"toolName": "sens", "params": {"z": z, "token": "SECRET-abc-123"}, "options": {"deadline": 300}}
        )
        assert answer["error"]["code"] == "TIMEOUT", answer
    runner.close()
    # Cut short by a $ref it cannot follow (one before the token, in the params' order).
    schema["properties"] = {"a": {"$ref": "https://example.invalid/none.json"}, **properties}
    bench.tool("sens2", ECHO, parameters=schema)
    runner = bench.runner()
    answer = runner.handle({"toolName": "sens2", "params": {"a": 1, "token": "SECRET-abc-123"}})
    assert answer["error"]["code"] == "INVALID_PARAMS", answer
    runner.close()
    assert "SECRET-abc-123" not in bench.audit_log.read_text()
