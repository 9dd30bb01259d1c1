"""A connection flood by an unprivileged local user, for the ``runner serve`` tests: idle
connections (nothing is ever sent) held against the server's ports by a process running as
``nobody``, and the server's descriptors and threads sampled meanwhile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

NOBODY = 65534
# The flooder: COUNT connections to each port, opened at once; each tick, every one the
# server closed is opened again, so COUNT are always being held or retried. It reports
# on stdout, one JSON line per tick. Standard library only, run isolated (-I).
FLOODER = r"""
import json, os, resource, select, socket, sys, time

host, ports, count, tick = sys.argv[1], [int(p) for p in sys.argv[2].split(",")], int(sys.argv[3]), float(sys.argv[4])
source = sys.argv[5]
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

def connect(port):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.bind((source, 0))
    sock.connect_ex((host, port))
    return sock

held = {port: [connect(port) for _ in range(count)] for port in ports}
reopened = 0
while True:
    poller = select.poll()
    where = {}
    for port, group in held.items():
        for index, sock in enumerate(group):
            poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            where[sock.fileno()] = (port, index)
    closed = {port: 0 for port in held}
    for fd, _ in poller.poll(0):
        port, index = where[fd]
        held[port][index].close()  # the server closed it (it never sends to an idle one)
        held[port][index] = connect(port)
        closed[port] += 1
        reopened += 1
    report = {"uid": os.getuid(), "count": count, "closed": closed, "reopened": reopened}
    print(json.dumps(report), flush=True)
    time.sleep(tick)
"""


@dataclass
class Flood:
    """``count`` idle connections to each of ``ports`` from ``source`` (a loopback address;
    127.0.0.1 is every local user's, the clients' of the tests too), held by ``nobody``."""

    ports: list[int]
    count: int = 1100
    tick_s: float = 1.0
    source: str = "127.0.0.1"
    reports: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        argv += [sys.executable, "-I", "-c", FLOODER, "127.0.0.1", ",".join(map(str, self.ports))]
        argv += [str(self.count), str(self.tick_s), self.source]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.reports.append(json.loads(line))

    def wait_holding(self, ticks: int = 2, timeout_s: float = 60.0) -> dict[str, Any]:
        """The last report, once ``ticks`` ticks ran after the connections were opened."""
        deadline = time.monotonic() + timeout_s
        while len(self.reports) < ticks:
            assert self.process.poll() is None, "the flooder died"
            assert time.monotonic() < deadline, "the flooder did not start"
            time.sleep(0.1)
        report = self.reports[-1]
        assert report["uid"] == NOBODY, report
        return report

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        self._reader.join(timeout=10)
        assert self.process.stdout is not None
        self.process.stdout.close()


@dataclass
class Usage:
    """The most descriptors and threads seen in one process."""

    pid: int
    fds: int = 0
    threads: int = 0

    def sample(self) -> None:
        self.fds = max(self.fds, len(os.listdir(f"/proc/{self.pid}/fd")))
        self.threads = max(self.threads, psutil.Process(self.pid).num_threads())

    def sample_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.sample()
            time.sleep(0.1)


def soft_nofile(pid: int) -> int:
    """The soft RLIMIT_NOFILE of ``pid`` now."""
    return psutil.Process(pid).rlimit(psutil.RLIMIT_NOFILE)[0]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])
