from django.db import models
from django.utils import timezone


class BenchmarkProfile(models.Model):
    name = models.SlugField(max_length=64, unique=True)
    tier = models.ForeignKey("catalog.ModelTier", on_delete=models.CASCADE, related_name="benchmarks")
    requests = models.PositiveIntegerField(default=20)
    concurrency = models.PositiveSmallIntegerField(default=4)
    image_share = models.FloatField(default=0.5, help_text="Share of requests that carry an image")
    image_width = models.PositiveIntegerField(default=1024)
    image_height = models.PositiveIntegerField(default=768)
    max_tokens = models.PositiveIntegerField(default=32)

    def __str__(self):
        return self.name


class BenchmarkRun(models.Model):
    class State(models.TextChoices):
        QUEUED = "queued", "queued"
        RUNNING = "running", "running"
        SUCCEEDED = "succeeded", "succeeded"
        FAILED = "failed", "failed"
        CANCELLED = "cancelled", "cancelled"

    profile = models.ForeignKey(BenchmarkProfile, on_delete=models.CASCADE, related_name="runs")
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    progress = models.FloatField(default=0.0)
    log = models.TextField(blank=True)
    results = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"{self.profile} run {self.pk}"
