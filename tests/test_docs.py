"""The manual stands alone: its links resolve inside the repository, and it names tests
that exist.

These read the checkout's own README.md and docs/: beside tests/, or, for the copy of
tests/ that scripts/test.sh runs outside the repository, where RUNNER_CHECKOUT says.
Without either they are skipped.
"""

from __future__ import annotations

import re
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
    """A guarantee cited with its test must keep a test: a renamed test breaks the claim."""
    sources = "\n".join(path.read_text(encoding="utf-8") for path in (CHECKOUT / "tests").rglob("test_*.py"))
    defined = set(re.findall(r"^(?:async )?def (test_[a-z0-9_]+)", sources, re.MULTILINE))
    files = {path.stem for path in (CHECKOUT / "tests").rglob("test_*.py")}
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
