"""Every list page and API endpoint reads the database a fixed number of times, however many
rows it shows: a query per row (N+1) fails here. Each page is read with a few rows of what it
lists, then with many more, and must make the same queries both times; that number is its
baseline, so a page that starts doing twice the work fails too.

A baseline that changes on purpose (a page that shows more, or reads less) is updated here,
in the table, with the page."""

from __future__ import annotations

import datetime as dt
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

import pytest
from django.apps import apps
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.alerts.models import Alert, AlertDelivery, AlertRule, Webhook
from controlplane.audit.models import AuditEntry
from controlplane.benchmarks.models import (
    BenchmarkImage,
    BenchmarkProfile,
    BenchmarkRun,
    EvalImport,
    EvalItem,
    EvalSet,
    GateCheck,
    QualityGate,
)
from controlplane.catalog.models import PriceRate
from controlplane.fleet.models import EngineEvent, EngineInstance, EngineMetricSample, Gpu, Node
from controlplane.gateway.process import GatewayProcess
from controlplane.metering.models import UsageEvent, UsageImage
from controlplane.metering.records import ImageLine, UsageRecord
from controlplane.metering.rollups import rollup_daily, rollup_hourly
from controlplane.metering.services import usage_record_many
from controlplane.tenants.models import Quota, RoutingRule
from controlplane.tenants.services import api_key_create
from tests.factories import (
    PricePlanFactory,
    ResolutionPolicyFactory,
    TenantFactory,
    VisionTierFactory,
    make_operator,
    make_tenant_admin,
)

pytestmark = pytest.mark.django_db

FEW, MANY = 3, 30
PICTURE = ImageLine(source_format="png", source_width=800, source_height=600, width=784, height=588,
                    fingerprint="0" * 16)


# -- rows of what the pages list: make(world, numbers) adds one row (or one of each) per number --

def _requests(world, numbers, *, tenant=None, tier=None, prefix="req", at=None):
    """Requests answered with one image each, a second apart (or `at(n)`), recorded as the
    gateway records them."""
    tenant = tenant or world.alice
    key = tenant.api_keys.order_by("pk").first()
    now = timezone.now()
    usage_record_many(records=[UsageRecord(
        request_id=f"{prefix}-{n}", tenant_id=tenant.pk, api_key_id=key.pk if key else None,
        tier_id=(tier or world.vision).pk, created_at=at(n) if at else now - dt.timedelta(seconds=n),
        images=[(PICTURE, 500, 0)], image_tokens=500, text_tokens=40, output_tokens=12) for n in numbers])


def _rollup():
    later = timezone.now() + dt.timedelta(seconds=2)  # past the moment every request was recorded
    rollup_hourly(now=later)
    rollup_daily(now=later)


def requests(world, numbers):
    _requests(world, numbers)


def requests_rolled_up(world, numbers):
    """Alice's requests on as many keys, in the hourly and daily rollups."""
    for n in numbers:
        api_key_create(tenant=world.alice, name=f"key-{n}")
        _requests(world, [n], prefix=f"keyed-{n}")
    _rollup()


def tiers(world, numbers):
    """Vision tiers on the standard policy."""
    for n in numbers:
        VisionTierFactory(name=f"tier-{n}")


def tiers_used(world, numbers):
    """Tiers that alice sent a request to, rolled up: a line each in her statements and totals."""
    for n in numbers:
        _requests(world, [n], tier=VisionTierFactory(name=f"tier-{n}"), prefix=f"on-tier-{n}")
    _rollup()


def policies(world, numbers):
    """Policies, each with a vision tier that uses it."""
    for n in numbers:
        VisionTierFactory(name=f"tier-{n}", resolution_policy=ResolutionPolicyFactory(name=f"policy-{n}"))


def price_plans(world, numbers):
    """Plans, each with its rate and a tier that bills on it."""
    for n in numbers:
        VisionTierFactory(name=f"tier-{n}", price_plan=PricePlanFactory(name=f"plan-{n}"))


