from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, URLValidator
from django.db import models
from django.utils import timezone

from controlplane import outbound
from controlplane.benchmarks.schedules import parse_cron

# A run is one Celery task with a one-hour limit: the load planned, plus the drain of each
# stage (at most 30 s, services.drain_seconds), must fit inside it.
MAX_PLANNED_S = 2400


def _default_buckets():
    return [{"width": 640, "height": 480, "weight": 3}, {"width": 1920, "height": 1080, "weight": 1}]


def _default_sweep():
    return [1, 4, 8]


def _default_caps():
    return [200704, 401408, 1003520]


class BenchmarkProfile(models.Model):
    """What to load, how hard, for how long, and what counts as good enough."""

    class Target(models.TextChoices):
        GATEWAY = "gateway", "the tier, through the gateway"
        INSTANCE = "instance", "one engine instance, directly"

    class Arrival(models.TextChoices):
        CLOSED = "closed", "closed loop: a concurrency sweep"
        OPEN = "open", "open loop: a Poisson request-rate sweep"

    class Kind(models.TextChoices):
        LOAD = "load", "load: latency and throughput under the traffic mix"
        RESOLUTION = "resolution", "resolution sweep: the same images at each pixel cap"

    class ImageSource(models.TextChoices):
        BUCKETS = "buckets", "synthetic images of the size buckets"
        UPLOADS = "uploads", "the uploaded images"

    name = models.SlugField(max_length=64, unique=True)
    description = models.TextField(blank=True)
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.LOAD)
    tier = models.ForeignKey("catalog.ModelTier", on_delete=models.CASCADE, related_name="benchmarks")
    target = models.CharField(max_length=16, choices=Target.choices, default=Target.GATEWAY)
    gateway_url = models.URLField(
        blank=True, default="",
        help_text="Where the gateway serves /v1 (a load balancer in front of replicas); empty: this control "
                  "plane's own gateway, at the address it is served on (GATEWAY_PUBLIC_URL)")
    instance = models.ForeignKey(
        "fleet.EngineInstance", null=True, blank=True, on_delete=models.SET_NULL, related_name="benchmarks",
        help_text="For an instance target; empty picks a healthy instance of the tier at run time")
    # The traffic mix.
    text_share = models.FloatField(
        default=0.5, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)],
        help_text="Share of requests without an image (0..1)")
    images_per_request_min = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])
    images_per_request_max = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])
    image_source = models.CharField(max_length=16, choices=ImageSource.choices, default=ImageSource.BUCKETS)
    image_buckets = models.JSONField(
        default=_default_buckets, blank=True,
        help_text='Weighted sizes, e.g. [{"width": 640, "height": 480, "weight": 3}]')
    prompt_tokens_min = models.PositiveIntegerField(default=32)
    prompt_tokens_max = models.PositiveIntegerField(default=128)
    output_tokens_min = models.PositiveIntegerField(default=32, validators=[MinValueValidator(1)])
    output_tokens_max = models.PositiveIntegerField(default=64, validators=[MinValueValidator(1)])
    # Arrival and duration.
    arrival = models.CharField(max_length=8, choices=Arrival.choices, default=Arrival.CLOSED)
    sweep = models.JSONField(
        default=_default_sweep,
        help_text="Load levels run in turn: concurrencies (closed loop) or requests per second (open loop)")
    stage_duration_s = models.FloatField(default=30.0, validators=[MinValueValidator(0.5)],
                                         help_text="Seconds of load at each level")
    seed = models.PositiveIntegerField(default=0, help_text="Same seed, same requests")
    # A resolution sweep: its evaluation items (or images) at each cap, sweep[0] at a time.
    eval_set = models.ForeignKey(
        "EvalSet", null=True, blank=True, on_delete=models.PROTECT, related_name="profiles",
        help_text="Resolution sweep: the labelled questions asked at each cap (else the images, unscored)")
    pixel_caps = models.JSONField(
        default=_default_caps, blank=True,
        help_text="Resolution sweep: pixel caps the images are scaled down to, e.g. [200704, 1003520]; "
                  "it sends the sweep's first value of requests at a time")
    # Service levels.
    ttft_slo_ms = models.PositiveIntegerField(default=2000, help_text="Time to first token, ms")
    tpot_slo_ms = models.PositiveIntegerField(default=100, help_text="Time per output token, ms")
    # A schedule: a django-celery-beat PeriodicTask kept in step with these two fields.
    schedule_enabled = models.BooleanField(default=False)
    schedule_cron = models.CharField(
        max_length=100, blank=True, help_text='minute hour day-of-month month day-of-week (UTC), e.g. "0 3 * * *"')
    periodic_task = models.OneToOneField(
        "django_celery_beat.PeriodicTask", null=True, blank=True, editable=False, on_delete=models.SET_NULL,
        related_name="benchmark_profile")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    @property
    def gateway_base(self) -> str:
        """The gateway a run sends to: the profile's own URL, else this server's."""
        return (self.gateway_url or settings.GATEWAY_PUBLIC_URL).rstrip("/")

    def _gateway_url_refusal(self) -> str | None:
        if not self.gateway_url:
            return None  # this server's own gateway
        try:
            URLValidator(schemes=["http", "https"])(self.gateway_url)
        except ValidationError:
            return None  # said by the field
        return outbound.url_refusal(self.gateway_url, trusted_networks=settings.OPERATOR_URL_TRUSTED_NETWORKS,
                                    what="benchmark target URL")

    def clean(self):
        errors = {}
        if self.images_per_request_min > self.images_per_request_max:
            errors["images_per_request_max"] = "must be at least the minimum"
        if self.prompt_tokens_min > self.prompt_tokens_max:
            errors["prompt_tokens_max"] = "must be at least the minimum"
        if self.output_tokens_min > self.output_tokens_max:
            errors["output_tokens_max"] = "must be at least the minimum"
        sweep = self.sweep
        if (not isinstance(sweep, list) or not sweep or len(sweep) > 20
                or not all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in sweep)):
            errors["sweep"] = "a list of 1 to 20 positive numbers"
        elif self.arrival == self.Arrival.CLOSED and not all(float(v).is_integer() and v <= 1024 for v in sweep):
            errors["sweep"] = "concurrencies are whole numbers up to 1024"
        elif len(sweep) * (self.stage_duration_s or 0) > MAX_PLANNED_S:
            errors["stage_duration_s"] = f"a run must plan at most {MAX_PLANNED_S} s of load in all"
        if self.text_share < 1 and self.image_source == self.ImageSource.BUCKETS:
            try:
                _check_buckets(self.image_buckets)
            except ValueError as exc:
                errors["image_buckets"] = str(exc)
        caps = self.pixel_caps
        if self.kind == self.Kind.RESOLUTION and (
                not isinstance(caps, list) or not caps or len(caps) > 12
                or not all(isinstance(c, int) and not isinstance(c, bool) and 3136 <= c <= 50_000_000
                           for c in caps)):
            errors["pixel_caps"] = "a list of 1 to 12 whole pixel counts between 3136 and 50,000,000"
        if self.schedule_enabled and not self.schedule_cron:
            errors["schedule_cron"] = "a schedule needs a cron expression"
        elif self.schedule_cron:
            try:
                parse_cron(self.schedule_cron)
            except ValueError as exc:
                errors["schedule_cron"] = str(exc)
        refused = self._gateway_url_refusal()
        if refused:
            errors["gateway_url"] = refused
        if self.target == self.Target.INSTANCE and self.instance_id and self.tier_id \
                and self.instance.tier_id != self.tier_id:
            errors["instance"] = "the instance must serve the profile's tier"
        if errors:
            raise ValidationError(errors)


