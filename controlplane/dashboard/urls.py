from django.urls import include, path

from controlplane.dashboard import (
    playground,
    policy_pages,
    prices,
    tiers,
    views,
)

# The pages of each app are the app's own (its urls.py); they are mounted here, in one URL
# namespace, so that every page keeps its path and its name (`dashboard:tiers`, ...).
app_name = "dashboard"
urlpatterns = [
    path("", views.index, name="index"),
    path("prices/", prices.plan_list, name="prices"),
    path("prices/<slug:name>/", prices.plan_detail, name="price-plan"),
    path("playground/", playground.playground, name="playground"),
    path("tiers/", tiers.tier_list, name="tiers"),
    path("tiers/new/", tiers.tier_new, name="tier-new"),
    path("tiers/<slug:name>/", tiers.tier_edit, name="tier-edit"),
    path("tiers/<slug:name>/enable/", tiers.tier_enable, {"enabled": True}, name="tier-enable"),
    path("tiers/<slug:name>/disable/", tiers.tier_enable, {"enabled": False}, name="tier-disable"),
    path("policies/", views.policies, name="policies"),
    path("policies/new/", policy_pages.policy_new, name="policy-new"),
    path("policies/<slug:name>/", policy_pages.policy_edit, name="policy-edit"),
    path("", include("controlplane.alerts.urls")),
    path("", include("controlplane.audit.urls")),
    path("", include("controlplane.fleet.urls")),
    path("", include("controlplane.metering.urls")),
    path("", include("controlplane.tenants.urls")),
]
