"""Text beside images on one real engine: what an image stream does to text users' time to
first token, without the gateway's controls and with them.

    python -m bench.mixed_batches            (--quick for a short run; needs the bench extra)

One vLLM CPU engine serves the tiny Qwen2.5-VL as the fleet starts it (bench/engine_path's
engine: the tier's launch spec, which now starts vLLM with --scheduling-policy priority), behind
our gateway (bench/gateway's world, the tier's image_prefill_slots at its default of 2). Text
requests arrive open loop, one every TEXT_EVERY_S, streamed, and each one's time to its first
token is taken at the client. Three phases, one after the other in one run:

- text alone: the text stream through the gateway, nothing else on the engine;
- images, no controls: the same text stream, and beside it IMAGE_CLIENTS clients sending
  distinct 1 MP photos back to back, all straight to vLLM without a priority (first come,
  first served, every image prefill admitted at once): a gateway without the controls;
- images, with controls: the same two streams through the gateway, which sends text ahead
  (priority 0 against 1) and lets at most two image requests of the engine be in prefill;
- with controls, 1 slot: the same with the tier's image_prefill_slots at 1.

It prints text TTFT p50/p90/p99 in each phase, their ratio to text alone, and the images
completed per second in the two image phases (the price of the protection). The target: text
p99 under the image stream within 1.5x of text alone with the controls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from bench.engine_path import (
    TIER,
    EngineGateway,
    Pictures,
    clean_up,
    engine_start,
    engine_stop,
    engine_wait,
    percentile,
)
from bench.gateway import free_port, messages

TEXT_EVERY_S = 0.5
IMAGE_CLIENTS = 4
IMAGE_SIZE = (1155, 866)  # 1 MP
TEXT_TOKENS, IMAGE_TOKENS = 8, 2
PHASE_S, QUICK_PHASE_S = 40, 20
TIER_CACHE_S = 6  # the gateway reads a tier's settings again after 5 s
TARGET = 1.5


def _body(image: bytes | None, *, max_tokens: int, stream: bool) -> bytes:
    return json.dumps({"model": TIER, "max_tokens": max_tokens, "stream": stream,
                       "messages": messages(image)}).encode()


async def _first_token(client: httpx.AsyncClient, url: str, headers: dict, body: bytes) -> float:
    started = time.perf_counter()
    async with client.stream("POST", url, content=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {(await response.aread())[:300]!r}")
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - started
        return first if first is not None else time.perf_counter() - started


async def _texts(url: str, headers: dict, seconds: float) -> list[float]:
    """Open loop: a text request every TEXT_EVERY_S for `seconds`, each one's time to first token."""
    async with httpx.AsyncClient(timeout=600) as client:
        sent = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            sent.append(asyncio.ensure_future(_first_token(
                client, url, headers, _body(None, max_tokens=TEXT_TOKENS, stream=True))))
            await asyncio.sleep(TEXT_EVERY_S)
        return list(await asyncio.gather(*sent))


async def _images(url: str, headers: dict, bodies: list[bytes], stop: asyncio.Event) -> int:
    """IMAGE_CLIENTS clients sending image requests back to back until `stop`; how many completed."""
    queue, done = iter(bodies), [0]

    async def client_loop(client):
        while not stop.is_set():
            body = next(queue, None)
            if body is None:
                return
            response = await client.post(url, content=body, headers=headers)
            if response.status_code != 200:
                raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
            if not stop.is_set():
                done[0] += 1

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(IMAGE_CLIENTS)))
    return done[0]


async def _phase(text: tuple[str, dict], images: tuple[str, dict] | None, bodies: list[bytes],
                 seconds: float) -> tuple[list[float], float | None]:
    stop = asyncio.Event()
    loading = asyncio.ensure_future(_images(*images, bodies, stop)) if images else None
    if loading is not None:
        await asyncio.sleep(3)  # the image stream in its stride before text is measured
    started = time.monotonic()
    firsts = await _texts(*text, seconds)
    elapsed = time.monotonic() - started
    stop.set()
    completed = await loading if loading is not None else None
    return firsts, (completed / (elapsed + 3) if completed is not None else None)


