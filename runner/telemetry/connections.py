"""Bounds on the connections of a listener of the runner (``runner serve``'s MCP and
metrics listeners).

A local user without a token can open connections and send nothing. Unbounded, they use
up the process's file descriptors (the default soft ``RLIMIT_NOFILE`` is 1024) and the
runner can no longer start a sandbox. So each listener has a ``ConnectionGate``:

- at most ``max_open`` connections in all and ``max_per_peer`` from one IP address, of
  which at most half of ``max_open`` untrusted (below): a flood from one address then
  never fills the listener, so it only ever evicts its own connections, never another
  address's new one, while a proxy's trusted connections from one address may fill it;
- a connection that has not yet been *trusted* (its request passed the token check, or a
  valid scrape on the metrics listener) is the first to go: when a cap is reached, a new
  connection closes the oldest idle untrusted one (of the same peer for the per-peer cap)
  instead of being refused. A flood of idle connections thus keeps cycling through its
  own slots, and a client with a token, which sends its request at once, gets in. Only
  when every slot holds a trusted connection is a new one refused;
- a connection is not idle while bytes it sent wait unread in the kernel, nor from the
  moment its request head arrived until its answer is sent: the request is about to be
  trusted or refused (a refused one is closed with its 401). Under a burst of the flood,
  the event loop reads a client's request a few accept batches after taking its
  connection, and those batches must not evict it first;
- a refused or evicted connection is closed at once with a reset (nothing lingers);
- a request's head must arrive within ``header_timeout_s``, and a kept-alive connection
  may stay idle ``idle_timeout_s`` between requests.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import resource
import socket
import termios
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from runner.call.policy import ServeConnectionsModel

Peer = tuple[str, int]
# The share of the process's descriptors that the listeners may hold between them; the
# rest is for sandboxes (pipes, pidfds), pools, the audit log and the tools' files.
LISTENERS_SHARE = 0.5
# How many connections asyncio accepts in one pass of the event loop, before the gate
# sees them (in the next): each is a descriptor until then, so with a queue full of a
# flood's connections, a few passes must not take hundreds.
ACCEPT_BACKLOG = 16
# The kernel's queue of connections not yet accepted (``listen_long``), capped by
# ``net.core.somaxconn``. When it is full the kernel drops a new connection's handshake,
# which its client sends again a second later at the earliest, and again, until it lands
# on a free place: beside a flood, a client's connection could lose that race each time,
# and be reset. In the queue each waits its turn, at no descriptor's cost to the runner;
# what its peer sent waits there too, up to its receive buffer, in the kernel's memory.
LISTEN_BACKLOG = 1024
# What an unlimited number of descriptors counts as.
UNLIMITED = 1 << 20
# The fewest connections a listener keeps, however low the descriptor limit.
MIN_OPEN = 16


def listener_share(descriptors: int, listeners: int) -> int:
    """The connections each of ``listeners`` listeners may hold, so that together they
    hold at most ``LISTENERS_SHARE`` of ``descriptors`` (and each at least ``MIN_OPEN``)."""
    return max(MIN_OPEN, int(descriptors * LISTENERS_SHARE) // max(1, listeners))


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds of one listener (see the module's docstring)."""

    max_open: int = 1024
    max_per_peer: int = 256
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 15.0

    @classmethod
    def from_policy(cls, model: ServeConnectionsModel) -> ConnectionLimits:
        return cls(
            max_open=model.max_open,
            max_per_peer=model.max_per_peer,
            header_timeout_s=model.header_timeout_ms / 1000,
            idle_timeout_s=model.idle_timeout_ms / 1000,
        )

    def within(self, descriptors: int, listeners: int) -> ConnectionLimits:
        """These limits, lowered so that ``listeners`` listeners together hold at most
        ``LISTENERS_SHARE`` of ``descriptors``."""
        most = min(self.max_open, listener_share(descriptors, listeners))
        return replace(self, max_open=most, max_per_peer=min(self.max_per_peer, most))


def raise_descriptor_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (systemd's default soft limit is
    1024); returns the soft limit in force. Never raises: a limit that cannot be changed
    is kept."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard in (resource.RLIM_INFINITY, soft):
        return soft if soft != resource.RLIM_INFINITY else UNLIMITED
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft
    return hard


