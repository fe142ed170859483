"""With the database down, the gateway serves from what it already knew (keys, models and
engines it had read), and answers a clear 503 for what it never saw; never a 500."""

from __future__ import annotations

import json

import pytest
from django.db import connection

from controlplane.gateway import state
from tests.controlplane.gateway.test_views import image_message, post
from tests.images import data_url, image_bytes

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def database_down(monkeypatch):
    """Call it to make the database stop answering (its port closed), as a stopped server does."""
    real = dict(connection.settings_dict)

    def stop():
        connection.close()
        monkeypatch.setitem(connection.settings_dict, "HOST", "127.0.0.1")
        monkeypatch.setitem(connection.settings_dict, "PORT", "1")
        monkeypatch.setitem(connection.settings_dict, "NAME", real["NAME"] if connection.vendor != "sqlite"
                            else "/nonexistent/dir/db.sqlite3")

    yield stop
    connection.close()
    connection.settings_dict.update(real)


def test_known_keys_and_models_are_served_while_the_database_is_down(client, world, monkeypatch, database_down):
    for cache in (state._keys, state._tiers, state._instances):
        monkeypatch.setattr(cache, "seconds", 0)  # every entry already past its freshness
    assert client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").status_code == 200
    body = {"model": "vlm-lite", "messages": image_message(data_url(image_bytes(64, 64)))}
    assert post(client, world.alice_key, body).status_code == 503  # no engine in these tests

    database_down()
    models = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    assert models.status_code == 200 and "vlm-lite" in models.content.decode()
    answered = post(client, world.alice_key, body)
    assert answered.status_code == 503
    assert json.loads(answered.content)["error"]["code"] == "engine_unavailable"  # routed as before
    never_seen = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.bob_key}")
    assert never_seen.status_code == 503 and int(never_seen["Retry-After"]) > 0
    assert json.loads(never_seen.content)["error"]["code"] == "service_unavailable"


def test_what_was_known_is_not_served_past_its_limit(client, world, monkeypatch, settings, database_down):
    monkeypatch.setattr(state._keys, "seconds", 0)
    settings.GATEWAY_STALE_MAX_S = 0
    assert client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").status_code == 200
    database_down()
    assert client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}").status_code == 503
