from django.contrib import admin

from controlplane.metering.models import DailyUsage, UsageEvent, UsageImage


class UsageImageInline(admin.TabularInline):
    model = UsageImage
    extra = 0
    can_delete = False


@admin.register(UsageEvent)
class UsageEventAdmin(admin.ModelAdmin):
    list_display = ["request_id", "created_at", "tenant", "tier", "status", "image_count", "image_tokens", "text_tokens", "output_tokens", "cost"]
    list_filter = ["status", "tier", "tenant"]
    inlines = [UsageImageInline]

    # Usage is the billing record: nobody edits it by hand.
    def has_change_permission(self, request, obj=None):
        return False

    def has_add_permission(self, request):
        return False


@admin.register(DailyUsage)
class DailyUsageAdmin(admin.ModelAdmin):
    list_display = ["day", "tenant", "tier", "requests", "images", "image_tokens", "output_tokens", "cost"]
    list_filter = ["tier", "tenant"]