def _check_buckets(value) -> None:
    if not isinstance(value, list) or not value:
        raise ValueError("image requests need at least one size bucket")
    for bucket in value:
        if not isinstance(bucket, dict) or set(bucket) - {"width", "height", "weight"}:
            raise ValueError('each bucket is {"width": W, "height": H, "weight": N}')
        width, height, weight = bucket.get("width"), bucket.get("height"), bucket.get("weight", 1)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (width, height)) \
                or not (16 <= width <= 8192 and 16 <= height <= 8192):
            raise ValueError("bucket width and height are whole pixels between 16 and 8192")
        if not isinstance(weight, int | float) or isinstance(weight, bool) or weight <= 0:
            raise ValueError("bucket weights are positive numbers")


class BenchmarkImage(models.Model):
    """An uploaded image a profile sends instead of synthetic ones."""

    profile = models.ForeignKey(BenchmarkProfile, on_delete=models.CASCADE, related_name="images")
    name = models.CharField(max_length=255)
    content_type = models.CharField(max_length=64)
    width = models.PositiveIntegerField()
    height = models.PositiveIntegerField()
    data = models.BinaryField()
    uploaded_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["profile", "id"]

    def __str__(self):
        return f"{self.name} ({self.width}x{self.height})"


class EvalSet(models.Model):
    """A named set of labelled questions about images: what a resolution sweep scores."""

    class Source(models.TextChoices):
        GENERATED = "generated", "generated (built-in)"
        IMPORTED = "imported", "imported from a file"
        PROFILE = "profile", "the items a profile held"

    name = models.CharField(max_length=128, unique=True)
    description = models.TextField(blank=True)
    source = models.CharField(max_length=16, choices=Source.choices)
    # A generated set: the generator's task and seed (the same pair makes the same set).
    generator = models.CharField(max_length=32, blank=True)
    seed = models.PositiveIntegerField(null=True, blank=True)
    # An imported set: the file it came from.
    file_name = models.CharField(max_length=255, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    @property
    def origin(self) -> str:
        if self.source == self.Source.GENERATED:
            return f"generated: {self.generator}, seed {self.seed}"
        if self.source == self.Source.IMPORTED:
            return f"imported from {self.file_name}"
        return self.get_source_display()


class EvalItem(models.Model):
    """A labelled question about an image."""

    class TaskType(models.TextChoices):
        READ = "read", "reading text and numbers"
        CHART = "chart", "chart reading"
        COUNT = "count", "counting"
        PRESENCE = "presence", "presence (yes/no)"
        DESCRIPTION = "description", "description"
        REASONING = "reasoning", "reasoning over image and text"
        LONG = "long", "tall or wide images"

    eval_set = models.ForeignKey(EvalSet, on_delete=models.CASCADE, related_name="items")
    row = models.PositiveIntegerField(default=0, help_text="Where the item came from: its row in the file")
    task_type = models.CharField(max_length=16, choices=TaskType.choices)
    question = models.TextField()
    answers = models.JSONField(default=list, help_text="Accepted answers")
    meta = models.JSONField(default=dict, blank=True)
    content_type = models.CharField(max_length=64)
    width = models.PositiveIntegerField()
    height = models.PositiveIntegerField()
    data = models.BinaryField()

    class Meta:
        ordering = ["eval_set", "row", "id"]

    def __str__(self):
        return f"{self.get_task_type_display()}: {self.question[:60]}"


class EvalImport(models.Model):
    """An import of an evaluation set from a file. The row is the truth: the worker writes its
    progress and the rows it refused; the set appears, whole, only if none was."""

    class State(models.TextChoices):
        QUEUED = "queued", "queued"
        RUNNING = "running", "running"
        SUCCEEDED = "succeeded", "succeeded"
        FAILED = "failed", "failed"

    FINAL = (State.SUCCEEDED, State.FAILED)

    name = models.CharField(max_length=128, help_text="The set to make")
    description = models.TextField(blank=True)
    file_name = models.CharField(max_length=255)
    task_type = models.CharField(max_length=16, choices=EvalItem.TaskType.choices,
                                 help_text="For rows that do not name their own")
    data = models.BinaryField(blank=True, help_text="The uploaded file, kept until the import ends")
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    progress = models.FloatField(default=0.0)
    rows = models.PositiveIntegerField(default=0, help_text="Rows read so far")
    errors = models.JSONField(default=list, blank=True, help_text="[row, reason] of refused rows, the first ones")
    error_count = models.PositiveIntegerField(default=0)
    message = models.TextField(blank=True)
    eval_set = models.ForeignKey(EvalSet, null=True, blank=True, on_delete=models.SET_NULL, related_name="imports")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"import of {self.file_name} as {self.name}"

    @property
    def finished(self) -> bool:
        return self.state in self.FINAL


class BenchmarkRun(models.Model):
    """One execution of a profile. The row is the truth: workers move its state and write
    its progress, log and results as they go; a cancel request is a flag the run polls."""

    class State(models.TextChoices):
        QUEUED = "queued", "queued"
        RUNNING = "running", "running"
        SUCCEEDED = "succeeded", "succeeded"
        FAILED = "failed", "failed"
        CANCELLED = "cancelled", "cancelled"

    FINAL = (State.SUCCEEDED, State.FAILED, State.CANCELLED)

    class Trigger(models.TextChoices):
        MANUAL = "manual", "on demand"
        SCHEDULE = "schedule", "schedule"

    profile = models.ForeignKey(BenchmarkProfile, on_delete=models.CASCADE, related_name="runs")
    label = models.CharField(max_length=128, blank=True, help_text="e.g. before / after a change")
    trigger = models.CharField(max_length=16, choices=Trigger.choices, default=Trigger.MANUAL)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Written by the worker as it runs (every half second under load): a running run silent
    # for long has lost its worker.
    beat_at = models.DateTimeField(null=True, blank=True)
    progress = models.FloatField(default=0.0)
    log = models.TextField(blank=True)
    config = models.JSONField(default=dict, blank=True, help_text="The profile and tier as the run used them")
    results = models.JSONField(default=dict, blank=True)
    cancel_requested = models.BooleanField(default=False)
    task_id = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.profile} run {self.pk}"

    @property
    def finished(self) -> bool:
        return self.state in self.FINAL


