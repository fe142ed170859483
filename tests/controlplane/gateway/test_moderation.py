"""Tiers that require moderation: images checked by an OpenAI-format /v1/moderations endpoint."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading

import pytest
from django.utils import timezone
from PIL import Image

from controlplane.fleet.models import EngineInstance, Node
from tests.controlplane.gateway.test_views import error_of, image_message, post
from tests.engines import simulator
from tests.images import data_url, image_bytes
from tests.system.harness import free_port

pytestmark = pytest.mark.django_db


class Moderator(http.server.BaseHTTPRequestHandler):
    """Flags images that are mostly red, as a classifier would flag what it is trained on."""

    seen: list[dict] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Moderator.seen.append({"auth": self.headers.get("Authorization"), "model": body["model"]})
        url = body["input"][0]["image_url"]["url"]
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
        red, green, blue = image.resize((1, 1)).getpixel((0, 0))
        flagged = red > 150 and green < 100
        result = {"flagged": flagged, "categories": {"violence": flagged, "sexual": False, "self-harm": False},
                  "category_scores": {"violence": 0.97 if flagged else 0.01}}
        answer = json.dumps({"id": "modr-1", "model": body["model"], "results": [result]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)


@pytest.fixture
def moderated(world, settings):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Moderator)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings.MODERATION_URL = f"http://127.0.0.1:{server.server_address[1]}/v1/moderations"
    settings.MODERATION_API_KEY = "moderation-secret"
    world.vision.engine_settings = {**world.vision.engine_settings, "require_moderation": True}
    world.vision.save()
    Moderator.seen.clear()
    with simulator(name="vlm-lite") as port:
        node = Node.objects.create(name="mod", queue="node.mod", last_seen_at=timezone.now())
        EngineInstance.objects.create(tier=world.vision, node=node, port=port, actual_state="running",
                                      healthy=True, last_health_at=timezone.now())
        yield world
    server.shutdown()


def test_a_flagged_image_is_refused_with_its_categories(client, moderated):
    red = data_url(image_bytes(200, 200, color=(220, 20, 20)))
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": image_message(red)})
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "content_policy_violation"
    assert "image 1 was flagged by moderation: violence" in error["message"]
    assert Moderator.seen[-1] == {"auth": "Bearer moderation-secret", "model": "omni-moderation-latest"}


def test_a_clean_image_goes_through(client, moderated):
    blue = data_url(image_bytes(200, 200, color=(20, 20, 220)))
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": image_message(blue)})
    assert response.status_code == 200
    assert len(Moderator.seen) == 1


def test_moderation_that_cannot_answer_fails_closed(client, moderated, settings):
    settings.MODERATION_URL = f"http://127.0.0.1:{free_port()}/v1/moderations"  # nothing listens
    blue = data_url(image_bytes(200, 200, color=(20, 20, 220)))
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": image_message(blue)})
    assert response.status_code == 503
    assert error_of(response)["code"] == "moderation_unavailable" and response["Retry-After"]


def test_text_and_unmoderated_tiers_do_not_call_moderation(client, moderated):
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200 and Moderator.seen == []


def test_an_image_that_fails_its_check_is_refused_before_it_is_moderated(client, moderated):
    broken = data_url(image_bytes(800, 600, color=(20, 20, 220))[:-3000])  # whole header, scans cut short
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": image_message(broken)})
    assert (response.status_code, error_of(response)["code"]) == (400, "corrupt_image")
    assert Moderator.seen == []