def rates(world, numbers):
    """Rates of the vision tier's plan an hour apart, up to now, each of which billed a request."""
    plan, now = world.vision.price_plan, timezone.now()
    def start(n):
        return now - dt.timedelta(hours=MANY - n)

    for n in numbers:
        PriceRate.objects.create(plan=plan, effective_from=start(n), image_per_mtok=Decimal("0.30"),
                                 output_per_mtok=Decimal("0.60"))
        _requests(world, [n], prefix="rated", at=lambda n: start(n) + dt.timedelta(minutes=1))


def tenants(world, numbers):
    """Tenants with a quota of their own, a tier allowed and a request this month."""
    for n in numbers:
        tenant = TenantFactory(name=f"tenant-{n}")
        Quota.objects.create(tenant=tenant, image_tokens=1_000_000)
        tenant.allowed_tiers.add(world.vision)
        _requests(world, [n], tenant=tenant, prefix=f"of-tenant-{n}")


def tenants_rolled_up(world, numbers):
    tenants(world, numbers)
    _rollup()


def keys(world, numbers):
    """Keys of as many tenants, each scoped to a tier."""
    for n in numbers:
        tenant = TenantFactory(name=f"tenant-{n}")
        tenant.allowed_tiers.add(world.vision)
        api_key_create(tenant=tenant, name=f"key-{n}", tiers=[world.vision])


def own_keys(world, numbers):
    """Alice's keys, each scoped to a tier, each with a request this month."""
    for n in numbers:
        api_key_create(tenant=world.alice, name=f"key-{n}", tiers=[world.vision])
    _requests(world, numbers)


def routing_rules(world, numbers):
    """Default rules, and rules of alice, of her key and of tenants of their own, some cascading."""
    key = world.alice.api_keys.order_by("pk").first()
    for n in numbers:
        escalate = {"escalate_to": world.vision, "threshold": 0.5, "send_detail": "low"} if n % 2 else {}
        RoutingRule.objects.create(position=n, tier=world.vision, tasks=f"task-{n}", **escalate)
        RoutingRule.objects.create(tenant=world.alice, position=n, tier=world.vision, min_images=n)
        RoutingRule.objects.create(tenant=world.alice, api_key=key, position=n, tier=world.text, **escalate)
        RoutingRule.objects.create(tenant=TenantFactory(name=f"tenant-{n}"), tier=world.vision)


def users(world, numbers):
    """Users of every role: operators, and tenant admins of tenants of their own."""
    for n in numbers:
        if n % 2:
            make_operator(f"operator-{n}")
        else:
            make_tenant_admin(TenantFactory(name=f"tenant-{n}"), f"admin-{n}")


def engines(world, numbers):
    """Nodes with a GPU each and an engine on it, with an event."""
    now = timezone.now()
    for n in numbers:
        node = Node.objects.create(name=f"node-{n}", queue=f"node.node-{n}", last_seen_at=now)
        gpu = Gpu.objects.create(node=node, index=0, model="H100 80GB", memory_mib=81559)
        instance = EngineInstance.objects.create(tier=world.vision, node=node, port=8000 + n, actual_state="running",
                                                 healthy=True, started_at=now, metrics_at=now)
        instance.gpus.add(gpu)
        EngineEvent.objects.create(instance=instance, from_state="starting", to_state="running", reason="healthy")
        EngineMetricSample.objects.create(instance=instance, at=now - dt.timedelta(seconds=n), waiting=1.0)


def engine_history(world, numbers):
    """One engine's events and metric samples."""
    now = timezone.now()
    instance, _ = EngineInstance.objects.get_or_create(tier=world.vision, port=9000,
                                                       defaults={"actual_state": "running", "healthy": True})
    EngineEvent.objects.bulk_create(EngineEvent(instance=instance, from_state="running", to_state="running",
                                                reason=f"event {n}", created_at=now - dt.timedelta(seconds=n))
                                    for n in numbers)
    EngineMetricSample.objects.bulk_create(EngineMetricSample(instance=instance, at=now - dt.timedelta(seconds=5 * n),
                                                              waiting=float(n)) for n in numbers)