class QualityGate(models.Model):
    """A tier's quality gate: a change of its resolution policy is measured on the gate set,
    the policy in force against the one proposed, before it goes live; a drop past the
    tolerance blocks the change unless an operator overrides it."""

    tier = models.OneToOneField("catalog.ModelTier", on_delete=models.CASCADE, related_name="quality_gate")
    eval_set = models.ForeignKey(EvalSet, on_delete=models.PROTECT, related_name="gates",
                                 help_text="The gate set: what a change is measured on")
    tolerance_points = models.FloatField(
        default=2.0, validators=[MinValueValidator(0.0), MaxValueValidator(100.0)],
        help_text="The largest drop in accuracy, in percentage points, a change may bring")
    max_tokens = models.PositiveIntegerField(default=16, validators=[MinValueValidator(1), MaxValueValidator(4096)],
                                             help_text="Longest answer asked for")

    def __str__(self):
        return f"quality gate of {self.tier}"


class GateCheck(models.Model):
    """One proposed change, measured before it goes live: of a resolution policy, on every
    gated tier that uses it; or of a gated tier's model or engine settings, on a candidate
    engine that runs the tier as the change would make it, beside the engines serving it. The
    change is applied only from here: at once when every tier passed, or by an operator's
    override, with its reason, when one was blocked. Both are audited with what changed."""

    class State(models.TextChoices):
        RUNNING = "running", "measuring"
        PASSED = "passed", "passed"
        BLOCKED = "blocked", "blocked"
        FAILED = "failed", "could not be measured"
        APPLIED = "applied", "applied"
        OVERRIDDEN = "overridden", "applied over a block"
        DISCARDED = "discarded", "discarded"

    DECIDED = (State.APPLIED, State.OVERRIDDEN, State.DISCARDED)

    # What changes: a policy, or a tier (then `candidate` is the engine measured).
    policy = models.ForeignKey("catalog.ResolutionPolicy", null=True, blank=True, on_delete=models.CASCADE,
                               related_name="gate_checks")
    tier = models.ForeignKey("catalog.ModelTier", null=True, blank=True, on_delete=models.CASCADE,
                             related_name="gate_checks")
    candidate = models.ForeignKey("fleet.EngineInstance", null=True, blank=True, on_delete=models.SET_NULL,
                                  related_name="+")
    current = models.JSONField(help_text="The policy's or tier's fields when the check began")
    proposed = models.JSONField(help_text="The policy's or tier's fields as proposed")
    state = models.CharField(max_length=16, choices=State.choices, default=State.RUNNING)
    progress = models.FloatField(default=0.0)
    log = models.TextField(blank=True)
    # Per tier: the gate set's accuracy under each policy, with its interval, and the drop.
    results = models.JSONField(default=dict, blank=True)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                     related_name="+")
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    override_reason = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [models.CheckConstraint(
            condition=models.Q(policy__isnull=True) ^ models.Q(tier__isnull=True), name="gate_check_of_one_thing")]

    def __str__(self):
        return f"quality check {self.pk} of {self.subject}"

    @property
    def subject(self) -> str:
        return f"policy {self.policy}" if self.policy_id else f"tier {self.tier}"
