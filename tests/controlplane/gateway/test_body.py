"""A large body is read with its images' base64 decoded where it lies, and reads exactly as the
whole body read as JSON does (the same values, the same errors), whatever is written around,
inside or instead of those images."""

from __future__ import annotations

import json
import random

import orjson
import pytest

from controlplane.gateway.body import LARGE_BODY, TooComplex, read_body
from controlplane.imaging.errors import ImageTooLarge
from controlplane.imaging.intake import image_source_bytes
from controlplane.imaging.policy import DecodedDataURL, decode_data_url
from controlplane.metering.models import UsageEvent
from tests.controlplane.gateway.calls import error_of, image_message, post
from tests.images import data_url, noise_bytes

PHOTO = random.Random(1).randbytes(900_000)  # base64 of 1.2 MB: a body the gateway looks through
URL = data_url(PHOTO)
OTHER = data_url(random.Random(2).randbytes(200_000), "image/png")
LARGE_PNG = data_url(noise_bytes(900, 600), "image/png")  # over a megabyte of base64


def _plain(value):
    """`value` with each decoded URL as the string it was."""
    if isinstance(value, DecodedDataURL):
        return str(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _read(raw: bytes):
    """read_body(raw), having checked it reads as the whole body does: the same values, or the
    same kind of error."""
    assert len(raw) >= LARGE_BODY
    try:
        whole = orjson.loads(raw)
    except ValueError as exc:
        with pytest.raises(type(exc)):
            read_body(raw)
        return None
    read = read_body(raw)
    assert _plain(read) == whole
    return read


def _body(*parts, **extra) -> bytes:
    return json.dumps({"model": "vlm-lite", **extra, "messages": [{"role": "user", "content": list(parts)}]}).encode()


def _urls(read) -> list:
    return [part.get("image_url", part.get("input_image")) for part in read["messages"][0]["content"]
            if part["type"] != "text"]


def test_an_images_base64_is_decoded_where_it_lies():
    read = _read(_body({"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": URL}}))
    (url,) = _urls(read)
    assert isinstance(url["url"], DecodedDataURL) and url["url"].data == PHOTO
    assert image_source_bytes(url["url"], max_bytes=10**7, fetch=None) == decode_data_url(URL, max_bytes=10**7)


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": URL},  # the URL as the part's value
    {"type": "input_image", "input_image": {"url": URL, "detail": "high"}},
    {"type": "image_url", "image_url": {"url": data_url(PHOTO, "image/jpeg;name=cat.jpg")}},
], ids=["bare string", "input_image", "with a parameter"])
def test_every_way_of_writing_an_image_has_it_decoded(part):
    read = _read(_body(part))
    (url,) = _urls(read)
    assert isinstance(url if isinstance(url, DecodedDataURL) else url["url"], DecodedDataURL)


def test_several_images_each_come_back_in_their_place():
    read = _read(_body({"type": "image_url", "image_url": {"url": URL}}, {"type": "text", "text": "and"},
                       {"type": "image_url", "image_url": {"url": OTHER}}))
    assert [url["url"].data for url in _urls(read)] == [PHOTO, decode_data_url(OTHER, max_bytes=10**7)]


@pytest.mark.parametrize("raw", [
    # Escaped slashes, as some JSON writers put them: read whole, the same URL.
    _body({"type": "image_url", "image_url": {"url": URL}}).replace(b"/", b"\\/"),
    # A data URL that is text, not an image: it stays text.
    _body({"type": "text", "text": URL}),
    _body({"type": "image_url", "image_url": {"url": OTHER}}, metadata={"source": URL}),
    _body({"type": "text", "text": '"' + URL}),  # after an escaped quote, inside the text
    _body({"type": "text", "text": 'see "' + URL + '" here'}),
    # Under another part's key than the one its type reads.
    _body({"type": "input_image", "image_url": {"url": URL}}),
    # Not base64, or not all of it: refused later, read as the string it is.
    _body({"type": "image_url", "image_url": {"url": URL[:5000] + "!" + URL[5000:]}}),
    _body({"type": "image_url", "image_url": {"url": "data:image/png," + URL[30:]}}),
    _body({"type": "image_url", "image_url": {"url": "data:image/jpeg;base64;base64," + URL[23:]}}),
], ids=["escaped slashes", "in a text", "in metadata", "after an escaped quote", "quoted in a text",
        "under another key", "a stray character", "not base64", "base64 twice"])
def test_what_is_not_an_image_url_of_base64_reads_as_the_whole_does(raw):
    read = _read(raw)
    assert not any(isinstance(url, DecodedDataURL) or isinstance(url, dict) and isinstance(url.get("url"), DecodedDataURL)
                   for url in _urls(read) if url is not None)


def test_a_body_of_countless_data_urls_is_read_whole():
    # Looked through a place at a time, it would hold the event loop for far longer than
    # msgspec takes to read it whole (8 MB of '"data:,",' took 0.45 s against 0.05).
    few, many = ([{"type": "text", "text": "data:,"}] * count for count in (10, 100))
    assert isinstance(_urls(_read(_body(*few, {"type": "image_url", "image_url": {"url": URL}})))[0]["url"],
                      DecodedDataURL)
    assert isinstance(_urls(_read(_body(*many, {"type": "image_url", "image_url": {"url": URL}})))[0]["url"], str)


