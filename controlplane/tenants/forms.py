"""The forms of the tenants pages: logging in, tenants and their quota, API keys (an
operator's and a tenant admin's own), users and their roles, routing rules and their dry run."""

from __future__ import annotations

from decimal import Decimal

from django import forms
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError
from django.core.validators import MaxLengthValidator
from django.utils import timezone

from controlplane.catalog.models import ModelTier
from controlplane.currencies import CURRENCIES
from controlplane.tenants import roles
from controlplane.tenants.models import (
    ApiKey,
    Quota,
    QuotaDefault,
    QuotaLimits,
    RoutingRule,
    Tenant,
)
from controlplane.tenants.users import TENANT_ADMIN, Role
from controlplane.web.fields import UtcDateTimeField

INVALID_LOGIN = "Your username and password didn't match. Please try again."
TENANT_DEACTIVATED = "{tenant} is deactivated: its admins cannot log in until an operator reactivates it."


class LoginForm(AuthenticationForm):
    """Django's login form, refusing a username no user can have before it is looked up
    (Django sets the field's max_length without its validator, and a failed login of a name
    past 255 characters was a 500 where django-axes records it), and the admin of a
    deactivated tenant, saying why."""

    error_messages = {**AuthenticationForm.error_messages, "invalid_login": INVALID_LOGIN}

    def __init__(self, request=None, *args, **kwargs):
        super().__init__(request, *args, **kwargs)
        self.fields["username"].validators.append(MaxLengthValidator(self.fields["username"].max_length))

    def clean(self):
        if self.has_error("username"):
            raise self.get_invalid_login_error()
        return super().clean()

    def confirm_login_allowed(self, user):
        super().confirm_login_allowed(user)
        tenant = roles.deactivated_tenant(user)
        if tenant is not None:
            raise ValidationError(TENANT_DEACTIVATED.format(tenant=tenant.name), code="tenant_deactivated")


class ApiKeyForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.filter(active=True))
    name = forms.CharField(max_length=64, required=False)
    expires_at = UtcDateTimeField(required=False, help_text="Optional, UTC")
    tiers = forms.ModelMultipleChoiceField(queryset=None, required=False, widget=forms.CheckboxSelectMultiple,
                                           label="Models it may use",
                                           help_text="None ticked: every model its tenant may use")
    requests_per_minute = forms.IntegerField(min_value=1, max_value=10**6, required=False,
                                             label="Requests per minute", help_text="Optional: this key's own limit")
    spend_limit = forms.DecimalField(min_value=Decimal("0.01"), max_value=10**9, decimal_places=2, required=False,
                                     label="Budget", help_text="Optional: what it may spend each quota period, in "
                                                               "its tenant's budget currency")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["tiers"].queryset = ModelTier.objects.order_by("name")


class OwnKeyForm(forms.Form):
    name = forms.CharField(max_length=64, required=False, help_text="What it is for, e.g. the app that uses it")
    tiers = forms.ModelMultipleChoiceField(queryset=None, required=False, widget=forms.CheckboxSelectMultiple,
                                           label="Models it may use", help_text="None ticked: every model of yours")
    expires_at = UtcDateTimeField(required=False, label="Expires", help_text="Optional, e.g. 2027-06-30 00:00")
    requests_per_minute = forms.IntegerField(min_value=1, max_value=10**6, required=False,
                                             label="Requests per minute", help_text="Optional: this key's own limit")
    spend_limit = forms.DecimalField(min_value=Decimal("0.01"), max_value=10**9, decimal_places=2, required=False,
                                     label="Budget", help_text="Optional: what it may spend each quota period, in "
                                                               "its tenant's budget currency")

    def __init__(self, *args, tenant, capture: bool = False, **kwargs):
        """`capture`: the reader is an operator, who may have the key's bodies captured."""
        super().__init__(*args, **kwargs)
        if capture:
            self.fields["capture_bodies"] = forms.BooleanField(
                required=False, label="Capture request and response bodies (debugging)",
                help_text="Kept for CAPTURE_RETENTION_HOURS, images as thumbnails, seen by operators only")
        allowed = tenant.allowed_tiers.all()
        self.fields["tiers"].queryset = (allowed if allowed.exists() else ModelTier.objects.filter(enabled=True)
                                         ).order_by("name")

    def clean_expires_at(self):
        when = self.cleaned_data["expires_at"]
        if when is not None and when <= timezone.now():
            raise forms.ValidationError("that moment has passed")
        return when


