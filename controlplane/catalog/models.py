import json
from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models, transaction
from django.db.models import Max, Q
from django.utils import timezone

from controlplane.audit.services import audit_record, field_values
from controlplane.catalog.engine_settings import EngineSettings, EngineSettingsError
from controlplane.currencies import CURRENCIES
from controlplane.imaging.decode import SUPPORTED_FORMATS
from controlplane.imaging.policy import Policy
from controlplane.imaging.tokens import FAMILIES, image_grid


class ResolutionPolicy(models.Model):
    """How far an image may grow before it reaches the model: the first cost gate."""

    # The fields that decide what an image becomes (all but the name), in the editor's order.
    BOUNDS = ("max_pixels", "low_detail_max_pixels", "min_pixels", "default_detail", "max_long_edge",
              "max_aspect_ratio", "tile_long_images", "max_images_per_request", "max_total_pixels",
              "max_input_pixels", "allowed_formats", "output_format", "output_quality")

    name = models.SlugField(max_length=64, unique=True)
    min_pixels = models.PositiveIntegerField(default=3136)
    max_pixels = models.PositiveIntegerField(default=1003520, help_text="'high' detail cap")
    low_detail_max_pixels = models.PositiveIntegerField(default=200704, help_text="'low' detail cap")
    default_detail = models.CharField(
        max_length=8, choices=[("low", "low"), ("high", "high")], default="high"
    )
    max_long_edge = models.PositiveIntegerField(default=4096)
    # Past 4:1 a long image is cut into tiles, each sent at the full cap: measured on a model
    # that reads, squashing a 1:6 to 1:30 banner whole read none of them, tiles past 4:1 read
    # 55 to 88 %, past 8:1 or 20:1 none (docs/design/seeing-model.md). A 1:32 strip takes 8 tiles.
    max_aspect_ratio = models.FloatField(default=4.0, validators=[MinValueValidator(1.0)],
                                         help_text="Longer images are cut into tiles of at most this ratio")
    tile_long_images = models.BooleanField(default=True)
    max_images_per_request = models.PositiveSmallIntegerField(default=8)
    max_total_pixels = models.PositiveBigIntegerField(default=16_000_000)
    max_input_pixels = models.PositiveBigIntegerField(
        default=50_000_000, help_text="Refuse larger images before decoding them"
    )
    allowed_formats = models.JSONField(
        default=list, blank=True, help_text="Empty means every supported format"
    )
    output_format = models.CharField(
        max_length=8, choices=[("jpeg", "JPEG"), ("png", "PNG"), ("webp", "WebP")], default="jpeg"
    )
    # 85: near-lossless for a picture the model's processor resamples anyway, and about a
    # fifth smaller than 90 on the wire to the engine.
    output_quality = models.PositiveSmallIntegerField(default=85)

    class Meta:
        verbose_name_plural = "resolution policies"

    def __str__(self):
        return self.name

    def clean(self):
        errors = {}
        patch = 28 * 28  # the smallest image a ViT-based VLM's processor makes (one merged patch)
        if self.min_pixels < patch:
            errors["min_pixels"] = f"at least {patch:,} pixels (28 x 28)"
        if self.min_pixels > self.max_pixels:
            errors["max_pixels"] = "must not be below min_pixels"
        if self.low_detail_max_pixels > self.max_pixels:
            errors["low_detail_max_pixels"] = "must not exceed max_pixels"
        if self.low_detail_max_pixels < self.min_pixels:
            errors["low_detail_max_pixels"] = "must not be below min_pixels"
        if self.max_total_pixels < self.max_pixels:
            errors["max_total_pixels"] = "must allow at least one image at max_pixels"
        if self.max_input_pixels < self.max_pixels:
            errors["max_input_pixels"] = "must allow an image of max_pixels in"
        if not 28 <= self.max_long_edge <= 65535:
            errors["max_long_edge"] = "from 28 to 65,535 pixels"
        if not 1 <= self.max_images_per_request <= 64:
            errors["max_images_per_request"] = "from 1 to 64"
        if not 1 <= self.output_quality <= 100:
            errors["output_quality"] = "from 1 to 100"
        if self.max_aspect_ratio > 200:
            errors["max_aspect_ratio"] = "at most 200"
        unknown = [f for f in self.allowed_formats or () if str(f).upper() not in SUPPORTED_FORMATS]
        if unknown:
            errors["allowed_formats"] = f"unknown formats {', '.join(map(str, unknown))}: use {', '.join(SUPPORTED_FORMATS)}"
        if errors:
            raise ValidationError(errors)

    def as_policy(self, *, grid: int = 0):
        return Policy(
            grid=grid,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            low_detail_max_pixels=self.low_detail_max_pixels,
            default_detail=self.default_detail,
            max_long_edge=self.max_long_edge,
            max_aspect_ratio=self.max_aspect_ratio,
            tile_long_images=self.tile_long_images,
            max_images_per_request=self.max_images_per_request,
            max_total_pixels=self.max_total_pixels,
            max_input_pixels=self.max_input_pixels,
            allowed_formats=tuple(f.upper() for f in self.allowed_formats or ()),
            output_format=self.output_format,
            output_quality=self.output_quality,
        )


