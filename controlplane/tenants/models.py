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
    # The service's own traffic (benchmarks, evaluations, the playground): metered like any
    # tenant's, kept out of finance totals, exports and statements unless asked for.
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

    def is_usable(self, now=None) -> bool:
        now = now or timezone.now()
        if self.revoked_at is not None or not self.tenant.active:
            return False
        return self.expires_at is None or self.expires_at > now


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
