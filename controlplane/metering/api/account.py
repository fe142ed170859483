"""A tenant's account through its API key: quota status, cost to date, price estimates."""

from __future__ import annotations

import logging
from decimal import Decimal

import xxhash
from django.conf import settings
from django.core.cache import cache
from django.db.models import Count, Sum
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import APIException, NotFound, PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from controlplane.catalog.models import ModelTier
from controlplane.catalog.services import tier_image_tokens
from controlplane.imaging.errors import ImageError
from controlplane.imaging.policy import picture_sent_sizes, sent_sizes
from controlplane.metering.models import UsageEvent
from controlplane.metering.periods import month_of, period_start, seconds_to_period_end
from controlplane.metering.ratebook import NoRate, RateBook
from controlplane.metering.rating import price_parts
from controlplane.metering.services import billed, metered_so_far
from controlplane.metering.statements import statement
from controlplane.tenants.api_auth import TenantPrincipal
from controlplane.tenants.models import usable_tier_ids


class NotPriced(APIException):
    """The tier has no price in effect yet: nothing can be estimated (nor served) for it."""

    status_code, default_code = 503, "model_not_priced"
    wait = 60  # DRF sends it as Retry-After

    def __init__(self, tier: str):
        super().__init__(f"the model '{tier}' has no price in effect yet; retry later")


def _tenant(request):
    if not isinstance(request.user, TenantPrincipal):
        raise PermissionDenied("use a tenant API key (Authorization: Bearer <key>)")
    return request.user.tenant


class QuotaSerializer(serializers.Serializer):
    period = serializers.CharField()
    period_started = serializers.DateTimeField()
    resets_in_seconds = serializers.IntegerField()
    limits = serializers.DictField(child=serializers.IntegerField(allow_null=True))
    used = serializers.DictField(child=serializers.IntegerField())
    remaining = serializers.DictField(child=serializers.IntegerField(allow_null=True))


class QuotaStatus(APIView):
    """This tenant's quota for the current period: limits, what is used, what remains."""

    @extend_schema(responses=QuotaSerializer)
    def get(self, request):
        tenant = _tenant(request)
        quota = getattr(tenant, "quota", None)
        period = quota.period if quota else "month"
        now = timezone.now()
        since = period_start(period, now)
        image_used, total_used = metered_so_far(tenant.pk, period, now)  # as admission counts it
        used = {"image_tokens": image_used, "total_tokens": total_used}
        limits = {"image_tokens": quota.image_tokens if quota else None,
                  "total_tokens": quota.total_tokens if quota else None,
                  "requests_per_minute": quota.requests_per_minute if quota else None,
                  "concurrent_large_images": quota.concurrent_large_images if quota else None}
        remaining = {name: None if limits[name] is None else max(0, limits[name] - used[name]) for name in used}
        return Response(QuotaSerializer({
            "period": period, "period_started": since, "resets_in_seconds": seconds_to_period_end(period, now),
            "limits": limits, "used": used, "remaining": remaining}).data)


class CostLine(serializers.Serializer):
    tier = serializers.CharField()
    currency = serializers.CharField()
    requests = serializers.IntegerField()
    images = serializers.IntegerField()
    image_tokens = serializers.IntegerField()
    cost = serializers.DecimalField(max_digits=16, decimal_places=6)


class CostTotal(serializers.Serializer):
    currency = serializers.CharField()
    cost = serializers.DecimalField(max_digits=16, decimal_places=6)


class CostSerializer(serializers.Serializer):
    currency = serializers.CharField(allow_null=True, help_text="The one currency of every tier used; null "
                                                                "when they bill in several (see totals)")
    since = serializers.DateTimeField()
    requests = serializers.IntegerField()
    images = serializers.IntegerField()
    image_tokens = serializers.IntegerField()
    cost = serializers.DecimalField(max_digits=16, decimal_places=6, allow_null=True,
                                    help_text="The total when every tier used bills in one currency")
    totals = CostTotal(many=True, help_text="A total per currency: amounts in two are never added")
    by_tier = CostLine(many=True)


