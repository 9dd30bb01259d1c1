"""``runner exec`` and a tool's events: progress and log lines on a terminal's stderr as
they come, nothing extra when piped, and ``--save-content DIR`` writing the blocks."""

from __future__ import annotations

import base64
import json
import os
import pty
import subprocess
from pathlib import Path

from conftest import ToolBench, runner_argv

EVENTFUL = """
import runner_tool as rt

def main(params, context):
    rt.progress(1, 2, "half way")
    rt.log("warning", "careful\\x1b[2J")
    rt.text("hello")
    rt.image(b"PNGBYTES", "image/png")
    rt.resource("file:///a.csv", text="a,b", mime_type="text/csv")
    return {"ok": True}

rt.run(main)
"""


def test_save_content_writes_each_block_and_piped_stderr_shows_no_events(
    bench: ToolBench, tmp_path: Path
) -> None:
    bench.tool("eventful", EVENTFUL)
    bench.write_policy()
    folder = tmp_path / "blocks"
    done = subprocess.run(
        runner_argv(bench, "exec", "eventful", "--save-content", str(folder)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["content"][0] == {"type": "text", "text": "hello"}
    assert "half way" not in done.stderr and "careful" not in done.stderr
    assert sorted(path.name for path in folder.iterdir()) == [
        "01-text.txt",
        "02-image.png",
        "03-resource.txt",
    ]
    assert (folder / "02-image.png").read_bytes() == b"PNGBYTES"
    assert (folder / "03-resource.txt").read_text() == "a,b"


def test_on_a_terminal_progress_and_log_lines_go_to_stderr_without_control_characters(
    bench: ToolBench,
) -> None:
    bench.tool("eventful", EVENTFUL)
    bench.runner()
    leader, follower = pty.openpty()
    try:
        done = subprocess.run(
            runner_argv(bench, "exec", "eventful"), stdout=subprocess.PIPE, stderr=follower, timeout=120
        )
        os.close(follower)
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other end is closed: all was read
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
    assert done.returncode == 0
    text = shown.decode()
    assert "eventful: [" + "#" * 12 + "." * 12 + "] 1/2 half way" in text  # the bar, redrawn in place
    assert "eventful [warning] careful?[2J" in text  # the escape sequence cannot reach the terminal
    assert base64.b64encode(b"PNGBYTES").decode() not in text
