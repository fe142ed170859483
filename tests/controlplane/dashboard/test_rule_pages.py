"""The routing rules pages: the default rules for operators, a tenant's and its keys' on its page
(operators) and on the account (its admins), each change recorded; a dry run of a request
against them, by the gateway's own code."""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from controlplane.audit.models import AuditEntry
from controlplane.tenants.models import RoutingRule
from controlplane.tenants.services import api_key_create
from tests.factories import VisionTierFactory
from tests.images import image_bytes

pytestmark = pytest.mark.django_db

FIELDS = {"position": 1, "name": "", "enabled": "on", "confidence": "mean", "escalate_on_length": "on",
          "escalate_on_refusal": "on", "cascade_streams": "on"}


@pytest.fixture
def flagship(world):
    return VisionTierFactory(name="vlm-flagship")


def _rule(tier, **fields) -> RoutingRule:
    rule = RoutingRule(tier=tier, **fields)
    rule.full_clean()
    rule.save()
    return rule


def _ask(text="What is the total?", **extra) -> str:
    return json.dumps({"model": "auto", "messages": [{"role": "user", "content": text}], **extra})


def _answer(page) -> str:
    return page.content.decode().split('id="dry-run-answer">')[1].split("</div>")[0]


def test_an_operator_creates_a_tenants_rule_from_its_page_and_the_change_is_recorded(client, world, flagship):
    client.force_login(world.operator)
    assert 'href="/tenants/alice/rules/"' in client.get("/tenants/alice/").content.decode()
    response = client.post("/tenants/alice/rules/new/", {**FIELDS, "name": "receipts", "tasks": "receipt, invoice",
                                                         "tier": flagship.pk, "pixel_cap": 500_000})
    assert response.status_code == 302 and response["Location"] == "/tenants/alice/rules/"
    rule = RoutingRule.objects.get(tenant=world.alice)
    assert (rule.name, rule.tasks, rule.tier, rule.api_key) == ("receipts", "invoice,receipt", flagship, None)
    entry = AuditEntry.objects.get(object_type=RoutingRule._meta.verbose_name, object_id=str(rule.pk))
    assert entry.actor == world.operator.username and entry.action == "created"
    assert entry.changes["tier"] == [None, "vlm-flagship"] and entry.changes["scope"] == [None, "tenant alice"]
    page = client.get("/tenants/alice/rules/").content.decode()
    assert "receipts" in page and "task invoice or receipt" in page and "at most 500,000 px" in page


def test_a_rule_naming_a_tier_its_tenant_may_not_use_is_refused_by_the_form(client, world, flagship):
    world.alice.allowed_tiers.add(world.vision)
    client.force_login(world.operator)
    response = client.post("/tenants/alice/rules/new/", {**FIELDS, "tier": flagship.pk})
    assert response.status_code == 200 and "this tenant may not use vlm-flagship" in response.content.decode()
    cascade = client.post("/tenants/alice/rules/new/", {**FIELDS, "tier": world.vision.pk,
                                                         "escalate_to": flagship.pk, "threshold": "1.5"})
    page = cascade.content.decode()
    assert "this tenant may not use vlm-flagship" in page and "between 0 and 1" in page
    assert not RoutingRule.objects.exists()


def test_editing_disabling_and_deleting_a_rule_is_recorded_with_before_and_after(client, world, flagship):
    rule = _rule(flagship, name="big", min_images=3)
    client.force_login(world.operator)
    edited = client.post(f"/rules/{rule.pk}/", {**FIELDS, "name": "big", "position": 2, "min_images": 4,
                                                "tier": flagship.pk})
    assert edited.status_code == 302 and edited["Location"] == "/rules/"
    client.post(f"/rules/{rule.pk}/toggle/")
    assert not RoutingRule.objects.get(pk=rule.pk).enabled
    client.post(f"/rules/{rule.pk}/delete/")
    assert not RoutingRule.objects.filter(pk=rule.pk).exists()
    entries = AuditEntry.objects.filter(object_type=RoutingRule._meta.verbose_name,
                                        object_id=str(rule.pk)).order_by("at", "pk")
    assert [(e.action, e.changes) for e in entries] == [
        ("changed", {"position": [1, 2], "min_images": [3, 4]}),
        ("changed", {"enabled": [True, False]}),
        ("deleted", entries[2].changes)]
    assert entries[2].changes["tier"] == ["vlm-flagship", None] and entries[2].changes["name"] == ["big", None]


def test_the_lists_show_the_rules_in_the_order_they_are_read(client, world, flagship):
    key = api_key_create(tenant=world.alice, name="web").api_key
    _rule(flagship, name="second", position=5)
    _rule(flagship, name="first", position=2)
    _rule(world.vision, tenant=world.alice, name="tenants")
    _rule(world.vision, api_key=key, name="keys")
    client.force_login(world.operator)
    page = client.get("/rules/").content.decode()
    assert page.index(">first<") < page.index(">second<") and ">keys<" not in page
    assert 'href="/tenants/alice/rules/"' in page  # alice has rules of her own
    one_key = client.get("/tenants/alice/rules/", {"key": key.prefix}).content.decode()
    assert one_key.index(">keys<") < one_key.index(">tenants<") < one_key.index(">first<") < one_key.index(">second<")
    assert client.get("/tenants/alice/rules/", {"key": "nope"}).status_code == 404


