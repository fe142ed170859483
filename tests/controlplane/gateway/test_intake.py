"""What a key's requests cost before admission counts against it: a key that keeps sending
pictures that are costly to refuse is throttled with a 429 before its next pictures are
opened, and a request refused at intake is one of its minute's requests. In both ledgers."""

from __future__ import annotations

import orjson
import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from controlplane.asgi import Application
from controlplane.gateway import ledger
from controlplane.gateway.ledger import IntakeLimits
from controlplane.tenants.models import Quota
from controlplane.tenants.services import api_key_create, api_key_lookup
from tests.controlplane.gateway.calls import error_of, image_message, post
from tests.http_wire import BodyBytesTaken, answer, closed, send
from tests.images import data_url, image_bytes
from tests.imaging_corpus import jpeg_scan_bomb, png_claiming

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.accounting]

# Within the scan limit, its 60 scans each a pass over 16 MP (a tenth of a second or more),
# and cut short: refused as corrupt once every scan is decoded.
COSTLY = jpeg_scan_bomb(4000, 4000, 60, colour=True)[:-2]
BROKEN = png_claiming(800, 600)  # refused as corrupt as soon as it is decoded, before admission


def _ask(picture: bytes) -> dict:
    mime = "image/png" if picture.startswith(b"\x89PNG") else "image/jpeg"
    return {"model": "vlm-lite", "max_tokens": 4, "messages": image_message(data_url(picture, mime))}


def _in_one_window(attempt, seconds: int = 60):
    """`attempt()`'s result, tried again should a window of `seconds` (a minute's requests,
    or 10 s of CPU time and bytes) turn during it: the counts start afresh in each."""
    def window():
        now = timezone.now()
        return now.replace(second=now.second // seconds * seconds, microsecond=0)

    for _ in range(3):
        started = window()
        try:
            outcome = attempt()
        except Exception:
            if window() == started:
                raise
            continue  # what was spent in one window did not hold in the next
        if window() == started:
            return outcome
    raise AssertionError("three windows turned during the attempts")


def test_a_key_that_keeps_sending_costly_refusals_is_throttled_before_its_pictures_are_opened(
        client, routed, ledger_mode, settings):  # noqa: F811
    settings.GATEWAY_KEY_INTAKE_CPU_S = 1  # 0.17 s every 10 s

    def attempt():
        secret = api_key_create(tenant=routed.alice).secret
        answers = [post(client, secret, _ask(COSTLY)) for _ in range(8)]
        codes = [error_of(answer)["code"] for answer in answers]
        assert codes[0] == "corrupt_image", answers[0].content
        throttled = codes.index("rate_limit_exceeded")  # within 0.17 s of CPU, well before 8
        assert set(codes[throttled:]) == {"rate_limit_exceeded"}
        # A picture refused at once if it were opened gets the 429: it is not opened.
        broken = post(client, secret, _ask(BROKEN))
        assert (broken.status_code, error_of(broken)["code"]) == (429, "rate_limit_exceeded")
        assert "CPU time" in error_of(broken)["message"] and int(broken["Retry-After"]) <= 10
        # Another key of the same tenant is not held by it.
        other = post(client, routed.alice_key, _ask(image_bytes(800, 600)))
        assert other.status_code == 200, other.content

    _in_one_window(attempt, 10)


def test_requests_refused_at_intake_count_against_the_requests_per_minute(client, routed, ledger_mode):  # noqa: F811
    Quota.objects.create(tenant=routed.alice, period="day", requests_per_minute=3)

    def attempt():
        Quota.objects.filter(tenant=routed.alice).update(requests_per_minute=3)
        refused = [post(client, routed.alice_key, _ask(BROKEN)) for _ in range(3)]
        assert [error_of(answer)["code"] for answer in refused] == ["corrupt_image"] * 3
        whole = post(client, routed.alice_key, _ask(image_bytes(800, 600)))
        assert (whole.status_code, error_of(whole)["code"]) == (429, "rate_limit_exceeded"), whole.content
        Quota.objects.filter(tenant=routed.alice).update(requests_per_minute=None)  # for a retry

    _in_one_window(attempt)


def test_a_keys_own_limit_counts_its_refusals_too(client, routed, ledger_mode):  # noqa: F811
    def attempt():
        secret = api_key_create(tenant=routed.alice, requests_per_minute=2).secret
        assert [post(client, secret, _ask(BROKEN)).status_code for _ in range(2)] == [400, 400]
        throttled = post(client, secret, _ask(image_bytes(800, 600)))
        assert throttled.status_code == 429 and "this API key's limit" in error_of(throttled)["message"]

    _in_one_window(attempt)


def test_a_key_with_no_limits_is_served_as_before(client, routed, ledger_mode):  # noqa: F811
    refused = [post(client, routed.alice_key, _ask(BROKEN)).status_code for _ in range(5)]
    assert refused == [400] * 5
    assert post(client, routed.alice_key, _ask(image_bytes(800, 600))).status_code == 200


def test_a_throttled_keys_large_body_is_refused_before_it_is_read(world, serve, ledger_mode, settings):
    """Served as production serves it: the 429 comes before a byte of the declared body is taken."""
    settings.GATEWAY_KEY_INTAKE_CPU_S = 1
    app = BodyBytesTaken(Application())
    port = serve(app)

    def attempt():
        secret = api_key_create(tenant=world.alice).secret
        spent = IntakeLimits(cpu_ms=1000)  # this minute's CPU, spent already
        async_to_sync(ledger.intake_charge)(world.alice.pk, api_key_lookup(secret).pk, spent, timezone.now(),
                                            cpu_ms=5000, refused=False)
        head = f"POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Length: 3000000\nAuthorization: Bearer {secret}"
        taken = app.taken
        with send(port, head, b"x" * 65536) as client:
            got = answer(client)
            assert got.status == 429 and orjson.loads(got.body)["error"]["code"] == "rate_limit_exceeded"
            assert closed(client)
        assert app.taken == taken

    _in_one_window(attempt, 10)


def test_a_key_that_sends_more_megabytes_than_a_minute_allows_is_throttled(client, routed, ledger_mode, settings):  # noqa: F811
    settings.GATEWAY_KEY_INTAKE_MB = 6  # 1 MB every 10 s
    bulky = {"model": "text", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 120_000}]}

    def attempt():
        secret = api_key_create(tenant=routed.alice).secret
        first, second, third = (post(client, secret, bulky) for _ in range(3))  # 600 KB each
        assert 429 not in (first.status_code, second.status_code)
        assert third.status_code == 429 and "share of request bodies" in error_of(third)["message"]

    _in_one_window(attempt, 10)
