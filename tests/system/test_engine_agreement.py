"""What the product assumes of an engine, held against the real vLLM (its CPU build) that the
started system serves: the simulator schedules by priority as vLLM does, and the KV planner
predicts the cache vLLM allocates."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from controlplane.fleet.engine_metrics import snapshot
from controlplane.fleet.kv_check import kv_check
from controlplane.fleet.models import EngineInstance
from controlplane.gateway.forwarding import PRIORITY_IMAGE, PRIORITY_TEXT
from controlplane.imaging import kv
from tests.engines import simulator
from tests.images import data_url, image_bytes
from tests.system.conftest import REAL_TIER
from tests.system.harness import wait_for

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("system")]

WAITING_IMAGES = TEXTS = 4


class NotSetUp(Exception):
    """The engine was not seen in the state the scenario needs (another request took a slot)."""


async def _wait_for_state(http, base_url, headers, check, what):
    deadline = time.monotonic() + 30
    while True:
        metrics = snapshot((await http.get(f"{base_url}/metrics", headers=headers)).text)
        if check(metrics):
            return
        if time.monotonic() > deadline:
            raise NotSetUp(f"{base_url}: {what}: {metrics.running:g} running, {metrics.waiting:g} waiting")
        await asyncio.sleep(0.005)


async def _first_token_order(base_url: str, model: str, headers: dict, running: int) -> list[str]:
    """Image requests hold every one of the engine's `running` slots and 4 more wait behind
    them; then 4 text requests come. Returns the class of each waiting request in the order
    their first tokens arrived."""
    order: list[str] = []

    def image_body(i: int, tokens: int, stream: bool) -> dict:
        return {"model": model, "stream": stream, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
                "priority": PRIORITY_IMAGE, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": f"picture {i}"},
                    {"type": "image_url", "image_url": {"url": data_url(image_bytes(448 + 28 * i, 448))}}]}]}

    async def ask(http, klass, body):
        if not body["stream"]:  # a slot holder: its answer is not watched (nor streamed, to spare the server)
            response = await http.post(f"{base_url}/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
            return
        async with http.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if klass and line.startswith("data: ") and '"content"' in line:
                    order.append(klass)
                    klass = None

    async with httpx.AsyncClient(timeout=120) as http:
        tasks = []
        try:
            for i in range(running):  # each holds its slot a different while, so that they free one at a time
                tasks.append(asyncio.create_task(ask(http, "holder", image_body(i, 3000 + 100 * i, stream=False))))
            await _wait_for_state(http, base_url, headers, lambda m: m.running == running and not m.waiting,
                                  "the images never held every slot")
            for i in range(WAITING_IMAGES):
                tasks.append(asyncio.create_task(ask(http, "image", image_body(running + i, 4, stream=True))))
            await _wait_for_state(http, base_url, headers,
                                  lambda m: m.running == running and m.waiting == WAITING_IMAGES,
                                  "the images were not waiting behind the full slots")
            for i in range(TEXTS):
                body = {"model": model, "stream": True, "max_tokens": 4, "priority": PRIORITY_TEXT,
                        "messages": [{"role": "user", "content": f"question {i}"}]}
                tasks.append(asyncio.create_task(ask(http, "text", body)))
            await _wait_for_state(http, base_url, headers, lambda m: m.waiting >= WAITING_IMAGES + TEXTS,
                                  "the text requests were not all waiting")
            if order:
                raise NotSetUp("a slot freed before the text requests were all waiting")
        finally:
            await asyncio.gather(*tasks)
    return order


def _order(base_url: str, model: str, headers: dict, running: int) -> list[str]:
    """The scenario's order, tried again when something else took a slot meanwhile (the
    node agent's probes reach the real engine every few seconds)."""
    for attempt in range(3):
        try:
            return asyncio.run(_first_token_order(base_url, model, headers, running))
        except NotSetUp:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def test_the_simulator_lets_text_overtake_waiting_images_as_the_real_engine_does(real_engine):
    settings = real_engine.tier.settings
    slots = settings.max_num_seqs
    real = _order(real_engine.base_url, REAL_TIER, {"Authorization": f"Bearer {real_engine.api_key}"}, slots)
    flags = ["--max-num-seqs", str(slots), "--scheduling-policy", settings.scheduling_policy,
             "--block-size", str(kv.CPU_BLOCK_TOKENS), "--sim-decode-ms-per-token", "0.3"]  # about the real engine's pace
    with simulator(name="same-load", extra=flags) as port:
        simulated = _order(f"http://127.0.0.1:{port}", "same-load", {}, slots)
    # Each slot that frees goes to text before the images that were waiting longer.
    expected = ["text"] * TEXTS + ["image"] * WAITING_IMAGES
    assert real == expected
    assert simulated == real


def test_the_kv_planner_predicts_the_cache_the_real_engine_allocates(system_db, real_engine):
    def reported():
        instance = EngineInstance.objects.using(system_db).select_related("tier", "node").get(pk=real_engine.pk)
        return instance if instance.kv_capacity_tokens else None

    instance = wait_for(reported, timeout=30, what="a scrape of the engine's KV cache size")
    check = kv_check(instance)
    assert check.predicted == instance.kv_capacity_tokens > 0
    assert check.difference_text == "exactly as planned" and "VLLM_CPU_KVCACHE_SPACE" in check.basis
