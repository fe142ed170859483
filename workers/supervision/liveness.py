"""Is an engine alive, and is it doing its work? /health alone cannot say: a hung engine
still answers it. So each pass also scrapes /metrics (work pending but counters frozen
means hung) and now and then sends a real one-token completion."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

import httpx
from django.conf import settings

from controlplane.fleet.engine_metrics import MetricsError, Snapshot, snapshot
from controlplane.fleet.models import EngineInstance, EngineMetricSample

log = logging.getLogger(__name__)
HANG_AFTER = dt.timedelta(seconds=20)  # work pending, counters frozen this long: hung
# A hung engine may never even queue new work, so its counters say nothing; the probe does.
# Every 10 s, and again on the very next pass after a failure: two failures in a row mark
# the engine hung within about 10 + 4 + pass + 4 s, under the 30 s target.
PROBE_EVERY = dt.timedelta(seconds=10)
PROBE_TIMEOUT_S = 4.0
PROBE_FAILURES_HUNG = 2


@dataclass
class Liveness:
    healthy: bool
    reason: str = ""
    snapshot: Snapshot | None = None


def _headers(instance: EngineInstance) -> dict:
    return {"Authorization": f"Bearer {instance.api_key}"} if instance.api_key else {}


def _http(instance: EngineInstance) -> httpx.Client:
    # An external engine's URL was set by an operator: each call is vetted and pinned.
    return instance.external_client() if instance.external_url else httpx.Client()


def health_ok(instance: EngineInstance) -> bool:
    try:
        with _http(instance) as http:
            response = http.get(f"{instance.base_url}/health", timeout=settings.ENGINE_HEALTH_TIMEOUT)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def scrape(instance: EngineInstance) -> Snapshot | None:
    try:
        with _http(instance) as http:
            response = http.get(f"{instance.base_url}/metrics", timeout=settings.ENGINE_HEALTH_TIMEOUT,
                                headers=_headers(instance))
        response.raise_for_status()
        return snapshot(response.text)
    except (httpx.HTTPError, MetricsError) as exc:
        log.info("could not scrape %s: %s", instance, exc)
        return None


def probe(instance: EngineInstance) -> str | None:
    """A real one-token completion: the engine must still be able to serve. None when it
    answered; otherwise why not (an engine that knows no model of the name it was sent says so)."""
    body = {"model": instance.model_name, "max_tokens": 1,
            "messages": [{"role": "user", "content": "ping"}]}
    if instance.serving_tier().settings.scheduling_policy == "priority":
        body["priority"] = -1000  # ahead of tenant traffic, so a busy engine is not mistaken for a hung one
    try:
        with _http(instance) as http:
            response = http.post(f"{instance.base_url}/v1/chat/completions", json=body,
                                 headers=_headers(instance), timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return type(exc).__name__
    if response.status_code == 200:
        return None
    try:
        said = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        said = ""
    return f"HTTP {response.status_code}" + (f": {str(said)[:160]}" if said else "")


def record_sample(instance: EngineInstance, snap: Snapshot, now: dt.datetime) -> None:
    EngineMetricSample.objects.create(
        instance=instance, at=now, running=snap.running, waiting=snap.waiting,
        kv_cache_usage=snap.kv_cache_usage, prompt_tokens=snap.prompt_tokens,
        generation_tokens=snap.generation_tokens, prefix_cache_queries=snap.prefix_cache_queries,
        prefix_cache_hits=snap.prefix_cache_hits, mm_cache_queries=snap.mm_cache_queries,
        mm_cache_hits=snap.mm_cache_hits, preemptions=snap.preemptions,
        ttft=snap.ttft.as_json() if snap.ttft else None, e2e=snap.e2e.as_json() if snap.e2e else None,
    )


def observe(instance: EngineInstance, now: dt.datetime, fields: dict) -> Snapshot | None:
    """Scrape /metrics into a sample; the latest gauges go into `fields`, to be saved."""
    snap = scrape(instance)
    if snap is not None:
        record_sample(instance, snap, now)
        fields.update(num_running=snap.running, num_waiting=snap.waiting,
                      kv_cache_usage=snap.kv_cache_usage, metrics_at=now)
        if snap.kv_capacity_tokens:
            fields["kv_capacity_tokens"] = int(snap.kv_capacity_tokens)
    return snap


def assess(instance: EngineInstance, now: dt.datetime, fields: dict) -> Liveness:
    """Health, progress and probe for a running process; fills `fields` with what to save."""
    if not health_ok(instance):
        return Liveness(False, "health check failed")
    snap = observe(instance, now, fields)
    progressed = False
    if snap is not None:
        if snap.progress != instance.last_progress or instance.last_progress_at is None:
            fields.update(last_progress=snap.progress, last_progress_at=now)
            progressed = instance.last_progress_at is not None
        elif snap.running + snap.waiting > 0 and now - instance.last_progress_at > HANG_AFTER:
            return Liveness(False, f"hung: {snap.running + snap.waiting:g} requests pending and no "
                                   f"progress for {(now - instance.last_progress_at).seconds}s", snap)
    due = (instance.last_probe_at is None or instance.probe_failures > 0
           or now - instance.last_probe_at >= PROBE_EVERY)
    if due or instance.actual_state != EngineInstance.Actual.RUNNING:
        failed = probe(instance)
        # A probe waits for a free slot like any request: an engine whose every slot holds a
        # long answer fails it while its counters advance. That engine is busy, not hung.
        failures = 0 if not failed or progressed else instance.probe_failures + 1
        fields.update(last_probe_at=now, probe_failures=failures)
        if failures >= PROBE_FAILURES_HUNG:
            return Liveness(False, f"completion probe failed {failures} times in a row ({failed})", snap)
        if failed and instance.actual_state != EngineInstance.Actual.RUNNING:
            return Liveness(False, f"not serving completions yet ({failed})", snap)
    return Liveness(True, snapshot=snap)
