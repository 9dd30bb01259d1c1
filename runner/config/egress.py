"""Egress allow-lists: which destinations a tool's proxy may open.

A destination is allowed only when both the manifest's ``network.allow`` and the
policy's ``tools.NAME.network.allow`` list it: ``host:port``, ``*.domain:port`` (any
name below ``domain``, not ``domain`` itself) or a literal address (``10.0.0.5:80``,
``[::1]:8080``). Names are resolved by the runner, never by the tool, and a name whose
answer holds a loopback, private, link-local or otherwise non-public address is refused
unless that very address is listed literally in both lists: an allowed name cannot
be pointed at the host or the internal network by whoever controls its DNS.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_ENTRY = re.compile(r"(?P<host>\[[0-9a-fA-F:.]+\]|[^:\[\]]+):(?P<port>[0-9]{1,5})")
MAX_ENTRIES = 256


@dataclass(frozen=True)
class Destination:
    """One entry of an allow-list: a name, a ``*.`` suffix or an address, and a port."""

    host: str  # lower case, no trailing dot; an address in its canonical text form
    port: int
    wildcard: bool = False

    def matches(self, host: str, port: int) -> bool:
        if port != self.port:
            return False
        if self.wildcard:
            return host.endswith("." + self.host)
        return host == self.host


def canonical_host(text: str) -> str:
    """A host as the rules compare it: an address in canonical form, else the name in
    lower case without a trailing dot.

    Raises:
        ValueError: neither an address nor a valid DNS name.
    """
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    address = as_address(bare)
    if address is not None:
        return str(address)
    name = text.lower().removesuffix(".")
    if len(name) > 253 or not _NAME.fullmatch(name):
        raise ValueError(f"{text!r} is not a host name or address")
    return name


def as_address(text: str) -> IPAddress | None:
    """``text`` as an IP address (an IPv4-mapped IPv6 one as IPv4), else None."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_destination(text: str) -> Destination:
    """An allow-list entry.

    Raises:
        ValueError: not ``host:port``, ``*.domain:port`` or ``address:port``.
    """
    match = _ENTRY.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not host:port, *.domain:port or [address]:port")
    port = int(match["port"])
    if not 0 < port < 65536:
        raise ValueError(f"{text!r}: port out of range")
    host = match["host"]
    wildcard = host.startswith("*.")
    canonical = canonical_host(host[2:] if wildcard else host)
    if wildcard and as_address(canonical) is not None:
        raise ValueError(f"{text!r}: a wildcard needs a domain name, not an address")
    return Destination(canonical, port, wildcard)


class NetworkAllow(BaseModel):
    """``network: {allow: [...]}`` in a manifest or in the policy's ``tools.NAME``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: list[str] = Field(max_length=MAX_ENTRIES)

    @field_validator("allow")
    @classmethod
    def _allow(cls, value: list[str]) -> list[str]:
        for entry in value:
            parse_destination(entry)
        return value

    def destinations(self) -> tuple[Destination, ...]:
        return tuple(parse_destination(entry) for entry in self.allow)


# IPv6 ranges that carry an IPv4 address in their last 32 bits: the well-known NAT64 prefix
# and the IPv4-compatible range. A gateway on the way turns them into that IPv4 address.
_IPV4_IN_LOW_BITS = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("::/96"))
# Never public, whatever the Python: local-use NAT64 (RFC 8215: where the IPv4 address sits
# depends on the network's own prefix), and the ranges whose ``is_global`` changed between
# Python releases (CPython gh-113171, in 3.11.10 and 3.12.4, and in distributions'
# backports such as Debian 12's 3.11.2) or are new to later ones (documentation 3fff::/20,
# SRv6 5f00::/16): special-purpose blocks nobody fetches from, Teredo (2001::/32) among
# them. So every interpreter allows the same destinations.
_NEVER_PUBLIC = (
    ipaddress.ip_network("64:ff9b:1::/48"),
    ipaddress.ip_network("192.0.0.0/24"),
    ipaddress.ip_network("2001::/23"),
    ipaddress.ip_network("3fff::/20"),
    ipaddress.ip_network("5f00::/16"),
)


def is_public(address: IPAddress) -> bool:
    """Globally routable unicast: not loopback, private, link-local, multicast, reserved;
    an IPv6 address that carries an IPv4 one (NAT64, 6to4, IPv4-compatible) exactly when
    that one is public (Pythons disagree on whether 2002::/16 is global)."""
    if any(address.version == network.version and address in network for network in _NEVER_PUBLIC):
        return False
    if isinstance(address, ipaddress.IPv6Address):
        carried = _carried_ipv4(address)
        if carried is not None:
            return is_public(carried)
    return address.is_global and not address.is_multicast


def _carried_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if any(address in network for network in _IPV4_IN_LOW_BITS):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


@dataclass(frozen=True)
class EgressRules:
    """The two lists a destination must both be in."""

    manifest: tuple[Destination, ...]
    policy: tuple[Destination, ...]

    def allows_name(self, host: str, port: int) -> bool:
        """Is ``host:port`` (canonical) in both lists?"""
        return _listed(self.manifest, host, port) and _listed(self.policy, host, port)

    def allows_address(self, address: IPAddress, port: int) -> bool:
        """May a name that resolved to ``address`` be connected to? Public addresses may;
        any other only when listed literally in both lists."""
        return is_public(address) or self.allows_name(str(address), port)


def _listed(destinations: tuple[Destination, ...], host: str, port: int) -> bool:
    return any(destination.matches(host, port) for destination in destinations)
