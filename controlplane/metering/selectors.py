"""Reads of metered usage that are not rollups."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from decimal import Decimal

from django.db.models import Count, Max, Q, Sum
from django.utils import timezone

from controlplane.metering.models import UsageEvent
from controlplane.metering.periods import period_start
from controlplane.metering.services import billed, metered_sums


def image_count_disagreements(*, since: dt.datetime) -> list[dict]:
    """Per tier since `since`: answers whose engine counted other image tokens than the
    gateway, and the latest of them (a partial index keeps this cheap at any volume)."""
    return list(
        UsageEvent.objects.filter(image_tokens_disagree=True, created_at__gte=since)
        .values("tier__name").annotate(count=Count("id"), latest=Max("created_at")).order_by("tier__name")
    )


@dataclass(frozen=True)
class LogQuery:
    """What the request log is asked for. Ids are already resolved and within what the
    reader may see; `statuses` empty means any."""

    tenant_ids: tuple[int, ...] | None = None  # None: every tenant
    api_key_id: int | None = None
    tier_id: int | None = None
    statuses: tuple[str, ...] = ()
    failed_only: bool = False  # anything but ok
    latency_min_ms: int | None = None
    latency_max_ms: int | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    request_id: str = ""


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MICROSECOND = dt.timedelta(microseconds=1)


@dataclass(frozen=True)
class LogCursor:
    """Where a page of the log ends: the (created_at, id) of its last event."""

    created_at: dt.datetime
    id: int

    def encode(self) -> str:
        return f"{(self.created_at - _EPOCH) // _MICROSECOND}.{self.id}"  # exact, unlike a float timestamp

    @classmethod
    def decode(cls, text: str | None) -> LogCursor | None:
        try:
            micros, pk = (text or "").split(".")
            return cls(_EPOCH + int(micros) * _MICROSECOND, int(pk))
        except (ValueError, OverflowError, OSError):
            return None


def usage_log(query: LogQuery, *, after: LogCursor | None = None, limit: int = 50) -> tuple[list, LogCursor | None]:
    """A page of events newest first, and the cursor of the next page (None at the end).

    One query over every month's partition. Bounding it by the months partitioned (so that
    PostgreSQL walks them newest first, an ordered Append, rather than merging all of them)
    was measured and lost: its planning costs more than it saves at 10 and 30 million events
    (bench/growth)."""
    page = list(usage_log_events(query, after=after)[: limit + 1])
    more = len(page) > limit
    page = page[:limit]
    return page, LogCursor(page[-1].created_at, page[-1].id) if more else None


def usage_log_events(query: LogQuery, *, after: LogCursor | None = None):
    """The events of the log, newest first, from below `after`.

    Keyset pagination: a page starts below the last (created_at, id) seen, so page 1,000 costs
    what page 1 does. The redundant `created_at <= cursor` bound is what lets the database
    start its index walk at the cursor rather than filter its way down to it."""
    events = UsageEvent.objects.select_related("tenant", "tier__price_plan", "api_key")
    if query.request_id:
        events = events.filter(request_id=query.request_id)
    if query.tenant_ids is not None:
        events = events.filter(tenant_id__in=query.tenant_ids)
    if query.api_key_id is not None:
        events = events.filter(api_key_id=query.api_key_id)
    if query.tier_id is not None:
        events = events.filter(tier_id=query.tier_id)
    if query.failed_only:
        events = events.filter(~Q(status=UsageEvent.Status.OK))
    if query.statuses:
        events = events.filter(status__in=query.statuses)
    if query.latency_min_ms is not None:
        events = events.filter(latency_ms__gte=query.latency_min_ms)
    if query.latency_max_ms is not None:
        events = events.filter(latency_ms__lte=query.latency_max_ms)
    if query.since is not None:
        events = events.filter(created_at__gte=query.since)
    if query.until is not None:
        events = events.filter(created_at__lt=query.until)
    if after is not None:
        events = events.filter(Q(created_at__lte=after.created_at)
                               & (Q(created_at__lt=after.created_at) | Q(id__lt=after.id)))
    return events.order_by("-created_at", "-id")


def usage_event_detail(*, request_id: str, tenant_ids: tuple[int, ...] | None) -> UsageEvent | None:
    """One event with its images, engine and key, if the reader may see its tenant."""
    events = UsageEvent.objects.select_related("tenant", "tier__price_plan", "api_key", "instance", "instance__node")
    if tenant_ids is not None:
        events = events.filter(tenant_id__in=tenant_ids)
    event = events.filter(request_id=request_id).first()
    if event is not None:
        event.image_rows = list(event.images.order_by("position"))
    return event


def cascade_attempts(event: UsageEvent) -> tuple[UsageEvent, UsageEvent | None] | None:
    """A cascade's two attempts, (first, escalation), when `event` is either of them: the
    escalation None when the first answer was kept (one that did not succeed means the first
    answer was sent after all); the first None when it is no longer kept. None when `event` is
    no cascade's."""
    related = UsageEvent.objects.select_related("tier").filter(tenant_id=event.tenant_id)
    if event.cascade_of:
        return related.filter(request_id=event.cascade_of).first(), event
    if event.escalation or event.confidence is not None:
        return event, related.filter(cascade_of=event.request_id).first() if event.escalation else None
    return None


def quota_use(*, tenant, quota, now: dt.datetime | None = None) -> list[dict]:
    """Each limit of `quota` beside what `tenant` has used against it, as admission counts
    (the tenant pages and the quota alerts read the same figures)."""
    return [] if quota is None else _use({tenant.pk: quota}, now or timezone.now())[tenant.pk]