QUOTA_LIMITS = QuotaLimits.LIMITS
QUOTA_SETTINGS = QuotaLimits.SETTINGS


class BudgetFields(forms.Form):
    """A quota's money budget: its amount, currency, and whether it refuses once spent."""

    spend_limit = forms.DecimalField(min_value=Decimal("0.01"), max_value=10**9, decimal_places=2, required=False,
                                     label="Budget")
    spend_currency = forms.TypedChoiceField(choices=[(c, c) for c in CURRENCIES], initial="USD", required=False,
                                            empty_value="USD", label="Budget currency")
    spend_hard = forms.TypedChoiceField(
        widget=forms.RadioSelect, coerce=lambda value: value != "soft", initial="hard", required=False,
        empty_value=True, label="Once spent",
        choices=[("hard", "Refuse requests (429 budget_exceeded)"), ("soft", "Serve on; alerts only")])


class TenantForm(BudgetFields, forms.ModelForm):
    """A tenant with the tiers it may use and its quota, each an explicit choice: a new tenant
    starts from the operator's default quota, and "every tier" or "unlimited" is chosen on
    purpose, never by leaving something empty."""

    tier_access = forms.ChoiceField(widget=forms.RadioSelect, label="Tiers it may use", choices=[
        ("every", "Every enabled tier, present and future"), ("chosen", "Only the tiers chosen here")])
    tiers = forms.ModelMultipleChoiceField(queryset=None, required=False, widget=forms.CheckboxSelectMultiple,
                                           label="Chosen tiers")
    quota_mode = forms.ChoiceField(widget=forms.RadioSelect, label="Quota", choices=[
        ("limits", "These limits"), ("unlimited", "Unlimited: no quota at all")])
    period = forms.ChoiceField(choices=[("day", "per day"), ("month", "per month")], label="Period")
    image_tokens = forms.IntegerField(min_value=1, max_value=10**15, required=False, label="Image tokens")
    total_tokens = forms.IntegerField(min_value=1, max_value=10**15, required=False, label="Total tokens")
    requests_per_minute = forms.IntegerField(min_value=1, max_value=10**7, required=False,
                                             label="Requests per minute")
    concurrent_large_images = forms.IntegerField(min_value=1, max_value=10**5, required=False,
                                                 label="Large-image requests at once")

    class Meta:
        from controlplane.tenants.models import Tenant

        model = Tenant
        fields = ["name", "display_name", "active", "isolate_prefix_cache", "default_text_tier",
                  "default_image_tier", "capture_bodies"]
        labels = {"isolate_prefix_cache": "Own prefix cache (never shares KV blocks with other tenants)",
                  "default_text_tier": "`auto` for text", "default_image_tier": "`auto` for images",
                  "capture_bodies": "Capture request and response bodies (debugging)"}
        del Tenant

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        tiers = ModelTier.objects.order_by("name")
        self.fields["tiers"].queryset = tiers
        self.fields["default_text_tier"].queryset = tiers
        self.fields["default_image_tier"].queryset = tiers.filter(kind=ModelTier.Kind.VISION)
        for name in ("default_text_tier", "default_image_tier"):
            self.fields[name].empty_label = "the tier marked as the default"
        creating = self.instance.pk is None
        quota = None if creating else Quota.objects.filter(tenant=self.instance).first()
        start = QuotaDefault.current() if creating else quota
        if not creating:
            chosen = list(self.instance.allowed_tiers.all())
            self.initial.update(tier_access="chosen" if chosen else "every", tiers=chosen)
            unlimited = quota is None or quota.unlimited
            self.initial["quota_mode"] = "unlimited" if unlimited else "limits"
        elif not start.unlimited:
            self.initial["quota_mode"] = "limits"  # the operator's default quota, filled in below
        if start is not None:
            self.initial.update({name: getattr(start, name) for name in QUOTA_SETTINGS})
            self.initial["spend_hard"] = "hard" if start.spend_hard else "soft"

    def clean(self):
        data = super().clean()
        if data.get("tier_access") == "chosen" and not data.get("tiers"):
            self.add_error("tiers", "choose at least one tier, or let it use every tier")
        if data.get("quota_mode") == "limits" and all(data.get(name) is None for name in QUOTA_LIMITS):
            self.add_error("quota_mode", "set at least one limit, or choose unlimited")
        usable = set(data.get("tiers") or []) if data.get("tier_access") == "chosen" else None
        for name in ("default_text_tier", "default_image_tier"):
            tier = data.get(name)
            if tier is not None and usable is not None and tier not in usable:
                self.add_error(name, f"{tier.name} is not among the tiers it may use")
        return data

    def chosen_tiers(self) -> list | None:
        """The tiers it may use; None: every tier."""
        return list(self.cleaned_data["tiers"]) if self.cleaned_data["tier_access"] == "chosen" else None

    def quota(self) -> dict | None:
        """Its quota; None: unlimited."""
        if self.cleaned_data["quota_mode"] == "unlimited":
            return None
        return {name: self.cleaned_data.get(name) for name in QUOTA_SETTINGS}


