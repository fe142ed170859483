"""A picture a tenant sends again (a chat resends its earlier images on every turn) is taken
from what this gateway process made of it the first time, not decoded and checked again: the
engine is sent the same bytes, the request is metered alike, and what one tenant sent is never
another's, nor what one policy or detail made of it another's. Operators see how often it
happens at /metrics."""

from __future__ import annotations

import asyncio
import os
import threading

import httpx
import pytest
from asgiref.sync import async_to_sync

from controlplane.asgi import application
from controlplane.imaging.policy import Policy, normalise, normalise_tiles
from controlplane.metering.models import UsageImage
from tests.controlplane.gateway.calls import error_of, image_message, post
from tests.controlplane.gateway.conftest import ingested
from tests.images import data_url, image_bytes

pytestmark = pytest.mark.django_db(transaction=True)

WHOLE = image_bytes(800, 600)  # within the policy: sent as it came, checked beside the engine
LARGE = image_bytes(2400, 1800)  # downscaled by the policy
BROKEN = WHOLE[:-3000]  # its header whole, its scans cut short: only a decode finds it out


def _ask(url, detail=None, **extra):
    return {"model": "vlm-lite", "max_tokens": 4, **extra, "messages": image_message(url, detail)}


def _images(client) -> dict[tuple[str, str], float]:
    """vlmcp_gateway_images_total by (tier, prepared)."""
    from controlplane.fleet.engine_metrics import parse

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


@pytest.mark.parametrize("picture", [LARGE, WHOLE], ids=["downscaled", "sent-as-it-came"])
def test_a_picture_sent_again_is_answered_while_every_worker_thread_is_busy(client, routed, ledger_mode, metrics,  # noqa: F811
                                                                              picture):
    # Worker threads prepare new pictures (a 12 MP photo's decode takes tens of milliseconds):
    # one sent again needs none of them, and does not wait in their queue.
    assert post(client, routed.alice_key, _ask(data_url(picture))).status_code == 200
    before = _counted(client)

    @async_to_sync
    async def again_while_busy():
        release, loop = threading.Event(), asyncio.get_running_loop()
        busy = [loop.run_in_executor(None, release.wait, 60) for _ in range(64)]
        try:  # through the production front (controlplane.asgi)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application),
                                         base_url="http://127.0.0.1") as front:
                sent = front.post("/v1/chat/completions", json=_ask(data_url(picture)),
                                  headers={"Authorization": f"Bearer {routed.alice_key}"})
                return await asyncio.wait_for(sent, 30)
        finally:
            release.set()
            await asyncio.gather(*busy)

    again = again_while_busy()
    assert again.status_code == 200, again.text
    assert _since(client, before) == (0, 1)


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


# Replicas behind a load balancer: each keeps its own, and with GATEWAY_SHARED_REPEATS_URL they
# share one Redis, so a chat's next turn on another replica finds what the first made of it.


def _shared(prefix: str, url: str | None = None, ttl_s: int = 60):
    """A replica's own client of the shared store."""
    from django.conf import settings

    from controlplane.gateway.apps import current_process
    from controlplane.gateway.repeats import Shared

    return Shared(url or settings.REDIS_URL, prefix=prefix, ttl_s=ttl_s, counters=current_process().counters)


def _prefix() -> str:
    import uuid

    return f"tests-{uuid.uuid4().hex}"


def _shared_outcomes(client) -> dict[str, float]:
    from controlplane.fleet.engine_metrics import parse

    series = parse(client.get("/metrics").content.decode())
    return {labels["outcome"]: value for labels, value in series.get("vlmcp_gateway_shared_pictures_total", [])}


def _until_written(shared, count: int = 1) -> None:
    """Entries are written on a thread of their own, after the answer."""
    import time

    for _ in range(200):
        if len(shared._reads.keys(shared.prefix + "*")) >= count:
            return
        time.sleep(0.01)
    raise AssertionError("the picture never reached the shared store")


