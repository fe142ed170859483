"""A picture a tenant sends again (a chat resends its earlier images on every turn) is taken
from what this gateway process made of it the first time, not decoded and checked again: the
engine is sent the same bytes, the request is metered alike, and what one tenant sent is never
another's, nor what one policy or detail made of it another's. Operators see how often it
happens at /metrics."""

from __future__ import annotations

import pytest

from controlplane.imaging.policy import Policy, normalise, normalise_tiles
from controlplane.metering.models import UsageImage
from tests.controlplane.gateway.conftest import ingested
from tests.controlplane.gateway.test_views import engines, error_of, image_message, post, routed  # noqa: F401
from tests.images import data_url, image_bytes

pytestmark = pytest.mark.django_db(transaction=True)

WHOLE = image_bytes(800, 600)  # within the policy: sent as it came, checked beside the engine
LARGE = image_bytes(2400, 1800)  # downscaled by the policy
BROKEN = WHOLE[:-3000]  # its header whole, its scans cut short: only a decode finds it out


def _ask(url, detail=None, **extra):
    return {"model": "vlm-lite", "max_tokens": 4, **extra, "messages": image_message(url, detail)}


def _images(client) -> dict[tuple[str, str], float]:
    """vlmcp_gateway_images_total by (tier, prepared)."""
    from workers.engines.metrics import parse

    series = parse(client.get("/metrics").content.decode())
    return {(labels["tier"], labels["prepared"]): value for labels, value in series.get("vlmcp_gateway_images_total", [])}


def _counted(client) -> tuple[float, float]:
    """The vision tier's images prepared new, and again, so far in this process."""
    images = _images(client)
    return images.get(("vlm-lite", "new"), 0.0), images.get(("vlm-lite", "again"), 0.0)


def _since(client, before: tuple[float, float]) -> tuple[float, float]:
    new, again = _counted(client)
    return new - before[0], again - before[1]


def _lines(response) -> list[UsageImage]:
    return list(UsageImage.objects.filter(event__request_id=response["x-request-id"]).order_by("id"))


@pytest.fixture
def metrics(settings):
    settings.DEBUG = True  # /metrics without a token


@pytest.mark.parametrize("picture", [LARGE, WHOLE], ids=["downscaled", "sent-as-it-came"])
def test_a_picture_sent_again_is_prepared_once_and_metered_alike(client, routed, ledger_mode, metrics, picture):  # noqa: F811
    before = _counted(client)
    first = post(client, routed.alice_key, _ask(data_url(picture)))
    assert first.status_code == 200, first.content
    assert _since(client, before) == (1, 0)
    second = post(client, routed.alice_key, _ask(data_url(picture)))
    assert second.status_code == 200, second.content
    assert _since(client, before) == (1, 1)
    # The engine counted the same image tokens: it was sent the same picture.
    tokens = [r.json()["usage"]["prompt_tokens_details"]["image_tokens"] for r in (first, second)]
    assert tokens[0] == tokens[1] > 0
    ingested()
    (one,), (two,) = _lines(first), _lines(second)
    seen = ("source_width", "source_height", "width", "height", "tokens", "fingerprint")
    assert [getattr(two, name) for name in seen] == [getattr(one, name) for name in seen]
    assert two.fingerprint != "" and two.width * two.height <= Policy().max_pixels


def test_another_tenant_sending_the_same_picture_gets_it_prepared_for_them(client, routed, ledger_mode, metrics):  # noqa: F811
    before = _counted(client)
    assert post(client, routed.alice_key, _ask(data_url(LARGE))).status_code == 200
    assert post(client, routed.bob_key, _ask(data_url(LARGE))).status_code == 200
    assert _since(client, before) == (2, 0)  # how long alice's took must not tell bob she sent it


