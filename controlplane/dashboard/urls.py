from django.urls import path

from controlplane.dashboard import exports, views

app_name = "dashboard"
urlpatterns = [
    path("", views.index, name="index"),
    path("keys/", views.keys, name="keys"),
    path("keys/<int:pk>/revoke/", views.key_revoke, name="key-revoke"),
    path("fleet/", views.fleet, name="fleet"),
    path("fleet/external/", views.fleet_register_external, name="fleet-external"),
    path("fleet/<int:pk>/", views.fleet_instance, name="fleet-instance"),
    path("fleet/<int:pk>/<str:action>/", views.fleet_action, name="fleet-action"),
    path("policies/", views.policies, name="policies"),
    path("capacity/", views.capacity, name="capacity"),
    path("exports/", exports.exports, name="exports"),
    path("exports/<slug:report>.<str:filetype>", exports.download, name="export"),
]
