from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from controlplane.currencies import CURRENCIES


class Tenant(models.Model):
    name = models.SlugField(max_length=64, unique=True)
    display_name = models.CharField(max_length=128, blank=True)
    allowed_tiers = models.ManyToManyField(
        "catalog.ModelTier", blank=True, related_name="tenants",
        help_text="Empty means every enabled tier",
    )
    # Where `auto` sends this tenant's requests, in place of the tiers marked as the defaults.
    default_text_tier = models.ForeignKey("catalog.ModelTier", null=True, blank=True, on_delete=models.SET_NULL,
                                          related_name="+", help_text="`auto` for text requests")
    default_image_tier = models.ForeignKey("catalog.ModelTier", null=True, blank=True, on_delete=models.SET_NULL,
                                           related_name="+", help_text="`auto` for requests with images")
    isolate_prefix_cache = models.BooleanField(
        default=True, help_text="Send a per-tenant cache_salt so tenants never share KV blocks"
    )
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    # The service's own traffic through the gateway (benchmark runs aimed at a tier, the
    # playground): metered like any tenant's, kept out of finance totals, exports and
    # statements unless asked for. What goes straight to an engine is not metered at all.
    internal = models.BooleanField(default=False, editable=False)
    capture_bodies = models.BooleanField(
        default=False, help_text="Keep its requests' bodies and answers for debugging (images as thumbnails), "
                                 "for CAPTURE_RETENTION_HOURS, seen by operators only")

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def clean(self):
        if self.default_image_tier_id and self.default_image_tier.kind != "vision":
            raise ValidationError({"default_image_tier": "only a vision tier can take requests with images"})


class ApiKey(models.Model):
    """A tenant's key. Only its SHA-256 is stored; the key itself is shown once."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=64, blank=True)
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    allowed_tiers = models.ManyToManyField(
        "catalog.ModelTier", blank=True, related_name="+",
        help_text="Empty: every tier its tenant may use; else only these (and only those its tenant may use)")
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="This key's own limit, within its tenant's quota; empty: none")
    capture_bodies = models.BooleanField(
        default=False, help_text="Keep this key's requests' bodies and answers for debugging (operators only)")
    spend_limit = models.DecimalField(
        max_digits=14, decimal_places=2, null=True, blank=True, validators=[MinValueValidator(Decimal("0.01"))],
        help_text="What this key may spend each quota period, in its tenant's budget currency; refused with "
                  "budget_exceeded once spent; empty: no budget of its own")

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"{self.prefix}… ({self.tenant})"

    def refusal(self, now=None) -> str | None:
        """Why the key cannot be used now: "revoked", "tenant_inactive" or "expired"; None when it can."""
        if self.revoked_at is not None:
            return "revoked"
        if not self.tenant.active:
            return "tenant_inactive"
        if self.expires_at is not None and self.expires_at <= (now or timezone.now()):
            return "expired"
        return None

    def is_usable(self, now=None) -> bool:
        return self.refusal(now) is None


def tenant_tier_ids(tenant: Tenant) -> frozenset[int] | None:
    """The tiers `tenant` may use (None: every enabled tier)."""
    return frozenset(tenant.allowed_tiers.values_list("id", flat=True)) or None


def usable_tier_ids(api_key: ApiKey) -> frozenset[int] | None:
    """The tiers `api_key` may use: its tenant's (None: every enabled tier), narrowed to the
    key's own scope when it has one."""
    allowed = tenant_tier_ids(api_key.tenant) or frozenset()
    scoped = frozenset(api_key.allowed_tiers.values_list("id", flat=True))
    if scoped:
        allowed = (allowed & scoped) if allowed else scoped
        return allowed or frozenset({-1})  # none left: no tier, rather than every tier
    return allowed or None


