"""What each rule kind reads: the subjects it measures now, each with its value and whether it
crosses the rule's threshold. Reads only; alerts_evaluate turns readings into alerts."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass
from decimal import Decimal

from django.db.models import Count, Max

from controlplane.alerts.models import AlertRule
from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun
from controlplane.catalog.models import ModelTier
from controlplane.fleet.models import EngineEvent, EngineInstance
from controlplane.fleet.selectors import routable_counts
from controlplane.metering.models import SERVER_ERROR, UsageEvent
from controlplane.metering.selectors import budget_terms, keys_spend, quota_shares
from controlplane.metering.traffic import latency_by_class
from controlplane.tenants.models import ApiKey, Quota

A = EngineInstance.Actual
# Out of service, and staying so unless something changes: how long in one of these counts.
STUCK_STATES = (A.UNHEALTHY, A.CRASHED, A.CRASH_LOOP, A.FAILED)
CRASH_STATES = (A.CRASHED, A.CRASH_LOOP)


@dataclass(frozen=True)
class Reading:
    subject: str
    value: Decimal
    breached: bool
    message: str


def readings(*, rule: AlertRule, now: dt.datetime) -> dict[str, Reading]:
    """Every subject `rule` measures now (a subject it does not list reads as clear)."""
    found = _READERS[rule.kind](rule, now)
    return {reading.subject: reading for reading in found}


def _pct(value) -> Decimal:
    return Decimal(value).quantize(Decimal("0.01"))


def _quota_use(rule: AlertRule, now: dt.datetime) -> list[Reading]:
    quotas = Quota.objects.select_related("tenant").filter(tenant__active=True).order_by("tenant__name")
    if rule.tenant_id:
        quotas = quotas.filter(tenant_id=rule.tenant_id)
    quotas = [quota for quota in quotas if not quota.unlimited]
    shares = quota_shares([quota.tenant for quota in quotas], now=now)  # every tenant's in one query
    found = []
    for quota in quotas:
        rows = [row for row in shares[quota.tenant_id] if not row["money"]]  # budgets: _budget_spent
        if not rows:
            continue
        top = rows[0]
        over = [row for row in rows if row["pct"] >= rule.threshold]
        shown = over or [top]
        period = "today" if quota.period == Quota.Period.DAY else "this month"
        parts = [f"{row['pct']:.0f} % of its {row['label'].lower()} ({row['used']:,} of {row['limit']:,} "
                 f"{'in the last minute' if row['name'] == 'requests_per_minute' else period})" for row in shown]
        found.append(Reading(subject=f"tenant:{quota.tenant.name}", value=top["pct"], breached=bool(over),
                             message=f"tenant {quota.tenant.name} has used " + "; ".join(parts)))
    return found


def _budget_spent(rule: AlertRule, now: dt.datetime) -> list[Reading]:
    """Each tenant's budget, hard or soft, and each key's, with the share spent this period."""
    quotas = Quota.objects.select_related("tenant").filter(tenant__active=True, spend_limit__isnull=False)
    keys = ApiKey.objects.select_related("tenant", "tenant__quota").filter(
        spend_limit__isnull=False, revoked_at__isnull=True, tenant__active=True)
    if rule.tenant_id:
        quotas, keys = quotas.filter(tenant_id=rule.tenant_id), keys.filter(tenant_id=rule.tenant_id)
    quotas, keys = list(quotas.order_by("tenant__name")), list(keys.order_by("tenant__name", "prefix"))
    shares = quota_shares([quota.tenant for quota in quotas], now=now)
    found = []
    for quota in quotas:
        for row in shares[quota.tenant_id]:
            if row["money"]:
                found.append(_spent(f"tenant:{quota.tenant.name}", f"tenant {quota.tenant.name}", row["used"],
                                    row["limit"], quota.spend_currency, quota.period, rule, hard=quota.spend_hard))
    spent = keys_spend(keys, now=now)
    for key in keys:
        period, currency = budget_terms(key.tenant)
        found.append(_spent(f"key:{key.prefix}", f"key {key.name or key.prefix} of {key.tenant.name}",
                            spent[key.pk], key.spend_limit, currency, period, rule, hard=True))
    return found


def _spent(subject: str, whose: str, used, limit, currency: str, period: str, rule: AlertRule, *,
           hard: bool) -> Reading:
    pct = _pct(100 * used / limit)
    when = "today" if period == Quota.Period.DAY else "this month"
    kind = "budget" if hard else "soft budget (alerts only)"
    return Reading(subject=subject, value=pct, breached=pct >= rule.threshold,
                   message=f"{whose} has spent {pct:.0f} % of its {kind}: {used:,.2f} of {limit:,.2f} {currency} {when}")


def _engine_unhealthy(rule: AlertRule, now: dt.datetime) -> list[Reading]:
    instances = EngineInstance.objects.filter(desired_state=EngineInstance.Desired.RUNNING).select_related(
        "tier", "node")
    if rule.tier_id:
        instances = instances.filter(tier_id=rule.tier_id)
    instances = list(instances)
    ids = [instance.pk for instance in instances]
    since = now - dt.timedelta(minutes=rule.window_minutes)
    crashes = dict(EngineEvent.objects.filter(instance_id__in=ids, created_at__gte=since, to_state__in=CRASH_STATES)
                   .values_list("instance_id").annotate(n=Count("id")))
    stuck = [instance.pk for instance in instances if instance.actual_state in STUCK_STATES]
    # When each stuck instance last entered the state it is in: the start of its current stint.
    entered = {(row["instance_id"], row["to_state"]): row["at"] for row in EngineEvent.objects.filter(
        instance_id__in=stuck, to_state__in=STUCK_STATES).values("instance_id", "to_state").annotate(at=Max("created_at"))}
    found = []
    for instance in instances:
        where = f"{instance.tier.name}#{instance.pk}" + (f" on {instance.node.name}" if instance.node else "")
        crashed = crashes.get(instance.pk, 0)
        held = None
        if instance.actual_state in STUCK_STATES:
            since_state = entered.get((instance.pk, instance.actual_state)) or instance.started_at
            held = int((now - since_state).total_seconds()) if since_state else rule.for_seconds
        looping = crashed >= rule.threshold
        down = held is not None and held >= rule.for_seconds
        reason = f": {instance.state_reason}" if instance.state_reason else ""
        if looping:
            message = (f"engine {where} crashed {crashed} times in the last {rule.window_minutes} min, "
                       f"now {instance.get_actual_state_display()}{reason}")
        elif held is not None:
            message = f"engine {where} has been {instance.get_actual_state_display()} for {held} s{reason}"
        else:
            message = f"engine {where} is {instance.get_actual_state_display()}, {crashed} crashes in the last {rule.window_minutes} min"
        found.append(Reading(subject=f"instance:{instance.pk}", breached=looping or down, message=message,
                             value=Decimal(crashed if looping or not down else held)))
    return found


def _usage(rule: AlertRule, now: dt.datetime):
    events = UsageEvent.objects.filter(created_at__gte=now - dt.timedelta(minutes=rule.window_minutes))
    if rule.tier_id:
        events = events.filter(tier_id=rule.tier_id)
    if rule.tenant_id:
        events = events.filter(tenant_id=rule.tenant_id)
    return events


def _scope(rule: AlertRule) -> str:
    return f" from tenant {rule.tenant.name}" if rule.tenant_id else ""


def _unrated_usage(rule: AlertRule, now: dt.datetime) -> list[Reading]:
    rows = (_usage(rule, now).filter(rated=False).values("tier__name", "tier__price_plan__name")
            .annotate(n=Count("id")).order_by("tier__name"))
    return [Reading(subject=f"tier:{row['tier__name']}", value=Decimal(row["n"]), breached=row["n"] >= rule.threshold,
                    message=(f"{row['n']} requests{_scope(rule)} on {row['tier__name']} in the last "
                             f"{rule.window_minutes} min were stored without a price (no rate of plan "
                             f"{row['tier__price_plan__name']} in effect): kept unrated, to be priced"))
            for row in rows]


def _error_rate(rule: AlertRule, now: dt.datetime) -> list[Reading]:
    rows = (_usage(rule, now).values("tier__name").annotate(total=Count("id"), errors=Count("id", filter=SERVER_ERROR))
            .order_by("tier__name"))
    found = []
    for row in rows:
        pct = _pct(100 * row["errors"] / row["total"])
        enough = row["total"] >= rule.min_requests
        # No tier: requests refused before their model was known; a gateway that cannot read
        # its models fails every one of them with a 503, which an error rate must see.
        tier = row["tier__name"]
        where = tier or "no model (refused before one was known)"
        found.append(Reading(
            subject=f"tier:{tier or '-'}", value=pct, breached=enough and pct >= rule.threshold,
            message=(f"{pct:.1f} % of requests{_scope(rule)} on {where} failed in the last "
                     f"{rule.window_minutes} min ({row['errors']} of {row['total']} answered 5xx)"
                     + ("" if enough else f"; too few to judge (fewer than {rule.min_requests})"))))
    return found


def _count_disagree(rule: AlertRule, now: dt.datetime) -> list[Reading]:
    rows = (_usage(rule, now).filter(image_tokens_disagree=True).values("tier__name").annotate(n=Count("id"))
            .order_by("tier__name"))
    return [Reading(subject=f"tier:{row['tier__name']}", value=Decimal(row["n"]), breached=row["n"] >= rule.threshold,
                    message=(f"{row['n']} requests{_scope(rule)} on {row['tier__name']} in the last "
                             f"{rule.window_minutes} min: the engine counted other image tokens than the "
                             "gateway (billed at the gateway's count)"))
            for row in rows]


def _set_figures(run: BenchmarkRun) -> dict[int, dict]:
    """A sweep's whole-set accuracy and interval by cap, for the caps that have both."""
    return {cap["cap"]: cap["overall"] for cap in (run.results or {}).get("caps") or []
            if (cap.get("overall") or {}).get("accuracy") is not None and cap["overall"].get("interval")}