def test_a_tenant_admin_manages_their_own_rules_and_their_keys(client, world, flagship):
    key = api_key_create(tenant=world.alice, name="web").api_key
    client.force_login(world.alice_admin)
    assert 'href="/account/rules/?key=' in client.get(f"/account/keys/{key.pk}/").content.decode()
    response = client.post(f"/account/rules/new/?key={key.prefix}", {**FIELDS, "name": "web big",
                                                                      "tier": flagship.pk, "min_images": 2})
    assert response.status_code == 302 and response["Location"] == f"/account/rules/?key={key.prefix}"
    rule = RoutingRule.objects.get()
    assert (rule.api_key, rule.tenant) == (key, world.alice)
    assert "web big" in client.get("/account/rules/").content.decode()
    assert client.post(f"/account/rules/{rule.pk}/toggle/").status_code == 302


def test_a_tenant_admin_cannot_see_or_edit_another_tenants_rules_nor_the_defaults(client, world, flagship):
    bobs = _rule(flagship, tenant=world.bob, name="bob's own")
    default = _rule(flagship, name="everyone's")
    client.force_login(world.alice_admin)
    for rule in (bobs, default):
        assert client.get(f"/account/rules/{rule.pk}/").status_code == 404
        assert client.post(f"/account/rules/{rule.pk}/", {**FIELDS, "tier": flagship.pk}).status_code == 404
        assert client.post(f"/account/rules/{rule.pk}/toggle/").status_code == 404
        assert client.post(f"/account/rules/{rule.pk}/delete/").status_code == 404
        assert client.get(f"/rules/{rule.pk}/").status_code == 403  # the operator's pages
        assert client.post(f"/rules/{rule.pk}/delete/").status_code == 403
    for path in ("/rules/", "/rules/new/", "/tenants/bob/rules/", "/tenants/alice/rules/"):
        assert client.get(path).status_code == 403
    page = client.get("/account/rules/").content.decode()
    assert "bob's own" not in page and "everyone's" not in page
    bob_key = api_key_create(tenant=world.bob).api_key
    assert client.get(f"/account/rules/new/?key={bob_key.prefix}").status_code == 404
    assert RoutingRule.objects.filter(pk__in=[bobs.pk, default.pk], enabled=True).count() == 2


def test_the_dry_run_names_the_rule_and_tier_that_hold_or_where_auto_goes_as_before(client, world, flagship):
    rule = _rule(flagship, tenant=world.alice, name="receipts", tasks="receipt", send_detail="low")
    client.force_login(world.operator)
    matched = client.post("/tenants/alice/rules/", {"body": _ask(metadata={"task": "receipt"})})
    assert ("would go to <strong>vlm-flagship, detail low</strong>, by <strong>rule 1 (receipts), tenant alice, "
            f"#{rule.pk}</strong>") in _answer(matched)
    by_header = client.post("/tenants/alice/rules/", {"body": _ask(), "task": "receipt"})
    assert "by <strong>rule 1 (receipts), tenant alice" in _answer(by_header)
    fallback = client.post("/tenants/alice/rules/", {"body": _ask(metadata={"task": "portrait"})})
    assert "No rule holds: <code>auto</code> goes to <strong>text</strong> as before" in _answer(fallback)
    bob = client.post("/rules/", {"tenant": world.bob.pk, "body": _ask(metadata={"task": "receipt"})})
    assert "No rule holds" in _answer(bob)  # alice's rules are not bob's
    bad = client.post("/tenants/alice/rules/", {"body": '{"model": "auto", "messages": ['})
    assert bad.status_code == 200 and "not valid JSON" in bad.content.decode() and "dry-run-answer" not in \
        bad.content.decode()
    invalid = client.post("/tenants/alice/rules/", {"body": '{"messages": []}'})
    assert "messages must be a non-empty array" in invalid.content.decode()


def test_the_dry_run_reads_an_uploaded_image_and_a_keys_rules_and_says_when_it_cascades(client, world, flagship):
    key = api_key_create(tenant=world.alice, name="web").api_key
    rule = _rule(world.vision, api_key=key, name="big photos", min_source_pixels=1_000_000, escalate_to=flagship,
                 threshold=0.6)
    client.force_login(world.alice_admin)
    photo = SimpleUploadedFile("photo.png", image_bytes(1600, 1000, fmt="PNG"), content_type="image/png")
    response = client.post("/account/rules/", {"key": key.pk, "body": _ask(), "image": photo})
    answer = _answer(response)
    assert f"by <strong>rule 1 (big photos), key {key.prefix}…, #{rule.pk}</strong>" in answer
    assert "first to <strong>vlm-lite</strong>, escalated to <strong>vlm-flagship</strong> below probability 0.6" \
        in answer
    small = SimpleUploadedFile("small.png", image_bytes(640, 480, fmt="PNG"), content_type="image/png")
    fallback = client.post("/account/rules/", {"key": key.pk, "body": _ask(), "image": small})
    assert "No rule holds: <code>auto</code> goes to <strong>vlm-lite</strong>" in _answer(fallback)
    as_tenant = client.post("/account/rules/", {"body": _ask(), "image": SimpleUploadedFile(
        "photo.png", image_bytes(1600, 1000, fmt="PNG"), content_type="image/png")})
    assert "No rule holds" in _answer(as_tenant)  # the key's rule is the key's alone
    bobs = api_key_create(tenant=world.bob).api_key
    refused = client.post("/account/rules/", {"key": bobs.pk, "body": _ask()})
    assert "Select a valid choice" in refused.content.decode()
