"""What a network costs a call: the median and p90 of one call per network mode.

    python3 bench/network.py [--calls 20] [--backends subprocess,docker]

Modes, for the subprocess and the docker backend: ``none`` (no network), ``own``
(``network: true``: a namespace of its own with slirp4netns; docker: its bridge) and
``allow`` (loopback only plus the call's egress proxy). Calls run one at a time through
one ``Runner``; the tool reads its input and prints ``{}``. Run by a user who is not
root (``--backends subprocess``), it measures the rootless network path.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runner import Runner  # noqa: E402

MODES: dict[str, Any] = {"none": False, "own": True, "allow": {"allow": ["127.0.0.1:9"]}}


def write_tools(root: Path) -> Path:
    tools = root / "tools"
    policy: dict[str, Any] = {
        "version": 1, "default_role": "user", "whitelist": ["*"], "roles": {"user": {"allow": ["*"]}},
        "limits": {"network": True}, "defaults": {"retries": 0}, "tools": {},
    }  # fmt: skip
    for backend in ("subprocess", "docker"):
        for mode, network in MODES.items():
            name = f"{backend}-{mode}"
            folder = tools / name
            folder.mkdir(parents=True)
            folder.chmod(0o755)
            (folder / "main.py").write_text("import sys; sys.stdin.read(); print('{}')\n")
            manifest = {"name": name, "description": name, "command": ["python3", "main.py"],
                        "parameters": {"type": "object"}, "network": copy.deepcopy(network)}  # fmt: skip
            if backend == "docker":
                manifest |= {"sandbox": "docker", "image": "runner/base:latest"}
            (folder / "tool.yaml").write_text(yaml.safe_dump(manifest))
            if mode == "allow":
                policy["tools"][name] = {"network": copy.deepcopy(network)}
    (root / "policies.yaml").write_text(yaml.safe_dump(policy))
    return tools


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--backends", default="subprocess,docker")
    args = parser.parse_args()
    backends = tuple(f"{backend}-" for backend in args.backends.split(","))
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        root.chmod(0o755)
        tools = write_tools(root)
        with Runner.load(tools=tools, policies=root / "policies.yaml", audit_log="/dev/null") as runner:
            for name in sorted(p.name for p in tools.iterdir() if p.name.startswith(backends)):
                runner.handle({"toolName": name})  # warm-up: images, caches
                times = []
                for _ in range(args.calls):
                    started = time.monotonic()
                    answer = runner.handle({"toolName": name})
                    times.append((time.monotonic() - started) * 1000)
                    if not answer["success"]:
                        raise SystemExit(f"{name}: {answer['error']}")
                p90 = sorted(times)[max(0, int(len(times) * 0.9) - 1)]
                print(f"{name:18s} median {statistics.median(times):6.1f} ms   p90 {p90:6.1f} ms")


if __name__ == "__main__":
    main()
