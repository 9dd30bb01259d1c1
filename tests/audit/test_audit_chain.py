"""The tamper-evident audit trail: a hash chain that several runner processes
extend, and ``runner audit verify`` naming the first line edited, removed, inserted or cut."""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ToolBench

from runner.audit import chain as audit_chain
from runner.audit import log as audit_module
from runner.audit.chain import GENESIS
from runner.audit.faults import OperatorLog
from runner.audit.log import AuditLog
from runner.audit.verify import ChainVerdict, verify
from runner.errors import CallError, ConfigError

OK = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"
CHECKOUT = Path(__file__).resolve().parents[2]


def chained_log(path: Path, count: int = 8) -> list[bytes]:
    """``count`` chained events written by the runner's own sink; the file's lines."""
    audit = AuditLog(path, chain=True)
    try:
        for index in range(count):
            audit.emit("call.finished", toolName="t", requestId=f"req_{index}", success=True, duration=index)
    finally:
        audit.close()
    assert audit.dropped == 0
    return path.read_bytes().splitlines(keepends=True)


def first_problem(verdict: ChainVerdict) -> tuple[int, str]:
    assert not verdict.intact
    problem = verdict.problems[0]
    return problem.line, problem.kind


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT), "RUNNER_AUDIT_LOG": os.devnull}
    return subprocess.run(
        [sys.executable, "-m", "runner", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=60
    )


# -- what a runner writes ------------------------------------------------------------------


def test_a_runner_with_chain_writes_lines_each_linked_to_the_one_before_and_rehashable_by_any_tool(
    bench: ToolBench,
) -> None:
    bench.tool("ok", OK)
    bench.policy["audit"] = {"chain": True}
    with bench.runner() as runner:
        assert runner.call("ok", {"a": "caf\u00e9 \u202e\n"}).success
        assert not runner.call("missing", {}).success
    lines = bench.audit_log.read_text(encoding="ascii").splitlines()
    events = [json.loads(line) for line in lines]
    assert [event["event"] for event in events][:3] == ["policy.decision", "call.attempt", "call.finished"]
    assert events[0]["prevHash"] == GENESIS
    for before, after in itertools.pairwise(events):
        assert after["prevHash"] == before["hash"]
    for line, event in zip(lines, events, strict=True):
        without = {key: value for key, value in event.items() if key != "hash"}
        # The documented recipe, with a JSON library: canonical JSON of the event without hash.
        text = json.dumps(without, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        assert hashlib.sha256(text.encode()).hexdigest() == event["hash"]
        # ... and without one: cut the last 75 characters, put the brace back.
        assert line[:-75] + "}" == text
    assert verify(bench.audit_log).intact


@pytest.mark.parametrize(
    "event",
    [
        {},
        {"a": 1},
        {"z": 1},
        {"Zeta": [1, {"b": None}], "prevHashes": 1, "pre": "\u00e9"},
        {"hash": "x", "prevHash": "y"},
    ],
)
def test_a_chained_line_is_the_canonical_json_of_the_event_with_prev_hash_and_its_hash_appended(
    event: dict[str, Any],
) -> None:
    line = audit_chain.chained_line(event, GENESIS)
    body = {key: value for key, value in event.items() if key != "hash"} | {"prevHash": GENESIS}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert line == f'{text[:-1]},"hash":"{hashlib.sha256(text.encode()).hexdigest()}"}}'


def test_without_chain_nothing_changes_no_chain_fields_and_no_lock(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    log.touch()
    with log.open("rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # a chained writer would wait for this
        audit = AuditLog(log)
        audit.emit("call.finished", toolName="t", success=True)
        audit.close()
    assert audit.dropped == 0
    event = json.loads(log.read_text())
    assert "hash" not in event and "prevHash" not in event


def test_a_lock_holder_that_never_lets_go_cannot_hang_the_runner_and_a_required_trail_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit_chain, "LOCK_WAIT_S", 0.3)
    log = tmp_path / "audit.log"
    audit = AuditLog(log, chain=True, required=True)
    with audit_chain.lock_path(log).open("rb") as holder:  # a stuck writer of the same user
        fcntl.flock(holder, fcntl.LOCK_EX)
        audit.emit("call.finished", toolName="t")  # not a gate event: counted, not raised
        with pytest.raises(CallError) as refused:
            audit.emit("policy.decision", toolName="t", decision="allow")
    audit.close()
    assert refused.value.code.value == "EXECUTION_ERROR"
    assert refused.value.reason == "audit_unavailable"
    assert audit.dropped == 2
    assert log.read_bytes() == b""


def test_a_chained_log_at_a_symlink_is_refused_and_its_target_left_alone(bench: ToolBench) -> None:
    target = bench.root / "elsewhere.log"
    target.write_text("precious\n")
    bench.audit_log.symlink_to(target)
    bench.policy["audit"] = {"chain": True}
    with pytest.raises(ConfigError) as refused:
        bench.runner()
    assert "symbolic link" in str(refused.value)
    assert target.read_text() == "precious\n"


def test_a_fifo_at_a_chained_logs_path_is_refused_without_blocking(bench: ToolBench) -> None:
    os.mkfifo(bench.audit_log)
    bench.policy["audit"] = {"chain": True}
    with pytest.raises(ConfigError) as refused:
        bench.runner()
    assert "not a regular file" in str(refused.value)


def test_a_chain_needs_a_file(bench: ToolBench) -> None:
    bench.policy["audit"] = {"chain": True}
    bench.runner().close()  # the bench gives --audit-log
    policy = bench.root / "policies.yaml"
    from runner import Runner

    with pytest.raises(ConfigError) as refused:
        Runner.load(tools=bench.tools, policies=policy)
    assert "audit.chain" in str(refused.value)


def test_after_a_torn_last_line_the_next_event_starts_a_line_of_its_own(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log, 3)
    with log.open("ab") as file:
        file.write(b'{"event":"call.fin')  # a writer died half way (a full disk)
    chained_log(log, 2)
    now = log.read_bytes().splitlines(keepends=True)
    assert now[:3] == lines and now[3] == b'{"event":"call.fin\n'
    assert [json.loads(line)["prevHash"] for line in now[4:5]] == [GENESIS]
    verdict = verify(log)
    assert [(problem.line, problem.kind) for problem in verdict.problems] == [(4, "broken")]


# -- verify names what was done ------------------------------------------------------------


def test_an_intact_log_verifies_with_its_head(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log)
    verdict = verify(log)
    assert verdict.intact and verdict.lines == verdict.chained == len(lines)
    assert verdict.head == json.loads(lines[-1])["hash"]


@pytest.mark.parametrize("line", [1, 4, 8])
def test_an_edited_byte_is_named_changed_at_its_line(tmp_path: Path, line: int) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log)
    edited = lines[line - 1].replace(b'"toolName":"t"', b'"toolName":"u"')
    assert edited != lines[line - 1]
    log.write_bytes(b"".join([*lines[: line - 1], edited, *lines[line:]]))
    verdict = verify(log)
    assert first_problem(verdict) == (line, "changed")
    assert verdict.problem_count == 1


def test_a_byte_json_would_not_see_is_still_a_change(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log)
    lines[2] = lines[2].replace(b'"event":', b'"event": ')  # same JSON, other bytes
    log.write_bytes(b"".join(lines))
    assert first_problem(verify(log)) == (3, "changed")


@pytest.mark.parametrize("line", [1, 4])
def test_a_deleted_line_is_named_at_the_line_that_now_stands_in_its_place(tmp_path: Path, line: int) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log)
    log.write_bytes(b"".join(lines[: line - 1] + lines[line:]))
    verdict = verify(log)
    assert first_problem(verdict) == (line, "removed")
    assert verdict.problem_count == 1


def _forged(prev_hash: str) -> bytes:
    event = {"event": "policy.decision", "toolName": "t", "decision": "allow", "requestId": "req_forged"}
    return audit_chain.chained_line(event, prev_hash).encode() + b"\n"


@pytest.mark.parametrize("linked", [True, False], ids=["linked_to_the_line_before", "linked_to_nothing"])
def test_an_inserted_line_with_a_valid_hash_of_its_own_is_named_inserted(
    tmp_path: Path, linked: bool
) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log)
    prev = json.loads(lines[2])["hash"] if linked else "ab" * 32
    forged = _forged(prev)
    assert audit_chain.split_line(forged[:-1]) is not None  # its own hash is right
    log.write_bytes(b"".join([*lines[:3], forged, *lines[3:]]))
    verdict = verify(log)
    assert first_problem(verdict) == (4, "inserted")
    assert verdict.problem_count == 1


