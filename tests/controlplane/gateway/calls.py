"""Calls to the gateway as tenants make them, for the gateway's tests."""

from __future__ import annotations

import json

from asgiref.sync import async_to_sync
from django.test import AsyncClient


def post(client, key, body, **headers):
    return client.post("/v1/chat/completions", data=json.dumps(body) if not isinstance(body, bytes) else body,
                       content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}", **headers)


def image_message(url, detail=None):
    image = {"url": url} if detail is None else {"url": url, "detail": detail}
    return [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                         {"type": "image_url", "image_url": image}]}]


@async_to_sync
async def post_and_read_stream(key, body):
    """Request and read a stream in one event loop, as the ASGI server does."""
    response = await AsyncClient().post("/v1/chat/completions", data=json.dumps(body),
                                        content_type="application/json",
                                        headers={"Authorization": f"Bearer {key}"})
    return response, b"".join([chunk async for chunk in response.streaming_content])


def error_of(response):
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]
