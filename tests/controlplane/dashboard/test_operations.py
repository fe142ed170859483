"""The operations page: per tier what clients saw (latency, time to first token, errors, rates),
per engine what it reports (queue, KV cache, tokens), per node its engines and GPU memory."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from controlplane.fleet.models import EngineInstance, EngineMetricSample, Gpu, Node
from controlplane.fleet.selectors import engine_series, node_summaries
from controlplane.metering.records import ImageLine, UsageRecord
from controlplane.metering.services import usage_record
from controlplane.metering.traffic import (
    latency_by_class,
    latency_by_class_in_python,
    traffic_by_tier,
    traffic_in_python,
)
from tests.factories import VisionTierFactory

pytestmark = pytest.mark.django_db
MINUTE = dt.timedelta(minutes=1)


def _event(world, n, *, at, latency, ttft=None, status="ok", tier=None, http_status=None):
    usage_record(record=UsageRecord(
        request_id=f"ops-{n}", tenant_id=world.alice.pk, api_key_id=None, tier_id=(tier or world.vision).pk,
        created_at=at, status=status, http_status=http_status or (200 if status == "ok" else 503), latency_ms=latency,
        ttft_ms=ttft, stream=ttft is not None, text_tokens=100, image_tokens=50, output_tokens=10))


def test_traffic_gives_each_minute_its_rates_errors_and_latency_percentiles(world):
    start = timezone.now().replace(second=0, microsecond=0) - dt.timedelta(minutes=10)
    # Minute one: latencies 100..1000 ms, one in ten an error; minute three: two streamed requests.
    for n in range(10):
        _event(world, n, at=start + dt.timedelta(seconds=n), latency=100 * (n + 1),
               status="error" if n in (8, 9) else "ok", http_status=429 if n == 8 else None)
    _event(world, 20, at=start + 2 * MINUTE, latency=400, ttft=120)
    _event(world, 21, at=start + 2 * MINUTE + dt.timedelta(seconds=5), latency=600, ttft=180)
    _event(world, 30, at=start, latency=50, tier=world.text)
    window = {"since": start, "until": start + 5 * MINUTE, "bucket": MINUTE}
    series = traffic_by_tier(**window)
    first, third = series[world.vision.pk]
    assert (first.at, first.requests, first.errors, first.tokens) == (start, 10, 1, 1600)
    assert first.error_rate == 0.1  # the 503 is a failure of the service; the quota's 429 is not
    assert first.latency_p50 == pytest.approx(550) and first.latency_p95 == pytest.approx(955)
    assert first.ttft_p50 is None  # nothing streamed that minute
    assert (third.at, third.requests, third.ttft_p50, third.ttft_p95) == (start + 2 * MINUTE, 2, 150, 177)
    assert [p.requests for p in series[world.text.pk]] == [1]
    # The database's percentiles are the ones embedded mode computes in Python.
    assert traffic_in_python(**window) == series
    assert list(traffic_by_tier(**window, tier_ids=[world.text.pk])) == [world.text.pk]


PICTURE = ImageLine(source_format="jpeg", source_width=640, source_height=480, width=644, height=476,
                    fingerprint="0" * 16)


def test_latency_is_shown_by_request_class_so_image_tails_do_not_hide_text(world):
    """Text, image and large-image requests apart: time to first token (a whole answer's
    arrival when not streamed), latency and time queued, at p50/p95/p99, per tier and engine."""
    world.vision.large_image_threshold = 1000
    world.vision.save()
    engine = EngineInstance.objects.create(tier=world.vision, actual_state="running")
    start = timezone.now() - dt.timedelta(minutes=10)
    for n in range(20):  # text: 100..290 ms to the first token, streamed
        usage_record(record=UsageRecord(
            request_id=f"text-{n}", tenant_id=world.alice.pk, api_key_id=None, tier_id=world.vision.pk,
            created_at=start, latency_ms=400 + 10 * n, ttft_ms=100 + 10 * n, stream=True, queue_ms=5,
            text_tokens=50, output_tokens=10, instance_id=engine.pk))
    for n, tokens in enumerate((300, 300, 300, 3000)):  # three images, one large; answers not streamed
        usage_record(record=UsageRecord(
            request_id=f"image-{n}", tenant_id=world.alice.pk, api_key_id=None, tier_id=world.vision.pk,
            created_at=start, latency_ms=2000 + 1000 * n, queue_ms=50 * n, images=[(PICTURE, tokens, 0)],
            image_tokens=tokens, text_tokens=20, output_tokens=10, instance_id=engine.pk))
    window = {"since": start - MINUTE, "until": timezone.now()}
    found = latency_by_class(**window)
    text, image, large = (found[(world.vision.pk, kind)] for kind in ("text", "image", "large"))
    assert (text.requests, image.requests, large.requests) == (20, 3, 1)
    assert text.first_token[0] == pytest.approx(195) and text.first_token[2] == pytest.approx(288.1)
    assert image.first_token == pytest.approx((3000, 3900, 3980))  # the whole answers' latencies
    assert large.latency == pytest.approx((5000, 5000, 5000)) and image.queue_p95 == pytest.approx(95)
    assert latency_by_class_in_python(**window) == found  # embedded mode's figures are the database's
    by_engine = latency_by_class(**window, by="engine")
    assert by_engine[(engine.pk, "text")].requests == 20


def test_the_page_shows_text_apart_from_images_and_marks_an_objective_missed(client, world):
    world.vision.engine_settings = {**world.vision.engine_settings, "ttft_objective_text_ms": 150}
    world.vision.save()
    now = timezone.now()
    for n in range(4):
        _event(world, n, at=now - dt.timedelta(seconds=20 + n), latency=900, ttft=300)
    client.force_login(world.operator)
    table = client.get("/operations/").content.decode().split('id="latency-by-class"')[1].split("</section>")[0]
    model_rows = table.split('data-part="tiers"')[1].split("</table>")[0]
    assert 'data-owner="vlm-lite" data-class="text"' in model_rows
    assert "300 / 300 / 300" in model_rows and "150 ms" in model_rows and "missed" in model_rows


def test_engine_series_averages_the_queue_and_turns_counters_into_rates(world):
    instance = EngineInstance.objects.create(tier=world.vision, actual_state="running")
    start = timezone.now().replace(second=0, microsecond=0) - dt.timedelta(minutes=10)
    for seconds, waiting, kv, tokens in ((0, 2, 0.2, 1000), (30, 4, 0.4, 4000), (60, 0, 0.1, 7000),
                                         (90, 0, 0.1, 100)):  # the engine restarted: its counters fell
        EngineMetricSample.objects.create(instance=instance, at=start + dt.timedelta(seconds=seconds),
                                          waiting=waiting, kv_cache_usage=kv, prompt_tokens=tokens)
    first, second = engine_series(since=start, until=start + 5 * MINUTE, bucket=MINUTE)[instance.pk]
    assert (first.waiting, first.kv_cache_usage) == (3, pytest.approx(0.3))
    assert first.tokens_per_s == 100  # 3,000 tokens in 30 s
    assert second.tokens_per_s is None  # from 4,000 to 100 across a restart: no rate, not a negative one


def test_each_engine_shows_how_often_its_prefix_and_image_caches_hit(world):
    instance = EngineInstance.objects.create(tier=world.vision, actual_state="running")
    start = timezone.now().replace(second=0, microsecond=0) - dt.timedelta(minutes=10)
    for seconds, queries, hits, images, image_hits in ((0, 1000, 100, 10, 0), (30, 3000, 1600, 30, 15),
                                                       (60, 3000, 1600, 30, 15), (90, 10, 0, 0, 0)):
        EngineMetricSample.objects.create(instance=instance, at=start + dt.timedelta(seconds=seconds),
                                          prefix_cache_queries=queries, prefix_cache_hits=hits,
                                          mm_cache_queries=images, mm_cache_hits=image_hits)
    first, second = engine_series(since=start, until=start + 5 * MINUTE, bucket=MINUTE)[instance.pk]
    assert first.prefix_hit_rate == pytest.approx(0.75) and first.mm_hit_rate == pytest.approx(0.75)
    assert second.prefix_hit_rate is None  # nothing looked up, then a restart: no rate, not a wrong one


def test_nodes_show_their_engines_and_the_gpu_memory_those_hold(world):
    tier = VisionTierFactory(name="vlm-pro", engine_kind="vllm", price_plan=world.vision.price_plan,
                             engine_settings={"max_model_len": 32768, "gpu_memory_utilization": 0.5})
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    gpus = [Gpu.objects.create(node=node, index=i, model="H100", memory_mib=81920) for i in range(2)]
    running = EngineInstance.objects.create(tier=tier, node=node, actual_state="running")
    running.gpus.set([gpus[0]])
    crashed = EngineInstance.objects.create(tier=tier, node=node, actual_state="crashloop")
    crashed.gpus.set([gpus[1]])  # a crashed engine holds no memory
    (summary,) = node_summaries()
    assert summary.engines == {"running": 1, "crashloop": 1}
    assert [g["reserved_mib"] for g in summary.gpus] == [40960, 0]


def test_the_page_draws_every_chart_for_operators_only(client, world):
    node = Node.objects.create(name="gpu-b", queue="node.gpu-b")
    Gpu.objects.create(node=node, index=0, model="L4", memory_mib=23034)
    instance = EngineInstance.objects.create(tier=world.vision, node=node, actual_state="running")
    now = timezone.now()
    EngineMetricSample.objects.create(instance=instance, at=now - dt.timedelta(seconds=30), waiting=3)
    for n in range(4):
        _event(world, n, at=now - dt.timedelta(seconds=20 + n), latency=200, status="error" if n == 0 else "ok")
    client.force_login(world.operator)
    page = client.get("/operations/?window=6h").content.decode()
    for chart in ("latency-chart", "ttft-chart", "error-rate-chart", "requests-chart", "tokens-chart",
                  "queue-chart", "kv-chart", "engine-tokens-chart", "engine-ttft-chart", "prefix-cache-chart",
                  "mm-cache-chart"):
        assert f'data-chart="{chart}"' in page and f'id="{chart}"' in page, chart
    totals = page.split('id="traffic-totals"')[1].split("</table>")[0]
    assert 'data-tier="vlm-lite"' in totals and "25.0%" in totals
    assert f"vlm-lite#{instance.pk} on gpu-b" in page  # the engine's series is named after it
    assert "0 / 23,034 MiB" in page.split('id="nodes"')[1]  # a simulator holds no GPU memory share
    assert client.get("/operations/?window=forever&tier=nope").status_code == 200
    client.force_login(world.finance)
    assert client.get("/operations/").status_code == 403


def test_a_quiet_window_says_there_is_nothing_to_draw_and_busy_charts_start_at_zero(client, world):
    from tests.charts import figure_of

    instance = EngineInstance.objects.create(tier=world.vision, actual_state="running")
    EngineMetricSample.objects.create(instance=instance, at=timezone.now() - dt.timedelta(seconds=30), waiting=3)
    client.force_login(world.operator)
    page = client.get("/operations/").content.decode()
    latency = page.split('data-chart="latency-chart"')[1].split("</section>")[0]
    assert "Nothing to draw in this window." in latency and "Plotly.newPlot" not in latency
    _, layout = figure_of(page, "queue-chart")
    assert layout["yaxis"]["rangemode"] == "tozero" and layout["xaxis"]["rangeslider"]["visible"]


def test_a_chart_spans_the_whole_window_chosen_however_few_its_points(client, world):
    from tests.charts import figure_of

    instance = EngineInstance.objects.create(tier=world.vision, actual_state="running")
    EngineMetricSample.objects.create(instance=instance, at=timezone.now() - dt.timedelta(seconds=30), waiting=3)
    client.force_login(world.operator)
    _, layout = figure_of(client.get("/operations/?window=6h").content.decode(), "queue-chart")
    start, end = (dt.datetime.fromisoformat(at) for at in layout["xaxis"]["range"])
    assert end - start == dt.timedelta(hours=6) and layout["xaxis"]["rangeslider"]["range"] == layout["xaxis"]["range"]
    assert [b["label"] for b in layout["xaxis"]["rangeselector"]["buttons"]] == ["15 minutes", "1 hour", "all"]
