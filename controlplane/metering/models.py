import bisect
from decimal import Decimal

from django.db import models
from django.utils import timezone

from controlplane.metering.records import ERROR_MESSAGE_CHARS, STAGES


class UsageEvent(models.Model):
    """Exactly one per gateway request, keyed by its request id."""

    class Status(models.TextChoices):
        OK = "ok", "ok"
        ERROR = "error", "error"
        ABORTED = "aborted", "aborted"
        # The gateway handling it died; recorded from its in-flight journal (prompt counted
        # before forwarding, output as of its last heartbeat).
        INTERRUPTED = "interrupted", "interrupted"

    # Unique (a constraint below: a unique field would get a second, LIKE-pattern index on
    # PostgreSQL that nothing reads and every insert pays for).
    request_id = models.CharField(max_length=64)
    created_at = models.DateTimeField(default=timezone.now)
    recorded_at = models.DateTimeField(auto_now_add=True, db_index=True)
    # Found by the indexes below that lead with them (a foreign key's own index would be a
    # second one to write on every insert).
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="usage_events",
                               db_index=False)
    api_key = models.ForeignKey(
        "tenants.ApiKey", null=True, on_delete=models.SET_NULL, related_name="usage_events"
    )
    # None: refused before its model was known (at authentication, or reading its body).
    tier = models.ForeignKey("catalog.ModelTier", null=True, blank=True, on_delete=models.PROTECT,
                             related_name="usage_events", db_index=False)
    instance = models.ForeignKey(
        "fleet.EngineInstance", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    status = models.CharField(max_length=16, choices=Status.choices)
    http_status = models.PositiveSmallIntegerField(default=200)
    stream = models.BooleanField(default=False)
    latency_ms = models.PositiveIntegerField(default=0, help_text="From arrival to the answer's last byte")
    prepare_ms = models.PositiveIntegerField(null=True, blank=True, help_text="Preparing the images")
    queue_ms = models.PositiveIntegerField(null=True, blank=True,
                                           help_text="Waiting in the gateway before an engine was sent it")
    ttft_ms = models.PositiveIntegerField(null=True, blank=True, help_text="From arrival to the first token streamed")
    error_stage = models.CharField(max_length=16, blank=True, choices=list(STAGES.items()),
                                   help_text="Where a failed request stopped")
    error_code = models.CharField(max_length=64, blank=True, help_text="The error's code, as its client was told")
    error_message = models.CharField(max_length=ERROR_MESSAGE_CHARS, blank=True)
    error_param = models.CharField(max_length=120, blank=True, help_text="The part of the request it named")
    routed_by = models.CharField(max_length=160, blank=True, help_text="The routing rule that chose its tier")
    cascade_of = models.CharField(max_length=64, blank=True,
                                  help_text="An escalation: the request id of the cascade's first attempt")
    escalation = models.CharField(max_length=16, blank=True,
                                  help_text="A cascade's first attempt: why its answer was not sent")
    confidence = models.FloatField(null=True, blank=True, help_text="A cascade's first answer's token probability")
    image_count = models.PositiveIntegerField(default=0)
    image_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    # Image tokens of whole images inside the prefix the engine reused (priced at a discount).
    cached_image_tokens = models.PositiveIntegerField(default=0)
    # The engine's own count (vLLM's prompt_tokens_details.multimodal_tokens.image: the image
    # placeholders, without the markers around each image that image_tokens includes). Null
    # when the engine reported none.
    engine_image_tokens = models.PositiveIntegerField(null=True, blank=True)
    # The engine's count is not what the gateway's count implies: billed at the gateway's
    # count (what admission reserved), flagged here and counted on the tier for review.
    image_tokens_disagree = models.BooleanField(default=False)
    # What the gateway counted before forwarding (text and images), which it reserved
    # against the quota; estimated when the tier had no tokenizer of its own.
    counted_prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    prompt_estimated = models.BooleanField(default=True)
    text_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    cost = models.DecimalField(max_digits=14, decimal_places=6, default=Decimal("0"))
    # What the cached image tokens' discount saved: the price without it minus the cost.
    cache_savings = models.DecimalField(max_digits=14, decimal_places=6, default=Decimal("0"))
    # False when no price was in effect: the usage is kept and the cost must be set later.
    rated = models.BooleanField(default=True)
    # The rate that priced it (none for a request not billed, or unrated): what it cost stays
    # what it was billed at, whatever later happens to its tier's plan.
    rate = models.ForeignKey("catalog.PriceRate", null=True, blank=True, on_delete=models.PROTECT,
                             related_name="usage_events", db_index=False)

    class Meta:
        ordering = ["-created_at"]
        # The request log reads newest first, a page at a time from a (created_at, id) key,
        # over everything or one tenant or tier, or only the requests that did not succeed:
        # each of those walks one of these indexes and stops after a page.
        # With the time it was made: on PostgreSQL the table is partitioned by it, and a unique
        # key must hold the partition's key (metering/partitions.py). Every copy of a request's
        # record carries the time it was made, so the pair is as unique as the id.
        constraints = [models.UniqueConstraint(fields=["request_id", "created_at"], name="one_event_per_request")]
        indexes = [
            models.Index(fields=["created_at", "id"], name="usage_log"),
            models.Index(fields=["tenant", "created_at", "id"], name="usage_log_tenant"),
            models.Index(fields=["tier", "created_at", "id"], name="usage_log_tier"),
            models.Index(fields=["created_at", "id"], condition=~models.Q(status="ok"), name="usage_log_not_ok"),
            # The rare events whose engine counted other image tokens, shown per tier.
            models.Index(fields=["tier", "created_at"], condition=models.Q(image_tokens_disagree=True),
                         name="usage_image_count_disagree"),
            # A cascade's escalation, found from its first attempt.
            models.Index(fields=["cascade_of"], condition=~models.Q(cascade_of=""), name="usage_escalations"),
            # What a rate billed, and until when (a new rate of its plan starts after that).
            models.Index(fields=["rate", "created_at"], name="usage_by_rate"),
        ]

    def __str__(self):
        return self.request_id


# An error rate counts failures of the service: the engine's or the gateway's (a 5xx). A refusal
# the client caused (a bad image, a quota's 429) is an error to the client, not a failure to
# page anyone about. The alerts and the operations charts both count these.
SERVER_ERROR = models.Q(status=UsageEvent.Status.ERROR, http_status__gte=500)


def is_server_error(status: str, http_status: int) -> bool:
    return status == UsageEvent.Status.ERROR and http_status >= 500


class UsageImage(models.Model):
    # No constraint in the database: PostgreSQL cannot point one at a partitioned table's id
    # alone. Both rows are written in one transaction, and the ORM cascades deletes.
    event = models.ForeignKey(UsageEvent, on_delete=models.CASCADE, related_name="images", db_constraint=False)
    created_at = models.DateTimeField(help_text="Its event's: the picture lives in its event's month")
    position = models.PositiveSmallIntegerField()
    source_format = models.CharField(max_length=8)
    source_width = models.PositiveIntegerField()
    source_height = models.PositiveIntegerField()
    width = models.PositiveIntegerField()
    height = models.PositiveIntegerField()
    tokens = models.PositiveIntegerField()
    fingerprint = models.CharField(max_length=32)  # matched in the gateway's memory, never looked up here
    # A long picture the policy cut into tiles is one row per tile, in reading order.
    tile = models.PositiveSmallIntegerField(default=0)
    tiles = models.PositiveSmallIntegerField(default=1)
    cached = models.BooleanField(default=False, help_text="Served from the engine's prefix cache, wholly or in part")
    # Its share of the engine's cached prefix: the positions of the image inside it.
    cached_tokens = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["event", "position"]

    def __str__(self):
        return f"{self.event_id}#{self.position} {self.width}x{self.height}"


class UsageTotals(models.Model):
    """The totals a rollup keeps for each period, tenant, key and tier. Requests not billed
    (refused or failed before an engine worked on them: metering.services.billed) are counted
    apart and add nothing else, so the token totals and the requests less the unbilled ones are
    what a statement shows."""

    requests = models.PositiveIntegerField(default=0)
    unbilled_requests = models.PositiveIntegerField(default=0)
    images = models.PositiveIntegerField(default=0)
    image_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    cached_image_tokens = models.PositiveBigIntegerField(default=0)
    text_tokens = models.PositiveBigIntegerField(default=0)
    output_tokens = models.PositiveBigIntegerField(default=0)
    cost = models.DecimalField(max_digits=16, decimal_places=6, default=Decimal("0"))
    cache_savings = models.DecimalField(max_digits=16, decimal_places=6, default=Decimal("0"))

    class Meta:
        abstract = True


# The totals every rollup row carries, in this order.
TOTALS = tuple(field.name for field in UsageTotals._meta.fields)


class DailyUsage(UsageTotals):
    day = models.DateField()
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="daily_usage")
    api_key = models.ForeignKey("tenants.ApiKey", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="daily_usage")
    # None: the requests refused before their model was known (counted, never billed).
    tier = models.ForeignKey("catalog.ModelTier", null=True, blank=True, on_delete=models.CASCADE,
                             related_name="daily_usage")

    class Meta:
        ordering = ["day", "tenant", "tier"]
        constraints = [
            models.UniqueConstraint(fields=["day", "tenant", "api_key", "tier"], name="one_row_per_day_tenant_key_tier")
        ]

    def __str__(self):
        return f"{self.day} {self.tenant_id}/{self.api_key_id}/{self.tier_id}"


