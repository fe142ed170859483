"""A tenant admin manages its own keys (scoped to models, revoked, last used, spend per key),
sees what is left of its quota, and reaches its statements, all without an operator."""

from __future__ import annotations

import json

import pytest

from controlplane.metering.records import UsageRecord
from controlplane.metering.services import usage_record
from controlplane.tenants.models import ApiKey, Quota
from controlplane.tenants.services import api_key_create
from tests.pages import field_errors

pytestmark = pytest.mark.django_db


def _chat(client, secret, model):
    return client.post("/v1/chat/completions", data=json.dumps({"model": model, "messages": [
        {"role": "user", "content": "hi"}]}), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {secret}")


def test_a_tenant_admin_creates_a_key_scoped_to_one_model_and_the_gateway_holds_it_to_that(client, world):
    client.force_login(world.alice_admin)
    page = client.post("/account/", {"name": "ocr app", "tiers": [world.vision.pk], "requests_per_minute": 30},
                       follow=True).content.decode()
    secret = page.split('id="issued-key">')[1].split("<")[0]
    key = ApiKey.objects.get(tenant=world.alice, name="ocr app")
    assert list(key.allowed_tiers.all()) == [world.vision] and key.requests_per_minute == 30
    refused = _chat(client, secret, world.text.name)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    models = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {secret}").json()
    assert [m["id"] for m in models["data"]] == ["auto", world.vision.name]


def test_a_tenant_admin_sees_its_keys_with_spend_and_revokes_one_but_never_another_tenants(client, world):
    mine = api_key_create(tenant=world.alice, name="web").api_key
    theirs = api_key_create(tenant=world.bob, name="bobs").api_key
    usage_record(record=UsageRecord(request_id="r1", tenant_id=world.alice.pk, api_key_id=mine.pk,
                                    tier_id=world.text.pk, text_tokens=1_000_000))
    client.force_login(world.alice_admin)
    page = client.get("/account/").content.decode()
    row = page.split(f'data-key="{mine.prefix}"')[1].split("</tr>")[0]
    assert "web" in row and "0.20 USD" in row and "every model of yours" in row  # 1 M text tokens at $0.20
    assert theirs.prefix not in page
    assert client.post(f"/account/keys/{theirs.pk}/revoke/").status_code == 404
    client.post(f"/account/keys/{mine.pk}/revoke/")
    mine.refresh_from_db()
    theirs.refresh_from_db()
    assert mine.revoked_at is not None and theirs.revoked_at is None


def test_a_tenant_admin_sees_what_is_left_of_its_quota(client, world):
    Quota.objects.create(tenant=world.alice, period="month", total_tokens=5_000)
    usage_record(record=UsageRecord(request_id="r1", tenant_id=world.alice.pk, api_key_id=None,
                                    tier_id=world.text.pk, text_tokens=1_200, output_tokens=300))
    client.force_login(world.alice_admin)
    row = client.get("/account/").content.decode().split('data-limit="total_tokens"')[1].split("</tr>")[0]
    assert "1,500" in row and "5,000" in row and "3,500" in row


def test_staff_and_users_without_a_tenant_have_no_account_page(client, world):
    client.force_login(world.operator)
    assert client.get("/account/").status_code == 403
    client.force_login(world.alice_admin)
    assert client.post("/account/", {"expires_at": "2001-01-01 00:00"}).content.decode().count("that moment has passed") == 1


@pytest.mark.parametrize("expires", ["9999-12-31T23:59:59-12:00", "0001-01-01T00:00:00+12:00"])
def test_a_key_expiry_that_cannot_be_written_in_utc_is_a_form_error_and_makes_no_key(client, world, expires):
    client.force_login(world.alice_admin)
    page = client.post("/account/", {"name": "forever", "expires_at": expires})
    assert page.status_code == 200
    assert "no moment that far out can be kept" in " ".join(field_errors(page.content.decode()))
    assert not ApiKey.objects.filter(name="forever").exists()
    assert client.get("/account/").status_code == 200


def test_no_page_makes_a_key_for_a_deactivated_tenant(client, world):
    world.alice.active = False
    world.alice.save()
    client.force_login(world.alice_admin)
    client.post("/account/", {"name": "meanwhile"})
    client.force_login(world.operator)
    page = client.post("/keys/", {"tenant": world.alice.pk, "name": "meanwhile"})
    assert "Select a valid choice" in page.content.decode()
    world.alice.active = True
    world.alice.save()
    assert not ApiKey.objects.filter(name="meanwhile").exists()
