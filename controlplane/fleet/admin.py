from django.contrib import admin

from controlplane.fleet.models import EngineEvent, EngineInstance, Gpu, Node


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "address", "queue", "vllm_version", "last_seen_at"]
    inlines = [GpuInline]


@admin.register(EngineInstance)
class EngineInstanceAdmin(admin.ModelAdmin):
    list_display = ["__str__", "node", "pool", "desired_state", "actual_state", "healthy", "port", "pid", "restart_count"]
    list_filter = ["actual_state", "tier"]
    readonly_fields = ["pid", "port", "started_at", "last_health_at", "command", "log_path"]


@admin.register(EngineEvent)
class EngineEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "instance", "from_state", "to_state", "reason"]
    list_filter = ["to_state"]
