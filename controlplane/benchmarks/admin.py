from django.contrib import admin
from django.db import models

from controlplane.benchmarks import services
from controlplane.benchmarks.models import BenchmarkImage, BenchmarkProfile, BenchmarkRun, EvalItem


class BenchmarkImageInline(admin.TabularInline):
    model = BenchmarkImage
    fields = ["name", "width", "height", "content_type"]
    readonly_fields = fields
    extra = 0


class EvalItemInline(admin.TabularInline):
    model = EvalItem
    fields = ["task_type", "question", "expected", "name", "width", "height"]
    readonly_fields = ["name", "width", "height"]
    extra = 0


@admin.register(BenchmarkProfile)
class BenchmarkProfileAdmin(admin.ModelAdmin):
    list_display = ["name", "kind", "tier", "target", "arrival", "schedule_enabled", "schedule_cron"]
    inlines = [BenchmarkImageInline, EvalItemInline]
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
