"""Routing rules pages: the rules of `auto` in the order the gateway reads them, each created,
edited, enabled or disabled and deleted with the change recorded, and a dry run of a request
against them. Operators manage the default rules and every tenant's; a tenant admin, their own
tenant's and its keys' (at account/rules/, as their keys are at account/keys/)."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Max, Q
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from controlplane.audit.services import history
from controlplane.catalog.models import ModelTier
from controlplane.tenants import roles
from controlplane.tenants.forms import RoutingRuleForm, RuleDryRunForm
from controlplane.tenants.models import ApiKey, RoutingRule, Tenant
from controlplane.tenants.services import routing_rule_delete, routing_rule_save
from controlplane.tenants.views.rule_dry_run import BodyInvalid, dry_run, request_body
from controlplane.web.access import operators_only


@dataclass(frozen=True)
class Place:
    """The reader's rules pages: the operator's (every scope) or a tenant admin's (their own)."""

    operator: bool

    def list_url(self, tenant: Tenant | None, key: ApiKey | None = None) -> str:
        if tenant is None:
            return reverse("dashboard:rules")
        url = reverse("dashboard:tenant-rules", args=[tenant.name]) if self.operator \
            else reverse("dashboard:account-rules")
        return f"{url}?key={key.prefix}" if key is not None else url

    def new_url(self, tenant: Tenant | None, key: ApiKey | None = None) -> str:
        if tenant is None:
            return reverse("dashboard:rule-new")
        url = reverse("dashboard:tenant-rule-new", args=[tenant.name]) if self.operator \
            else reverse("dashboard:account-rule-new")
        return f"{url}?key={key.prefix}" if key is not None else url

    def rule_url(self, rule: RoutingRule, action: str = "edit") -> str:
        return reverse(f"dashboard:{'' if self.operator else 'account-'}rule-{action}", args=[rule.pk])

    def back(self, rule: RoutingRule) -> str:
        return self.list_url(rule.tenant if rule.tenant_id or rule.api_key_id else None,
                             rule.api_key if rule.api_key_id else None)


OPERATOR, TENANT_ADMIN = Place(operator=True), Place(operator=False)


def _admin_tenant(request) -> Tenant:
    tenant = roles.member_tenant(request.user)
    if tenant is None:
        raise PermissionDenied
    return tenant


RANGES = (("images", "images"), ("source_pixels", "largest image's pixels"), ("image_tokens", "image tokens"),
          ("prompt_tokens", "prompt tokens"), ("max_tokens", "max_tokens"))


def _rows(rules, place: Place) -> list[RoutingRule]:
    """`rules` as the pages list them, each with its links and its conditions in words."""
    rows = list(rules.select_related("tier", "escalate_to", "api_key", "tenant"))
    for rule in rows:
        rule.edit_url, rule.toggle_url = place.rule_url(rule), place.rule_url(rule, "toggle")
        rule.when = _conditions(rule)
    return rows


def _conditions(rule: RoutingRule) -> list[str]:
    found = []
    if rule.tasks:
        found.append("task " + " or ".join(rule.tasks.split(",")))
    for name, words in RANGES:
        least, most = getattr(rule, f"min_{name}"), getattr(rule, f"max_{name}")
        if least is not None and most is not None:
            found.append(f"{words} {least:,} to {most:,}")
        elif least is not None:
            found.append(f"{words} at least {least:,}")
        elif most is not None:
            found.append(f"{words} at most {most:,}")
    if rule.detail:
        found.append(f"detail {rule.detail} asked")
    if rule.tools:
        found.append(rule.get_tools_display())
    return found


def _defaults():
    return RoutingRule.objects.filter(tenant=None, api_key=None).order_by("position", "pk")


def _of_tenant(tenant: Tenant):
    """A tenant's rules and its keys'."""
    return RoutingRule.objects.filter(Q(tenant=tenant) | Q(api_key__tenant=tenant))