class QuotaLimits(models.Model):
    """A quota's limits: a tenant's own (Quota), or what new tenants start with (QuotaDefault)."""

    class Period(models.TextChoices):
        DAY = "day", "day"
        MONTH = "month", "month"

    LIMITS = ("image_tokens", "total_tokens", "requests_per_minute", "concurrent_large_images", "spend_limit")
    SETTINGS = ("period", *LIMITS, "spend_hard", "spend_currency")  # all a quota says

    period = models.CharField(max_length=8, choices=Period.choices, default=Period.MONTH)
    image_tokens = models.PositiveBigIntegerField(null=True, blank=True, help_text="Empty: no limit")
    total_tokens = models.PositiveBigIntegerField(null=True, blank=True, help_text="Empty: no limit")
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    concurrent_large_images = models.PositiveIntegerField(null=True, blank=True)
    # A money budget per period: hard, refused with budget_exceeded once spent; soft, alerts only
    # (alert rules of kind budget_spent at the thresholds the operator sets).
    spend_limit = models.DecimalField(max_digits=14, decimal_places=2, null=True, blank=True,
                                      validators=[MinValueValidator(Decimal("0.01"))],
                                      help_text="Budget per period; empty: none")
    spend_hard = models.BooleanField(default=True, help_text="Refuse requests once the budget is spent")
    spend_currency = models.CharField(max_length=3, default="USD", choices=[(c, c) for c in CURRENCIES],
                                      help_text="What the budget counts: requests to tiers priced in it")

    class Meta:
        abstract = True

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, name) is None for name in self.LIMITS)


class Quota(QuotaLimits):
    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")

    def __str__(self):
        return f"quota for {self.tenant}"


class QuotaDefault(QuotaLimits):
    """The quota a new tenant starts with, as the operator set it (one row). No limit set at
    all means new tenants start unlimited, which the tenant form then says in so many words."""

    def __str__(self):
        return "quota of new tenants"

    @classmethod
    def current(cls) -> QuotaDefault:
        return cls.objects.order_by("pk").first() or cls()


class Membership(models.Model):
    """Makes a user the admin of one tenant: they see that tenant's figures and nothing else."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="members")

    def __str__(self):
        return f"{self.user} admin of {self.tenant}"


class QuotaCounter(models.Model):
    """Embedded-mode admission counters (with Redis, these live in Redis).

    One row per tenant and limit; `window` names the period (or minute) the count belongs
    to, so a new period starts from zero without a reset job.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="quota_counters")
    key = models.CharField(max_length=32)  # image_tokens, total_tokens, requests, large_images
    window = models.CharField(max_length=32, default="")
    used = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "key"], name="one_counter_per_limit")]

    def __str__(self):
        return f"{self.tenant} {self.key}@{self.window}: {self.used}"