class CostToDate(APIView):
    """What this tenant has spent since the start of the month (UTC), in total and per tier:
    billed requests only, as the month's statement will count them."""

    @extend_schema(responses=CostSerializer)
    def get(self, request):
        tenant = _tenant(request)
        since = period_start("month", timezone.now())
        events = UsageEvent.objects.filter(billed(), tenant=tenant, created_at__gte=since)
        by_tier = [{"tier": row["tier__name"], "currency": row["tier__price_plan__currency"],
                    "requests": row["requests"], "images": row["images"] or 0,
                    "image_tokens": row["image_tokens"] or 0, "cost": Decimal(row["cost"] or 0)}
                   for row in events.values("tier__name", "tier__price_plan__currency").annotate(
                       requests=Count("id"), images=Sum("image_count"), image_tokens=Sum("image_tokens"),
                       cost=Sum("cost")).order_by("tier__name")]
        totals = {}
        for row in by_tier:
            totals[row["currency"]] = totals.get(row["currency"], Decimal(0)) + row["cost"]
        one = next(iter(totals.items())) if len(totals) == 1 else None
        return Response(CostSerializer({
            "currency": one[0] if one else None, "since": since,
            "requests": sum(row["requests"] for row in by_tier),
            "images": sum(row["images"] for row in by_tier),
            "image_tokens": sum(row["image_tokens"] for row in by_tier),
            "cost": one[1] if one else (Decimal(0) if not totals else None),
            "totals": [{"currency": currency, "cost": totals[currency]} for currency in sorted(totals)],
            "by_tier": by_tier,
        }).data)


log = logging.getLogger(__name__)


class PerKeyThrottle(SimpleRateThrottle):
    """At most API_ESTIMATES_PER_MINUTE estimates a minute per API key, counted in the cache that
    every replica shares. A cache that does not answer throttles nothing."""

    scope = "estimate"

    def get_rate(self) -> str:
        return f"{settings.API_ESTIMATES_PER_MINUTE}/min"

    def get_cache_key(self, request, view) -> str:
        # The key's random prefix, not its id: ids are used again where a database starts afresh.
        ident = f"key-{request.auth.prefix}" if getattr(request.auth, "prefix", None) else self.get_ident(request)
        return self.cache_format % {"scope": self.scope, "ident": ident}

    def allow_request(self, request, view) -> bool:
        try:
            return super().allow_request(request, view)
        except Exception as exc:  # noqa: BLE001 - logged; an estimate costs no more than its header
            log.warning("could not count estimates: %s", exc)
            return True


def _picture_sizes(tier: ModelTier, data: bytes, detail: str | None) -> list[tuple[int, int]]:
    """What the gateway would send of the picture on `tier`, from its header, kept in the cache
    per picture, policy and detail (the same picture estimated again is not read again)."""
    policy = tier.image_policy()
    key = "estimate:" + xxhash.xxh3_128_hexdigest(repr((policy, detail)).encode() + data)
    try:
        kept = cache.get(key)
    except Exception:  # noqa: BLE001 - no cache: read it again
        kept = None
    if kept is not None:
        return [tuple(size) for size in kept]
    sizes = picture_sent_sizes(data, policy, detail, max_scans=settings.GATEWAY_IMAGE_MAX_SCANS)
    try:
        cache.set(key, sizes, 3600)
    except Exception:  # noqa: BLE001
        pass
    return sizes


class EstimateRequest(serializers.Serializer):
    tier = serializers.CharField()
    width = serializers.IntegerField(min_value=1, max_value=100_000, required=False)
    height = serializers.IntegerField(min_value=1, max_value=100_000, required=False)
    image = serializers.FileField(required=False)
    detail = serializers.ChoiceField(choices=["low", "high", "auto"], required=False,
                                     help_text="As in an image part: the policy's low or high cap, or its "
                                               "default (auto, or none given)")
    # Far past any model's context: an estimate of more than this is no estimate.
    text_tokens = serializers.IntegerField(min_value=0, max_value=100_000_000, default=0)
    output_tokens = serializers.IntegerField(min_value=0, max_value=100_000_000, default=0)

    def validate(self, data):
        if "image" not in data and not ("width" in data and "height" in data):
            raise ValidationError("give an image, or its width and height")
        return data


class EstimateSerializer(serializers.Serializer):
    tier = serializers.CharField()
    sent_sizes = serializers.ListField(child=serializers.ListField(child=serializers.IntegerField()))
    image_tokens = serializers.IntegerField()
    cost = serializers.DecimalField(max_digits=16, decimal_places=6)
    currency = serializers.CharField()