@pytest.mark.parametrize("picture", [LARGE, WHOLE], ids=["downscaled", "sent-as-it-came"])
def test_a_picture_one_replica_prepared_is_taken_by_another_from_the_store_they_share(
        client, routed, ledger_mode, metrics, monkeypatch, picture):  # noqa: F811
    from controlplane.gateway.apps import current_process
    from controlplane.gateway.repeats import Repeats, Shared
    from tests.conftest import skip_without_redis

    skip_without_redis()
    monkeypatch.setattr(Shared, "MIN_BYTES", 0)  # these pictures are small
    prefix = _prefix()
    one, other = _shared(prefix), _shared(prefix, ttl_s=600)
    before, outcomes = _counted(client), _shared_outcomes(client)

    monkeypatch.setattr(current_process(), "prepared_images", Repeats(10**8, shared=one))
    first = post(client, routed.alice_key, _ask(data_url(picture)))
    assert first.status_code == 200, first.content
    _until_written(one)
    monkeypatch.setattr(current_process(), "prepared_images", Repeats(10**8, shared=other))
    second = post(client, routed.alice_key, _ask(data_url(picture)))
    assert second.status_code == 200, second.content
    assert _since(client, before) == (1, 1)  # the second replica decoded and checked nothing
    assert _shared_outcomes(client).get("hit", 0) - outcomes.get("hit", 0) == 1
    (entry,) = one._reads.keys(prefix + "*")
    assert one._reads.ttl(entry) > 60  # a picture in use lives on from when it was last asked for
    tokens = [r.json()["usage"]["prompt_tokens_details"]["image_tokens"] for r in (first, second)]
    assert tokens[0] == tokens[1] > 0
    ingested()
    (a,), (b,) = _lines(first), _lines(second)
    seen = ("source_width", "source_height", "width", "height", "tokens", "fingerprint")
    assert [getattr(b, name) for name in seen] == [getattr(a, name) for name in seen] and b.fingerprint
    # and never another tenant's: bob sending the same bytes has them prepared for him
    assert post(client, routed.bob_key, _ask(data_url(picture))).status_code == 200
    assert _since(client, before) == (2, 1)


@pytest.mark.parametrize("store", ["down", "silent"])
def test_a_shared_store_down_or_silent_costs_a_request_nothing_but_its_picture_prepared_here(
        client, routed, ledger_mode, metrics, monkeypatch, store):  # noqa: F811
    import socket
    import time

    from controlplane.gateway.apps import current_process
    from controlplane.gateway.repeats import Repeats, Shared

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    if store == "silent":
        listener.listen(16)  # connections are taken, and nothing is ever answered
    port = listener.getsockname()[1]
    if store == "down":
        listener.close()  # nothing listens there: refused
    monkeypatch.setattr(Shared, "PAUSE_S", 60.0)
    monkeypatch.setattr(Shared, "MIN_BYTES", 0)  # these pictures are small
    monkeypatch.setattr(Shared, "WRITE_TIMEOUT_S", 0.3)
    shared = _shared(_prefix(), f"redis://127.0.0.1:{port}/0")
    monkeypatch.setattr(current_process(), "prepared_images", Repeats(10**8, shared=shared))
    try:
        before, outcomes = _counted(client), _shared_outcomes(client)
        pictures = [LARGE, image_bytes(2000, 1500), image_bytes(1600, 1600)]  # none kept by this replica
        answers = [post(client, routed.alice_key, _ask(data_url(picture))).status_code for picture in pictures]
        for _ in range(250):  # the writes, on a thread of their own, are over
            if not shared._writing:
                break
            time.sleep(0.02)
    finally:
        listener.close()
    assert answers == [200, 200, 200]
    assert _since(client, before) == (3, 0)
    # The first request found it failing (refused at once, or silent for its 0.1 s), and so
    # did the first write; the replica then left it alone: not asked again, nothing written.
    assert _shared_outcomes(client).get("failed", 0) - outcomes.get("failed", 0) == 2


def test_an_entry_of_the_shared_store_is_taken_only_if_it_reads_back_whole_and_as_written():
    import orjson

    from controlplane.gateway.repeats import Key, digest, packed, unpacked

    long = image_bytes(200, 5000)
    tiles = tuple((tile, digest(tile.data)) for tile in normalise_tiles(long, Policy()))
    assert len(tiles) > 1  # a long picture cut in tiles: several images in one entry
    key = Key.of(long, scope="7", policy=Policy(), cap=Policy().max_pixels)
    entry = packed(tiles, key)
    assert unpacked(entry, key) == tiles
    for another in (Key.of(long, scope="8", policy=Policy(), cap=Policy().max_pixels),
                    Key.of(long, scope="7", policy=Policy(), cap=Policy().low_detail_max_pixels)):
        assert unpacked(entry, another) is None  # an entry of another tenant's or detail's picture

    flipped = bytearray(entry)
    flipped[-10] ^= 0x01  # a bit of the last image's bytes
    broken = [entry[:-1], entry + b"x", bytes(flipped), b"", b"\x00\x00\x00\x05nope!", b"\xff\xff\xff\xff{}"]

    def rewritten(change) -> bytes:
        """The entry with its head changed by `change`, well formed otherwise."""
        size = int.from_bytes(entry[:4], "big")
        head = orjson.loads(entry[4:4 + size])
        change(head)
        new = orjson.dumps(head)
        return len(new).to_bytes(4, "big") + new + entry[4 + size:]

    def image_field(name, value):
        return lambda head: head["images"][0].__setitem__(name, value)

    assert unpacked(rewritten(lambda head: None), key) == tiles  # rewriting alone changes nothing
    broken += [rewritten(change) for change in (
        image_field("source_width", "800"), image_field("fingerprint", [1]), image_field("tile", -1),
        image_field("tiles", "2"), image_field("width", True), image_field("height", 0), image_field("tile", 1),
        image_field("length", 1.5), image_field("mime", None), lambda head: head.pop("scope"),
        lambda head: head.__setitem__("images", {}), lambda head: head["images"].__setitem__(0, []))]
    for blob in broken:
        assert unpacked(blob, key) is None


