"""``runner serve tokens add``: a token printed once, its digest in the policy, the file's
comments kept, and a token that would break the policy never written."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import yaml

from runner.call.policy import Policy

POLICY = """\
# The team's policy: keep this comment.
version: 1
default_role: user   # calls that name no role
whitelist: ["*"]
roles:
  user:
    allow: [echo, "tag:read"]
  admin:
    inherits: [user]
"""


def add(policy: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "runner", "--policies", str(policy), "serve", "tokens", "add", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_a_new_token_is_printed_once_and_only_its_digest_is_stored_with_the_comments_kept(
    tmp_path: Path,
) -> None:
    policy = tmp_path / "policies.yaml"
    policy.write_text(POLICY)
    policy.chmod(0o640)
    first = add(policy, "ci-agent", "--role", "user")
    second = add(policy, "ops", "--role", "admin")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    token = first.stdout.strip()
    assert token.startswith("rnr_") and len(token) > 40
    text = policy.read_text()
    assert token not in text
    assert text.startswith(POLICY)  # every line of the file as it was, comments and quotes included
    tokens = Policy.load(policy).model.serve.tokens
    assert [(t.name, t.role) for t in tokens] == [("ci-agent", "user"), ("ops", "admin")]
    assert tokens[0].sha256 == hashlib.sha256(token.encode()).hexdigest()
    assert policy.stat().st_mode & 0o777 == 0o640


def test_a_token_with_an_unknown_role_or_a_taken_name_is_refused_and_the_file_left_alone(
    tmp_path: Path,
) -> None:
    policy = tmp_path / "policies.yaml"
    policy.write_text(POLICY)
    assert add(policy, "ci-agent", "--role", "user").returncode == 0
    before = policy.read_text()
    for args in (
        ["other", "--role", "nobody"],
        ["ci-agent", "--role", "user"],
        ["bad name", "--role", "user"],
    ):
        refused = add(policy, *args)
        assert refused.returncode == 2, args
        assert refused.stdout == ""  # no token printed for nothing
        assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
    assert policy.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policies.yaml"]  # no temporary left
    assert yaml.safe_load(before)["serve"]["tokens"][0]["name"] == "ci-agent"