def quotas_use(tenants, *, now: dt.datetime | None = None) -> dict[int, list[dict]]:
    """quota_use of each of `tenants` (each with its `quota`, or none), by tenant id: the same
    figures, read in one query for them all."""
    quotas = {tenant.pk: quota for tenant in tenants if (quota := getattr(tenant, "quota", None)) is not None}
    use = _use(quotas, now or timezone.now())
    return {tenant.pk: use.get(tenant.pk, []) for tenant in tenants}


def _use(quotas: dict, now: dt.datetime) -> dict[int, list[dict]]:
    """What each tenant (by id, with its quota) has used against its quota, in one query: image
    and total tokens and spend in its budget's currency this period, requests this minute."""
    minute = now - dt.timedelta(minutes=1)
    starts = {period: period_start(period, now) for period in {quota.period for quota in quotas.values()}}
    # Refusals at authentication are not among a quota's requests (admission never counted them).
    sums = {"requests_per_minute": Count("id", filter=Q(created_at__gte=minute) & ~Q(error_stage="authentication"))}
    for period, since in starts.items():
        sums |= {f"{period}_{name}": total
                 for name, total in metered_sums(filter=billed() & Q(created_at__gte=since)).items()}
    for period, currency in {(quota.period, quota.spend_currency) for quota in quotas.values()}:
        sums[f"{period}_{currency}"] = Sum("cost", filter=billed() & Q(created_at__gte=starts[period],
                                                                       rate__plan__currency=currency))
    read = {row["tenant_id"]: row for row in UsageEvent.objects.filter(
        tenant_id__in=quotas, created_at__gte=min([minute, *starts.values()])).values("tenant_id").order_by()
        .annotate(**sums)} if quotas else {}
    use = {}
    for tenant_id, quota in quotas.items():
        row = read.get(tenant_id, {})
        use[tenant_id] = _quota_rows(quota, {"image_tokens": int(row.get(f"{quota.period}_image") or 0),
                                             "total_tokens": int(row.get(f"{quota.period}_total") or 0),
                                             "requests_per_minute": row.get("requests_per_minute") or 0,
                                             "spend_limit": row.get(f"{quota.period}_{quota.spend_currency}")
                                             or Decimal(0)})
    return use


def budget_terms(tenant) -> tuple[str, str]:
    """The period and currency a tenant's budgets (its own and its keys') count in: its quota's,
    else a month in USD."""
    quota = getattr(tenant, "quota", None)
    return (quota.period, quota.spend_currency) if quota is not None else ("month", "USD")


def keys_spend(keys, *, now: dt.datetime | None = None) -> dict[int, Decimal]:
    """What each of `keys` (with its tenant and the tenant's quota read) has spent this budget
    period (budget_terms), by key id, in one query."""
    now = now or timezone.now()
    terms = {key.pk: budget_terms(key.tenant) for key in keys}
    sums = {f"{period}_{currency}": Sum("cost", filter=billed() & Q(created_at__gte=period_start(period, now),
                                                                     rate__plan__currency=currency))
            for period, currency in set(terms.values())}
    if not sums:
        return {}
    since = min(period_start(period, now) for period, _ in terms.values())
    read = {row["api_key_id"]: row for row in UsageEvent.objects.filter(api_key_id__in=terms, created_at__gte=since)
            .values("api_key_id").order_by().annotate(**sums)}
    return {key_id: read.get(key_id, {}).get(f"{period}_{currency}") or Decimal(0)
            for key_id, (period, currency) in terms.items()}


@dataclass(frozen=True)
class KeyBudget:
    """What a key has spent this budget period (budget_terms) against a budget of its own."""

    spent: Decimal
    limit: Decimal | None  # None: no budget of its own
    currency: str

    @property
    def left(self) -> Decimal | None:
        return _left(self.limit, self.spent)

    @property
    def pct(self) -> Decimal | None:
        """The share of its budget spent, a percent to two places."""
        return _pct(self.spent, self.limit) if self.limit else None


def keys_budget(keys, *, now: dt.datetime | None = None) -> dict[int, KeyBudget]:
    """Each of `keys`' (each with its tenant and the tenant's quota read) budget, by key id, in
    one query: what the key pages show and the home page's keys near a budget read."""
    spend = keys_spend(keys, now=now)
    return {key.pk: KeyBudget(spent=spend.get(key.pk, Decimal(0)), limit=key.spend_limit,
                              currency=budget_terms(key.tenant)[1]) for key in keys}


def _left(limit, used):
    """What is left of a limit: never below nothing, and nothing to say without a limit."""
    return max(0, limit - used) if limit and used is not None else None


def _pct(used, limit) -> Decimal:
    return Decimal(100 * used / limit).quantize(Decimal("0.01"))


def quota_shares(tenants, *, now: dt.datetime | None = None) -> dict[int, list[dict]]:
    """The limits of each of `tenants` that are set and counted, as quotas_use reads them,
    each with `pct`, the share used (a Decimal percent, two places), most used first; by
    tenant id. What a quota alert and the home page's tenants near a quota both read."""
    shares = {}
    for tenant_id, rows in quotas_use(tenants, now=now).items():
        rows = [dict(row, pct=_pct(row["used"], row["limit"]))
                for row in rows if row["limit"] and row["used"] is not None]
        shares[tenant_id] = sorted(rows, key=lambda row: -row["pct"])
    return shares


def _quota_rows(quota, used: dict) -> list[dict]:
    rows = []
    for name in quota.LIMITS:
        limit = getattr(quota, name)
        value = used.get(name)
        money = name == "spend_limit"
        rows.append({"name": name, "label": "Budget" if money else name.replace("_", " ").capitalize(),
                     "limit": limit, "used": value, "money": money,
                     "currency": quota.spend_currency if money else "", "hard": quota.spend_hard if money else True,
                     "share": round(100 * value / limit) if limit and value is not None else None,
                     "left": _left(limit, value)})
    return rows