# -- the lists, each with a dry run -------------------------------------------------------------

@login_required
def rules(request):
    """The default rules, and the tenants with rules of their own."""
    operators_only(request)
    tenants = Tenant.objects.annotate(rule_count=Count("routing_rules")).filter(rule_count__gt=0).order_by("name")
    return _list(request, tenant=None, place=OPERATOR, groups=[("Default rules", _rows(_defaults(), OPERATOR))],
                 extra={"tenants": tenants})


@login_required
def tenant_rules(request, name: str):
    operators_only(request)
    return _tenant_list(request, get_object_or_404(Tenant, name=name), OPERATOR)


@login_required
def account_rules(request):
    return _tenant_list(request, _admin_tenant(request), TENANT_ADMIN)


def _tenant_list(request, tenant: Tenant, place: Place):
    """A tenant's rules and its keys', or (`?key=<prefix>`) the rules one key's requests read,
    in the order they are read."""
    prefix = request.GET.get("key") or ""
    key = get_object_or_404(ApiKey, tenant=tenant, prefix=prefix) if prefix else None
    rows = _rows(_of_tenant(tenant) if key is None else _of_tenant(tenant).filter(Q(api_key=key) | Q(api_key=None)),
                 place)
    keys, own = {}, []
    for rule in rows:
        if rule.api_key_id:
            keys.setdefault(rule.api_key_id, (rule.api_key, []))[1].append(rule)
        else:
            own.append(rule)
    tenant_group = (f"Tenant {tenant.name}'s rules", own)
    key_groups = [(f"Key {k.name or 'unnamed'} vlm-{k.prefix}-…'s rules", found) for k, found in
                  sorted(keys.values(), key=lambda item: (item[0].name, item[0].pk))]
    if key is not None:  # read first, then its tenant's
        groups = [(f"Key {key.name or 'unnamed'} vlm-{key.prefix}-…'s rules", keys.get(key.pk, (key, []))[1]),
                  tenant_group]
    else:
        groups = [tenant_group, *key_groups]
    return _list(request, tenant=tenant, place=place, groups=groups, key=key,
                 extra={"defaults": _rows(_defaults(), place) if place.operator else None,
                        "keys": list(ApiKey.objects.filter(tenant=tenant, revoked_at=None).order_by("name", "pk"))})


def _list(request, *, tenant: Tenant | None, place: Place, groups: list, key: ApiKey | None = None,
          extra: dict | None = None):
    form = RuleDryRunForm(request.POST or None, request.FILES or None, tenant=tenant,
                          initial={"key": key} if key is not None else None)
    outcome = None
    if request.method == "POST" and form.is_valid():
        upload = form.cleaned_data["image"]
        try:
            body = request_body(form.cleaned_data["body"], image=upload.read() if upload else None,
                                image_type=(upload.content_type or "") if upload else "")
        except BodyInvalid as exc:
            form.add_error("body", str(exc))
        else:
            outcome = dry_run(body, task=form.cleaned_data["task"], api_key=form.cleaned_data["key"],
                              tenant=form.cleaned_data["tenant"])
    return render(request, "tenants/rules.html", {
        "tenant": tenant, "key": key, "place": place, "groups": groups, "form": form, "outcome": outcome,
        "new_url": place.new_url(tenant, key), "list_url": place.list_url(tenant),
        "max_image_mb": settings.GATEWAY_MAX_BODY_BYTES >> 20, **(extra or {})})


# -- one rule ----------------------------------------------------------------------------------

@login_required
def rule_new(request):
    operators_only(request)
    return _rule_form(request, RoutingRule(), OPERATOR)


@login_required
def tenant_rule_new(request, name: str):
    operators_only(request)
    return _rule_form(request, _new_rule(request, get_object_or_404(Tenant, name=name)), OPERATOR)


@login_required
def account_rule_new(request):
    return _rule_form(request, _new_rule(request, _admin_tenant(request)), TENANT_ADMIN)