@dataclass
class _Held:
    owner: object
    close: Callable[[], None]
    unread: Callable[[], bool]  # bytes it sent wait in the kernel
    trusted: bool = False
    busy: bool = False  # a request's head arrived and its answer is not sent yet

    def idle(self) -> bool:
        return not (self.trusted or self.busy or self.unread())


class ConnectionGate:
    """Admission of one listener's connections. Not thread-safe: one event loop uses it."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._open: OrderedDict[Peer, _Held] = OrderedDict()  # oldest first
        self._per_host: Counter[str] = Counter()
        self._untrusted: Counter[str] = Counter()  # per host
        self.refused = 0
        self.evicted = 0

    def admit(
        self,
        peer: Peer,
        owner: object,
        close: Callable[[], None],
        unread: Callable[[], bool] = lambda: False,
    ) -> bool:
        """Take the connection from ``peer`` (closed with ``close`` if it is evicted later;
        ``unread`` tells whether bytes it sent wait unread); False: refused, the caller
        closes it at once."""
        host = peer[0]
        untrusted_cap = max(1, self.limits.max_open // 2)
        if (
            self._per_host[host] >= self.limits.max_per_peer or self._untrusted[host] >= untrusted_cap
        ) and not self._evict(host):
            self.refused += 1
            return False
        if len(self._open) >= self.limits.max_open and not self._evict(None):
            self.refused += 1
            return False
        self._open[peer] = _Held(owner, close, unread)
        self._per_host[host] += 1
        self._untrusted[host] += 1
        return True

    def trust(self, peer: Peer) -> None:
        """The connection from ``peer`` was answered as a client with a token: it is no
        longer evicted for newer ones."""
        held = self._open.get(peer)
        if held is not None and not held.trusted:
            held.trusted = True
            self._uncount(self._untrusted, peer[0])

    def busy(self, peer: Peer, busy: bool) -> None:
        """The connection from ``peer`` has a request in hand (``busy``) or is idle again: a
        busy one is not evicted for newer ones."""
        held = self._open.get(peer)
        if held is not None:
            held.busy = busy

    def release(self, peer: Peer, owner: object) -> None:
        """``owner``'s connection from ``peer`` is closed (a no-op once it was evicted)."""
        held = self._open.get(peer)
        if held is not None and held.owner is owner:
            self._forget(peer)

    @property
    def open(self) -> int:
        return len(self._open)

    def _evict(self, host: str | None) -> bool:
        for peer, held in self._open.items():
            if (host is None or peer[0] == host) and held.idle():
                self._forget(peer)
                self.evicted += 1
                held.close()
                return True
        return False

    def _forget(self, peer: Peer) -> None:
        held = self._open.pop(peer)
        self._uncount(self._per_host, peer[0])
        if not held.trusted:
            self._uncount(self._untrusted, peer[0])

    @staticmethod
    def _uncount(counter: Counter[str], host: str) -> None:
        counter[host] -= 1
        if not counter[host]:
            del counter[host]


def listen_long(sock: socket.socket) -> None:
    """Give the listening ``sock`` the kernel's long queue (``LISTEN_BACKLOG``): asyncio's
    server listens with its accept batch as the queue's length, so this comes after it
    has started."""
    sock.listen(LISTEN_BACKLOG)


def reset(transport: asyncio.BaseTransport) -> Callable[[], None]:
    """Close ``transport`` at once, unsent data dropped: a refused or evicted
    connection costs nothing after it."""
    abort = getattr(transport, "abort", None)
    return abort if callable(abort) else transport.close


def unread(transport: asyncio.BaseTransport) -> Callable[[], bool]:
    """Whether bytes the peer sent wait unread in the kernel on ``transport``'s socket."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return lambda: False

    def waiting() -> bool:
        count = array.array("i", [0])
        fd = sock.fileno()  # -1 once closed: its number may already be another socket's
        if fd < 0:
            return False
        try:
            fcntl.ioctl(fd, termios.FIONREAD, count)
        except OSError:
            return False
        return count[0] > 0

    return waiting