def alerts(world, numbers):
    """Rules, each with an alert firing and one resolved, sent to a webhook of its own that failed."""
    now = timezone.now()
    for n in numbers:
        rule = AlertRule.objects.create(name=f"rule-{n}", kind="quota_use", threshold=Decimal(80),
                                        tier=world.vision if n % 2 else None, tenant=world.alice if n % 3 else None)
        firing = Alert.objects.create(rule=rule, subject=f"tenant:{n}", value=Decimal(90), message="over")
        Alert.objects.create(rule=rule, subject=f"tenant:{n}", value=Decimal(90), message="over", state="resolved",
                             resolved_at=now, resolution="back under")
        webhook = Webhook.objects.create(name=f"hook-{n}", url="http://127.0.0.1:9/hooks/none", kinds=["quota_use"])
        AlertDelivery.objects.create(alert=firing, webhook=webhook, event="fired", payload={}, state="failed",
                                     attempts=5, last_error="connection refused")


def audit_entries(world, numbers):
    AuditEntry.objects.bulk_create(AuditEntry(actor=f"user-{n}", action="changed", object_type="tier",
                                              object_id=str(n), object_repr=f"tier-{n}", changes={"enabled": [0, 1]})
                                   for n in numbers)


def images(world, numbers):
    """The images of one request."""
    _requests(world, [0], prefix="pictured")
    event = UsageEvent.objects.get(request_id="pictured-0")
    UsageImage.objects.bulk_create(UsageImage(event=event, created_at=event.created_at, position=n + 1, source_format="png", source_width=800,
                                              source_height=600, width=784, height=588, tokens=500,
                                              fingerprint=f"{n:016x}") for n in numbers)


def _profile(world, name, **fields):
    return BenchmarkProfile.objects.create(name=name, tier=world.vision, sweep=[2], **fields)


def _eval_set(world, name):
    return EvalSet.objects.create(name=name, source="generated", generator="count", seed=1,
                                  created_by=world.operator)


def profiles(world, numbers):
    """Profiles with an eval set, an engine and a run each."""
    for n in numbers:
        profile = _profile(world, f"profile-{n}", eval_set=_eval_set(world, f"set-{n}"),
                           instance=EngineInstance.objects.create(tier=world.vision))
        BenchmarkRun.objects.create(profile=profile, created_by=world.operator, state="succeeded", label=f"run {n}")


def runs(world, numbers):
    """Runs of one profile, and the images it sends."""
    profile = BenchmarkProfile.objects.filter(name="watched").first() or _profile(world, "watched")
    for n in numbers:
        BenchmarkRun.objects.create(profile=profile, created_by=world.operator, state="succeeded", label=f"run {n}")
        BenchmarkImage.objects.create(profile=profile, name=f"image-{n}.png", content_type="image/png", width=64,
                                      height=48, data=b"")


def eval_sets(world, numbers):
    """Sets with items of two task types, and the imports that made them."""
    for n in numbers:
        eval_set = _eval_set(world, f"set-{n}")
        _items(eval_set, [0, 1])
        EvalImport.objects.create(name=f"set-{n}", file_name=f"set-{n}.csv", task_type="count", state="succeeded",
                                  eval_set=eval_set, created_by=world.operator)


def _items(eval_set, numbers):
    EvalItem.objects.bulk_create(EvalItem(eval_set=eval_set, row=n, task_type=("count", "read")[n % 2],
                                          question=f"how many? {n}", answers=[str(n)], content_type="image/png",
                                          width=64, height=48, data=b"") for n in numbers)


def items(world, numbers):
    """The items of one set."""
    eval_set = EvalSet.objects.filter(name="watched").first() or _eval_set(world, "watched")
    _items(eval_set, numbers)


