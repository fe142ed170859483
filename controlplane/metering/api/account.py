"""A tenant's account through its API key: quota status, cost to date, price estimates."""

from __future__ import annotations

from decimal import Decimal

from django.db.models import Count, Sum
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import APIException, NotFound, PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.catalog.models import ModelTier
from controlplane.catalog.services import tier_image_tokens
from controlplane.imaging.errors import ImageError
from controlplane.imaging.policy import normalise_tiles, sent_sizes
from controlplane.metering.models import UsageEvent
from controlplane.metering.periods import month_of, period_start, seconds_to_period_end
from controlplane.metering.ratebook import NoRate, RateBook
from controlplane.metering.rating import Usage, money_text, price
from controlplane.metering.services import metered_so_far
from controlplane.tenants.api_auth import TenantPrincipal
from controlplane.tenants.services import usable_tier_ids


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


class CostSerializer(serializers.Serializer):
    currency = serializers.CharField()
    since = serializers.DateTimeField()
    requests = serializers.IntegerField()
    images = serializers.IntegerField()
    image_tokens = serializers.IntegerField()
    cost = serializers.DecimalField(max_digits=16, decimal_places=6)
    by_tier = serializers.ListField(child=serializers.DictField())


class CostToDate(APIView):
    """What this tenant has spent since the start of the month (UTC), in total and per tier."""

    @extend_schema(responses=CostSerializer)
    def get(self, request):
        tenant = _tenant(request)
        since = period_start("month", timezone.now())
        events = UsageEvent.objects.filter(tenant=tenant, created_at__gte=since)
        by_tier = list(events.values("tier__name", "tier__price_plan__currency").annotate(
            requests=Count("id"), images=Sum("image_count"), image_tokens=Sum("image_tokens"), cost=Sum("cost"))
            .order_by("tier__name"))
        currencies = {row["tier__price_plan__currency"] for row in by_tier}
        return Response(CostSerializer({
            "currency": currencies.pop() if len(currencies) == 1 else ("" if currencies else "USD"), "since": since,
            "requests": sum(row["requests"] for row in by_tier),
            "images": sum(row["images"] or 0 for row in by_tier),
            "image_tokens": sum(row["image_tokens"] or 0 for row in by_tier),
            "cost": sum((row["cost"] or Decimal(0) for row in by_tier), Decimal(0)),
            "by_tier": [{"tier": row["tier__name"], "requests": row["requests"], "images": row["images"] or 0,
                         "image_tokens": row["image_tokens"] or 0, "currency": row["tier__price_plan__currency"],
                         # six places, as every amount here (SQLite sums in floats)
                         "cost": money_text(row["cost"] or Decimal(0))}
                        for row in by_tier],
        }).data)


class EstimateRequest(serializers.Serializer):
    tier = serializers.CharField()
    width = serializers.IntegerField(min_value=1, max_value=100_000, required=False)
    height = serializers.IntegerField(min_value=1, max_value=100_000, required=False)
    image = serializers.FileField(required=False)
    detail = serializers.ChoiceField(choices=["low", "high"], required=False,
                                     help_text="As in an image part: the policy's low or high cap")
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
    """Tokens and cost of an image (or its dimensions) on a tier, priced as the gateway would."""

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
                    tiles = normalise_tiles(data["image"].read(), policy, detail=detail)
                except ImageError as exc:
                    raise ValidationError({"image": str(exc)}) from None
                sizes = [(t.width, t.height) for t in tiles]
            else:
                try:
                    sizes = sent_sizes(data["width"], data["height"], policy, detail)
                except ImageError as exc:
                    raise ValidationError({"width": str(exc)}) from None
        elif "image" in data or "width" in data:
            raise ValidationError({"tier": f"{tier.name} does not accept images"})
        tokens = sum(tier_image_tokens(tier, w, h) for w, h in sizes)
        try:
            rates = RateBook().rates_at(tier.price_plan_id, timezone.now())
        except NoRate:
            raise NotPriced(tier.name) from None
        cost = price(Usage(text_tokens=data["text_tokens"], image_tokens=tokens, output_tokens=data["output_tokens"],
                           images=len(sizes)), rates)
        return Response(EstimateSerializer({"tier": tier.name, "sent_sizes": sizes, "image_tokens": tokens,
                                            "cost": cost, "currency": tier.price_plan.currency}).data)


class StatementLine(serializers.Serializer):
    tier = serializers.CharField()
    requests = serializers.IntegerField()
    images = serializers.IntegerField()
    image_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    text_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    cost = serializers.DecimalField(max_digits=16, decimal_places=6)


class StatementSerializer(serializers.Serializer):
    tenant = serializers.CharField()
    period = serializers.CharField()
    currency = serializers.CharField()
    lines = StatementLine(many=True)
    total = serializers.DecimalField(max_digits=16, decimal_places=6)
    unrated_requests = serializers.IntegerField()


class Statement(APIView):
    """This tenant's statement for a month (YYYY-MM): a line per tier; the total is their sum."""

    @extend_schema(responses=StatementSerializer, parameters=[
        OpenApiParameter("period", str, OpenApiParameter.PATH, description="The month, YYYY-MM (UTC).")])
    def get(self, request, period: str):
        from controlplane.metering.statements import statement

        tenant = _tenant(request)
        try:
            year, month = month_of(period)
        except ValueError as exc:
            raise ValidationError({"period": str(exc)}) from None
        return Response(StatementSerializer(statement(tenant=tenant, year=year, month=month)).data)