def run(quick: bool, chunk: int | None = None) -> None:
    from workers.engines.cpu import install, tiny_model

    seconds = QUICK_PHASE_S if quick else PHASE_S
    python = install.ensure()
    model = tiny_model.ensure(python)
    engine_port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="bench-mixed-"))
    gateway = EngineGateway(engine_port, model, python)
    try:
        key = gateway.start()
        if chunk:  # prefill in chunks of this many tokens: shorter engine steps, text in sooner
            _engine_settings(max_num_batched_tokens=chunk)
        engine = engine_start(engine_port, folder)
        engine_wait(engine, engine_port)
        direct = (f"http://127.0.0.1:{engine_port}/v1/chat/completions", {"Content-Type": "application/json"})
        through = (f"http://127.0.0.1:{gateway.port}/v1/chat/completions",
                   {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        pictures = Pictures()
        needed = int((seconds + 3) * 8) + 20  # more than the engine takes in a phase (about 6 a second)
        print(f"making {needed} distinct 1 MP photos for each image phase", flush=True)

        def photos() -> list[bytes]:
            return [_body(pictures.next(*IMAGE_SIZE), max_tokens=IMAGE_TOKENS, stream=False) for _ in range(needed)]

        asyncio.run(_texts(*through, 2))  # warm up, untimed
        phases = {
            "text alone": asyncio.run(_phase(through, None, [], seconds)),
            "images, no controls": asyncio.run(_phase(direct, direct, photos(), seconds)),
            "images, with controls": asyncio.run(_phase(through, through, photos(), seconds)),
        }
        _engine_settings(image_prefill_slots=1)  # the strictest setting: one image in prefill per engine
        time.sleep(TIER_CACHE_S)
        phases["with controls, 1 slot"] = asyncio.run(_phase(through, through, photos(), seconds))
        report(phases)
    finally:
        clean_up(engine_stop, gateway.stop)
        shutil.rmtree(folder, ignore_errors=True)


def _engine_settings(**changes) -> None:
    from controlplane.catalog.models import ModelTier

    tier = ModelTier.objects.get(name=TIER)
    tier.engine_settings = {**tier.engine_settings, **changes}
    tier.save(update_fields=["engine_settings"])


def report(phases: dict) -> None:
    alone = phases["text alone"][0]
    base = {share: percentile(alone, share) for share in (0.5, 0.9, 0.99)}
    print(f"\n{'phase':24} {'texts':>5} {'TTFT p50 ms':>11} {'p90 ms':>8} {'p99 ms':>8} {'p99 / alone':>11} "
          f"{'images/s':>9}")
    for name, (firsts, image_rate) in phases.items():
        p50, p90, p99 = (percentile(firsts, share) for share in (0.5, 0.9, 0.99))
        rate = f"{image_rate:9.2f}" if image_rate is not None else f"{'-':>9}"
        print(f"{name:24} {len(firsts):5d} {1000 * p50:11.1f} {1000 * p90:8.1f} {1000 * p99:8.1f} "
              f"{p99 / base[0.99]:11.2f} {rate}")
    with_controls = percentile(phases["images, with controls"][0], 0.99) / base[0.99]
    without = percentile(phases["images, no controls"][0], 0.99) / base[0.99]
    verdict = "met" if with_controls <= TARGET else "MISSED"
    print(f"\ntext p99 under the image stream: {with_controls:.2f}x text alone with the controls, {without:.2f}x "
          f"without (target: within {TARGET}x with them): {verdict}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_PHASE_S} s phases instead of {PHASE_S} s")
    parser.add_argument("--prefill-chunk", type=int, help="start vLLM with this --max-num-batched-tokens")
    args = parser.parse_args(argv)
    run(args.quick, args.prefill_chunk)


if __name__ == "__main__":
    main()
