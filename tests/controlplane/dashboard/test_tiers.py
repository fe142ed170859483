"""Operators create, edit, enable and disable tiers in product pages: one form per engine kind
with typed settings, refused with a message where the old JSON box took anything, and a
preview of the engine's command line, what sample images cost, and whether it fits the GPUs."""

from __future__ import annotations

import html
import json
import shlex

import pytest

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import ModelTier, PricePlan
from controlplane.fleet.models import Gpu, Node
from tests.factories import PricePlanFactory, ResolutionPolicyFactory
from tests.pages import field_errors

pytestmark = pytest.mark.django_db


def _form(world, **changes):
    data = {
        "engine_kind": "vllm", "name": "vlm-7b", "display_name": "Qwen2.5-VL 7B", "kind": "vision",
        "family": "qwen2_5_vl", "model_id": "Qwen/Qwen2.5-VL-7B-Instruct",
        "resolution_policy": ResolutionPolicyFactory().pk, "price_plan": world.vision.price_plan_id,
        "large_image_threshold": 4096, "replicas": 1, "gpus_per_replica": 1, "enabled": "on",
        "setting_max_model_len": 16384, "setting_max_output_tokens": 2048,
    }
    data.update(changes)
    return {k: v for k, v in data.items() if v is not None}



@pytest.mark.parametrize(("typo", "message"), [
    ({"setting_max_model_len": -5}, "Ensure this value is greater than or equal to 256."),
    ({"setting_gpu_memory_utilization": 1.5}, "Ensure this value is less than or equal to 0.99."),
    ({"setting_max_output_tokens": 20000}, "must be below the context length (16,384 tokens)"),
    ({"setting_kv_cache_dtype": "int3"}, "Select a valid choice. int3 is not one of the available choices."),
])
def test_out_of_range_settings_are_refused_with_a_message_and_nothing_is_saved(client, world, typo, message):
    client.force_login(world.operator)
    response = client.post("/tiers/new/", _form(world, save="1", **typo))
    assert response.status_code == 200
    assert message in field_errors(response.content.decode())
    assert not ModelTier.objects.filter(name="vlm-7b").exists()


def test_a_tier_is_created_with_typed_settings_and_the_change_recorded(client, world):
    client.force_login(world.operator)
    response = client.post("/tiers/new/", _form(world, save="1", setting_scheduling_policy="priority",
                                                setting_allowed_media_domains="images.example.com, cdn.example.com"))
    assert response.status_code == 302 and response["Location"] == "/tiers/vlm-7b/"
    tier = ModelTier.objects.get(name="vlm-7b")
    assert tier.engine_kind == "vllm" and tier.enabled
    assert tier.engine_settings == {"max_model_len": 16384, "scheduling_policy": "priority",
                                    "max_output_tokens": 2048,
                                    "allowed_media_domains": ["images.example.com", "cdn.example.com"]}
    entry = AuditEntry.objects.get(object_type="model tier", object_id=str(tier.pk))
    assert (entry.actor, entry.action) == (world.operator.username, "created")
    page = client.get("/tiers/vlm-7b/").content.decode()
    assert "Tier vlm-7b created." in page and world.operator.username in page.split("Changes")[1]


def test_the_preview_shows_the_vllm_command_sample_costs_and_the_gpu_fit_without_saving(client, world):
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    Gpu.objects.create(node=node, index=0, model="NVIDIA L4")
    client.force_login(world.operator)
    page = client.post("/tiers/new/", _form(world, preview="1", setting_max_model_len=32768)).content.decode()
    assert not ModelTier.objects.filter(name="vlm-7b").exists()
    command = shlex.split(html.unescape(page.split('id="tier-command">')[1].split("</pre>")[0]))
    assert command[command.index("serve") + 1] == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert command[command.index("--max-model-len") + 1] == "32768"
    assert '"max_pixels": 1003520' in command[command.index("--mm-processor-kwargs") + 1]
    samples = page.split('id="tier-samples"')[1].split("</table>")[0]
    # A 12 MP photo is sent at the size Qwen2.5-VL's processor would resize it to under the
    # standard policy's 1,003,520-pixel cap (1148 x 840: 41 x 30 merged patches of 28 pixels, and the
    # image's start and end markers: 1,232 prompt positions).
    row = samples.split("4032 × 3024")[1].split("</tr>")[0]
    assert "1148 × 840" in row and "1,232" in row
    fit = page.split('id="tier-fit"')[1].split("</table>")[0]
    # 7B in bf16 (16.6 GB) on a 24 GB L4 leaves room for a context of 32,768 tokens.
    assert "1 x L4" in fit and "yes" in fit and "requests at once with 8 images" in fit


