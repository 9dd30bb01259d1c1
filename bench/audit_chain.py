"""What the hash chain costs per audit event, and what ``runner audit verify`` costs per line.

    python3 bench/audit_chain.py [--events 20000] [--rounds 5]

Each round writes ``--events`` events of a call's usual size (a ``policy.decision`` with
params) through ``AuditLog.emit`` to a fresh file: plain (one ``O_APPEND`` write, the
baseline), chained (``flock``, read the tail's hash, canonical JSON, SHA-256, write,
unlock) and chained with a key (HMAC-SHA256 instead of SHA-256). Then two processes
appending to one chained file at once (the lock contended), and ``verify`` over the
chained and the keyed file, and one line's hash alone (SHA-256 and HMAC-SHA256 in turns).
Medians of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runner.audit import chain as audit_chain  # noqa: E402
from runner.audit.log import AuditLog  # noqa: E402
from runner.audit.verify import verify  # noqa: E402

FIELDS: dict[str, Any] = {
    "toolName": "add_numbers",
    "requestId": "req_7733db314a9e4ab299663a0ddd4bb3a3",
    "traceId": "21612c553b04453291ed10e3dafc0b22",
    "role": "user",
    "decision": "allow",
    "reason": "allowed",
    "rule": "add_numbers",
    "params": {"a": 1, "b": 2, "note": "a short note of the kind a model sends"},
}
WRITER = """
import sys, time
from pathlib import Path
from typing import Any
sys.path.insert(0, sys.argv[3])
from runner.audit.log import AuditLog
audit = AuditLog(Path(sys.argv[1]), chain=True)
sys.stdin.read()
fields = {"toolName": "add_numbers", "role": "user", "decision": "allow", "params": {"a": 1, "b": 2}}
started = time.perf_counter()
for _ in range(int(sys.argv[2])):
    audit.emit("policy.decision", **fields)
print(time.perf_counter() - started)
"""


KEY = b"a bench key of 32 bytes, no more"


def per_event_us(folder: Path, events: int, chain: bool, key: bytes | None = None) -> float:
    kind = "keyed" if key else "chained" if chain else "plain"
    path = folder / f"{kind}-{time.monotonic_ns()}.log"
    audit = AuditLog(path, chain=chain, key=key)
    started = time.perf_counter()
    for _ in range(events):
        audit.emit("policy.decision", **FIELDS)
    elapsed = time.perf_counter() - started
    audit.close()
    assert audit.dropped == 0
    return elapsed / events * 1e6


def digest_us(key: bytes | None, times: int = 20_000) -> float:
    """One line's hash, of a line the size ``FIELDS`` makes."""
    line = audit_chain.chained_line({"event": "policy.decision", **FIELDS}, audit_chain.GENESIS)
    parts = audit_chain.split_line(line.encode("ascii"))
    assert parts is not None
    body = parts[0]
    started = time.perf_counter()
    for _ in range(times):
        audit_chain.digest(body, key)
    return (time.perf_counter() - started) / times * 1e6


def contended_us(folder: Path, events: int) -> float:
    """Two processes appending to one chained file at once: the slower one's time per event."""
    path = folder / f"shared-{time.monotonic_ns()}.log"
    argv = [sys.executable, "-c", WRITER, str(path), str(events), str(REPO)]
    procs = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
    times = []
    for proc in procs:
        assert proc.stdout is not None
        times.append(float(proc.stdout.read()))
        proc.wait(timeout=300)
    assert verify(path).intact
    return max(times) / events * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="runner-bench-chain-") as scratch:
        folder = Path(scratch)
        plain: list[float] = []
        chained: list[float] = []
        keyed: list[float] = []
        shared: list[float] = []
        checks: list[float] = []
        keyed_checks: list[float] = []
        hashes: list[float] = []
        hmacs: list[float] = []
        for _ in range(args.rounds * 3):
            hashes.append(digest_us(None))
            hmacs.append(digest_us(KEY))
        for _ in range(args.rounds):
            plain.append(per_event_us(folder, args.events, chain=False))
            chained.append(per_event_us(folder, args.events, chain=True))
            keyed.append(per_event_us(folder, args.events, chain=True, key=KEY))
            shared.append(contended_us(folder, args.events))
        for kind, key, found in (("chained", None, checks), ("keyed", KEY, keyed_checks)):
            log = max(folder.glob(f"{kind}-*.log"))
            started = time.perf_counter()
            verdict = verify(log, key=key)
            assert verdict.intact
            found.append((time.perf_counter() - started) / verdict.lines * 1e6)
        base = statistics.median(plain)
        rows = [
            ("emit, plain (baseline)", base),
            ("emit, chained", statistics.median(chained)),
            ("emit, chained and keyed (HMAC-SHA256)", statistics.median(keyed)),
            ("emit, chained, 2 processes on one file", statistics.median(shared)),
            ("verify, per line", statistics.median(checks)),
            ("verify, keyed, per line", statistics.median(keyed_checks)),
            ("one line's hash alone, SHA-256", statistics.median(hashes)),
            ("one line's hash alone, HMAC-SHA256", statistics.median(hmacs)),
        ]
        print(f"{args.events} events x {args.rounds} rounds")
        print(f"{'':42} {'us/event':>9} {'x base':>7}")
        for name, value in rows:
            print(f"{name:42} {value:9.2f} {value / base:7.2f}")
        print(f"chain cost per event: {statistics.median(chained) - base:+.2f} us")


if __name__ == "__main__":
    main()
