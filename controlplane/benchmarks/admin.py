from django.contrib import admin

from controlplane.benchmarks.models import BenchmarkImage, BenchmarkProfile, BenchmarkRun


class BenchmarkImageInline(admin.TabularInline):
    model = BenchmarkImage
    fields = ["name", "width", "height", "content_type"]
    readonly_fields = fields
    extra = 0


@admin.register(BenchmarkProfile)
class BenchmarkProfileAdmin(admin.ModelAdmin):
    list_display = ["name", "tier", "target", "arrival", "schedule_enabled", "schedule_cron"]
    inlines = [BenchmarkImageInline]


@admin.register(BenchmarkRun)
class BenchmarkRunAdmin(admin.ModelAdmin):
    list_display = ["profile", "label", "state", "trigger", "created_at", "progress"]
    list_filter = ["state", "trigger"]
    readonly_fields = ["config", "results", "log"]