def _new_rule(request, tenant: Tenant) -> RoutingRule:
    """A new rule of `tenant`, or of its key `?key=<prefix>`."""
    prefix = request.GET.get("key") or ""
    if prefix:
        key = get_object_or_404(ApiKey, tenant=tenant, prefix=prefix, revoked_at=None)
        return RoutingRule(tenant=tenant, api_key=key)
    return RoutingRule(tenant=tenant)


@login_required
def rule_edit(request, pk: int):
    operators_only(request)
    return _rule_form(request, _rule(pk), OPERATOR)


@login_required
def account_rule_edit(request, pk: int):
    return _rule_form(request, _rule(pk, tenant=_admin_tenant(request)), TENANT_ADMIN)


def _rule(pk: int, *, tenant: Tenant | None = None) -> RoutingRule:
    """The rule `pk`; with `tenant`, only one of its or its keys' (another's, or a default
    rule, is not found)."""
    found = RoutingRule.objects.select_related("tenant", "api_key__tenant", "tier", "escalate_to")
    if tenant is not None:
        found = found.filter(Q(tenant=tenant) | Q(api_key__tenant=tenant))
    return get_object_or_404(found, pk=pk)


def _tiers(place: Place, tenant: Tenant | None):
    """The tiers a rule's form offers: every tier to an operator; a tenant admin, their own."""
    if place.operator or tenant is None:
        return ModelTier.objects.order_by("name")
    allowed = tenant.allowed_tiers.all()
    return (allowed if allowed.exists() else ModelTier.objects.filter(enabled=True)).order_by("name")


def _rule_form(request, rule: RoutingRule, place: Place):
    creating = rule.pk is None
    if creating and request.method != "POST":
        last = RoutingRule.objects.filter(tenant=rule.tenant, api_key=rule.api_key).aggregate(Max("position"))
        rule.position = (last["position__max"] or 0) + 1  # read after the scope's others
    scope, back = rule.scope, place.back(rule)
    form = RoutingRuleForm(request.POST or None, instance=rule, tiers=_tiers(place, rule.tenant))
    if request.method == "POST" and form.is_valid():
        rule = routing_rule_save(rule=form.save(commit=False), actor=request.user.get_username())
        messages.success(request, f"{str(rule).capitalize()} of {scope} {'created' if creating else 'saved'}: "
                                  "the gateway reads it within seconds.")
        return redirect(back)
    return render(request, "tenants/rule_form.html", {
        "form": form, "rule": rule, "scope": scope, "creating": creating, "back": back,
        "delete_url": None if creating else place.rule_url(rule, "delete"),
        "history": [] if creating else history(rule)[:20]})


@login_required
@require_POST
def rule_toggle(request, pk: int):
    operators_only(request)
    return _toggled(request, _rule(pk), OPERATOR)


@login_required
@require_POST
def account_rule_toggle(request, pk: int):
    return _toggled(request, _rule(pk, tenant=_admin_tenant(request)), TENANT_ADMIN)


def _toggled(request, rule: RoutingRule, place: Place):
    rule.enabled = not rule.enabled
    routing_rule_save(rule=rule, actor=request.user.get_username())
    messages.success(request, f"{str(rule).capitalize()} of {rule.scope} "
                              f"{'enabled' if rule.enabled else 'disabled'}.")
    return redirect(place.back(rule))


@login_required
@require_POST
def rule_delete(request, pk: int):
    operators_only(request)
    return _deleted(request, _rule(pk), OPERATOR)


@login_required
@require_POST
def account_rule_delete(request, pk: int):
    return _deleted(request, _rule(pk, tenant=_admin_tenant(request)), TENANT_ADMIN)


def _deleted(request, rule: RoutingRule, place: Place):
    back, what = place.back(rule), f"{str(rule).capitalize()} of {rule.scope}"
    routing_rule_delete(rule=rule, actor=request.user.get_username())
    messages.success(request, f"{what} deleted.")
    return redirect(back)