def test_a_line_rewritten_with_a_recomputed_hash_breaks_the_next_link(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log)
    event = json.loads(lines[4])
    event["success"] = False
    lines[4] = audit_chain.chained_line(event, event["prevHash"]).encode() + b"\n"
    log.write_bytes(b"".join(lines))
    assert first_problem(verify(log)) == (6, "removed")


@pytest.mark.parametrize("cut", [1, 30], ids=["the_newline", "mid_line"])
def test_a_truncated_tail_is_named_truncated(tmp_path: Path, cut: int) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log)
    with log.open("r+b") as file:
        file.truncate(log.stat().st_size - cut)
    assert first_problem(verify(log)) == (len(lines), "truncated")


def test_a_last_line_cut_and_closed_with_a_newline_is_still_truncated(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log)
    log.write_bytes(b"".join(lines[:-1]) + lines[-1][:40] + b"\n")
    assert first_problem(verify(log)) == (len(lines), "truncated")


def test_an_unchained_line_after_chained_ones_is_named(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log)
    plain = json.dumps({"event": "call.finished", "toolName": "t", "success": True}).encode() + b"\n"
    log.write_bytes(b"".join([*lines[:5], plain, *lines[5:]]))
    verdict = verify(log)
    assert first_problem(verdict) == (6, "unchained")
    assert verdict.problem_count == 1


