"""The forms of the catalog pages: tiers and their engine settings, resolution policies and
their preview, price plans and their rates."""

from decimal import Decimal

from django import forms
from django.utils import timezone

from controlplane.catalog.engine_settings import (
    SETTINGS,
    SGLANG,
    EngineSettings,
    EngineSettingsError,
    applicable,
)
from controlplane.imaging.decode import SUPPORTED_FORMATS
from controlplane.web.fields import UtcDateTimeField


class PolicyPreviewForm(forms.Form):
    MAX_BYTES = 50 * 1024 * 1024

    image = forms.FileField(help_text="Any JPEG, PNG, WebP, GIF, BMP, TIFF, HEIC or AVIF")
    detail = forms.ChoiceField(choices=[("auto", "auto"), ("high", "high"), ("low", "low")], initial="auto")

    def clean_image(self):
        upload = self.cleaned_data["image"]
        if upload.size > self.MAX_BYTES:
            raise forms.ValidationError(f"images up to {self.MAX_BYTES // (1024 * 1024)} MB")
        return upload


class TierForm(forms.ModelForm):
    """A tier, with the engine settings of one engine kind as typed fields (their bounds and
    the rules between them are engine_settings.py's, so the form and the model agree)."""

    class Meta:
        from controlplane.catalog.models import ModelTier

        model = ModelTier
        fields = ["name", "display_name", "kind", "family", "model_id", "resolution_policy", "price_plan",
                  "large_image_threshold", "replicas", "gpus_per_replica", "enabled", "default_for_text",
                  "default_for_images"]
        labels = {"model_id": "Model (weights)", "large_image_threshold": "Large-image threshold (tokens)",
                  "gpus_per_replica": "GPUs per replica", "enabled": "Enabled (served to tenants)",
                  "default_for_text": "Default for text (`auto`)", "default_for_images": "Default for images (`auto`)"}
        del ModelTier

    def __init__(self, *args, engine_kind: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine_kind = engine_kind
        current = applicable(self.instance.engine_settings, engine_kind)
        self.settings_fields = []
        for setting in SETTINGS:
            if engine_kind in setting.engines:
                name = f"setting_{setting.key}"
                self.fields[name] = _setting_field(setting, current.get(setting.key), engine_kind)
                self.settings_fields.append((setting, name))
        self.fields["resolution_policy"].help_text = "Vision tiers: how far images may grow (the cost gate)"

    def _get_validation_exclusions(self):
        # Marking this tier a default takes the mark from another one when it is saved
        # (catalog/changes.tier_save), so the one-default constraints are not the form's to refuse.
        return {*super()._get_validation_exclusions(), "default_for_text", "default_for_images"}

    def setting_groups(self):
        """The settings fields, grouped as the page shows them."""
        titles = {"engine": "Engine", "cpu": "vLLM CPU build", "gateway": "Gateway", "simulator": "Simulator"}
        groups = {}
        for setting, name in self.settings_fields:
            groups.setdefault(titles[setting.group], []).append(self[name])
        return groups.items()

    def clean(self):
        data = super().clean()
        raw = {}
        for setting, name in self.settings_fields:
            value = data.get(name)
            if value in (None, "") or (setting.kind is list and not value):
                continue
            raw[setting.key] = value
        self.instance.engine_kind = self.engine_kind
        try:
            EngineSettings.parse(raw, self.engine_kind)
            self.instance.engine_settings = raw
        except EngineSettingsError as exc:
            for key, message in exc.messages.items():
                self.add_error(f"setting_{key}", message)
            self.instance.engine_settings = {}  # the errors are on the fields already
        return data


def _setting_field(setting, value, engine_kind):
    """A form field for one engine setting, showing its default when left blank, and the flag
    it becomes on this tier's engine."""
    flag = setting.flag_for(engine_kind)
    engine = "SGLang" if engine_kind == SGLANG else "vLLM"
    options = {"required": False, "label": setting.label, "initial": value,
               "help_text": " ".join(part for part in (setting.help, f"{engine} flag {flag}." if flag else "")
                                     if part)}
    if setting.kind is bool:
        default = "on" if setting.default else "off"
        return forms.TypedChoiceField(choices=[("", f"default ({default})"), (True, "on"), (False, "off")],
                                      coerce=lambda v: v in (True, "True", "true"), empty_value=None, **options)
    if choices := setting.choices_for(engine_kind):
        default = f"default ({setting.default})" if setting.default else "default (the engine's own)"
        return forms.ChoiceField(choices=[("", default), *[(c, c) for c in choices]], **options)
    bounds = {"min_value": setting.minimum, "max_value": setting.maximum}
    placeholder = {"placeholder": f"{setting.default:,}" if isinstance(setting.default, int | float)
                   and not isinstance(setting.default, bool) else "engine default"}
    if setting.kind is int:
        return forms.IntegerField(widget=forms.NumberInput(attrs=placeholder), **bounds, **options)
    if setting.kind is float:
        return forms.FloatField(widget=forms.NumberInput(attrs={**placeholder, "step": "any"}), **bounds, **options)
    if setting.kind is list:
        return HostListField(**options)
    return forms.CharField(max_length=200, **options)


class HostListField(forms.CharField):
    """Host names, separated by commas or spaces."""

    def prepare_value(self, value):
        return ", ".join(value) if isinstance(value, list | tuple) else value

    def to_python(self, value):
        return [part for part in (value or "").replace(",", " ").split() if part]


class PricePlanForm(forms.ModelForm):
    """A plan and its currency (the model refuses a change of currency once it has rates)."""

    class Meta:
        from controlplane.catalog.models import PricePlan

        model = PricePlan
        fields = ["name", "currency"]
        del PricePlan


class PriceRateForm(forms.ModelForm):
    """A new rate of a plan, from a moment on: amounts not negative (the model's validators and
    the database's constraints say so too), the cached discount a percentage, never back-dated."""

    effective_from = UtcDateTimeField(label="Effective from")
    cached_image_discount = forms.DecimalField(min_value=0, max_value=100, decimal_places=1, initial=0,
                                               label="Cached image discount (%)",
                                               help_text="Share of the image price waived for cached image tokens")

    class Meta:
        from controlplane.catalog.models import PriceRate

        model = PriceRate
        fields = ["effective_from", "text_input_per_mtok", "image_per_mtok", "output_per_mtok", "per_image_fee",
                  "cached_image_discount"]
        labels = {"effective_from": "Effective from", "text_input_per_mtok": "Text input per million tokens",
                  "image_per_mtok": "Image tokens per million", "output_per_mtok": "Output per million tokens",
                  "per_image_fee": "Fee per image"}
        del PriceRate

    def clean_effective_from(self):
        when = self.cleaned_data["effective_from"]
        if when < timezone.now() - timezone.timedelta(minutes=1):
            raise forms.ValidationError("a new rate starts now or later: requests already made keep the "
                                        "price they were billed at")
        if self.instance.plan_id and type(self.instance).objects.filter(plan_id=self.instance.plan_id,
                                                                         effective_from=when).exists():
            raise forms.ValidationError("the plan has a rate from that moment already")
        return when

    def clean_cached_image_discount(self):
        return self.cleaned_data["cached_image_discount"] / Decimal(100)


class PolicyForm(forms.ModelForm):
    """A resolution policy, checked by the model (bounds and the rules between them)."""

    allowed_formats = forms.MultipleChoiceField(required=False, widget=forms.CheckboxSelectMultiple,
                                                label="Formats accepted", help_text="None ticked: every format")

    class Meta:
        from controlplane.catalog.models import ResolutionPolicy

        model = ResolutionPolicy
        fields = ["name", *ResolutionPolicy.BOUNDS]
        labels = {"max_pixels": "Pixel cap ('high' detail)", "low_detail_max_pixels": "Pixel cap ('low' detail)",
                  "min_pixels": "Smallest size (pixels)", "max_long_edge": "Longest edge (pixels)",
                  "max_aspect_ratio": "Most elongated (long : short)", "tile_long_images": "Tile long images",
                  "max_images_per_request": "Images per request", "max_total_pixels": "Pixels per request",
                  "max_input_pixels": "Largest upload (pixels, refused before decoding)",
                  "output_quality": "Re-encoding quality"}
        del ResolutionPolicy

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["allowed_formats"].choices = [(f, f) for f in SUPPORTED_FORMATS]