class HourlyUsage(UsageTotals):
    hour = models.DateTimeField()
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="hourly_usage")
    api_key = models.ForeignKey("tenants.ApiKey", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="hourly_usage")
    # None: the requests refused before their model was known (counted, never billed).
    tier = models.ForeignKey("catalog.ModelTier", null=True, blank=True, on_delete=models.CASCADE,
                             related_name="hourly_usage")

    class Meta:
        ordering = ["hour", "tenant", "tier"]
        constraints = [
            models.UniqueConstraint(fields=["hour", "tenant", "api_key", "tier"], name="one_row_per_hour_tenant_key_tier")
        ]

    def __str__(self):
        return f"{self.hour:%Y-%m-%d %H}h {self.tenant_id}/{self.api_key_id}/{self.tier_id}"


class RetiredMonth(models.Model):
    """A month whose usage events and pictures were dropped (metering/partitions.py), after its
    rollups were found equal to them; its statements are read from the rollups."""

    month = models.DateField(unique=True)  # its first day
    retired_at = models.DateTimeField(default=timezone.now)
    events = models.PositiveBigIntegerField()
    images = models.PositiveBigIntegerField()
    archive = models.CharField(max_length=512, blank=True)  # where they were copied, if anywhere

    class Meta:
        ordering = ["month"]

    def __str__(self):
        return f"{self.month:%Y-%m} retired"