def test_a_log_that_was_never_chained_does_not_pass_as_intact(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    audit = AuditLog(log)
    audit.emit("call.finished", toolName="t")
    audit.close()
    assert first_problem(verify(log)) == (1, "unchained")


def test_an_endless_line_is_read_in_bounded_pieces_and_named(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log)
    with log.open("ab") as file:
        file.write(b"x" * (3 << 20) + b"\n")
        file.write(lines[0])
    verdict = verify(log)
    # After a line without a hash the next links to genesis, as lines[0] does: one problem.
    assert [(p.line, p.kind) for p in verdict.problems] == [(9, "broken")]
    assert verdict.lines == 10


def _plain(tool: str) -> bytes:
    event = {"event": "call.finished", "toolName": tool, "role": "admin", "success": True, "duration": 1}
    return json.dumps({**event, "timestamp": "2030-01-01T00:00:00Z"}).encode() + b"\n"


def test_forged_unchained_lines_before_the_first_chained_one_are_named(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log, 3)
    log.write_bytes(_plain("rm_rf") * 5 + b"".join(lines))  # the reviewer's forgery
    verdict = verify(log)
    assert [(problem.line, problem.kind) for problem in verdict.problems] == [
        (line, "unchained") for line in range(1, 6)
    ]
    assert verdict.problem_count == 5
    assert "--allow-unchained-prefix" in verdict.problems[0].detail
    # A log chained later: allowed only when asked, and the skipped lines counted.
    allowed = verify(log, allow_unchained_prefix=True)
    assert allowed.intact and allowed.unchained_prefix == 5 and allowed.chained == 3


def test_a_broken_line_in_an_unchained_prefix_keeps_the_problems_in_line_order(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log, 2)
    log.write_bytes(_plain("a") + b"not json\n" + _plain("b") + b"".join(lines))
    verdict = verify(log)
    assert [(p.line, p.kind) for p in verdict.problems] == [(1, "unchained"), (2, "broken"), (3, "unchained")]
    allowed = verify(log, allow_unchained_prefix=True)
    assert [(p.line, p.kind) for p in allowed.problems] == [(2, "broken")]


def test_lines_removed_after_a_torn_looking_fragment_are_named(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log, 10)
    # lines 3 to 8 removed, and what looks like a torn write from a crash left in their place
    log.write_bytes(b"".join(lines[:2]) + lines[2][:40] + b"\n" + b"".join(lines[8:]))
    verdict = verify(log)
    assert [(p.line, p.kind) for p in verdict.problems] == [(3, "broken"), (4, "removed")]


def test_lines_removed_after_an_edited_line_are_named(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log, 10)
    edited = lines[2].replace(b'"requestId":"req_2"', b'"requestId":"req_X"')
    assert edited != lines[2]
    log.write_bytes(b"".join(lines[:2]) + edited + b"".join(lines[8:]))  # line 3 edited, 4-8 removed
    verdict = verify(log)
    assert [(p.line, p.kind) for p in verdict.problems] == [(3, "changed"), (4, "removed")]


def test_lines_removed_before_an_edited_line_are_named(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log, 10)
    edited = lines[8].replace(b'"requestId":"req_8"', b'"requestId":"req_X"')
    log.write_bytes(b"".join(lines[:3]) + edited + lines[9])  # 4-8 removed, then line 9 edited
    verdict = verify(log)
    assert [(p.line, p.kind) for p in verdict.problems] == [(4, "changed"), (4, "removed")]


def test_lines_removed_after_an_overlong_line_are_named(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log, 10)
    log.write_bytes(b"".join(lines[:2]) + b"x" * (3 << 20) + b"\n" + b"".join(lines[8:]))
    verdict = verify(log)
    assert [(p.line, p.kind) for p in verdict.problems] == [(3, "broken"), (4, "removed")]


def test_a_deeply_nested_line_is_broken_not_a_crash(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log, 3)
    log.write_bytes(b"".join(lines) + b"[" * 200_000 + b"\n" + b"".join(lines))
    verdict = verify(log)
    assert [(p.line, p.kind) for p in verdict.problems] == [(4, "broken")]
    done = run_cli("audit", "verify", "--log", str(log), "--json", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert json.loads(done.stdout)["problems"][0] == {
        "line": 4,
        "kind": "broken",
        "detail": "not a JSON object",
    }


# -- the command ---------------------------------------------------------------------------


def test_runner_audit_verify_refuses_a_forged_prefix_unless_allowed_and_says_how_many_it_skipped(
    tmp_path: Path,
) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log, 3)
    log.write_bytes(_plain("rm_rf") * 5 + b"".join(lines))
    forged = run_cli("audit", "verify", "--log", str(log), "--json", cwd=tmp_path)
    assert forged.returncode == 1, forged.stderr
    assert json.loads(forged.stdout)["problemCount"] == 5
    allowed = run_cli(
        "audit", "verify", "--log", str(log), "--allow-unchained-prefix", "--json", cwd=tmp_path
    )
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["unchainedPrefix"] == 5
    text = run_cli("audit", "verify", "--log", str(log), "--allow-unchained-prefix", cwd=tmp_path)
    assert text.returncode == 0
    assert "(5 unchained before the first chained one, allowed)" in text.stdout


def test_runner_audit_verify_says_an_empty_log_is_empty(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    log.touch()
    text = run_cli("audit", "verify", "--log", str(log), cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"empty: {log}: 0 lines")
    assert "head recorded elsewhere" in text.stdout
    as_json = run_cli("audit", "verify", "--log", str(log), "--json", cwd=tmp_path)
    assert json.loads(as_json.stdout)["lines"] == 0


def test_runner_audit_verify_exits_0_when_intact_and_1_naming_the_line_when_not(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    lines = chained_log(log)
    intact = run_cli("audit", "verify", "--log", str(log), "--json", cwd=tmp_path)
    assert intact.returncode == 0, intact.stderr
    assert json.loads(intact.stdout)["intact"] is True

    log.write_bytes(b"".join(lines[:2] + lines[3:]))
    broken = run_cli("audit", "verify", "--log", str(log), "--json", cwd=tmp_path)
    assert broken.returncode == 1, broken.stderr
    verdict = json.loads(broken.stdout)
    assert verdict["intact"] is False
    assert verdict["problems"][0]["line"] == 3 and verdict["problems"][0]["kind"] == "removed"
    text = run_cli("audit", "verify", "--log", str(log), cwd=tmp_path)
    assert text.returncode == 1
    assert text.stdout.startswith(f"NOT intact: {log}: line 3: removed:")


def test_runner_audit_verify_misuse_is_exit_2_without_a_traceback(tmp_path: Path) -> None:
    for args in (["--log", str(tmp_path / "absent.log")], ["--log", str(tmp_path)], ["--bogus"]):
        done = run_cli("audit", "verify", *args, cwd=tmp_path)
        assert done.returncode == 2, (args, done.stderr)
        assert "Traceback" not in done.stderr


# -- the lock ------------------------------------------------------------------------------


def test_a_reader_holding_a_lock_on_the_log_neither_delays_nor_drops_events(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    audit = AuditLog(log, chain=True, required=True)
    audit.emit("call.finished", toolName="t")
    log.chmod(0o644)  # made readable, e.g. for a log shipper
    fd = os.open(log, os.O_RDONLY)  # a reader's descriptor is enough for flock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        started = time.monotonic()
        for _ in range(3):
            audit.emit("policy.decision", toolName="t", decision="allow")
        took = time.monotonic() - started
    finally:
        os.close(fd)
        audit.close()
    assert audit.dropped == 0
    assert took < audit_chain.LOCK_WAIT_S / 2, took  # not waiting for the reader's lock
    assert verify(log).chained == 4


def _planted_symlink(lock: Path) -> None:
    (lock.parent / "elsewhere").write_text("precious\n")
    lock.symlink_to(lock.parent / "elsewhere")


def _planted_other_owner(lock: Path) -> None:
    lock.touch(mode=0o600)
    os.chown(lock, 65534, 65534)


def _planted_readable(lock: Path) -> None:
    lock.touch()
    lock.chmod(0o644)


@pytest.mark.parametrize(
    ("plant", "said"),
    [
        (_planted_symlink, "symbolic link"),
        (_planted_other_owner, "belongs to uid 65534"),
        (_planted_readable, "open to group or others (mode 0644)"),
    ],
    ids=["symlink", "other_owner", "mode_0644"],
)
def test_a_planted_lock_file_is_refused_at_load(bench: ToolBench, plant: Any, said: str) -> None:
    if plant is _planted_other_owner and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    plant(audit_chain.lock_path(bench.audit_log))
    bench.policy["audit"] = {"chain": True}
    with pytest.raises(ConfigError) as refused:
        bench.runner()
    assert said in str(refused.value)
    assert ".audit.log.lock" in str(refused.value)


def test_the_lock_file_is_created_private_beside_the_log(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    chained_log(log, 1)
    info = (tmp_path / ".audit.log.lock").stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()


def test_every_dropped_event_is_warned_about_at_most_once_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit_chain, "LOCK_WAIT_S", 0.05)
    log = tmp_path / "audit.log"
    operator = OperatorLog.open(tmp_path / "operator.log")
    audit = AuditLog(log, chain=True, operator=operator)
    with audit_chain.lock_path(log).open("rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        for _ in range(3):  # well within a second: one warning
            audit.emit("call.finished", toolName="t")
        monkeypatch.setattr(audit_module, "DROP_WARNING_INTERVAL_S", 0.0)
        audit.emit("call.finished", toolName="t")  # the next warning, with the count since
    audit.close()
    warnings = (tmp_path / "operator.log").read_text().splitlines()
    assert audit.dropped == 4
    assert len(warnings) == 2, warnings
    assert "1 event(s) not written so far" in warnings[0]
    assert "(and 2 more since the last warning)" in warnings[1]
    assert "4 event(s) not written so far" in warnings[1]


# -- several writers -----------------------------------------------------------------------

EMITTER = """
import sys
from pathlib import Path
from runner.audit.log import AuditLog
audit = AuditLog(Path(sys.argv[1]), chain=True)
sys.stdin.read()  # start together
for index in range(int(sys.argv[2])):
    audit.emit("call.attempt", toolName="t", writer=sys.argv[3], index=index)
audit.close()
sys.exit(1 if audit.dropped else 0)
"""

CALLER = """
import sys
from runner import Runner
runner = Runner.load(tools=sys.argv[1], policies=sys.argv[2], audit_log=sys.argv[3])
sys.stdin.read()
for i in range(int(sys.argv[4])):
    runner.handle({"toolName": "ok", "params": {"i": i}})
    for _ in range(10):
        runner.handle({"toolName": "missing"})
runner.close()
sys.exit(1 if runner.audit.dropped else 0)
"""


def _start_together(argvs: list[list[str]], cwd: Path) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, text=True, cwd=cwd, env=env) for argv in argvs]
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
    yield from procs


def test_writers_in_four_processes_interleave_and_leave_a_chain_that_verifies(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    per_writer = 4000  # long enough to overlap on a loaded machine too (1500 did not, once)
    argvs = [[sys.executable, "-c", EMITTER, str(log), str(per_writer), f"w{n}"] for n in range(4)]
    assert all(proc.wait(timeout=120) == 0 for proc in list(_start_together(argvs, tmp_path)))
    events = [json.loads(line) for line in log.read_bytes().splitlines()]
    assert len(events) == 4 * per_writer
    writers = [event["writer"] for event in events]
    switches = sum(a != b for a, b in itertools.pairwise(writers))
    assert switches > 10, "the writers did not overlap: the test proves nothing"
    for name in ("w0", "w1", "w2", "w3"):  # each writer's own events stay in its order
        assert [e["index"] for e in events if e["writer"] == name] == list(range(per_writer))
    verdict = verify(log)
    assert verdict.intact, verdict.problems[:3]
    assert verdict.chained == 4 * per_writer


def test_two_runner_processes_calling_at_once_leave_a_chain_that_verifies(bench: ToolBench) -> None:
    bench.tool("ok", OK)
    bench.policy["audit"] = {"chain": True}
    bench.runner().close()
    calls = 8
    argv = [sys.executable, "-c", CALLER, str(bench.tools), str(bench.root / "policies.yaml")]
    argvs = [[*argv, str(bench.audit_log), str(calls)] for _ in range(2)]
    assert all(proc.wait(timeout=120) == 0 for proc in list(_start_together(argvs, bench.root)))
    events = [json.loads(line) for line in bench.audit_log.read_bytes().splitlines()]
    # per ok call: decision, attempt, finished; per missing call: decision, finished
    assert len(events) == 2 * calls * (3 + 10 * 2)
    requests: dict[str, Any] = {}
    for event in events:
        requests.setdefault(event["requestId"], []).append(event["event"])
    assert len(requests) == 2 * calls * 11
    verdict = verify(bench.audit_log)
    assert verdict.intact, verdict.problems[:3]
    done = subprocess.run(
        [sys.executable, "-m", "runner", "audit", "verify", "--log", str(bench.audit_log)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(CHECKOUT)},
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("intact:")