class QuotaDefaultForm(BudgetFields, forms.ModelForm):
    class Meta:
        from controlplane.tenants.models import QuotaDefault

        model = QuotaDefault
        fields = list(QUOTA_SETTINGS)
        labels = {"image_tokens": "Image tokens", "total_tokens": "Total tokens",
                  "requests_per_minute": "Requests per minute",
                  "concurrent_large_images": "Large-image requests at once"}
        del QuotaDefault

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.initial["spend_hard"] = "hard" if self.instance.spend_hard else "soft"


class RoleField(forms.ChoiceField):
    """operator, finance, or tenant:<id> (the admin of that tenant)."""

    def __init__(self, **kwargs):
        super().__init__(choices=self._choices, **kwargs)

    @staticmethod
    def _choices():
        return [("", "choose a role"), ("operator", "Operator: everything"),
                ("finance", "Finance: usage, statements, exports, read only"),
                *[(f"tenant:{t.pk}", f"Tenant admin of {t.name}") for t in Tenant.objects.filter(active=True)]]

    def clean(self, value):
        value = super().clean(value)
        if value.startswith("tenant:"):
            return Role(TENANT_ADMIN, Tenant.objects.get(pk=int(value.split(":", 1)[1])))
        return Role(value)


def role_value(role) -> str:
    if role is None:
        return ""
    return f"tenant:{role.tenant.pk}" if role.tenant is not None else role.name


class UserInviteForm(forms.Form):
    username = forms.RegexField(regex=r"^[\w.@+-]+\Z", max_length=150,
                                error_messages={"invalid": "letters, digits and @ . + - _ only"})
    email = forms.EmailField(required=False)
    role = RoleField()

    def clean_username(self):
        name = self.cleaned_data["username"]
        if get_user_model().objects.filter(username__iexact=name).exists():
            raise forms.ValidationError("a user with that name exists")
        return name


class UserChangeForm(forms.Form):
    role = RoleField()
    active = forms.BooleanField(required=False, label="Active (may log in)")


class RoutingRuleForm(forms.ModelForm):
    """A routing rule, checked by the model (its ranges, caps within its tiers' policies, a
    cascade's threshold, the tiers its tenant or key may use). Its scope is the instance's,
    set by the page before the form is bound."""

    CONDITIONS = ("tasks", "min_images", "max_images", "min_source_pixels", "max_source_pixels", "min_image_tokens",
                  "max_image_tokens", "min_prompt_tokens", "max_prompt_tokens", "min_max_tokens", "max_max_tokens",
                  "detail", "tools")
    ACTION = ("tier", "send_detail", "pixel_cap")
    CASCADE = ("escalate_to", "escalate_detail", "escalate_pixel_cap", "confidence", "threshold",
               "escalate_on_length", "escalate_on_refusal", "cascade_streams")

    class Meta:
        model = RoutingRule
        fields = ["position", "name", "enabled", "tasks", "min_images", "max_images", "min_source_pixels",
                  "max_source_pixels", "min_image_tokens", "max_image_tokens", "min_prompt_tokens",
                  "max_prompt_tokens", "min_max_tokens", "max_max_tokens", "detail", "tools", "tier", "send_detail",
                  "pixel_cap", "escalate_to", "escalate_detail", "escalate_pixel_cap", "confidence", "threshold",
                  "escalate_on_length", "escalate_on_refusal", "cascade_streams"]
        labels = {"enabled": "Enabled (read by the gateway)", "tasks": "Tasks",
                  "min_images": "Images, at least", "max_images": "Images, at most",
                  "min_source_pixels": "Largest image's pixels, at least", "max_source_pixels": "Largest image's pixels, at most",
                  "min_image_tokens": "Image tokens, at least", "max_image_tokens": "Image tokens, at most",
                  "min_prompt_tokens": "Prompt tokens, at least", "max_prompt_tokens": "Prompt tokens, at most",
                  "min_max_tokens": "max_tokens asked, at least", "max_max_tokens": "max_tokens asked, at most",
                  "detail": "Detail asked", "tools": "Tools", "tier": "Send to", "send_detail": "At detail",
                  "pixel_cap": "Pixel cap", "escalate_to": "Escalate to", "escalate_detail": "At detail",
                  "escalate_pixel_cap": "Pixel cap", "confidence": "Confidence read",
                  "threshold": "Escalate below", "escalate_on_length": "Escalate an answer cut short",
                  "escalate_on_refusal": "Escalate a refusal", "cascade_streams": "Cascade streamed requests"}

    def __init__(self, *args, tiers, **kwargs):
        """`tiers`: those the reader may name (an operator, every tier: one the rule's tenant or
        key may not use is refused by the model, saying so)."""
        super().__init__(*args, **kwargs)
        for name in ("tier", "escalate_to"):
            self.fields[name].queryset = tiers
        self.fields["escalate_to"].empty_label = "no cascade"
        for name in ("detail", "tools", "send_detail", "escalate_detail"):
            self.fields[name].choices = [("", "any" if name in ("detail", "tools") else "as asked"),
                                         *self.fields[name].choices[1:]]

    def sections(self) -> list[tuple[str, list]]:
        return [("Rule", [self[name] for name in ("position", "name", "enabled")]),
                ("When every condition holds", [self[name] for name in self.CONDITIONS]),
                ("Send it", [self[name] for name in self.ACTION]),
                ("Cascade", [self[name] for name in self.CASCADE])]


