from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record
from controlplane.tenants.models import Quota
from tests.images import image_bytes

pytestmark = [pytest.mark.django_db, pytest.mark.accounting]


def _spend(world, tenant, request_id, image_tokens, status="ok"):
    return usage_record(record=UsageRecord(request_id=request_id, tenant_id=tenant.pk, api_key_id=None,
                                           tier_id=world.vision.pk, image_tokens=image_tokens, text_tokens=100,
                                           output_tokens=50, status=status))


def _get(client, key, path, **params):
    response = client.get(path, params, HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 200, response.content
    return response.json()


def test_quota_status_shows_limits_use_and_what_remains(client, world):
    Quota.objects.create(tenant=world.alice, period="month", image_tokens=10_000, requests_per_minute=60)
    _spend(world, world.alice, "a1", 1224)
    _spend(world, world.alice, "a2", 9999, status="error")  # failed requests use no quota
    _spend(world, world.charlie, "c1", 5000)
    status = _get(client, world.alice_key, "/api/v1/quota/")
    assert status["limits"]["image_tokens"] == 10_000 and status["limits"]["total_tokens"] is None
    assert status["used"]["image_tokens"] == 1224
    assert status["remaining"]["image_tokens"] == 10_000 - 1224
    assert status["resets_in_seconds"] > 0


def test_cost_to_date_is_the_tenants_own_and_adds_up(client, world):
    events = [_spend(world, world.alice, f"a{n}", 1000) for n in range(3)]
    _spend(world, world.charlie, "c1", 50_000)
    cost = _get(client, world.alice_key, "/api/v1/cost/")
    assert cost["requests"] == 3 and cost["image_tokens"] == 3000
    assert Decimal(cost["cost"]) == sum(e.cost for e in events) > 0
    assert [row["tier"] for row in cost["by_tier"]] == ["vlm-lite"]
    assert cost["by_tier"][0]["cost"] == cost["cost"] and len(cost["cost"].split(".")[1]) == 6
    assert cost["currency"] == cost["by_tier"][0]["currency"] == world.vision.price_plan.currency


def test_an_estimate_from_dimensions_matches_what_the_gateway_would_count(client, world):
    response = client.post("/api/v1/estimate/", {"tier": "vlm-lite", "width": 1920, "height": 1080},
                           HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    body = response.json()
    assert body["image_tokens"] == 1224 and body["sent_sizes"] == [[1316, 728]]
    assert Decimal(body["cost"]) > 0


def test_an_estimate_for_a_tier_without_a_price_in_effect_says_so_with_a_503(client, world):
    from controlplane.catalog.models import PricePlan, PriceRate

    later = PricePlan.objects.create(name="from-next-week")
    PriceRate.objects.create(plan=later, effective_from=timezone.now() + dt.timedelta(days=7))
    world.vision.price_plan = later
    world.vision.save()
    response = client.post("/api/v1/estimate/", {"tier": "vlm-lite", "width": 640, "height": 480},
                           HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    assert response.status_code == 503 and int(response["Retry-After"]) > 0
    assert "no price in effect" in response.json()["detail"]


def test_an_estimate_honours_low_detail_as_the_gateway_does(client, world):
    def ask(**detail):
        return client.post("/api/v1/estimate/", {"tier": "vlm-lite", "width": 1920, "height": 1080, **detail},
                           HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").json()

    low, high = ask(detail="low"), ask(detail="high")
    # The policy's low-detail cap, 200,704 pixels: 588x336 of the 1920x1080 photo (Qwen's grid).
    assert low["sent_sizes"] == [[588, 336]] and low["image_tokens"] < high["image_tokens"] == 1224
    assert Decimal(low["cost"]) < Decimal(high["cost"])


def test_an_estimate_from_an_uploaded_image(client, world):
    upload = SimpleUploadedFile("long.png", image_bytes(300, 3000, "PNG"))
    policy = world.vision.resolution_policy
    policy.max_aspect_ratio = 4
    policy.save()
    body = client.post("/api/v1/estimate/", {"tier": "vlm-lite", "image": upload},
                       HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").json()
    assert len(body["sent_sizes"]) == 3  # a long image is priced as its tiles


def test_estimates_refuse_what_the_gateway_would_refuse(client, world):
    world.bob.allowed_tiers.set([world.text])
    auth = {"HTTP_AUTHORIZATION": f"Bearer {world.bob_key}"}
    assert client.post("/api/v1/estimate/", {"tier": "vlm-lite", "width": 10, "height": 10}, **auth).status_code == 404
    assert client.post("/api/v1/estimate/", {"tier": "text", "width": 10, "height": 10}, **auth).status_code == 400
    assert client.post("/api/v1/estimate/", {"tier": "text"}, **auth).status_code == 400  # nothing to price
    svg = SimpleUploadedFile("x.svg", b"<svg xmlns='http://www.w3.org/2000/svg'/>")
    refused = client.post("/api/v1/estimate/", {"tier": "vlm-lite", "image": svg},
                          HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    assert refused.status_code == 400 and "SVG" in refused.json()["image"]


def test_the_account_endpoints_want_a_tenant_key(client, world):
    client.force_login(world.operator)
    assert client.get("/api/v1/quota/").status_code == 403
    assert client.get("/api/v1/cost/", HTTP_AUTHORIZATION="Bearer vlm-wrong").status_code == 401


def test_a_statement_reconciles_with_its_events_and_survives_a_price_change(client, world):
    import datetime as dt

    from django.utils import timezone

    from controlplane.catalog.models import PriceRate
    from controlplane.metering.models import UsageEvent

    now = timezone.now()
    for n in range(7):
        usage_record(record=UsageRecord(request_id=f"s{n}", tenant_id=world.alice.pk, api_key_id=None,
                                        tier_id=(world.vision if n % 2 else world.text).pk, image_tokens=333 * n,
                                        text_tokens=71 * n, output_tokens=13 * n, created_at=now))
    _spend(world, world.charlie, "other", 5000)
    period = f"{now:%Y-%m}"
    first = _get(client, world.alice_key, f"/api/v1/statements/{period}/")
    events = UsageEvent.objects.filter(tenant=world.alice)
    assert Decimal(first["total"]) == sum(e.cost for e in events) == sum(Decimal(line["cost"]) for line in first["lines"])
    assert [line["tier"] for line in first["lines"]] == ["text", "vlm-lite"]
    assert sum(line["requests"] for line in first["lines"]) == 7

    PriceRate.objects.create(plan=world.vision.price_plan, effective_from=now + dt.timedelta(seconds=1),
                             image_per_mtok=Decimal("99"))  # a new price, for later requests only
    assert _get(client, world.alice_key, f"/api/v1/statements/{period}/")["total"] == first["total"]
    assert client.get("/api/v1/statements/2026-13/", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").status_code == 400


def test_an_estimate_is_what_the_bill_will_be(client, world):
    """Priced as the bill prices the request: each tile on its own, each rounded, then summed
    (rounding the whole request once gave 0.003059 for three tiles billed 0.003060)."""
    from controlplane.metering.records import ImageLine

    policy = world.vision.resolution_policy
    policy.max_aspect_ratio = 4
    policy.save()
    estimate = client.post("/api/v1/estimate/", {"tier": "vlm-lite", "width": 300, "height": 3000,
                                                 "text_tokens": 33, "output_tokens": 7},
                           HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").json()
    assert len(estimate["sent_sizes"]) > 1
    from controlplane.catalog.services import tier_image_tokens

    each = [tier_image_tokens(world.vision, w, h) for w, h in estimate["sent_sizes"]]
    tile = ImageLine(source_format="png", source_width=300, source_height=3000, width=0, height=0, fingerprint="")
    bill = usage_record(record=UsageRecord(request_id="as-estimated", tenant_id=world.alice.pk, api_key_id=None,
                                           tier_id=world.vision.pk, images=[(tile, t, 0) for t in each],
                                           image_tokens=sum(each), text_tokens=33, output_tokens=7))
    assert estimate["image_tokens"] == sum(each)
    assert Decimal(estimate["cost"]) == bill.cost


def test_cost_to_date_counts_billed_requests_as_the_statement_will(client, world):
    billed = _spend(world, world.alice, "ok", 1000)
    _spend(world, world.alice, "failed", 4000, status="error")
    cost = _get(client, world.alice_key, "/api/v1/cost/")
    now = timezone.now()
    bill = _get(client, world.alice_key, f"/api/v1/statements/{now:%Y-%m}/")
    assert cost["requests"] == 1 == sum(line["requests"] for line in bill["lines"])
    assert cost["image_tokens"] == 1000 and Decimal(cost["cost"]) == billed.cost == Decimal(bill["total"])
    assert bill["unbilled_requests"] == 1


def test_an_estimate_reads_a_picture_as_far_as_its_header(client, world):
    """A 66 KB progressive JPEG of 2000x2000 whose scans cost a second to decode (here broken
    past its header, which a decode would refuse) is priced from its header alone; one of more
    scans than the gateway takes is refused as the gateway refuses it."""
    from tests.imaging_corpus import jpeg_scan_bomb

    auth = {"HTTP_AUTHORIZATION": f"Bearer {world.alice_key}"}
    costly = SimpleUploadedFile("p.jpg", jpeg_scan_bomb(2000, 2000, 60)[:-2])
    body = client.post("/api/v1/estimate/", {"tier": "vlm-lite", "image": costly}, **auth)
    assert body.status_code == 200, body.content
    assert body.json()["sent_sizes"] == client.post("/api/v1/estimate/", {"tier": "vlm-lite", "width": 2000,
                                                                           "height": 2000}, **auth).json()["sent_sizes"]
    bomb = SimpleUploadedFile("b.jpg", jpeg_scan_bomb(2000, 2000, 2646))
    refused = client.post("/api/v1/estimate/", {"tier": "vlm-lite", "image": bomb}, **auth)
    assert refused.status_code == 400 and "scans" in refused.json()["image"]


def test_estimates_are_limited_per_key(client, world, settings):
    settings.API_ESTIMATES_PER_MINUTE = 3

    def ask(key):
        return client.post("/api/v1/estimate/", {"tier": "vlm-lite", "width": 640, "height": 480},
                           HTTP_AUTHORIZATION=f"Bearer {key}")

    assert [ask(world.alice_key).status_code for _ in range(3)] == [200] * 3
    throttled = ask(world.alice_key)
    assert throttled.status_code == 429 and 0 < int(throttled["Retry-After"]) <= 60
    assert ask(world.charlie_key).status_code == 200  # another key is not held by it
