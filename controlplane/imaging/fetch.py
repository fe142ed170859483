"""Fetching an image by URL without letting the URL reach anything it should not (SSRF).

The rules, each because of an attack seen in the field (vLLM CVE-2025-6242 and the
backslash-before-@ parser differentials of CVE-2026-24779 / CVE-2026-25960):
- http and https only; no userinfo, no backslashes, no control characters or spaces;
- the host is resolved once, every A and AAAA record is vetted, and any address that is not
  plainly public (loopback, private, link-local, multicast, reserved, unspecified, CGNAT,
  cloud metadata) refuses the whole URL; an IPv6 address that carries an IPv4 one (mapped,
  translated, compatible, 6to4, Teredo, NAT64) is judged by the IPv4 address it reaches;
- the connection goes to the vetted address itself (no second lookup that DNS rebinding
  could answer differently), with the original host name in Host and in TLS SNI;
- redirects are followed only up to a small number of hops, each hop vetted again;
- caps on bytes, on time and on the content type.
Pure Python: no Django, no Celery.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

import httpx

from controlplane.imaging.errors import ImageError, ImageTooLarge


class UnsafeURL(ImageError):
    code = "unsafe_image_url"


class FetchFailed(ImageError):
    code = "image_fetch_failed"


# Addresses cloud providers serve instance credentials from. Most are link-local or private
# anyway; listing them keeps the refusal explicit even if a range check changed.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "169.254.169.123", "100.100.100.200", "192.0.0.192",
    "fd00:ec2::254", "fd00:ec2::23",
))
_BLOCKED_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
    "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32",
    "::/96",  # IPv4-compatible (deprecated) and the unspecified/loopback addresses
    "::ffff:0:0/96",  # IPv4-mapped
    "64:ff9b::/96", "64:ff9b:1::/48",  # NAT64
    "100::/64", "2001::/32", "2001:db8::/32", "2002::/16",  # discard, Teredo, docs, 6to4
    "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8",
))
_HOST_CHARS = re.compile(r"^[A-Za-z0-9.\-]+$")
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$", re.IGNORECASE)


_CGNAT = ipaddress.ip_network("100.64.0.0/10")


def _kind(address) -> str:
    if address.is_unspecified:
        return "an unspecified"
    if address.is_loopback:
        return "a loopback"
    if address.is_link_local:
        return "a link-local"
    if address.is_multicast:
        return "a multicast"
    if address.version == 4 and address in _CGNAT:
        return "a carrier-grade NAT"
    if address.is_private:
        return "a private"
    return "a reserved or special-purpose"


def address_problem(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why `address` must not be fetched from, or None when it is a plain public address."""
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    for network in _BLOCKED_NETWORKS:
        if address.version == network.version and address in network:
            return f"{_kind(address)} address"
    if not address.is_global:
        return "not a public address"
    return None


_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")
_COMPATIBLE = ipaddress.ip_network("::/96")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")


def _ipv4(bits: int) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(bits & 0xFFFFFFFF)


def _local_nat64_readings(n: int) -> tuple[ipaddress.IPv4Address, ...]:
    # RFC 6052 places the IPv4 address by prefix length (skipping bits 64-71), and a network
    # in 64:ff9b:1::/48 picks its own length: every reading must be safe, as we cannot tell.
    return (_ipv4((n >> 64 & 0xFFFF) << 16 | n >> 40 & 0xFFFF),  # /48
            _ipv4((n >> 64 & 0xFF) << 24 | n >> 32 & 0xFFFFFF),  # /56
            _ipv4(n >> 24), _ipv4(n))  # /64, /96