# The most engines one tier may run (the fleet page and the tier form hold to it).
MAX_REPLICAS = 64


class PricePlan(models.Model):
    """Prices over time in one currency: a plan keeps its currency once it has rates, and
    amounts in different currencies are never added together."""

    name = models.SlugField(max_length=64, unique=True)
    currency = models.CharField(max_length=3, default="USD", choices=[(c, c) for c in CURRENCIES])

    def __str__(self):
        return self.name

    def save(self, *args, actor: str = "", **kwargs):
        """Saved and recorded in the audit log at once; `actor` is who made the change."""
        if self.currency not in CURRENCIES:
            raise ValidationError({"currency": f"{self.currency!r} is not a currency plans bill in: "
                                               f"{', '.join(CURRENCIES)}"})
        self._refuse_a_currency_change()
        stored = PricePlan.objects.filter(pk=self.pk).first() if self.pk else None
        with transaction.atomic():
            super().save(*args, **kwargs)
            audit_record(actor=actor, action="changed" if stored else "created", obj=self,
                         before=field_values(stored, ("name", "currency")) if stored else None,
                         after=field_values(self, ("name", "currency")))

    def clean(self):
        self._refuse_a_currency_change()

    def _refuse_a_currency_change(self) -> None:
        if self.pk is None:
            return
        stored = PricePlan.objects.filter(pk=self.pk).values_list("currency", flat=True).first()
        if stored and stored != self.currency and self.rates.exists():
            raise ValidationError({"currency": f"a plan with rates keeps its currency ({stored}): make a new "
                                               "plan instead"})


_PRICE = {"max_digits": 12, "decimal_places": 6, "default": Decimal("0"), "validators": [MinValueValidator(0)]}
_AMOUNTS = ("text_input_per_mtok", "image_per_mtok", "output_per_mtok", "per_image_fee", "cached_image_discount")
_AUDITED = ("plan_id", "effective_from", *_AMOUNTS)


class RateInUse(ValidationError):
    pass


class PriceRateQuerySet(models.QuerySet):
    """Writes in bulk go through each rate's own checks and audit, so no path rewrites or
    removes a rate that billed anything (the database refuses it as well: a trigger on
    update, the usage events' foreign key on delete)."""

    def update(self, **changes):
        count = 0
        for rate in self:
            for name, value in changes.items():
                setattr(rate, name, value)
            rate.save()
            count += 1
        return count

    def delete(self):
        deleted = 0
        for rate in self:
            deleted += rate.delete()[0]
        return deleted, {PriceRate._meta.label: deleted}


