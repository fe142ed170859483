"""The tenants pages: tenants, API keys, a tenant admin's own account, users. The dashboard
mounts them at the site's root, in its URL namespace (`dashboard:tenants`, ...)."""

from django.urls import path

from controlplane.tenants.views import account, keys, tenants, users

urlpatterns = [
    path("keys/", keys.keys, name="keys"),
    path("keys/<int:pk>/", keys.key_edit, name="key-edit"),
    path("keys/<int:pk>/revoke/", keys.key_revoke, name="key-revoke"),
    path("keys/<int:pk>/rotate/", keys.key_rotate, name="key-rotate"),
    path("account/", account.account, name="account"),
    path("account/keys/<int:pk>/", account.account_key_edit, name="account-key-edit"),
    path("account/keys/<int:pk>/revoke/", account.account_key_revoke, name="account-key-revoke"),
    path("account/keys/<int:pk>/rotate/", account.account_key_rotate, name="account-key-rotate"),
    path("users/", users.user_list, name="users"),
    path("users/<int:pk>/", users.user_edit, name="user-edit"),
    path("tenants/", tenants.tenant_list, name="tenants"),
    path("tenants/new/", tenants.tenant_new, name="tenant-new"),
    path("tenants/<slug:name>/", tenants.tenant_edit, name="tenant-edit"),
]
