from __future__ import annotations

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineEvent, EngineInstance, Gpu, Node
from controlplane.fleet.services import tier_replicas_sync
from tests.factories import VisionTierFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(world):
    node = Node.objects.create(name="gpu-a", address="10.0.0.5", queue="node.gpu-a", vllm_version="0.11.0",
                               last_seen_at=timezone.now())
    gpu = Gpu.objects.create(node=node, index=0, model="H100", memory_mib=81559)
    running = EngineInstance.objects.create(tier=world.vision, node=node, port=8100, pid=4242, actual_state="running",
                                            healthy=True, kv_cache_usage=0.37, num_running=3, num_waiting=2,
                                            log_tail="INFO engine ready\n")
    running.gpus.add(gpu)
    return world, node, running


def test_operators_see_nodes_gpus_and_instances_with_their_load(client, fleet):
    world, node, running = fleet
    client.force_login(world.operator)
    page = client.get("/fleet/").content.decode()
    assert "gpu-a" in page and "H100" in page and f"→ #{running.pk}" in page  # which engine holds the GPU
    row = page.split(f'data-instance="{running.pk}"')[1].split("</tr>")[0]
    assert "37%" in row and "3 / 2" in row and "running" in row


def test_drain_stop_and_launch_move_the_desired_state_and_are_logged(client, fleet):
    world, node, running = fleet
    client.force_login(world.operator)
    client.post(f"/fleet/{running.pk}/drain/")
    running.refresh_from_db()
    assert running.desired_state == "stopped" and running.drain
    client.post(f"/fleet/{running.pk}/launch/")
    running.refresh_from_db()
    assert running.desired_state == "running" and not running.drain
    reasons = list(EngineEvent.objects.filter(instance=running).values_list("reason", flat=True))
    assert any(f"drain requested by {world.operator.username}" in r for r in reasons)
    assert any(f"launched by {world.operator.username}" in r for r in reasons)


def _wanted_running(tier):
    return list(tier.instances.filter(desired_state="running").order_by("pk"))


def test_a_drain_lowers_the_tiers_replicas_instead_of_spawning_a_hidden_replacement(client, fleet):
    world, node, running = fleet
    client.force_login(world.operator)
    page = client.post(f"/fleet/{running.pk}/drain/", follow=True).content.decode()
    assert "vlm-lite now wants 0 replicas" in page
    tier_replicas_sync()
    world.vision.refresh_from_db()
    assert world.vision.replicas == 0 and _wanted_running(world.vision) == []
    entry = AuditEntry.objects.get(object_type="model tier", object_id=str(world.vision.pk))
    assert entry.changes["replicas"] == [1, 0] and entry.actor == world.operator.username


def test_replace_drains_the_instance_and_launches_another_in_its_place(client, fleet):
    world, node, running = fleet
    client.force_login(world.operator)
    page = client.post(f"/fleet/{running.pk}/drain/", {"replace": "1"}, follow=True).content.decode()
    assert "a replacement is launched" in page
    tier_replicas_sync()
    world.vision.refresh_from_db()
    replacement = _wanted_running(world.vision)
    assert world.vision.replicas == 1 and len(replacement) == 1 and replacement[0].pk != running.pk


def test_launching_a_stopped_instance_again_leaves_one_instance_per_replica(client, fleet):
    world, node, running = fleet
    client.force_login(world.operator)
    client.post(f"/fleet/{running.pk}/stop/")
    tier_replicas_sync()
    client.post(f"/fleet/{running.pk}/launch/")
    tier_replicas_sync()
    world.vision.refresh_from_db()
    assert world.vision.replicas == 1 and _wanted_running(world.vision) == [running]


