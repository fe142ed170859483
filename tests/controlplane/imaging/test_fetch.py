"""SSRF-safe image fetching, against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import http.server
import ipaddress
import threading
import time

import pytest

from controlplane.imaging.errors import ImageTooLarge
from controlplane.imaging.fetch import (
    FetchFailed,
    FetchPolicy,
    UnsafeURL,
    fetch_image_bytes,
    vet_url,
)
from tests.images import image_bytes

PNG = image_bytes(40, 30, "PNG")
PUBLIC = {"example.com": ["93.184.215.14"], "cdn.example.com": ["93.184.215.15"],
          "v6.example.com": ["2606:2800:21f:cb07:6820:80da:af6b:8b2c"],
          "rebind.example.com": ["93.184.215.14", "127.0.0.1"], "localhost": ["127.0.0.1", "::1"],
          "metadata.example.com": ["169.254.169.254"], "intranet.example.com": ["10.1.2.3"]}


def resolver(host, port):
    return PUBLIC.get(host, ["127.0.0.1"] if host.endswith("images.test") else [])


class Handler(http.server.BaseHTTPRequestHandler):
    seen_hosts: list[str] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        Handler.seen_hosts.append(self.headers.get("Host"))
        port = self.server.server_address[1]
        routes = {
            "/cat.png": (200, {"Content-Type": "image/png"}, PNG),
            "/page": (200, {"Content-Type": "text/html"}, b"<html></html>"),
            "/declared-huge": (200, {"Content-Type": "image/png", "Content-Length": str(10**9)}, b""),
            "/to-cat": (302, {"Location": "/cat.png"}, b""),
            "/to-loopback": (302, {"Location": f"http://127.0.0.2:{port}/cat.png"}, b""),
            "/to-metadata": (301, {"Location": "http://169.254.169.254/latest/meta-data/"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
            "/missing": (404, {"Content-Type": "text/plain"}, b"no"),
        }
        if self.path == "/endless":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(10_000):
                    self.wfile.write(b"\0" * 65536)
            except OSError:
                pass
            return
        if self.path == "/slow":
            time.sleep(1.5)
        status, headers, body = routes.get(self.path, (200, {"Content-Type": "image/png"}, PNG))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:  # the client gave up, as it should on oversized bodies
            pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()


def trusted(**overrides):
    return FetchPolicy(trusted_networks=("127.0.0.1/32",), **overrides)


def fetch(port, path, policy=None):
    return fetch_image_bytes(f"http://images.test:{port}{path}", policy or trusted(), resolver=resolver)


def test_it_fetches_from_the_vetted_address_with_the_original_host(server):
    Handler.seen_hosts.clear()
    assert fetch(server, "/cat.png") == PNG
    # images.test resolves nowhere but in our resolver: reaching the server proves the
    # connection went to the vetted address, with no second lookup.
    assert Handler.seen_hosts == [f"images.test:{server}"]


def test_redirects_are_followed_and_each_hop_is_vetted(server):
    assert fetch(server, "/to-cat") == PNG
    with pytest.raises(UnsafeURL, match="127.0.0.2"):
        fetch(server, "/to-loopback")
    with pytest.raises(UnsafeURL, match="metadata"):
        fetch(server, "/to-metadata")
    with pytest.raises(FetchFailed, match="redirected more than"):
        fetch(server, "/loop")
    with pytest.raises(FetchFailed, match="redirected more than 0 times"):  # redirects off
        fetch(server, "/to-cat", trusted(max_redirects=0))


def test_size_time_and_content_type_are_capped(server):
    with pytest.raises(ImageTooLarge):
        fetch(server, "/declared-huge")
    started = time.monotonic()
    with pytest.raises(ImageTooLarge):
        fetch(server, "/endless", trusted(max_bytes=1_000_000))
    assert time.monotonic() - started < 5
    with pytest.raises(FetchFailed, match="longer than"):
        fetch(server, "/slow", trusted(timeout_s=0.5))
    with pytest.raises(FetchFailed, match="content type 'text/html'"):
        fetch(server, "/page")
    with pytest.raises(FetchFailed, match="HTTP 404"):
        fetch(server, "/missing")


def test_loopback_is_refused_unless_an_operator_trusts_it(server):
    with pytest.raises(UnsafeURL, match="loopback"):
        fetch_image_bytes(f"http://images.test:{server}/cat.png", FetchPolicy(), resolver=resolver)


@pytest.mark.parametrize("url, reason", [
    ("file:///etc/passwd", "scheme"),
    ("gopher://example.com/", "scheme"),
    ("ftp://example.com/a.png", "scheme"),
    ("//example.com/a.png", "scheme"),
    ("http://2130706433/", "non-canonical"),
    ("http://0177.0.0.1/", "non-canonical"),
    ("http://0x7f.0.0.1/", "non-canonical"),
    ("http://0x7f000001/", "non-canonical"),
    ("http://127.1/", "non-canonical"),
    ("http://127.0.0.1/", "loopback"),
    ("http://[::1]/", "loopback"),
    ("http://[::ffff:127.0.0.1]/", "IPv4-mapped"),
    ("http://[::ffff:169.254.169.254]/", "metadata|IPv4-mapped"),
    ("http://[::127.0.0.1]/", "loopback"),
    ("http://[64:ff9b::a00:1]/", "private"),
    ("http://[2002:a00:1::]/", "6to4"),
    ("http://0.0.0.0/", "unspecified"),
    ("http://10.0.0.1/", "private"),
    ("http://172.16.5.4/", "private"),
    ("http://192.168.1.1/", "private"),
    ("http://100.64.0.1/", "carrier-grade NAT"),
    ("http://169.254.169.254/latest/meta-data/", "metadata"),
    ("http://[fd00:ec2::254]/", "metadata"),
    ("http://100.100.100.200/", "metadata"),
    ("http://224.0.0.1/", "multicast"),
    ("http://[fe80::1]/", "link-local"),
    ("http://localhost/", "loopback"),
    ("http://rebind.example.com/", "127.0.0.1"),
    ("http://metadata.example.com/", "metadata"),
    ("http://intranet.example.com/", "private"),
    ("http://example.com\\@127.0.0.1/", "backslash"),
    ("http://127.0.0.1\\@example.com/", "backslash"),
    ("http://example.com@127.0.0.1/", "user name"),
    ("http://user:secret@example.com/", "user name"),
    ("http://example.com%2f@127.0.0.1/", "user name"),
    ("http://exa mple.com/", "white space"),
    ("http://example.com/\r\nHost: evil", "control"),
    ("http:///a.png", "no host"),
    ("http://example.com:99999/", "malformed"),
])
def test_hostile_urls_are_refused(url, reason):
    with pytest.raises((UnsafeURL, FetchFailed), match=reason):
        vet_url(url, FetchPolicy(), resolver)


def test_public_hosts_pass_and_keep_their_name_for_sni():
    target = vet_url("https://Example.COM./img.png?x=1", FetchPolicy(), resolver)
    assert (target.host, target.address, target.port, target.path) == (
        "example.com", "93.184.215.14", 443, "/img.png?x=1")
    assert vet_url("http://v6.example.com/", FetchPolicy(), resolver).address.startswith("2606:")


def test_a_fragment_is_not_part_of_the_host():
    target = vet_url("http://example.com#@127.0.0.1/", FetchPolicy(), resolver)
    assert (target.host, target.address, target.path) == ("example.com", "93.184.215.14", "/")


def test_a_domain_allowlist_limits_hosts():
    policy = FetchPolicy(allowed_domains=("example.com", "*.cdn.example.com"))
    assert vet_url("http://example.com/a.png", policy, resolver)
    with pytest.raises(UnsafeURL, match="allowed domains"):
        vet_url("http://cdn.example.com/a.png", policy, resolver)
    with pytest.raises(UnsafeURL, match="allowed domains"):
        vet_url("http://evil-example.com/a.png", policy, resolver)
    assert vet_url("http://img.cdn.example.com/a.png",
                   FetchPolicy(allowed_domains=("*.cdn.example.com",)),
                   lambda h, p: ["93.184.215.16"])


@pytest.mark.parametrize("url, reason", [
    ("http://[::ffff:127.0.0.1]/", "IPv4-mapped IPv6 address of 127.0.0.1, a loopback"),
    ("http://[::ffff:0:7f00:1]/", "IPv4-translated IPv6 address of 127.0.0.1, a loopback"),
    ("http://[::ffff:0:a9fe:a9fe]/", "169.254.169.254, a cloud metadata"),
    ("http://[::ffff:0:a00:1]/", "10.0.0.1, a private"),
    ("http://[::10.0.0.1]/", "IPv4-compatible IPv6 address of 10.0.0.1, a private"),
    ("http://[2002:7f00:1::1]/", "6to4 IPv6 address of 127.0.0.1, a loopback"),
    ("http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/", "Teredo IPv6 address of 127.0.0.1, a loopback"),
    ("http://[64:ff9b::a9fe:a9fe]/", "NAT64 IPv6 address of 169.254.169.254"),
    ("http://[64:ff9b:1::7f00:1]/", "NAT64 IPv6 address of"),
    ("http://[64:ff9b:1:808:8:800::]/", "NAT64 IPv6 address of"),  # 8.8.8.8 at /48, not at /96
])
def test_ipv6_forms_of_an_unsafe_ipv4_address_are_refused(url, reason):
    with pytest.raises(UnsafeURL, match=reason):
        vet_url(url, FetchPolicy(), resolver)


@pytest.mark.parametrize("address", [
    "::ffff:8.8.8.8", "::ffff:0:808:808", "::8.8.8.8", "2002:808:808::1",
    "2001:0:4136:e378:8000:63bf:f7f7:f7f7", "64:ff9b::808:808",
])
def test_ipv6_forms_of_a_public_ipv4_address_pass(address):
    vetted = vet_url(f"http://[{address}]/", FetchPolicy(), resolver).address
    assert ipaddress.ip_address(vetted) == ipaddress.ip_address(address)


def test_ipv6_forms_of_a_trusted_ipv4_address_pass_as_the_address_itself_would():
    policy = FetchPolicy(trusted_networks=("10.0.0.0/8",))
    assert vet_url("http://[::ffff:0:a00:1]/", policy, resolver)
    assert vet_url("http://[::ffff:10.0.0.1]/", policy, resolver)
    with pytest.raises(UnsafeURL, match="192.168.0.1, a private"):
        vet_url("http://[::ffff:0:c0a8:1]/", policy, resolver)
