"""A Ray cluster and a runner client inside a network namespace of their own (only loopback).

Started by tests/support/ray_cluster.py as ``unshare --net python ray_agent.py WORKDIR MODE``:
brings loopback up, starts a Ray head (the control node: no sandbox slots, the client's
raylet) and, in MODE ``locked``, two worker nodes with two ``runner_sandbox`` slots each, all
in token mode; in MODE ``open`` one node with slots and no authentication at all. Then it
serves JSON-line commands on stdin (answers on the stdout it had; its own fd 1 goes to
stderr, where Ray may print). Every process of the namespace is killed when it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

PORT = 6379
ADDRESS = f"127.0.0.1:{PORT}"
SLOTS = 2


def ray_env(workdir: Path, mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    if mode.startswith("locked"):
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = (workdir / "token").read_text().strip()
    else:
        env["RAY_AUTH_MODE"] = "disabled"
    env["HOME"] = str(workdir)  # no ~/.ray/auth_token of the machine's
    return env


def ray_start(workdir: Path, mode: str, temp_dir: str, head: bool, slots: int) -> None:
    # This Python's Ray, so the nodes' workers import the runner the tests import.
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--node-ip-address=127.0.0.1"]
    argv += ["--disable-usage-stats"]
    argv += ["--num-cpus=1", f"--resources={json.dumps({'runner_sandbox': slots} if slots else {})}"]
    if head:
        argv += [
            "--head",
            f"--port={PORT}",
            "--include-dashboard=false",
            "--dashboard-host=127.0.0.1",
            f"--temp-dir={temp_dir}",
        ]
    else:
        argv += [f"--address={ADDRESS}"]
    with (workdir / "ray-start.log").open("ab") as log:
        subprocess.run(argv, env=ray_env(workdir, mode), stdout=log, stderr=log, check=True, timeout=120)


def same_netns_pids() -> list[int]:
    mine = os.readlink("/proc/self/ns/net")
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == mine:
                    found.append(int(entry))
            except OSError:
                continue
    return found


class Agent:
    def __init__(self, workdir: Path, mode: str) -> None:
        self.workdir = workdir
        self.mode = mode
        self.temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner: Any = None
        self.calls: dict[str, Future[Any]] = {}

    def start(self) -> dict[str, Any]:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        (self.workdir / "token").write_text(secrets.token_hex(32))
        (self.workdir / "token").chmod(0o600)
        ray_start(
            self.workdir, self.mode, self.temp_dir, head=True, slots=0 if self.mode == "locked" else SLOTS
        )
        if self.mode.startswith("locked"):
            for _ in range(1 if self.mode == "locked-1" else 2):
                self.add_node()
        return {"address": ADDRESS}

    def add_node(self) -> dict[str, Any]:
        ray_start(self.workdir, self.mode, self.temp_dir, head=False, slots=SLOTS)
        return {}

    def load(self, tools: str, policy: str, audit: str) -> dict[str, Any]:
        from runner import Runner

        if self.runner is not None:
            self.runner.close()
        self.runner = Runner.load(tools=tools, policies=policy, audit_log=audit, warm_pools=False)
        return {}

    def call(self, id: str, request: dict[str, Any]) -> dict[str, Any]:
        self.calls[id] = asyncio.run_coroutine_threadsafe(self._call(request), self.loop)
        return {}

    async def _call(self, request: dict[str, Any]) -> Any:
        return await self.runner.ahandle(request)

    def result(self, id: str, timeout: float = 60) -> dict[str, Any]:
        try:
            return {"answer": self.calls.pop(id).result(timeout)}
        except BaseException as exc:  # a cancelled call: CancelledError
            return {"raised": type(exc).__name__}

    def bench(self, tool: str, calls: int, concurrency: int) -> dict[str, Any]:
        """``calls`` calls of ``tool`` with ``concurrency`` at once: each call's seconds, and the wall time."""
        return asyncio.run_coroutine_threadsafe(self._bench(tool, calls, concurrency), self.loop).result()

    async def _bench(self, tool: str, calls: int, concurrency: int) -> dict[str, Any]:
        gate = asyncio.Semaphore(concurrency)
        seconds: list[float] = []
        failures: list[Any] = []

        async def one() -> None:
            async with gate:
                began = time.perf_counter()
                answer = await self.runner.ahandle({"toolName": tool, "params": {}})
                seconds.append(time.perf_counter() - began)
                if not answer["success"]:
                    failures.append(answer["error"])

        began = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(calls)))
        return {"latencies": seconds, "wall": time.perf_counter() - began, "failures": failures[:3]}

    def python(self) -> dict[str, Any]:
        return {"version": list(sys.version_info[:3]), "executable": sys.executable}

    def break_node_jobs(self, broken: bool) -> dict[str, Any]:
        """A fault of the runner's own code on the node, for the tests: while ``broken``,
        every node job names a cache folder no path can be (a NUL in it: ValueError)."""
        from dataclasses import replace

        from runner.dispatch.sandbox import DispatchedSandbox

        original = self.__dict__.setdefault("_job", DispatchedSandbox.job)

        def broken_job(sandbox: Any, *args: Any) -> Any:
            return replace(original(sandbox, *args), cache_root="node-cache\0broken")

        DispatchedSandbox.job = broken_job if broken else original  # type: ignore[method-assign,assignment]
        return {}

    def cancel(self, id: str) -> dict[str, Any]:
        self.calls[id].cancel()
        return {}

    def probe(self, token: str | None) -> dict[str, Any]:
        from runner.dispatch.cluster import authentication_problem

        return {"problem": authentication_problem(ADDRESS, token, 5.0)}

    def slots(self) -> dict[str, Any]:
        from runner.dispatch.cluster import node_slots

        return {"nodes": [n.__dict__ for n in node_slots("runner_sandbox")]}

    def doctor(self, policy: str) -> dict[str, Any]:
        from runner.call.policy import Policy
        from runner.cli.doctor import check_layers

        layers = check_layers(Policy.load(Path(policy)))
        return {"layers": [layer.__dict__ for layer in layers if layer.backend == "dispatch"]}

    def ray_init_without_token(self) -> dict[str, Any]:
        """A plain Ray client with no token (and token mode off) trying to join."""
        code = (
            "import ray, sys\n"
            "try:\n    ray.init(address=sys.argv[1], log_to_driver=False)\n"
            "except Exception as exc:\n    print('refused', type(exc).__name__); sys.exit(3)\n"
            "print('joined'); sys.exit(0)\n"
        )
        env = ray_env(self.workdir, "open")
        env["RAY_gcs_rpc_server_connect_timeout_s"] = "3"
        done = subprocess.run(
            [sys.executable, "-c", code, ADDRESS], env=env, capture_output=True, text=True, timeout=90
        )
        return {"returncode": done.returncode, "stdout": done.stdout[-500:]}

    def close(self) -> None:
        if self.runner is not None:
            try:
                self.runner.close()
            except Exception as exc:
                print("closing the runner:", exc, file=sys.stderr)
        for pid in same_netns_pids():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def main() -> None:
    workdir, mode = Path(sys.argv[1]), sys.argv[2]
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    agent = Agent(workdir, mode)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            op = command.pop("op")
            if op == "exit":
                break
            started = time.monotonic()
            try:
                reply = {"ok": True, **getattr(agent, op)(**command)}
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            reply["seconds"] = round(time.monotonic() - started, 3)
            answers.write(json.dumps(reply) + "\n")
    finally:
        agent.close()
        answers.write(json.dumps({"ok": True, "closed": True}) + "\n")
        os._exit(0)  # Ray's atexit hooks would try a cluster whose processes are gone


if __name__ == "__main__":
    main()
