"""The query parameters of the usage lists, checked before any query runs, and their pages.

A bad value is a 400 that names the parameter and says what would do, never a 500 and never
a silently ignored filter. Anything named (tenant, key, tier) must be visible to the caller;
for a tenant key that means its own tenant only, and the answer is the same whether the
thing named exists elsewhere or not.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db.models import Q, QuerySet
from django.utils.dateparse import parse_date, parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.exceptions import ValidationError

from controlplane.catalog.models import ModelTier
from controlplane.metering.models import UsageEvent
from controlplane.pagination import CheckedLimitOffsetPagination, whole_number
from controlplane.tenants import roles
from controlplane.tenants.api_auth import TenantPrincipal
from controlplane.tenants.models import ApiKey, Tenant
from controlplane.tenants.services import KEY_PREFIX


def visible_tenants(request) -> QuerySet:
    """A tenant's key sees its own tenant; staff see the tenants their role allows."""
    if isinstance(request.user, TenantPrincipal):
        return Tenant.objects.filter(pk=request.user.tenant.pk)
    return roles.visible_tenants(request.user)


@dataclass(frozen=True)
class Bound:
    """One end of a range: the moment it stands for, and the day when it was given as a date."""

    at: dt.datetime
    day: dt.date | None = None


_BAD_MOMENT = ("{value!r} is neither a date (YYYY-MM-DD) nor an ISO 8601 time such as "
               "2026-03-01T12:00:00Z (in a URL, write the + of an offset as %2B)")


@extend_schema_field(OpenApiTypes.STR)
class MomentField(serializers.CharField):
    """A date (a whole UTC day) or an ISO 8601 time; a time without an offset is UTC."""

    def to_internal_value(self, data) -> Bound:
        text = super().to_internal_value(data).strip()
        try:
            day = parse_date(text)
            if day is not None:
                return Bound(at=dt.datetime.combine(day, dt.time.min, tzinfo=dt.UTC), day=day)
            when = parse_datetime(text)
        except ValueError:  # well formed but impossible, such as a 13th month
            when = None
        if when is None:
            raise ValidationError(_BAD_MOMENT.format(value=text[:64]))
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        try:
            return Bound(at=when.astimezone(dt.UTC))
        except OverflowError:
            raise ValidationError(f"{text[:64]!r} is out of range") from None


