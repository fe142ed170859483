"""The production way in: /v1 served by the plain ASGI front, the rest by Django."""

from __future__ import annotations

import httpx
import pytest
from asgiref.sync import async_to_sync

from controlplane.asgi import application

pytestmark = pytest.mark.django_db


@async_to_sync
async def call(method, path, **kwargs):
    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        return await client.request(method, path, **kwargs)


def test_v1_answers_with_openai_errors_and_the_rest_is_django(world, settings):
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    assert call("GET", "/v1/models").json()["error"]["code"] == "invalid_api_key"
    models = call("GET", "/v1/models", headers={"Authorization": f"Bearer {world.alice_key}"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "auto"
    bad = call("POST", "/v1/chat/completions", content=b"{nope", headers={"Authorization": f"Bearer {world.alice_key}"})
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_json")
    assert call("GET", "/v1/embeddings").json()["error"]["code"] == "unknown_url"
    assert call("GET", "/static/css/app.css").status_code == 200  # not /v1: Django serves it
    assert "csrftoken" not in call("GET", "/v1/models").headers.get("set-cookie", "")


def test_an_oversized_body_is_refused_without_being_kept(world, settings):
    settings.GATEWAY_MAX_BODY_BYTES = 50_000
    response = call("POST", "/v1/chat/completions", content=b"x" * 200_000,
                    headers={"Authorization": f"Bearer {world.alice_key}"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_the_gateway_process_keeps_freed_image_buffers_unless_told_not_to():
    from controlplane.gateway.memory import keep_freed_buffers

    # glibc accepts the tuning (a refused value would leave every request faulting in fresh pages)
    assert keep_freed_buffers(256) is True
    assert keep_freed_buffers(0) is False  # GATEWAY_HEAP_KEEP_MB=0: glibc's defaults
