"""``runner audit report --html``: one page, nothing fetched, the numbers of ``--json``,
rendered for real by headless Chromium with no network, and looked at (its pixels)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import ToolBench

RUNNER = [sys.executable, "-m", "runner"]
CHROMIUM = shutil.which("chromium")
HOSTILE_NAME = 'x"><script>alert(1)</script><img src=http://example.invalid/p.png>'


def _log(bench: ToolBench) -> Path:
    """Real calls: successes, a denial, an unknown (hostile) tool name, a failing tool whose
    breaker opens, and calls refused while it is open."""
    bench.tool("adder", "import json, sys\nprint(json.load(sys.stdin)['params'].get('n', 0))\n")
    bench.tool("broken", "import sys\nsys.exit(3)\n")
    bench.tool("hidden", "print(1)\n")
    bench.policy["roles"] = {"user": {"allow": ["adder", "broken"]}}
    bench.policy["circuit_breaker"] = {"failure_threshold": 2, "reset_timeout_ms": 600000}
    runner = bench.runner()
    for n in range(4):
        assert runner.handle({"toolName": "adder", "params": {"n": n}})["success"]
    runner.handle({"toolName": "hidden"})
    runner.handle({"toolName": HOSTILE_NAME})
    for _ in range(4):
        runner.handle({"toolName": "broken", "options": {"retries": 0}})
    runner.close()
    return bench.audit_log


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _report(log: Path, tmp_path: Path) -> tuple[Path, dict[str, object]]:
    page = tmp_path / "report.html"
    done = subprocess.run(
        [*RUNNER, "audit", "report", "--log", str(log), "--html", str(page)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    wanted = subprocess.run(
        [*RUNNER, "audit", "report", "--log", str(log), "--json"], capture_output=True, text=True, timeout=60
    )
    return page, json.loads(wanted.stdout)


def test_the_page_is_self_contained_escaped_and_shows_the_numbers_of_the_json_report(
    bench: ToolBench, tmp_path: Path
) -> None:
    page, report = _report(_log(bench), tmp_path)
    text = page.read_text(encoding="utf-8")
    parsed = _Page()
    parsed.feed(text)
    tags = [tag for tag, _ in parsed.tags]
    assert "script" not in tags and "img" not in tags and "link" not in tags and "iframe" not in tags
    assert "<script>alert(1)" not in text and "&lt;script&gt;" in text  # the caller's words, escaped
    csp = [
        a["content"]
        for t, a in parsed.tags
        if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"
    ]
    assert csp == ["default-src 'none'; style-src 'unsafe-inline'"]
    assert not [a for _, a in parsed.tags if {"src", "href"} & a.keys()]  # nothing to load
    attrs = [a for t, a in parsed.tags if t == "rect"]
    total = report["total"]
    assert isinstance(total, dict)
    # Calls over time: the bars add up to the calls, per outcome.
    by_outcome: dict[str, int] = {}
    for a in attrs:
        if a.get("data-outcome"):
            by_outcome[str(a["data-outcome"])] = by_outcome.get(str(a["data-outcome"]), 0) + int(
                str(a["data-count"])
            )
    assert sum(by_outcome.values()) == total["calls"] == 10
    assert by_outcome["success"] == total["successes"] == 4
    assert by_outcome["denied"] == 2  # PERMISSION_DENIED and TOOL_NOT_FOUND

    # Denials, errors, breaker openings: one bar per key of the JSON report, its count.
    def bars(kind: str) -> dict[str, int]:
        return {str(a["data-label"]): int(str(a["data-count"])) for a in attrs if a.get("data-chart") == kind}

    assert bars("denials") == total["denials"]
    errors = total["errors"]
    assert isinstance(errors, dict)
    assert bars("errors") == {
        f"{code} {reason}": n for code, reasons in errors.items() for reason, n in reasons.items()
    }
    assert bars("breakers") == report["breakerOpenings"] == {"broken": 1}
    # Durations per tool: the same p50 and p95.
    for group in report["groups"]:  # type: ignore[attr-defined]
        shown = [a for a in attrs if a.get("data-tool") == group["group"]]
        assert float(str(shown[0]["data-p50"])) == pytest.approx(group["durationMs"]["p50"])
        assert float(str(shown[1]["data-p95"])) == pytest.approx(group["durationMs"]["p95"])


def _pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and rows of RGB(A) pixels of an 8-bit, non-interlaced PNG (what
    Chromium writes): enough to look at a screenshot without an imaging library."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    offset, data, header = 8, b"", b""
    while offset < len(png):
        (length,) = struct.unpack(">I", png[offset : offset + 4])
        kind, body = png[offset + 4 : offset + 8], png[offset + 8 : offset + 8 + length]
        header = body if kind == b"IHDR" else header
        data += body if kind == b"IDAT" else b""
        offset += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and colour in (2, 6)
    size = 4 if colour == 6 else 3
    raw, rows, previous = zlib.decompress(data), [], bytearray(width * size)
    stride = width * size + 1
    for y in range(height):
        kind, row = raw[y * stride], bytearray(raw[y * stride + 1 : (y + 1) * stride])
        for i in range(len(row)):
            left = row[i - size] if i >= size else 0
            up, corner = previous[i], previous[i - size] if i >= size else 0
            if kind == 1:
                row[i] = (row[i] + left) & 0xFF
            elif kind == 2:
                row[i] = (row[i] + up) & 0xFF
            elif kind == 3:
                row[i] = (row[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                row[i] = (row[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 0xFF
        rows.append(bytes(row))
        previous = row
    return width, height, [bytes(r[i : i + 3]) for r in rows for i in range(0, len(r), size)]


@pytest.mark.slow
def test_the_page_renders_in_headless_chromium_with_no_network(bench: ToolBench, tmp_path: Path) -> None:
    if CHROMIUM is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing: scripts/setup.sh installs it")
        pytest.skip("chromium is not installed (Debian package chromium)")
    page, _ = _report(_log(bench), tmp_path)
    shot = tmp_path / "shot.png"
    done = subprocess.run(
        [
            "unshare",
            "--net",  # a network namespace with nothing in it: the page can fetch nothing
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=900,1400",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.is_file(), done.stderr[-2000:]
    width, height, pixels = _pixels(shot.read_bytes())
    assert (width, height) == (900, 1400)
    seen = set(pixels)
    for colour in ("2e7d32", "ef6c00", "c62828", "1565c0", "6a1b9a"):  # each chart drew its bars
        assert bytes.fromhex(colour) in seen, colour
    assert sum(1 for p in pixels if p != b"\xff\xff\xff") > width * height // 50  # not a blank page


def test_a_request_with_half_a_surrogate_pair_leaves_strict_json_and_a_page(
    bench: ToolBench, tmp_path: Path
) -> None:
    # Echoed as it came, `\udcff` went into the answer and the audit trail (no Unicode:
    # strict parsers refuse it), and `runner audit report --html` then failed on it.
    runner = bench.runner()
    answer = runner.handle({"toolName": "ech\udcff", "requestId": "req_\ud800", "role": "r\udfff"})
    runner.close()
    assert answer["error"]["code"] == "INVALID_PARAMS"  # the request is no Unicode text
    json.dumps(answer, ensure_ascii=False).encode("utf-8")  # raises on a lone surrogate
    for line in bench.audit_log.read_text(encoding="utf-8").splitlines():
        json.dumps(json.loads(line), ensure_ascii=False).encode("utf-8")
    page, _ = _report(bench.audit_log, tmp_path)
    assert "ech\ufffd" in page.read_text(encoding="utf-8")
