"""The product pages' URLs: the home page and the playground, and every app's pages."""

from django.urls import include, path

from controlplane.dashboard import playground, views

# The pages of each app are the app's own (its urls.py); they are mounted here, in one URL
# namespace, so that every page keeps its path and its name (`dashboard:tiers`, ...).
app_name = "dashboard"
urlpatterns = [
    path("", views.index, name="index"),
    path("usage/", views.usage, name="usage"),
    path("playground/", playground.playground, name="playground"),
    path("playground/key/", playground.playground_key, name="playground-key"),
    path("", include("controlplane.alerts.urls")),
    path("", include("controlplane.audit.urls")),
    path("", include("controlplane.catalog.urls")),
    path("", include("controlplane.fleet.urls")),
    path("", include("controlplane.metering.urls")),
    path("", include("controlplane.tenants.urls")),
]
