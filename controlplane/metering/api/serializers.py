from rest_framework import serializers

from controlplane.metering.models import TOTALS, DailyUsage, HourlyUsage, UsageEvent, UsageImage

NO_TIER = "The model's name; null for requests refused before their model was known"


class UsageImageSerializer(serializers.ModelSerializer):
    class Meta:
        model = UsageImage
        fields = ["position", "source_format", "source_width", "source_height", "width", "height",
                  "tokens", "fingerprint", "cached", "cached_tokens"]


class UsageEventSerializer(serializers.ModelSerializer):
    tenant = serializers.CharField(source="tenant.name")
    key_prefix = serializers.CharField(source="api_key.prefix", default=None)
    tier = serializers.CharField(source="tier.name", default=None, help_text=NO_TIER)
    currency = serializers.CharField(source="tier.price_plan.currency", default=None,
                                     help_text="What cost and cache_savings are in: the tier's plan's currency")
    images = UsageImageSerializer(many=True)

    class Meta:
        model = UsageEvent
        fields = ["request_id", "created_at", "tenant", "key_prefix", "tier", "status", "http_status", "stream",
                  "latency_ms", "image_count", "image_tokens", "cached_tokens", "cached_image_tokens",
                  "text_tokens", "output_tokens", "cost", "cache_savings", "currency", "routed_by", "cascade_of", "escalation",
                  "confidence", "images"]


class DailyUsageSerializer(serializers.ModelSerializer):
    tenant = serializers.CharField(source="tenant.name")
    tier = serializers.CharField(source="tier.name", default=None, help_text=NO_TIER)
    key_prefix = serializers.CharField(source="api_key.prefix", default=None)

    class Meta:
        model = DailyUsage
        fields = ["day", "tenant", "tier", "key_prefix", *TOTALS]


class HourlyUsageSerializer(serializers.ModelSerializer):
    tenant = serializers.CharField(source="tenant.name")
    tier = serializers.CharField(source="tier.name", default=None, help_text=NO_TIER)
    key_prefix = serializers.CharField(source="api_key.prefix", default=None)

    class Meta:
        model = HourlyUsage
        fields = ["hour", "tenant", "tier", "key_prefix", *TOTALS]


class TierUsageSerializer(serializers.Serializer):
    """Totals of one tier over the range asked for (rows of sums named sum_<total>)."""

    tier = serializers.CharField(source="tier__name", allow_null=True, help_text=NO_TIER)
    requests = serializers.IntegerField(source="sum_requests")
    unbilled_requests = serializers.IntegerField(
        source="sum_unbilled_requests",
        help_text="Of the requests, those refused or failed before an engine worked on them (not billed)")
    images = serializers.IntegerField(source="sum_images")
    image_tokens = serializers.IntegerField(source="sum_image_tokens")
    cached_tokens = serializers.IntegerField(source="sum_cached_tokens")
    cached_image_tokens = serializers.IntegerField(source="sum_cached_image_tokens")
    text_tokens = serializers.IntegerField(source="sum_text_tokens")
    output_tokens = serializers.IntegerField(source="sum_output_tokens")
    cost = serializers.DecimalField(max_digits=20, decimal_places=6, source="sum_cost")
    cache_savings = serializers.DecimalField(max_digits=20, decimal_places=6, source="sum_cache_savings")
