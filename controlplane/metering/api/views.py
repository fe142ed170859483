"""Usage lists: each request, and the hourly, daily and per-tier totals from the rollups.

Every list takes the filters of its `filters` class, pages with UsagePagination, and is in a
total order (the last field is unique) so pages never repeat or skip a row.
"""

from django.db.models import QuerySet, Sum
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import generics

from controlplane.metering.api.filters import (
    DailyFilters,
    HourlyFilters,
    RequestFilters,
    UsageFilters,
    UsagePagination,
)
from controlplane.metering.api.serializers import (
    DailyUsageSerializer,
    HourlyUsageSerializer,
    TierUsageSerializer,
    UsageEventSerializer,
)
from controlplane.metering.models import TOTALS, DailyUsage, HourlyUsage, UsageEvent

BAD_FILTER = OpenApiResponse(
    response=OpenApiTypes.OBJECT,
    description="A filter or page parameter is not acceptable: each one named, with what is wrong.",
    examples=[OpenApiExample("a bad date", value={"since": [
        "'yesterday' is neither a date (YYYY-MM-DD) nor an ISO 8601 time such as 2026-03-01T12:00:00Z "
        "(in a URL, write the + of an offset as %2B)"]})],
)


def _documented(filters, serializer):
    return extend_schema_view(get=extend_schema(parameters=[filters],
                                                responses={200: serializer(many=True), 400: BAD_FILTER}))


class _UsageList(generics.ListAPIView):
    pagination_class = UsagePagination
    filters = UsageFilters
    period = ""  # the field that dates a row

    def rows(self) -> QuerySet:
        raise NotImplementedError

    def get_queryset(self):
        filters = self.filters(data=self.request.query_params, context={"request": self.request})
        filters.is_valid(raise_exception=True)
        return filters.apply(self.rows(), period=self.period)


@_documented(RequestFilters, UsageEventSerializer)
class UsageRequestList(_UsageList):
    """The requests made with this tenant's keys, newest first, each with its metered usage
    and its images. To walk a range that is still receiving requests, give `until`."""

    serializer_class = UsageEventSerializer
    filters = RequestFilters
    period = "created_at"

    def rows(self):
        return (UsageEvent.objects.select_related("tenant", "api_key", "tier__price_plan").prefetch_related("images")
                .order_by("-created_at", "-id"))


@_documented(HourlyFilters, HourlyUsageSerializer)
class HourlyUsageList(_UsageList):
    """Totals per UTC hour, key and tier, from the hourly rollups, newest hour first."""

    serializer_class = HourlyUsageSerializer
    filters = HourlyFilters
    period = "hour"

    def rows(self):
        return (HourlyUsage.objects.select_related("tenant", "api_key", "tier")
                .order_by("-hour", "tenant__name", "tier__name", "api_key__prefix", "id"))


@_documented(DailyFilters, DailyUsageSerializer)
class DailyUsageList(_UsageList):
    """Totals per UTC day, key and tier, from the daily rollups, newest day first."""

    serializer_class = DailyUsageSerializer
    filters = DailyFilters
    period = "day"

    def rows(self):
        return (DailyUsage.objects.select_related("tenant", "api_key", "tier")
                .order_by("-day", "tenant__name", "tier__name", "api_key__prefix", "id"))


@_documented(HourlyFilters, TierUsageSerializer)
class TierUsageList(_UsageList):
    """Totals per tier over the range (all time unless `since`/`until` say otherwise), summed
    from the hourly rollups, by tier name."""

    serializer_class = TierUsageSerializer
    filters = HourlyFilters
    period = "hour"

    def rows(self):
        return HourlyUsage.objects.all()

    def get_queryset(self):
        # Tier names are unique, so one row per name is a total order.
        return (super().get_queryset().values("tier__name").order_by("tier__name")
                .annotate(**{f"sum_{name}": Sum(name) for name in TOTALS}))
