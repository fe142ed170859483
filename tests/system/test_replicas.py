"""Gateway replicas as deployed: three behind a round-robin balancer, in front of two engines
of one tier. A chat's next turn reaches the engine that has its image cached whichever replica
takes it, and no engine has more image requests in prefill than the tier's slots."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import subprocess
import sys
import threading

import httpx
import pytest

from tests.images import data_url, noise_bytes
from tests.system.harness import ROOT, free_port, wait_for

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("system")]
TIER = "vlm-replicas"
SLOTS = 1


@contextlib.contextmanager
def round_robin(ports: list[int]):
    """A TCP balancer on 127.0.0.1: each connection to the next of `ports` in turn."""
    loop, ready, listening = asyncio.new_event_loop(), threading.Event(), {}
    turn = itertools.cycle(ports)

    async def pipe(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(client_reader, client_writer):
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", next(turn))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, upstream_writer), pipe(upstream_reader, client_writer))

    async def serve():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        listening["port"] = server.sockets[0].getsockname()[1]
        ready.set()
        async with server:
            await server.serve_forever()

    def run():
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(serve())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield listening["port"]
    finally:
        loop.call_soon_threadsafe(lambda: [task.cancel() for task in asyncio.all_tasks(loop)])
        thread.join(10)


@contextlib.contextmanager
def replicas(system, count: int):
    """`count` more gateway processes on the system's database and Redis."""
    started = []
    try:
        for _ in range(count):
            port = free_port()
            process = subprocess.Popen([sys.executable, "-m", "controlplane.serving", "--host", "127.0.0.1",
                                        "--port", str(port)], cwd=ROOT, env=system.env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            started.append((port, process))
        for port, _ in started:
            wait_for(lambda port=port: httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 401,
                     timeout=60, what=f"a gateway replica on {port}")
        yield [port for port, _ in started]
    finally:
        for _, process in started:
            process.terminate()
            process.wait(timeout=30)


def _tier(db) -> list:
    from controlplane.catalog.models import ModelTier, PricePlan, ResolutionPolicy
    from controlplane.fleet.models import EngineInstance

    policy = ResolutionPolicy.objects.using(db).get(name="standard")
    ModelTier.objects.using(db).create(
        name=TIER, family="qwen2_5_vl", kind="vision", engine_kind="simulator", model_id="Qwen/Qwen2.5-VL-3B-Instruct",
        replicas=2, resolution_policy=policy, price_plan=PricePlan.objects.using(db).get(name="vlm-lite"),
        large_image_threshold=100_000,
        # Slow prefills (an image of about 1,300 tokens: some 100 ms), so that requests overlap.
        engine_settings={"max_model_len": 32768, "max_num_seqs": 16, "image_prefill_slots": SLOTS,
                         "prefill_us_per_token": 40, "encode_us_per_image_token": 40, "decode_ms_per_token": 5})

    def serving():
        engines = list(EngineInstance.objects.using(db).filter(tier__name=TIER, actual_state="running", healthy=True))
        return engines if len(engines) == 2 else None

    return wait_for(serving, timeout=120, interval=1, what=f"two engines of {TIER}")


def _chats(base_url: str, key: str, pictures: list[bytes], turns: int = 3) -> tuple[int, int]:
    """Each picture a chat of `turns` turns, the chats at once, each turn on a new connection
    (so a balancer may send it to any replica): the prompt tokens and cached tokens of the
    turns after the first."""

    def chat(picture: bytes) -> tuple[int, int]:
        conversation = [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": data_url(picture, "image/png")}}]}]
        prompt = cached = 0
        for turn in range(turns):
            with httpx.Client(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
                response = client.post(f"{base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                        json={"model": TIER, "max_tokens": 8, "messages": conversation})
            assert response.status_code == 200, response.text
            body = response.json()
            if turn:
                prompt += body["usage"]["prompt_tokens"]
                cached += (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            conversation += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                             {"role": "user", "content": f"And then, turn {turn + 2}?"}]
        return prompt, cached

    with concurrent.futures.ThreadPoolExecutor(len(pictures)) as pool:
        results = list(pool.map(chat, pictures))
    return sum(p for p, _ in results), sum(c for _, c in results)


def test_replicas_behind_a_balancer_keep_chats_on_their_cached_engine_and_the_slots_cap(system, system_db):
    engines = _tier(system_db)
    system.wait_for_engines(tiers=(TIER,), timeout=60)  # and the gateway knows the tier
    one = _chats(system.base_url, system.api_key, [noise_bytes(448, 448) for _ in range(6)])
    with replicas(system, 2) as ports, round_robin([system.port, *ports]) as balancer:
        three = _chats(f"http://127.0.0.1:{balancer}", system.api_key, [noise_bytes(448, 448) for _ in range(6)])
    through_one, through_three = one[1] / one[0], three[1] / three[0]
    assert through_one > 0.5, one  # a chat's later turns hit the engine's prefix cache through one replica...
    assert through_three >= 0.95 * through_one, (one, three)  # ...and as much through three behind a balancer
    peaks = []
    for engine in engines:  # seen from the engines: never more image requests in prefill than the slots
        metrics = httpx.get(f"{engine.base_url}/metrics", timeout=5).text
        peak = next(line for line in metrics.splitlines() if line.startswith("sim:image_prefills_peak"))
        peaks.append(float(peak.rsplit(" ", 1)[1]))
    assert max(peaks) == SLOTS and all(peak <= SLOTS for peak in peaks), peaks