class PriceRate(models.Model):
    """One version of a plan's prices. A new price is a new row; old periods keep theirs. Each
    usage event names the rate that priced it, so a rate that billed anything never changes
    and never goes: a change is a new rate from its own moment, after what was billed."""

    plan = models.ForeignKey(PricePlan, on_delete=models.CASCADE, related_name="rates")
    effective_from = models.DateTimeField(default=timezone.now)
    text_input_per_mtok = models.DecimalField(**_PRICE)
    image_per_mtok = models.DecimalField(**_PRICE)
    output_per_mtok = models.DecimalField(**_PRICE)
    per_image_fee = models.DecimalField(**_PRICE)
    cached_image_discount = models.DecimalField(
        max_digits=4, decimal_places=3, default=Decimal("0"),
        validators=[MinValueValidator(0), MaxValueValidator(1)],
        help_text="Fraction of the image token price waived for cached image tokens (0..1)",
    )
    created_at = models.DateTimeField(auto_now_add=True, null=True)
    created_by = models.CharField(max_length=150, blank=True, help_text="Who entered this rate")

    objects = PriceRateQuerySet.as_manager()

    class Meta:
        ordering = ["plan", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["plan", "effective_from"], name="one_rate_per_instant"),
            # Checked twice: the form and clean() refuse these, the database too.
            models.CheckConstraint(
                condition=models.Q(text_input_per_mtok__gte=0, image_per_mtok__gte=0, output_per_mtok__gte=0,
                                   per_image_fee__gte=0),
                name="rate_amounts_not_negative"),
            models.CheckConstraint(condition=models.Q(cached_image_discount__gte=0, cached_image_discount__lte=1),
                                   name="rate_cached_discount_a_fraction"),
        ]

    def __str__(self):
        return f"{self.plan} from {self.effective_from:%Y-%m-%d}"

    def save(self, *args, actor: str = "", **kwargs):
        """Saved and recorded in the audit log at once; `actor` is who made the change."""
        self._refuse_a_billed_change()  # also for code that skips clean()
        stored = PriceRate.objects.filter(pk=self.pk).first() if self.pk else None
        with transaction.atomic():
            super().save(*args, **kwargs)
            audit_record(actor=actor or (self.created_by if stored is None else ""),
                         action="changed" if stored else "created", obj=self,
                         before=field_values(stored, _AUDITED) if stored else None,
                         after=field_values(self, _AUDITED))

    def delete(self, *args, actor: str = "", **kwargs):
        if billed := self.billed_requests():
            raise RateInUse(f"this rate has priced {billed} requests and cannot be deleted")
        self._refuse_leaving_live_tiers_unpriced()
        with transaction.atomic():
            audit_record(actor=actor, action="deleted", obj=self, before=field_values(self, _AUDITED))
            return super().delete(*args, **kwargs)

    def clean(self):
        self._refuse_a_billed_change()

    def billed_requests(self) -> int:
        """Requests this rate priced (each usage event names its rate)."""
        return self.usage_events.count() if self.pk else 0

    def _refuse_a_billed_change(self) -> None:
        stored = PriceRate.objects.filter(pk=self.pk).values(*_AMOUNTS, "effective_from", "plan_id").first() \
            if self.pk else None
        changed = stored and any(stored[name] != getattr(self, name) for name in (*_AMOUNTS, "effective_from", "plan_id"))
        if changed and (billed := PriceRate.objects.get(pk=self.pk).billed_requests()):
            # Editing it would rewrite what was billed: a change is a new rate from a date.
            raise RateInUse(f"this rate has priced {billed} requests and cannot change; add a new "
                            "rate with its own effective date")
        if stored is None or stored["effective_from"] != self.effective_from or stored["plan_id"] != self.plan_id:
            self._refuse_starting_inside_what_was_billed()

    def _refuse_starting_inside_what_was_billed(self) -> None:
        """A rate starting before usage its plan already billed would be the rate in effect for
        requests another rate priced: a new price starts after the last request billed."""
        if self.effective_from is None or self.plan_id is None:
            return
        since = Q(usage_events__created_at__gte=self.effective_from)
        last = PriceRate.objects.filter(plan_id=self.plan_id) \
            .aggregate(last=Max("usage_events__created_at", filter=since))["last"]
        if last is not None:
            raise RateInUse({"effective_from": f"requests were already billed on this plan up to "
                                               f"{last:%Y-%m-%d %H:%M:%S %Z}: a new rate starts after that"})

    def _refuse_leaving_live_tiers_unpriced(self) -> None:
        now = timezone.now()
        if self.effective_from > now or self.plan.rates.exclude(pk=self.pk).filter(effective_from__lte=now).exists():
            return
        live = list(self.plan.tiers.filter(enabled=True).values_list("name", flat=True))
        if live:
            raise ValidationError(f"{', '.join(live)} would have no price in effect: add another rate, or "
                                  "disable the tiers first")