def test_disabling_a_tier_drains_its_engines_and_enabling_it_launches_them_again(client, fleet):
    world, node, running = fleet
    other = VisionTierFactory(name="vlm-other", default_for_images=False)
    world.vision.default_for_images = False
    world.vision.save()
    other.default_for_images = True
    other.save()
    client.force_login(world.operator)
    client.post(f"/tiers/{world.vision.name}/disable/")
    tier_replicas_sync()
    running.refresh_from_db()
    assert running.desired_state == "stopped" and running.drain
    assert EngineEvent.objects.filter(instance=running, reason__contains="tier disabled").exists()
    assert client.post(f"/fleet/{running.pk}/launch/", follow=True).content.decode().count(
        "is disabled: enable the tier first") == 1
    EngineInstance.objects.filter(pk=running.pk).update(actual_state="stopped", pid=None)  # it has drained
    client.post(f"/tiers/{world.vision.name}/enable/")
    tier_replicas_sync()
    assert _wanted_running(world.vision) == [running]  # launched again, not a new row beside it


def test_lowering_the_replicas_drains_the_least_useful_engines_first(client, fleet):
    world, node, running = fleet
    crashed = EngineInstance.objects.create(tier=world.vision, node=node, actual_state="failed")
    healthy_new = EngineInstance.objects.create(tier=world.vision, node=node, actual_state="running", healthy=True)
    world.vision.replicas = 3
    world.vision.save()
    client.force_login(world.operator)
    client.post(f"/fleet/tiers/{world.vision.name}/replicas/", {"replicas": 1})
    tier_replicas_sync()
    assert _wanted_running(world.vision) == [running]  # the crashed one first, then the newest
    crashed.refresh_from_db()
    healthy_new.refresh_from_db()
    assert crashed.desired_state == healthy_new.desired_state == "stopped"
    assert "Replicas must be a whole number" in client.post(
        f"/fleet/tiers/{world.vision.name}/replicas/", {"replicas": "-1"}, follow=True).content.decode()


def test_destructive_actions_ask_for_confirmation_and_the_page_updates_in_place(client, fleet):
    world, node, running = fleet
    client.force_login(world.operator)
    page = client.get("/fleet/").content.decode()
    assert 'http-equiv="refresh"' not in page and 'data-live="5"' in page
    row = page.split(f'data-instance="{running.pk}"')[1].split("</tr>")[0]
    for action in ("drain", "stop"):
        form = row.split(f'action="/fleet/{running.pk}/{action}/"')[1].split(">")[0]
        assert "data-confirm=" in form


def test_only_operators_act_on_the_fleet(client, fleet):
    world, node, running = fleet
    client.force_login(world.finance)
    assert client.post(f"/fleet/{running.pk}/stop/").status_code == 403
    assert client.get(f"/fleet/{running.pk}/").status_code == 403
    running.refresh_from_db()
    assert running.desired_state == "running"


def test_the_instance_page_shows_its_log_tail_and_load_chart(client, fleet):
    from controlplane.fleet.models import EngineMetricSample

    world, node, running = fleet
    ttft = {"buckets": [[0.1, 4], ["+Inf", 5]], "sum": 0.4, "count": 5}
    for n in range(3):
        EngineMetricSample.objects.create(instance=running, running=n, waiting=1, kv_cache_usage=0.2, ttft=ttft)
    client.force_login(world.operator)
    page = client.get(f"/fleet/{running.pk}/").content.decode()
    assert "INFO engine ready" in page
    assert 'id="engine-load"' in page and "TTFT p50" in page


def test_an_external_engine_is_registered_by_url(client, world):
    tier = ModelTier.objects.create(name="vlm-k8s", family="qwen2_5_vl", model_id="Qwen/Qwen2.5-VL-7B-Instruct",
                                    kind="vision", engine_kind="external", resolution_policy=world.vision.resolution_policy,
                                    price_plan=world.vision.price_plan)
    client.force_login(world.operator)
    client.post("/fleet/external/", {"tier": tier.pk, "url": "http://vllm-7b.inference.svc:8000"})
    instance = EngineInstance.objects.get(tier=tier)
    assert instance.base_url == "http://vllm-7b.inference.svc:8000" and instance.node is None
    client.post("/fleet/external/", {"tier": tier.pk, "url": "file:///etc/passwd"})
    assert EngineInstance.objects.filter(tier=tier).count() == 1


