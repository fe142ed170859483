"""The alerts pages. The dashboard mounts them at the site's root, in its URL namespace
(`dashboard:alerts`, ...)."""

from django.urls import path

from controlplane.alerts import views

urlpatterns = [
    path("alerts/", views.alert_list, name="alerts"),
    path("alerts/rules/new/", views.rule_new, name="alert-rule-new"),
    path("alerts/rules/<int:pk>/", views.rule_edit, name="alert-rule-edit"),
    path("alerts/rules/<int:pk>/enable/", views.rule_enable, {"enabled": True}, name="alert-rule-enable"),
    path("alerts/rules/<int:pk>/disable/", views.rule_enable, {"enabled": False}, name="alert-rule-disable"),
    path("alerts/webhooks/new/", views.webhook_new, name="webhook-new"),
    path("alerts/webhooks/<int:pk>/", views.webhook_edit, name="webhook-edit"),
    path("alerts/webhooks/<int:pk>/enable/", views.webhook_enable, {"enabled": True}, name="webhook-enable"),
    path("alerts/webhooks/<int:pk>/disable/", views.webhook_enable, {"enabled": False}, name="webhook-disable"),
    path("alerts/webhooks/<int:pk>/test/", views.webhook_test, name="webhook-test"),
]
