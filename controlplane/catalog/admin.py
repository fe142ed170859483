from django.contrib import admin

from controlplane.catalog.models import ModelTier, PricePlan, PriceRate, ResolutionPolicy


class PriceRateInline(admin.TabularInline):
    model = PriceRate
    extra = 0
    readonly_fields = ["created_at", "created_by"]


@admin.register(PricePlan)
class PricePlanAdmin(admin.ModelAdmin):
    list_display = ["name", "currency"]
    inlines = [PriceRateInline]

    def save_formset(self, request, form, formset, change):
        for rate in formset.save(commit=False):
            if rate.pk is None:
                rate.created_by = request.user.get_username()  # who entered the price
            rate.save(actor=request.user.get_username())
        for rate in formset.deleted_objects:
            rate.delete(actor=request.user.get_username())


@admin.register(ResolutionPolicy)
class ResolutionPolicyAdmin(admin.ModelAdmin):
    list_display = ["name", "min_pixels", "max_pixels", "low_detail_max_pixels", "max_images_per_request"]


@admin.register(ModelTier)
class ModelTierAdmin(admin.ModelAdmin):
    list_display = ["name", "kind", "family", "model_id", "engine_kind", "replicas", "enabled"]
    list_filter = ["kind", "engine_kind", "enabled"]
