"""The tenants pages: tenants, API keys, a tenant admin's own account, users, routing rules. The dashboard
mounts them at the site's root, in its URL namespace (`dashboard:tenants`, ...)."""

from django.urls import path

from controlplane.tenants.views import account, keys, rules, tenants, users

urlpatterns = [
    path("keys/", keys.keys, name="keys"),
    path("keys/<int:pk>/", keys.key_edit, name="key-edit"),
    path("keys/<int:pk>/revoke/", keys.key_revoke, name="key-revoke"),
    path("keys/<int:pk>/rotate/", keys.key_rotate, name="key-rotate"),
    path("account/", account.account, name="account"),
    path("account/keys/<int:pk>/", account.account_key_edit, name="account-key-edit"),
    path("account/keys/<int:pk>/revoke/", account.account_key_revoke, name="account-key-revoke"),
    path("account/keys/<int:pk>/rotate/", account.account_key_rotate, name="account-key-rotate"),
    path("account/rules/", rules.account_rules, name="account-rules"),
    path("account/rules/new/", rules.account_rule_new, name="account-rule-new"),
    path("account/rules/<int:pk>/", rules.account_rule_edit, name="account-rule-edit"),
    path("account/rules/<int:pk>/toggle/", rules.account_rule_toggle, name="account-rule-toggle"),
    path("account/rules/<int:pk>/delete/", rules.account_rule_delete, name="account-rule-delete"),
    path("rules/", rules.rules, name="rules"),
    path("rules/new/", rules.rule_new, name="rule-new"),
    path("rules/<int:pk>/", rules.rule_edit, name="rule-edit"),
    path("rules/<int:pk>/toggle/", rules.rule_toggle, name="rule-toggle"),
    path("rules/<int:pk>/delete/", rules.rule_delete, name="rule-delete"),
    path("users/", users.user_list, name="users"),
    path("users/<int:pk>/", users.user_edit, name="user-edit"),
    path("tenants/", tenants.tenant_list, name="tenants"),
    path("tenants/new/", tenants.tenant_new, name="tenant-new"),
    path("tenants/<slug:name>/", tenants.tenant_edit, name="tenant-edit"),
    path("tenants/<slug:name>/rules/", rules.tenant_rules, name="tenant-rules"),
    path("tenants/<slug:name>/rules/new/", rules.tenant_rule_new, name="tenant-rule-new"),
]
