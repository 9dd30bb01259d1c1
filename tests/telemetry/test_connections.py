"""``ConnectionGate``'s rules, without sockets: caps per peer and in all, the oldest
untrusted connection evicted first, trusted ones kept, a refusal once all are trusted;
``ConnectionLimits.within`` fits the caps to the descriptor limit."""

from __future__ import annotations

from runner.telemetry.connections import MIN_OPEN, ConnectionGate, ConnectionLimits


class Held:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _admit(gate: ConnectionGate, host: str, port: int) -> tuple[bool, Held]:
    held = Held()
    return gate.admit((host, port), held, held.close), held


def test_a_new_connection_past_the_per_peer_cap_closes_that_peers_oldest_untrusted_one() -> None:
    gate = ConnectionGate(ConnectionLimits(max_open=10, max_per_peer=2))
    first = _admit(gate, "10.0.0.1", 1)[1]
    other = _admit(gate, "10.0.0.2", 1)[1]
    second = _admit(gate, "10.0.0.1", 2)[1]
    admitted, third = _admit(gate, "10.0.0.1", 3)
    assert admitted and first.closed
    assert not (other.closed or second.closed or third.closed)
    assert gate.open == 3 and gate.evicted == 1


def test_trusted_connections_are_kept_and_a_new_one_is_refused_once_every_slot_is_trusted() -> None:
    gate = ConnectionGate(ConnectionLimits(max_open=2, max_per_peer=2))
    kept = [_admit(gate, "127.0.0.1", port)[1] for port in (1, 2)]
    gate.trust(("127.0.0.1", 1))
    admitted, newer = _admit(gate, "127.0.0.1", 3)  # evicts port 2, the untrusted one
    assert admitted and kept[1].closed and not kept[0].closed
    gate.trust(("127.0.0.1", 3))
    refused, _ = _admit(gate, "127.0.0.1", 4)
    assert not refused and gate.refused == 1 and not newer.closed
    # A release by a connection that was evicted frees nothing of the newer one's.
    gate.release(("127.0.0.1", 2), kept[1])
    assert gate.open == 2
    gate.release(("127.0.0.1", 3), newer)
    assert gate.open == 1


def test_the_caps_are_fitted_to_half_the_descriptors_shared_by_the_listeners() -> None:
    limits = ConnectionLimits(max_open=1024, max_per_peer=256)
    assert limits.within(1 << 20, listeners=2) == limits
    assert limits.within(1024, listeners=2).max_open == 256
    assert limits.within(1024, listeners=2).max_per_peer == 256
    assert limits.within(40, listeners=2).max_open == MIN_OPEN
