"""Benchmark runs: a closed-loop load against one instance of a tier, stored on the run row."""

from __future__ import annotations

import asyncio
import base64
import io
import statistics
import time

import httpx
from django.utils import timezone
from PIL import Image

from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun
from controlplane.fleet.selectors import routable_instances


def benchmark_start(*, profile: BenchmarkProfile) -> BenchmarkRun:
    from django.db import transaction

    from workers.tasks import benchmark_run

    run = BenchmarkRun.objects.create(profile=profile)
    transaction.on_commit(lambda: benchmark_run.delay(run.pk))
    return run


def _image_url(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.radial_gradient("L").resize((width, height)).convert("RGB").save(buffer, "JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else 0.0


async def _load(base_url: str, model: str, profile: BenchmarkProfile, api_key: str = "") -> list[dict]:
    image = _image_url(profile.image_width, profile.image_height)
    results: list[dict] = []
    counter = iter(range(profile.requests))

    async def worker(client: httpx.AsyncClient):
        for n in counter:
            # Spread images evenly: request n carries one when the running share steps up.
            with_image = int((n + 1) * profile.image_share) > int(n * profile.image_share)
            content = [{"type": "text", "text": f"request {n}: describe"}]
            if with_image:
                content.append({"type": "image_url", "image_url": {"url": image}})
            started = time.monotonic()
            try:
                r = await client.post(f"{base_url}/v1/chat/completions", json={
                    "model": model, "max_tokens": profile.max_tokens,
                    "messages": [{"role": "user", "content": content}]})
                ok = r.status_code == 200
                usage = r.json().get("usage", {}) if ok else {}
            except httpx.HTTPError:
                ok, usage = False, {}
            results.append({"class": "image" if with_image else "text", "ok": ok,
                            "latency": time.monotonic() - started,
                            "output_tokens": usage.get("completion_tokens", 0)})

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        await asyncio.gather(*(worker(client) for _ in range(profile.concurrency)))
    return results


def benchmark_execute(*, run_id: int) -> None:
    run = BenchmarkRun.objects.select_related("profile__tier").get(pk=run_id)
    if run.state != BenchmarkRun.State.QUEUED:
        return
    run.state, run.started_at = BenchmarkRun.State.RUNNING, timezone.now()
    run.save(update_fields=["state", "started_at"])
    instances = routable_instances(tier_id=run.profile.tier_id)
    if not instances:
        run.state, run.finished_at = BenchmarkRun.State.FAILED, timezone.now()
        run.log = "no healthy instance of the tier to benchmark"
        run.save()
        return
    started = time.monotonic()
    results = asyncio.run(_load(instances[0].base_url, run.profile.tier.name, run.profile,
                                instances[0].api_key))
    elapsed = time.monotonic() - started
    summary = {}
    for cls in ("text", "image"):
        latencies = [r["latency"] for r in results if r["class"] == cls and r["ok"]]
        if latencies:
            summary[cls] = {"requests": len(latencies), "p50_s": _percentile(latencies, 0.5),
                            "p99_s": _percentile(latencies, 0.99), "mean_s": statistics.fmean(latencies)}
    run.results = {
        "elapsed_s": elapsed,
        "requests_per_s": len(results) / elapsed if elapsed else 0,
        "errors": sum(not r["ok"] for r in results),
        "output_tokens_per_s": sum(r["output_tokens"] for r in results) / elapsed if elapsed else 0,
        "classes": summary,
    }
    run.state = BenchmarkRun.State.SUCCEEDED if not run.results["errors"] else BenchmarkRun.State.FAILED
    run.progress, run.finished_at = 1.0, timezone.now()
    run.log = f"{len(results)} requests against instance {instances[0].pk} in {elapsed:.2f}s"
    run.save()
