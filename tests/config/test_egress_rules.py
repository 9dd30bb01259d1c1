"""Allow-list entries, matching, address classes and proxy request heads (no network)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from conftest import write_tool

from runner.call.egress import EgressRefused, parse_head
from runner.config.egress import EgressRules, is_public, parse_destination
from runner.tools.manifest import ManifestError, load_tool


def rules(*entries: str) -> EgressRules:
    parsed = tuple(parse_destination(entry) for entry in entries)
    return EgressRules(parsed, parsed)


@pytest.mark.parametrize(
    "entry",
    [
        "example.com",
        "example.com:0",
        "example.com:70000",
        "*.10.0.0.1:80",
        "exa mple.com:80",
        "[zz]:80",
        ":80",
    ],
)
def test_a_malformed_allow_entry_is_rejected(entry: str) -> None:
    with pytest.raises(ValueError):
        parse_destination(entry)


def test_a_wildcard_matches_names_below_its_domain_only() -> None:
    allowed = rules("*.example.com:443")
    assert allowed.allows_name("api.example.com", 443)
    assert allowed.allows_name("a.b.example.com", 443)
    assert not allowed.allows_name("example.com", 443)
    assert not allowed.allows_name("evilexample.com", 443)
    assert not allowed.allows_name("api.example.com", 80)


def test_both_lists_must_allow_a_destination() -> None:
    both = EgressRules((parse_destination("a.example:443"),), (parse_destination("b.example:443"),))
    assert not both.allows_name("a.example", 443)
    assert not both.allows_name("b.example", 443)


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.1.2.3", "192.168.1.1", "169.254.169.254", "::1", "fe80::1", "fd00::2", "0.0.0.0"],
)
def test_a_name_resolving_to_a_non_public_address_is_refused_unless_listed_literally(address: str) -> None:
    parsed = ipaddress.ip_address(address)
    assert not rules("service.example:80").allows_address(parsed, 80)
    literal = f"[{address}]:80" if ":" in address else f"{address}:80"
    assert rules("service.example:80", literal).allows_address(parsed, 80)


def test_an_ipv4_mapped_address_is_judged_as_its_ipv4_address() -> None:
    mapped = parse_destination("[::ffff:127.0.0.1]:80")
    assert mapped.host == "127.0.0.1"


def test_a_public_address_is_allowed_for_a_listed_name() -> None:
    assert rules("service.example:443").allows_address(ipaddress.ip_address("93.184.216.34"), 443)


def test_an_http_request_is_rewritten_to_its_origin_with_its_own_host() -> None:
    head = (
        b"GET http://api.example:8080/v1?q=1 HTTP/1.1\r\nHost: evil.example\r\n"
        b"Proxy-Authorization: x\r\nAccept: */*\r\n\r\n"
    )
    request = parse_head(head)
    assert (request.method, request.host, request.port) == ("GET", "api.example", 8080)
    assert request.forward == (
        b"GET /v1?q=1 HTTP/1.1\r\nAccept: */*\r\nHost: api.example:8080\r\nConnection: close\r\n\r\n"
    )


def test_connect_names_host_and_port() -> None:
    request = parse_head(b"CONNECT [::1]:443 HTTP/1.1\r\n\r\n")
    assert (request.method, request.host, request.port, request.forward) == ("CONNECT", "::1", 443, b"")


@pytest.mark.parametrize(
    "head",
    [
        b"GET https://api.example/ HTTP/1.1\r\n\r\n",  # TLS goes through CONNECT
        b"GET /relative HTTP/1.1\r\n\r\n",
        b"CONNECT api.example HTTP/1.1\r\n\r\n",
        b"CONNECT api.example:99999 HTTP/1.1\r\n\r\n",
        b"GET http://user:pw@api.example/ HTTP/1.1\r\n\r\n",
        b"\x00\x01\x02 garbage\r\n\r\n",
        b"GET http://api.example/ HTTP/2\r\n\r\n",
    ],
)
def test_anything_but_connect_or_an_absolute_http_url_is_a_bad_request(head: bytes) -> None:
    with pytest.raises(EgressRefused) as refused:
        parse_head(head)
    assert refused.value.reason == "bad_request"


@pytest.mark.parametrize("env", [{"HTTP_PROXY": "http://evil"}, {"https_proxy": "http://evil"}])
def test_a_manifest_cannot_set_the_proxy_variables(tmp_path: Path, env: dict[str, str]) -> None:
    folder = write_tool(tmp_path, "fetch", "", env=env, network={"allow": ["api.example:443"]})
    with pytest.raises(ManifestError):
        load_tool(folder)


def test_a_manifest_with_a_bad_allow_entry_is_invalid(tmp_path: Path) -> None:
    folder = write_tool(tmp_path, "fetch", "", network={"allow": ["no-port.example"]})
    with pytest.raises(ManifestError, match="network"):
        load_tool(folder)


@pytest.mark.parametrize(
    "text",
    [
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "64:ff9b::a00:5",  # NAT64 of 10.0.0.5
        "64:ff9b:1::1",  # local-use NAT64
        "2002:7f00:1::1",  # 6to4 of 127.0.0.1
        "2002:c0a8:101::1",  # 6to4 of 192.168.1.1
    ],
)
def test_an_ipv6_address_that_leads_to_a_private_ipv4_one_is_not_public(text: str) -> None:
    assert not is_public(ipaddress.ip_address(text))


# Addresses whose ``is_global`` differs between Pythons (CPython gh-113171: fixed in 3.11.10
# and 3.12.4, backported to Debian 12's 3.11.2, not in 3.11.7): the runner decides them.
ADDRESSES_PYTHONS_DISAGREE_ON = {
    "192.0.0.8": False,
    "192.0.0.9": False,
    "2001:1::1": False,
    "2001:4:112::1": False,
    "2001:20::1": False,
    "3fff::1": False,
    "5f00::1": False,
    "2002:808:808::1": True,  # 6to4 of 8.8.8.8: decided by the address it carries
    "2002:a00:1::1": False,  # 6to4 of 10.0.0.1
}


def test_addresses_pythons_disagree_on_are_judged_the_same_on_every_python() -> None:
    judged = {text: is_public(ipaddress.ip_address(text)) for text in ADDRESSES_PYTHONS_DISAGREE_ON}
    assert judged == ADDRESSES_PYTHONS_DISAGREE_ON


def test_an_ipv6_address_that_leads_to_a_public_ipv4_one_is_public() -> None:
    assert is_public(ipaddress.ip_address("64:ff9b::808:808"))  # NAT64 of 8.8.8.8
    assert is_public(ipaddress.ip_address("2606:4700:4700::1111"))
