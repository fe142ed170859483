"""A load profile drawn from the traffic a tier served sends that traffic's mix."""

from __future__ import annotations

import datetime as dt
import random
from collections import Counter

import pytest
from django.utils import timezone

from controlplane.benchmarks import observed, services
from controlplane.benchmarks.models import BenchmarkProfile
from controlplane.metering.models import UsageEvent, UsageImage
from controlplane.tenants.services import internal_tenant

pytestmark = pytest.mark.django_db

SIZES = {(640, 480): 6, (1280, 720): 3, (320, 240): 1}  # the images' source sizes, by weight


def _traffic(tenant, tier, *, requests: int, hours: float, seed: int = 1, prefix: str = "obs"):
    """`requests` spread over the last `hours`: 30 % text, 1 to 2 images otherwise."""
    rng = random.Random(seed)
    now = timezone.now()
    events, images = [], []
    for n in range(requests):
        count = 0 if rng.random() < 0.3 else rng.choice((1, 1, 1, 2))
        events.append(UsageEvent(
            request_id=f"{prefix}-{n}", tenant=tenant, tier=tier, status="ok",
            created_at=now - dt.timedelta(seconds=rng.uniform(1, hours * 3600 - 1)), image_count=count,
            text_tokens=rng.randint(40, 200), output_tokens=rng.randint(10, 300)))
    UsageEvent.objects.bulk_create(events)
    for event in UsageEvent.objects.filter(request_id__startswith=f"{prefix}-", image_count__gt=0):
        for position in range(event.image_count):
            width, height = rng.choices(list(SIZES), weights=list(SIZES.values()))[0]
            images.append(UsageImage(event=event, created_at=event.created_at, position=position, source_format="jpeg", source_width=width,
                                     source_height=height, width=width, height=height, tokens=300,
                                     fingerprint=f"{event.pk}-{position}"))
    UsageImage.objects.bulk_create(images)


def test_a_profile_drawn_from_traffic_sends_the_mix_the_tier_served(world):
    _traffic(world.alice, world.vision, requests=600, hours=2)
    profile = services.profile_from_traffic(name="observed", tier=world.vision, seconds=3 * 3600,
                                            multipliers=[1, 2, 4])
    # The rate: 600 requests in the 3-hour window, then twice and four times that.
    rate = 600 / (3 * 3600)
    assert profile.arrival == "open" and profile.sweep == [round(rate * m, 2) for m in (1, 2, 4)]
    # What the profile's load test sends, request by request.
    workload = services.workload_for(profile)
    specs = [workload.spec(n) for n in range(400)]
    text_share = sum(s.images == 0 for s in specs) / len(specs)
    assert abs(text_share - 0.3) < 0.07
    assert {s.images for s in specs if s.images} == {1, 2}
    sent = Counter(size for s in specs for size in s.sizes)
    total = sum(sent.values())
    for size, weight in SIZES.items():
        assert abs(sent[size] / total - weight / 10) < 0.07, (size, sent)
    texts = [len(s.body["messages"][0]["content"][0]["text"].split()) for s in specs]
    outputs = [s.body["max_tokens"] for s in specs]
    assert 40 <= profile.prompt_tokens_min <= 60 and 180 <= profile.prompt_tokens_max <= 200
    assert min(outputs) >= profile.output_tokens_min >= 10 and max(outputs) <= profile.output_tokens_max <= 300
    assert profile.output_tokens_max - profile.output_tokens_min > 200 and max(texts) > 100
    share = UsageEvent.objects.filter(image_count=0).count() / 600
    assert profile.text_share == round(share, 3)
    assert "600 requests" in profile.description and f"{100 * share:.0f}% text" in profile.description


def test_benchmark_traffic_and_other_tenants_are_left_out_when_asked(world):
    benchmarks = internal_tenant()
    _traffic(world.alice, world.vision, requests=50, hours=1, prefix="alice")
    _traffic(world.bob, world.vision, requests=150, hours=1, prefix="bob")
    _traffic(benchmarks, world.vision, requests=1000, hours=1, prefix="bench")
    everyone = services.profile_from_traffic(name="everyone", tier=world.vision, seconds=3600, multipliers=[1])
    alice = services.profile_from_traffic(name="alice", tier=world.vision, tenant=world.alice, seconds=3600,
                                          multipliers=[1])
    assert everyone.sweep == [round(200 / 3600, 2)] and "200 requests" in everyone.description
    assert "50 requests" in alice.description and "alice on" in alice.description


def test_traffic_older_than_the_window_or_of_another_tier_draws_nothing(world):
    _traffic(world.alice, world.text, requests=20, hours=1)
    with pytest.raises(observed.NoTraffic):
        services.profile_from_traffic(name="none", tier=world.vision, seconds=3600, multipliers=[1])
    assert not BenchmarkProfile.objects.filter(name="none").exists()


def test_many_image_sizes_become_eight_buckets_that_keep_the_pixel_distribution():
    rng = random.Random(3)
    sizes = [(rng.randint(200, 4000), rng.randint(200, 3000)) for _ in range(5000)]
    buckets = observed.size_buckets(sizes)
    assert len(buckets) == 8 and sum(b["weight"] for b in buckets) == 5000
    pixels = sorted(w * h for w, h in sizes)
    drawn = sorted(p for b in buckets for p in [b["width"] * b["height"]] * b["weight"])
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):  # each quantile within one bucket's step
        index = int(q * len(pixels))
        assert abs(drawn[index] - pixels[index]) / pixels[index] < 0.35, q


def test_sizes_outside_what_a_bucket_holds_are_scaled_into_it_keeping_their_aspect():
    buckets = observed.size_buckets([(20000, 5000), (4, 400)])
    assert {(b["width"], b["height"]) for b in buckets} == {(8192, 2048), (16, 1600)}


def test_the_page_draws_a_profile_and_says_when_there_is_no_traffic(client, world):
    client.force_login(world.operator)
    form = {"name": "from-traffic", "tier": world.vision.pk, "window": "1h", "multipliers": "1, 3",
            "stage_duration_s": "20"}
    empty = client.post("/benchmarks/from-traffic/", form)
    assert empty.status_code == 200 and "no requests in this window" in empty.content.decode()
    _traffic(world.alice, world.vision, requests=40, hours=0.5)
    response = client.post("/benchmarks/from-traffic/", form)
    profile = BenchmarkProfile.objects.get(name="from-traffic")
    assert response.status_code == 302 and response.url == f"/benchmarks/{profile.pk}/"
    assert profile.sweep == [round(40 / 3600, 2), round(3 * 40 / 3600, 2)] and profile.stage_duration_s == 20
    bad = client.post("/benchmarks/from-traffic/", {**form, "name": "other", "multipliers": "1, x"})
    assert "numbers separated by commas" in bad.content.decode()
    again = client.post("/benchmarks/from-traffic/", form)
    assert "a profile of this name exists" in again.content.decode()


def test_only_operators_draw_profiles(client, world):
    client.force_login(world.finance)
    assert client.get("/benchmarks/from-traffic/").status_code == 403
