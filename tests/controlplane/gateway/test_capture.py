"""A tenant or key may have its requests' bodies and answers captured for debugging: off by
default, images kept as thumbnails of what the engine was sent, deleted after the retention
period, shown to operators only."""

from __future__ import annotations

import base64
import datetime as dt
import io
import json

import pytest
from django.utils import timezone
from PIL import Image

from controlplane.metering.captures import captures_prune
from controlplane.metering.models import RequestCapture
from controlplane.tenants.services import api_key_create
from tests.controlplane.gateway.calls import image_message, post, post_and_read_stream
from tests.images import data_url, image_bytes

pytestmark = pytest.mark.django_db(transaction=True)


BODY = {"model": "vlm-lite", "max_tokens": 8, "messages": image_message(data_url(image_bytes(1920, 1080)))}


def _ask(client, secret):
    return post(client, secret, BODY)


def test_nothing_is_captured_unless_the_tenant_or_key_asks(client, routed):
    assert _ask(client, routed.alice_key).status_code == 200
    assert not RequestCapture.objects.exists()


def test_a_tenant_that_captures_keeps_each_body_with_a_thumbnail_and_its_answer(client, routed):
    routed.alice.capture_bodies = True
    routed.alice.save()
    response = _ask(client, routed.alice_key)
    captured = RequestCapture.objects.get(request_id=response["x-request-id"])
    (message,) = captured.request["messages"]
    text, picture = message["content"]
    assert text["text"] == "what is this"
    header, encoded = picture["image_url"]["url"].split(",", 1)
    assert header == "data:image/jpeg;base64"
    thumbnail = Image.open(io.BytesIO(base64.b64decode(encoded)))
    assert max(thumbnail.size) <= 160 and thumbnail.size[0] > thumbnail.size[1]  # the photo, small
    assert json.loads(captured.response)["choices"][0]["message"]["content"] == \
        response.json()["choices"][0]["message"]["content"]
    assert captured.tenant == routed.alice


def test_a_key_that_captures_keeps_a_streams_text_and_other_keys_do_not(client, routed):
    capturing = api_key_create(tenant=routed.alice, name="debug")
    capturing.api_key.capture_bodies = True
    capturing.api_key.save()
    streamed, raw = post_and_read_stream(capturing.secret, {**BODY, "stream": True})
    text = "".join(json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
                   for line in raw.decode().split("\n\n")
                   if line.startswith("data: {") and json.loads(line[5:]).get("choices"))
    captured = RequestCapture.objects.get(request_id=streamed["x-request-id"])
    assert captured.response == text and text
    assert _ask(client, routed.alice_key).status_code == 200
    assert RequestCapture.objects.count() == 1


def test_captures_are_deleted_after_the_retention_period(routed, settings):
    settings.CAPTURE_RETENTION_HOURS = 72
    now = timezone.now()
    for hours, request_id in ((1, "recent"), (73, "old")):
        RequestCapture.objects.create(request_id=request_id, tenant=routed.alice, request={},
                                      created_at=now - dt.timedelta(hours=hours))
    assert captures_prune(now=now) == 1
    assert list(RequestCapture.objects.values_list("request_id", flat=True)) == ["recent"]


def test_only_operators_see_a_captured_body_on_the_request_page(client, routed):
    routed.alice.capture_bodies = True
    routed.alice.save()
    request_id = _ask(client, routed.alice_key)["x-request-id"]
    client.force_login(routed.operator)
    page = client.get(f"/requests/{request_id}/").content.decode()
    assert 'id="captured"' in page and "data:image/jpeg;base64," in page
    client.force_login(routed.alice_admin)
    page = client.get(f"/requests/{request_id}/").content.decode()
    assert page.count("data:image/jpeg") == 0 and 'id="captured"' not in page