def test_a_model_too_large_for_the_gpus_is_shown_not_to_fit(client, world):
    node = Node.objects.create(name="gpu-a", queue="node.gpu-a")
    Gpu.objects.create(node=node, index=0, model="NVIDIA L4")
    client.force_login(world.operator)
    page = client.post("/tiers/new/", _form(world, preview="1", model_id="Qwen/Qwen2.5-VL-72B-Instruct",
                                            setting_tensor_parallel_size=2)).content.decode()
    fit = page.split('id="tier-fit"')[1].split("</table>")[0]
    assert "2 x L4" in fit and "leave no memory for the KV cache" in fit


def test_a_tier_cannot_be_enabled_without_a_price_in_effect(client, world):
    client.force_login(world.operator)
    unpriced = PricePlan.objects.create(name="unpriced")
    response = client.post("/tiers/new/", _form(world, save="1", price_plan=unpriced.pk))
    assert "an enabled tier needs a price in effect" in response.content.decode()
    client.post("/tiers/new/", _form(world, save="1", price_plan=unpriced.pk, enabled=None))
    tier = ModelTier.objects.get(name="vlm-7b")
    assert not tier.enabled
    page = client.post("/tiers/vlm-7b/enable/", follow=True).content.decode()
    assert "was not enabled: an enabled tier needs a price in effect" in html.unescape(page)
    tier.refresh_from_db()
    assert not tier.enabled
    tier.price_plan = PricePlanFactory()
    tier.save()
    client.post("/tiers/vlm-7b/enable/")
    tier.refresh_from_db()
    assert tier.enabled


def test_editing_keeps_what_the_form_does_not_show_and_switching_engine_kind_keeps_what_applies(client, world):
    client.force_login(world.operator)
    tier = world.vision
    tier.engine_settings = {"max_model_len": 8192, "decode_ms_per_token": 2}
    tier.save()
    page = client.get(f"/tiers/{tier.name}/").content.decode()
    field = page.split('name="setting_decode_ms_per_token"')[1].split(">")[0]
    assert 'value="2.0"' in field or 'value="2"' in field
    form = _form(world, save="1", engine_kind="vllm", name=tier.name, setting_max_model_len=8192,
                 setting_max_output_tokens=None, price_plan=tier.price_plan_id)
    assert client.post(f"/tiers/{tier.name}/?engine=vllm", form).status_code == 302
    tier.refresh_from_db()
    assert tier.engine_kind == "vllm" and tier.engine_settings == {"max_model_len": 8192}


def test_only_operators_reach_the_tier_pages(client, world):
    for user in (world.finance, world.alice_admin):
        client.force_login(user)
        assert client.get("/tiers/").status_code == 403
        assert client.post("/tiers/new/", _form(world, save="1")).status_code == 403
    client.force_login(world.operator)
    page = client.get("/tiers/").content.decode()
    assert world.vision.name in page and world.text.name in page


def test_marking_a_tier_the_default_for_images_takes_the_mark_from_the_previous_one_on_purpose(client, world):
    client.force_login(world.operator)
    page = client.get("/tiers/").content.decode()
    assert "requests with images to <strong>vlm-lite</strong>" in page
    response = client.post("/tiers/new/", _form(world, save="1", default_for_images="on"), follow=True)
    assert "<code>auto</code> now sends images requests to vlm-7b instead of vlm-lite." in html.unescape(
        response.content.decode())
    world.vision.refresh_from_db()
    assert not world.vision.default_for_images and ModelTier.objects.get(name="vlm-7b").default_for_images
    moved = AuditEntry.objects.get(object_type="model tier", object_id=str(world.vision.pk))
    assert moved.changes == {"default_for_images": [True, False]} and moved.actor == world.operator.username


def test_the_tier_auto_sends_to_cannot_be_disabled_until_another_is_the_default(client, world):
    client.force_login(world.operator)
    page = client.post(f"/tiers/{world.vision.name}/disable/", follow=True).content.decode()
    assert "make another tier the default before disabling it" in html.unescape(page)
    world.vision.refresh_from_db()
    assert world.vision.enabled


def test_the_keys_page_shows_where_auto_sends_each_tenants_requests(client, world):
    world.bob.allowed_tiers.set([world.text])
    client.force_login(world.operator)
    page = client.get("/keys/").content.decode()
    rows = {row.split("<td>")[1].split("</td>")[0]: row for row in page.split("<tr>")[2:]}
    assert "text → text<br>images → vlm-lite" in rows["alice"]
    assert "text → text<br>images → refused" in rows["bob"]