class KeyChoiceField(forms.ModelChoiceField):
    def label_from_instance(self, obj):
        return f"{obj.name or 'unnamed'} vlm-{obj.prefix}-… ({obj.tenant.name})"


EXAMPLE_BODY = """{
  "model": "auto",
  "metadata": {"task": "receipt"},
  "max_tokens": 300,
  "messages": [{"role": "user", "content": "What is the total?"}]
}"""


class RuleDryRunForm(forms.Form):
    """A request to try the rules on, as a key (or its tenant) would send it. `tenant`: the
    page's tenant, whose keys are offered; None: any key or any tenant (an operator's)."""

    key = KeyChoiceField(queryset=ApiKey.objects.none(), required=False, label="As key")
    body = forms.CharField(widget=forms.Textarea(attrs={"rows": 10, "spellcheck": "false"}), initial=EXAMPLE_BODY,
                           label="Request body (JSON)", help_text="`model` left out is `auto`")
    task = forms.CharField(max_length=200, required=False, label="X-Task header",
                           help_text="Optional: the task, when the body's metadata names none")
    image = forms.FileField(required=False, label="Image", help_text=(
        "Optional: added to the last user message as a data URL, as a client would send it"))

    def __init__(self, *args, tenant: Tenant | None, **kwargs):
        super().__init__(*args, **kwargs)
        keys = ApiKey.objects.filter(revoked_at=None).select_related("tenant").order_by("tenant__name", "name", "pk")
        if tenant is not None:
            self.fields["key"].queryset = keys.filter(tenant=tenant)
            self.fields["key"].empty_label = f"none: {tenant.name}'s rules, then the defaults"
        else:
            self.fields["key"].queryset = keys
            self.fields["key"].empty_label = "none: the tenant's rules, then the defaults"
            self.fields["tenant"] = forms.ModelChoiceField(
                queryset=Tenant.objects.order_by("name"), required=False, label="Or as tenant",
                help_text="Its rules and the defaults, for a key of its with none of its own")
            self.order_fields(["key", "tenant"])
        self.tenant = tenant

    def clean_image(self):
        image = self.cleaned_data["image"]
        if image is not None and image.size > settings.GATEWAY_MAX_BODY_BYTES:
            raise forms.ValidationError(f"larger than a request may be ({settings.GATEWAY_MAX_BODY_BYTES:,} bytes)")
        return image

    def clean(self):
        data = super().clean()
        key = data.get("key")
        if key is not None:
            data["tenant"] = key.tenant
        elif self.tenant is not None:
            data["tenant"] = self.tenant
        elif not data.get("tenant") and not self.has_error("tenant") and not self.has_error("key"):
            self.add_error("key", "choose a key or a tenant")
        return data
