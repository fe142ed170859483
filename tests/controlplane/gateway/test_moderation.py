"""Tiers that require moderation: each prompt, its text and its images, checked by an
OpenAI-format /v1/moderations endpoint before the engine."""

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
from tests.controlplane.gateway.calls import error_of, image_message, post
from tests.engines import simulator
from tests.images import data_url, image_bytes
from tests.system.harness import free_port

pytestmark = pytest.mark.django_db

BLUE = data_url(image_bytes(200, 200, color=(20, 20, 220)))
RED = data_url(image_bytes(200, 200, color=(220, 20, 20)))


def _red(url: str) -> bool:
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    red, green, _blue = image.resize((1, 1)).getpixel((0, 0))
    return red > 150 and green < 100


class Moderator(http.server.BaseHTTPRequestHandler):
    """Answers as OpenAI's omni-moderation does: one result for the whole input, at most one
    image a call, and for each category the input types it applies to. Flags mostly red
    images as violence and text that says "forbidden" as harassment."""

    seen: list[dict] = []

    def log_message(self, *args):
        pass

    def _answer(self, status: int, body: dict) -> None:
        answer = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        parts = body["input"]
        texts = [p["text"] for p in parts if p["type"] == "text"]
        images = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
        Moderator.seen.append({"auth": self.headers.get("Authorization"), "model": body["model"],
                               "input": [p["type"] for p in parts], "text": "\n".join(texts)})
        if len(images) > 1:
            return self._answer(400, {"error": {"message": f"Number of images ({len(images)}) exceeds maximum of 1",
                                                "type": "invalid_request_error", "param": "input",
                                                "code": "too_many_images"}})
        harassment = any("forbidden" in text for text in texts)
        violence = any(_red(url) for url in images)
        result = {"flagged": harassment or violence,
                  "categories": {"harassment": harassment, "violence": violence, "sexual": False},
                  "category_scores": {"harassment": 0.9 if harassment else 0.01, "violence": 0.97 if violence else 0.01},
                  "category_applied_input_types": {"harassment": ["text"] if texts else [],
                                                   "violence": ["text"] * bool(texts) + ["image"] * bool(images),
                                                   "sexual": ["text"] * bool(texts) + ["image"] * bool(images)}}
        self._answer(200, {"id": "modr-1", "model": body["model"], "results": [result]})


@pytest.fixture
def moderated(world, settings):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Moderator)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings.MODERATION_URL = f"http://127.0.0.1:{server.server_address[1]}/v1/moderations"
    settings.MODERATION_API_KEY = "moderation-secret"
    settings.OPERATOR_URL_TRUSTED_NETWORKS = ["127.0.0.1/32"]  # a classifier of the operator's own
    for tier in (world.vision, world.text):
        tier.engine_settings = {**tier.engine_settings, "require_moderation": True}
        tier.save()
    Moderator.seen.clear()
    with simulator(name="vlm-lite") as port:
        node = Node.objects.create(name="mod", queue="node.mod", last_seen_at=timezone.now())
        for tier in (world.vision, world.text):  # one engine serves both, under its own name
            EngineInstance.objects.create(tier=tier, node=node, port=port, actual_state="running",
                                          healthy=True, last_health_at=timezone.now(), served_model_name="vlm-lite")
        yield world
    server.shutdown()
    server.server_close()


def images_only(*urls):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in urls]}]


def test_a_flagged_image_is_refused_with_its_categories(client, moderated):
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": images_only(RED)})
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "content_policy_violation"
    assert error["message"] == "image 1 was flagged by moderation: violence"
    assert Moderator.seen[-1]["auth"] == "Bearer moderation-secret"
    assert Moderator.seen[-1]["model"] == "omni-moderation-latest"


def test_the_prompts_text_goes_with_its_image_in_one_call(client, moderated):
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": image_message(BLUE)})
    assert response.status_code == 200
    assert [(seen["input"], seen["text"]) for seen in Moderator.seen] == [(["text", "image_url"], "what is this")]


def test_flagged_text_is_refused_beside_a_clean_image(client, moderated):
    messages = [{"role": "user", "content": [{"type": "text", "text": "say something forbidden"},
                                             {"type": "image_url", "image_url": {"url": BLUE}}]}]
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": messages})
    assert (response.status_code, error_of(response)["code"]) == (400, "content_policy_violation")
    assert error_of(response)["message"] == "the prompt's text was flagged by moderation: harassment"


def test_a_text_only_request_is_moderated_too_every_message_of_it(client, moderated):
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "hi"}]
    assert post(client, moderated.alice_key, {"model": moderated.text.name, "messages": messages}).status_code == 200
    assert [(seen["input"], seen["text"]) for seen in Moderator.seen] == [(["text"], "You are helpful.\n\nhi")]
    messages[0]["content"] = "Everything forbidden is allowed."
    response = post(client, moderated.alice_key, {"model": moderated.text.name, "messages": messages})
    assert (response.status_code, error_of(response)["code"]) == (400, "content_policy_violation")
    assert "the prompt's text was flagged by moderation: harassment" in error_of(response)["message"]


def test_each_image_is_checked_within_the_endpoints_limit_of_one_a_call(client, moderated):
    messages = [{"role": "user", "content": [{"type": "text", "text": "compare"},
                                             {"type": "image_url", "image_url": {"url": BLUE}},
                                             {"type": "image_url", "image_url": {"url": RED}}]}]
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": messages})
    assert (response.status_code, error_of(response)["message"]) == (400, "image 2 was flagged by moderation: violence")
    assert sorted(seen["input"] for seen in Moderator.seen) == [["image_url"], ["text", "image_url"]]


def test_a_category_the_text_and_the_image_share_names_both(client, moderated):
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": image_message(RED)})
    assert error_of(response)["message"] == "the prompt's text or image 1 was flagged by moderation: violence"


def test_a_tier_without_moderation_does_not_call_it(client, moderated):
    moderated.text.engine_settings = {**moderated.text.engine_settings, "require_moderation": False}
    moderated.text.save()
    response = post(client, moderated.alice_key, {"model": moderated.text.name, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200 and Moderator.seen == []


def test_moderation_that_cannot_answer_fails_closed(client, moderated, settings):
    settings.MODERATION_URL = f"http://127.0.0.1:{free_port()}/v1/moderations"  # nothing listens
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": image_message(BLUE)})
    assert response.status_code == 503
    assert error_of(response)["code"] == "moderation_unavailable" and response["Retry-After"]


def test_a_moderation_endpoint_inside_the_network_is_an_explicit_choice(client, moderated, settings):
    settings.OPERATOR_URL_TRUSTED_NETWORKS = []
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": image_message(BLUE)})
    assert (response.status_code, error_of(response)["code"]) == (503, "moderation_unavailable")
    assert "127.0.0.1" not in error_of(response)["message"]  # the tenant is not told where it is
    assert Moderator.seen == []


def test_an_image_that_fails_its_check_is_refused_before_it_is_moderated(client, moderated):
    broken = data_url(image_bytes(800, 600, color=(20, 20, 220))[:-3000])  # whole header, scans cut short
    response = post(client, moderated.alice_key, {"model": "vlm-lite", "messages": image_message(broken)})
    assert (response.status_code, error_of(response)["code"]) == (400, "corrupt_image")
    assert Moderator.seen == []
