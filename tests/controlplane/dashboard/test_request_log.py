"""The request log: an operator finds a tenant's failing or slow requests, pages through them
newest first, and opens one to see its images, tokens, cost, engine and timings."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.utils import timezone

from controlplane.fleet.models import EngineInstance, Node
from controlplane.metering.records import ImageLine, UsageRecord
from controlplane.metering.services import usage_record
from controlplane.tenants.services import api_key_create
from tests.pages import field_errors

pytestmark = pytest.mark.django_db
NOW = timezone.now().replace(microsecond=0)


def _request(world, request_id, *, tenant=None, at=None, status="ok", latency=100, key=None, images=(),
             **fields):
    tenant = tenant or world.alice
    return usage_record(record=UsageRecord(
        request_id=request_id, tenant_id=tenant.pk, api_key_id=(key or tenant.api_keys.order_by("pk").first()).pk,
        tier_id=world.vision.pk, created_at=at or NOW, status=status,
        http_status=200 if status == "ok" else 502, latency_ms=latency, images=list(images),
        image_tokens=sum(tokens for _, tokens, _ in images), text_tokens=30, output_tokens=8, **fields))


def _listed(page) -> list[str]:
    return re.findall(r'data-request="([^"]+)"', page.content.decode())


def _pages(client, url) -> list[list[str]]:
    pages = []
    while url:
        page = client.get(url)
        assert page.status_code == 200
        pages.append(_listed(page))
        older = re.search(r'id="older" href="([^"]+)"', page.content.decode())
        url = "/requests/" + older.group(1).replace("&amp;", "&") if older else None
    return pages


def test_it_pages_every_request_once_newest_first_even_when_many_share_a_moment(client, world):
    # 130 requests in 13 distinct instants: a page boundary falls among requests of one instant.
    for n in range(130):
        _request(world, f"r{n:03}", at=NOW - dt.timedelta(seconds=n // 10))
    client.force_login(world.operator)
    pages = _pages(client, "/requests/")
    assert [len(p) for p in pages] == [50, 50, 30]
    seen = [request for page in pages for request in page]
    assert len(set(seen)) == 130
    # Newest first: an instant's ten requests all come before the instant before it.
    assert [int(r[1:]) // 10 for r in seen] == sorted(int(r[1:]) // 10 for r in seen)


def test_an_operator_finds_a_tenants_failing_slow_requests(client, world):
    batch = api_key_create(tenant=world.alice, name="batch").api_key
    _request(world, "fast-ok", latency=80)
    _request(world, "slow-error", status="error", latency=9000)
    _request(world, "slow-error-batch", status="error", latency=9500, key=batch)
    _request(world, "slow-aborted", status="aborted", latency=7000)
    _request(world, "bob-error", tenant=world.bob, status="error", latency=9000)
    _request(world, "old-error", status="error", latency=9000, at=NOW - dt.timedelta(days=3))
    client.force_login(world.operator)
    since = (NOW - dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    failing = _listed(client.get(f"/requests/?tenant=alice&status=failed&latency_min=5000&since={since}"))
    assert sorted(failing) == ["slow-aborted", "slow-error", "slow-error-batch"]
    # Of one instant, the one recorded last comes first.
    assert _listed(client.get(f"/requests/?tenant=alice&status=error&latency_min=5000&since={since}")) == [
        "slow-error-batch", "slow-error"]
    assert _listed(client.get(f"/requests/?key={batch.prefix}")) == ["slow-error-batch"]
    assert _listed(client.get("/requests/?latency_max=100")) == ["fast-ok"]
    assert _listed(client.get("/requests/?q=bob-error")) == ["bob-error"]
    assert "bob-error" in _listed(client.get("/requests/"))  # operators see every tenant


def test_bad_filters_are_explained_not_a_server_error(client, world):
    _request(world, "one")
    client.force_login(world.operator)
    page = client.get("/requests/?latency_min=-5&latency_max=abc&since=yesterday&status=lost")
    assert page.status_code == 200
    text = page.content.decode()
    assert "Correct the filter above." in text and _listed(page) == []
    assert "Ensure this value is greater than or equal to 0" in text
    backwards = client.get("/requests/?latency_min=900&latency_max=100").content.decode()
    assert "must not be below the latency it starts from" in backwards
    # A cursor that means nothing starts from the newest.
    assert _listed(client.get("/requests/?after=not-a-cursor")) == ["one"]


def test_a_tenant_admin_sees_only_their_own_tenants_requests(client, world):
    _request(world, "alice-1")
    _request(world, "charlie-1", tenant=world.charlie)
    client.force_login(world.alice_admin)
    assert _listed(client.get("/requests/")) == ["alice-1"]
    assert _listed(client.get("/requests/?q=charlie-1")) == []
    assert client.get("/requests/charlie-1/").status_code == 404
    assert client.get("/requests/alice-1/").status_code == 200
    # Naming another tenant in the address shows nothing of it.
    assert _listed(client.get("/requests/?tenant=charlie")) == []


def test_opening_a_request_shows_its_images_tokens_cost_engine_and_timings(client, world):
    node = Node.objects.create(name="gpu-a", address="10.0.0.5", queue="node.gpu-a")
    instance = EngineInstance.objects.create(tier=world.vision, node=node, port=8101, actual_state="running")
    photo = ImageLine(source_format="jpeg", source_width=4000, source_height=3000, width=1148, height=868,
                      fingerprint="f" * 32)
    receipt = [ImageLine(source_format="png", source_width=400, source_height=4000, width=392, height=1568,
                         fingerprint=f"{n}" * 32, tile=n, tiles=2) for n in range(2)]
    _request(world, "req_open", images=[(photo, 1276, 1276), (receipt[0], 784, 0), (receipt[1], 784, 0)],
             instance_id=instance.pk, stream=True, latency=1800, prepare_ms=42, queue_ms=7, ttft_ms=310,
             cached_tokens=1300)
    client.force_login(world.operator)
    page = client.get("/requests/req_open/").content.decode()
    images = page.split('id="images"')[1]
    photo_row, receipt_row = re.findall(r'<tr data-image="\d">(.*?)</tr>', images, re.S)
    assert "4000×3000 jpeg" in photo_row and "1148×868" in photo_row and "1,276" in photo_row
    assert "(100%)" in photo_row and "f" * 32 in photo_row
    assert "400×4000 png" in receipt_row and "392×1568, 392×1568" in receipt_row and "2 tiles" in receipt_row
    assert "1,568" in receipt_row and "(0%)" in receipt_row
    timings = page.split('id="timings"')[1].split("</section>")[0]
    for name, value in (("Image preparation", "42 ms"), ("Queue", "7 ms"), ("Time to first token", "310 ms"),
                        ("Engine", "1,751 ms"), ("Total", "1,800 ms")):
        assert re.search(rf"{name}</th><td class=\"num\">{value}", timings), name
    assert f"#{instance.pk} on gpu-a:8101" in page.split('id="engine"')[1]
    assert "USD" in page.split('id="cost"')[1].split("</td>")[0]


def test_a_request_refused_before_any_engine_says_so(client, world):
    _request(world, "req_refused", status="error", latency=3)
    client.force_login(world.finance)
    page = client.get("/requests/req_refused/").content.decode()
    assert "it never reached an engine" in page and "error" in page.split('id="status"')[1]
    assert "Time to first token</th><td class=\"num\">—" in page
    assert client.get("/requests/req_nothing/").status_code == 404


def test_a_request_refused_at_its_key_is_listed_with_the_stage_and_code_and_opens(client, world):
    key = world.alice.api_keys.get()
    usage_record(record=UsageRecord(request_id="req_revoked", tenant_id=world.alice.pk, api_key_id=key.pk,
                                    tier_id=None, created_at=NOW).failed(
        "authentication", 401, code="invalid_api_key", message="this API key was revoked"))
    client.force_login(world.alice_admin)
    row = client.get("/requests/").content.decode().split('data-request="req_revoked"')[1].split("</tr>")[0]
    assert "alice-main" in row and "error 401" in row and "invalid_api_key · checking its API key" in row
    page = client.get("/requests/req_revoked/")
    assert page.status_code == 200
    text = page.content.decode()
    why = text.split('id="failure"')[1].split("</tr>")[0]
    assert "Failed at <strong>checking its API key</strong>" in why and "this API key was revoked" in why
    assert "refused before its model was known" in text.split('id="model"')[1].split("</td>")[0]
    assert "nothing" in text.split('id="cost"')[1].split("</td>")[0]


@pytest.mark.parametrize("moment", ["9999-12-31T23:59:59-12:00", "0001-01-01T00:00:00+12:00"])
@pytest.mark.parametrize("bound", ["since", "until"])
def test_a_filter_moment_that_cannot_be_written_in_utc_is_explained(client, world, bound, moment):
    _request(world, "one")
    client.force_login(world.alice_admin)
    page = client.get("/requests/", {bound: moment})
    assert page.status_code == 200
    assert "no moment that far out can be kept" in " ".join(field_errors(page.content.decode()))


def test_a_refused_image_request_says_why_where_it_failed_and_which_key_sent_it(client, world):
    from tests.controlplane.gateway.calls import error_of, image_message, post

    response = post(client, world.alice_key, {"model": "vlm-lite",
                                              "messages": image_message("data:image/png;base64," + "QUJD" * 8)})
    told = error_of(response)
    request_id = response["x-request-id"]
    client.force_login(world.operator)

    row = client.get("/requests/").content.decode().split(f'data-request="{request_id}"')[1].split("</tr>")[0]
    assert "alice-main" in row and "error 400" in row
    assert "unsupported_image_format · reading the request and its images" in row
    page = client.get(f"/requests/{request_id}/").content.decode()
    why = page.split('id="failure"')[1].split("</tr>")[0]
    assert "Failed at <strong>reading the request and its images</strong>" in why
    assert "<code>unsupported_image_format</code>" in why and told["message"] in why
    assert "Its images were not read: image 1: " in page and "a text request" not in page


def test_a_request_no_engine_could_serve_says_so(client, world):
    from tests.controlplane.gateway.calls import post

    response = post(client, world.alice_key, {"model": "text", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 503
    client.force_login(world.alice_admin)
    page = client.get(f"/requests/{response['x-request-id']}/").content.decode()
    why = page.split('id="failure"')[1].split("</tr>")[0]
    assert "Failed at <strong>choosing an engine</strong>" in why and "engine_unavailable" in why
    assert "no healthy engine is serving" in why
    assert "No image was measured" in page


def test_a_cascades_two_attempts_are_shown_together_each_linking_the_other(client, world):
    label = "rule 1 (receipts), tenant alice"
    _request(world, "req-first", routed_by=label, escalation="low_confidence", confidence=0.4213)
    _request(world, "req-second", routed_by=label, cascade_of="req-first")
    _request(world, "req-kept", routed_by=label, confidence=0.93)
    _request(world, "req-plain")
    client.force_login(world.alice_admin)
    first = client.get("/requests/req-first/").content.decode()
    assert label in first.split('id="routed-by">')[1].split("</td>")[0]
    cascade = first.split('id="cascade"')[1].split("</section>")[0]
    assert "0.421" in cascade and "escalated: unsure" in cascade and 'href="/requests/req-second/"' in cascade
    second = client.get("/requests/req-second/").content.decode().split('id="cascade"')[1].split("</section>")[0]
    assert 'href="/requests/req-first/"' in second and "0.421" in second and "req-second</code> (this one)" in second
    kept = client.get("/requests/req-kept/").content.decode().split('id="cascade"')[1].split("</section>")[0]
    assert "kept: its answer was sent" in kept and "cascade-escalation" not in kept
    plain = client.get("/requests/req-plain/").content.decode()
    assert 'id="cascade"' not in plain and "no routing rule" in plain
