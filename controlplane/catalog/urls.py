"""The catalog pages: tiers, resolution policies, price plans. The dashboard mounts them at
the site's root, in its URL namespace (`dashboard:tiers`, ...)."""

from django.urls import path

from controlplane.catalog.views import policies, prices, tiers

urlpatterns = [
    path("prices/", prices.plan_list, name="prices"),
    path("prices/<slug:name>/", prices.plan_detail, name="price-plan"),
    path("tiers/", tiers.tier_list, name="tiers"),
    path("tiers/new/", tiers.tier_new, name="tier-new"),
    path("tiers/<slug:name>/", tiers.tier_edit, name="tier-edit"),
    path("tiers/<slug:name>/enable/", tiers.tier_enable, {"enabled": True}, name="tier-enable"),
    path("tiers/<slug:name>/disable/", tiers.tier_enable, {"enabled": False}, name="tier-disable"),
    path("policies/", policies.policies, name="policies"),
    path("policies/new/", policies.policy_new, name="policy-new"),
    path("policies/<slug:name>/", policies.policy_edit, name="policy-edit"),
]
