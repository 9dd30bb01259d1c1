"""Warm pools: the latency of a warm ``Runner.call``, next to a bare spawn and a
cold call measured in the same run, and the memory one warm sandbox holds.

    python3 bench/pool.py [--n 200] [--docker-n 50]

Rows: a bare ``python3 main.py`` spawn of the shipped ``add_numbers`` (the baseline), a
cold ``Runner.call`` (no pool) and a warm one (``tools.add_numbers.pool: 2``), sampled in
turns. Each timed run waits, untimed, until the pool is full again and then 50 ms more
(the tool's own start-up after its sandbox is set up), so every warm call finds a warm
sandbox whose tool waits on its stdin: this is the latency a pool gives while it keeps
up; the audit's ``warm`` field is counted to show that it did. Memory: RSS and USS
(pages no other process shares) summed over the processes of one idle warm sandbox
(bubblewrap, its init, the tool).

Docker rows (``--docker-n 0`` skips them), with their own baseline measured in the same
run: ``docker run --rm -i`` of an adding tool in ``runner/base:latest`` (the flags of
``bench/docker_call.py``), and a warm docker ``Runner.call`` of the same tool
(``pool: 2``), each call made once the pool is full again, as above.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _timing import (  # noqa: E402
    ADD_PARAMS,
    ADD_PAYLOAD,
    PYTHON,
    bare_env,
    docker_add_folder,
    docker_run_argv,
    starter_folder,
    timed_together,
)

from runner import Runner  # noqa: E402
from sandboxes.subprocess._cgroup import CgroupFactory  # noqa: E402

STARTER = starter_folder()
TOOL = STARTER / "tools" / "add_numbers"
PARAMS, PAYLOAD = ADD_PARAMS, ADD_PAYLOAD
POOL_SIZE = 2
CALL_GAP_S = 0.05

BARE_ENV = bare_env()


def bare() -> None:
    argv = [PYTHON, "main.py"]
    subprocess.run(argv, input=PAYLOAD, capture_output=True, cwd=TOOL, check=True, env=BARE_ENV)


def runner(pool: int, audit: Path) -> Runner:
    policy_path = STARTER / "policies.yaml"
    policy = yaml.safe_load(policy_path.read_text())
    policy.setdefault("tools", {}).setdefault("add_numbers", {})["pool"] = pool
    path = STARTER / f"policies-pool{pool}.yaml"
    path.write_text(yaml.safe_dump(policy))
    return Runner.load(tools=STARTER / "tools", policies=path, audit_log=audit)


def wait_full(r: Runner, tool: str = "add_numbers") -> None:
    deadline = time.monotonic() + 10
    while r.warm_sandboxes().get(tool, 0) < POOL_SIZE:
        if time.monotonic() > deadline:
            raise SystemExit("the pool did not fill within 10 s")
        time.sleep(0.002)
    # A pooled sandbox counts once it is set up; its interpreter may still be starting.
    # Calls that come this long after the refill find it waiting on its stdin.
    time.sleep(CALL_GAP_S)


def call(r: Runner) -> None:
    result = r.call("add_numbers", PARAMS)
    if not result.success:
        raise SystemExit(f"call failed: {result.error}")


def warm_sandbox_memory() -> tuple[float, float]:
    """RSS and USS (MiB) of the processes of each idle warm sandbox of this process, averaged."""
    pids_parent = next(p for p in CgroupFactory().parents if "pids" in p.parts)
    groups = [g for g in pids_parent.iterdir() if g.name.startswith(f"{os.getpid()}-")]
    rss = uss = 0
    for group in groups:
        for pid in (group / "cgroup.procs").read_text().split():
            info = psutil.Process(int(pid)).memory_full_info()
            rss += info.rss
            uss += info.uss
    return rss / len(groups) / 2**20, uss / len(groups) / 2**20


def warm_container_memory() -> tuple[float, float]:
    """Of each idle warm container of this process, averaged (MiB): what its cgroup charges
    (``memory.usage_in_bytes`` / ``memory.current``: the processes in it, page cache and
    kernel memory included) and the RSS of its ``containerd-shim``, the daemon side's one
    process per container."""
    from sandboxes.docker._cgroup import ContainerCgroup
    from sandboxes.docker._client import api_client
    from sandboxes.docker.sandbox import LABEL_OWNER

    client = api_client()
    ours = client.containers(filters={"label": f"{LABEL_OWNER}={os.getpid()}", "status": "running"})
    charged = shim = 0
    for container in ours:
        cgroup = ContainerCgroup.find(container["Id"])
        assert cgroup is not None, "the container's cgroup is not on this host"
        usage = cgroup.memory / "memory.usage_in_bytes"
        charged += int((usage if usage.exists() else cgroup.memory / "memory.current").read_text())
        shim += sum(
            p.memory_info().rss
            for p in psutil.process_iter(["name", "cmdline"])
            if (p.info["name"] or "").startswith("containerd-shim")
            and container["Id"] in " ".join(p.info["cmdline"] or ())
        )
    count = max(1, len(ours))
    return charged / count / 2**20, shim / count / 2**20


def docker_rows(n: int) -> tuple[list[float], list[float], int, tuple[float, float]]:
    """``docker run --rm -i`` and a warm docker ``Runner.call`` of the same tool, with the
    number of calls the audit says were warm and the memory of an idle warm container."""
    with tempfile.TemporaryDirectory() as tmp:
        tools, policy = docker_add_folder(Path(tmp), f"{{dadd: {{pool: {POOL_SIZE}}}}}")
        tool = tools / "dadd"
        cli = docker_run_argv(tool)

        def docker_run() -> None:
            done = subprocess.run(cli, check=False, input=PAYLOAD, capture_output=True)
            if done.stdout.strip() != b"3":
                raise SystemExit(f"docker run failed: {done.stderr.decode(errors='replace')[-300:]}")

        def warm_call(r: Runner) -> None:
            result = r.call("dadd", PARAMS, retries=0)
            if not result.success:
                raise SystemExit(f"docker call failed: {result.error}")

        (run_ms,) = timed_together([docker_run], n)
        audit = Path(tmp) / "audit.log"
        with Runner.load(tools=tools, policies=policy, audit_log=audit) as warm_runner:
            refilled = lambda: wait_full(warm_runner, "dadd")  # noqa: E731
            (warm_ms,) = timed_together([lambda: warm_call(warm_runner)], n, refilled)
            wait_full(warm_runner, "dadd")
            memory = warm_container_memory()
        attempts = [json.loads(line) for line in audit.read_text().splitlines() if '"call.attempt"' in line]
        return run_ms, warm_ms, sum(1 for a in attempts if a.get("warm")), memory


def row(name: str, samples: list[float], base: float) -> None:
    ordered = sorted(samples)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(f"{name:<24}{p50:>9.1f}{p99:>9.1f}{p50 / base:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--docker-n", type=int, default=50)
    args = parser.parse_args()
    n = args.n
    audit = STARTER / "audit.log"
    with runner(0, Path(os.devnull)) as cold_runner, runner(POOL_SIZE, audit) as warm_runner:
        # In turns, one of each per round (a machine whose speed drifts during the run
        # weighs on every row alike), each after a quiet moment: the pool full again and
        # the cold call's teardown done (``wait_full`` waits 50 ms past the refill).
        bare_ms, cold_ms, warm_ms = timed_together(
            [bare, lambda: call(cold_runner), lambda: call(warm_runner)], n, lambda: wait_full(warm_runner)
        )
        wait_full(warm_runner)
        rss, uss = warm_sandbox_memory()
    attempts = [json.loads(line) for line in audit.read_text().splitlines() if '"call.attempt"' in line]
    warm_count = sum(1 for a in attempts if a.get("warm"))
    base = statistics.median(bare_ms)
    print(f"n={n} per row, {os.cpu_count()} cores")
    print(f"{'what':<24}{'p50 ms':>9}{'p99 ms':>9}{'p50 x bare':>12}")
    row("bare python3 main.py", bare_ms, base)
    row("Runner.call cold", cold_ms, base)
    row("Runner.call warm", warm_ms, base)
    print(f"warm calls: {warm_count} of {len(attempts)} (warm-up included)")
    print(f"one idle warm sandbox: RSS {rss:.1f} MiB, USS {uss:.1f} MiB")
    if args.docker_n > 0:
        run_ms, docker_warm_ms, docker_warm, (charged, shim) = docker_rows(args.docker_n)
        docker_base = statistics.median(run_ms)
        print(f"{'docker':<24}{'p50 ms':>9}{'p99 ms':>9}{'p50 x run':>12}")
        row("docker run --rm -i", run_ms, docker_base)
        row("Runner.call warm docker", docker_warm_ms, docker_base)
        print(f"warm docker calls: {docker_warm} of {args.docker_n + 1} (warm-up included)")
        print(
            f"one idle warm container: {charged:.1f} MiB charged to its cgroup,"
            f" containerd-shim RSS {shim:.1f} MiB"
        )


if __name__ == "__main__":
    main()