def gates(world, numbers):
    """Gated tiers, and checks of their policies and of the tiers themselves."""
    for n in numbers:
        tier = VisionTierFactory(name=f"tier-{n}", resolution_policy=ResolutionPolicyFactory(name=f"policy-{n}"))
        QualityGate.objects.create(tier=tier, eval_set=_eval_set(world, f"set-{n}"))
        GateCheck.objects.create(policy=tier.resolution_policy, current={}, proposed={}, requested_by=world.operator)
        GateCheck.objects.create(tier=tier, current={}, proposed={}, requested_by=world.operator,
                                 decided_by=world.operator, state="applied",
                                 candidate=EngineInstance.objects.create(tier=tier, pool="candidate"))


# -- the pages -------------------------------------------------------------------------------

def _pk(model, **lookup) -> Callable:
    return lambda: model.objects.get(**lookup).pk


@dataclass(frozen=True)
class Page:
    name: str
    url: str  # may name {pk}: the pk of the row `pk` finds
    role: str  # the World's user who reads it, or alice_key: alice's API key
    make_rows: Callable
    queries: int  # the baseline: queries per reading (the session and the user included)
    pk: Callable | None = None
    cold: bool = False  # read by a gateway process that has cached nothing yet


MONTH = f"{timezone.now():%Y-%m}"

PAGES = [
    # The product pages.
    # the operator's home is the service's health: a few queries per tier (its engines), none per row;
    # one more reads the keys with a budget of their own (and one their spend, when there are any)
    Page("home", "/", "operator", tenants_rolled_up, 17),
    Page("home as a tenant admin", "/", "alice_admin", requests_rolled_up, 11),
    Page("tiers", "/tiers/", "operator", tiers, 6),
    # its engines, serving count, last hour and month at a glance: five reads, none per row
    Page("tier", "/tiers/vlm-lite/", "operator", engines, 15),
    Page("policies", "/policies/", "operator", policies, 8),  # one of them: every tier's colour
    Page("policy", "/policies/standard/", "operator", tiers, 12),
    Page("prices", "/prices/", "finance", price_plans, 7),
    Page("price plan", "/prices/vlm-lite/", "finance", rates, 7),
    Page("tenants", "/tenants/", "operator", tenants, 9),
    Page("tenant", "/tenants/alice/", "operator", tiers, 13),
    Page("keys", "/keys/", "operator", keys, 11),
    Page("account", "/account/", "alice_admin", own_keys, 14),
    Page("users", "/users/", "operator", users, 9),
    Page("routing rules", "/rules/", "operator", routing_rules, 9),  # the defaults, tenants with rules, the dry run
    Page("tenant routing rules", "/tenants/alice/rules/", "operator", routing_rules, 10),
    Page("account routing rules", "/account/rules/", "alice_admin", routing_rules, 8),
    Page("fleet", "/fleet/", "operator", engines, 14),
    # one of them: every tier's colour, its load drawn in its tier's
    Page("fleet engine", "/fleet/{pk}/", "operator", engine_history, 9, _pk(EngineInstance, port=9000)),
    Page("operations", "/operations/", "operator", engines, 16),  # latency by class: per tier, per engine
    Page("alerts", "/alerts/", "operator", alerts, 11),
    Page("audit log", "/audit/", "finance", audit_entries, 8),
    Page("request log", "/requests/", "operator", requests, 8),
    Page("request log as a tenant admin", "/requests/", "alice_admin", requests, 8),
    Page("request", "/requests/pictured-0/", "operator", images, 9),  # one of them: its captured body
    Page("statements", f"/statements/?tenant=alice&month={MONTH}", "finance", tiers_used, 9),  # 9: whether the month was retired (its events dropped)
    Page("exports", "/exports/", "finance", tenants, 5),
    Page("per-image export", f"/exports/images.csv?month={MONTH}", "finance", requests, 7),
    Page("monthly summary export", f"/exports/monthly-summary.csv?month={MONTH}", "finance", tenants_rolled_up, 5),
    Page("benchmarks", "/benchmarks/", "operator", profiles, 7),
    Page("benchmark profile", "/benchmarks/{pk}/", "operator", runs, 11, _pk(BenchmarkProfile, name="watched")),
    Page("benchmark run", "/benchmarks/runs/{pk}/", "operator", runs, 8,  # one of them: every tier's colour
         lambda: BenchmarkRun.objects.filter(profile__name="watched").order_by("pk").first().pk),
    Page("eval sets", "/benchmarks/sets/", "operator", eval_sets, 8),
    Page("eval set", "/benchmarks/sets/{pk}/", "operator", items, 10, _pk(EvalSet, name="watched")),
    Page("quality gates", "/benchmarks/gates/", "operator", gates, 9),
    # The gateway's and the REST API's.
    Page("api models", "/v1/models", "alice_key", tiers, 7, cold=True),
    Page("api usage requests", "/api/v1/usage/requests/", "alice_key", requests, 4),
    Page("api usage hourly", "/api/v1/usage/hourly/", "alice_key", requests_rolled_up, 3),
    Page("api usage daily", "/api/v1/usage/daily/", "alice_key", requests_rolled_up, 3),
    Page("api usage by tier", "/api/v1/usage/by-tier/", "alice_key", tiers_used, 3),
    Page("api quota", "/api/v1/quota/", "alice_key", requests, 2),
    Page("api cost", "/api/v1/cost/", "alice_key", tiers_used, 2),
    Page("api statement", f"/api/v1/statements/{MONTH}/", "alice_key", tiers_used, 5),  # 5: whether the month was retired
    Page("api per-image export", f"/api/v1/exports/images.csv?month={MONTH}", "finance", requests, 7),
    Page("api monthly summary export", f"/api/v1/exports/monthly-summary.csv?month={MONTH}", "finance",
         tenants_rolled_up, 5),
    Page("api benchmark profiles", "/api/v1/benchmarks/profiles/", "operator", profiles, 6),
    Page("api benchmark profile", "/api/v1/benchmarks/profiles/{pk}/", "operator", runs, 5,
         _pk(BenchmarkProfile, name="watched")),
    Page("api benchmark runs", "/api/v1/benchmarks/runs/", "operator", profiles, 6),
    Page("api benchmark run", "/api/v1/benchmarks/runs/{pk}/", "operator", runs, 5,
         lambda: BenchmarkRun.objects.filter(profile__name="watched").order_by("pk").first().pk),
    Page("api eval sets", "/api/v1/benchmarks/eval-sets/", "operator", eval_sets, 7),
    Page("api eval set", "/api/v1/benchmarks/eval-sets/{pk}/", "operator", items, 6, _pk(EvalSet, name="watched")),
]