def test_the_same_picture_at_another_detail_is_prepared_again(client, routed, ledger_mode, metrics):  # noqa: F811
    before = _counted(client)
    high = post(client, routed.alice_key, _ask(data_url(LARGE), "high"))
    low = post(client, routed.alice_key, _ask(data_url(LARGE), "low"))
    assert (high.status_code, low.status_code) == (200, 200)
    assert _since(client, before) == (2, 0)
    tokens = [r.json()["usage"]["prompt_tokens_details"]["image_tokens"] for r in (high, low)]
    assert tokens[0] > tokens[1]


def test_a_picture_changed_in_the_middle_is_not_taken_for_the_one_sent_before(client, routed, ledger_mode, metrics):  # noqa: F811
    changed = bytearray(LARGE)
    middle = len(changed) // 2
    changed[middle] ^= 0x01  # one bit of its scans: the same length, the same head and tail
    before = _counted(client)
    assert post(client, routed.alice_key, _ask(data_url(LARGE))).status_code == 200
    response = post(client, routed.alice_key, _ask(data_url(bytes(changed))))
    assert _since(client, before)[1] == 0
    assert response.status_code in (200, 400)  # a bit of entropy-coded data may break the scan


@pytest.mark.parametrize("detail", [["high"], {"level": "low"}, "medium"])
def test_a_detail_that_is_none_of_the_three_is_refused_as_such(client, routed, ledger_mode, detail):  # noqa: F811
    for _ in range(2):
        refused = post(client, routed.alice_key, _ask(data_url(LARGE), detail))
        assert (refused.status_code, error_of(refused)["code"]) == (400, "image_policy_violation"), refused.content


def test_a_broken_picture_sent_again_is_refused_again(client, routed, ledger_mode, metrics):  # noqa: F811
    before = _counted(client)
    for _ in range(2):
        refused = post(client, routed.alice_key, _ask(data_url(BROKEN)))
        assert (refused.status_code, error_of(refused)["code"]) == (400, "corrupt_image")
    assert _since(client, before) == (2, 0)  # prepared anew each time: never kept


def test_what_is_kept_is_bounded_in_bytes_the_least_recently_sent_forgotten_first():
    from controlplane.gateway.repeats import Key, Repeats, digest

    def picture(n: int):
        data = bytes([n]) * 1000
        return Key.of(data, scope="1", policy=Policy(), cap=Policy().max_pixels), ((normalise(WHOLE, Policy()), digest(data)),)

    size = len(normalise(WHOLE, Policy()).data) + 512
    kept = Repeats(max_bytes=3 * size)
    (a, made), (b, _), (c, _), (d, _) = (picture(n) for n in range(4))
    for key in (a, b, c):
        kept.put(key, made)
    assert kept.get(a) == made  # a sent again: now the most recent
    kept.put(d, made)  # over the bound: the least recently sent (b) is forgotten
    assert (kept.get(b), kept.get(c) is not None, kept.get(a) is not None, kept.get(d) is not None) == \
        (None, True, True, True)
    assert kept.bytes <= kept.max_bytes
    with pytest.raises(ValueError):  # an image whose check has not passed is never kept
        kept.put(a, tuple((tile, "") for tile in normalise_tiles(WHOLE, Policy(), check_later=True)))


def test_the_same_bytes_are_another_picture_for_another_tenant_policy_or_detail():
    from controlplane.gateway.repeats import Key

    policy = Policy()
    same = Key.of(WHOLE, scope="1", policy=policy, cap=policy.pixel_cap(None))
    assert same == Key.of(bytes(WHOLE), scope="1", policy=Policy(), cap=policy.pixel_cap("high"))
    assert same != Key.of(WHOLE, scope="2", policy=policy, cap=policy.pixel_cap(None))
    assert same != Key.of(WHOLE, scope="1", policy=Policy(max_long_edge=2048), cap=policy.pixel_cap(None))
    assert same != Key.of(WHOLE, scope="1", policy=policy, cap=policy.pixel_cap("low"))
