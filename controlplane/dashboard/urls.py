from django.urls import include, path

from controlplane.dashboard import (
    account,
    operations,
    playground,
    policy_pages,
    prices,
    tenants,
    tiers,
    users,
    views,
)

# The pages of each app are the app's own (its urls.py); they are mounted here, in one URL
# namespace, so that every page keeps its path and its name (`dashboard:tiers`, ...).
app_name = "dashboard"
urlpatterns = [
    path("", views.index, name="index"),
    path("keys/", views.keys, name="keys"),
    path("keys/<int:pk>/revoke/", views.key_revoke, name="key-revoke"),
    path("fleet/", views.fleet, name="fleet"),
    path("fleet/external/", views.fleet_register_external, name="fleet-external"),
    path("fleet/tiers/<slug:name>/replicas/", views.fleet_replicas, name="fleet-replicas"),
    path("fleet/<int:pk>/", views.fleet_instance, name="fleet-instance"),
    path("fleet/<int:pk>/<str:action>/", views.fleet_action, name="fleet-action"),
    path("account/", account.account, name="account"),
    path("account/keys/<int:pk>/revoke/", account.account_key_revoke, name="account-key-revoke"),
    path("prices/", prices.plan_list, name="prices"),
    path("prices/<slug:name>/", prices.plan_detail, name="price-plan"),
    path("users/", users.user_list, name="users"),
    path("users/<int:pk>/", users.user_edit, name="user-edit"),
    path("operations/", operations.operations, name="operations"),
    path("playground/", playground.playground, name="playground"),
    path("tenants/", tenants.tenant_list, name="tenants"),
    path("tenants/new/", tenants.tenant_new, name="tenant-new"),
    path("tenants/<slug:name>/", tenants.tenant_edit, name="tenant-edit"),
    path("tiers/", tiers.tier_list, name="tiers"),
    path("tiers/new/", tiers.tier_new, name="tier-new"),
    path("tiers/<slug:name>/", tiers.tier_edit, name="tier-edit"),
    path("tiers/<slug:name>/enable/", tiers.tier_enable, {"enabled": True}, name="tier-enable"),
    path("tiers/<slug:name>/disable/", tiers.tier_enable, {"enabled": False}, name="tier-disable"),
    path("policies/", views.policies, name="policies"),
    path("policies/new/", policy_pages.policy_new, name="policy-new"),
    path("policies/<slug:name>/", policy_pages.policy_edit, name="policy-edit"),
    path("capacity/", views.capacity, name="capacity"),
    path("", include("controlplane.alerts.urls")),
    path("", include("controlplane.audit.urls")),
    path("", include("controlplane.metering.urls")),
]
