from django.contrib import admin

from controlplane.tenants.models import ApiKey, Membership, Quota, Tenant


class QuotaInline(admin.StackedInline):
    model = Quota
    extra = 0


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "display_name", "active", "created_at"]
    inlines = [QuotaInline]
    filter_horizontal = ["allowed_tiers"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    # Keys are created in the dashboard (shown once there); the admin only views and revokes.
    list_display = ["prefix", "tenant", "name", "created_at", "expires_at", "revoked_at", "last_used_at"]
    list_filter = ["tenant"]
    readonly_fields = ["prefix", "key_hash", "created_at", "created_by", "last_used_at"]

    def has_add_permission(self, request):
        return False


admin.site.register(Membership)
