"""The fleet pages: engines, operations and capacity. The dashboard mounts them at the site's
root, in its URL namespace (`dashboard:fleet`, ...)."""

from django.urls import path

from controlplane.fleet.views import capacity, engines, operations

urlpatterns = [
    path("fleet/", engines.fleet, name="fleet"),
    path("fleet/external/", engines.fleet_register_external, name="fleet-external"),
    path("fleet/tiers/<slug:name>/replicas/", engines.fleet_replicas, name="fleet-replicas"),
    path("fleet/<int:pk>/", engines.fleet_instance, name="fleet-instance"),
    path("fleet/<int:pk>/<str:action>/", engines.fleet_action, name="fleet-action"),
    path("operations/", operations.operations, name="operations"),
    path("capacity/", capacity.capacity, name="capacity"),
]
