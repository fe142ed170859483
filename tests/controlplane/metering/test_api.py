from __future__ import annotations

import re

import pytest

from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record

pytestmark = [pytest.mark.django_db, pytest.mark.accounting]


def _event(world, tenant, request_id):
    return usage_record(record=UsageRecord(request_id=request_id, tenant_id=tenant.pk, api_key_id=None,
                                           tier_id=world.vision.pk, image_tokens=100, text_tokens=10,
                                           output_tokens=5))


def _ids(response):
    assert response.status_code == 200, response.content
    return sorted(r["request_id"] for r in response.json()["results"])


def test_a_tenant_key_sees_its_own_requests_and_never_anothers(client, world):
    _event(world, world.alice, "req_alice")
    _event(world, world.charlie, "req_charlie")
    alice = client.get("/api/v1/usage/requests/", HTTP_AUTHORIZATION=f"Bearer {world.alice_key}")
    charlie = client.get("/api/v1/usage/requests/", HTTP_AUTHORIZATION=f"Bearer {world.charlie_key}")
    assert _ids(alice) == ["req_alice"]
    assert _ids(charlie) == ["req_charlie"]
    probe = client.get("/api/v1/usage/requests/", {"request_id": "req_alice"},
                       HTTP_AUTHORIZATION=f"Bearer {world.charlie_key}")
    assert _ids(probe) == []
    # naming another tenant is refused, not quietly answered with its rows
    probe = client.get("/api/v1/usage/requests/", {"request_id": "req_alice", "tenant": "alice"},
                       HTTP_AUTHORIZATION=f"Bearer {world.charlie_key}")
    assert probe.status_code == 400 and b"req_alice" not in probe.content


def test_staff_see_what_their_role_allows(client, world):
    _event(world, world.alice, "req_alice")
    _event(world, world.charlie, "req_charlie")
    client.force_login(world.charlie_admin)
    assert _ids(client.get("/api/v1/usage/requests/")) == ["req_charlie"]
    client.force_login(world.finance)
    assert _ids(client.get("/api/v1/usage/requests/")) == ["req_alice", "req_charlie"]
    assert _ids(client.get("/api/v1/usage/requests/", {"tenant": "alice"})) == ["req_alice"]


def test_a_bad_key_is_a_401_and_no_key_is_refused(client, world):
    assert client.get("/api/v1/usage/requests/", HTTP_AUTHORIZATION="Bearer vlm-bad").status_code == 401
    assert client.get("/api/v1/usage/daily/").status_code in (401, 403)


def test_the_openapi_schema_and_docs_are_served(client, world):
    schema = client.get("/api/schema/")
    assert schema.status_code == 200
    assert b"/api/v1/usage/requests/" in schema.content
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    # assets come from the installed sidecar, none from elsewhere
    assert not re.search(rb'(src|href)="(https?:)?//', docs.content) and b"cdn.jsdelivr" not in docs.content
    assert b"/static/drf_spectacular_sidecar/" in docs.content