def _accuracy(figures: dict, run: BenchmarkRun) -> str:
    low, high = figures["interval"]
    return f"{figures['accuracy']:.1%} [{low:.1%}, {high:.1%}] in run #{run.pk}"


def _quality_regression(rule: AlertRule, now: dt.datetime) -> list[Reading]:
    profiles = BenchmarkProfile.objects.filter(kind=BenchmarkProfile.Kind.RESOLUTION).select_related("tier")
    if rule.tier_id:
        profiles = profiles.filter(tier_id=rule.tier_id)
    succeeded = BenchmarkRun.objects.filter(state=BenchmarkRun.State.SUCCEEDED, finished_at__lte=now)
    found = []
    for profile in profiles.order_by("name"):
        runs = succeeded.filter(profile=profile).order_by("-finished_at", "-id")
        latest = runs.filter(finished_at__gte=now - dt.timedelta(minutes=rule.window_minutes)).first()
        if latest is None:
            continue
        eval_set = (latest.config or {}).get("eval_set")
        previous = runs.filter(finished_at__lte=latest.finished_at, config__eval_set=eval_set).exclude(
            pk=latest.pk).exclude(finished_at=latest.finished_at, pk__gt=latest.pk).first()
        if previous is None:
            continue
        now_figures, before = _set_figures(latest), _set_figures(previous)
        caps = []
        for cap in sorted(set(now_figures) & set(before)):
            drop = Decimal(str(round(100 * (before[cap]["accuracy"] - now_figures[cap]["accuracy"]), 2)))
            apart = now_figures[cap]["interval"][1] < before[cap]["interval"][0]
            caps.append((drop >= rule.threshold and apart, drop, apart, cap))
        if not caps:
            continue
        breached, drop, apart, cap = max(caps)  # the largest breach, else the largest drop
        where = f"{profile.tier.name} (sweep {profile.name} on {eval_set or 'its images'})"
        figures = (f"{_accuracy(now_figures[cap], latest)} against {_accuracy(before[cap], previous)}")
        if breached:
            others = sum(1 for c in caps if c[0]) - 1
            message = (f"{where}: accuracy fell {drop:.1f} points at {cap:,} px, {figures}; the intervals do not "
                       "overlap" + (f"; {others} more {'cap' if others == 1 else 'caps'} fell past the threshold"
                                    if others else ""))
        elif drop >= rule.threshold:
            message = (f"{where}: accuracy fell {drop:.1f} points at {cap:,} px, {figures}, but the intervals "
                       "overlap: within the set's noise")
        elif drop > 0:
            message = f"{where}: at most {drop:.1f} points lost at any cap ({cap:,} px: {figures})"
        else:
            message = f"{where}: no cap lost accuracy ({cap:,} px: {figures})"
        found.append(Reading(subject=f"profile:{profile.name}", value=drop, breached=breached, message=message))
    return found


