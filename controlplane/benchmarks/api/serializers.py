from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import models
from rest_framework import serializers

from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun, EvalItem, EvalSet


class ProfileSerializer(serializers.ModelSerializer):
    schedule_task = serializers.SerializerMethodField(help_text="The beat entry that runs the profile, if any")
    sweep = serializers.ListField(child=serializers.FloatField(min_value=0), min_length=1, max_length=20,
                                  help_text="Concurrencies (closed loop) or requests per second (open loop)")
    pixel_caps = serializers.ListField(
        child=serializers.IntegerField(min_value=3136), required=False, max_length=12,
        help_text="Resolution sweep: pixel caps the images are scaled down to")
    image_buckets = serializers.ListField(
        child=serializers.DictField(), required=False,
        help_text='Weighted sizes: [{"width": 640, "height": 480, "weight": 3}]')

    class Meta:
        model = BenchmarkProfile
        fields = ["id", "name", "description", "kind", "tier", "target", "gateway_url", "instance", "text_share",
                  "images_per_request_min", "images_per_request_max", "image_source", "image_buckets",
                  "prompt_tokens_min", "prompt_tokens_max", "output_tokens_min", "output_tokens_max",
                  "arrival", "sweep", "stage_duration_s", "seed", "eval_set", "pixel_caps", "ttft_slo_ms",
                  "tpot_slo_ms", "schedule_enabled", "schedule_cron", "schedule_task", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]

    def get_schedule_task(self, profile) -> str | None:
        return profile.periodic_task.name if profile.periodic_task_id else None

    def validate(self, attrs):
        # The model's own checks (sweep, buckets, cron, instance of the tier), on the whole row.
        profile = self.instance or BenchmarkProfile()
        for name, value in attrs.items():
            setattr(profile, name, value)
        if isinstance(profile.sweep, list):
            profile.sweep = [int(v) if float(v).is_integer() else v for v in profile.sweep]
            attrs["sweep"] = profile.sweep
        try:
            profile.full_clean(validate_unique=False)
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from None
        return attrs


class RunSerializer(serializers.ModelSerializer):
    profile_name = serializers.CharField(source="profile.name", read_only=True)

    class Meta:
        model = BenchmarkRun
        fields = ["id", "profile", "profile_name", "label", "trigger", "state", "progress", "created_at",
                  "started_at", "finished_at", "cancel_requested"]
        read_only_fields = fields


class RunDetailSerializer(RunSerializer):
    class Meta(RunSerializer.Meta):
        fields = [*RunSerializer.Meta.fields, "log", "config", "results"]
        read_only_fields = fields


class RunStartSerializer(serializers.Serializer):
    label = serializers.CharField(max_length=128, required=False, allow_blank=True, default="")


class EvalSetSerializer(serializers.ModelSerializer):
    items = serializers.IntegerField(source="item_count", read_only=True)
    task_types = serializers.SerializerMethodField(help_text="Items per task type")

    class Meta:
        model = EvalSet
        fields = ["id", "name", "description", "source", "generator", "seed", "file_name", "items", "task_types",
                  "created_at"]
        read_only_fields = fields

    def get_task_types(self, eval_set) -> dict[str, int]:
        counts = self.context.get("task_counts")
        if counts is None:  # one query for every set listed (see EvalSetViewSet)
            counts = self.context["task_counts"] = task_counts()
        return dict(sorted(counts.get(eval_set.pk, {}).items()))


def task_counts() -> dict[int, dict[str, int]]:
    """Items per task type of every set."""
    counts: dict[int, dict[str, int]] = {}
    for set_id, task, n in EvalItem.objects.values_list("eval_set_id", "task_type").annotate(n=models.Count("id")):
        counts.setdefault(set_id, {})[task] = n
    return counts