def test_a_key_written_twice_reads_as_the_whole_does():
    part = '{"type": "image_url", "image_url": {"url": "%s", "url": "%s"}}'
    for first, last in ((URL, OTHER), (OTHER, URL)):
        raw = ('{"model": "vlm-lite", "messages": [{"role": "user", "content": [%s]}]}' % (part % (first, last))).encode()
        _read(raw)


@pytest.mark.parametrize("raw", [
    _body({"type": "image_url", "image_url": {"url": URL}}).replace(b"}]}]}", b"}]},]}"),  # a trailing comma
    _body({"type": "image_url", "image_url": {"url": URL}}, user="\\ud800").replace(b"\\\\ud800", b"\\ud800"),
    _body({"type": "image_url", "image_url": {"url": URL}}).replace(URL[4000:4004].encode(), b"AA\nA", 1),
    _body({"type": "image_url", "image_url": {"url": URL}})[:-3],  # cut short
    b"[" * 5000 + _body({"type": "image_url", "image_url": {"url": URL}}) + b"]" * 5000,
], ids=["a trailing comma", "a lone surrogate", "a raw newline", "cut short", "nested too deep"])
def test_a_body_that_is_not_json_is_refused_as_the_whole_is(raw):
    assert _read(raw) is None


def test_a_decoded_image_is_refused_by_its_size_as_its_string_is():
    read = _read(_body({"type": "image_url", "image_url": {"url": URL}}))
    with pytest.raises(ImageTooLarge) as decoded:
        image_source_bytes(_urls(read)[0]["url"], max_bytes=len(PHOTO) - 1, fetch=None)
    with pytest.raises(ImageTooLarge) as whole:
        image_source_bytes(URL, max_bytes=len(PHOTO) - 1, fetch=None)
    assert str(decoded.value) == str(whole.value)


@pytest.mark.django_db
def test_a_large_image_is_served_alike_with_its_slashes_escaped_or_not(client, routed):  # noqa: F811
    body = json.dumps({"model": "vlm-lite", "max_tokens": 4, "messages": image_message(LARGE_PNG)}).encode()
    assert len(body) > LARGE_BODY
    plain, escaped = (post(client, routed.alice_key, raw) for raw in (body, body.replace(b"/", b"\\/")))
    assert (plain.status_code, escaped.status_code) == (200, 200), (plain.content, escaped.content)
    assert plain.json()["usage"]["prompt_tokens"] == escaped.json()["usage"]["prompt_tokens"]


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["image_url", "input_image"])
def test_a_large_image_whose_url_is_the_parts_value_is_served(client, routed, kind):  # noqa: F811
    message = {"role": "user", "content": [{"type": "text", "text": "what is this"}, {"type": kind, kind: LARGE_PNG}]}
    response = post(client, routed.alice_key, {"model": "vlm-lite", "max_tokens": 4, "messages": [message]})
    assert response.status_code == 200, response.content
    assert UsageEvent.objects.get(request_id=response["x-request-id"]).image_count == 1


@pytest.mark.django_db
def test_a_large_image_with_a_stray_character_is_refused_as_a_small_one_is(client, routed):  # noqa: F811
    broken = LARGE_PNG[:70_000] + "!" + LARGE_PNG[70_000:]
    response = post(client, routed.alice_key, {"model": "vlm-lite", "messages": image_message(broken)})
    assert (response.status_code, error_of(response)["code"]) == (400, "invalid_image_url")
    assert "image 1" in error_of(response)["message"]


@pytest.mark.parametrize("raw", [
    # 2,048 messages of 1,024 parts each: 54.6 MB that took 0.6 s to parse, and 3.5 s in all.
    orjson.dumps({"model": "vlm-lite", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}] * 1024}] * 2048}),
    b'{"model": "vlm-lite", "metadata": {"a": [' + b",".join([b"[]"] * 1_000_000) + b"]}}",
    b'{"model": "vlm-lite", "logit_bias": {' + b",".join(b'"%d": 1' % i for i in range(70_000)) + b"}}",
    b'{"model": "vlm-lite", "stop": [' + b",".join([b"1.7976931348623157e308"] * 200_000) + b"]}",
], ids=["two million parts", "a million arrays", "70,000 keys", "200,000 numbers"])
def test_a_body_of_more_json_than_a_request_can_use_is_refused_before_it_is_read(raw):
    with pytest.raises(TooComplex):
        read_body(raw)


def test_a_long_prompt_is_read():
    prose = "It was the best of times, it was the worst of times: " * 20_000  # a megabyte, 40,000 commas
    assert read_body(_body({"type": "text", "text": prose}))["messages"][0]["content"][0]["text"] == prose


@pytest.mark.django_db
def test_a_body_of_two_million_parts_is_a_400_before_it_is_read(client, routed):  # noqa: F811
    body = {"model": "vlm-lite", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1024}] * 2048}
    response = post(client, routed.alice_key, body)
    assert (response.status_code, error_of(response)["code"]) == (400, "request_too_complex")


@pytest.mark.django_db
def test_content_parts_are_counted_over_the_whole_request(client, routed):  # noqa: F811
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1000}] * 5
    response = post(client, routed.alice_key, {"model": "vlm-lite", "messages": messages})
    assert response.status_code == 400
    assert "5000 content parts in all; at most 4096" in error_of(response)["message"]