class Estimate(APIView):
    """Tokens and cost of an image (or its dimensions) on a tier, priced as the gateway would.
    The image is read as far as its header: its size is what its tokens are counted on."""

    throttle_classes = [PerKeyThrottle]

    @extend_schema(request=EstimateRequest, responses=EstimateSerializer)
    def post(self, request):
        _tenant(request)  # a tenant key, or a 403
        ask = EstimateRequest(data=request.data)
        ask.is_valid(raise_exception=True)
        data = ask.validated_data
        tier = ModelTier.objects.filter(name=data["tier"], enabled=True).select_related(
            "resolution_policy", "price_plan").first()
        allowed = usable_tier_ids(request.auth)
        if tier is None or (allowed is not None and tier.pk not in allowed):
            raise NotFound(f"no model named {data['tier']!r} is available to this key")
        sizes = []
        if tier.kind == ModelTier.Kind.VISION:
            policy, detail = tier.image_policy(), data.get("detail")
            if "image" in data:
                try:
                    sizes = _picture_sizes(tier, data["image"].read(), detail)
                except ImageError as exc:
                    raise ValidationError({"image": str(exc)}) from None
            else:
                try:
                    sizes = sent_sizes(data["width"], data["height"], policy, detail)
                except ImageError as exc:
                    raise ValidationError({"width": str(exc)}) from None
        elif "image" in data or "width" in data:
            raise ValidationError({"tier": f"{tier.name} does not accept images"})
        each = [tier_image_tokens(tier, w, h) for w, h in sizes]
        try:
            rates = RateBook().rates_at(tier.price_plan_id, timezone.now())
        except NoRate:
            raise NotPriced(tier.name) from None
        # Priced part by part, as the bill will price the request (each image rounded alone).
        cost = price_parts(images=[(tokens, 0) for tokens in each], text_tokens=data["text_tokens"],
                           output_tokens=data["output_tokens"], rates=rates).total
        tokens = sum(each)
        return Response(EstimateSerializer({"tier": tier.name, "sent_sizes": sizes, "image_tokens": tokens,
                                            "cost": cost, "currency": tier.price_plan.currency}).data)


class StatementLine(serializers.Serializer):
    tier = serializers.CharField()
    currency = serializers.CharField()
    requests = serializers.IntegerField()
    images = serializers.IntegerField()
    image_tokens = serializers.IntegerField()
    cached_image_tokens = serializers.IntegerField(help_text="Image tokens served from the engine's prefix cache")
    text_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    cost = serializers.DecimalField(max_digits=16, decimal_places=6)
    cache_savings = serializers.DecimalField(max_digits=16, decimal_places=6,
                                             help_text="What the cached-image discount took off the cost")


class StatementTotal(serializers.Serializer):
    currency = serializers.CharField()
    total = serializers.DecimalField(max_digits=16, decimal_places=6)
    cache_savings = serializers.DecimalField(max_digits=16, decimal_places=6)


class StatementSerializer(serializers.Serializer):
    tenant = serializers.CharField()
    period = serializers.CharField()
    currency = serializers.CharField(allow_null=True, help_text="The currency of every line; null when the "
                                                                "lines are in several (see totals) or there are none")
    lines = StatementLine(many=True, help_text="Billed requests, a line per tier")
    totals = StatementTotal(many=True, help_text="A total per currency: amounts in two are never added")
    total = serializers.DecimalField(max_digits=16, decimal_places=6, allow_null=True,
                                     help_text="The total when the lines are in one currency")
    cache_savings = serializers.DecimalField(max_digits=16, decimal_places=6, allow_null=True)
    unbilled_requests = serializers.IntegerField(help_text="Requests refused or failed before an engine "
                                                           "worked on them: not billed, not in the lines")
    unrated_requests = serializers.IntegerField()


class Statement(APIView):
    """This tenant's statement for a month (YYYY-MM): a line per tier; the total is their sum."""

    @extend_schema(responses=StatementSerializer, parameters=[
        OpenApiParameter("period", str, OpenApiParameter.PATH, description="The month, YYYY-MM (UTC).")])
    def get(self, request, period: str):
        tenant = _tenant(request)
        try:
            year, month = month_of(period)
        except ValueError as exc:
            raise ValidationError({"period": str(exc)}) from None
        return Response(StatementSerializer(statement(tenant=tenant, year=year, month=month)).data)