def _shape(sql: str) -> str:
    """A query without its values: the same query for another row has the same shape."""
    return re.sub(r"'[^']*'|\d+", "?", sql)


def _read(client, world, page: Page, url: str) -> list[str]:
    """The queries of one reading of the page (a streamed file read to its end)."""
    headers = {"Authorization": f"Bearer {world.alice_key}"} if page.role == "alice_key" else {}
    if page.cold:
        apps.get_app_config("gateway").process = GatewayProcess.from_settings()
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url, headers=headers)
        if response.streaming:
            b"".join(response.streaming_content)
    assert response.status_code == 200, (url, response.status_code)
    return [query["sql"] for query in captured.captured_queries]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_a_page_reads_as_much_for_many_rows_as_for_a_few(client, world, page):
    if page.role != "alice_key":
        client.force_login(getattr(world, page.role))
    page.make_rows(world, range(FEW))
    url = page.url.format(pk=page.pk() if page.pk else None)
    _read(client, world, page, url)  # the session, the caches: what a first reading alone does
    few = _read(client, world, page, url)
    page.make_rows(world, range(FEW, MANY))
    many = _read(client, world, page, url)
    grown = "\n".join(f"{n} more: {shape}" for shape, n in
                      (Counter(map(_shape, many)) - Counter(map(_shape, few))).items())
    assert len(many) == len(few), f"{page.name}: {len(few)} queries for {FEW} rows, {len(many)} for {MANY}:\n{grown}"
    assert len(few) == page.queries, (f"{page.name}: {len(few)} queries where its baseline says {page.queries}; "
                                      "if the page reads more or less on purpose, say so in PAGES")