class ModelTier(models.Model):
    class Kind(models.TextChoices):
        TEXT = "text", "text"
        VISION = "vision", "vision"

    class EngineKind(models.TextChoices):
        VLLM = "vllm", "vLLM"
        SGLANG = "sglang", "SGLang"
        SIMULATOR = "simulator", "simulator"
        EXTERNAL = "external", "external (already running, registered by URL)"

    name = models.SlugField(max_length=64, unique=True, help_text="The `model` tenants ask for")
    display_name = models.CharField(max_length=128, blank=True)
    family = models.CharField(
        max_length=32, choices=[(f, f) for f in FAMILIES], help_text="Hugging Face model_type"
    )
    model_id = models.CharField(max_length=256, help_text="Weights, e.g. Qwen/Qwen2.5-VL-7B-Instruct")
    kind = models.CharField(max_length=8, choices=Kind.choices)
    engine_kind = models.CharField(max_length=16, choices=EngineKind.choices)
    engine_settings = models.JSONField(default=dict, blank=True)
    resolution_policy = models.ForeignKey(
        ResolutionPolicy, null=True, blank=True, on_delete=models.PROTECT, related_name="tiers"
    )
    price_plan = models.ForeignKey(PricePlan, on_delete=models.PROTECT, related_name="tiers")
    large_image_threshold = models.PositiveIntegerField(
        default=4096, help_text="Requests with more image tokens than this go to the large-image pool"
    )
    replicas = models.PositiveSmallIntegerField(
        default=1, validators=[MaxValueValidator(MAX_REPLICAS)], help_text=f"Engines to run, 0 to {MAX_REPLICAS}")
    gpus_per_replica = models.PositiveSmallIntegerField(default=0)
    enabled = models.BooleanField(default=True)
    # What the model name `auto` resolves to (routing.py), unless a tenant names its own.
    default_for_text = models.BooleanField(default=False, help_text="`auto` sends text requests here")
    default_for_images = models.BooleanField(default=False, help_text="`auto` sends requests with images here")

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["default_for_text"], condition=models.Q(default_for_text=True),
                                    name="one_default_text_tier"),
            models.UniqueConstraint(fields=["default_for_images"], condition=models.Q(default_for_images=True),
                                    name="one_default_image_tier"),
        ]

    def __str__(self):
        return self.name

    def save(self, *args, **kwargs):
        # Whatever path saves a tier, its settings are ones the launcher and gateway can use,
        # and what it billed stays in the currency it was billed in.
        self.engine_settings = self._checked_settings().stored()
        self._refuse_a_currency_change()
        super().save(*args, **kwargs)

    def image_policy(self):
        """The resolution policy as the imaging library applies it for this tier's model."""
        return self.resolution_policy.as_policy(grid=image_grid(self.family)) if self.resolution_policy else None

    @property
    def settings(self) -> EngineSettings:
        """The engine settings, typed (engine_settings.py); EngineSettingsError if the stored
        ones cannot be used."""
        key = (self.engine_kind, json.dumps(self.engine_settings, sort_keys=True, default=str))
        if getattr(self, "_settings_key", None) != key:
            self._settings, self._settings_key = EngineSettings.parse(self.engine_settings, self.engine_kind), key
        return self._settings

    def ttft_objectives(self) -> dict[str, int]:
        """The p95 first-token objective of each request class the tier sets (ms); none while
        its stored settings cannot be used (its page says what is wrong with them)."""
        try:
            return self.settings.ttft_objectives()
        except EngineSettingsError:
            return {}

    @property
    def runs_on_cpu(self) -> bool:
        """A vLLM tier with `device: cpu` runs vLLM's CPU build, on a node without GPUs."""
        return self.engine_kind == self.EngineKind.VLLM and self.settings.runs_on_cpu

    def _checked_settings(self) -> EngineSettings:
        try:
            return self.settings
        except EngineSettingsError as exc:
            raise ValidationError({"engine_settings": [f"{k}: {m}" for k, m in exc.messages.items()]}) from exc

    def clean(self):
        self._checked_settings()
        if self.kind == self.Kind.VISION and self.resolution_policy_id is None:
            raise ValidationError("a vision tier needs a resolution policy")
        if self.default_for_images and self.kind != self.Kind.VISION:
            raise ValidationError({"default_for_images": "only a vision tier can be the default for images"})
        if not self.enabled and (self.default_for_text or self.default_for_images):
            raise ValidationError(f"{self.name} is where `auto` sends requests: make another tier the default "
                                  "before disabling it")
        if self.enabled and self.price_plan_id:
            if not priced_plans([self.price_plan_id], timezone.now()):
                raise ValidationError("an enabled tier needs a price in effect: add a rate to its plan first")
        self._refuse_a_currency_change()

    def _refuse_a_currency_change(self) -> None:
        """A tier bills in one currency: once it has billed, its plan changes only to a plan of
        the same currency (a tenant's usage of it is never summed across currencies)."""
        if self.pk is None or not self.price_plan_id:
            return

        stored = ModelTier.objects.filter(pk=self.pk).values_list("price_plan__currency", flat=True).first()
        currency = PricePlan.objects.filter(pk=self.price_plan_id).values_list("currency", flat=True).first()
        if stored and currency != stored and self.usage_events.exclude(rate=None).exists():
            raise ValidationError({"price_plan": f"{self.name} has billed in {stored}: its plan may change only "
                                                 f"to another plan in that currency, not {currency}"})


class TierTokenizer(models.Model):
    """A tier's own tokenizer and chat template, with which the gateway counts prompts
    exactly. Published by the node agent from the model it launched, or uploaded by an
    operator (`manage.py tier_tokenizer`)."""

    tier = models.OneToOneField(ModelTier, on_delete=models.CASCADE, related_name="tokenizer")
    tokenizer_json = models.TextField(help_text="The model's tokenizer.json (fast tokenizer)")
    chat_template = models.TextField()
    special_tokens = models.JSONField(default=dict, blank=True, help_text="bos_token, eos_token")
    digest = models.CharField(max_length=64, help_text="sha256 of the three above")
    source = models.CharField(max_length=255, help_text="Where it came from")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self):
        return f"tokenizer of {self.tier}"


def priced_plans(plan_ids, when) -> set[int]:
    """Of these price plans, those with a rate in effect at `when` (one query)."""
    return set(PriceRate.objects.filter(plan_id__in=set(plan_ids), effective_from__lte=when)
               .values_list("plan_id", flat=True).distinct())