def embedded_ipv4(address: ipaddress.IPv6Address) -> tuple[str, tuple[ipaddress.IPv4Address, ...]] | None:
    """The IPv6 form that carries an IPv4 address, and the address(es) it reaches; None for
    an IPv6 address that embeds none."""
    n = int(address)
    if address.ipv4_mapped is not None:
        return "an IPv4-mapped", (address.ipv4_mapped,)
    if address in _TRANSLATED:
        return "an IPv4-translated", (_ipv4(n),)
    if address in _COMPATIBLE and not (address.is_loopback or address.is_unspecified):
        return "an IPv4-compatible", (_ipv4(n),)
    if address.sixtofour is not None:
        return "a 6to4", (address.sixtofour,)
    if address.teredo is not None:
        return "a Teredo", address.teredo  # its server and its client
    if address in _NAT64:
        return "a NAT64", (_ipv4(n),)
    if address in _LOCAL_NAT64:
        return "a NAT64", _local_nat64_readings(n)
    return None


@dataclass(frozen=True)
class FetchPolicy:
    max_bytes: int = 20 * 1024 * 1024
    timeout_s: float = 10.0
    max_redirects: int = 3
    allowed_domains: tuple[str, ...] = ()  # empty: any public host; "*.example.com" for subdomains
    content_types: tuple[str, ...] = ("image/",)
    # Networks an operator trusts despite being private (an internal image store, say).
    trusted_networks: tuple[str, ...] = ()
    user_agent: str = "vlm-gateway/1 (+image fetch)"
    _trusted: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_trusted", tuple(ipaddress.ip_network(n) for n in self.trusted_networks))

    def trusts(self, address) -> bool:
        return any(address.version == n.version and address in n for n in self._trusted)


def address_refusal(address: ipaddress.IPv4Address | ipaddress.IPv6Address, policy: FetchPolicy) -> str | None:
    """Why `policy` refuses `address`, or None. An IPv6 address that carries an IPv4 one is
    judged by the IPv4 address it reaches, as that address itself would be."""
    if policy.trusts(address):
        return None
    embedded = embedded_ipv4(address) if address.version == 6 else None
    if embedded is None:
        return address_problem(address)
    form, inner = embedded
    for ipv4 in inner:
        problem = address_problem(ipv4)
        if problem and not policy.trusts(ipv4):
            return f"{form} IPv6 address of {ipv4}, {problem}"
    return None


Resolver = Callable[[str, int], Iterable[str]]


