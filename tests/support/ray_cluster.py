"""The host side of tests/support/ray_agent.py: a Ray cluster in a namespace of its own, and its processes.

The cluster's processes share this machine's PID namespace, so the tests see them in
/proc: a raylet by its ``--node_id``, a sandbox's node by the raylet among its ancestors.
Everything in the agent's network namespace is the tests' own, and is killed on close
(never ``ray stop``, which would stop every Ray process of the machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

AGENT = Path(__file__).resolve().parent / "ray_agent.py"
HOST_NETNS = os.readlink("/proc/self/ns/net")


class RayCluster:
    """A cluster (``locked``: token auth, a head without slots and two nodes with two each;
    ``open``: one node, no authentication) and a runner client beside it."""

    def __init__(
        self, workdir: Path, mode: str, python: str = sys.executable, stderr: Path | None = None
    ) -> None:
        """The agent, the cluster's nodes and the runner client run on ``python``; the
        agent's standard error (the runner's too) goes to ``stderr`` when given."""
        self.workdir = workdir
        self.netns: str | None = None
        with open(stderr or os.devnull, "ab") as err:
            self._proc = subprocess.Popen(
                ["unshare", "--net", python, str(AGENT), str(workdir), mode],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err if stderr is not None else None,
                text=True,
            )
        try:
            self.netns = os.readlink(f"/proc/{self._proc.pid}/ns/net")
            self.ask("start", timeout=180)
            self.netns = os.readlink(f"/proc/{self._proc.pid}/ns/net")
            assert self.netns != HOST_NETNS
        except BaseException:
            self.close()
            raise

    @property
    def token_file(self) -> Path:
        return self.workdir / "token"

    def ask(self, op: str, timeout: float = 120, **arguments: Any) -> dict[str, Any]:
        """Send one command; its answer (a failed command fails the test)."""
        reply = self._exchange({"op": op, **arguments}, timeout)
        assert reply["ok"], reply
        return reply

    def _exchange(self, command: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        assert ready, f"the Ray agent did not answer {command['op']} within {timeout} s"
        line = self._proc.stdout.readline()
        assert line, "the Ray agent exited"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def policy(self, path: Path, **dispatch: Any) -> dict[str, Any]:
        from conftest import BASE_POLICY

        document: dict[str, Any] = yaml.safe_load(yaml.safe_dump(BASE_POLICY))
        document["dispatch"] = {
            "engine": "ray",
            "address": "127.0.0.1:6379",
            "token_file": str(self.token_file),
            "node_cache": str(self.workdir / "node-cache"),
            **dispatch,
        }
        path.write_text(yaml.safe_dump(document))
        return document

    def raylets(self) -> dict[str, int]:
        """The alive raylets of this cluster: node id -> pid."""
        found = {}
        for pid in self.pids():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if Path(argv[0].decode()).name == "raylet":
                for arg in argv:
                    if arg.startswith(b"--node_id="):
                        found[arg.split(b"=", 1)[1].decode()] = pid
        return found

    def node_of(self, pid: int) -> str | None:
        """The node whose raylet is an ancestor of ``pid``."""
        by_pid = {p: n for n, p in self.raylets().items()}
        while pid > 1:
            if pid in by_pid:
                return by_pid[pid]
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return None
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        return None

    def pids(self) -> list[int]:
        """Every process in the cluster's network namespace."""
        if self.netns is None or self.netns == HOST_NETNS:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.readlink(f"/proc/{entry}/ns/net") == self.netns:
                        found.append(int(entry))
                except OSError:
                    continue
        return found

    def close(self) -> None:
        """Stop the agent (it kills its namespace's processes), then sweep what is left."""
        try:
            if self._proc.poll() is None:
                self._exchange({"op": "exit"}, timeout=60)
                self._proc.wait(timeout=30)
        except Exception:
            pass
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
            deadline = time.monotonic() + 10
            while (left := self.pids()) and time.monotonic() < deadline:
                for pid in left:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.1)
