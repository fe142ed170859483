from django.contrib import admin

from controlplane.benchmarks.models import BenchmarkProfile, BenchmarkRun

admin.site.register(BenchmarkProfile)


@admin.register(BenchmarkRun)
class BenchmarkRunAdmin(admin.ModelAdmin):
    list_display = ["profile", "state", "created_at", "progress"]