class RoutingRule(models.Model):
    """A rule of `auto`: requests that meet every one of its conditions go to its tier (at a
    detail or pixel cap within the tier's policy), or first to its tier and, should that
    answer be unsure, cut short or a refusal, to a second. A key's rules are read first, then
    its tenant's, then the defaults (neither tenant nor key), each in `position` order; the
    first that holds decides. None holding, `auto` means what catalog/routing.py says."""

    class Detail(models.TextChoices):
        LOW = "low", "low"
        HIGH = "high", "high"

    class Tools(models.TextChoices):
        WITH = "with", "with tools"
        WITHOUT = "without", "without tools"

    class Confidence(models.TextChoices):
        MEAN = "mean", "mean token probability"
        MIN = "min", "least token probability"

    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="routing_rules",
                               help_text="Empty (and no key): a default rule, for every tenant")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE, related_name="routing_rules")
    position = models.PositiveIntegerField(default=1, help_text="Lower is read first, within its scope")
    name = models.CharField(max_length=64, blank=True)
    enabled = models.BooleanField(default=True)
    # Conditions: each one empty holds for every request.
    tasks = models.CharField(max_length=200, blank=True, help_text=(
        "Task names, comma-separated, one of which the request names (metadata.task, or the X-Task header), "
        "in any case"))
    min_images = models.PositiveIntegerField(null=True, blank=True)
    max_images = models.PositiveIntegerField(null=True, blank=True)
    min_source_pixels = models.PositiveIntegerField(null=True, blank=True, help_text="Of its largest image, as sent")
    max_source_pixels = models.PositiveIntegerField(null=True, blank=True)
    min_image_tokens = models.PositiveIntegerField(
        null=True, blank=True, help_text="All its images', counted at this rule's tier as this rule sends them")
    max_image_tokens = models.PositiveIntegerField(null=True, blank=True)
    min_prompt_tokens = models.PositiveIntegerField(null=True, blank=True, help_text="Its text, estimated")
    max_prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    min_max_tokens = models.PositiveIntegerField(null=True, blank=True, help_text="The max_tokens it asks for")
    max_max_tokens = models.PositiveIntegerField(null=True, blank=True)
    detail = models.CharField(max_length=8, blank=True, choices=[*Detail.choices, ("auto", "auto")],
                              help_text="The detail every image asks for (none asked is auto)")
    tools = models.CharField(max_length=8, blank=True, choices=Tools.choices)
    # What it does.
    tier = models.ForeignKey("catalog.ModelTier", on_delete=models.PROTECT, related_name="+")
    send_detail = models.CharField(max_length=8, blank=True, choices=Detail.choices,
                                   help_text="Every image sent at this detail, whatever it asked")
    pixel_cap = models.PositiveIntegerField(null=True, blank=True, help_text="At most this many pixels an image, "
                                            "within the tier's policy")
    escalate_to = models.ForeignKey("catalog.ModelTier", null=True, blank=True, on_delete=models.PROTECT,
                                    related_name="+", help_text="A cascade: asked when the first answer is unsure")
    escalate_detail = models.CharField(max_length=8, blank=True, choices=Detail.choices)
    escalate_pixel_cap = models.PositiveIntegerField(null=True, blank=True)
    confidence = models.CharField(max_length=8, choices=Confidence.choices, default=Confidence.MEAN)
    threshold = models.FloatField(null=True, blank=True, help_text=(
        "Escalate when the first answer's token probability (mean or least) is below this, between 0 and 1"))
    escalate_on_length = models.BooleanField(default=True, help_text="Escalate an answer cut short by max_tokens")
    escalate_on_refusal = models.BooleanField(default=True, help_text="Escalate an answer that refuses")
    cascade_streams = models.BooleanField(default=True, help_text=(
        "Cascade streamed requests too (their answer is sent once decided); else streams go to the first tier"))
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["position", "id"]
        constraints = [models.CheckConstraint(
            condition=models.Q(escalate_to__isnull=True) | models.Q(threshold__gt=0, threshold__lt=1),
            name="cascade_has_threshold")]

    def __str__(self):
        return f"rule {self.position}" + (f" ({self.name})" if self.name else "")

    @property
    def scope(self) -> str:
        if self.api_key_id:
            return f"key {self.api_key.prefix}…"
        return f"tenant {self.tenant.name}" if self.tenant_id else "default"

    def clean(self):
        errors = {}
        if self.api_key_id:
            self.tenant = self.api_key.tenant
        for low, high in (("min_images", "max_images"), ("min_source_pixels", "max_source_pixels"),
                          ("min_image_tokens", "max_image_tokens"), ("min_prompt_tokens", "max_prompt_tokens"),
                          ("min_max_tokens", "max_max_tokens")):
            if None not in (getattr(self, low), getattr(self, high)) and getattr(self, low) > getattr(self, high):
                errors[high] = "below its least"
        if self.tasks:
            self.tasks = ",".join(sorted({task.strip().lower() for task in self.tasks.split(",") if task.strip()}))
        for field, cap, tier in (("pixel_cap", self.pixel_cap, self.tier if self.tier_id else None),
                                 ("escalate_pixel_cap", self.escalate_pixel_cap,
                                  self.escalate_to if self.escalate_to_id else None)):
            if cap is None or tier is None:
                continue
            policy = tier.resolution_policy
            if policy is None:
                errors[field] = f"{tier.name} takes no images, so has no pixel cap"
            elif not policy.min_pixels <= cap <= policy.max_pixels:
                errors[field] = (f"within {tier.name}'s policy: between {policy.min_pixels:,} and "
                                 f"{policy.max_pixels:,} pixels")
        if self.escalate_to_id:
            if self.threshold is None or not 0 < self.threshold < 1:
                errors["threshold"] = "a cascade escalates below a probability between 0 and 1"
            if (self.escalate_to_id, self.escalate_detail, self.escalate_pixel_cap) == (
                    self.tier_id, self.send_detail, self.pixel_cap):
                errors["escalate_to"] = "the same tier as sent first: a higher cap or detail, or another tier"
        elif self.threshold is not None:
            errors["threshold"] = "only a cascade has a threshold: name the tier it escalates to"
        errors.update(self._tiers_usable())
        if errors:
            raise ValidationError(errors)

    def _tiers_usable(self) -> dict:
        """A tenant's or key's rule may only name tiers it may use."""
        if self.api_key_id:
            usable, whose = usable_tier_ids(self.api_key), "this key"
        elif self.tenant_id:
            usable, whose = tenant_tier_ids(self.tenant), "this tenant"
        else:
            return {}
        errors = {}
        for field in ("tier", "escalate_to"):
            tier_id = getattr(self, f"{field}_id")
            if tier_id is not None and usable is not None and tier_id not in usable:
                errors[field] = f"{whose} may not use {getattr(self, field).name}"
        return errors
