"""A bound on what refused HTTP requests write into the audit trail.

Every request without a known token is refused (401), and a refusal is worth an audit
event; but a client needs no token to send thousands of requests a second, each of which
would otherwise append a line to the (chained) log. So, as the egress proxy does for a
tool's refused connections, each peer has a budget: its first ``per_peer`` refusals in a
window of ``window_s`` seconds are audited one by one, the rest only counted, and when
the window ends one summary event (``reason: summary``) carries that count. At most
``max_peers`` peers are tracked; any further peer shares one budget (``peer: other``),
so the trail grows by at most ``(max_peers + 1) * (per_peer + 1)`` events per window
whatever the clients do. A peer is an IP address, an IPv6 address by its /64 (the block
one host is usually given). Behind a reverse proxy every client is the proxy's address,
and they share its budget.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PER_PEER = 10
WINDOW_S = 60.0
MAX_PEERS = 128
OTHER_PEERS = "other"

Emit = Callable[..., Any]


@dataclass
class _Window:
    started: float
    refused: int = 0


class RefusalBudget:
    """Decides which refusals are audited one by one; ``emit(**fields)`` writes an event."""

    def __init__(
        self,
        emit: Emit,
        *,
        per_peer: int = PER_PEER,
        window_s: float = WINDOW_S,
        max_peers: int = MAX_PEERS,
        key_field: str = "peer",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._emit = emit
        self._per_peer = per_peer
        self._window_s = window_s
        self._max_peers = max_peers
        self._key_field = key_field
        self._clock = clock
        # Oldest window first: expired ones are found at the front.
        self._windows: OrderedDict[str, _Window] = OrderedDict()

    def refused(self, host: str | None, **fields: Any) -> None:
        """One refused request from ``host``: audited with ``fields`` while in budget."""
        now = self._clock()
        self.sweep(now)
        key = peer_key(host)
        window = self._windows.get(key)
        if window is None:
            if len(self._windows) >= self._max_peers:
                key = OTHER_PEERS
                window = self._windows.get(key)
            if window is None:
                window = self._windows[key] = _Window(now)
        window.refused += 1
        if window.refused <= self._per_peer:
            self._emit(**fields)

    def sweep(self, now: float | None = None) -> None:
        """Close the windows that have ended (each with its summary when it had one)."""
        now = self._clock() if now is None else now
        while self._windows:
            key, window = next(iter(self._windows.items()))
            if now - window.started < self._window_s:
                return
            del self._windows[key]
            self._summarise(key, window)

    def flush(self) -> None:
        """Close every window now (the server stops): no count is lost."""
        while self._windows:
            self._summarise(*self._windows.popitem(last=False))

    def _summarise(self, key: str, window: _Window) -> None:
        unlogged = window.refused - self._per_peer
        if unlogged > 0:
            seconds = round(min(self._clock() - window.started, self._window_s), 1)
            fields = {self._key_field: key, "count": unlogged, "refused": window.refused, "seconds": seconds}
            self._emit(reason="summary", **fields)


def peer_key(host: str | None) -> str:
    """The budget a request from ``host`` counts against: its address (IPv6: the /64)."""
    if not host:
        return "unknown"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]  # a Unix socket path or a name: as it is, bounded
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)
