"""Calling the URLs operators set: alert webhooks, external engines, benchmark targets and the
moderation endpoint. They are vetted as image URLs are (controlplane/imaging/fetch.py): when
saved, and again at each request, which goes to the address just vetted (DNS asked twice
could answer differently the second time) and follows no redirect. Private networks are
reached only when OPERATOR_URL_TRUSTED_NETWORKS names them. Pure Python and httpx: the load
generator, which has no Django, sends through it too; the settings are read by the callers.
"""

from __future__ import annotations

import asyncio

import httpx

from controlplane.imaging.fetch import (
    FetchFailed,
    FetchPolicy,
    Resolver,
    Target,
    UnsafeURL,
    system_resolver,
    vet_url,
)


class RefusedTarget(httpx.RequestError):
    """Not sent: the URL is not one this process may call (not worth trying again as it is)."""


def vet(url: str, *, trusted_networks: tuple[str, ...] | list[str], what: str = "URL",
        resolver: Resolver = system_resolver) -> Target:
    """`url` checked and resolved to one address; UnsafeURL, or FetchFailed when its host
    does not resolve. Credentials in the URL are refused: none of these targets takes them."""
    return vet_url(url, FetchPolicy(trusted_networks=tuple(trusted_networks)), resolver, what=what)


def url_refusal(url: str, *, trusted_networks, what: str = "URL", resolver: Resolver = system_resolver) -> str | None:
    """Why `url` may not be saved as a target, or None. A name that does not resolve now
    passes: it reaches nothing, and each request is vetted again."""
    try:
        vet(url, trusted_networks=trusted_networks, what=what, resolver=resolver)
    except UnsafeURL as exc:
        return str(exc)
    except FetchFailed:
        pass
    return None


def _pin(request: httpx.Request, target: Target) -> None:
    # The Host header was set from the URL when the request was built and stays; TLS is
    # sent the name as SNI and checks the certificate against it.
    request.url = request.url.copy_with(host=target.address)
    if target.scheme == "https":
        request.extensions = {**request.extensions, "sni_hostname": target.host}


def _vetted(request: httpx.Request, trusted_networks: tuple[str, ...], what: str, resolver: Resolver) -> Target:
    try:
        return vet(str(request.url), trusted_networks=trusted_networks, what=what, resolver=resolver)
    except UnsafeURL as exc:
        raise RefusedTarget(str(exc), request=request) from None
    except FetchFailed as exc:  # DNS may answer again: as a failed connection would be
        raise httpx.ConnectError(str(exc), request=request) from None


class VettingTransport(httpx.HTTPTransport):
    """Vets each request's URL, then connects to the address it was vetted at."""

    def __init__(self, *, trusted_networks=(), what: str = "URL", resolver: Resolver = system_resolver, **kwargs):
        super().__init__(trust_env=False, **kwargs)
        self.trusted_networks, self.what, self.resolver = tuple(trusted_networks), what, resolver

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        _pin(request, _vetted(request, self.trusted_networks, self.what, self.resolver))
        return super().handle_request(request)


class AsyncVettingTransport(httpx.AsyncHTTPTransport):
    """VettingTransport for asyncio: the lookup runs on a thread, off the event loop."""

    def __init__(self, *, trusted_networks=(), what: str = "URL", resolver: Resolver = system_resolver, **kwargs):
        super().__init__(trust_env=False, **kwargs)
        self.trusted_networks, self.what, self.resolver = tuple(trusted_networks), what, resolver

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        target = await asyncio.to_thread(_vetted, request, self.trusted_networks, self.what, self.resolver)
        _pin(request, target)
        return await super().handle_async_request(request)


class AsyncPinnedTransport(httpx.AsyncHTTPTransport):
    """Sends every request for `target`'s host and port to the address it was vetted at, once
    (a load test's requests are not slowed by a lookup each); refuses any other host."""

    def __init__(self, target: Target, **kwargs):
        super().__init__(trust_env=False, **kwargs)
        self.target = target

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        host = url.raw_host.decode("ascii").lower()
        if (url.scheme, host, url.port or (443 if url.scheme == "https" else 80)) != (
                self.target.scheme, self.target.host, self.target.port):
            raise RefusedTarget(f"{host} is not the host this client was vetted for", request=request)
        _pin(request, self.target)
        return await super().handle_async_request(request)


def client(*, trusted_networks, what: str = "URL", resolver: Resolver = system_resolver, **kwargs) -> httpx.Client:
    """An httpx client that vets every request and follows no redirect."""
    transport = VettingTransport(trusted_networks=trusted_networks, what=what, resolver=resolver)
    return httpx.Client(transport=transport, follow_redirects=False, trust_env=False, **kwargs)


def async_client(*, trusted_networks, what: str = "URL", resolver: Resolver = system_resolver,
                 limits: httpx.Limits | None = None, **kwargs) -> httpx.AsyncClient:
    """An httpx.AsyncClient that vets every request and follows no redirect."""
    transport = AsyncVettingTransport(trusted_networks=trusted_networks, what=what, resolver=resolver,
                                      **({"limits": limits} if limits else {}))
    return httpx.AsyncClient(transport=transport, follow_redirects=False, trust_env=False, **kwargs)
