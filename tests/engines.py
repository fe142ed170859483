"""Engines for tests that need an upstream: a real simulator process, or a raw socket server
standing in for an engine that misbehaves in ways the simulator never does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys

import httpx
from asgiref.sync import async_to_sync, sync_to_async
from django.utils import timezone

from tests.system.harness import ROOT, free_port, wait_for


@contextlib.contextmanager
def simulator(*, family="qwen2_5_vl", name="vlm-lite", images=4, max_pixels=1003520, extra=()):
    port = free_port()
    argv = [sys.executable, "-m", "workers.engines.simulator", "test-model", "--family", family,
            "--served-model-name", name, "--port", str(port), *extra]
    if images is not None:
        argv += ["--limit-mm-per-prompt", f'{{"image": {images}}}',
                 "--mm-processor-kwargs", f'{{"min_pixels": 3136, "max_pixels": {max_pixels}}}']
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200,
                 timeout=20, what="the simulator to answer /health")
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


async def read_request(reader) -> None:
    """Read one HTTP request (head and body) off `reader`."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await reader.read(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[1])
    while len(rest) < length:
        rest += await reader.read(65536)


async def raw_engine(world, handler):
    """`handler` serving on a port of its own, registered as a healthy engine of the vision tier."""
    from controlplane.fleet.models import EngineInstance, Node

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    def register():
        node = Node.objects.create(name="flaky", address="127.0.0.1", queue="node.flaky", last_seen_at=timezone.now())
        EngineInstance.objects.create(tier=world.vision, node=node, port=port, actual_state="running",
                                      healthy=True, last_health_at=timezone.now())

    await sync_to_async(register)()
    return server


async def answer(world, body: bytes) -> tuple[int, bytes]:
    """The gateway's answer to alice's request `body`, read to its end: its status and bytes."""
    from controlplane.gateway import handlers
    from controlplane.gateway.http import Request

    response = await handlers.chat_completions(Request("POST", {"authorization": f"Bearer {world.alice_key}"}, body))
    text = b"".join([c async for c in response.stream]) if response.stream else response.body
    if response.on_close:
        await response.on_close()
    return response.status, text


def with_raw_engine(world, handler, request_body):
    """Send `request_body` twice through the gateway to `handler`, alice's key, the vision tier."""

    @async_to_sync
    async def run():
        server = await raw_engine(world, handler)
        results = [await answer(world, json.dumps(request_body).encode()) for _ in range(2)]
        server.close()
        return results

    return run()


async def dies_mid_body(reader, writer):
    """An engine that starts a plain answer and dies halfway through its body."""
    await read_request(reader)
    writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5000\r\n\r\n{"id":"x"')
    await writer.drain()
    writer.close()
