"""The floor under the gateway's text path: a proxy that makes only the hops the gateway
makes, on the same libraries, and does nothing else.

    python -m bench.bare_proxy PORT UPSTREAM_URL [REDIS_URL]

It is served as the gateway is (uvicorn with httptools on uvloop, one worker, a plain ASGI
app) and forwards each POST's body to UPSTREAM_URL's /v1/chat/completions through a pooled
aiohttp session, as the gateway forwards to an engine. With REDIS_URL it also makes the
gateway's two round trips to Redis, one before forwarding and one after the answer (the
gateway admits and journals the request, then hands its usage over), each an EVALSHA of a
script that touches one key, through redis-py's asyncio client: what those round trips cost
whatever the scripts do. No authentication, no checks, no counting, no usage.

Without REDIS_URL it is a bare pass-through proxy; with it, the gateway's design with none of
its work: the gateway's added time less this one's is what the gateway's own work costs.
"""

from __future__ import annotations

import sys

import aiohttp
import redis.asyncio
import uvicorn

_SCRIPT = "return redis.call('INCR', KEYS[1])"


class BareProxy:
    def __init__(self, upstream: str, redis_url: str | None):
        self.url = upstream.rstrip("/") + "/v1/chat/completions"
        self.redis_url = redis_url
        self.session = self.redis = self.sha = None

    async def _start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512, limit_per_host=0),
                                             auto_decompress=False, skip_auto_headers=("User-Agent",))
        if self.redis_url:
            self.redis = redis.asyncio.Redis.from_url(self.redis_url)
            self.sha = await self.redis.script_load(_SCRIPT)

    async def _round_trip(self) -> None:
        if self.redis is not None:
            await self.redis.evalsha(self.sha, 1, "bench:bare-proxy")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                if message["type"] == "lifespan.startup":
                    await self._start()
                    await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
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
        await self._round_trip()
        async with self.session.post(self.url, data=b"".join(chunks),
                                     headers={"content-type": "application/json"}) as answer:
            status, body = answer.status, await answer.read()
        await self._round_trip()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    port, upstream = int(sys.argv[1]), sys.argv[2]
    app = BareProxy(upstream, sys.argv[3] if len(sys.argv) > 3 else None)
    uvicorn.run(app, host="127.0.0.1", port=port, http="httptools", loop="uvloop", workers=1,
                log_level="warning", lifespan="on")