def test_replicas_name_a_picture_alike_in_the_shared_store_and_never_across_tenants_or_policies():
    import subprocess
    import sys

    from controlplane.gateway.counters import Counters
    from controlplane.gateway.repeats import Key, Shared

    one, other = (Shared("redis://127.0.0.1:6379/0", prefix="p", ttl_s=60, counters=Counters()) for _ in range(2))
    policy = Policy()
    key = Key.of(WHOLE, scope="1", policy=policy, cap=policy.max_pixels)
    assert one.name(key) == other.name(Key.of(bytes(WHOLE), scope="1", policy=Policy(), cap=policy.max_pixels))
    # and in another process, its string hashes salted otherwise: another replica
    script = ("import os, django; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'tests.settings'); django.setup(); "
              "from controlplane.gateway.counters import Counters; from controlplane.gateway.repeats import Key, Shared; from controlplane.imaging.policy import Policy; "
              "from tests.images import image_bytes; "
              "print(Shared('redis://127.0.0.1:6379/0', prefix='p', ttl_s=60, counters=Counters()).name("
              "Key.of(image_bytes(800, 600), scope='1', policy=Policy(), cap=Policy().max_pixels)))")
    elsewhere = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                               env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert elsewhere == one.name(key)
    for another in (Key.of(WHOLE, scope="2", policy=policy, cap=policy.max_pixels),
                    Key.of(WHOLE, scope="1", policy=Policy(output_quality=90), cap=policy.max_pixels),
                    Key.of(WHOLE, scope="1", policy=policy, cap=policy.low_detail_max_pixels),
                    Key.of(LARGE, scope="1", policy=policy, cap=policy.max_pixels)):
        assert one.name(another) != one.name(key)
    assert Shared("redis://127.0.0.1:6379/0", prefix="q", ttl_s=60, counters=Counters()).name(key) != one.name(key)
    assert one.name(key).startswith("p:repeats:") and ":1:" in one.name(key)  # the tenant in the clear


def test_a_picture_cheaper_to_prepare_than_to_share_is_neither_asked_for_nor_written(
        client, routed, ledger_mode, metrics, monkeypatch):  # noqa: F811
    from controlplane.gateway.apps import current_process
    from controlplane.gateway.repeats import Repeats, Shared

    shared = _shared(_prefix(), "redis://127.0.0.1:1/0")  # were it asked, it would fail
    monkeypatch.setattr(current_process(), "prepared_images", Repeats(10**8, shared=shared))
    before, outcomes = _counted(client), _shared_outcomes(client)
    assert len(LARGE) < Shared.MIN_BYTES
    for _ in range(2):
        assert post(client, routed.alice_key, _ask(data_url(LARGE))).status_code == 200
    assert _since(client, before) == (1, 1)  # kept by the replica all the same
    assert _shared_outcomes(client) == outcomes  # the store was never asked, nor written to


def _with_metadata(picture: bytes, text: str) -> bytes:
    """`picture` (a PNG or a JPEG) with a text chunk or comment of `text`: the same pixels."""
    import io

    from PIL import Image, PngImagePlugin

    image, out = Image.open(io.BytesIO(picture)), io.BytesIO()
    if image.format == "PNG":
        info = PngImagePlugin.PngInfo()
        info.add_text("Comment", text)
        image.save(out, "PNG", pnginfo=info)
        return out.getvalue()
    return picture[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text.encode() + picture[2:]


@pytest.mark.parametrize("picture", [image_bytes(2400, 1800, "PNG"), LARGE], ids=["png", "jpeg"])
def test_a_picture_sent_again_with_other_metadata_is_found_again(client, routed, ledger_mode, metrics, picture):  # noqa: F811
    """Changing a text chunk or a comment changes the bytes, not the pixels: not decoded again."""
    before = _counted(client)
    first = post(client, routed.alice_key, _ask(data_url(_with_metadata(picture, "one"), "image/png")))
    second = post(client, routed.alice_key, _ask(data_url(_with_metadata(picture, "two"), "image/png")))
    assert (first.status_code, second.status_code) == (200, 200), second.content
    assert _since(client, before) == (1, 1)
