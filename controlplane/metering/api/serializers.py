from rest_framework import serializers

from controlplane.metering.models import DailyUsage, UsageEvent, UsageImage


class UsageImageSerializer(serializers.ModelSerializer):
    class Meta:
        model = UsageImage
        fields = ["position", "source_format", "source_width", "source_height", "width", "height",
                  "tokens", "fingerprint", "cached"]


class UsageEventSerializer(serializers.ModelSerializer):
    tier = serializers.CharField(source="tier.name")
    images = UsageImageSerializer(many=True)

    class Meta:
        model = UsageEvent
        fields = ["request_id", "created_at", "tier", "status", "http_status", "stream", "latency_ms",
                  "image_count", "image_tokens", "cached_tokens", "text_tokens", "output_tokens",
                  "cost", "images"]


class DailyUsageSerializer(serializers.ModelSerializer):
    tier = serializers.CharField(source="tier.name")
    key_prefix = serializers.CharField(source="api_key.prefix", default=None)

    class Meta:
        model = DailyUsage
        fields = ["day", "tier", "key_prefix", "requests", "images", "image_tokens", "cached_tokens", "text_tokens",
                  "output_tokens", "cost"]
