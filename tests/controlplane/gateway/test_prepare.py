"""An image the policy leaves as it is goes to the engine before its check (a whole decode, its
fingerprint) has finished: nothing is answered before the check, and an image that fails it
is refused as it would have been at once, its request metered at no cost, its quota released."""

from __future__ import annotations

import io

import pytest

from controlplane.imaging.policy import Policy, normalise
from controlplane.metering.models import UsageEvent, UsageImage
from controlplane.tenants.models import Quota
from tests.controlplane.gateway.calls import error_of, image_message, post
from tests.controlplane.gateway.conftest import ingested
from tests.images import data_url, image_bytes
from tests.imaging_corpus import jpeg_scan_bomb, png_claiming

pytestmark = pytest.mark.django_db(transaction=True)

WHOLE = image_bytes(800, 600)  # within the policy: sent as it came
BROKEN = WHOLE[:-3000]  # its header whole, its scans cut short: only a decode finds it out


def _ask(url, **extra):
    return {"model": "vlm-lite", "max_tokens": 600, **extra, "messages": image_message(url)}


@pytest.mark.parametrize("stream", [False, True])
def test_an_image_that_fails_its_check_is_refused_and_costs_nothing(client, routed, ledger_mode, stream):  # noqa: F811
    # Room for one request at a time: a reservation left behind would refuse the next.
    Quota.objects.create(tenant=routed.alice, period="day", total_tokens=1500)
    refused = post(client, routed.alice_key, _ask(data_url(BROKEN), stream=stream))
    assert refused.status_code == 400, refused.content
    assert error_of(refused)["code"] == "corrupt_image" and "image 1" in error_of(refused)["message"]
    served = post(client, routed.alice_key, _ask(data_url(WHOLE)))
    assert served.status_code == 200, served.content
    ingested()
    failed = UsageEvent.objects.get(request_id=refused["x-request-id"])
    assert (failed.status, failed.http_status, failed.cost) == ("error", 400, 0)


def test_a_broken_image_is_a_400_where_there_is_no_engine_to_send_it_to(client, world, ledger_mode):
    refused = post(client, world.alice_key, _ask(data_url(BROKEN)))
    assert (refused.status_code, error_of(refused)["code"]) == (400, "corrupt_image")
    assert post(client, world.alice_key, _ask(data_url(WHOLE))).status_code == 503  # a whole one: no engine


def test_a_broken_image_is_a_400_where_the_quota_is_spent(client, world, ledger_mode):
    Quota.objects.create(tenant=world.alice, period="day", total_tokens=10)
    refused = post(client, world.alice_key, _ask(data_url(BROKEN)))
    assert (refused.status_code, error_of(refused)["code"]) == (400, "corrupt_image")
    assert post(client, world.alice_key, _ask(data_url(WHOLE))).status_code == 429  # a whole one: the quota


def test_an_image_checked_beside_the_engine_is_metered_with_its_fingerprint(client, routed, ledger_mode):  # noqa: F811
    response = post(client, routed.alice_key, _ask(data_url(WHOLE), max_tokens=4))
    assert response.status_code == 200
    ingested()
    line = UsageImage.objects.get(event__request_id=response["x-request-id"])
    assert (line.width, line.height) == (800, 600)
    assert line.fingerprint == normalise(WHOLE, Policy()).fingerprint


