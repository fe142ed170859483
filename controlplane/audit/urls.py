"""The audit log page. The dashboard mounts it at the site's root, in its URL namespace
(`dashboard:audit`)."""

from django.urls import path

from controlplane.audit import views

urlpatterns = [
    path("audit/", views.audit_log, name="audit"),
]