CLASS_NAMES = {"text": "text requests", "image": "image requests", "large": "large-image requests"}


def _latency_objective(rule: AlertRule, now: dt.datetime) -> list[Reading]:
    tiers = ModelTier.objects.filter(enabled=True).order_by("name")
    if rule.tier_id:
        tiers = tiers.filter(pk=rule.tier_id)
    objectives = {tier: by_class for tier in tiers if (by_class := tier.ttft_objectives())}
    if not objectives:
        return []
    seen = latency_by_class(since=now - dt.timedelta(minutes=rule.window_minutes), until=now + dt.timedelta(seconds=1),
                            tier_ids=[tier.pk for tier in objectives])
    found = []
    for tier, by_class in objectives.items():
        for kind, objective in by_class.items():
            figures = seen.get((tier.pk, kind))
            if figures is None:
                continue
            p95 = figures.first_token[1]
            share = _pct(100 * p95 / objective)
            enough = figures.requests >= rule.min_requests
            found.append(Reading(
                subject=f"tier:{tier.name}:{kind}", value=share, breached=enough and share >= rule.threshold,
                message=(f"{CLASS_NAMES[kind]} on {tier.name}: first token at p95 in {p95:,.0f} ms over the last "
                         f"{rule.window_minutes} min, {share:.0f} % of its {objective:,} ms objective "
                         f"({figures.requests} requests)"
                         + ("" if enough else f"; too few to judge (fewer than {rule.min_requests})"))))
    return found


