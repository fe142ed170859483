"""A key's own page: edit its name, models, limits and budget, rotate its secret; a new or
rotated key's secret shown once with a copy button and a ready snippet; one key's usage."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.metering.models import DailyUsage
from controlplane.tenants.models import ApiKey
from controlplane.tenants.services import api_key_create, api_key_lookup

pytestmark = pytest.mark.django_db


def test_a_tenant_admin_edits_a_keys_name_models_limits_and_budget_and_the_change_is_recorded(client, world):
    issued = api_key_create(tenant=world.alice, name="web")
    client.force_login(world.alice_admin)
    response = client.post(f"/account/keys/{issued.api_key.pk}/", {
        "name": "mobile app", "tiers": [world.vision.pk], "requests_per_minute": 30, "spend_limit": "12.50"})
    assert response.status_code == 302 and response["Location"] == "/account/"
    key = api_key_lookup(issued.secret)  # the same secret, now with its new settings
    assert (key.name, key.requests_per_minute, key.spend_limit) == ("mobile app", 30, Decimal("12.50"))
    assert list(key.allowed_tiers.all()) == [world.vision]
    entry = AuditEntry.objects.filter(object_type=ApiKey._meta.verbose_name, action="changed").latest("at")
    assert entry.changes["name"] == ["web", "mobile app"] and entry.changes["spend_limit"] == [None, "12.50"]
    refused = client.post(f"/account/keys/{issued.api_key.pk}/", {"name": "x", "spend_limit": "0"})
    assert refused.status_code == 200 and "greater than or equal to 0.01" in refused.content.decode()


def test_rotating_a_key_gives_it_a_new_secret_and_keeps_its_history_and_budget(client, world):
    issued = api_key_create(tenant=world.alice, name="web", spend_limit=Decimal("5"))
    client.force_login(world.alice_admin)
    response = client.post(f"/account/keys/{issued.api_key.pk}/rotate/")
    assert response.status_code == 302
    page = client.get("/account/").content.decode()
    secret = page.split('id="issued-key">')[1].split("<")[0]
    assert secret != issued.secret and api_key_lookup(issued.secret) is None
    rotated = api_key_lookup(secret)
    assert rotated.pk == issued.api_key.pk and rotated.spend_limit == Decimal("5")
    assert 'data-copy="issued-key"' in page and f"Bearer {secret}" in page  # a copy button and a snippet
    assert "issued-key" not in client.get("/account/").content.decode()  # shown once


def test_a_tenant_admin_cannot_see_edit_or_rotate_another_tenants_key(client, world):
    other = api_key_create(tenant=world.bob, name="bob's")
    client.force_login(world.alice_admin)
    assert client.get(f"/account/keys/{other.api_key.pk}/").status_code == 404
    assert client.post(f"/account/keys/{other.api_key.pk}/rotate/").status_code == 404
    assert api_key_lookup(other.secret) is not None
    assert client.get(f"/keys/{other.api_key.pk}/").status_code == 403  # the operator's page


def test_an_operator_edits_any_key_and_a_revoked_key_cannot_be_changed(client, world):
    issued = api_key_create(tenant=world.bob, name="ci")
    client.force_login(world.operator)
    assert client.post(f"/keys/{issued.api_key.pk}/", {"name": "ci runner"}).status_code == 302
    assert ApiKey.objects.get(pk=issued.api_key.pk).name == "ci runner"
    client.post(f"/keys/{issued.api_key.pk}/revoke/")
    page = client.get(f"/keys/{issued.api_key.pk}/").content.decode()
    assert "it cannot be changed" in page and "Rotate secret" not in page
    client.post(f"/keys/{issued.api_key.pk}/rotate/")
    assert api_key_lookup(issued.secret) is None and ApiKey.objects.get(pk=issued.api_key.pk).prefix == \
        issued.api_key.prefix


def test_the_usage_page_shows_one_keys_usage_and_refuses_a_key_the_reader_cannot_see(client, world):
    web = api_key_create(tenant=world.alice, name="web").api_key
    batch = api_key_create(tenant=world.alice, name="batch").api_key
    bobs = api_key_create(tenant=world.bob, name="bob's").api_key
    today = timezone.now().date()
    for key, tokens in ((web, 1_111), (batch, 2_222), (bobs, 3_333)):
        DailyUsage.objects.create(day=today, tenant=key.tenant, tier=world.vision, api_key=key, requests=1,
                                  images=1, image_tokens=tokens, cost="0.5")
    client.force_login(world.alice_admin)
    page = client.get("/usage/", {"key": web.prefix}).content.decode()
    totals = page.split('id="usage-totals"')[1].split("</div>\n</div>")[0]
    assert "1,111" in totals and "2,222" not in totals and "key web" in page
    refused = client.get("/usage/", {"key": bobs.prefix})
    assert refused.status_code == 400 and f"no API key &#x27;{bobs.prefix}&#x27; you can see" in refused.content.decode()
    client.force_login(world.operator)
    page = client.get("/usage/", {"key": bobs.prefix}).content.decode()
    assert "3,333" in page.split('id="usage-totals"')[1].split("</div>\n</div>")[0]


def _spend_on(world, key, millions: int):
    """Output tokens billed to `key` at the vision tier's 0.60 per million."""
    from controlplane.metering.records import UsageRecord
    from controlplane.metering.services import usage_record

    usage_record(record=UsageRecord(request_id=f"spend-{key.pk}-{millions}", tenant_id=key.tenant_id,
                                    api_key_id=key.pk, tier_id=world.vision.pk, output_tokens=millions * 1_000_000))


def test_every_page_of_a_key_with_a_budget_says_what_is_left_of_it(client, world):
    key = api_key_create(tenant=world.alice, name="batch", spend_limit=Decimal("2.50")).api_key
    _spend_on(world, key, 1)  # 0.60 USD of 2.50: 1.90 left
    client.force_login(world.operator)
    row = client.get("/keys/").content.decode().split(f"vlm-{key.prefix}-")[1].split("</tr>")[0]
    assert "0.60 USD" in row and "1.90 USD" in row
    glance = client.get(f"/keys/{key.pk}/").content.decode().split('id="key-glance"')[1].split("</div>\n</div>")[0]
    assert "Left of its budget<span>1.90 USD</span>" in glance
    client.force_login(world.alice_admin)
    row = client.get("/account/").content.decode().split(f'data-key="{key.prefix}"')[1].split("</tr>")[0]
    assert "1.90 USD" in row
    assert "Left of its budget<span>1.90 USD</span>" in client.get(f"/account/keys/{key.pk}/").content.decode()