def system_resolver(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise FetchFailed(f"host {host!r} does not resolve: {exc}") from None
    return sorted({info[4][0] for info in infos})


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # IDNA-encoded, lower case
    port: int
    path: str  # path and query
    address: str  # the vetted address to connect to


def _host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    for rule in allowed:
        rule = rule.lower().rstrip(".")
        if rule.startswith("*."):
            if host.endswith(rule[1:]):
                return True
        elif host == rule:
            return True
    return False


def vet_url(url: str, policy: FetchPolicy, resolver: Resolver = system_resolver, *,
            what: str = "image URL") -> Target:
    """Check `url` and resolve it to one vetted address, or raise UnsafeURL (its messages
    call the URL `what`)."""
    if not isinstance(url, str) or len(url) > 4096:
        raise UnsafeURL(f"{what} must be a string of at most 4096 characters")
    if any(c in url for c in "\\\t\r\n ") or any(ord(c) < 0x20 or ord(c) == 0x7f for c in url):
        raise UnsafeURL(f"{what} contains a backslash, white space or a control character")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UnsafeURL(f"{what} is malformed: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise UnsafeURL(f"{what} scheme {parts.scheme or '(none)'!r} is not allowed; use http or https")
    if "@" in parts.netloc or parts.username is not None or parts.password is not None:
        raise UnsafeURL(f"{what} must not contain a user name or password")
    raw_host = parts.hostname or ""
    if not raw_host:
        raise UnsafeURL(f"{what} has no host")
    literal = None
    try:
        literal = ipaddress.ip_address(raw_host)
    except ValueError:
        pass
    if literal is None:
        if _NUMERIC_LABEL.match(raw_host.rstrip(".").rsplit(".", 1)[-1]):
            # 2130706433, 0177.0.0.1, 0x7f.1, 127.1: no top-level domain is a number, and C
            # resolvers read these forms as IPv4 addresses.
            raise UnsafeURL(f"{what} host {raw_host!r} is a non-canonical IP address")
        try:
            host = raw_host.encode("idna").decode("ascii").lower().rstrip(".")
        except UnicodeError:
            raise UnsafeURL(f"{what} host {raw_host!r} is not a valid host name") from None
        if not _HOST_CHARS.match(host) or ".." in host:
            raise UnsafeURL(f"{what} host {raw_host!r} is not a valid host name")
    else:
        host = literal.compressed
    if policy.allowed_domains and not _host_allowed(host, policy.allowed_domains):
        raise UnsafeURL(f"{what} host {host!r} is not on this model's list of allowed domains")
    port = port or (443 if scheme == "https" else 80)
    addresses = [literal.compressed] if literal is not None else list(resolver(host, port))
    if not addresses:
        raise FetchFailed(f"{what} host {host!r} has no address")
    for text in addresses:
        address = ipaddress.ip_address(text.split("%", 1)[0])
        problem = address_refusal(address, policy)
        if problem:
            raise UnsafeURL(f"{what} host {host!r} resolves to {address}, {problem}")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(scheme=scheme, host=host, port=port, path=path, address=addresses[0])


def _request_url(target: Target) -> str:
    address = ipaddress.ip_address(target.address)
    shown = f"[{address.compressed}]" if address.version == 6 else address.compressed
    return f"{target.scheme}://{shown}:{target.port}{target.path}"


def fetch_image_bytes(url: str, policy: FetchPolicy, *, resolver: Resolver = system_resolver,
                      client: httpx.Client | None = None) -> bytes:
    """Download an image from `url` under `policy`. Raises UnsafeURL, FetchFailed, ImageTooLarge."""
    deadline = time.monotonic() + policy.timeout_s
    own = client is None
    client = client or httpx.Client(follow_redirects=False, trust_env=False)
    try:
        for _hop in range(policy.max_redirects + 1):
            target = vet_url(url, policy, resolver)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FetchFailed(f"fetching the image took longer than {policy.timeout_s:g}s")
            host_header = target.host if target.port in (80, 443) else f"{target.host}:{target.port}"
            request = client.build_request(
                "GET", _request_url(target),
                headers={"Host": host_header, "User-Agent": policy.user_agent, "Accept": "image/*"},
                timeout=httpx.Timeout(remaining),
                extensions={"sni_hostname": target.host} if target.scheme == "https" else {},
            )
            try:
                response = client.send(request, stream=True)
            except httpx.TimeoutException:
                raise FetchFailed(f"fetching the image took longer than {policy.timeout_s:g}s") from None
            except httpx.HTTPError as exc:
                raise FetchFailed(f"could not fetch the image: {exc}") from None
            try:
                if response.is_redirect:
                    location = response.headers.get("location")
                    if not location:
                        raise FetchFailed("image URL redirected without a location")
                    url = urljoin(url, location)
                    continue
                return _read_body(response, policy, deadline)
            finally:
                response.close()
        raise FetchFailed(f"image URL redirected more than {policy.max_redirects} times")
    finally:
        if own:
            client.close()


def _read_body(response: httpx.Response, policy: FetchPolicy, deadline: float) -> bytes:
    if response.status_code != 200:
        raise FetchFailed(f"image URL answered HTTP {response.status_code}")
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if not any(content_type.startswith(allowed) for allowed in policy.content_types):
        raise FetchFailed(f"image URL returned content type {content_type or '(none)'!r}, not an image")
    declared = response.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > policy.max_bytes:
        raise ImageTooLarge(f"image at URL is {declared} bytes; at most {policy.max_bytes} are accepted")
    chunks, size = [], 0
    try:
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > policy.max_bytes:
                raise ImageTooLarge(f"image at URL exceeds {policy.max_bytes} bytes")
            if time.monotonic() > deadline:
                raise FetchFailed(f"fetching the image took longer than {policy.timeout_s:g}s")
            chunks.append(chunk)
    except httpx.TimeoutException:
        raise FetchFailed(f"fetching the image took longer than {policy.timeout_s:g}s") from None
    except httpx.HTTPError as exc:
        raise FetchFailed(f"could not fetch the image: {exc}") from None
    return b"".join(chunks)
