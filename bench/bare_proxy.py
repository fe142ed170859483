"""The floor under the gateway's text path: a proxy that makes only the hops the gateway
makes, with the gateway's own server and clients, and does nothing else.

    python -m bench.bare_proxy PORT UPSTREAM_URL [REDIS_URL [--admission-awaited]]  (the gateway's settings)

It is served as the gateway is (controlplane.serving: uvicorn with its header-timeout
protocol, one worker, a plain ASGI app) and forwards each POST's body to UPSTREAM_URL's
/v1/chat/completions with the gateway's engine client (controlplane.gateway.upstream: its
pooled aiohttp session, timeouts and buffers). With REDIS_URL it also makes the gateway's two
round trips to Redis, as the gateway makes them: one written before forwarding, its reply
awaited beside the engine's work and before the answer is relayed (the gateway admits and
journals the request), and one after the engine's answer, written before the answer leaves and
its reply awaited after (the gateway hands the usage over), each an EVALSHA of a script that
touches one key, through the client the gateway runs its scripts with (controlplane.redis_clients:
one connection the requests share, its timeouts): what those round trips cost whatever the
scripts do. No authentication, no
checks, no counting, no usage.

Without REDIS_URL it is a bare pass-through proxy; with it, the gateway's design with none of
its work: the gateway's added time less this one's is what the gateway's own work costs. With
--admission-awaited, the first round trip's reply is awaited before forwarding, as the gateway
did before its admissions ran beside the engine: what that saves.
"""

from __future__ import annotations

import asyncio
import sys

import django

# Settings are read only when a request is served, after django.setup() below.
from controlplane.gateway.upstream import Connections
from controlplane.redis_clients import async_redis, once_written, script_redis, until_written

_SCRIPT = "return redis.call('INCR', KEYS[1])"


class BareProxy:
    def __init__(self, upstream: str, redis_url: str | None, *, admission_awaited: bool = False):
        self.url = upstream.rstrip("/") + "/v1/chat/completions"
        self.redis_url, self.admission_awaited = redis_url, admission_awaited
        self.sha = None
        self.connections = Connections()

    async def _round_trip(self, written: asyncio.Future | None = None) -> None:
        if self.redis_url:
            if self.sha is None:
                self.sha = await async_redis(self.redis_url).script_load(_SCRIPT)
            with once_written(written, "EVALSHA"):
                await script_redis(self.redis_url).evalsha(self.sha, 1, "bench:bare-proxy")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        loop = asyncio.get_running_loop()
        admitted = loop.create_future()
        admitting = asyncio.ensure_future(self._round_trip(None if self.admission_awaited else admitted))
        await until_written(admitting, admitted)
        try:
            answer = await self.connections.engine_post(self.url, content=b"".join(chunks),
                                                headers={"content-type": "application/json"})
        finally:
            await admitting  # as the gateway: the answer is taken once the admission has its reply
        try:
            status, body = answer.status_code, await answer.read()
        finally:
            await answer.aclose()
        written = loop.create_future()
        handing = asyncio.ensure_future(self._round_trip(written))
        await until_written(handing, written)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        await handing


if __name__ == "__main__":
    django.setup()  # the gateway's settings: its clients' bounds, the server's header timeout
    from controlplane.serving import serve

    port, upstream_url = int(sys.argv[1]), sys.argv[2]
    serve(BareProxy(upstream_url, sys.argv[3] if len(sys.argv) > 3 else None,
                    admission_awaited="--admission-awaited" in sys.argv),
          host="127.0.0.1", port=port, log_level="warning")
