"""``runner audit report`` over a million events: time and peak memory of the command.

    python3 bench/audit_report.py [--events 1000000] [--keep FILE]

Writes a log of realistic events (per call a ``policy.decision`` with its params, a
``call.attempt`` with a stderr tail, a ``call.finished``; a tenth of the calls denied, a
tenth failing) into a temporary file, then runs, each as a child process whose peak RSS is
read with ``os.wait4``:

- the baseline: a Python child that only reads the file line by line (the floor of any
  streamed reader),
- ``runner audit report --json`` (by tool) and ``--by client``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOLS = [f"tool_{n:02d}" for n in range(40)]
ROLES = ("user", "admin", "ci")
CLIENTS = ("ci-agent", "ops", "notebook")
READ_ONLY = "import sys\nwith open(sys.argv[1], 'rb') as f:\n    for line in f:\n        pass\n"


def generate(path: Path, events: int, seed: int = 1) -> int:
    """Write about ``events`` events; the number written."""
    rng = random.Random(seed)
    written = 0
    call = 0
    with path.open("w") as log:
        while written < events:
            call += 1
            ms = 1_700_000_000_000 + call * 37
            common = {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000))
                + f".{ms % 1000:03d}Z",
                "requestId": f"req_{rng.getrandbits(128):032x}",
                "traceId": f"{rng.getrandbits(128):032x}",
                "toolName": rng.choice(TOOLS),
                "role": rng.choice(ROLES),
                "client": rng.choice(CLIENTS),
            }
            denied = rng.random() < 0.1
            decision = {
                **common,
                "decision": "deny" if denied else "allow",
                "reason": "not_allowed" if denied else "allowed",
                "rule": None if denied else "*",
                "params": {
                    "a": rng.randint(0, 99),
                    "b": rng.randint(0, 99),
                    "note": "x" * rng.randint(0, 80),
                },
                "event": "policy.decision",
            }
            lines = [decision]
            duration = int(rng.lognormvariate(4.5, 1.0))
            if denied:
                end = {"success": False, "code": "PERMISSION_DENIED", "reason": "not_allowed", "attempts": 0}
            else:
                failed = rng.random() < 0.1
                lines.append(
                    {
                        **common,
                        "attempt": 1,
                        "sandbox": "subprocess",
                        "duration": duration,
                        "exitCode": 1 if failed else 0,
                        "signal": None,
                        "reason": "nonzero_exit" if failed else None,
                        "code": "EXECUTION_ERROR" if failed else None,
                        "warm": False,
                        "stderr": "Traceback ...\nValueError: bad input\n" if failed else "",
                        "event": "call.attempt",
                    }
                )
                end = {
                    "success": not failed,
                    "code": "EXECUTION_ERROR" if failed else None,
                    "reason": "nonzero_exit" if failed else None,
                    "attempts": 1,
                }
            lines.append({**common, **end, "duration": duration + 2, "event": "call.finished"})
            for event in lines:
                log.write(json.dumps(event, separators=(",", ":")) + "\n")
            written += len(lines)
    return written


def measured(argv: list[str]) -> tuple[float, float, bytes]:
    """Wall seconds, peak RSS (MiB) and stdout of a child."""
    with tempfile.TemporaryFile() as out:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        started = time.perf_counter()
        child = subprocess.Popen(argv, stdout=out, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            raise SystemExit(f"{argv[2:5]} exited {child.returncode}")
        out.seek(0)
        return wall, usage.ru_maxrss / 1024, out.read()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keep", type=Path, default=None, help="write the log here and keep it")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="runner-bench-report-"))
    log = args.keep or folder / "audit.log"
    try:
        started = time.perf_counter()
        count = generate(log, args.events)
        size = log.stat().st_size
        print(f"generated {count} events ({size / 2**20:.0f} MiB) in {time.perf_counter() - started:.1f} s")
        base_s, base_mib, _ = measured([sys.executable, "-c", READ_ONLY, str(log)])
        rows = [("python reading the lines (baseline)", base_s, base_mib)]
        for by in ("tool", "client"):
            argv = [
                sys.executable,
                "-m",
                "runner",
                "audit",
                "report",
                "--log",
                str(log),
                "--json",
                "--by",
                by,
            ]
            wall, mib, out = measured(argv)
            calls = json.loads(out)["total"]["calls"]
            rows.append((f"runner audit report --by {by} ({calls} calls)", wall, mib))
        print(f"{'':48} {'seconds':>8} {'x base':>7} {'peak RSS MiB':>13} {'x base':>7}")
        for name, wall, mib in rows:
            print(f"{name:48} {wall:8.2f} {wall / base_s:7.1f} {mib:13.1f} {mib / base_mib:7.2f}")
        print(f"per event: {rows[1][1] / count * 1e6:.2f} us")
    finally:
        if args.keep is None:
            log.unlink(missing_ok=True)
        folder.rmdir()


if __name__ == "__main__":
    main()
