from django.db.models import QuerySet
from rest_framework import generics

from controlplane.metering.api.serializers import DailyUsageSerializer, UsageEventSerializer
from controlplane.metering.models import DailyUsage, UsageEvent
from controlplane.tenants import roles
from controlplane.tenants.api_auth import TenantPrincipal


def _tenant_scope(request, queryset: QuerySet) -> QuerySet:
    """A tenant's key sees its own tenant; staff see the tenants their role allows."""
    if isinstance(request.user, TenantPrincipal):
        return queryset.filter(tenant=request.user.tenant)
    queryset = queryset.filter(tenant__in=roles.visible_tenants(request.user))
    if name := request.query_params.get("tenant"):
        queryset = queryset.filter(tenant__name=name)
    return queryset


class UsageRequestList(generics.ListAPIView):
    """The requests made with this tenant's keys, newest first, with their metered usage."""

    serializer_class = UsageEventSerializer

    def get_queryset(self):
        queryset = UsageEvent.objects.select_related("tier").prefetch_related("images")
        queryset = _tenant_scope(self.request, queryset)
        if request_id := self.request.query_params.get("request_id"):
            queryset = queryset.filter(request_id=request_id)
        return queryset.order_by("-created_at", "-id")


class DailyUsageList(generics.ListAPIView):
    """Daily totals per tier, from the rollups."""

    serializer_class = DailyUsageSerializer

    def get_queryset(self):
        queryset = _tenant_scope(self.request, DailyUsage.objects.select_related("tier", "api_key"))
        return queryset.order_by("-day", "tier__name")