def test_a_request_that_fails_at_its_engine_is_metered_with_its_images_fingerprints(world, ledger_mode):
    """Its record is not laid out from the engine's answer: its lines get their fingerprints
    from the check, which may still be running when the request is admitted."""
    from PIL import Image

    from tests.engines import dies_mid_body, with_raw_engine

    noise = io.BytesIO()  # a photo whose check takes a few milliseconds, longer than its admission
    Image.effect_noise((1155, 866), 80).convert("RGB").save(noise, "JPEG", quality=95)
    (first, _), (second, _) = with_raw_engine(world, dies_mid_body, _ask(data_url(noise.getvalue()), max_tokens=4))
    assert (first, second) == (502, 502)
    ingested()
    lines = UsageImage.objects.filter(event__tenant=world.alice)
    assert [line.fingerprint for line in lines] == [normalise(noise.getvalue(), Policy()).fingerprint] * 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_polyglot_within_the_policy_is_refused_as_such_and_never_kept(client, routed, ledger_mode, stream):  # noqa: F811
    """Sent as it came, its search for a document runs with its check, beside the engine: the
    client still gets the polyglot's 400, at no cost, and sending it again is refused again."""
    polyglot = WHOLE + b"<script>fetch('/steal')</script>"
    for _ in range(2):
        refused = post(client, routed.alice_key, _ask(data_url(polyglot), stream=stream))
        assert refused.status_code == 400, refused.content
        assert error_of(refused)["code"] == "polyglot_image" and "image 1" in error_of(refused)["message"]
    ingested()
    assert [event.cost for event in UsageEvent.objects.filter(tenant=routed.alice)] == [0, 0]


@pytest.mark.parametrize("image, code", [(WHOLE + b"<script>fetch('/steal')</script>", "polyglot_image"),
                                         (BROKEN, "corrupt_image")], ids=["polyglot", "broken"])
@pytest.mark.parametrize("beside", ["an unreadable second image", "text past the context"])
def test_an_image_failing_its_check_is_refused_for_it_whatever_else_the_request_gets_wrong(
        client, routed, ledger_mode, beside, image, code):  # noqa: F811
    """Its check (with its search for a document) runs after the request's other checks have
    begun: a refusal for another reason must not hide it (it came first when a polyglot was
    searched for at intake)."""
    messages = image_message(data_url(image))
    if beside == "an unreadable second image":
        messages[0]["content"].append({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
    else:
        messages[0]["content"].append({"type": "text", "text": "word " * 40_000})
    refused = post(client, routed.alice_key, {"model": "vlm-lite", "max_tokens": 4, "messages": messages})
    assert refused.status_code == 400, refused.content
    assert error_of(refused)["code"] == code and "image 1" in error_of(refused)["message"]


def test_a_jpeg_of_thousands_of_scans_is_refused_before_it_is_decoded(client, routed, ledger_mode):  # noqa: F811
    """194 KB, a progressive JPEG of 2,646 valid scans: each a pass of the decoder over 16 MP."""
    bomb = jpeg_scan_bomb(4000, 4000, 2646, colour=True)
    refused = post(client, routed.alice_key, _ask(data_url(bomb)))
    assert refused.status_code == 400, refused.content
    assert error_of(refused)["code"] == "image_too_complex"
    assert "64 scans" in error_of(refused)["message"]


def test_a_picture_past_the_requests_total_is_refused_by_its_header(client, routed, ledger_mode):  # noqa: F811
    """A PNG of 7000x7000 (143 KB of zeros) is refused by its header's size: its rows (garbage,
    here) are never decoded."""
    refused = post(client, routed.alice_key, _ask(data_url(png_claiming(7000, 7000), "image/png")))
    assert refused.status_code == 400, refused.content
    assert error_of(refused)["code"] == "image_too_large"
    assert "pixels in total" in error_of(refused)["message"]


def test_a_picture_that_finds_every_decode_busy_is_a_503_to_retry(client, routed, ledger_mode, monkeypatch):  # noqa: F811
    from controlplane.gateway.apps import current_process
    from controlplane.imaging.budget import DecodeMemory

    shared = DecodeMemory(64 << 20, wait_s=0.05)
    monkeypatch.setattr(current_process(), "decode_memory", shared)
    with shared.holding(64 << 20):  # other requests' decodes hold all of it
        busy = post(client, routed.alice_key, _ask(data_url(image_bytes(2400, 1800))))
    assert (busy.status_code, error_of(busy)["code"]) == (503, "service_unavailable")
    assert busy["Retry-After"] == "1"
    assert post(client, routed.alice_key, _ask(data_url(image_bytes(2400, 1800)))).status_code == 200