class RollupState(models.Model):
    """How far the rollup has read, so each run only revisits days touched since."""

    name = models.CharField(max_length=32, unique=True)
    watermark = models.DateTimeField(null=True, blank=True)
    ran_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return f"{self.name} up to {self.watermark}"


class ImageCostHistogram(models.Model):
    """How many images of a day, tenant and tier cost how much each: the cost-per-image
    distribution, kept so the dashboard never reads the images themselves.

    Buckets grow logarithmically (1, 1.5, 2, 3, 5, 7 per decade of the tier's currency, from
    0.00001 to 10);
    each is named by its lower edge and holds the images costing from that edge up to the next.
    Costs are whole micro-units, so the bucket from 0 holds exactly the free images.
    """

    EDGES = (Decimal("0"), Decimal("0.000001"),
             *(Decimal(step).scaleb(exponent) for exponent in range(-5, 1) for step in ("1", "1.5", "2", "3", "5", "7")),
             Decimal("10"))

    day = models.DateField()
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="image_costs")
    tier = models.ForeignKey("catalog.ModelTier", on_delete=models.CASCADE, related_name="image_costs")
    # Null for images with no price in effect when they were sent.
    cost_from = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    images = models.PositiveIntegerField(default=0)
    image_tokens = models.PositiveBigIntegerField(default=0)
    cost = models.DecimalField(max_digits=16, decimal_places=6, default=Decimal("0"))

    class Meta:
        ordering = ["day", "tenant", "tier", "cost_from"]
        constraints = [
            models.UniqueConstraint(fields=["day", "tenant", "tier", "cost_from"],
                                    name="one_row_per_day_tenant_tier_cost_bucket")
        ]

    def __str__(self):
        return f"{self.day} {self.tenant_id}/{self.tier_id} {self.label(self.cost_from)}: {self.images}"

    @classmethod
    def bucket(cls, cost: Decimal | None) -> Decimal | None:
        """The lower edge of the bucket `cost` falls in (None when it has no price)."""
        if cost is None:
            return None
        return cls.EDGES[max(bisect.bisect_right(cls.EDGES, cost) - 1, 0)]

    @classmethod
    def label(cls, cost_from: Decimal | None) -> str:
        if cost_from is None:
            return "unpriced"
        if cost_from == 0:
            return "0"
        position = cls.EDGES.index(cost_from)
        if position == len(cls.EDGES) - 1:
            return f"≥ {_plain(cost_from)}"
        return f"{_plain(cost_from)}–{_plain(cls.EDGES[position + 1])}"


def _plain(amount: Decimal) -> str:
    return format(amount.normalize(), "f")


class RequestCapture(models.Model):
    """A request's body and its answer, kept for debugging when its tenant or key asks for it
    (off by default): images as small thumbnails, text whole up to CAPTURE_MAX_CHARS, for
    CAPTURE_RETENTION_HOURS. Only operators see them."""

    request_id = models.CharField(max_length=64, unique=True)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    request = models.JSONField()  # the body, each image a thumbnail data URL
    response = models.TextField(blank=True)  # the answer's JSON, or a stream's text

    def __str__(self):
        return f"capture of {self.request_id}"