def test_an_external_engine_inside_the_network_is_an_explicit_choice(client, world, settings):
    tier = ModelTier.objects.create(name="vlm-k8s", family="qwen2_5_vl", model_id="Qwen/Qwen2.5-VL-7B-Instruct",
                                    kind="vision", engine_kind="external", resolution_policy=world.vision.resolution_policy,
                                    price_plan=world.vision.price_plan)
    client.force_login(world.operator)
    for url, reason in [("http://10.1.2.3:8000", "resolves to 10.1.2.3, a private address"),
                        ("http://169.254.169.254", "a cloud metadata address"),
                        ("http://[::ffff:0:7f00:1]:8000", "127.0.0.1, a loopback address"),
                        ("http://admin:pw@vllm.example.com:8000", "must not contain a user name or password")]:
        page = client.post("/fleet/external/", {"tier": tier.pk, "url": url}, follow=True).content.decode()
        assert reason in page and "engine URL" in page
    assert not EngineInstance.objects.filter(tier=tier).exists()
    settings.OPERATOR_URL_TRUSTED_NETWORKS = ["10.1.0.0/16"]
    client.post("/fleet/external/", {"tier": tier.pk, "url": "http://10.1.2.3:8000"})
    assert EngineInstance.objects.get(tier=tier).base_url == "http://10.1.2.3:8000"


def test_the_control_plane_exposes_its_own_prometheus_metrics(client, fleet, settings):
    from controlplane.fleet.engine_metrics import parse

    world, node, running = fleet
    assert client.get("/metrics").status_code == 403  # outside DEBUG, no token: nothing to see
    settings.DEBUG = True
    series = parse(client.get("/metrics").content.decode())
    assert ({"tier": "vlm-lite", "state": "running"}, 1.0) in series["vlmcp_engine_instances"]
    assert ({"instance": str(running.pk), "tier": "vlm-lite"}, 0.37) in series["vlmcp_engine_kv_cache_usage"]
    settings.METRICS_TOKEN = "scrape-me"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me").status_code == 200


def test_operators_see_which_tiers_engines_counted_other_image_tokens(client, fleet):
    from controlplane.metering.records import UsageRecord
    from controlplane.metering.services import usage_record

    world, _, running = fleet
    client.force_login(world.operator)
    assert "Every engine counted the image tokens" in client.get("/fleet/").content.decode()
    for n, disagree in enumerate((True, True, False)):
        usage_record(record=UsageRecord(request_id=f"req_{n}", tenant_id=world.alice.pk, api_key_id=None,
                                 tier_id=world.vision.pk, instance_id=running.pk, image_tokens=1198,
                                 engine_image_tokens=1190 if disagree else 1196, image_tokens_disagree=disagree))
    section = client.get("/fleet/").content.decode().split('id="image-count-disagreements"')[1].split("</section>")[0]
    assert "billed at the gateway's count" in section
    assert f"<td>{world.vision.name}</td><td>2</td>" in section


@pytest.mark.parametrize("tier", ["", "external", "9" * 30, "1.5"])
def test_registering_an_engine_for_a_tier_that_is_not_one_is_a_404(client, world, tier):
    client.force_login(world.operator)
    response = client.post("/fleet/external/", {"tier": tier, "url": "http://vllm-7b.inference.svc:8000"})
    assert response.status_code == 404


def test_an_engine_not_scraped_yet_says_so_where_its_load_chart_will_be(client, fleet):
    world, node, running = fleet
    client.force_login(world.operator)
    page = client.get(f"/fleet/{running.pk}/").content.decode()
    assert 'id="engine-load"' in page and "No scrapes of this engine yet." in page
    assert "Plotly.newPlot" not in page
