"""The manual stands alone: its links resolve inside the repository, and it names tests
that exist.

These read the checkout's own README.md and docs/: beside tests/, or, for the copy of
tests/ that scripts/test.sh runs outside the repository, where RUNNER_CHECKOUT says.
Without either they are skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
from conftest import checkout

CHECKOUT = checkout() or Path(__file__).resolve().parent.parent
README = CHECKOUT / "README.md"

pytestmark = pytest.mark.skipif(
    checkout() is None,
    reason="no checkout: README.md and docs/ are neither beside tests/ nor in RUNNER_CHECKOUT",
)

# [text](target) and [text]: target; images too. The target ends at whitespace or ")".
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:
TEST_NAME = re.compile(r"`(test_[a-z0-9_]+)")
TEST_FILE = re.compile(r"\b(test_[a-z0-9_]+)\.py\b")


def manual_pages() -> list[Path]:
    return [README, *sorted((CHECKOUT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without code blocks and code spans: a link inside code is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    text = prose(text)
    return [*INLINE_LINK.findall(text), *REFERENCE_LINK.findall(text)]


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for line in FENCE.sub("", text).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", manual_pages(), ids=lambda page: page.name)
def test_every_relative_link_resolves_to_a_file_in_the_repository(page: Path) -> None:
    broken = []
    for target in links(page.read_text(encoding="utf-8")):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not resolved.is_relative_to(CHECKOUT) or not resolved.exists():
            broken.append(f"{target}: no such file in the repository")
        elif (
            anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text("utf-8"))
        ):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    assert broken == []


@pytest.mark.parametrize("page", manual_pages(), ids=lambda page: page.name)
def test_the_manual_never_points_outside_the_repository(page: Path) -> None:
    assert "../shared" not in page.read_text(encoding="utf-8")


def test_every_test_the_manual_names_exists() -> None:
    """A guarantee cited with its test must keep a test: a renamed test breaks the claim.
    The suite's tests, and the benchmarks' own (``bench/``, run by hand)."""
    test_files = [*(CHECKOUT / "tests").rglob("test_*.py"), *(CHECKOUT / "bench").glob("test_*.py")]
    sources = "\n".join(path.read_text(encoding="utf-8") for path in test_files)
    defined = set(re.findall(r"^(?:async )?def (test_[a-z0-9_]+)", sources, re.MULTILINE))
    files = {path.stem for path in test_files}
    missing = set()
    for page in manual_pages():
        text = page.read_text(encoding="utf-8")
        named_files = set(TEST_FILE.findall(text))
        missing |= named_files - files
        missing |= {name for name in TEST_NAME.findall(text) if name not in defined and name not in files}
    assert sorted(missing) == []


def test_the_two_set_up_commands_open_the_readme() -> None:
    text = README.read_text(encoding="utf-8")
    first_section = text.split("\n## ", 2)[1]
    assert first_section.startswith("The two commands")
    assert 'bash scripts/setup.sh && runner exec add_numbers --params \'{"a": 1, "b": 2}\'' in first_section
    assert "bash scripts/setup.sh && bash scripts/test.sh" in first_section


FIRST_HOUR = re.compile(r"^## Your first hour\n(.*?)^## ", re.MULTILINE | re.DOTALL)
BLOCK = re.compile(r"^```(sh|python)\n(.*?)^```", re.MULTILINE | re.DOTALL)


@pytest.mark.slow
def test_the_first_hour_runs_as_the_readme_says(tmp_path: Path) -> None:
    """Each line of the walk-through runs in an empty folder, in order; the text after
    ``# =>`` must be in what it printed, and nothing prints a traceback."""
    section = FIRST_HOUR.search(README.read_text(encoding="utf-8"))
    assert section is not None
    # `runner` is the package under test (the suite may run from a checkout, where another
    # `runner` could be on PATH); an MCP client gives its server a bare environment.
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "runner").write_text(
        f'#!/bin/sh\nPYTHONPATH="{os.environ["PYTHONPATH"]}" exec "{sys.executable}" -m runner "$@"\n'
    )
    (shims / "runner").chmod(0o755)
    folder = tmp_path / "first-hour"
    folder.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("RUNNER_")},
        "PATH": f"{shims}:{os.environ['PATH']}",
    }
    ran = 0
    for kind, body in BLOCK.findall(section.group(1)):
        if kind == "python":
            done = subprocess.run(
                [sys.executable, "-c", body], cwd=folder, env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stderr
            assert "add_numbers" in done.stdout and done.stdout.strip().endswith("3"), done.stdout
            ran += 1
            continue
        for line in body.splitlines():
            command, _, expected = line.partition("# =>")
            done = subprocess.run(
                ["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=120
            )
            said = done.stdout + done.stderr
            assert "Traceback" not in said, (line, said)
            assert expected.strip() in said, (line, said)
            ran += 1
    assert ran >= 12
    assert (folder / "report.html").is_file()


def test_nothing_a_user_reads_points_at_a_document_they_do_not_have() -> None:
    """The README and docs/ are the contract: no "SPEC" section numbers in the manual, the
    code's texts (help, errors, docstrings), the scaffolds or the shipped tools."""
    roots = [README, CHECKOUT / "docs", CHECKOUT / "runner", CHECKOUT / "sandboxes", CHECKOUT / "tools"]
    found = []
    for root in roots:
        for path in [root] if root.is_file() else sorted(root.rglob("*")):
            if path.is_file() and path.suffix in (".md", ".py", ".yaml", ".sh", ".txt"):
                for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                    if re.search(r"\bSPEC\b|\.\./shared", line):
                        found.append(f"{path.relative_to(CHECKOUT)}:{number}: {line.strip()}")
    assert found == []


EXAMPLES = sorted((CHECKOUT / "docs" / "examples").glob("*.py"))
PRINTS = re.compile(r"^\s*print\(.*\)\s*# => (.+)$", re.MULTILINE)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_each_example_of_the_manual_runs_offline_and_prints_what_it_says(
    example: Path, tmp_path: Path
) -> None:
    """The provider SDK loops run against a recorded model, in a folder made by runner init."""
    from runner.config.starter import write_starter

    write_starter(tmp_path)
    expected = PRINTS.findall(example.read_text(encoding="utf-8"))
    assert expected, f"{example.name} says nowhere what it prints (# => ...)"
    env = {key: value for key, value in os.environ.items() if not key.startswith("RUNNER_")}
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == expected
