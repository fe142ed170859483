import secrets

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone

from controlplane import outbound
from controlplane.catalog.models import ModelTier, ResolutionPolicy


def engine_api_key() -> str:
    return secrets.token_urlsafe(32)


class Node(models.Model):
    """A host that runs engines. Its Celery worker consumes the queue `node.<name>`."""

    name = models.CharField(max_length=128, unique=True)
    address = models.CharField(max_length=255, default="127.0.0.1", help_text="Where engines are reached")
    queue = models.CharField(max_length=160, unique=True)
    vllm_version = models.CharField(max_length=64, blank=True, help_text="'+cpu' for vLLM's CPU build")
    transformers_version = models.CharField(max_length=64, blank=True)
    registered_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    @staticmethod
    def queue_for(name: str) -> str:
        return f"node.{name}"


class Gpu(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    model = models.CharField(max_length=128, blank=True)
    memory_mib = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["node", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_index_per_node")]

    def __str__(self):
        return f"{self.node}:{self.index}"


class EngineInstance(models.Model):
    """One engine process serving a tier. The row is the truth; agents move it between states."""

    class Desired(models.TextChoices):
        RUNNING = "running", "running"
        STOPPED = "stopped", "stopped"

    class Actual(models.TextChoices):
        PENDING = "pending", "pending"  # not placed or not started yet
        STARTING = "starting", "starting"
        RUNNING = "running", "running"
        UNHEALTHY = "unhealthy", "unhealthy"
        DRAINING = "draining", "draining"
        STOPPED = "stopped", "stopped"
        CRASHED = "crashed", "crashed"
        CRASH_LOOP = "crashloop", "crash loop"  # crashed again and again; still retried, with backoff
        FAILED = "failed", "failed"  # cannot be launched as configured

    tier = models.ForeignKey("catalog.ModelTier", on_delete=models.CASCADE, related_name="instances")
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="instances"
    )
    gpus = models.ManyToManyField(Gpu, blank=True, related_name="instances")
    pool = models.CharField(
        max_length=16, default="standard",
        choices=[("standard", "standard"), ("large", "large images"), ("candidate", "candidate, not served")]
    )
    # A candidate runs the tier as a proposed change would make it, to be measured before the
    # change goes live: these fields of the tier, instead of the tier's (quality gates). The
    # gateway never routes to it.
    overrides = models.JSONField(default=dict, blank=True)
    desired_state = models.CharField(max_length=16, choices=Desired.choices, default=Desired.RUNNING)
    actual_state = models.CharField(max_length=16, choices=Actual.choices, default=Actual.PENDING)
    port = models.PositiveIntegerField(null=True, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    last_health_at = models.DateTimeField(null=True, blank=True)
    healthy = models.BooleanField(default=False)
    restart_count = models.PositiveIntegerField(default=0)
    next_start_at = models.DateTimeField(null=True, blank=True)
    state_reason = models.CharField(max_length=255, blank=True)
    log_path = models.CharField(max_length=512, blank=True)
    command = models.JSONField(default=list, blank=True)
    # Engines listen on the network on multi-host setups: only the gateway may call them.
    api_key = models.CharField(max_length=64, default=engine_api_key, editable=False)
    # Engine kind "external": an endpoint started elsewhere, watched and routed to, never launched.
    external_url = models.URLField(blank=True, help_text="For external engines: e.g. http://vllm-7b.svc:8000")
    served_model_name = models.CharField(
        max_length=200, blank=True,
        help_text="The model name an external engine answers to (its --served-model-name); empty: the tier's name")
    drain = models.BooleanField(default=False, help_text="Stop gracefully: no new work, wait for in-flight")
    drain_started_at = models.DateTimeField(null=True, blank=True)
    # Liveness beyond /health: counters must move when there is work, and a tiny completion
    # must come back. A hung engine can still answer /health.
    last_progress = models.FloatField(default=0.0)
    last_progress_at = models.DateTimeField(null=True, blank=True)
    last_probe_at = models.DateTimeField(null=True, blank=True)
    probe_failures = models.PositiveSmallIntegerField(default=0)
    # Latest scrape of the engine's /metrics (full samples live in EngineMetricSample).
    num_running = models.FloatField(default=0.0)
    num_waiting = models.FloatField(default=0.0)
    kv_cache_usage = models.FloatField(default=0.0)
    kv_capacity_tokens = models.PositiveIntegerField(
        null=True, blank=True, help_text="The KV cache's size in tokens, as the engine reports it")
    metrics_at = models.DateTimeField(null=True, blank=True)
    log_tail = models.TextField(blank=True)

    class Meta:
        ordering = ["tier", "id"]

    def __str__(self):
        return f"{self.tier}#{self.pk}"

    def serving_tier(self):
        """The tier as this engine runs it: the tier itself, or for a candidate the tier with
        the proposed fields (unsaved)."""
        if not self.overrides:
            return self.tier
        tier = ModelTier.objects.select_related("resolution_policy", "price_plan").get(pk=self.tier_id)
        for name, value in self.overrides.items():
            setattr(tier, name, value)
        if "resolution_policy_id" in self.overrides:
            tier.resolution_policy = ResolutionPolicy.objects.filter(pk=self.overrides["resolution_policy_id"]).first()
        return tier

    def external_url_refusal(self) -> str | None:
        """Why this external engine's URL may not be called, or None: an operator set it, so
        it is vetted as every such URL is (controlplane/outbound.py)."""
        return outbound.url_refusal(self.external_url, trusted_networks=settings.OPERATOR_URL_TRUSTED_NETWORKS,
                                    what="engine URL")

    def external_client(self, **kwargs):
        """An httpx client for this external engine: each request vetted, sent to the vetted
        address, no redirect followed."""
        return outbound.client(trusted_networks=settings.OPERATOR_URL_TRUSTED_NETWORKS, what="engine URL", **kwargs)

    def clean(self):
        refused = self.external_url and self.external_url_refusal()
        if refused:
            raise ValidationError({"external_url": refused})

    @property
    def model_name(self) -> str:
        """The name this engine serves its model under: what the gateway sends as `model`."""
        return self.served_model_name or self.tier.name

    @property
    def base_url(self) -> str | None:
        if self.external_url:
            return self.external_url.rstrip("/")
        if self.node is None or self.port is None:
            return None
        return f"http://{self.node.address}:{self.port}"


class EngineEvent(models.Model):
    instance = models.ForeignKey(EngineInstance, on_delete=models.CASCADE, related_name="events")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    from_state = models.CharField(max_length=16)
    to_state = models.CharField(max_length=16)
    reason = models.CharField(max_length=512)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.instance}: {self.from_state} -> {self.to_state} ({self.reason})"


class EngineMetricSample(models.Model):
    """One scrape of an engine's /metrics. Kept for FLEET_METRICS_RETENTION_HOURS."""

    instance = models.ForeignKey(EngineInstance, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(default=timezone.now, db_index=True)
    running = models.FloatField(default=0.0)
    waiting = models.FloatField(default=0.0)
    kv_cache_usage = models.FloatField(default=0.0)
    prompt_tokens = models.FloatField(default=0.0)
    generation_tokens = models.FloatField(default=0.0)
    prefix_cache_queries = models.FloatField(default=0.0)
    prefix_cache_hits = models.FloatField(default=0.0)
    mm_cache_queries = models.FloatField(default=0.0)
    mm_cache_hits = models.FloatField(default=0.0)
    preemptions = models.FloatField(default=0.0)
    ttft = models.JSONField(null=True, blank=True)
    e2e = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["instance", "at"])]

    def __str__(self):
        return f"{self.instance} @ {self.at:%H:%M:%S}"


class Lease(models.Model):
    """A role only one process may hold at a time (the beat that sends scheduled tasks): held by
    `holder` until `expires_at`, by the database's clock, unless renewed (controlplane/beat.py)."""

    name = models.CharField(max_length=40, unique=True)
    holder = models.CharField(max_length=200)
    expires_at = models.DateTimeField()

    def __str__(self):
        return f"{self.name}: {self.holder} until {self.expires_at}"