def _tier_unserved(rule: AlertRule, now: dt.datetime) -> list[Reading]:
    """Each enabled tier's engines that the gateway can route to now; where there are none,
    how long since there last were: since an engine of the tier last left the running state
    (or was last found healthy), else since its engines were first placed. A tier with no
    engine at all has been unserved for as long as it matters: it reads past any threshold."""
    tiers = ModelTier.objects.filter(enabled=True).order_by("name")
    if rule.tier_id:
        tiers = tiers.filter(pk=rule.tier_id)
    found, counts = [], routable_counts(now=now)
    for tier in tiers:
        serving = counts.get(tier.pk, 0)
        if serving:
            found.append(Reading(subject=f"tier:{tier.name}", value=Decimal(0), breached=False,
                                 message=f"{tier.name} is served by {serving} engine{'s' if serving > 1 else ''}"))
            continue
        instances = EngineInstance.objects.filter(tier=tier).exclude(pool="candidate")
        events = EngineEvent.objects.filter(instance__in=instances, created_at__lte=now)
        since = max(filter(None, [
            events.filter(from_state=A.RUNNING).aggregate(at=Max("created_at"))["at"],
            instances.filter(actual_state=A.RUNNING).aggregate(at=Max("last_health_at"))["at"],
        ]), default=None) or events.order_by("created_at").values_list("created_at", flat=True).first()
        states = ", ".join(f"{n} {state}" for state, n in sorted(Counter(
            instances.filter(desired_state=EngineInstance.Desired.RUNNING).values_list("actual_state", flat=True)
        ).items()))
        if since is None:
            held, message = int(rule.threshold), f"{tier.name} is enabled and has no engine to serve it"
        else:
            held = max(0, int((now - since).total_seconds()))
            message = f"{tier.name} has had no engine serving it for {held} s"
        message += f" ({states}); its requests are answered 503" if states else "; its requests are answered 503"
        found.append(Reading(subject=f"tier:{tier.name}", value=Decimal(held), breached=held >= rule.threshold,
                             message=message))
    return found


_READERS = {
    AlertRule.Kind.QUOTA_USE: _quota_use,
    AlertRule.Kind.BUDGET_SPENT: _budget_spent,
    AlertRule.Kind.ENGINE_UNHEALTHY: _engine_unhealthy,
    AlertRule.Kind.UNRATED_USAGE: _unrated_usage,
    AlertRule.Kind.ERROR_RATE: _error_rate,
    AlertRule.Kind.COUNT_DISAGREE: _count_disagree,
    AlertRule.Kind.QUALITY_REGRESSION: _quality_regression,
    AlertRule.Kind.LATENCY_OBJECTIVE: _latency_objective,
    AlertRule.Kind.TIER_UNSERVED: _tier_unserved,
}
