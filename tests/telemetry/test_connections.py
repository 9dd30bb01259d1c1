"""``ConnectionGate``'s rules: caps per peer and in all, the oldest idle untrusted connection
evicted first, trusted, busy and talking ones kept, a refusal once all are trusted;
``ConnectionLimits.within`` fits the caps to the descriptor limit; ``unread`` on a real
socket pair."""

from __future__ import annotations

import socket

import httpx2

from runner.call.policy import ServeConnectionsModel
from runner.telemetry.connections import MIN_OPEN, ConnectionGate, ConnectionLimits, unread


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
    gate = ConnectionGate(ConnectionLimits(max_open=4, max_per_peer=2))
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


def test_a_flood_from_one_address_never_evicts_another_addresss_new_connection() -> None:
    # A client's connection whose request has not arrived yet looks like the flood's; were
    # one address allowed every slot, the flood's newer connections would evict it.
    # So one address holds at most half of a listener's slots untrusted.
    gate = ConnectionGate(ConnectionLimits(max_open=8, max_per_peer=8))
    fresh = _admit(gate, "127.0.0.1", 1)[1]
    for port in range(1, 100):
        assert _admit(gate, "127.0.0.2", port)[0]
    assert not fresh.closed
    assert gate.open == 1 + 8 // 2


def test_trusted_connections_of_one_address_may_fill_the_listener() -> None:
    # A TLS proxy on loopback: every client arrives from 127.0.0.1, each with a token.
    gate = ConnectionGate(ConnectionLimits(max_open=8, max_per_peer=8))
    for port in range(1, 9):
        assert _admit(gate, "127.0.0.1", port)[0]
        gate.trust(("127.0.0.1", port))
    assert gate.open == 8 and gate.evicted == 0


def test_a_connection_with_a_request_in_hand_is_not_evicted_until_its_answer_is_sent() -> None:
    # A client with a token whose request waits for the event loop behind a burst of the
    # flood must not lose its connection before the token check trusts it.
    gate = ConnectionGate(ConnectionLimits(max_open=10, max_per_peer=2))
    waiting = _admit(gate, "127.0.0.1", 1)[1]
    idle = _admit(gate, "127.0.0.1", 2)[1]
    gate.busy(("127.0.0.1", 1), True)
    admitted, newer = _admit(gate, "127.0.0.1", 3)
    assert admitted and idle.closed and not waiting.closed
    # Answered (and not trusted: a refused one): it is idle again, the first to go.
    gate.busy(("127.0.0.1", 1), False)
    admitted, _ = _admit(gate, "127.0.0.1", 4)
    assert admitted and waiting.closed and not newer.closed


def test_a_connection_whose_bytes_wait_unread_is_not_evicted() -> None:
    # The event loop reads a client's request some accept batches after taking its
    # connection: the flood's newer connections must not evict it meanwhile.
    gate = ConnectionGate(ConnectionLimits(max_open=10, max_per_peer=2))
    sent = [True]
    talking = Held()
    gate.admit(("127.0.0.1", 1), talking, talking.close, lambda: sent[0])
    idle = _admit(gate, "127.0.0.1", 2)[1]
    assert _admit(gate, "127.0.0.1", 3)[0] and idle.closed and not talking.closed
    sent[0] = False
    assert _admit(gate, "127.0.0.1", 4)[0] and talking.closed


def test_unread_sees_the_bytes_waiting_in_the_kernel() -> None:
    class Transport:
        def __init__(self, sock: socket.socket) -> None:
            self.sock = sock

        def get_extra_info(self, name: str) -> object:
            return self.sock if name == "socket" else None

    ours, theirs = socket.socketpair()
    with ours, theirs:
        waiting = unread(Transport(ours))  # type: ignore[arg-type]
        assert not waiting()
        theirs.sendall(b"POST /mcp HTTP/1.1\r\n")
        assert waiting()
        ours.recv(100)
        assert not waiting()
    assert not waiting()  # closed: never another socket's count


def test_the_default_idle_timeout_outlasts_the_mcp_sdk_clients_keep_alive() -> None:
    # Both 5 s: the server closed a kept-alive connection as the client sent its next
    # request on it, and the client's call failed (ReadError) under load.
    sdk_keeps = httpx2.Limits().keepalive_expiry  # what create_mcp_http_client leaves as is
    assert sdk_keeps is not None
    assert ConnectionLimits().idle_timeout_s == ServeConnectionsModel().idle_timeout_ms / 1000
    assert ConnectionLimits().idle_timeout_s > 2 * sdk_keeps