def test_an_sglang_tier_shows_sglangs_flags_and_previews_sglangs_command(client, world):
    client.force_login(world.operator)
    form = client.get("/tiers/new/?engine=sglang").content.decode()
    assert "SGLang flag --chunked-prefill-size." in form and "--max-num-batched-tokens" not in form
    assert "setting_mm_processor_cache_gb" not in form  # vLLM's alone
    assert "setting_scheduling_policy" in form and "--enable-priority-scheduling" in form  # SGLang's equivalent
    assert '<option value="qwen25">' in form and '<option value="llama3_json">' not in form  # its parsers
    page = client.post("/tiers/new/", _form(world, preview="1", engine_kind="sglang", setting_max_model_len=32768,
                                            setting_max_num_seqs=64)).content.decode()
    command = shlex.split(html.unescape(page.split('id="tier-command">')[1].split("</pre>")[0]))
    assert command[1].endswith("workers/engines/sglang_server.py")
    assert command[command.index("--model-path") + 1] == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert command[command.index("--context-length") + 1] == "32768"
    assert command[command.index("--max-running-requests") + 1] == "64"
    assert json.loads(command[command.index("--mm-process-config") + 1]) == {
        "image": {"size": {"shortest_edge": 3136, "longest_edge": 1003520}}}
    assert "--api-key" not in command
    # the same bounds as the gateway's count: a 12 MP photo is sent at 1148 x 840
    row = page.split('id="tier-samples"')[1].split("4032 × 3024")[1].split("</tr>")[0]
    assert "1148 × 840" in row and "1,232" in row


def test_an_sglang_tier_refuses_a_kv_cache_type_sglang_has_not(client, world):
    client.force_login(world.operator)
    response = client.post("/tiers/new/", _form(world, save="1", engine_kind="sglang", setting_kv_cache_dtype="fp8"))
    assert "Select a valid choice. fp8 is not one of the available choices." in field_errors(response.content.decode())
    assert not ModelTier.objects.filter(name="vlm-7b").exists()


def test_enabling_or_disabling_a_tier_always_returns_to_the_tiers_page(client, world):
    client.force_login(world.operator)
    response = client.post(f"/tiers/{world.text.name}/disable/", {"next": "https://elsewhere.example/"})
    assert response["Location"] == "/tiers/"


def test_the_tier_form_refuses_more_replicas_than_the_fleet_page_allows(client, world):
    from controlplane.catalog.models import MAX_REPLICAS

    client.force_login(world.operator)
    page = client.get(f"/tiers/{world.vision.name}/")
    form = page.context["form"]
    data = {name: value for name, value in form.initial.items() if value is not None and not isinstance(value, list)}
    data.update({"replicas": MAX_REPLICAS + 1})
    response = client.post(f"/tiers/{world.vision.name}/", data)
    assert response.status_code == 200 and "replicas" in response.context["form"].errors
    world.vision.refresh_from_db()
    assert world.vision.replicas <= MAX_REPLICAS


def test_a_tiers_page_shows_its_engines_traffic_errors_and_what_it_billed(client, world):
    import datetime as dt

    from django.utils import timezone

    from controlplane.fleet.models import EngineInstance
    from controlplane.metering.models import DailyUsage
    from tests.controlplane.alerts.conftest import usage

    EngineInstance.objects.create(tier=world.vision, actual_state="crashloop")
    usage(tenant=world.alice, tier=world.vision, n=3, latency_ms=400)
    usage(tenant=world.alice, tier=world.vision, n=1, status="error", http_status=503)
    DailyUsage.objects.create(day=timezone.now().date(), tenant=world.alice, tier=world.vision, requests=4, cost="2.5")
    DailyUsage.objects.create(day=timezone.now().date() - dt.timedelta(days=40), tenant=world.alice,
                              tier=world.vision, requests=4, cost="100")
    client.force_login(world.operator)
    glance = client.get(f"/tiers/{world.vision.name}/").content.decode().split('id="tier-glance"')[1].split("</div>\n</div>")[0]
    assert "1 crashloop" in glance and "25.0 %" in glance and "2.50 USD" in glance
    assert 'Serving now<span class="error">0</span>' in glance and "Requests, last hour<span>4</span>" in glance


def test_what_a_tier_billed_this_month_is_what_the_statements_bill_for_it(client, world):
    import datetime as dt

    from django.utils import timezone

    from controlplane.metering.records import UsageRecord
    from controlplane.metering.rollups import rollup_daily
    from controlplane.metering.services import usage_record
    from controlplane.tenants.services import internal_tenant

    now = timezone.now()
    for request_id, tenant, millions in (("a", world.alice, 1), ("b", world.bob, 2), ("own", internal_tenant(), 5)):
        usage_record(record=UsageRecord(request_id=request_id, tenant_id=tenant.pk, api_key_id=None,
                                        tier_id=world.vision.pk, output_tokens=millions * 1_000_000, created_at=now))
    rollup_daily(now=timezone.now() + dt.timedelta(seconds=5))
    client.force_login(world.finance)
    statements = client.get("/statements/", {"month": f"{now:%Y-%m}"}).content.decode()
    billed = statements.split('class="statement-total"')[1].split("</tr>")[0]
    client.force_login(world.operator)
    glance = client.get(f"/tiers/{world.vision.name}/").content.decode().split('id="tier-glance"')[1]
    shown = glance.split("Billed to tenants this month<span>")[1].split("</span>")[0]
    assert shown == "1.80 USD" and f">{shown}</th>" in billed  # the service's own traffic is billed to no one
