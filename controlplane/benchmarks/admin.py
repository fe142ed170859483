from django.contrib import admin
from django.db import models

from controlplane.benchmarks import services
from controlplane.benchmarks.models import (
    BenchmarkImage,
    BenchmarkProfile,
    BenchmarkRun,
    EvalImport,
    EvalSet,
)


class BenchmarkImageInline(admin.TabularInline):
    model = BenchmarkImage
    fields = ["name", "width", "height", "content_type"]
    readonly_fields = fields
    extra = 0


@admin.register(BenchmarkProfile)
class BenchmarkProfileAdmin(admin.ModelAdmin):
    list_display = ["name", "kind", "tier", "target", "arrival", "schedule_enabled", "schedule_cron"]
    inlines = [BenchmarkImageInline]
    formfield_overrides = {models.URLField: {"assume_scheme": "http"}}  # a gateway on the local network

    # Through the services, so that the profile's beat schedule follows what is saved or deleted here.
    def save_model(self, request, obj, form, change):
        services.profile_save(profile=obj)

    def delete_model(self, request, obj):
        services.profile_delete(profile=obj)

    def delete_queryset(self, request, queryset):
        for profile in queryset.select_related("periodic_task"):
            services.profile_delete(profile=profile)


@admin.register(BenchmarkRun)
class BenchmarkRunAdmin(admin.ModelAdmin):
    list_display = ["profile", "label", "state", "trigger", "created_at", "progress"]
    list_filter = ["state", "trigger"]
    readonly_fields = ["config", "results", "log"]


@admin.register(EvalSet)
class EvalSetAdmin(admin.ModelAdmin):
    list_display = ["name", "source", "generator", "seed", "file_name", "created_at"]
    list_filter = ["source"]


@admin.register(EvalImport)
class EvalImportAdmin(admin.ModelAdmin):
    list_display = ["name", "file_name", "state", "rows", "error_count", "created_at"]
    list_filter = ["state"]
    exclude = ["data"]
    readonly_fields = ["errors", "message"]
