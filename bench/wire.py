"""HTTP/1.1 over asyncio streams, as lean as a measurement needs: a closed-loop sender and a
server, each a few microseconds of CPU per request, so that what a benchmark measures is the
program under test and not its load generator or its stand-in upstream (httpx as a sender,
uvicorn as the upstream, each cost more CPU per request than the gateway does on text).

Only what the benchmarks send and answer: requests with a Content-Length, keep-alive
connections, responses with a Content-Length or chunked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length, chunked = None, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return status, b"".join(parts)
            parts.append(await reader.readexactly(size + 2))
    return status, await reader.readexactly(length or 0)


def _request(url: str, headers: dict, body: bytes) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    head = [f"POST {parts.path or '/'} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {len(body)}",
            "Connection: keep-alive", *(f"{name}: {value}" for name, value in headers.items())]
    return parts.hostname, parts.port or 80, ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def send(url: str, headers: dict, requests: list[bytes], concurrency: int) -> tuple[list[float], float]:
    """Latencies of `requests` (JSON bodies) POSTed `concurrency` at a time over keep-alive
    connections, closed loop, and the seconds all took. A response other than 200 raises."""
    headers = {**headers, "Content-Type": "application/json"}
    prepared = [_request(url, headers, body) for body in requests]
    host, port = prepared[0][0], prepared[0][1]
    queue = iter(prepared)
    latencies: list[float] = []

    async def worker():
        reader, writer = await asyncio.open_connection(host, port)
        try:
            for _, _, raw in queue:
                started = time.perf_counter()
                writer.write(raw)
                status, body = await _read_response(reader)
                if status != 200:
                    raise RuntimeError(f"{url}: {status} {body[:300]!r}")
                latencies.append(time.perf_counter() - started)
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - started


Handler = Callable[[str, str, bytes], Awaitable[tuple[int, bytes, bytes]]]


async def serve(host: str, port: int, handler: Handler) -> asyncio.Server:
    """Answer each request with `handler(method, path, body)` -> (status, content type, body)."""

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.split(b"\r\n")
                method, path, _ = lines[0].decode().split(" ", 2)
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                status, kind, answer = await handler(method, path.split("?")[0], body)
                writer.write(f"HTTP/1.1 {status} OK\r\nContent-Type: {kind.decode()}\r\nContent-Length: {len(answer)}"
                             f"\r\nConnection: keep-alive\r\n\r\n".encode() + answer)
                await writer.drain()
        finally:
            writer.close()

    return await asyncio.start_server(connection, host, port)
