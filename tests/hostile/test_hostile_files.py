"""Hostile files and logs: YAML alias bombs and oversized manifests or policies, and an
audit log whose values would drive the terminal that ``runner audit`` prints to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest
import yaml
from conftest import ToolBench

ECHO = "import json, sys\njson.dump(json.load(sys.stdin)['params'], sys.stdout)\n"


def runner_cli(bench: ToolBench, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    config = ["--tools", str(bench.tools), "--policies", str(bench.root / "policies.yaml")]
    return subprocess.run(
        [sys.executable, "-m", "runner", *config, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=bench.root,
        timeout=30,
        env={**os.environ, "RUNNER_AUDIT_LOG": str(bench.audit_log)},
    )


def alias_bomb(levels: int = 9, fan_out: int = 9) -> str:
    """A few hundred bytes of YAML describing fan_out ** levels schemas."""
    lines = ["    a0: &a0 {type: string}"]
    for level in range(1, levels + 1):
        refs = ",".join([f"*a{level - 1}"] * fan_out)
        lines.append(f"    a{level}: &a{level} {{allOf: [{refs}]}}")
    head = "name: bomb\ndescription: billion laughs\ncommand: [python3, main.py]\n"
    return head + "parameters:\n  type: object\n  $defs:\n" + "\n".join(lines) + "\n"


# -- manifests and policies (issue 8, item 7) -----------------------------------------


def test_a_yaml_alias_bomb_manifest_is_reported_and_left_out_in_milliseconds(bench: ToolBench) -> None:
    bench.tool("ok", ECHO)
    bench.write_policy()
    bomb = bench.tools / "bomb"
    bomb.mkdir()
    (bomb / "tool.yaml").write_text(alias_bomb())
    assert len(alias_bomb()) < 1024
    started = time.monotonic()
    done = runner_cli(bench, "validate")
    assert time.monotonic() - started < 5.0  # mostly the interpreter's start
    assert done.returncode == 1
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("invalid:")] == [
        f"{bomb / 'tool.yaml'}:"
    ]
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("ok:")] == ["ok"]
    started = time.monotonic()
    answer = json.loads(runner_cli(bench, "exec", "ok", "--params", '{"i": 1}').stdout)
    assert time.monotonic() - started < 5.0
    assert answer["result"] == {"i": 1}


def test_a_manifest_larger_than_256_kib_is_left_out(bench: ToolBench) -> None:
    bench.tool("ok", ECHO)
    bench.write_policy()
    folder = bench.tool("big", ECHO)
    padding = "".join(f"# {'x' * 76}\n" for _ in range(4000))  # 320 KB of comments
    (folder / "tool.yaml").write_text((folder / "tool.yaml").read_text() + padding)
    done = runner_cli(bench, "validate")
    assert done.returncode == 1
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("ok:")] == ["ok"]


@pytest.mark.parametrize("kind", ["alias", "bomb", "oversized"])
def test_a_policy_file_that_expands_or_is_oversized_stops_the_runner_quickly(
    bench: ToolBench, kind: str
) -> None:
    bench.tool("ok", ECHO)
    bench.runner()
    policy = bench.root / "policies.yaml"
    text = yaml.safe_dump(bench.policy)
    if kind == "alias":
        text = text.replace(
            "roles:\n  user:\n    allow:\n    - '*'", "roles:\n  user:\n    allow: &all\n    - '*'"
        )
        text += "disabled: *all\n"
    elif kind == "bomb":
        text += "x: " + alias_bomb().split("$defs:\n", 1)[1].replace("\n    ", "\n  ")
    else:
        text += "".join(f"# {'x' * 76}\n" for _ in range(4000))
    policy.write_text(text)
    started = time.monotonic()
    done = runner_cli(bench, "exec", "ok", "--params", "{}")
    assert time.monotonic() - started < 5.0
    assert done.returncode == 2
    assert done.stdout == ""
    assert str(policy) in done.stderr
    assert "Traceback" not in done.stderr


def test_a_key_given_twice_stops_the_runner_rather_than_drop_the_first(bench: ToolBench) -> None:
    # The loader kept the last: a later roles: dropped the deny of the first, and
    # runner validate said all was well.
    bench.tool("ok", ECHO)
    bench.tool("wipe", ECHO, tags=["destructive"])
    bench.runner()
    policy = bench.root / "policies.yaml"
    text = yaml.safe_dump(bench.policy)
    policy.write_text(text + "disabled: [wipe]\n" + "disabled: []\n")
    for command in (("exec", "wipe", "--params", "{}"), ("validate",)):
        done = runner_cli(bench, *command)
        assert done.returncode == 2, done.stdout
        assert "'disabled' is given twice" in done.stderr and "Traceback" not in done.stderr
    merged = text.replace("roles:", "<<: {disabled: [wipe]}\nroles:", 1) + "disabled: []\n"
    policy.write_text(merged)  # a merge key's keys lose to the mapping's own, as unseen
    done = runner_cli(bench, "exec", "wipe", "--params", "{}")
    assert done.returncode == 2 and "merge keys" in done.stderr, done.stdout
    policy.write_text(text)
    manifest = bench.tools / "ok" / "tool.yaml"
    manifest.write_text(manifest.read_text() + "name: wipe\n")  # the same goes for a manifest
    done = runner_cli(bench, "validate")
    assert "'name' is given twice" in done.stdout + done.stderr, done


def test_a_policy_file_that_is_a_fifo_stops_the_runner_without_blocking(
    bench: ToolBench, tmp_path: Path
) -> None:
    bench.tool("ok", ECHO)
    bench.runner()
    policy = bench.root / "policies.yaml"
    fifo = tmp_path / "policy.fifo"
    os.mkfifo(fifo)
    policy.unlink()
    policy.symlink_to(fifo)
    done = runner_cli(bench, "validate")
    assert done.returncode == 2
    assert str(policy) in done.stderr


# -- runner audit's table (issue 8, item 12) -----------------------------------------


UNPRINTABLE = {"Cc", "Cf", "Zl", "Zp", "Cs"}


def test_runner_audit_table_escapes_every_control_and_bidi_character(bench: ToolBench) -> None:
    bench.tool("ok", ECHO)
    bench.runner()
    hostile = (
        "r\x1b[2J\x1b[H\r\n2026-01-01T00:00:00Z policy.decision forged\u202egnp.exe\x9b31m\x7f\u2028\u2066"
    )
    runner_cli(bench, "exec", "-", stdin=json.dumps({"toolName": "ok", "requestId": hostile}))
    runner_cli(bench, "exec", "-", stdin=json.dumps({"toolName": hostile}))
    runner_cli(bench, "exec", "-", stdin=json.dumps({"toolName": "ok", "role": hostile}))
    events = bench.audit_log.read_text().splitlines()
    table = runner_cli(bench, "audit", "--log", str(bench.audit_log))
    assert table.returncode == 0
    lines = table.stdout.split("\n")
    assert lines[-1] == ""
    assert len(lines) - 1 == 1 + len(events)  # a header, then exactly one row per event
    bad = sorted(
        {f"U+{ord(c):04X}" for c in table.stdout.replace("\n", "") if unicodedata.category(c) in UNPRINTABLE}
    )
    assert bad == []
    assert "\\x1b" in table.stdout
