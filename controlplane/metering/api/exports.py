"""Finance exports over the API, for staff with the finance or operator role (session auth).
A tenant's API key is refused: exports span every tenant."""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.permissions import BasePermission, IsAuthenticated
from rest_framework.views import APIView

from controlplane.metering.exports import (
    CONTENT_TYPES,
    IMAGES,
    MONTHLY_SUMMARY,
    ExportError,
    export_for,
    export_response,
)
from controlplane.tenants import roles


class FinanceOrOperator(BasePermission):
    message = "exports are for finance and operator staff; a tenant API key cannot export"

    def has_permission(self, request, view):
        return roles.is_operator(request.user) or roles.is_finance(request.user)


class AnyAccept(BaseContentNegotiation):
    """The file type is in the path, so an `Accept: text/csv` is never refused; errors are JSON."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


_FILETYPE = OpenApiParameter("filetype", OpenApiTypes.STR, OpenApiParameter.PATH, enum=sorted(CONTENT_TYPES),
                             description="csv (streamed) or xlsx (numbers as numbers, times as datetimes)")
_TENANT = OpenApiParameter("tenant", OpenApiTypes.STR, description="one tenant's name; every tenant when absent")
_TIER = OpenApiParameter("tier", OpenApiTypes.STR, description="one tier's name; every tier when absent")
_KEY = OpenApiParameter("key", OpenApiTypes.STR,
                        description="one API key's prefix: only its requests (and its tenant's); every key when absent")
_MONTH = OpenApiParameter("month", OpenApiTypes.STR, description="YYYY-MM; takes precedence over from/to")
_FROM = OpenApiParameter("from", OpenApiTypes.DATE, description="first day (UTC); default the first of this month")
_TO = OpenApiParameter("to", OpenApiTypes.DATE, description="last day (UTC), included; default today")
_FILES = {(200, media_type): OpenApiResponse(OpenApiTypes.BINARY, description="the report as the path asks")
          for media_type in CONTENT_TYPES.values()}
_ERRORS = {400: OpenApiResponse(description="a malformed period, or an unknown tenant, tier or key"),
           403: OpenApiResponse(description="not finance or operator staff, or a tenant API key")}


class _Export(APIView):
    permission_classes = [IsAuthenticated, FinanceOrOperator]
    content_negotiation_class = AnyAccept
    report = ""

    def get(self, request, filetype: str):
        if filetype not in CONTENT_TYPES:
            raise NotFound(f"exports come as {' or '.join(sorted(CONTENT_TYPES))}")
        try:
            export = export_for(report=self.report, filetype=filetype, params=request.query_params,
                                tenants=roles.visible_tenants(request.user), today=timezone.now().date())
        except ExportError as exc:
            raise ValidationError({"detail": str(exc)}) from None
        return export_response(export, asgi=request.META.get("wsgi.version") is None)


class ImageCostExport(_Export):
    report = IMAGES

    @extend_schema(
        operation_id="exports_images", tags=["exports"], summary="Per-image cost report",
        description="One row per image sent to an engine: tenant, request, time, tier, resolution before and "
                    "after the policy, image tokens, cache hit, and its cost at the rate then in effect. "
                    "The period is `month`, or `from`/`to`; this month so far when neither is given.",
        parameters=[_FILETYPE, _MONTH, _FROM, _TO, _TENANT, _TIER, _KEY], responses={**_FILES, **_ERRORS},
        auth=[{"cookieAuth": []}])
    def get(self, request, filetype: str):
        return super().get(request, filetype)


class MonthlySummaryExport(_Export):
    report = MONTHLY_SUMMARY

    @extend_schema(
        operation_id="exports_monthly_summary", tags=["exports"], summary="Per-tenant monthly summary",
        description="Per tenant and month: a line per tier and the tenant's total of requests, images, image "
                    "tokens, cached image tokens, text and output tokens, cost and cache savings, from the "
                    "daily rollups. Costs equal the monthly statements exactly. Covers whole months: `month`, "
                    "or the months `from`/`to` touch; this month when neither is given.",
        parameters=[_FILETYPE, _MONTH, _FROM, _TO, _TENANT, _TIER, _KEY], responses={**_FILES, **_ERRORS},
        auth=[{"cookieAuth": []}])
    def get(self, request, filetype: str):
        return super().get(request, filetype)
