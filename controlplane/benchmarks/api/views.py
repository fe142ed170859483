"""Benchmark profiles and runs for operators (session authentication)."""

from __future__ import annotations

from django.db.models import Count
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, permissions, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from controlplane.benchmarks import services
from controlplane.benchmarks.api.serializers import (
    EvalSetSerializer,
    ProfileSerializer,
    RunDetailSerializer,
    RunSerializer,
    RunStartSerializer,
)
from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun, EvalSet
from controlplane.tenants import roles


class IsOperator(permissions.BasePermission):
    message = "benchmarks are for operators"

    def has_permission(self, request, view):
        return roles.is_operator(request.user)


@extend_schema(tags=["benchmarks"])
class ProfileViewSet(viewsets.ModelViewSet):
    """Benchmark profiles: target, traffic mix, arrival sweep, duration, SLOs and schedule."""

    serializer_class = ProfileSerializer
    permission_classes = [IsOperator]
    queryset = BenchmarkProfile.objects.select_related("periodic_task").order_by("name")

    def perform_create(self, serializer):
        serializer.instance = services.profile_save(profile=BenchmarkProfile(**serializer.validated_data))

    def perform_update(self, serializer):
        profile = serializer.instance
        for name, value in serializer.validated_data.items():
            setattr(profile, name, value)
        services.profile_save(profile=profile)

    def perform_destroy(self, instance):
        services.profile_delete(profile=instance)

    @extend_schema(request=RunStartSerializer, responses={201: RunSerializer})
    @action(detail=True, methods=["post"])
    def run(self, request, pk=None):
        """Start a run of the profile now; it is queued for a worker."""
        start = RunStartSerializer(data=request.data)
        start.is_valid(raise_exception=True)
        run = services.benchmark_start(profile=self.get_object(), label=start.validated_data["label"],
                                       user=request.user)
        return Response(RunSerializer(run).data, status=status.HTTP_201_CREATED)


@extend_schema(tags=["benchmarks"])
@extend_schema_view(list=extend_schema(parameters=[
    OpenApiParameter("profile", int, description="Only the runs of this profile"),
    OpenApiParameter("state", str, enum=[s for s, _ in BenchmarkRun.State.choices]),
]))
class RunViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Benchmark runs, newest first; one run with its log, settings and results."""

    permission_classes = [IsOperator]

    def get_serializer_class(self):
        return RunSerializer if self.action == "list" else RunDetailSerializer

    def get_queryset(self):
        queryset = BenchmarkRun.objects.select_related("profile")
        if profile := self.request.query_params.get("profile"):
            queryset = queryset.filter(profile_id=profile) if profile.isascii() and profile.isdigit() \
                else queryset.none()
        if state := self.request.query_params.get("state"):
            queryset = queryset.filter(state=state) if state in BenchmarkRun.State.values else queryset.none()
        if self.action == "list":
            queryset = queryset.defer("results", "log", "config")
        return queryset.order_by("-created_at", "-id")

    @extend_schema(request=None, responses={202: RunDetailSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        """Cancel: a queued run at once; a running one stops at its next poll, keeping its results."""
        run = self.get_object()
        services.benchmark_cancel(run=run)
        return Response(RunDetailSerializer(run).data, status=status.HTTP_202_ACCEPTED)


@extend_schema(tags=["benchmarks"])
class EvalSetViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Evaluation sets a profile may ask at each pixel cap: where each came from and its items per task type."""

    serializer_class = EvalSetSerializer
    permission_classes = [IsOperator]
    queryset = EvalSet.objects.annotate(item_count=Count("items")).order_by("name")
