"""The audit log: who changed tiers, prices, quotas, keys and the fleet, and when, as a
filterable list for operators and finance."""

from __future__ import annotations

import pytest

from controlplane.audit.models import AuditEntry
from controlplane.fleet.models import EngineInstance

pytestmark = pytest.mark.django_db


def _rows(page: str) -> list[str]:
    return page.split('id="audit"')[1].split("</table>")[0].split("<tr>")[2:]


def test_changes_made_in_the_pages_are_listed_with_who_and_filterable(client, world):
    client.force_login(world.operator)
    client.post("/keys/", {"tenant": world.bob.pk, "name": "ci"})
    instance = EngineInstance.objects.create(tier=world.vision, actual_state="running")
    client.post(f"/fleet/{instance.pk}/drain/")
    client.post(f"/tiers/{world.text.name}/", {"engine_kind": "simulator", "name": "text", "kind": "text",
                                                "family": "qwen2", "model_id": "Qwen/Qwen2.5-7B-Instruct",
                                                "price_plan": world.text.price_plan_id, "large_image_threshold": 4096,
                                                "replicas": 2, "gpus_per_replica": 0, "enabled": "on",
                                                "default_for_text": "on", "save": "1"})
    page = client.get("/audit/").content.decode()
    rows = _rows(page)
    assert any("created api key" in r and world.operator.username in r and "bob" in r for r in rows)
    assert any("changed engine instance" in r and "<code>drain</code>: False → True" in r for r in rows)
    assert any("changed model tier" in r and "<code>replicas</code>: 1 → 2" in r for r in rows)
    only_tiers = _rows(client.get("/audit/?type=model+tier").content.decode())
    assert only_tiers and all("model tier" in r for r in only_tiers)
    assert "No change matches." in client.get("/audit/?actor=nobody").content.decode()
    assert _rows(client.get("/audit/?from=not-a-day&page=x").content.decode())  # bad input is ignored, not a 500


def test_finance_reads_the_audit_log_and_tenant_admins_do_not(client, world):
    AuditEntry.objects.create(actor="olivia", action="changed", object_type="price rate", object_id="1",
                              object_repr="vlm-lite from 2026-01-01")
    client.force_login(world.finance)
    assert "vlm-lite from 2026-01-01" in client.get("/audit/").content.decode()
    client.force_login(world.alice_admin)
    assert client.get("/audit/").status_code == 403


@pytest.mark.parametrize("query", [{"to": "9999-12-31"}, {"from": "0001-01-01", "to": "9999-12-31"}])
def test_the_last_day_there_is_may_end_the_range(client, world, query):
    AuditEntry.objects.create(actor="olivia", action="changed", object_type="price rate", object_id="1",
                              object_repr="vlm-lite from 2026-01-01")
    client.force_login(world.operator)
    page = client.get("/audit/", query)
    assert page.status_code == 200
    assert any("vlm-lite from 2026-01-01" in row for row in _rows(page.content.decode()))
