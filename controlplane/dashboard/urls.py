from django.urls import path

from controlplane.dashboard import account, audit, exports, statements, tenants, tiers, users, views

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
    path("audit/", audit.audit_log, name="audit"),
    path("users/", users.user_list, name="users"),
    path("users/<int:pk>/", users.user_edit, name="user-edit"),
    path("statements/", statements.statements, name="statements"),
    path("tenants/", tenants.tenant_list, name="tenants"),
    path("tenants/new/", tenants.tenant_new, name="tenant-new"),
    path("tenants/<slug:name>/", tenants.tenant_edit, name="tenant-edit"),
    path("tiers/", tiers.tier_list, name="tiers"),
    path("tiers/new/", tiers.tier_new, name="tier-new"),
    path("tiers/<slug:name>/", tiers.tier_edit, name="tier-edit"),
    path("tiers/<slug:name>/enable/", tiers.tier_enable, {"enabled": True}, name="tier-enable"),
    path("tiers/<slug:name>/disable/", tiers.tier_enable, {"enabled": False}, name="tier-disable"),
    path("policies/", views.policies, name="policies"),
    path("capacity/", views.capacity, name="capacity"),
    path("exports/", exports.exports, name="exports"),
    path("exports/<slug:report>.<str:filetype>", exports.download, name="export"),
]
