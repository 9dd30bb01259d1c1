"""``runner audit report``: its numbers against a direct computation over the same
generated log, grouping, ``--since``, bounded structures, hostile lines."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from runner.audit import report as audit_report
from runner.audit.report import DurationHistogram, report_file

CHECKOUT = Path(__file__).resolve().parents[2]
START = datetime(2026, 12, 1, tzinfo=UTC)
TOOLS = ("add_numbers", "echo", "fetch")
ROLES = ("user", "admin")
DENY_REASONS = ("not_allowed", "disabled", "tool_not_found")
FAILURES = (("TIMEOUT", "timeout"), ("EXECUTION_ERROR", "nonzero_exit"), ("EXECUTION_ERROR", "memory_limit"))


def _stamp(second: int) -> str:
    return (START + timedelta(seconds=second)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def generate(path: Path, calls: int, seed: int = 7) -> list[dict[str, Any]]:
    """A log of ``calls`` calls as the runner writes them; the call.finished and decision events."""
    rng = random.Random(seed)
    kept: list[dict[str, Any]] = []
    with path.open("w") as log:
        for index in range(calls):
            common: dict[str, Any] = {
                "timestamp": _stamp(index),
                "requestId": f"req_{index:032x}",
                "traceId": f"{index:032x}",
                "toolName": rng.choice(TOOLS),
                "role": rng.choice(ROLES),
            }
            if rng.random() < 0.5:
                common["client"] = rng.choice(("ci-agent", "ops"))
            if rng.random() < 0.3:  # a call made in a session
                common["sessionId"] = rng.choice(("ses_a", "ses_b", "ses_c"))
            denied = rng.random() < 0.1
            decision: dict[str, Any] = {
                **common,
                "event": "policy.decision",
                "decision": "deny" if denied else "allow",
                "reason": rng.choice(DENY_REASONS) if denied else "allowed",
                "rule": None,
                "params": {"event": "call.finished", "note": "a param that looks like an event"},
            }
            events: list[dict[str, Any]] = [decision]
            duration = rng.choice((rng.randint(0, 900), rng.randint(0, 60), int(rng.lognormvariate(8, 1))))
            if denied:
                finished = {
                    "success": False,
                    "code": "PERMISSION_DENIED",
                    "reason": decision["reason"],
                    "attempts": 0,
                }
            else:
                events.append({**common, "event": "call.attempt", "attempt": 1, "duration": duration})
                roll = rng.random()
                if roll < 0.75:
                    finished = {"success": True, "code": None, "reason": None, "attempts": 1}
                elif roll < 0.8:
                    finished = {
                        "success": False,
                        "code": None,
                        "reason": None,
                        "attempts": 1,
                        "cancelled": True,
                    }
                else:
                    code, reason = rng.choice(FAILURES)
                    finished = {"success": False, "code": code, "reason": reason, "attempts": 1}
            events.append({**common, "event": "call.finished", "duration": duration, **finished})
            for event in events:
                log.write(json.dumps(event, separators=(",", ":")) + "\n")
            kept += [event for event in events if event["event"] != "call.attempt"]
    return kept


def nearest_rank(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(fraction * len(ordered)), 1) - 1]


def direct(
    events: list[dict[str, Any]], field: str, since: datetime | None = None
) -> dict[str, dict[str, Any]]:
    """The report, computed the plain way: every value kept, sorted."""
    groups: dict[str, dict[str, Any]] = {}
    for event in events:
        if since is not None and datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")) < since:
            continue
        group = groups.setdefault(
            str(event.get(field, "-")),
            {"calls": 0, "successes": 0, "cancelled": 0, "denials": Counter(), "errors": {}, "durations": []},
        )
        if event["event"] == "policy.decision":
            if event["decision"] == "deny":
                group["denials"][event["reason"]] += 1
            continue
        group["calls"] += 1
        group["durations"].append(event["duration"])
        if event["success"]:
            group["successes"] += 1
        elif event.get("cancelled"):
            group["cancelled"] += 1
        else:
            group["errors"].setdefault(event["code"], Counter())[event["reason"]] += 1
    return groups


def assert_close(found: float | None, exact: float | None) -> None:
    assert (found is None) == (exact is None)
    if found is None or exact is None:
        return
    if exact < audit_report.EXACT_BELOW_MS:
        assert found == exact
    else:  # the bucket's middle: within half a bucket of the true value
        assert abs(found - exact) <= exact * (audit_report.BUCKET_RATIO - 1) / 2 + 1e-9, (found, exact)


@pytest.mark.parametrize("by", ["tool", "role", "client", "session"])
def test_report_numbers_match_a_direct_computation(tmp_path: Path, by: str) -> None:
    log = tmp_path / "audit.log"
    events = generate(log, 4000)
    expected = direct(events, audit_report.GROUP_FIELDS[by])
    report = report_file(log, by)  # type: ignore[arg-type]
    assert set(report.groups) == set(expected)
    for name, stats in report.groups.items():
        want = expected[name]
        assert (stats.calls, stats.successes, stats.cancelled) == (
            want["calls"],
            want["successes"],
            want["cancelled"],
        )
        assert stats.denials == want["denials"]
        assert stats.errors == want["errors"]
        assert_close(stats.durations.percentile(0.5), nearest_rank(want["durations"], 0.5))
        assert_close(stats.durations.percentile(0.95), nearest_rank(want["durations"], 0.95))
    assert report.total.calls == 4000
    assert sum(stats.calls for stats in report.groups.values()) == 4000


def test_since_keeps_only_events_at_or_after_it(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    events = generate(log, 1000)
    since = START + timedelta(seconds=600)
    expected = direct(events, "toolName", since)
    report = report_file(log, "tool", since)
    assert {name: stats.calls for name, stats in report.groups.items()} == {
        name: group["calls"] for name, group in expected.items()
    }
    assert report.total.calls == 400


def test_percentiles_are_exact_below_a_second_and_within_half_a_percent_above() -> None:
    rng = random.Random(3)
    values = [rng.randint(0, 999) for _ in range(5000)] + [rng.uniform(1000, 3_600_000) for _ in range(5000)]
    histogram = DurationHistogram()
    for value in values:
        histogram.add(value)
    for fraction in (0.01, 0.25, 0.5, 0.9, 0.95, 0.99, 1.0):
        exact = nearest_rank(values, fraction)
        assert exact is not None
        found = histogram.percentile(fraction)
        assert found is not None
        if exact < 1000:
            assert found == round(exact)
        else:
            assert abs(found - exact) <= exact * 0.005 + 0.1, (fraction, found, exact)
    assert len(histogram._counts) < 1000 + 1500  # buckets, not values: bounded whatever the count


def test_hostile_lines_are_skipped_and_invented_tool_names_cannot_grow_the_report_without_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit_report, "MAX_GROUPS", 50)
    log = tmp_path / "audit.log"
    with log.open("w") as file:
        file.write('{"event":"call.finished","duration":NaN,"success":true,"toolName":"x"}\n')
        file.write('{"event":"call.finished","duration":1e999,"success":true,"toolName":"x"}\n')
        file.write('{"event":"call.finished","duration":5,"success":true,"toolName":"x"}\n')
        file.write('["call.finished"]\n')
        file.write("call.finished is not json\n")
        file.write('{"event":"call.finished","toolName":"y","success":true}' + " " * (2 << 20) + "\n")
        for index in range(500):  # a caller asking for tools that do not exist
            event = {"event": "policy.decision", "decision": "deny", "reason": "tool_not_found"}
            file.write(json.dumps({**event, "toolName": f"nope{index}"}) + "\n")
        file.write('{"event":"call.finished","toolName":"x","success":true,"duration":7}')  # no newline
    report = report_file(log, "tool")
    assert len(report.groups) == 51
    assert report.groups[audit_report.OTHER].denials == Counter({"tool_not_found": 451})
    # NaN and 1e999 are calls without a duration; a whole last line without newline counts.
    assert report.groups["x"].calls == 4
    assert report.groups["x"].durations.count == 2
    assert report.skipped == 2  # the text line, and the line past the length bound


def test_a_deeply_nested_line_is_skipped_and_counted(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    log.write_bytes(
        b'{"event":"call.finished","toolName":' + b"[" * 200_000 + b"\n"
        b'{"event":"call.finished","toolName":"x","success":true}\n'
    )
    report = report_file(log, "tool")
    assert report.skipped == 1 and report.groups["x"].calls == 1
    done = _cli("--log", str(log), "--json")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert json.loads(done.stdout)["total"]["calls"] == 1


def test_group_names_codes_and_reasons_are_cut_so_memory_stays_bounded(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    huge = "n" * 300_000  # three such fields to a line: under the 1 MiB line bound
    with log.open("w") as file:
        for index in range(3):
            event = {"event": "call.finished", "toolName": f"{index}{huge}", "success": False}
            file.write(json.dumps({**event, "code": f"C{huge}", "reason": f"{index}{huge}"}) + "\n")
    report = report_file(log, "tool")
    cut = audit_report.MAX_KEY_CHARS
    assert len(report.groups) == 3
    for name, stats in report.groups.items():
        assert len(name) == cut and name.endswith(audit_report.CUT)
        ((code, reasons),) = stats.errors.items()
        assert len(code) == cut and all(len(reason) == cut for reason in reasons)


def _chained_with_forged_prefix(log: Path) -> None:
    from runner.audit.log import AuditLog

    audit = AuditLog(log, chain=True)
    for _ in range(3):
        audit.emit("call.finished", toolName="echo", role="r", success=True, duration=5, code=None)
    audit.close()
    forged = {"event": "call.finished", "toolName": "rm_rf", "role": "admin", "success": True, "duration": 1}
    log.write_bytes((json.dumps(forged) + "\n").encode() * 5 + log.read_bytes())


def test_in_a_chained_log_only_chained_lines_are_counted(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    _chained_with_forged_prefix(log)  # the reviewer's forgery
    report = report_file(log, "tool")
    assert set(report.groups) == {"echo"} and report.groups["echo"].calls == 3
    assert report.chained and report.unchained_skipped == 5
    done = _cli("--log", str(log), "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["chained"] is True and found["unchainedSkipped"] == 5
    assert [group["group"] for group in found["groups"]] == ["echo"]
    table = _cli("--log", str(log))
    assert "only chained lines counted, 5 unchained skipped" in table.stdout


def test_an_unchained_log_is_counted_whole(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    generate(log, 50)
    report = report_file(log, "tool")
    assert not report.chained and report.unchained_skipped == 0
    assert report.total.calls == 50


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    return subprocess.run(
        [sys.executable, "-m", "runner", "audit", "report", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_runner_audit_report_prints_json_and_a_table_with_hostile_names_escaped(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    generate(log, 300)
    with log.open("a") as file:
        file.write(
            json.dumps(
                {
                    "event": "policy.decision",
                    "decision": "deny",
                    "reason": "tool_not_found",
                    "toolName": "evil\x1b[2J\u202e",
                }
            )
            + "\n"
        )
    done = _cli("--log", str(log), "--json", "--by", "role")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["by"] == "role"
    assert {group["group"] for group in report["groups"]} == {"user", "admin", "-"}
    assert report["total"]["calls"] == 300
    assert set(report["total"]["durationMs"]) == {"p50", "p95"}

    table = _cli("--log", str(log))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:7] == ["TOOL", "CALLS", "OK", "DENIED", "ERRORS", "P50", "MS"]
    assert lines[-1].startswith("(all)")
    assert "\x1b" not in table.stdout and "\u202e" not in table.stdout
    assert "evil\\x1b[2J\\u202e" in table.stdout


def test_runner_audit_report_misuse_is_exit_2_without_a_traceback(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    generate(log, 5)
    for args in (
        ["--log", str(tmp_path / "absent")],
        ["--log", str(log), "--since", "yesterday"],
        ["--log", str(log), "--by", "colour"],
    ):
        done = _cli(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert "Traceback" not in done.stderr