class UsageFilters(serializers.Serializer):
    """Filters shared by every usage list. `grain` is the period the rows cover: a range must
    align with it, so the figures never silently leave out part of a period."""

    grain = "time"

    since = MomentField(required=False, help_text=(
        "Start of the range, included: a date (YYYY-MM-DD, from 00:00 UTC) or an ISO 8601 time "
        "(UTC when it has no offset)."))
    until = MomentField(required=False, help_text=(
        "End of the range: a date includes that whole UTC day; a time is excluded."))
    tier = serializers.CharField(required=False, max_length=64, help_text="Only this tier (its model name).")
    key = serializers.CharField(required=False, max_length=64, help_text=(
        "Only this API key: its prefix (the 8 characters after `vlm-`) or its id."))
    tenant = serializers.CharField(required=False, max_length=64, help_text=(
        "Only this tenant, by name (staff). A tenant's key sees its own tenant only: "
        "naming another is a 400."))

    def _visible(self) -> QuerySet:
        return visible_tenants(self.context["request"])

    def validate_since(self, bound: Bound) -> Bound:
        return self._aligned(bound)

    def validate_until(self, bound: Bound) -> Bound:
        bound = self._aligned(bound)
        if bound.day is not None:  # the whole day is included: the range ends at the next midnight
            if bound.day == dt.date.max:
                return Bound(at=dt.datetime.max.replace(tzinfo=dt.UTC), day=bound.day)
            return Bound(at=bound.at + dt.timedelta(days=1), day=bound.day)
        return bound

    def _aligned(self, bound: Bound) -> Bound:
        if self.grain == "day" and bound.day is None:
            raise ValidationError("daily totals cover whole UTC days: give a date (YYYY-MM-DD)")
        if self.grain == "hour" and (bound.at.minute, bound.at.second, bound.at.microsecond) != (0, 0, 0):
            raise ValidationError(
                "hourly totals cover whole UTC hours: give a date or a time on the hour "
                "(such as 2026-03-01T12:00:00Z)")
        return bound

    def validate_tier(self, name: str) -> ModelTier:
        tier = ModelTier.objects.filter(name=name).first()
        if tier is None:
            raise ValidationError(f"no tier named {name!r}")
        return tier

    def validate_key(self, value: str) -> ApiKey:
        prefix = value.removeprefix(KEY_PREFIX)
        keys = ApiKey.objects.filter(tenant__in=self._visible())
        match = Q(prefix=prefix)
        if whole_number(prefix) is not None:  # a prefix may be all digits too: a prefix match comes first
            match |= Q(pk=whole_number(prefix))
        found = sorted(keys.filter(match), key=lambda k: k.prefix != prefix)
        if not found:
            raise ValidationError("no API key with this prefix or id is visible to you")
        return found[0]

    def validate_tenant(self, name: str) -> Tenant:
        tenant = self._visible().filter(name=name).first()
        if tenant is None:
            raise ValidationError(f"no tenant named {name!r} is visible to you")
        return tenant

    def validate(self, data):
        since, until = data.get("since"), data.get("until")
        if since and until and since.at >= until.at:
            raise ValidationError({"until": "must be later than since"})
        return data

    def apply(self, queryset: QuerySet, *, period: str) -> QuerySet:
        """The rows of the caller's tenants that pass the filters; `period` is the field that
        dates a row (its time, or the start of its hour or day)."""
        data = self.validated_data
        queryset = queryset.filter(tenant__in=self._visible())
        if "since" in data:
            queryset = queryset.filter(**{f"{period}__gte": data["since"].day if self.grain == "day"
                                          else data["since"].at})
        if "until" in data:
            if self.grain == "day":
                queryset = queryset.filter(**{f"{period}__lte": data["until"].day})
            else:
                queryset = queryset.filter(**{f"{period}__lt": data["until"].at})
        for name, field in (("tier", "tier"), ("key", "api_key"), ("tenant", "tenant")):
            if name in data:
                queryset = queryset.filter(**{field: data[name]})
        return queryset


class HourlyFilters(UsageFilters):
    grain = "hour"

    since = MomentField(required=False, help_text=(
        "First hour included: a date (from 00:00 UTC) or an ISO 8601 time on the hour."))
    until = MomentField(required=False, help_text=(
        "End of the range: a date includes that whole UTC day; a time on the hour is excluded."))


class DailyFilters(UsageFilters):
    grain = "day"

    since = MomentField(required=False, help_text="First UTC day included (YYYY-MM-DD).")
    until = MomentField(required=False, help_text="Last UTC day included (YYYY-MM-DD).")


class RequestFilters(UsageFilters):
    request_id = serializers.CharField(required=False, max_length=64, help_text=(
        "The request with this id (the `x-request-id` header of the gateway's response)."))
    status = serializers.ChoiceField(
        choices=UsageEvent.Status.choices, required=False,
        help_text="Only requests that ended so.",
        error_messages={"invalid_choice": "{input!r} is not a status: use one of "
                                          + ", ".join(UsageEvent.Status.values)})

    def apply(self, queryset: QuerySet, *, period: str) -> QuerySet:
        queryset = super().apply(queryset, period=period)
        for name in ("request_id", "status"):
            if name in self.validated_data:
                queryset = queryset.filter(**{name: self.validated_data[name]})
        return queryset


class UsagePagination(CheckedLimitOffsetPagination):
    """Every usage list is in a total order, so walking the pages of an unchanging range shows
    each row exactly once."""
